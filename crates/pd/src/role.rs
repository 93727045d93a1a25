//! The engine in a PD role: a prefill node or a decode node. One thread
//! owns the batch core ([`engine::Core`]: model, pool, batch) and the
//! role's transfer state machine ([`transfer::prefill::PrefillNode`] or
//! [`transfer::decode::DecodeNode`]), joined by the glue in
//! [`transfer::node`] — the same code the simulator and the model checker
//! run, with the batch core plugged in as its [`NodeEngine`]. The network
//! is outside: a transport feeds [`NetEvent`]s in through a bounded channel
//! and carries out the [`NetCommand`]s the node hands to its callback.
//! Nothing here opens a socket or reads a clock for a decision (clocks
//! only time transfers for `/metrics`).
//!
//! * **Prefill**: a `Prefill` message is validated (K8 on this node, then
//!   every parameter) before the machine allocates; the machine's
//!   `Compute` runs as a prefill-only request in the batch (chunked with
//!   other prompts), whose first sampled token goes back to the machine,
//!   which sends the pages and `Done`.
//! * **Decode**: a `Reserve` is validated the same way; once the machine
//!   has checked a transfer (K6, K7, K10) its `StartDecode` becomes a
//!   decode-only request in the batch; tokens stream to the gateway as
//!   `Token` messages, the end goes back to the machine, which frees the
//!   pages and sends `Finished`.

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use engine::{
    CapacityInfo, Core, DecodeJob, EngineConfig, EngineStats, Event, Outcome, PrefillJob,
    StartError,
};
use kv::{DType, Pool, RequestId, TenantId};
use model::Model;
use request::RequestError;
use tokenizer::Tokenizer;
use transfer::convert::{engine_logprobs, gen_request, params_of, refusal_of, wire_logprobs};
use transfer::decode::{DecodeConfig, DecodeNode, DecodeStart, DecodeStats};
use transfer::node::{self, DecodeEngine, DecodeReport, NodeEngine, PrefillEngine, PrefillReport};
pub use transfer::node::{NetCommand, NetEvent};
use transfer::prefill::{ComputeJob, PrefillConfig, PrefillNode, PrefillStats};
use transfer::wire::{GenSpec, KvLayout, Message, Refusal};
use transfer::Identity;

/// Which PD role a node plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PdRole {
    Prefill,
    Decode,
}

/// Settings of the PD protocol on a node.
#[derive(Clone, Debug)]
pub struct PdConfig {
    /// This node's name (unique in a deployment).
    pub node: String,
    /// The model's fingerprint (`gguf::GgufFile::fingerprint`).
    pub fingerprint: [u8; 32],
    /// Pages in flight per transfer before an acknowledgement (the bounded
    /// transfer batch).
    pub transfer_window_pages: u32,
    /// Requests the node knows at once.
    pub requests_max: usize,
    /// Requests waiting for free pages.
    pub waiting_max: usize,
    /// Events waiting for the node thread (the transport blocks beyond).
    pub events_max: usize,
    /// Where the node's request spans go (the log; OTLP with
    /// `--otlp-endpoint`).
    pub telemetry: telemetry::Telemetry,
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig {
            node: "node".into(),
            fingerprint: [0; 32],
            transfer_window_pages: 8,
            requests_max: 256,
            waiting_max: 256,
            events_max: 1024,
            telemetry: telemetry::Telemetry::logs_only("isoserve-node"),
        }
    }
}

/// Counters of a PD node: the engine's and its transfer machine's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PdStats {
    pub engine: EngineStats,
    pub prefill: Option<PrefillStats>,
    pub decode: Option<DecodeStats>,
    /// Requests the node knows (all phases).
    pub requests: usize,
    /// The node is draining: it takes no new request.
    pub draining: bool,
    /// Decode: wall time from a transfer's first page to its checked end,
    /// summed over completed transfers (with `decode.page_bytes_received`
    /// this gives the transfer rate). Measured by the node loop, not the
    /// state machine (which has no clock).
    pub transfer_seconds_total: f64,
    pub transfers_timed_total: u64,
    /// Transfers in flight (kept only while the console reads them).
    pub transfers: Vec<request::console::TransferView>,
}

/// A node's machine and batch core, joined by the shared glue.
enum Glue {
    Prefill(node::Prefill<CoreEngine>),
    Decode(node::Decode<CoreEngine>),
}

/// A running PD node.
pub struct PdNode {
    role: PdRole,
    tx: SyncSender<Option<NetEvent>>,
    capacity: CapacityInfo,
    layout: KvLayout,
    stats: Arc<Mutex<PdStats>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    drain: Arc<std::sync::atomic::AtomicBool>,
    console: Arc<engine::console::ConsoleCell>,
    name: String,
    /// The node's grammar compiler, shared with its engine: requests'
    /// grammars are compiled as their messages arrive, on the thread that
    /// hands events in, so the node thread finds them in the cache.
    grammar: Arc<grammar::Compiler>,
}

/// The KV layout a node advertises (must match its peer's exactly).
pub fn kv_layout(model: &Model, cfg: &EngineConfig) -> KvLayout {
    KvLayout {
        page_size: cfg.page_size_tokens as u32,
        dtype: match cfg.kv_dtype {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q8_0 => 2,
        },
        layers: model.config.n_layer as u32,
        kv_heads: model.config.n_kv_head as u32,
        head_dim: model.config.head_dim as u32,
    }
}

impl PdNode {
    /// Measures the pool (K8, as [`engine::Engine::start`]), allocates it and
    /// starts the node thread. `commands` is called on that thread and must
    /// not block (queue the command and return).
    pub fn start(
        role: PdRole,
        model: Model,
        tokenizer: Tokenizer,
        cfg: EngineConfig,
        pd: PdConfig,
        commands: Box<dyn FnMut(NetCommand) + Send>,
    ) -> Result<PdNode, StartError> {
        // Only decode nodes speculate: a prefill node's draft would idle.
        let draft = match role {
            PdRole::Decode => engine::load_draft(&model, &cfg)?,
            PdRole::Prefill => None,
        };
        let model = model::Runner::new(model, cfg.step_tokens);
        let (shape, pages, mut capacity) = engine::measure(&model, &cfg)?;
        if role == PdRole::Decode {
            // Decode receives every page; only prefill nodes cache.
            capacity.prefix_cache = engine::PrefixCache::Off;
        }
        if pd.transfer_window_pages == 0 || pd.requests_max == 0 || pd.events_max == 0 {
            return Err(StartError::Config(
                "transfer window, request and event limits must be positive".into(),
            ));
        }
        let layout = kv_layout(model.model(), &cfg);
        let identity = Identity {
            node: pd.node.clone(),
            fingerprint: pd.fingerprint,
            layout,
            max_request_tokens: capacity.max_request_tokens.min(u32::MAX as usize) as u32,
        };
        let vocab = model.model().config.vocab as u32;
        #[allow(unused_mut)]
        let mut pool = kv::Pool::new(shape, pages, kv::PoolOptions { poison: cfg.poison })?;
        let stats = Arc::new(Mutex::new(PdStats::default()));
        let waiting = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let max_request = capacity.max_request_tokens;
        let prefix_cache = cfg.prefix_cache;
        #[cfg(feature = "fault-incident")]
        incident_pool(&mut pool);
        // The batch core, the glue's engine on either role.
        let name = pd.node.clone();
        let grammar = grammar::Vocabulary::from_tokenizer(&tokenizer)
            .and_then(|v| grammar::Compiler::new(v, grammar::Limits::default()))
            .map(Arc::new)
            .map_err(|e| StartError::Config(format!("the grammar engine: {e}")))?;
        let mut core = Core::new(
            model,
            tokenizer,
            pool,
            cfg,
            max_request,
            Arc::new(Mutex::new(EngineStats::default())),
            waiting,
        );
        if let Some(d) = draft {
            core.set_draft(d)?;
        }
        let engine = CoreEngine::new(core, grammar.clone());
        let glue = match role {
            PdRole::Prefill => {
                let machine = PrefillNode::new(PrefillConfig {
                    identity,
                    vocab,
                    requests_max: pd.requests_max,
                    queue_max: pd.waiting_max,
                    window_pages: pd.transfer_window_pages,
                    tombstones_max: 4096,
                    prefix_keys: match prefix_cache {
                        engine::PrefixCache::Tenant => Some(kv::PrefixKeys::random()),
                        engine::PrefixCache::Off => None,
                    },
                });
                #[cfg(feature = "fault-incident")]
                let machine = incident_prefill(machine);
                Glue::Prefill(node::Prefill::new(machine, engine))
            }
            PdRole::Decode => {
                let machine = DecodeNode::new(DecodeConfig {
                    identity,
                    vocab,
                    requests_max: pd.requests_max,
                    waiting_max: pd.waiting_max,
                    ack_every_pages: pd.transfer_window_pages.div_ceil(2).max(1),
                });
                #[cfg(feature = "fault-incident")]
                let machine = incident_decode(machine);
                Glue::Decode(node::Decode::new(machine, engine))
            }
        };
        let console = match &glue {
            Glue::Prefill(g) => g.engine.core.console(),
            Glue::Decode(g) => g.engine.core.console(),
        };
        let (tx, rx) = mpsc::sync_channel(pd.events_max);
        let drain = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let node = NodeLoop {
            glue,
            commands,
            stats: stats.clone(),
            drain: drain.clone(),
            load_reported: Instant::now(),
            spans: crate::spans::NodeSpans::new(pd.telemetry.clone()),
        };
        let thread = std::thread::Builder::new()
            .name(match role {
                PdRole::Prefill => "isoserve-prefill".into(),
                PdRole::Decode => "isoserve-decode".into(),
            })
            .spawn(move || node.run(rx))
            .map_err(|e| StartError::Config(format!("cannot start the node thread: {e}")))?;
        Ok(PdNode {
            role,
            tx,
            capacity,
            layout,
            stats,
            thread: Mutex::new(Some(thread)),
            drain,
            console,
            name,
            grammar,
        })
    }

    pub fn role(&self) -> PdRole {
        self.role
    }

    pub fn capacity(&self) -> &CapacityInfo {
        &self.capacity
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// Hands an event to the node thread; blocks while its queue is full
    /// (back-pressure on the transport). False once the node stopped.
    pub fn event(&self, ev: NetEvent) -> bool {
        self.precompile(&ev);
        self.tx.send(Some(ev)).is_ok()
    }

    /// Compiles the grammar of a request that arrives (in its scope), so
    /// the node thread's compile is a cache hit: compiling never stalls
    /// the node's engine. A grammar that does not compile is left to the
    /// node thread, whose `check` refuses the request with the error.
    fn precompile(&self, ev: &NetEvent) {
        let NetEvent::Message { msg, .. } = ev else {
            return;
        };
        let (tenant, gen) = match msg {
            Message::Reserve { tenant, gen, .. } | Message::Prefill { tenant, gen, .. } => {
                (*tenant, gen)
            }
            _ => return,
        };
        if let Some(spec) = gen.grammar.as_deref() {
            let scope = request::Scope::of(tenant, gen.cache_scope);
            let _ = self.grammar.compile(scope, spec);
        }
    }

    pub fn stats(&self) -> PdStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// What the operator console shows of this node: its pool map (taken
    /// by the node thread, which wakes at least every 250 ms), its pool's
    /// and its transfer machine's safety counters, its transfers in flight.
    /// Blocks at most [`engine::console::FRESH_WAIT`].
    pub fn console_view(&self) -> request::console::NodeView {
        use request::console::SafetyCounter;
        let snap = self.console.read(|| {});
        let mut s = self.stats();
        let transfers = std::mem::take(&mut s.transfers);
        let role = match self.role {
            PdRole::Prefill => "prefill",
            PdRole::Decode => "decode",
        };
        let mut v = engine::console::node_view(&self.name, role, &snap, &s.engine.pool, transfers);
        let mut push = |name: &str, value: u64| {
            v.safety.push(SafetyCounter {
                name: format!("transfer_{name}"),
                value,
            })
        };
        if let Some(d) = &s.decode {
            push("checksum", d.checksum_failures_total);
            push("canary", d.canary_failures_total);
            push("fenced_pages", d.pages_fenced_total);
            push("late_pages", d.pages_late_total);
            push("duplicate_pages", d.duplicate_pages_total);
            push("incomplete", d.incomplete_transfers_total);
            push("protocol_errors", d.protocol_errors_total);
            push("handshakes_refused", d.handshakes_refused_total);
        }
        if let Some(p) = &s.prefill {
            push("protocol_errors", p.protocol_errors_total);
            push("handshakes_refused", p.handshakes_refused_total);
        }
        v
    }

    /// Starts draining: new requests are refused as `draining` (the
    /// gateway places them on another pair), those in flight run to their
    /// end. Seen by the node loop within its idle poll (500 ms); watch
    /// [`PdStats::requests`] reach 0 (and [`PdStats::draining`]), then
    /// [`Self::shutdown`].
    pub fn drain(&self) {
        self.drain.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Stops the node thread (running requests end with the process; the
    /// transport's connections close and peers release their side).
    pub fn shutdown(&self) {
        let _ = self.tx.send(None);
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

impl Drop for PdNode {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// `fault-incident` only: the incident on a PD node. Prefill answers a
/// prompt over its limit with a one-token placeholder reported complete;
/// decode starts on `Done` without checking that every reserved page
/// arrived, and reads the pages nobody wrote as the last owner left them
/// (watermark check and poisoning off).
#[cfg(feature = "fault-incident")]
fn incident_pool(pool: &mut kv::Pool) {
    tracing::error!(
        "FAULT-INCIDENT BUILD: over-long prompts become one-token placeholders and decode reads \
         pages nobody wrote; for testing isoserve probe only"
    );
    pool.set_faults(kv::Faults::incident());
}

#[cfg(feature = "fault-incident")]
fn incident_prefill(mut m: PrefillNode) -> PrefillNode {
    m.set_mutations(transfer::prefill::PrefillMutations {
        placeholder: true,
        // As the unified engine's: one prefix-cache scope for every tenant.
        one_cache_scope: std::env::var_os("ISOSERVE_FAULT_SHARED_CACHE").is_some_and(|v| v == "1"),
        ..Default::default()
    });
    m
}

#[cfg(feature = "fault-incident")]
fn incident_decode(mut m: DecodeNode) -> DecodeNode {
    m.set_mutations(transfer::decode::DecodeMutations {
        skip_completeness_check: true,
        ..Default::default()
    });
    m
}

/// Transfers being timed at once (beyond it the oldest timings are
/// dropped: they belong to transfers that failed).
const TIMED_TRANSFERS_MAX: usize = 4096;

struct NodeLoop {
    glue: Glue,
    commands: Box<dyn FnMut(NetCommand) + Send>,
    stats: Arc<Mutex<PdStats>>,
    /// Set by [`PdNode::drain`]; the loop hands it to the machine.
    drain: Arc<std::sync::atomic::AtomicBool>,
    /// When the node last told its gateways its load.
    load_reported: Instant,
    /// Each traced request's current phase (queue, prefill, transfer,
    /// decode), ended into a span.
    spans: crate::spans::NodeSpans,
}

/// How often a node tells its gateways its load (`Message::Load`): often
/// enough that a burst of requests spreads by what nodes hold, not only by
/// what one gateway sent; a 30-byte frame per gateway each time.
const LOAD_REPORT_INTERVAL: Duration = Duration::from_millis(250);

/// The batch core as the glue's engine, on either role.
struct CoreEngine {
    core: Core,
    /// Decode: when each transfer's first page arrived (for `/metrics`).
    transfer_started: HashMap<RequestId, Instant>,
    transfer_seconds_total: f64,
    transfers_timed_total: u64,
    outbox: Vec<Outcome>,
    /// Prefill: requests whose compute started since the loop last looked
    /// (their `queue` span ends there).
    computing: Vec<RequestId>,
    /// The node's grammar compiler, cached per cache scope (K11): the
    /// event thread compiles a request's grammar as it arrives
    /// ([`PdNode::event`]); `check` finds it in the cache (or refuses the
    /// request with its error, the client's 400) and so does the start.
    grammar: Arc<grammar::Compiler>,
}

impl CoreEngine {
    fn new(core: Core, grammar: Arc<grammar::Compiler>) -> CoreEngine {
        CoreEngine {
            core,
            grammar,
            transfer_started: HashMap::new(),
            transfer_seconds_total: 0.0,
            transfers_timed_total: 0,
            outbox: Vec::new(),
            computing: Vec::new(),
        }
    }

    /// The request's grammar compiled in its scope (a cache hit after
    /// `check`).
    fn compile(
        &self,
        scope: request::Scope,
        gen: &GenSpec,
    ) -> Result<Option<Arc<grammar::Compiled>>, RequestError> {
        gen.grammar
            .as_deref()
            .map(|spec| {
                self.grammar
                    .compile(scope, spec)
                    .map_err(|e| RequestError::InvalidParam {
                        field: "response_format",
                        why: format!("{}: {e}", spec.noun()),
                    })
            })
            .transpose()
    }

    /// A page of a transfer arrived: start its clock.
    fn page_arrived(&mut self, req: RequestId) {
        if self.transfer_started.len() >= TIMED_TRANSFERS_MAX {
            self.transfer_started.clear();
        }
        self.transfer_started
            .entry(req)
            .or_insert_with(Instant::now);
    }
}

impl NodeEngine for CoreEngine {
    fn pool(&mut self) -> &mut Pool {
        self.core.pool_mut()
    }

    /// The unified engine's rules for every parameter; the window is the
    /// machine's check (it counts it, and prefill tells decode at once).
    fn check(
        &mut self,
        tenant: TenantId,
        tokens: &[u32],
        max_tokens: u32,
        gen: &GenSpec,
    ) -> Result<(), Refusal> {
        let req = gen_request(tenant, tokens, max_tokens, gen);
        engine::validate(&req, usize::MAX, self.core.vocab())
            .and_then(|()| self.compile(req.scope(), gen).map(drop))
            .map_err(|e| {
                self.core.count_refused();
                refusal_of(&e)
            })
    }

    fn stop(&mut self, req: RequestId) {
        self.core.stop_remote(req);
        // The machine ended it: the engine must not run it any more.
        assert!(
            !self.core.runs(req),
            "request {req} still runs after its stop"
        );
    }

    fn running(&mut self) -> usize {
        self.core.running()
    }
}

impl PrefillEngine for CoreEngine {
    fn compute(&mut self, job: ComputeJob) {
        // The machine hands a request to the engine once.
        assert!(
            !self.core.runs(job.req),
            "request {} computed twice",
            job.req
        );
        if job.gen.trace.is_some() && self.computing.len() < crate::spans::TRACKED_MAX {
            self.computing.push(job.req);
        }
        let grammar = match self.compile(job.owner.scope, &job.gen) {
            Ok(g) => g,
            Err(e) => {
                // `check` compiled it; only an eviction in between and a
                // failed recompile lands here: the request fails whole.
                self.outbox.push(Outcome::Event {
                    req: job.req,
                    conn: 0,
                    event: Event::Error(e),
                });
                return;
            }
        };
        self.core.start_prefill(PrefillJob {
            req: job.req,
            owner: job.owner,
            prompt: job.tokens,
            params: params_of(&job.gen),
            logprobs: job.gen.logprobs.map(usize::from),
            pages: job.pages,
            cached_tokens: job.cached_tokens as usize,
            priority: job.gen.priority,
            weight: job.gen.weight,
            grammar,
        });
    }

    fn take_reports(&mut self, out: &mut Vec<PrefillReport>) {
        self.core.take_outbox(&mut self.outbox);
        for o in self.outbox.drain(..) {
            match o {
                Outcome::Computed {
                    req,
                    first,
                    logprobs,
                    sampler_state,
                } => out.push(PrefillReport::Computed {
                    req,
                    first,
                    logprobs: wire_logprobs(logprobs),
                    sampler_state,
                }),
                // A prefill-only request only ends in an error (a failed
                // forward step, or its grammar).
                Outcome::Event {
                    req,
                    event: Event::Error(e),
                    ..
                } => out.push(PrefillReport::Failed {
                    req,
                    error: refusal_of(&e),
                }),
                Outcome::Event { .. } => {}
            }
        }
    }
}

impl DecodeEngine for CoreEngine {
    fn start_decode(&mut self, s: DecodeStart) -> Result<(), Refusal> {
        // The machine starts a request's decode once.
        assert!(!self.core.runs(s.req), "request {} started twice", s.req);
        if let Some(t0) = self.transfer_started.remove(&s.req) {
            self.transfer_seconds_total += t0.elapsed().as_secs_f64();
            self.transfers_timed_total += 1;
        }
        let grammar = self
            .compile(s.owner.scope, &s.gen)
            .map_err(|e| refusal_of(&e))?;
        self.core
            .start_decode(DecodeJob {
                req: s.req,
                owner: s.owner,
                conn: s.conn,
                prompt: s.tokens,
                max_tokens: s.max_tokens as usize,
                params: params_of(&s.gen),
                sampler_state: s.sampler_state,
                stop: s.gen.stop.clone(),
                ignore_eos: s.gen.ignore_eos,
                logprobs: s.gen.logprobs.map(usize::from),
                pages: s.pages,
                first_token: s.first_token,
                first_logprobs: engine_logprobs(s.first_logprobs),
                priority: s.gen.priority,
                weight: s.gen.weight,
                grammar,
                prediction: s.gen.prediction.as_deref().unwrap_or_default().to_vec(),
            })
            .map_err(|e| refusal_of(&e))
    }

    fn take_reports(&mut self, out: &mut Vec<DecodeReport>) {
        self.core.take_outbox(&mut self.outbox);
        for o in self.outbox.drain(..) {
            let Outcome::Event { req, conn, event } = o else {
                debug_assert!(false, "decode computed a prefill");
                continue;
            };
            out.push(match event {
                Event::Token(t) => DecodeReport::Token {
                    req,
                    conn,
                    id: t.id,
                    text: t.text,
                    logprobs: wire_logprobs(t.logprob.map(|lp| (lp, t.top_logprobs))),
                },
                Event::Done(d) => DecodeReport::Finished {
                    req,
                    finish: request::finish_code(d.finish, d.stop_index),
                    completion_tokens: d.usage.completion_tokens as u32,
                    prediction: transfer::wire::PredictionCounts {
                        accepted: d.usage.accepted_prediction_tokens as u32,
                        rejected: d.usage.rejected_prediction_tokens as u32,
                    },
                    tail_text: d.tail_text,
                },
                Event::Error(e) => DecodeReport::Failed {
                    req,
                    error: refusal_of(&e),
                },
            });
        }
    }
}

impl NodeLoop {
    fn engine(&self) -> &CoreEngine {
        match &self.glue {
            Glue::Prefill(g) => &g.engine,
            Glue::Decode(g) => &g.engine,
        }
    }

    fn engine_mut(&mut self) -> &mut CoreEngine {
        match &mut self.glue {
            Glue::Prefill(g) => &mut g.engine,
            Glue::Decode(g) => &mut g.engine,
        }
    }

    fn run(mut self, rx: Receiver<Option<NetEvent>>) {
        loop {
            if self.drain.load(std::sync::atomic::Ordering::Acquire) {
                match &mut self.glue {
                    Glue::Prefill(g) => g.machine.drain(),
                    Glue::Decode(g) => g.machine.drain(),
                }
            }
            // Block while idle; poll while a batch runs. The timeout bounds
            // how long stats and the load report can go stale.
            if self.engine().core.running() == 0 {
                // A console map half taken: its next slice first (commands
                // still taken between slices).
                let wait = if self.engine().core.console_pending() {
                    Duration::ZERO
                } else {
                    LOAD_REPORT_INTERVAL
                };
                match rx.recv_timeout(wait) {
                    Ok(Some(ev)) => self.handle(ev),
                    Ok(None) | Err(RecvTimeoutError::Disconnected) => break,
                    Err(RecvTimeoutError::Timeout) => {}
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(Some(ev)) => self.handle(ev),
                    Ok(None) | Err(mpsc::TryRecvError::Disconnected) => {
                        self.publish();
                        return;
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            self.engine_mut().core.step_if_running();
            let mut cmds = Vec::new();
            match &mut self.glue {
                Glue::Prefill(g) => g.reports(&mut cmds),
                Glue::Decode(g) => g.reports(&mut cmds),
            }
            if self.load_reported.elapsed() >= LOAD_REPORT_INTERVAL {
                self.load_reported = Instant::now();
                match &mut self.glue {
                    Glue::Prefill(g) => g.report_load(&mut cmds),
                    Glue::Decode(g) => g.report_load(&mut cmds),
                }
            }
            self.send(cmds);
            self.publish();
        }
        self.publish();
    }

    fn publish(&mut self) {
        let (requests, draining, prefill, decode) = match &self.glue {
            Glue::Prefill(g) => (
                g.machine.requests(),
                g.machine.draining(),
                Some(g.machine.stats()),
                None,
            ),
            Glue::Decode(g) => (
                g.machine.requests(),
                g.machine.draining(),
                None,
                Some(g.machine.stats()),
            ),
        };
        let e = self.engine_mut();
        e.core.publish();
        let mut engine = e.core.stats().clone();
        engine.pool = e.core.pool().stats();
        if let Some(p) = &prefill {
            // The prefill machine, not the batch core, looks the cache up.
            engine.prefix_cache_queries_total = p.cache_queries_total;
            engine.prefix_cache_query_tokens_total = p.cache_query_tokens_total;
            engine.prefix_cache_hit_pages_total = p.cache_hit_pages_total;
            engine.prefix_cache_hit_tokens_total = p.cache_hit_tokens_total;
        }
        engine.running = e.core.running();
        let (seconds, timed) = (e.transfer_seconds_total, e.transfers_timed_total);
        let mut transfers = Vec::new();
        if e.core.console().wanted() {
            match &self.glue {
                Glue::Prefill(g) => g.machine.transfers(&mut transfers),
                Glue::Decode(g) => g.machine.transfers(&mut transfers),
            }
        }
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.transfers = transfers;
        s.engine = engine;
        s.transfer_seconds_total = seconds;
        s.transfers_timed_total = timed;
        s.prefill = prefill;
        s.decode = decode;
        s.requests = requests;
        s.draining = draining;
    }

    fn send(&mut self, cmds: Vec<NetCommand>) {
        // Computes started by what produced these commands end their
        // requests' queue spans first.
        let started = std::mem::take(&mut self.engine_mut().computing);
        for req in started {
            self.spans.computing(req);
        }
        for c in cmds {
            if let NetCommand::Send { msg, .. } = &c {
                self.spans.outbound(msg);
            }
            (self.commands)(c);
        }
    }

    fn handle(&mut self, ev: NetEvent) {
        if let NetEvent::Message { msg, .. } = &ev {
            self.spans.inbound(msg);
        }
        let mut cmds = Vec::new();
        match &mut self.glue {
            Glue::Prefill(g) => g.event(ev, &mut cmds),
            Glue::Decode(g) => {
                if let NetEvent::Message {
                    msg: Message::Page { req, .. },
                    ..
                } = &ev
                {
                    g.engine.page_arrived(*req);
                }
                g.event(ev, &mut cmds)
            }
        }
        self.send(cmds);
    }
}
