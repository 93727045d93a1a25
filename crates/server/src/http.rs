//! Routes and handlers: admission, non-streaming and streaming responses,
//! and the per-request accounting (metrics and request log).

use std::collections::hash_map::RandomState;
use std::convert::Infallible;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use request::SamplingParams;
use request::{DoneEvent, Event, GenRequest, RequestHandle, TokenEvent};
use serde::Serialize;
use serde_json::{json, Map, Value};
use tokenizer::ChatMessage;

use crate::api::{
    self, ChatChoice, ChatChunk, ChatChunkChoice, ChatCompletion, ChatLogprobs, ChatMessageOut,
    Completion, CompletionChoice, CompletionLogprobs, Delta, Endpoint, GenParams, Input, ModelCard,
    ModelList, TokenLogprob, TopLogprob, Usage,
};
use crate::error::ApiError;
use crate::reqlog::{rfc3339, LogRecord};
use crate::tenants::TenantPermit;
use crate::{unix_now, AppState, InflightGuard};

/// Bodies declared or found larger than the limit are still read (and
/// discarded) up to this size, so the client finishes sending and sees the
/// 413 instead of a connection reset.
const DRAIN_MAX: usize = 64 << 20;

pub(crate) fn router(st: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model_by_id))
        .route("/tokenize", post(tokenize_route))
        .route("/health", get(health))
        .route("/metrics", get(metrics_api))
        .merge(console_routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(st)
}

/// The operator console (`crate::console`): the page, its script and
/// style, and the snapshot it polls — on the API port and the operations
/// listener alike, the operator's key on both.
fn console_routes() -> Router<Arc<AppState>> {
    use crate::console;
    Router::new()
        .route("/console", get(console::page))
        .route("/console/", get(console::page))
        .route("/console/console.js", get(console::script))
        .route("/console/console.css", get(console::style))
        .route("/console/snapshot", get(console::snapshot_route))
}

/// The overflow lane's routes (see [`crate::door`]): `/health` as usual,
/// anything else the connection limit's error.
pub(crate) fn overflow_router(st: Arc<AppState>, why: crate::door::Overflow) -> Router {
    use crate::door::Overflow;
    let refuse = move |State(st): State<Arc<AppState>>| async move {
        let e = match why {
            Overflow::Client { limit } => ApiError::client_connections(limit),
            Overflow::Server { limit } => ApiError::server_connections(limit),
        };
        st.metrics.rejection(e.reason);
        e.into_response()
    };
    Router::new()
        .route("/health", get(health))
        .fallback(refuse)
        .with_state(st)
}

async fn not_found(State(st): State<Arc<AppState>>, method: Method, uri: Uri) -> Response {
    let e = ApiError::route_not_found(method.as_str(), uri.path());
    st.metrics.rejection(e.reason);
    e.into_response()
}

async fn method_not_allowed(State(st): State<Arc<AppState>>, method: Method, uri: Uri) -> Response {
    let e = ApiError::method_not_allowed(method.as_str(), uri.path());
    st.metrics.rejection(e.reason);
    e.into_response()
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.is_shutting_down() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "shutting_down"})),
        )
            .into_response()
    } else if !st.engine.ready() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "unavailable"})),
        )
            .into_response()
    } else {
        Json(serde_json::json!({"status": "ok"})).into_response()
    }
}

/// `GET /metrics` on the API port: with a tenants file, the operator's key
/// only (what every tenant does is not a tenant's business).
async fn metrics_api(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let auth = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    let refusal = match st.tenants.operator(auth) {
        Ok(true) => return metrics(State(st)).await,
        Ok(false) => ApiError::forbidden(
            "/metrics on the API port needs the operator's key: add an [operator] section with \
             its api_key_sha256 to the tenants file, or serve metrics on --metrics-port",
        ),
        Err(why) => ApiError::unauthorized(why),
    };
    st.metrics.rejection(refusal.reason);
    refusal.into_response()
}

/// The operations listener's routes (`--metrics-port`): `/metrics` and
/// `/health`, no key (bind it where only operators reach).
pub(crate) fn ops_router(st: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(console_routes())
        .fallback(not_found)
        .with_state(st)
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.set_inflight(st.inflight());
    // A backend may ask its nodes (bounded, loopback): off the async threads.
    let backend = st.engine.clone();
    let mut samples = tokio::task::spawn_blocking(move || backend.metric_samples())
        .await
        .unwrap_or_default();
    let stats = st.engine.stats();
    // Each active tenant's requests in the engine, under its name (K13).
    for t in &stats.tenants {
        let name = st
            .tenants
            .name_of(t.tenant)
            .unwrap_or("unknown")
            .to_string();
        for (state, n) in [
            ("running", t.running),
            ("waiting", t.waiting),
            ("preempted", t.preempted),
        ] {
            samples.push(
                request::MetricSample::gauge(
                    "isoserve_tenant_requests",
                    "Requests of an active tenant in the engine, by state (K13)",
                    n as f64,
                )
                .label("tenant", name.clone())
                .label("state", state),
            );
        }
        samples.push(
            request::MetricSample::gauge(
                "isoserve_tenant_weight",
                "An active tenant's fair-share weight (its share of the engine when others \
                 are busy: weight over the active tenants' sum)",
                f64::from(t.weight),
            )
            .label("tenant", name.clone()),
        );
        samples.push(
            request::MetricSample::gauge(
                "isoserve_tenant_service",
                "Rows computed for an active tenant per unit of weight since it became active \
                 (the virtual token counter admission serves lowest first)",
                t.service,
            )
            .label("tenant", name),
        );
    }
    let text = st.metrics.render(stats, samples);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
        )],
        text,
    )
        .into_response()
}

fn model_card(st: &AppState) -> ModelCard {
    ModelCard {
        id: st.cfg.model_id.clone(),
        object: "model".into(),
        created: st.started,
        owned_by: "isoserve".into(),
        max_model_len: st.max_request(),
        context_length: st.max_request(),
    }
}

/// Under `--tenants`, `/v1/models` wants a valid key like every `/v1`
/// route (what is served is not public).
fn check_key(st: &AppState, headers: &HeaderMap) -> Result<(), Box<Response>> {
    let auth = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    st.tenants.authenticate(auth).map(|_| ()).map_err(|why| {
        let e = ApiError::unauthorized(why);
        st.metrics.rejection(e.reason);
        Box::new(e.into_response())
    })
}

async fn models(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(r) = check_key(&st, &headers) {
        return *r;
    }
    Json(ModelList {
        object: "list".into(),
        data: vec![model_card(&st)],
    })
    .into_response()
}

async fn model_by_id(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Err(r) = check_key(&st, &headers) {
        return *r;
    }
    if st.cfg.serves_model(&id) {
        Json(model_card(&st)).into_response()
    } else {
        let e = ApiError::model_not_found(&id);
        st.metrics.rejection(e.reason);
        e.into_response()
    }
}

async fn chat(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    generate(st, Endpoint::Chat, headers, body).await
}

async fn completions(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    generate(st, Endpoint::Completions, headers, body).await
}

async fn responses(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    generate(st, Endpoint::Responses, headers, body).await
}

/// `POST /tokenize`: the prompt's token ids exactly as a generation request
/// would send them to the engine (the same encoder, BOS included), for a
/// tenant's key. Nothing reaches the engine or the pool.
async fn tokenize_route(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = async {
        let auth = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
        st.tenants
            .authenticate(auth)
            .map_err(ApiError::unauthorized)?;
        let bytes = read_body(body, &headers, st.cfg.max_body_bytes, st.cfg.body_timeout).await?;
        let input = api::parse_tokenize(&bytes)?;
        let (ids, _) = tokenize(&st, &input, "messages")?;
        Ok::<_, ApiError>(serde_json::json!({
            "count": ids.len(),
            "max_model_len": st.max_request(),
            "tokens": ids,
        }))
    }
    .await;
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => {
            st.metrics.rejection(e.reason);
            e.into_response()
        }
    }
}

// ---- ids, randomness -------------------------------------------------------

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh random 64-bit value (std's randomly keyed SipHash over a counter
/// and the clock; good enough for ids and default seeds, not for secrets).
fn random_u64() -> u64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.write_u128(nanos);
    h.finish()
}

fn request_id(ep: Endpoint) -> String {
    // OpenAI's prefixes: `chatcmpl-`, `cmpl-`, and `resp_` for responses.
    let prefix = match ep {
        Endpoint::Chat => "chatcmpl-",
        Endpoint::Completions => "cmpl-",
        Endpoint::Responses => "resp_",
    };
    format!("{prefix}{:016x}{:08x}", random_u64(), random_u64() as u32)
}

// ---- accounting ------------------------------------------------------------

/// Accounts for one generation request: metrics and the request log, once,
/// whatever way it ends. Dropped without an explicit end (the client went
/// away) it records `cancelled`.
struct Tracker {
    st: Arc<AppState>,
    rec: LogRecord,
    start: Instant,
    first_token: Option<Instant>,
    /// Each choice's last token (inter-token gaps are per choice).
    last_token: Vec<Option<Instant>>,
    done: bool,
    /// The engine's count of pages allocated to each choice, once admitted.
    pages: Vec<Arc<std::sync::atomic::AtomicU64>>,
    /// The tenant, once authenticated (its console counters).
    tenant: Option<Arc<crate::tenants::Tenant>>,
}

impl Tracker {
    fn new(st: &Arc<AppState>, ep: Endpoint, id: &str) -> Tracker {
        Tracker {
            st: st.clone(),
            rec: LogRecord {
                id: id.to_string(),
                endpoint: ep.as_str(),
                ..LogRecord::default()
            },
            start: Instant::now(),
            first_token: None,
            last_token: Vec::new(),
            done: false,
            pages: Vec::new(),
            tenant: None,
        }
    }

    /// A token of choice `choice` (0 when `n` is 1).
    fn token(&mut self, choice: usize) {
        let now = Instant::now();
        if self.first_token.is_none() {
            self.first_token = Some(now);
            self.st
                .metrics
                .ttft
                .observe((now - self.start).as_secs_f64());
        }
        if self.last_token.len() <= choice {
            self.last_token.resize(choice + 1, None);
        }
        if let Some(prev) = self.last_token[choice] {
            self.st
                .metrics
                .inter_token
                .observe((now - prev).as_secs_f64());
        }
        self.last_token[choice] = Some(now);
        self.rec.output_tokens += 1;
        if let Some(t) = &self.tenant {
            t.activity.tokens_generated.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn write(&mut self, outcome: &'static str) {
        // Milliseconds with microsecond resolution.
        let ms = |d: Duration| (d.as_secs_f64() * 1e6).round() / 1e3;
        self.done = true;
        self.rec.outcome = outcome;
        self.rec.total_ms = ms(self.start.elapsed());
        self.rec.ttft_ms = self.first_token.map(|t| ms(t - self.start));
        self.rec.queue_ms = self.rec.queue_ms.map(|q| (q * 1e3).round() / 1e3);
        self.rec.ts = rfc3339(SystemTime::now());
        if self.rec.pages.is_none() {
            // Refused before admission: nothing was allocated.
            self.rec.pages = self.pages.iter().try_fold(0usize, |sum, cell| {
                match cell.load(std::sync::atomic::Ordering::Acquire) {
                    request::PAGES_UNKNOWN => None,
                    n => Some(sum + n as usize),
                }
            });
        }
        self.rec.kv_capacity_tokens = self.st.engine.kv_capacity_tokens();
        self.rec.context_window_tokens = self.st.max_request();
        let rate = self.st.engine.stats().prefill_tokens_per_s;
        self.rec.prefill_tokens_per_s = (rate > 0.0).then(|| rate.round());
        self.st.metrics.request(outcome);
        if let Some(log) = &self.st.reqlog {
            log.write(&self.rec);
        }
    }

    fn reject(&mut self, e: &ApiError) {
        self.st.metrics.rejection(e.reason);
        if let Some(t) = &self.tenant {
            t.activity.refused.fetch_add(1, Ordering::Relaxed);
        }
        self.rec.error_kind = Some(e.reason.as_str());
        self.rec.error_code = e.code;
        self.write("rejected");
    }

    fn failed(&mut self, e: &ApiError) {
        self.rec.error_kind = Some(e.reason.as_str());
        self.rec.error_code = e.code;
        self.write("error");
    }

    fn finished(&mut self, d: &DoneEvent) {
        let m = &self.st.metrics;
        m.queue_time.observe(d.queue_ms / 1e3);
        m.e2e.observe(self.start.elapsed().as_secs_f64());
        m.tokens(d.usage.prompt_tokens, d.usage.completion_tokens);
        if let Some(t) = &self.rec.tenant {
            m.tenant_finished(t, &d.usage, d.queue_ms / 1e3);
        }
        self.rec.cached_tokens = d.usage.cached_tokens;
        // The prompt as the client sent it (tokenised here), not as the
        // backend says it ran it: the two differ only on a server that cut
        // the prompt, which is what the log must show.
        if self.rec.prompt_tokens == 0 {
            self.rec.prompt_tokens = d.usage.prompt_tokens;
        }
        self.rec.output_tokens = d.usage.completion_tokens;
        self.rec.queue_ms = Some(d.queue_ms);
        self.rec.pages = Some(d.pages);
        self.rec.finish_reason = Some(d.finish.as_openai());
        self.write("finished");
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        if !self.done {
            self.write("cancelled");
        }
    }
}

// ---- admission -------------------------------------------------------------

/// An admitted request: an engine handle per choice (`n`) and what it
/// holds (a tenant permit per choice).
struct Admitted {
    handles: Vec<RequestHandle>,
    params: GenParams,
    permits: Vec<TenantPermit>,
    inflight: InflightGuard,
}

/// Reads the body with a size limit and a deadline.
async fn read_body(
    body: Body,
    headers: &HeaderMap,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let expects_continue = headers
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if let Some(n) = declared {
        // Refuse before reading when the client waits for our go-ahead or
        // the body is too large even to drain.
        if n > limit as u64 && (expects_continue || n > DRAIN_MAX as u64) {
            return Err(ApiError::body_too_large(limit));
        }
    }
    let read = async {
        let mut stream = body.into_data_stream();
        let mut buf: Vec<u8> = Vec::with_capacity(declared.unwrap_or(0).min(limit as u64) as usize);
        let mut seen: usize = 0;
        while let Some(chunk) = stream.next().await {
            let chunk =
                chunk.map_err(|e| ApiError::invalid_json(format!("reading the body: {e}")))?;
            seen = seen.saturating_add(chunk.len());
            if seen > DRAIN_MAX {
                break;
            }
            if seen <= limit {
                buf.extend_from_slice(&chunk);
            }
        }
        if seen > limit {
            return Err(ApiError::body_too_large(limit));
        }
        Ok(Bytes::from(buf))
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(r) => r,
        Err(_) => Err(ApiError::body_timeout(timeout.as_secs())),
    }
}

/// Prompt token ids (and the prompt text, for the log) of a request,
/// through the project's one prompt encoder ([`tokenizer::encode_text`],
/// [`tokenizer::encode_chat`]: in chat messages only the template's text
/// may produce special tokens), shared with `isoserve generate` and
/// `isoserve tokenize`.
/// `chat_param` names the field of chat messages in errors (`messages`, or
/// the Responses API's `input`).
fn tokenize(
    st: &AppState,
    input: &Input,
    chat_param: &str,
) -> Result<(Vec<u32>, String), ApiError> {
    match input {
        Input::Tokens(ids) => Ok((ids.clone(), format!("{ids:?}"))),
        Input::Text(t) => {
            let ids = tokenizer::encode_text(&st.tokenizer, t)
                .map_err(|e| ApiError::bad_prompt("prompt", e))?;
            Ok((ids, t.clone()))
        }
        Input::Chat(msgs) => {
            let p = chat_prompt(st, msgs, chat_param)?;
            Ok((p.ids, p.text))
        }
    }
}

fn chat_prompt(
    st: &AppState,
    msgs: &[(String, String)],
    param: &str,
) -> Result<tokenizer::Prompt, ApiError> {
    let template = st
        .template
        .as_ref()
        .ok_or_else(|| ApiError::bad_prompt(param, "the model has no chat template"))?;
    let ms: Vec<ChatMessage> = msgs
        .iter()
        .map(|(r, c)| ChatMessage::new(r.as_str(), c.as_str()))
        .collect();
    tokenizer::encode_chat(&st.tokenizer, template, &ms).map_err(|e| ApiError::bad_prompt(param, e))
}

async fn admit(
    st: &Arc<AppState>,
    ep: Endpoint,
    headers: &HeaderMap,
    body: Body,
    tr: &mut Tracker,
) -> Result<Admitted, ApiError> {
    if st.is_shutting_down() {
        return Err(ApiError::shutting_down());
    }
    let auth = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    let tenant = st
        .tenants
        .authenticate(auth)
        .map_err(ApiError::unauthorized)?;
    tr.rec.tenant = Some(tenant.name.clone());
    tr.tenant = Some(tenant.clone());
    let bytes = read_body(body, headers, st.cfg.max_body_bytes, st.cfg.body_timeout).await?;
    let params = match ep {
        Endpoint::Chat => api::parse_chat(&bytes)?,
        Endpoint::Completions => api::parse_completion(&bytes)?,
        Endpoint::Responses => api::parse_responses(&bytes)?,
    };
    drop(bytes);
    if let Some(m) = &params.model {
        if !st.cfg.serves_model(m) {
            return Err(ApiError::model_not_found(m));
        }
    }
    // Tokenising a multi-megabyte prompt is CPU work: off the async workers.
    // A batch's prompts one after another (`more_inputs`).
    let (prompts, params) = {
        let st2 = st.clone();
        tokio::task::spawn_blocking(move || {
            std::iter::once(&params.input)
                .chain(&params.more_inputs)
                .map(|input| tokenize(&st2, input, ep.prompt_param()))
                .collect::<Result<Vec<_>, _>>()
                .map(|prompts| (prompts, params))
        })
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task: {e}")))??
    };
    tr.rec.prompt_tokens = prompts.iter().map(|(ids, _)| ids.len()).sum();
    if st.cfg.log_prompts {
        let texts: Vec<&str> = prompts.iter().map(|(_, t)| t.as_str()).collect();
        tr.rec.prompt = Some(texts.join("\n"));
    }
    let mut prompts = prompts.into_iter().map(|(ids, _)| ids);
    let ids = prompts.next().expect("one prompt at least");
    let more_prompts: Vec<Vec<u32>> = prompts.collect();
    let max_tokens_for = |len: usize| {
        params.max_tokens.unwrap_or_else(|| {
            st.max_request()
                .saturating_sub(len)
                .clamp(1, st.cfg.default_max_tokens)
        })
    };
    let max_tokens = max_tokens_for(ids.len());
    let req = GenRequest {
        tenant: tenant.id,
        prompt: ids,
        max_tokens,
        params: SamplingParams {
            temperature: params.temperature,
            top_k: params.top_k,
            top_p: params.top_p,
            min_p: params.min_p,
            repetition_penalty: params.repetition_penalty,
            presence_penalty: params.presence_penalty,
            frequency_penalty: params.frequency_penalty,
            seed: params.seed.unwrap_or_else(random_u64),
            logit_bias: params.logit_bias.clone(),
        },
        stop: params.stop.clone(),
        ignore_eos: params.ignore_eos,
        logprobs: params.logprobs,
        cache_scope: st
            .tenants
            .cache_scope(&tenant, params.cache_salt.as_deref()),
        priority: params.priority,
        weight: tenant.weight,
        // W3C Trace Context: a malformed header is ignored (the spec: start
        // a new trace), never an error.
        trace: headers
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .and_then(request::trace::TraceContext::parse),
    };
    if let Some(m) = tenant.max_priority.filter(|&m| params.priority < m) {
        // Priority orders only the tenant's own requests; the operator may
        // still bound it (K13).
        return Err(ApiError::invalid_value(
            "priority",
            format!(
                "{} is more precedence than this tenant may ask: the lowest value allowed is {m} \
                 (lower values run earlier)",
                params.priority
            ),
        ));
    }
    let engine_err = |e: &request::RequestError| {
        ApiError::from_engine(e, ep.prompt_param(), ep.logprobs_param())
    };
    // The window check (K8) before any tenant budget or queue slot is used
    // (the test-only `fault-incident` build skips it: the engine's
    // placeholder path takes over-long requests).
    let window = if cfg!(feature = "fault-incident") {
        usize::MAX
    } else {
        st.max_request()
    };
    // Every prompt of a batch is checked before anything is queued.
    let mut reqs = vec![req];
    for ids in more_prompts {
        let mut r = reqs[0].clone();
        r.max_tokens = max_tokens_for(ids.len());
        r.prompt = ids;
        reqs.push(r);
    }
    for r in &reqs {
        request::validate(r, window, st.vocab).map_err(|e| engine_err(&e))?;
    }
    // Each choice is a sequence of its own in the engine and counts as one
    // of the tenant's concurrent requests: `n` (or a batch) cannot multiply
    // a tenant's share past what the operator allowed.
    let n = params.n;
    let sequences = n * reqs.len();
    if sequences > tenant.max_concurrent {
        return Err(ApiError::invalid_value(
            "n",
            format!(
                "{} prompts × {n} choices are more than this tenant may run at once \
                 (max_concurrent {})",
                reqs.len(),
                tenant.max_concurrent
            ),
        ));
    }
    // Sequence k is prompt k / n's choice k % n; all admitted or none.
    let needs: Vec<u64> = (0..sequences)
        .map(|k| (reqs[k / n].prompt.len() + reqs[k / n].max_tokens) as u64)
        .collect();
    let mut permits = st.tenants.admit_all(&tenant, &needs, Instant::now())?;
    tr.rec.sequences = sequences;
    let mut handles = Vec::with_capacity(sequences);
    for k in 0..sequences {
        let (req, i) = (&reqs[k / n], k % n);
        // Choice i samples with seed + i: choice 0 is what n = 1 gives.
        let mut choice = req.clone();
        choice.params.seed = req.params.seed.wrapping_add(i as u64);
        match st.engine.submit(choice) {
            Ok(h) => {
                tr.pages.push(h.pages_cell());
                handles.push(h);
            }
            Err(e) => {
                // Sequences already submitted are cancelled as `handles`
                // drops; none ran, so every permit's tokens go back.
                permits.iter_mut().for_each(TenantPermit::refund);
                return Err(engine_err(&e));
            }
        }
    }
    Ok(Admitted {
        handles,
        params,
        permits,
        inflight: InflightGuard::new(st),
    })
}

async fn generate(st: Arc<AppState>, ep: Endpoint, headers: HeaderMap, body: Body) -> Response {
    let id = request_id(ep);
    let mut tr = Tracker::new(&st, ep, &id);
    let adm = match admit(&st, ep, &headers, body, &mut tr).await {
        Ok(a) => a,
        Err(e) => {
            tracing::debug!(id, reason = e.reason.as_str(), "refused: {e}");
            tr.reject(&e);
            return e.into_response();
        }
    };
    let shaper = Shaper {
        st: st.clone(),
        ep,
        id,
        created: unix_now(),
        include_usage: adm.params.include_usage,
        logprobs: adm.params.logprobs.is_some(),
        temperature: adm.params.temperature,
        top_p: adm.params.top_p,
        max_tokens: adm.params.max_tokens,
        instructions: adm.params.instructions.clone(),
        seq: AtomicU64::new(0),
    };
    if adm.params.stream {
        stream_response(shaper, adm, tr)
    } else {
        full_response(shaper, adm, tr).await
    }
}

// ---- response shaping ------------------------------------------------------

/// Builds the OpenAI JSON of one request's responses and chunks.
struct Shaper {
    st: Arc<AppState>,
    ep: Endpoint,
    id: String,
    created: u64,
    include_usage: bool,
    logprobs: bool,
    /// What a Responses API response echoes of its request.
    temperature: f32,
    top_p: f32,
    max_tokens: Option<usize>,
    instructions: Option<String>,
    /// The Responses API's `sequence_number` of the next stream event.
    seq: AtomicU64,
}

/// A logprob as JSON can carry it (no infinities).
fn finite(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else {
        -9999.0
    }
}

fn sse<T: Serialize>(v: &T) -> Vec<u8> {
    let mut out = b"data: ".to_vec();
    if serde_json::to_writer(&mut out, v).is_err() {
        out.extend_from_slice(b"{}");
    }
    out.extend_from_slice(b"\n\n");
    out
}

const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

impl Shaper {
    fn model(&self) -> String {
        self.st.cfg.model_id.clone()
    }

    fn token_str(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self
            .st
            .tokenizer
            .token_bytes(id)
            .map(<[u8]>::to_vec)
            .unwrap_or_default();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    fn chat_logprob(&self, t: &TokenEvent) -> TokenLogprob {
        let (token, bytes) = self.token_str(t.id);
        TokenLogprob {
            token,
            logprob: finite(t.logprob.unwrap_or(0.0)),
            bytes,
            top_logprobs: t
                .top_logprobs
                .iter()
                .map(|&(id, lp)| {
                    let (token, bytes) = self.token_str(id);
                    TopLogprob {
                        token,
                        logprob: finite(lp),
                        bytes,
                    }
                })
                .collect(),
        }
    }

    /// Appends `t` to completions-style logprobs; `offset` is the text
    /// offset (in characters) of the token.
    fn completion_logprob(&self, lp: &mut CompletionLogprobs, t: &TokenEvent, offset: usize) {
        let (token, _) = self.token_str(t.id);
        let mut top = Map::new();
        for &(id, l) in &t.top_logprobs {
            let (s, _) = self.token_str(id);
            top.entry(s)
                .or_insert_with(|| Value::from(finite(l) as f64));
        }
        lp.tokens.push(token);
        lp.token_logprobs.push(finite(t.logprob.unwrap_or(0.0)));
        lp.top_logprobs.push(top);
        lp.text_offset.push(offset);
    }

    fn chat_chunk(
        &self,
        index: usize,
        delta: Delta,
        lp: Option<ChatLogprobs>,
        finish: Option<&str>,
    ) -> Vec<u8> {
        sse(&ChatChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.created,
            model: self.model(),
            choices: vec![ChatChunkChoice {
                index,
                delta,
                logprobs: lp,
                finish_reason: finish.map(str::to_string),
            }],
            usage: self.include_usage.then_some(None),
        })
    }

    fn completion_chunk(
        &self,
        index: usize,
        text: String,
        lp: Option<CompletionLogprobs>,
        finish: Option<&str>,
    ) -> Vec<u8> {
        sse(&Completion {
            id: self.id.clone(),
            object: "text_completion".into(),
            created: self.created,
            model: self.model(),
            choices: vec![CompletionChoice {
                index,
                text,
                logprobs: lp,
                finish_reason: finish.map(str::to_string),
            }],
            usage: self.include_usage.then_some(None),
        })
    }

    /// The first chunks: chat announces the assistant's role, once per
    /// choice.
    fn start(&self, choices: usize) -> Option<Vec<u8>> {
        match self.ep {
            Endpoint::Chat => Some(
                (0..choices)
                    .flat_map(|i| {
                        self.chat_chunk(
                            i,
                            Delta {
                                role: Some("assistant".into()),
                                content: Some(String::new()),
                            },
                            None,
                            None,
                        )
                    })
                    .collect(),
            ),
            Endpoint::Completions => None,
            Endpoint::Responses => {
                let mut out = self.event(
                    "response.created",
                    json!({"response": self.response_obj("in_progress", vec![], None)}),
                );
                out.extend(self.event(
                    "response.in_progress",
                    json!({"response": self.response_obj("in_progress", vec![], None)}),
                ));
                out.extend(self.event(
                    "response.output_item.added",
                    json!({"output_index": 0, "item": {
                        "type": "message", "id": self.message_id(), "status": "in_progress",
                        "role": "assistant", "content": []}}),
                ));
                out.extend(self.event(
                    "response.content_part.added",
                    json!({"item_id": self.message_id(), "output_index": 0, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": [],
                                    "logprobs": []}}),
                ));
                Some(out)
            }
        }
    }

    fn token_chunk(&self, index: usize, t: &TokenEvent, offset: usize) -> Vec<u8> {
        match self.ep {
            Endpoint::Chat => {
                let lp = self.logprobs.then(|| ChatLogprobs {
                    content: vec![self.chat_logprob(t)],
                });
                self.chat_chunk(
                    index,
                    Delta {
                        role: None,
                        content: Some(t.text.clone()),
                    },
                    lp,
                    None,
                )
            }
            Endpoint::Completions => {
                let lp = self.logprobs.then(|| {
                    let mut lp = CompletionLogprobs::default();
                    self.completion_logprob(&mut lp, t, offset);
                    lp
                });
                self.completion_chunk(index, t.text.clone(), lp, None)
            }
            Endpoint::Responses => {
                let lp: Vec<TokenLogprob> = self
                    .logprobs
                    .then(|| self.chat_logprob(t))
                    .into_iter()
                    .collect();
                self.event(
                    "response.output_text.delta",
                    json!({"item_id": self.message_id(), "output_index": 0, "content_index": 0,
                           "delta": t.text, "logprobs": lp}),
                )
            }
        }
    }

    /// The end of one choice: its held-back tail (if any) and its finish
    /// chunk. `text` is the choice's whole text, tail included, and
    /// `logprobs` its tokens' (the Responses API repeats both at the end).
    fn finish_choice(
        &self,
        index: usize,
        d: &DoneEvent,
        text: &str,
        logprobs: &[TokenEvent],
    ) -> Vec<u8> {
        let mut out = Vec::new();
        let reason = Some(d.finish.as_openai());
        match self.ep {
            Endpoint::Chat => {
                if !d.tail_text.is_empty() {
                    out.extend(self.chat_chunk(
                        index,
                        Delta {
                            role: None,
                            content: Some(d.tail_text.clone()),
                        },
                        None,
                        None,
                    ));
                }
                out.extend(self.chat_chunk(index, Delta::default(), None, reason));
            }
            Endpoint::Completions => {
                if !d.tail_text.is_empty() {
                    out.extend(self.completion_chunk(index, d.tail_text.clone(), None, None));
                }
                out.extend(self.completion_chunk(index, String::new(), None, reason));
            }
            Endpoint::Responses => {
                if !d.tail_text.is_empty() {
                    out.extend(self.event(
                        "response.output_text.delta",
                        json!({"item_id": self.message_id(), "output_index": 0,
                               "content_index": 0, "delta": d.tail_text, "logprobs": []}),
                    ));
                }
                let item = self.message_item(d, text, logprobs);
                let part = item["content"][0].clone();
                out.extend(self.event(
                    "response.output_text.done",
                    json!({"item_id": self.message_id(), "output_index": 0, "content_index": 0,
                           "text": text, "logprobs": part["logprobs"]}),
                ));
                out.extend(self.event(
                    "response.content_part.done",
                    json!({"item_id": self.message_id(), "output_index": 0, "content_index": 0,
                           "part": part}),
                ));
                out.extend(self.event(
                    "response.output_item.done",
                    json!({"output_index": 0, "item": item}),
                ));
            }
        }
        out
    }

    // ---- the Responses API's shapes ----

    /// The output message's id: the response's, renamed.
    fn message_id(&self) -> String {
        format!("msg_{}", self.id.trim_start_matches("resp_"))
    }

    /// One stream event: `event:` names it, `data:` carries it with its
    /// `type` and `sequence_number`.
    fn event(&self, ty: &str, mut v: Value) -> Vec<u8> {
        v["type"] = Value::from(ty);
        v["sequence_number"] = Value::from(self.seq.fetch_add(1, Ordering::Relaxed));
        let mut out = format!("event: {ty}\n").into_bytes();
        out.extend(sse(&v));
        out
    }

    /// The output message of a finished choice.
    fn message_item(&self, d: &DoneEvent, text: &str, logprobs: &[TokenEvent]) -> Value {
        let lp: Vec<TokenLogprob> = if self.logprobs {
            logprobs.iter().map(|t| self.chat_logprob(t)).collect()
        } else {
            Vec::new()
        };
        json!({"type": "message", "id": self.message_id(), "status": response_status(d),
               "role": "assistant",
               "content": [{"type": "output_text", "text": text, "annotations": [],
                            "logprobs": lp}]})
    }

    /// The response object: `in_progress` with no output yet, or the end
    /// with its output and usage.
    fn response_obj(&self, status: &str, output: Vec<Value>, done: Option<&DoneEvent>) -> Value {
        let usage = done.map(|d| {
            let u = &d.usage;
            json!({"input_tokens": u.prompt_tokens,
                   "input_tokens_details": {"cached_tokens": u.cached_tokens},
                   "output_tokens": u.completion_tokens,
                   "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": u.prompt_tokens + u.completion_tokens})
        });
        let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
        json!({"id": self.id, "object": "response", "created_at": self.created,
               "status": status, "model": self.model(), "output": output, "usage": usage,
               "error": null, "incomplete_details": incomplete,
               "instructions": self.instructions, "max_output_tokens": self.max_tokens,
               "metadata": {}, "parallel_tool_calls": false,
               "temperature": shown_f32(self.temperature), "top_p": shown_f32(self.top_p), "tool_choice": "none", "tools": [],
               "text": {"format": {"type": "text"}}, "truncation": "disabled",
               "store": false, "background": false, "previous_response_id": null,
               "reasoning": {"effort": null, "summary": null}})
    }

    /// After every choice finished: the usage chunk (if asked for) and
    /// `[DONE]`; for the Responses API, `response.completed` (or
    /// `.incomplete`) with the whole response.
    fn end(&self, all: &DoneEvent, text: &str, logprobs: &[TokenEvent]) -> Vec<u8> {
        let usage = Some(Some(Usage::of(&all.usage)));
        let mut out = match self.ep {
            Endpoint::Responses => {
                let status = response_status(all);
                let item = self.message_item(all, text, logprobs);
                return self.event(
                    &format!("response.{status}"),
                    json!({"response": self.response_obj(status, vec![item], Some(all))}),
                );
            }
            _ if !self.include_usage => Vec::new(),
            Endpoint::Chat => sse(&ChatChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk".into(),
                created: self.created,
                model: self.model(),
                choices: Vec::new(),
                usage,
            }),
            Endpoint::Completions => sse(&Completion {
                id: self.id.clone(),
                object: "text_completion".into(),
                created: self.created,
                model: self.model(),
                choices: Vec::new(),
                usage,
            }),
        };
        out.extend_from_slice(SSE_DONE);
        out
    }

    /// An error after the stream started: an error event, then `[DONE]`;
    /// for the Responses API, `response.failed` with the error in the
    /// response.
    fn error(&self, e: &ApiError) -> Vec<u8> {
        if self.ep == Endpoint::Responses {
            let mut r = self.response_obj("failed", vec![], None);
            r["error"] = json!({"code": e.code.unwrap_or(e.kind), "message": e.message});
            return self.event("response.failed", json!({"response": r}));
        }
        let mut out = sse(&e.body());
        out.extend_from_slice(SSE_DONE);
        out
    }
}

/// An f32 as JSON shows the decimal the client sent (0.7, not
/// 0.699999988079071): its shortest round-trip text, read as f64.
fn shown_f32(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

/// A finished response's status: `incomplete` when it ran out of
/// `max_output_tokens`.
fn response_status(d: &DoneEvent) -> &'static str {
    match d.finish {
        request::FinishReason::Length => "incomplete",
        request::FinishReason::Stop => "completed",
    }
}

fn engine_error(ep: Endpoint, e: &request::RequestError) -> ApiError {
    ApiError::from_engine(e, ep.prompt_param(), ep.logprobs_param())
}

fn ended_without_result() -> ApiError {
    ApiError::internal("the engine ended the request without a result")
}

// ---- choices ---------------------------------------------------------------

/// Every choice's events, merged as they come: `(choice, event)`, where
/// `None` is a handle that ended without a result. A choice's handle is
/// dropped after its last event.
type ChoiceEvents = futures_util::stream::SelectAll<
    std::pin::Pin<Box<dyn futures_util::Stream<Item = (usize, Option<Event>)> + Send>>,
>;

fn choice_events(handles: Vec<RequestHandle>) -> ChoiceEvents {
    futures_util::stream::select_all(handles.into_iter().enumerate().map(|(i, h)| {
        let s = futures_util::stream::unfold(Some(h), move |h| async move {
            let mut h = h?;
            match h.next().await {
                Some(e @ (Event::Done(_) | Event::Error(_))) => Some(((i, Some(e)), None)),
                Some(e) => Some(((i, Some(e)), Some(h))),
                None => Some(((i, None), None)),
            }
        });
        Box::pin(s) as std::pin::Pin<Box<dyn futures_util::Stream<Item = _> + Send>>
    }))
}

/// The request's end from its sequences' ends (`n` choices of each
/// prompt): each prompt counted once (as OpenAI's usage does), with its
/// first choice's cached tokens; completions summed, pages summed, the
/// longest queue wait; the finish reason of the first choice.
fn combined(dones: &[DoneEvent], n: usize) -> DoneEvent {
    let first = &dones[0];
    let firsts = || dones.iter().step_by(n.max(1));
    DoneEvent {
        finish: first.finish,
        usage: request::Usage {
            prompt_tokens: firsts().map(|d| d.usage.prompt_tokens).sum(),
            completion_tokens: dones.iter().map(|d| d.usage.completion_tokens).sum(),
            cached_tokens: firsts().map(|d| d.usage.cached_tokens).sum(),
        },
        tail_text: String::new(),
        queue_ms: dones.iter().map(|d| d.queue_ms).fold(0.0, f64::max),
        ttft_ms: first.ttft_ms,
        total_ms: dones.iter().map(|d| d.total_ms).fold(0.0, f64::max),
        pages: dones.iter().map(|d| d.pages).sum(),
    }
}

// ---- non-streaming ---------------------------------------------------------

async fn full_response(sh: Shaper, adm: Admitted, mut tr: Tracker) -> Response {
    let Admitted {
        handles,
        params,
        permits: _permits,
        inflight: _inflight,
    } = adm;
    let n = handles.len();
    let mut texts = vec![String::new(); n];
    let mut events: Vec<Vec<TokenEvent>> = vec![Vec::new(); n];
    let mut dones: Vec<Option<DoneEvent>> = vec![None; n];
    let mut merged = choice_events(handles);
    while let Some((i, ev)) = merged.next().await {
        match ev {
            Some(Event::Token(t)) => {
                tr.token(i);
                texts[i].push_str(&t.text);
                if sh.logprobs {
                    events[i].push(t);
                }
            }
            Some(Event::Done(d)) => dones[i] = Some(d),
            Some(Event::Error(e)) => {
                // The other choices are cancelled as `merged` drops.
                let e = engine_error(sh.ep, &e);
                tr.failed(&e);
                return e.into_response();
            }
            None => {
                let e = ended_without_result();
                tr.failed(&e);
                return e.into_response();
            }
        }
    }
    let Some(dones) = dones.into_iter().collect::<Option<Vec<DoneEvent>>>() else {
        let e = ended_without_result();
        tr.failed(&e);
        return e.into_response();
    };
    let all = combined(&dones, params.n);
    tr.finished(&all);
    for (text, d) in texts.iter_mut().zip(&dones) {
        text.push_str(&d.tail_text);
    }
    let usage = Usage::of(&all.usage);
    let finish = |d: &DoneEvent| Some(d.finish.as_openai().to_string());
    match sh.ep {
        Endpoint::Responses => {
            let item = sh.message_item(&dones[0], &texts[0], &events[0]);
            Json(sh.response_obj(response_status(&all), vec![item], Some(&all))).into_response()
        }
        Endpoint::Chat => Json(ChatCompletion {
            id: sh.id.clone(),
            object: "chat.completion".into(),
            created: sh.created,
            model: sh.model(),
            choices: dones
                .iter()
                .zip(texts)
                .zip(&events)
                .enumerate()
                .map(|(index, ((d, text), events))| ChatChoice {
                    index,
                    message: ChatMessageOut {
                        role: "assistant".into(),
                        content: text,
                    },
                    logprobs: sh.logprobs.then(|| ChatLogprobs {
                        content: events.iter().map(|t| sh.chat_logprob(t)).collect(),
                    }),
                    finish_reason: finish(d),
                })
                .collect(),
            usage,
        })
        .into_response(),
        Endpoint::Completions => Json(Completion {
            id: sh.id.clone(),
            object: "text_completion".into(),
            created: sh.created,
            model: sh.model(),
            choices: dones
                .iter()
                .zip(texts)
                .zip(&events)
                .enumerate()
                .map(|(index, ((d, text), events))| {
                    let logprobs = sh.logprobs.then(|| {
                        let mut lp = CompletionLogprobs::default();
                        let mut offset = 0;
                        for t in events {
                            sh.completion_logprob(&mut lp, t, offset);
                            offset += t.text.chars().count();
                        }
                        lp
                    });
                    CompletionChoice {
                        index,
                        text,
                        logprobs,
                        finish_reason: finish(d),
                    }
                })
                .collect(),
            usage: Some(Some(usage)),
        })
        .into_response(),
    }
}

// ---- streaming -------------------------------------------------------------

enum Phase {
    Start,
    Tokens,
    End,
}

/// The state of an SSE body. It owns the engine handles: when hyper drops
/// the body (the client disconnected), the handles are dropped with it and
/// the engine cancels every choice; the tracker records `cancelled`.
struct Streaming {
    sh: Shaper,
    merged: ChoiceEvents,
    _permits: Vec<TenantPermit>,
    _inflight: InflightGuard,
    tr: Tracker,
    phase: Phase,
    /// Characters sent so far per choice (completions' `text_offset`).
    offsets: Vec<usize>,
    /// Choices per prompt.
    n: usize,
    /// Text so far per choice, and the tokens (with log-probabilities,
    /// when asked for): the Responses API repeats them at the end.
    texts: Vec<String>,
    tokens: Vec<Vec<TokenEvent>>,
    dones: Vec<Option<DoneEvent>>,
}

impl Streaming {
    async fn next_bytes(&mut self) -> Option<Vec<u8>> {
        match self.phase {
            Phase::End => return None,
            Phase::Start => {
                self.phase = Phase::Tokens;
                if let Some(first) = self.sh.start(self.dones.len()) {
                    return Some(first);
                }
            }
            Phase::Tokens => {}
        }
        loop {
            match self.merged.next().await {
                Some((i, Some(Event::Token(t)))) => {
                    self.tr.token(i);
                    if t.text.is_empty() && !self.sh.logprobs {
                        continue;
                    }
                    let out = self.sh.token_chunk(i, &t, self.offsets[i]);
                    self.offsets[i] += t.text.chars().count();
                    if self.sh.ep == Endpoint::Responses {
                        self.texts[i].push_str(&t.text);
                        if self.sh.logprobs {
                            self.tokens[i].push(t);
                        }
                    }
                    return Some(out);
                }
                Some((i, Some(Event::Done(d)))) => {
                    self.texts[i].push_str(&d.tail_text);
                    let mut out = self
                        .sh
                        .finish_choice(i, &d, &self.texts[i], &self.tokens[i]);
                    self.dones[i] = Some(d);
                    if self.dones.iter().all(Option::is_some) {
                        self.phase = Phase::End;
                        let dones: Vec<DoneEvent> = self.dones.iter().flatten().cloned().collect();
                        let all = combined(&dones, self.n);
                        self.tr.finished(&all);
                        out.extend(self.sh.end(&all, &self.texts[0], &self.tokens[0]));
                    }
                    return Some(out);
                }
                Some((_, Some(Event::Error(e)))) => {
                    self.phase = Phase::End;
                    let e = engine_error(self.sh.ep, &e);
                    self.tr.failed(&e);
                    return Some(self.sh.error(&e));
                }
                Some((_, None)) | None => {
                    self.phase = Phase::End;
                    let e = ended_without_result();
                    self.tr.failed(&e);
                    return Some(self.sh.error(&e));
                }
            }
        }
    }
}

fn stream_response(sh: Shaper, adm: Admitted, tr: Tracker) -> Response {
    let n = adm.handles.len();
    let state = Streaming {
        sh,
        merged: choice_events(adm.handles),
        _permits: adm.permits,
        _inflight: adm.inflight,
        tr,
        phase: Phase::Start,
        offsets: vec![0; n],
        n: adm.params.n,
        texts: vec![String::new(); n],
        tokens: vec![Vec::new(); n],
        dones: vec![None; n],
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        let bytes = s.next_bytes().await?;
        Some((Ok::<Bytes, Infallible>(Bytes::from(bytes)), s))
    });
    let mut resp = Response::new(Body::from_stream(stream));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}
