//! The engine in a PD role: a prefill node or a decode node. One thread
//! owns the model, the pool, the batch and the role's transfer state
//! machine ([`transfer::prefill::PrefillNode`] or
//! [`transfer::decode::DecodeNode`]). The network is outside: a transport
//! feeds [`NetEvent`]s in through a bounded channel and carries out the
//! [`NetCommand`]s the node hands to its callback. Nothing here opens a
//! socket or reads a clock for a decision.
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

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kv::DType;
use model::sample::{FinishReason, SamplingParams};
use model::Model;
use tokenizer::Tokenizer;
use transfer::decode::{DecodeAction, DecodeConfig, DecodeNode, DecodeStats};
use transfer::prefill::{PrefillAction, PrefillConfig, PrefillNode, PrefillStats};
use transfer::wire::{GenSpec, KvLayout, Message, Refusal, WireLogprobs};
use transfer::Identity;

use crate::core::{Core, DecodeJob, Outcome, PrefillJob};
use crate::{CapacityInfo, EngineConfig, EngineStats, Event, GenRequest, RequestError, StartError};

/// Which PD role a node plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PdRole {
    Prefill,
    Decode,
}

/// What the transport tells the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NetEvent {
    /// A peer dialled us (a gateway; on decode also a prefill node).
    Accepted {
        conn: u64,
    },
    /// Our dial to `addr` succeeded (prefill → decode).
    Dialled {
        conn: u64,
        addr: String,
    },
    DialFailed {
        addr: String,
        why: String,
    },
    Message {
        conn: u64,
        msg: Message,
    },
    /// The connection ended (peer closed, reset, heartbeat timeout, a frame
    /// that did not parse).
    Closed {
        conn: u64,
    },
}

/// What the node asks of the transport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NetCommand {
    Send { conn: u64, msg: Message },
    Close { conn: u64 },
    Dial { addr: String },
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
    pub window_pages: u32,
    /// Requests the node knows at once.
    pub requests_max: usize,
    /// Requests waiting for free pages.
    pub waiting_max: usize,
    /// Events waiting for the node thread (the transport blocks beyond).
    pub events_max: usize,
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig {
            node: "node".into(),
            fingerprint: [0; 32],
            window_pages: 8,
            requests_max: 256,
            waiting_max: 256,
            events_max: 1024,
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
    /// Decode: wall time from a transfer's first page to its checked end,
    /// summed over completed transfers (with `decode.page_bytes_received`
    /// this gives the transfer rate). Measured by the node loop, not the
    /// state machine (which has no clock).
    pub transfer_seconds_total: f64,
    pub transfers_timed_total: u64,
}

enum Machine {
    Prefill(PrefillNode),
    Decode(DecodeNode),
}

/// A running PD node.
pub struct PdNode {
    role: PdRole,
    tx: SyncSender<Option<NetEvent>>,
    capacity: CapacityInfo,
    layout: KvLayout,
    stats: Arc<Mutex<PdStats>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The KV layout a node advertises (must match its peer's exactly).
pub fn kv_layout(model: &Model, cfg: &EngineConfig) -> KvLayout {
    KvLayout {
        page_size: cfg.page_size_tokens as u32,
        dtype: match cfg.kv_dtype {
            DType::F32 => 0,
            DType::F16 => 1,
        },
        layers: model.config.n_layer as u32,
        kv_heads: model.config.n_kv_head as u32,
        head_dim: model.config.head_dim as u32,
    }
}

impl PdNode {
    /// Measures the pool (K8, as [`crate::Engine::start`]), allocates it and
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
        let (shape, pages, capacity) = crate::measure(&model, &cfg)?;
        if pd.window_pages == 0 || pd.requests_max == 0 || pd.events_max == 0 {
            return Err(StartError::Config(
                "transfer window, request and event limits must be positive".into(),
            ));
        }
        let layout = kv_layout(&model, &cfg);
        let identity = Identity {
            node: pd.node.clone(),
            fingerprint: pd.fingerprint,
            layout,
            max_request_tokens: capacity.max_request_tokens.min(u32::MAX as usize) as u32,
        };
        let vocab = model.config.vocab as u32;
        #[allow(unused_mut)]
        let mut machine = match role {
            PdRole::Prefill => Machine::Prefill(PrefillNode::new(PrefillConfig {
                identity,
                vocab,
                requests_max: pd.requests_max,
                queue_max: pd.waiting_max,
                window_pages: pd.window_pages,
                tombstones_max: 4096,
            })),
            PdRole::Decode => Machine::Decode(DecodeNode::new(DecodeConfig {
                identity,
                vocab,
                requests_max: pd.requests_max,
                waiting_max: pd.waiting_max,
                ack_every_pages: pd.window_pages.div_ceil(2).max(1),
            })),
        };
        #[allow(unused_mut)]
        let mut pool = kv::Pool::new(shape, pages, kv::PoolOptions { poison: cfg.poison })?;
        #[cfg(feature = "fault-incident")]
        incident_faults(&mut machine, &mut pool);
        let stats = Arc::new(Mutex::new(PdStats::default()));
        let waiting = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let max_request = capacity.max_request_tokens;
        let core = Core::new(
            model,
            tokenizer,
            pool,
            cfg,
            max_request,
            Arc::new(Mutex::new(EngineStats::default())),
            waiting,
        );
        let (tx, rx) = mpsc::sync_channel(pd.events_max);
        let node = NodeLoop {
            transfer_started: std::collections::HashMap::new(),
            transfer_seconds_total: 0.0,
            transfers_timed_total: 0,
            core,
            machine,
            commands,
            stats: stats.clone(),
            vocab: vocab as usize,
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
        self.tx.send(Some(ev)).is_ok()
    }

    pub fn stats(&self) -> PdStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
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
fn incident_faults(machine: &mut Machine, pool: &mut kv::Pool) {
    tracing::error!(
        "FAULT-INCIDENT BUILD: over-long prompts become one-token placeholders and decode reads \
         pages nobody wrote; for testing isoserve probe only"
    );
    match machine {
        Machine::Prefill(m) => {
            m.set_mutations(transfer::prefill::PrefillMutations { placeholder: true })
        }
        Machine::Decode(m) => m.set_mutations(transfer::decode::DecodeMutations {
            skip_completeness_check: true,
            ..Default::default()
        }),
    }
    pool.set_faults(kv::Faults {
        skip_watermark_check: true,
        skip_poison: true,
        ..kv::Faults::default()
    });
}

/// Transfers being timed at once (beyond it the oldest timings are
/// dropped: they belong to transfers that failed).
const TIMED_TRANSFERS_MAX: usize = 4096;

struct NodeLoop {
    transfer_started: std::collections::HashMap<u64, std::time::Instant>,
    transfer_seconds_total: f64,
    transfers_timed_total: u64,
    core: Core,
    machine: Machine,
    commands: Box<dyn FnMut(NetCommand) + Send>,
    stats: Arc<Mutex<PdStats>>,
    vocab: usize,
}

/// A request's sampling on the wire → the engine's parameters.
pub fn params_of(g: &GenSpec) -> SamplingParams {
    SamplingParams {
        temperature: g.temperature(),
        top_k: g.top_k as usize,
        top_p: g.top_p(),
        min_p: g.min_p(),
        repetition_penalty: g.repetition_penalty(),
        presence_penalty: g.presence_penalty(),
        frequency_penalty: g.frequency_penalty(),
        seed: g.seed,
    }
}

/// The engine's request → its sampling on the wire.
pub fn gen_spec(req: &GenRequest) -> GenSpec {
    let p = &req.params;
    GenSpec {
        temperature_bits: p.temperature.to_bits(),
        top_k: p.top_k.min(u32::MAX as usize) as u32,
        top_p_bits: p.top_p.to_bits(),
        min_p_bits: p.min_p.to_bits(),
        repetition_penalty_bits: p.repetition_penalty.to_bits(),
        presence_penalty_bits: p.presence_penalty.to_bits(),
        frequency_penalty_bits: p.frequency_penalty.to_bits(),
        seed: p.seed,
        ignore_eos: req.ignore_eos,
        logprobs: req.logprobs.map(|n| n.min(u8::MAX as usize) as u8),
        stop: req.stop.clone(),
    }
}

/// A request as a node receives it → the engine's request (to validate it
/// with the same rules as the unified engine).
pub fn gen_request(tenant: u64, tokens: &[u32], max_tokens: u32, g: &GenSpec) -> GenRequest {
    GenRequest {
        tenant: kv::TenantId(tenant),
        prompt: tokens.to_vec(),
        max_tokens: max_tokens as usize,
        params: params_of(g),
        stop: g.stop.clone(),
        ignore_eos: g.ignore_eos,
        logprobs: g.logprobs.map(usize::from),
    }
}

/// An engine error as the original error on the wire (K9).
pub fn refusal_of(e: &RequestError) -> Refusal {
    let status = match e {
        RequestError::ContextLengthExceeded { .. }
        | RequestError::EmptyPrompt
        | RequestError::InvalidParam { .. } => 400,
        RequestError::QueueFull { .. } => 429,
        RequestError::ShuttingDown => 503,
        RequestError::Internal(_) => 500,
        RequestError::Remote { status, .. } => *status,
    };
    let code = match e {
        RequestError::Remote { code, .. } => code.clone(),
        e => e.kind().to_string(),
    };
    let message = match e {
        RequestError::Remote { message, .. } => message.clone(),
        e => e.to_string(),
    };
    Refusal {
        status,
        code,
        message,
    }
}

fn wire_logprobs(l: Option<(f32, Vec<(u32, f32)>)>) -> Option<WireLogprobs> {
    l.map(|(lp, top)| WireLogprobs {
        logprob_bits: lp.to_bits(),
        top: top.into_iter().map(|(id, v)| (id, v.to_bits())).collect(),
    })
}

fn engine_logprobs(l: Option<WireLogprobs>) -> Option<(f32, Vec<(u32, f32)>)> {
    l.map(|w| {
        (
            f32::from_bits(w.logprob_bits),
            w.top
                .into_iter()
                .map(|(id, b)| (id, f32::from_bits(b)))
                .collect(),
        )
    })
}

impl NodeLoop {
    fn run(mut self, rx: Receiver<Option<NetEvent>>) {
        loop {
            // Block while idle; poll while a batch runs. The timeout only
            // bounds how long stats can go unpublished.
            if self.core.running.is_empty() {
                match rx.recv_timeout(Duration::from_millis(500)) {
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
            self.core.step_if_running();
            self.drain_outbox();
            self.publish();
        }
        self.publish();
    }

    fn publish(&mut self) {
        self.core.publish();
        let mut s = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        s.engine = self.core.local.clone();
        s.engine.pool = self.core.pool.stats();
        s.engine.running = self.core.running.len();
        s.transfer_seconds_total = self.transfer_seconds_total;
        s.transfers_timed_total = self.transfers_timed_total;
        match &self.machine {
            Machine::Prefill(m) => {
                s.prefill = Some(m.stats());
                s.requests = m.requests();
            }
            Machine::Decode(m) => {
                s.decode = Some(m.stats());
                s.requests = m.requests();
            }
        }
    }

    fn send(&mut self, cmd: NetCommand) {
        (self.commands)(cmd);
    }

    /// The engine's checks of an incoming request's parameters (the same
    /// rules as the unified engine), before the machine allocates anything.
    /// The window (K8) is the machine's own check, which counts it and (on
    /// prefill) tells decode at once.
    fn prevalidate(&mut self, conn: u64, msg: &Message) -> bool {
        let (req, checked) = match msg {
            Message::Reserve {
                req,
                tenant,
                tokens,
                max_tokens,
                gen,
                ..
            } if matches!(self.machine, Machine::Decode(_)) => (
                *req,
                crate::validate(
                    &gen_request(*tenant, tokens, *max_tokens, gen),
                    usize::MAX,
                    self.vocab,
                ),
            ),
            Message::Prefill {
                req,
                tenant,
                tokens,
                max_tokens,
                gen,
                ..
            } if matches!(self.machine, Machine::Prefill(_)) => (
                *req,
                crate::validate(
                    &gen_request(*tenant, tokens, *max_tokens, gen),
                    usize::MAX,
                    self.vocab,
                ),
            ),
            _ => return true,
        };
        match checked {
            Ok(()) => true,
            Err(e) => {
                self.core.local.requests_refused_total += 1;
                self.send(NetCommand::Send {
                    conn,
                    msg: Message::Rejected {
                        req,
                        error: refusal_of(&e),
                    },
                });
                false
            }
        }
    }

    fn handle(&mut self, ev: NetEvent) {
        if let NetEvent::Message { conn, msg } = &ev {
            if !self.prevalidate(*conn, msg) {
                return;
            }
            if let Message::Page { req, .. } = msg {
                if self.transfer_started.len() >= TIMED_TRANSFERS_MAX {
                    self.transfer_started.clear();
                }
                self.transfer_started
                    .entry(*req)
                    .or_insert_with(std::time::Instant::now);
            }
        }
        let pool = &mut self.core.pool;
        match &mut self.machine {
            Machine::Prefill(m) => {
                let mut out = Vec::new();
                match ev {
                    NetEvent::Accepted { conn } => m.accepted(conn, &mut out),
                    NetEvent::Dialled { conn, addr } => m.connected(conn, &addr, &mut out),
                    NetEvent::DialFailed { addr, why } => {
                        m.connect_failed(pool, &addr, &why, &mut out)
                    }
                    NetEvent::Message { conn, msg } => m.message(pool, conn, msg, &mut out),
                    NetEvent::Closed { conn } => m.closed(pool, conn, &mut out),
                }
                self.prefill_actions(out);
            }
            Machine::Decode(m) => {
                let mut out = Vec::new();
                match ev {
                    NetEvent::Accepted { conn } | NetEvent::Dialled { conn, .. } => {
                        m.connected(conn, &mut out)
                    }
                    NetEvent::DialFailed { .. } => {}
                    NetEvent::Message { conn, msg } => m.message(pool, conn, msg, &mut out),
                    NetEvent::Closed { conn } => m.closed(pool, conn, &mut out),
                }
                self.decode_actions(out);
            }
        }
    }

    fn prefill_actions(&mut self, actions: Vec<PrefillAction>) {
        for a in actions {
            match a {
                PrefillAction::Send { conn, msg } => self.send(NetCommand::Send { conn, msg }),
                PrefillAction::Close { conn } => self.send(NetCommand::Close { conn }),
                PrefillAction::Connect { addr } => self.send(NetCommand::Dial { addr }),
                PrefillAction::Compute(job) => {
                    let job = *job;
                    self.core.start_prefill(PrefillJob {
                        req: job.req,
                        owner: job.owner,
                        prompt: job.tokens,
                        params: params_of(&job.gen),
                        logprobs: job.gen.logprobs.map(usize::from),
                        pages: job.pages,
                    });
                }
                PrefillAction::StopCompute { req } => {
                    self.core.stop_remote(req);
                }
            }
        }
    }

    fn decode_actions(&mut self, actions: Vec<DecodeAction>) {
        for a in actions {
            match a {
                DecodeAction::Send { conn, msg } => self.send(NetCommand::Send { conn, msg }),
                DecodeAction::Close { conn } => self.send(NetCommand::Close { conn }),
                DecodeAction::StartDecode(start) => {
                    let s = *start;
                    let req = s.req;
                    if let Some(t0) = self.transfer_started.remove(&req) {
                        self.transfer_seconds_total += t0.elapsed().as_secs_f64();
                        self.transfers_timed_total += 1;
                    }
                    let started = self.core.start_decode(DecodeJob {
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
                    });
                    if let Err(e) = started {
                        let mut out = Vec::new();
                        if let Machine::Decode(m) = &mut self.machine {
                            m.decode_failed(&mut self.core.pool, req, refusal_of(&e), &mut out);
                        }
                        self.decode_actions(out);
                    }
                }
                DecodeAction::StopDecode { req } => {
                    self.core.stop_remote(req);
                }
            }
        }
        // The first token of a started request may already be in the outbox.
        self.drain_outbox();
    }

    fn drain_outbox(&mut self) {
        while !self.core.outbox.is_empty() {
            let outbox = std::mem::take(&mut self.core.outbox);
            for o in outbox {
                self.outcome(o);
            }
        }
    }

    fn outcome(&mut self, o: Outcome) {
        let pool = &mut self.core.pool;
        match (&mut self.machine, o) {
            (
                Machine::Prefill(m),
                Outcome::Computed {
                    req,
                    first,
                    logprobs,
                    sampler_state,
                },
            ) => {
                let mut out = Vec::new();
                m.computed(
                    pool,
                    req,
                    first,
                    wire_logprobs(logprobs),
                    sampler_state,
                    &mut out,
                );
                self.prefill_actions(out);
            }
            (Machine::Prefill(m), Outcome::Event { req, event, .. }) => {
                // A prefill-only request only ends in an error (a failed
                // forward step).
                if let Event::Error(e) = event {
                    let mut out = Vec::new();
                    m.compute_failed(pool, req, refusal_of(&e), &mut out);
                    self.prefill_actions(out);
                }
            }
            (Machine::Decode(m), Outcome::Event { req, conn, event }) => {
                let mut out = Vec::new();
                match event {
                    Event::Token(t) => {
                        let logprobs = wire_logprobs(t.logprob.map(|lp| (lp, t.top_logprobs)));
                        m.stream_token(req, conn, t.id, t.text, logprobs, &mut out);
                    }
                    Event::Done(d) => m.decode_finished(
                        pool,
                        req,
                        match d.finish {
                            FinishReason::Stop => 0,
                            FinishReason::Length => 1,
                        },
                        d.usage.completion_tokens as u32,
                        d.tail_text,
                        &mut out,
                    ),
                    Event::Error(e) => m.decode_failed(pool, req, refusal_of(&e), &mut out),
                }
                for a in out {
                    match a {
                        DecodeAction::Send { conn, msg } => {
                            self.send(NetCommand::Send { conn, msg })
                        }
                        DecodeAction::Close { conn } => self.send(NetCommand::Close { conn }),
                        other => self.decode_actions(vec![other]),
                    }
                }
            }
            (Machine::Decode(_), Outcome::Computed { .. }) => {
                debug_assert!(false, "decode computed a prefill");
            }
        }
    }
}
