//! `gateway` — the PD gateway as a [`request::Backend`]: the HTTP layer
//! submits requests,
//! the [`transfer::gateway::Gateway`] state machine coordinates them over
//! (prefill, decode) pairs, and a connection manager keeps every configured
//! node connected (reconnecting with backoff; a reconnect re-reads the
//! node's limit, K8). A node address `dns:NAME:PORT` (a Kubernetes
//! headless Service) is resolved at start and every
//! [`RESOLVE_INTERVAL`]: addresses that appear join, ones that vanish are
//! retired (nothing new goes to them; what runs there finishes).
//!
//! A client that goes away drops its [`RequestHandle`]; the handle's cancel
//! hook tells the machine, which sends a cooperative `Cancel` to both nodes.
//! Node connections are never closed for a client's sake.
//!
//! It links no model, kernel or pool: it speaks the request vocabulary
//! (`request`), the protocol (`transfer`) and TCP (`transport`). A test
//! over `cargo metadata` (in the `isoserve` crate) pins that.
//!
//! ```no_run
//! # async fn f() {
//! use gateway::{GatewayBackend, GatewayOptions};
//! # let opts: GatewayOptions = todo!();
//! // Inside a tokio runtime: connects to every node and serves requests.
//! let gw = GatewayBackend::start(opts);
//! # let _ = gw;
//! # }
//! ```

#![forbid(unsafe_code)]

pub mod nodes;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use request::{
    Backend, DoneEvent, EngineStats, Event, GenRequest, MetricSample, RequestError, RequestHandle,
    RequestId, TokenEvent, Usage,
};
use tokio::sync::{mpsc, Notify};
use transfer::convert::gen_spec;
use transfer::gateway::{ClientEvent, Gateway, GatewayAction, GatewayConfig};
use transfer::wire::{Message, Refusal, ROLE_DECODE, ROLE_PREFILL};
use transfer::Identity;

use telemetry::metrics::Family;
use transfer::node::NetEvent;
use transport::{Transport, TransportConfig};

/// Requests in flight at once on a gateway that sets no limit (each holds
/// a client's event channel and a slot of the machine's table).
pub const REQUESTS_MAX_DEFAULT: usize = 4096;
/// Transport events queued for the gateway's loop before the transport
/// waits (back-pressure on the node connections, not a drop).
pub const NET_EVENTS_MAX: usize = 4096;

/// Settings of a gateway.
#[derive(Clone, Debug)]
pub struct GatewayOptions {
    pub node: String,
    pub fingerprint: [u8; 32],
    /// The model's context window (metadata).
    pub model_window_tokens: u32,
    /// Lower the advertised window below the model's.
    pub max_context: Option<u32>,
    pub requests_max: usize,
    pub prefill: Vec<String>,
    pub decode: Vec<String>,
    pub transport: TransportConfig,
    /// Longest wait between reconnect attempts.
    pub reconnect_max: Duration,
    /// Test-only: route over-long requests to the nodes (to show their own
    /// checks). Needs the `mutations` feature.
    pub skip_limit_check: bool,
    /// Where request spans go (the log; OTLP with `--otlp-endpoint`).
    pub telemetry: telemetry::Telemetry,
}

impl GatewayOptions {
    pub fn new(
        prefill: Vec<String>,
        decode: Vec<String>,
        fingerprint: [u8; 32],
        window: u32,
    ) -> Self {
        GatewayOptions {
            node: "gateway".into(),
            fingerprint,
            model_window_tokens: window,
            max_context: None,
            requests_max: REQUESTS_MAX_DEFAULT,
            prefill,
            decode,
            transport: TransportConfig::default(),
            reconnect_max: Duration::from_secs(2),
            skip_limit_check: false,
            telemetry: telemetry::Telemetry::logs_only("isoserve-gateway"),
        }
    }
}

struct Client {
    events: tokio::sync::mpsc::Sender<Event>,
    submitted_at: Instant,
    first_token_at: Option<Instant>,
    prompt_tokens: usize,
    /// The handle's page count: decode's pages for the prompt, once the
    /// gateway hands them to prefill.
    pages: Arc<AtomicU64>,
    /// The request's span, ended when the client is dropped (every way a
    /// request ends removes its client).
    span: RequestSpan,
}

/// The gateway's `request` span: its id is the parent the nodes' spans
/// name; it ends when dropped, failed unless marked finished.
struct RequestSpan {
    span: Option<telemetry::OpenSpan>,
    finished: bool,
}

impl Drop for RequestSpan {
    fn drop(&mut self) {
        if let Some(s) = self.span.take() {
            s.end(self.finished);
        }
    }
}

struct State {
    gw: Gateway,
    /// Requests ended because their client fell too far behind.
    too_slow_total: u64,
    clients: HashMap<RequestId, Client>,
    /// Connection → node index.
    conn_node: HashMap<u64, usize>,
}

struct Inner {
    state: Mutex<State>,
    transport: Arc<Transport>,
    next_req: AtomicU64,
    nonce: u64,
    shutting_down: AtomicBool,
    /// Per node slot of the machine: its connection manager's handle.
    slots: Mutex<Vec<Arc<Slot>>>,
    reconnect_max: Duration,
    /// Connection managers, aborted when the backend drops.
    managers: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    telemetry: telemetry::Telemetry,
}

/// A node slot's connection manager: the generation names it (a slot
/// reassigned to another address gets a new manager; the old one sees the
/// generation change and stops).
struct Slot {
    generation: u64,
    addr: String,
    /// Fired when the slot's connection closes.
    closed: Notify,
    /// The manager stopped (the node was retired and its connection ended).
    stopped: AtomicBool,
}

/// How often `dns:` node addresses are resolved again.
pub const RESOLVE_INTERVAL: Duration = Duration::from_secs(5);
/// Addresses one `dns:` name may contribute.
pub const RESOLVED_ADDRS_MAX: usize = 64;

/// The key a slot's dial reports in `NetEvent::Dialled::addr`: the slot and
/// its generation, so that a connection is matched to the manager that
/// made it even when two slots share an address.
fn dial_key(slot: usize, generation: u64) -> String {
    format!("slot:{slot}:{generation}")
}

fn parse_dial_key(key: &str) -> Option<(usize, u64)> {
    let mut it = key.strip_prefix("slot:")?.split(':');
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// `dns:NAME:PORT` → (NAME, PORT).
pub fn parse_dns(addr: &str) -> Option<(String, u16)> {
    let rest = addr.strip_prefix("dns:")?;
    let (name, port) = rest.rsplit_once(':')?;
    if name.is_empty() {
        return None;
    }
    Some((name.to_string(), port.parse().ok()?))
}

/// The PD gateway backend.
pub struct GatewayBackend {
    inner: Arc<Inner>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

fn refusal_error(r: Refusal) -> RequestError {
    RequestError::Remote {
        status: r.status,
        code: r.code,
        message: r.message,
    }
}

impl Inner {
    fn execute(&self, st: &mut State, actions: Vec<GatewayAction>) {
        // Clients that fell `REQUEST_EVENTS_MAX` events behind: ended after
        // this batch of actions (a remote decode cannot be paused).
        let mut too_slow = Vec::new();
        for a in actions {
            match a {
                GatewayAction::Send { conn, msg } => {
                    if let Message::Prefill { req, pages, .. } = &msg {
                        let client = st.gw.client_of(*req);
                        if let Some(c) = client.and_then(|id| st.clients.get(&id)) {
                            c.pages.store(pages.len() as u64, Ordering::Release);
                        }
                    }
                    self.transport.send(conn, &msg)
                }
                GatewayAction::Close { conn } => self.transport.close(conn),
                GatewayAction::Deliver { req, event } => {
                    let Some(c) = st.clients.get_mut(&req) else {
                        continue;
                    };
                    match event {
                        ClientEvent::Token { id, text, logprobs } => {
                            c.first_token_at.get_or_insert_with(Instant::now);
                            let (logprob, top) = match logprobs {
                                Some(l) => (
                                    Some(f32::from_bits(l.logprob_bits)),
                                    l.top
                                        .into_iter()
                                        .map(|(id, b)| (id, f32::from_bits(b)))
                                        .collect(),
                                ),
                                None => (None, Vec::new()),
                            };
                            // The last slot is kept for the end.
                            if c.events.capacity() <= 1 {
                                let c = st.clients.remove(&req).expect("known");
                                let _ =
                                    c.events.try_send(Event::Error(RequestError::ClientTooSlow {
                                        limit: request::REQUEST_EVENTS_MAX,
                                    }));
                                too_slow.push(req);
                                continue;
                            }
                            let _ = c.events.try_send(Event::Token(TokenEvent {
                                id,
                                text,
                                logprob,
                                top_logprobs: top,
                            }));
                        }
                        ClientEvent::Finished {
                            finish,
                            prompt_tokens,
                            cached_tokens,
                            completion_tokens,
                            prediction,
                            tail_text,
                        } => {
                            let mut c = st.clients.remove(&req).expect("known");
                            c.span.finished = true;
                            let now = Instant::now();
                            let ms = |d: Duration| d.as_secs_f64() * 1e3;
                            let (finish, stop_index) = request::finish_of(finish);
                            let _ = c.events.try_send(Event::Done(DoneEvent {
                                finish,
                                stop_index,
                                usage: Usage {
                                    prompt_tokens: prompt_tokens as usize,
                                    completion_tokens: completion_tokens as usize,
                                    cached_tokens: cached_tokens as usize,
                                    accepted_prediction_tokens: prediction.accepted as usize,
                                    rejected_prediction_tokens: prediction.rejected as usize,
                                },
                                tail_text,
                                queue_ms: 0.0,
                                ttft_ms: ms(c.first_token_at.unwrap_or(now) - c.submitted_at),
                                total_ms: ms(now - c.submitted_at),
                                pages: match c.pages.load(Ordering::Acquire) {
                                    request::PAGES_UNKNOWN => 0,
                                    n => n as usize,
                                },
                            }));
                            debug_assert_eq!(c.prompt_tokens, prompt_tokens as usize);
                        }
                        ClientEvent::Error(r) => {
                            let c = st.clients.remove(&req).expect("known");
                            let _ = c.events.try_send(Event::Error(refusal_error(r)));
                        }
                    }
                }
            }
        }
        for req in too_slow {
            st.too_slow_total += 1;
            let mut out = Vec::new();
            st.gw.cancel(req, &mut out);
            self.execute(st, out);
        }
    }

    fn on_event(&self, ev: NetEvent) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let st = &mut *st;
        let mut out = Vec::new();
        match ev {
            NetEvent::Dialled { conn, addr } => {
                let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
                let live = parse_dial_key(&addr).filter(|&(node, generation)| {
                    slots.get(node).is_some_and(|s| s.generation == generation)
                });
                drop(slots);
                if let Some((node, _)) = live {
                    let before = st.conn_node.insert(conn, node);
                    // The transport names each connection once.
                    assert!(before.is_none(), "connection {conn} dialled twice");
                    st.gw.connected(node, conn, &mut out);
                } else {
                    self.transport.close(conn);
                }
            }
            NetEvent::Message { conn, msg } => st.gw.message(conn, msg, &mut out),
            NetEvent::Closed { conn } => {
                st.gw.closed(conn, &mut out);
                if let Some(node) = st.conn_node.remove(&conn) {
                    let slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(s) = slots.get(node) {
                        s.closed.notify_one();
                    }
                }
            }
            NetEvent::Accepted { conn } => {
                // Nobody dials a gateway over the PD protocol.
                self.transport.close(conn);
            }
            NetEvent::DialFailed { .. } => {}
        }
        self.execute(st, out);
    }

    fn cancel(&self, req: RequestId) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let st = &mut *st;
        if st.clients.remove(&req).is_none() {
            return;
        }
        let mut out = Vec::new();
        st.gw.cancel(req, &mut out);
        self.execute(st, out);
    }
}

impl GatewayBackend {
    /// Starts the gateway (inside a tokio runtime): connects to every node
    /// and keeps reconnecting.
    pub fn start(opts: GatewayOptions) -> GatewayBackend {
        let (tx, mut rx) = mpsc::channel(NET_EVENTS_MAX);
        let transport = Transport::new(
            opts.transport.clone(),
            tokio::runtime::Handle::current(),
            tx,
        );
        let window = opts.max_context.map_or(opts.model_window_tokens, |m| {
            m.min(opts.model_window_tokens)
        });
        #[allow(unused_mut)]
        let mut gw = Gateway::new(GatewayConfig {
            placements_max: transfer::gateway::PLACEMENTS_MAX,
            identity: Identity {
                node: opts.node.clone(),
                fingerprint: opts.fingerprint,
                layout: transfer::wire::KvLayout {
                    page_size: 0,
                    dtype: 0,
                    layers: 0,
                    kv_heads: 0,
                    head_dim: 0,
                },
                max_request_tokens: window,
            },
            model_window_tokens: window,
            requests_max: opts.requests_max,
            prefill: opts
                .prefill
                .iter()
                .filter(|a| parse_dns(a).is_none())
                .cloned()
                .collect(),
            decode: opts
                .decode
                .iter()
                .filter(|a| parse_dns(a).is_none())
                .cloned()
                .collect(),
        });
        let statics: Vec<String> = gw.nodes().iter().map(|n| n.addr.clone()).collect();
        // The fault-incident build sends over-long requests on to the nodes,
        // where its prefill turns them into placeholders.
        #[cfg(feature = "mutations")]
        gw.set_mutations(transfer::gateway::GatewayMutations {
            skip_limit_check: opts.skip_limit_check || cfg!(feature = "fault-incident"),
            ..Default::default()
        });
        #[cfg(not(feature = "mutations"))]
        if opts.skip_limit_check {
            tracing::error!("skip_limit_check needs the `mutations` build; ignored");
        }
        let mut seed = [0u8; 8];
        // A per-process nonce in the request ids, so that a restarted
        // gateway never reuses a live id on a node.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        seed.copy_from_slice(&(t ^ (std::process::id() as u64).rotate_left(32)).to_le_bytes());
        let nonce = u64::from_le_bytes(seed) & 0xff_ffff;
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                gw,
                too_slow_total: 0,
                clients: HashMap::new(),
                conn_node: HashMap::new(),
            }),
            transport,
            next_req: AtomicU64::new(1),
            nonce,
            shutting_down: AtomicBool::new(false),
            slots: Mutex::new(Vec::new()),
            reconnect_max: opts.reconnect_max,
            managers: Mutex::new(Vec::new()),
            telemetry: opts.telemetry.clone(),
        });
        let mut tasks = Vec::new();
        let i = inner.clone();
        tasks.push(tokio::spawn(async move {
            while let Some(ev) = rx.recv().await {
                i.on_event(ev);
            }
        }));
        for (node, addr) in statics.into_iter().enumerate() {
            Inner::manage(&inner, node, addr);
        }
        for (role, list) in [(ROLE_PREFILL, &opts.prefill), (ROLE_DECODE, &opts.decode)] {
            for spec in list {
                if let Some((name, port)) = parse_dns(spec) {
                    let i = Arc::downgrade(&inner);
                    tasks.push(tokio::spawn(resolver(i, role, name, port)));
                }
            }
        }
        GatewayBackend { inner, tasks }
    }

    /// A snapshot of the gateway machine's view of its nodes.
    pub fn nodes(&self) -> Vec<transfer::gateway::NodeView> {
        let st = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        st.gw.nodes().to_vec()
    }

    /// Up prefill/decode nodes whose KV layouts differ (never paired).
    pub fn layout_mismatches(&self) -> Vec<String> {
        let st = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        st.gw.layout_mismatches()
    }

    pub fn gateway_stats(&self) -> transfer::gateway::GatewayStats {
        let st = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        st.gw.stats()
    }
}

impl Inner {
    /// Starts the connection manager of slot `node` (now at `addr`),
    /// replacing any earlier one (it sees the new generation and stops).
    fn manage(inner: &Arc<Inner>, node: usize, addr: String) {
        let mut slots = inner.slots.lock().unwrap_or_else(|e| e.into_inner());
        let generation = slots.get(node).map_or(0, |s| s.generation + 1);
        let slot = Arc::new(Slot {
            generation,
            addr: addr.clone(),
            closed: Notify::new(),
            stopped: AtomicBool::new(false),
        });
        if node < slots.len() {
            slots[node] = slot.clone();
        } else {
            debug_assert_eq!(node, slots.len(), "slots are added in order");
            slots.push(slot.clone());
        }
        drop(slots);
        let i = Arc::downgrade(inner);
        let max = inner.reconnect_max;
        let task = tokio::spawn(connection_manager(i, node, slot, max));
        let mut managers = inner.managers.lock().unwrap_or_else(|e| e.into_inner());
        managers.retain(|t| !t.is_finished());
        managers.push(task);
    }

    /// Applies one resolution of a `dns:` name: addresses not yet known
    /// join (a slot and a manager each), known ones of this name that are
    /// gone are retired.
    fn discovered(inner: &Arc<Inner>, role: u8, mine: &mut Vec<String>, found: Vec<String>) {
        let mut start = Vec::new();
        {
            let mut st = inner.state.lock().unwrap_or_else(|e| e.into_inner());
            for addr in &found {
                let Some(node) = st.gw.add_node(role, addr) else {
                    tracing::warn!(%addr, "node slots full ({}); not adding", transfer::gateway::NODES_MAX);
                    continue;
                };
                let slots = inner.slots.lock().unwrap_or_else(|e| e.into_inner());
                let running = slots
                    .get(node)
                    .is_some_and(|s| s.addr == *addr && !s.stopped.load(Ordering::Acquire));
                drop(slots);
                if !running {
                    start.push((node, addr.clone()));
                }
                if !mine.contains(addr) {
                    tracing::info!(%addr, role = transfer::role_name(role), "node joined");
                }
            }
            for addr in mine.iter().filter(|a| !found.contains(a)) {
                if let Some(node) = st
                    .gw
                    .nodes()
                    .iter()
                    .position(|n| n.role == role && n.addr == *addr && !n.retired)
                {
                    tracing::info!(%addr, role = transfer::role_name(role), "node left discovery: retired");
                    st.gw.retire_node(node);
                }
            }
        }
        *mine = found;
        for (node, addr) in start {
            Inner::manage(inner, node, addr);
        }
    }
}

/// Resolves `name:port` now and every [`RESOLVE_INTERVAL`]; a failed
/// lookup keeps the last answer (a DNS hiccup is not a node leaving).
async fn resolver(inner: Weak<Inner>, role: u8, name: String, port: u16) {
    let mut mine: Vec<String> = Vec::new();
    let mut failing = false;
    loop {
        match tokio::net::lookup_host((name.as_str(), port)).await {
            Ok(addrs) => {
                let mut found: Vec<String> = addrs.map(|a| a.to_string()).collect();
                found.sort();
                found.dedup();
                found.truncate(RESOLVED_ADDRS_MAX);
                failing = false;
                let Some(i) = inner.upgrade() else {
                    return;
                };
                if i.shutting_down.load(Ordering::Acquire) {
                    return;
                }
                Inner::discovered(&i, role, &mut mine, found);
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(%name, port, "cannot resolve: {e}; keeping the last answer");
                }
                failing = true;
            }
        }
        tokio::time::sleep(RESOLVE_INTERVAL).await;
    }
}

async fn connection_manager(inner: Weak<Inner>, node: usize, slot: Arc<Slot>, max: Duration) {
    let mut backoff = Duration::from_millis(50);
    let current = |i: &Inner| {
        let slots = i.slots.lock().unwrap_or_else(|e| e.into_inner());
        slots
            .get(node)
            .is_some_and(|s| s.generation == slot.generation)
    };
    let retired = |i: &Inner| {
        let st = i.state.lock().unwrap_or_else(|e| e.into_inner());
        st.gw.nodes().get(node).is_none_or(|n| n.retired)
    };
    loop {
        let Some(i) = inner.upgrade() else {
            return;
        };
        if i.shutting_down.load(Ordering::Acquire) || !current(&i) || retired(&i) {
            slot.stopped.store(true, Ordering::Release);
            return;
        }
        let key = dial_key(node, slot.generation);
        let dialled = i
            .transport
            .dial_wait(&slot.addr, move |conn| NetEvent::Dialled {
                conn,
                addr: key,
            })
            .await;
        match dialled {
            Ok(_conn) => {
                backoff = Duration::from_millis(50);
                // (The task is aborted when the backend drops, releasing
                // this reference.)
                slot.closed.notified().await;
                tracing::warn!(node = %slot.addr, "connection to node lost; reconnecting");
            }
            Err(why) => {
                tracing::debug!(node = %slot.addr, "cannot connect: {why}");
                drop(i);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(max);
            }
        }
    }
}

impl Drop for GatewayBackend {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        for t in self
            .inner
            .managers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            t.abort();
        }
        self.inner.transport.close_all();
    }
}

impl Backend for GatewayBackend {
    fn submit(&self, req: GenRequest) -> Result<RequestHandle, RequestError> {
        if self.inner.shutting_down.load(Ordering::Acquire) {
            return Err(RequestError::ShuttingDown);
        }
        let n = self.inner.next_req.fetch_add(1, Ordering::Relaxed);
        let id = RequestId((self.inner.nonce << 40) | n);
        let (etx, erx) = request::event_channel();
        let pages = Arc::new(AtomicU64::new(request::PAGES_UNKNOWN));
        // The request span: under the caller's `traceparent`, or a new
        // trace; its id is the parent of every node's span for it.
        let span = self.inner.telemetry.start("request", req.trace, id);
        let mut spec = gen_spec(&req);
        spec.trace = Some(Box::new(span.context()));
        {
            let mut st = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
            let st = &mut *st;
            let mut out = Vec::new();
            let before = st.clients.insert(
                id,
                Client {
                    events: etx,
                    submitted_at: Instant::now(),
                    first_token_at: None,
                    prompt_tokens: req.prompt.len(),
                    pages: pages.clone(),
                    span: RequestSpan {
                        span: Some(span),
                        finished: false,
                    },
                },
            );
            // Ids are a per-process nonce and a counter: never reused.
            assert!(before.is_none(), "request id {id} submitted twice");
            if let Err(r) = st.gw.submit(
                id,
                req.tenant,
                req.prompt,
                req.max_tokens.min(u32::MAX as usize) as u32,
                spec,
                &mut out,
            ) {
                st.clients.remove(&id);
                return Err(refusal_error(r));
            }
            self.inner.execute(st, out);
        }
        let weak = Arc::downgrade(&self.inner);
        Ok(RequestHandle::new(
            id,
            erx,
            Box::new(move || {
                if let Some(i) = weak.upgrade() {
                    i.cancel(id);
                }
            }),
        )
        .with_pages_cell(pages))
    }

    fn max_request_tokens(&self) -> usize {
        let st = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        st.gw.max_request_tokens() as usize
    }

    fn stats(&self) -> EngineStats {
        let st = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        EngineStats {
            running: st.gw.requests(),
            ..EngineStats::default()
        }
    }

    fn shutdown(&self, drain: bool) {
        self.inner.shutting_down.store(true, Ordering::Release);
        if drain {
            return;
        }
        let ids: Vec<RequestId> = {
            let st = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
            st.clients.keys().copied().collect()
        };
        for id in ids {
            let mut st = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
            let st = &mut *st;
            if let Some(c) = st.clients.remove(&id) {
                let _ = c.events.try_send(Event::Error(RequestError::ShuttingDown));
            }
            let mut out = Vec::new();
            st.gw.cancel(id, &mut out);
            self.inner.execute(st, out);
        }
    }

    fn ready(&self) -> bool {
        let st = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        st.gw.ready()
    }

    fn metric_samples(&self) -> Vec<MetricSample> {
        let st = self.inner.state.lock().unwrap_or_else(|e| e.into_inner());
        gateway_samples(&st.gw, &self.inner.transport, st.too_slow_total)
    }
}

/// The gateway's metric families, declared once: what its
/// [`gateway_samples`] export (its nodes' own are `pd::node`'s, added by
/// `nodes::WithNodeMetrics`).
pub const GATEWAY_FAMILIES: &[Family] = &[
    G_REQUESTS_TOTAL,
    G_REFUSED_LIMIT_TOTAL,
    G_REFUSED_UNAVAILABLE_TOTAL,
    G_REJECTED_BY_DECODE_TOTAL,
    G_REJECTED_BY_PREFILL_TOTAL,
    G_FINISHED_TOTAL,
    G_CANCELS_RESERVING_TOTAL,
    G_CANCELS_PREFILLING_TOTAL,
    G_CANCELS_STREAMING_TOTAL,
    G_CLIENT_TOO_SLOW_TOTAL,
    G_FAILED_NODE_LOST_TOTAL,
    G_NODES_LOST_TOTAL,
    G_HANDSHAKES_REFUSED_TOTAL,
    G_PROTOCOL_ERRORS_TOTAL,
    G_TRANSPORT_BYTES_RECEIVED_TOTAL,
    G_TRANSPORT_BYTES_SENT_TOTAL,
    G_AFFINITY_ROUTED_TOTAL,
    G_LOAD_REPORTS_TOTAL,
    G_LOAD_ROUTED_TOTAL,
    G_REPLACED_DRAINING_TOTAL,
    G_REPLACED_NODE_LOST_TOTAL,
    G_TRANSPORT_TLS_HANDSHAKES_REFUSED_TOTAL,
    G_NODE_UP,
    G_NODE_REQUESTS,
    G_NODE_RETIRED,
    G_NODE_DRAINING,
    G_NODE_MAX_REQUEST_TOKENS,
    G_MAX_REQUEST_TOKENS,
    G_NODE_REQUESTS_QUEUED,
    G_NODE_REQUESTS_RUNNING,
    G_NODE_KV_PAGES_FREE,
    G_NODE_KV_PAGES_TOTAL,
];

const G_REQUESTS_TOTAL: Family = Family::counter(
    "isoserve_gateway_requests_total",
    "Requests submitted to the gateway",
);
const G_REFUSED_LIMIT_TOTAL: Family = Family::counter(
    "isoserve_gateway_refused_limit_total",
    "Requests over the advertised window, refused before any node",
);
const G_REFUSED_UNAVAILABLE_TOTAL: Family = Family::counter(
    "isoserve_gateway_refused_unavailable_total",
    "Requests refused: no pair up or too many in flight",
);
const G_REJECTED_BY_DECODE_TOTAL: Family = Family::counter(
    "isoserve_gateway_rejected_by_decode_total",
    "Requests a decode node refused or failed",
);
const G_REJECTED_BY_PREFILL_TOTAL: Family = Family::counter(
    "isoserve_gateway_rejected_by_prefill_total",
    "Requests a prefill node refused or failed",
);
const G_FINISHED_TOTAL: Family =
    Family::counter("isoserve_gateway_finished_total", "Requests that finished");
const G_CANCELS_RESERVING_TOTAL: Family = Family::counter(
    "isoserve_gateway_cancels_reserving_total",
    "Client cancels while reserving on decode",
);
const G_CANCELS_PREFILLING_TOTAL: Family = Family::counter(
    "isoserve_gateway_cancels_prefilling_total",
    "Client cancels while prefill computed or transferred",
);
const G_CANCELS_STREAMING_TOTAL: Family = Family::counter(
    "isoserve_gateway_cancels_streaming_total",
    "Client cancels while tokens streamed",
);
const G_CLIENT_TOO_SLOW_TOTAL: Family = Family::counter(
    "isoserve_gateway_client_too_slow_total",
    "Requests ended because their client fell REQUEST_EVENTS_MAX events behind",
);
const G_FAILED_NODE_LOST_TOTAL: Family = Family::counter(
    "isoserve_gateway_failed_node_lost_total",
    "Requests failed because a node was lost",
);
const G_NODES_LOST_TOTAL: Family =
    Family::counter("isoserve_gateway_nodes_lost_total", "Node connections lost");
const G_HANDSHAKES_REFUSED_TOTAL: Family = Family::counter(
    "isoserve_gateway_handshakes_refused_total",
    "Pairings refused (fingerprint, layout or role mismatch)",
);
const G_PROTOCOL_ERRORS_TOTAL: Family = Family::counter(
    "isoserve_gateway_protocol_errors_total",
    "Messages a node may not send",
);
const G_TRANSPORT_BYTES_RECEIVED_TOTAL: Family = Family::counter(
    "isoserve_gateway_transport_bytes_received_total",
    "Bytes received from nodes",
);
const G_TRANSPORT_BYTES_SENT_TOTAL: Family = Family::counter(
    "isoserve_gateway_transport_bytes_sent_total",
    "Bytes sent to nodes",
);
const G_AFFINITY_ROUTED_TOTAL: Family = Family::counter(
    "isoserve_gateway_affinity_routed_total",
    "Requests sent to their tenant's previous prefill node (its prefix cache) over a less-loaded one",
);
const G_LOAD_REPORTS_TOTAL: Family = Family::counter(
    "isoserve_gateway_load_reports_total",
    "Load reports received from nodes (queued and running requests, free pages)",
);
const G_LOAD_ROUTED_TOTAL: Family = Family::counter(
    "isoserve_gateway_load_routed_total",
    "Requests placed on another pair than the gateway's own counts would pick, because of what nodes reported",
);
const G_REPLACED_DRAINING_TOTAL: Family = Family::counter(
    "isoserve_gateway_replaced_draining_total",
    "Requests placed on another pair because a node refused them while draining",
);
const G_REPLACED_NODE_LOST_TOTAL: Family = Family::counter(
    "isoserve_gateway_replaced_node_lost_total",
    "Requests placed on another pair because a node holding them was lost before any token reached the client",
);
const G_TRANSPORT_TLS_HANDSHAKES_REFUSED_TOTAL: Family = Family::counter(
    "isoserve_gateway_transport_tls_handshakes_refused_total",
    "TLS handshakes with nodes that failed (another CA, wrong name, plaintext, too slow)",
);
const G_NODE_UP: Family = Family::gauge(
    "isoserve_gateway_node_up",
    "Whether the gateway is paired with the node",
)
.with_labels(&["node", "role"]);
const G_NODE_REQUESTS: Family = Family::gauge(
    "isoserve_gateway_node_requests",
    "Requests this gateway has placed on the node and not yet seen end",
)
.with_labels(&["node"]);
const G_NODE_RETIRED: Family = Family::gauge(
    "isoserve_gateway_node_retired",
    "The node left discovery: no new requests; what runs there finishes",
)
.with_labels(&["node"]);
const G_NODE_DRAINING: Family = Family::gauge(
    "isoserve_gateway_node_draining",
    "The node refused a request as draining: no new requests until it reconnects",
)
.with_labels(&["node"]);
const G_NODE_MAX_REQUEST_TOKENS: Family = Family::gauge(
    "isoserve_gateway_node_max_request_tokens",
    "The limit the node last advertised (K8)",
)
.with_labels(&["node"]);
const G_MAX_REQUEST_TOKENS: Family = Family::gauge(
    "isoserve_gateway_max_request_tokens",
    "The advertised limit: min over the model and every node",
);
const G_NODE_REQUESTS_QUEUED: Family = Family::gauge(
    "isoserve_gateway_node_requests_queued",
    "Requests the node last reported admitted but not running (every gateway's)",
)
.with_labels(&["node"]);
const G_NODE_REQUESTS_RUNNING: Family = Family::gauge(
    "isoserve_gateway_node_requests_running",
    "Requests the node last reported in its engine's batch (every gateway's)",
)
.with_labels(&["node"]);
const G_NODE_KV_PAGES_FREE: Family = Family::gauge(
    "isoserve_gateway_node_kv_pages_free",
    "KV pages the node last reported free (idle cached ones included)",
)
.with_labels(&["node"]);
const G_NODE_KV_PAGES_TOTAL: Family = Family::gauge(
    "isoserve_gateway_node_kv_pages_total",
    "KV pages in the node's pool, as last reported",
)
.with_labels(&["node"]);

/// The gateway's counters and its view of the nodes, as samples for the
/// HTTP layer's Prometheus encoder.
pub fn gateway_samples(gw: &Gateway, t: &Transport, too_slow_total: u64) -> Vec<MetricSample> {
    let s = gw.stats();
    let mut o = Vec::new();
    let mut counter = |f: &Family, v: u64| o.push(f.sample(v as f64));
    counter(&G_REQUESTS_TOTAL, s.requests_total);
    counter(&G_REFUSED_LIMIT_TOTAL, s.refused_limit_total);
    counter(&G_REFUSED_UNAVAILABLE_TOTAL, s.refused_unavailable_total);
    counter(&G_REJECTED_BY_DECODE_TOTAL, s.rejected_by_decode_total);
    counter(&G_REJECTED_BY_PREFILL_TOTAL, s.rejected_by_prefill_total);
    counter(&G_FINISHED_TOTAL, s.finished_total);
    counter(&G_CANCELS_RESERVING_TOTAL, s.cancels_reserving_total);
    counter(&G_CANCELS_PREFILLING_TOTAL, s.cancels_prefilling_total);
    counter(&G_CANCELS_STREAMING_TOTAL, s.cancels_streaming_total);
    counter(&G_CLIENT_TOO_SLOW_TOTAL, too_slow_total);
    counter(&G_FAILED_NODE_LOST_TOTAL, s.failed_node_lost_total);
    counter(&G_NODES_LOST_TOTAL, s.nodes_lost_total);
    counter(&G_HANDSHAKES_REFUSED_TOTAL, s.handshakes_refused_total);
    counter(&G_PROTOCOL_ERRORS_TOTAL, s.protocol_errors_total);
    counter(
        &G_TRANSPORT_BYTES_RECEIVED_TOTAL,
        t.stats.bytes_received_total.load(Ordering::Relaxed),
    );
    counter(
        &G_TRANSPORT_BYTES_SENT_TOTAL,
        t.stats.bytes_sent_total.load(Ordering::Relaxed),
    );
    counter(&G_AFFINITY_ROUTED_TOTAL, s.affinity_routed_total);
    counter(&G_LOAD_REPORTS_TOTAL, s.load_reports_total);
    counter(&G_LOAD_ROUTED_TOTAL, s.load_routed_total);
    counter(&G_REPLACED_DRAINING_TOTAL, s.replaced_draining_total);
    counter(&G_REPLACED_NODE_LOST_TOTAL, s.replaced_node_lost_total);
    counter(
        &G_TRANSPORT_TLS_HANDSHAKES_REFUSED_TOTAL,
        t.stats.tls_handshakes_refused_total.load(Ordering::Relaxed),
    );
    for n in gw.nodes() {
        let role = if n.role == ROLE_DECODE {
            "decode"
        } else {
            "prefill"
        };
        o.push(
            G_NODE_UP
                .sample(f64::from(u8::from(n.up())))
                .label("node", n.addr.clone())
                .label("role", role),
        );
    }
    for n in gw.nodes() {
        o.push(
            G_NODE_REQUESTS
                .sample(n.inflight as f64)
                .label("node", n.addr.clone()),
        );
        if n.retired {
            o.push(G_NODE_RETIRED.sample(1.0).label("node", n.addr.clone()));
        }
        if n.draining {
            o.push(G_NODE_DRAINING.sample(1.0).label("node", n.addr.clone()));
        }
    }
    for n in gw.nodes() {
        let Some(l) = n.load else { continue };
        for (f, v) in [
            (&G_NODE_REQUESTS_QUEUED, l.queued),
            (&G_NODE_REQUESTS_RUNNING, l.running),
            (&G_NODE_KV_PAGES_FREE, l.pages_free),
            (&G_NODE_KV_PAGES_TOTAL, l.pages_total),
        ] {
            o.push(f.sample(f64::from(v)).label("node", n.addr.clone()));
        }
    }
    for n in gw.nodes() {
        if let Some(l) = n.last_limit {
            o.push(
                G_NODE_MAX_REQUEST_TOKENS
                    .sample(l as f64)
                    .label("node", n.addr.clone()),
            );
        }
    }
    o.push(G_MAX_REQUEST_TOKENS.sample(gw.max_request_tokens() as f64));
    o
}
