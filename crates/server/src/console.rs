//! The operator console: one self-contained page (`GET /console`, its
//! script and style embedded in the binary, no external fetch: the page's
//! Content-Security-Policy forbids any) and the snapshot it polls at
//! 2 Hz (`GET /console/snapshot`): every node's pool as a grid of pages
//! coloured by state and tenant, each tenant's load and share, every
//! safety counter with a minute of history, the transfers in flight.
//!
//! **Who may open it.** The operator alone: with a tenants file, the
//! `[operator]` key (`Authorization: Bearer KEY`, or Basic credentials with
//! the key as password — what a browser's own prompt sends); a tenant's key
//! gets 403, no key 401 with a Basic challenge. Without a tenants file the
//! server has no keys at all and the console is as open as `/metrics`.
//!
//! **What it shows.** Counts, states, epochs, request numbers and tenant
//! names; never a prompt, a token id, a key or a cache scope's value
//! (scopes become the tenant or group they belong to, or "salted"). The
//! snapshot is built from [`request::console::NodeView`]s, which carry
//! nothing else, and from the tenants' counters.
//!
//! **What it costs.** A node's map is taken by the thread that owns its
//! pool after a step, O(pages) over metadata (~20 µs at the default pool);
//! the snapshot reports the time each took (`snapshot_us_max`). The grid is
//! at most [`request::console::GRID_CELLS_MAX`] cells.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use request::console::{NodeView, PageState, TransferView, GRID_CELLS_MAX};
use serde::Serialize;

use crate::error::ApiError;
use crate::state::{unix_now, AppState};

const PAGE_HTML: &str = include_str!("../console/index.html");
const PAGE_JS: &str = include_str!("../console/console.js");
const PAGE_CSS: &str = include_str!("../console/console.css");

/// Samples of history kept (one per ≥ [`SAMPLE_SPACING_MS`] of polling):
/// about a minute at the page's 2 Hz.
const HISTORY_MAX: usize = 120;
const SAMPLE_SPACING_MS: u64 = 450;
/// Tokens per second are measured over this window.
const RATE_WINDOW_MS: u64 = 5_000;

/// The policy every console response carries: nothing but this origin,
/// no frames, no forms, no referrer.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
                   connect-src 'self'; img-src 'self' data:; base-uri 'none'; \
                   form-action 'none'; frame-ancestors 'none'";

/// The console's memory: a short history of counters (shared by every
/// viewer; bounded).
#[derive(Debug)]
pub(crate) struct ConsoleState {
    start: Instant,
    history: Mutex<VecDeque<Sample>>,
}

#[derive(Debug)]
struct Sample {
    t_ms: u64,
    /// `node/counter` → value.
    safety: HashMap<String, u64>,
    /// Tokens generated so far, by tenant (the tenants file's order).
    tokens: Vec<u64>,
}

impl Default for ConsoleState {
    fn default() -> Self {
        ConsoleState {
            start: Instant::now(),
            history: Mutex::new(VecDeque::with_capacity(HISTORY_MAX)),
        }
    }
}

/// Who is asking: `Ok(())` for the operator, else the refusal.
fn check_operator(st: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let auth = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    match st.tenants.operator(auth) {
        Ok(true) => Ok(()),
        Ok(false) => Err(ApiError::forbidden(
            "the console is the operator's: add an [operator] section with its api_key_sha256 \
             to the tenants file",
        )),
        Err(why) => {
            // A tenant's own key opens its API, never the console.
            if st.tenants.tenant_of_credentials(auth).is_ok() {
                Err(ApiError::forbidden(
                    "the console is the operator's: a tenant's key does not open it",
                ))
            } else {
                Err(ApiError::from(why))
            }
        }
    }
}

fn refuse(st: &AppState, e: ApiError) -> Response {
    st.metrics.rejection(e.reason);
    let unauthorized = e.status == StatusCode::UNAUTHORIZED;
    let mut r = e.into_response();
    if unauthorized {
        // Lets a browser ask for the operator key itself.
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Basic realm=\"isoserve console\", charset=\"UTF-8\""),
        );
    }
    r
}

fn asset(body: &'static str, ctype: &'static str) -> Response {
    let mut r = (StatusCode::OK, body).into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ctype));
    secure(h);
    r
}

fn secure(h: &mut HeaderMap) {
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
}

/// The console's routes: the page, its script and style, and the snapshot
/// it polls — on the API port and the operations listener alike, the
/// operator's key on both.
pub(crate) fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/console", get(page))
        .route("/console/", get(page))
        .route("/console/console.js", get(script))
        .route("/console/console.css", get(style))
        .route("/console/snapshot", get(snapshot_route))
}

pub(crate) async fn page(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    match check_operator(&st, &headers) {
        Ok(()) => asset(PAGE_HTML, "text/html; charset=utf-8"),
        Err(e) => refuse(&st, e),
    }
}

pub(crate) async fn script(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    match check_operator(&st, &headers) {
        Ok(()) => asset(PAGE_JS, "text/javascript; charset=utf-8"),
        Err(e) => refuse(&st, e),
    }
}

pub(crate) async fn style(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    match check_operator(&st, &headers) {
        Ok(()) => asset(PAGE_CSS, "text/css; charset=utf-8"),
        Err(e) => refuse(&st, e),
    }
}

pub(crate) async fn snapshot_route(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
) -> Response {
    if let Err(e) = check_operator(&st, &headers) {
        return refuse(&st, e);
    }
    // Asking the nodes blocks (a fresh map, a gateway's fetches): off the
    // async threads.
    let backend = st.engine.clone();
    let nodes = match tokio::task::spawn_blocking(move || backend.console_nodes()).await {
        Ok(n) => n,
        Err(e) => {
            return refuse(
                &st,
                ApiError::internal(format!("console snapshot task: {e}")),
            )
        }
    };
    let snap = build(&st, nodes);
    let mut r = axum::Json(snap).into_response();
    secure(r.headers_mut());
    r
}

// ---- the snapshot ----------------------------------------------------------

/// Everything the page draws, in one JSON document.
#[derive(Debug, Serialize)]
pub(crate) struct Snapshot {
    pub t_ms: u64,
    pub model: String,
    pub uptime_s: u64,
    /// `unified` (one engine) or `disaggregated` (a gateway and its nodes).
    pub mode: &'static str,
    /// Tenants and cache groups: a grid cell's `label` indexes this.
    pub labels: Vec<Label>,
    pub tenants: Vec<TenantRow>,
    pub nodes: Vec<NodeOut>,
    pub safety: Vec<SafetyRow>,
    /// Times of the history's samples, oldest first (ms since start).
    pub history_t_ms: Vec<u64>,
    /// The longest any node's pool map took its owner (µs).
    pub snapshot_us_max: f64,
}

#[derive(Debug, Serialize)]
pub(crate) struct Label {
    pub name: String,
    /// `tenant`, `group` (a cache group's scope), `salted` (a scope a
    /// request's salt narrowed: its owner is not recorded), `unknown`.
    pub kind: &'static str,
}

#[derive(Debug, Serialize)]
pub(crate) struct TenantRow {
    pub name: String,
    pub label: usize,
    pub weight: u32,
    /// Requests admitted by the HTTP layer and not yet done.
    pub in_flight: usize,
    /// From the engine, where it reports tenants (the unified engine):
    /// running, waiting and preempted requests. `None` otherwise.
    pub running: Option<usize>,
    pub queued: Option<usize>,
    pub preempted: Option<usize>,
    pub tokens_generated: u64,
    pub tokens_per_s: f64,
    /// Its share of the tokens generated per second now, and what its
    /// weight entitles it to among the tenants active now (K13).
    pub share: f64,
    pub weight_share: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Cached over prompt tokens of its finished requests (K11).
    pub cache_hit_rate: f64,
    pub finished: u64,
    pub refused: u64,
    /// Pages it holds now over every node (private, leased or pending).
    pub pages: u64,
}

#[derive(Debug, Serialize)]
pub(crate) struct NodeOut {
    pub name: String,
    pub role: String,
    pub pages_total: u64,
    pub pages_per_cell: u32,
    pub page_size_tokens: u32,
    /// One letter per cell ([`PageState::code`]).
    pub state: String,
    pub epoch: Vec<u64>,
    /// Index into [`Snapshot::labels`], or -1 (free pages).
    pub label: Vec<i32>,
    /// The owning request's id on its node (decimal: PD ids are 64-bit,
    /// beyond a JavaScript number's integers), or null.
    pub request: Vec<Option<String>>,
    pub written: Vec<u16>,
    pub counts: request::console::StateCounts,
    pub transfers: Vec<TransferOut>,
    pub snapshot_us_last: f64,
    pub snapshot_us_max: f64,
    pub map_age_ms: f64,
}

#[derive(Debug, Serialize)]
pub(crate) struct TransferOut {
    /// Decimal, as a cell's `request`.
    pub request: String,
    pub tenant: String,
    pub from: String,
    pub to: String,
    pub pages_done: u32,
    pub pages_total: u32,
    pub phase: String,
}

#[derive(Debug, Serialize)]
pub(crate) struct SafetyRow {
    pub node: String,
    pub name: String,
    pub value: u64,
    /// Its values at [`Snapshot::history_t_ms`] (missing samples: 0).
    pub history: Vec<u64>,
    /// It moved within the history.
    pub moved: bool,
}

/// Turns owners into labels: tenant ids and cache scopes to names.
struct Labels {
    labels: Vec<Label>,
    by_tenant: HashMap<u64, usize>,
    by_scope: HashMap<u64, usize>,
    salted: Option<usize>,
    unknown: Option<usize>,
}

impl Labels {
    fn new(st: &AppState) -> Labels {
        let mut l = Labels {
            labels: Vec::new(),
            by_tenant: HashMap::new(),
            by_scope: HashMap::new(),
            salted: None,
            unknown: None,
        };
        let mut groups: HashMap<String, usize> = HashMap::new();
        for t in st.tenants.iter() {
            let at = l.labels.len();
            l.labels.push(Label {
                name: t.name.clone(),
                kind: "tenant",
            });
            l.by_tenant.insert(t.id.0, at);
            l.by_scope.insert(request::Scope::tenant(t.id).0, at);
            if let Some(g) = &t.cache_group {
                let gi = *groups.entry(g.clone()).or_insert_with(|| {
                    l.labels.push(Label {
                        name: format!("group {g}"),
                        kind: "group",
                    });
                    l.labels.len() - 1
                });
                if let Some(scope) = st.tenants.cache_scope(t, None) {
                    l.by_scope.insert(scope.0, gi);
                }
            }
        }
        l
    }

    fn extra(&mut self, which: bool) -> usize {
        let (slot, name, kind) = if which {
            (&mut self.salted, "salted scope", "salted")
        } else {
            (&mut self.unknown, "unknown", "unknown")
        };
        *slot.get_or_insert_with(|| {
            self.labels.push(Label {
                name: name.into(),
                kind,
            });
            self.labels.len() - 1
        })
    }

    fn of_cell(&mut self, state: char, who: u64) -> i32 {
        if who == u64::MAX {
            return -1;
        }
        if state == PageState::Cached.code() {
            if let Some(&i) = self.by_scope.get(&who) {
                return i as i32;
            }
            // A derived scope no group has: a request's salt made it.
            let derived = who & (1 << 63) != 0;
            return self.extra(derived) as i32;
        }
        match self.by_tenant.get(&who) {
            Some(&i) => i as i32,
            None => self.extra(false) as i32,
        }
    }

    fn of_tenant(&mut self, id: u64) -> String {
        match self.by_tenant.get(&id) {
            Some(&i) => self.labels[i].name.clone(),
            None => "unknown".into(),
        }
    }
}

/// A grid whose columns agree: a node's view crossed a socket, so a cell
/// the page would index must exist in every column, and a state is one of
/// the known letters (anything else shows as free). Truncates to the
/// shortest column and to [`GRID_CELLS_MAX`] cells.
fn consistent(mut g: request::console::PoolGrid) -> request::console::PoolGrid {
    let state: String = g
        .state
        .chars()
        .map(|c| PageState::from_code(c).unwrap_or(PageState::Free).code())
        .collect();
    let n = [
        state.len(),
        g.epoch.len(),
        g.who.len(),
        g.request.len(),
        g.written.len(),
    ]
    .into_iter()
    .min()
    .unwrap_or(0)
    .min(GRID_CELLS_MAX);
    g.state = state[..n].to_string();
    g.epoch.truncate(n);
    g.who.truncate(n);
    g.request.truncate(n);
    g.written.truncate(n);
    g
}

pub(crate) fn build(st: &AppState, nodes: Vec<NodeView>) -> Snapshot {
    let now_ms = st.console.start.elapsed().as_millis() as u64;
    let mut labels = Labels::new(st);
    let tenants: Vec<_> = st.tenants.iter().cloned().collect();
    let mut pages_of: HashMap<u64, u64> = HashMap::new();
    let mut out_nodes = Vec::with_capacity(nodes.len());
    let mut us_max: f64 = 0.0;
    let mut safety_now: Vec<(String, String, u64)> = Vec::new();
    for n in nodes {
        for c in &n.safety {
            safety_now.push((n.name.clone(), c.name.clone(), c.value));
        }
        for h in &n.held {
            *pages_of.entry(h.tenant).or_default() += h.pages;
        }
        let g = consistent(n.grid);
        let label: Vec<i32> = g
            .state
            .chars()
            .zip(&g.who)
            .map(|(s, &w)| labels.of_cell(s, w))
            .collect();
        us_max = us_max.max(n.snapshot_us_max);
        out_nodes.push(NodeOut {
            name: n.name,
            role: n.role,
            pages_total: g.pages_total,
            pages_per_cell: g.pages_per_cell,
            page_size_tokens: g.page_size_tokens,
            request: g
                .request
                .iter()
                .map(|&r| (r != u64::MAX).then(|| r.to_string()))
                .collect(),
            state: g.state,
            epoch: g.epoch,
            label,
            written: g.written,
            counts: n.counts,
            transfers: n
                .transfers
                .into_iter()
                .map(|t: TransferView| TransferOut {
                    request: t.request.to_string(),
                    tenant: labels.of_tenant(t.tenant),
                    from: t.from,
                    to: t.to,
                    pages_done: t.pages_done,
                    pages_total: t.pages_total,
                    phase: t.phase,
                })
                .collect(),
            snapshot_us_last: n.snapshot_us_last,
            snapshot_us_max: n.snapshot_us_max,
            map_age_ms: n.map_age_ms,
        });
    }
    let tokens_now: Vec<u64> = tenants
        .iter()
        .map(|t| t.activity.tokens_generated.load(Ordering::Relaxed))
        .collect();

    // History: record this poll (spaced, bounded), then read the rows and
    // rates from it under the lock (only console polls take it).
    let (safety, rates, history_t_ms) = {
        let mut h = st.console.history.lock().unwrap_or_else(|e| e.into_inner());
        let due = h
            .back()
            .is_none_or(|s| now_ms >= s.t_ms + SAMPLE_SPACING_MS);
        let keys: Vec<String> = safety_now
            .iter()
            .map(|(n, c, _)| format!("{n}/{c}"))
            .collect();
        if due {
            if h.len() == HISTORY_MAX {
                h.pop_front();
            }
            h.push_back(Sample {
                t_ms: now_ms,
                safety: keys
                    .iter()
                    .zip(&safety_now)
                    .map(|(k, (_, _, v))| (k.clone(), *v))
                    .collect(),
                tokens: tokens_now.clone(),
            });
        }
        let safety: Vec<SafetyRow> = safety_now
            .into_iter()
            .zip(&keys)
            .map(|((node, name, value), key)| {
                let hist: Vec<u64> = h
                    .iter()
                    .map(|s| s.safety.get(key).copied().unwrap_or(0))
                    .collect();
                let moved = hist.first().is_some_and(|&first| first != value);
                SafetyRow {
                    node,
                    name,
                    value,
                    history: hist,
                    moved,
                }
            })
            .collect();
        // Rates over the last RATE_WINDOW_MS of history.
        let base = h
            .iter()
            .find(|s| now_ms.saturating_sub(s.t_ms) <= RATE_WINDOW_MS && s.t_ms < now_ms);
        let rates: Vec<f64> = tokens_now
            .iter()
            .enumerate()
            .map(|(i, &now)| match base {
                Some(b) => {
                    let dt = (now_ms - b.t_ms) as f64 / 1e3;
                    let then = b.tokens.get(i).copied().unwrap_or(0);
                    now.saturating_sub(then) as f64 / dt
                }
                None => 0.0,
            })
            .collect();
        (
            safety,
            rates,
            h.iter().map(|s| s.t_ms).collect::<Vec<u64>>(),
        )
    };
    let total_rate: f64 = rates.iter().sum();
    let stats = st.engine.stats();
    let engine_tenants = !stats.tenants.is_empty() || st.engine.kv_capacity_tokens().is_some();
    let rows: Vec<TenantRow> = tenants
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let load = stats.tenants.iter().find(|l| l.tenant == t.id);
            let a = &t.activity;
            let done = st.metrics.tenant_totals(&t.name);
            let (prompt, cached) = (done.prompt_tokens, done.cached_tokens);
            TenantRow {
                name: t.name.clone(),
                label: labels.by_tenant[&t.id.0],
                weight: t.weight,
                in_flight: t.running(),
                running: engine_tenants.then(|| load.map_or(0, |l| l.running)),
                queued: engine_tenants.then(|| load.map_or(0, |l| l.waiting)),
                preempted: engine_tenants.then(|| load.map_or(0, |l| l.preempted)),
                tokens_generated: tokens_now[i],
                tokens_per_s: rates[i],
                share: if total_rate > 0.0 {
                    rates[i] / total_rate
                } else {
                    0.0
                },
                weight_share: 0.0,
                prompt_tokens: prompt,
                cached_tokens: cached,
                cache_hit_rate: if prompt > 0 {
                    cached as f64 / prompt as f64
                } else {
                    0.0
                },
                finished: done.finished,
                refused: a.refused.load(Ordering::Relaxed),
                pages: pages_of.get(&t.id.0).copied().unwrap_or(0),
            }
        })
        .collect();
    // A tenant is active when it has requests in flight or produced tokens
    // in the window: the weights of the active ones divide the engine.
    let active = |r: &TenantRow| r.in_flight > 0 || r.tokens_per_s > 0.0;
    let weights: f64 = rows
        .iter()
        .filter(|r| active(r))
        .map(|r| f64::from(r.weight))
        .sum();
    let rows = rows
        .into_iter()
        .map(|mut r| {
            if active(&r) && weights > 0.0 {
                r.weight_share = f64::from(r.weight) / weights;
            }
            r
        })
        .collect();
    Snapshot {
        t_ms: unix_now() * 1000,
        model: st.cfg.model_id.clone(),
        uptime_s: unix_now().saturating_sub(st.started),
        mode: if st.engine.kv_capacity_tokens().is_some() {
            "unified"
        } else {
            "disaggregated"
        },
        labels: labels.labels,
        tenants: rows,
        nodes: out_nodes,
        safety,
        history_t_ms,
        snapshot_us_max: us_max,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nodes_grid_with_ragged_columns_or_strange_states_is_made_consistent() {
        let g = request::console::PoolGrid {
            pages_total: 5,
            pages_per_cell: 1,
            page_size_tokens: 16,
            state: "o?\u{e9}cl".into(),
            epoch: vec![1, 2, 3, 4, 5],
            who: vec![7, 7, 7],
            request: vec![1, 2, 3, 4],
            written: vec![3, 3, 3, 3, 3],
        };
        let c = consistent(g);
        assert_eq!(c.state, "o..");
        assert_eq!(
            (c.epoch.len(), c.who.len(), c.request.len(), c.written.len()),
            (3, 3, 3, 3)
        );
    }
}
