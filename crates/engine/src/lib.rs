//! `engine` — the serving engine (unified role): continuous batching over
//! one model and one KV pool, owned by one thread.
//!
//! * **Admission (K8, K9).** At start the pool is measured in tokens and
//!   compared with the model's context window: [`Engine::start`] refuses to
//!   run when the pool cannot hold one full-window request, naming both
//!   numbers, unless `max_context` lowers the advertised window. Every
//!   request is checked (`prompt + max_tokens ≤ advertised window`) in
//!   [`Engine::submit`] — before it is queued, long before any page is
//!   allocated — and again by the engine thread. A refused request gets its
//!   original error; nothing ever continues in its place.
//! * **Reservation.** A request is admitted only when the pool has pages for
//!   its whole `prompt + max_tokens`; it gets them all at once (all or
//!   nothing) and keeps them to the end. So a running request can never run
//!   out of pages, there is no preemption to get wrong and no deadlock: the
//!   head of the FIFO queue waits until finishing requests free enough
//!   pages, and every admissible request fits an empty pool (K8).
//! * **Continuous batching.** Each step runs one decode row per decoding
//!   request plus chunks of prompts under a per-step token budget (chunked
//!   prefill); requests join and leave between steps.
//! * **Cancellation** at any point (the handle dropped, or
//!   [`RequestHandle::cancel`]) frees the request's pages at the next step.
//! * **Determinism (K12).** The forward pass is batch-invariant, and each
//!   request samples with its own seeded sampler, so a greedy request's
//!   tokens do not depend on what else runs.
//!
//! ```no_run
//! use engine::{Engine, EngineConfig, GenRequest, Event};
//! # fn f(model: model::Model, tok: tokenizer::Tokenizer) -> Result<(), Box<dyn std::error::Error>> {
//! let engine = Engine::start(model, tok, EngineConfig::default())?;
//! let mut h = engine.submit(GenRequest::greedy(kv::TenantId(1), vec![504, 3575, 282, 4649, 314], 8))?;
//! while let Some(ev) = h.blocking_next() {
//!     match ev {
//!         Event::Token(t) => print!("{}", t.text),
//!         Event::Done(d) => println!(" [{:?}]", d.finish),
//!         Event::Error(e) => eprintln!("{e}"),
//!     }
//! }
//! # Ok(()) }
//! ```

pub mod core;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

pub use crate::core::{Core, DecodeJob, EngineStats, Outcome, PrefillJob};
use kv::{DType, KvShape, Poison, RequestId, TenantId};
use model::sample::{FinishReason, SamplingParams};
use model::Model;
use tokenizer::Tokenizer;
use tokio::sync::mpsc as tmpsc;

/// Start-up configuration. Every queue and batch has a limit.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Token slots per KV page.
    pub page_size_tokens: usize,
    /// Pool size as a page count (takes precedence over `kv_memory_bytes`).
    pub kv_pages: Option<u64>,
    /// Pool size as a memory budget.
    pub kv_memory_bytes: u64,
    /// Lower the advertised context window (needed when the pool is smaller
    /// than the model's window).
    pub max_context: Option<usize>,
    /// Rows (tokens) per forward step: decode rows plus prefill chunks.
    pub step_tokens_max: usize,
    /// Requests running at once.
    pub running_max: usize,
    /// Requests waiting for admission (beyond it: `QueueFull`, HTTP 429).
    pub queue_max: usize,
    pub kv_dtype: DType,
    pub poison: Poison,
}

/// Default KV budget: 1 GiB, about 23k tokens of the default model in f32.
pub const KV_MEMORY_BYTES_DEFAULT: u64 = 1 << 30;
/// Largest `top_logprobs` a request may ask for (as OpenAI's API).
pub const TOP_LOGPROBS_MAX: usize = 20;
/// Largest `max_tokens` any request may ask for (also bounded by the window).
pub const MAX_TOKENS_MAX: usize = 1 << 20;

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            page_size_tokens: 16,
            kv_pages: None,
            kv_memory_bytes: KV_MEMORY_BYTES_DEFAULT,
            max_context: None,
            step_tokens_max: 256,
            running_max: 32,
            queue_max: 256,
            kv_dtype: DType::F32,
            poison: Poison::Nan,
        }
    }
}

/// What the node measured at start-up (the K8 capacity table).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapacityInfo {
    /// The model's context window from its metadata.
    pub model_window_tokens: usize,
    /// Tokens the KV pool holds.
    pub pool_tokens: u64,
    pub pool_pages: u64,
    pub page_size_tokens: usize,
    /// The largest `prompt + max_tokens` accepted: min(model window, pool,
    /// `max_context`).
    pub max_request_tokens: usize,
}

impl CapacityInfo {
    /// The one-line capacity table printed at start.
    pub fn table(&self) -> String {
        format!(
            "capacity: model window {} tokens | KV pool {} tokens ({} pages × {} tokens) | max request {} tokens",
            self.model_window_tokens,
            self.pool_tokens,
            self.pool_pages,
            self.page_size_tokens,
            self.max_request_tokens
        )
    }
}

/// Errors of starting the engine.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(
        "the KV pool holds {pool_tokens} tokens, less than the model's context window of \
         {window_tokens} tokens: a full-window request could not run. Give the pool more memory \
         (--kv-memory / --kv-pages) or advertise a smaller window with --max-context {pool_tokens} \
         (or less)"
    )]
    PoolSmallerThanWindow {
        pool_tokens: u64,
        window_tokens: usize,
    },
    #[error("--max-context {max_context} exceeds {what} of {limit} tokens")]
    MaxContextTooLarge {
        max_context: usize,
        what: &'static str,
        limit: u64,
    },
    #[error("invalid engine configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Kv(#[from] kv::KvError),
}

/// Why a request was refused or failed. `kind()` names it for logs and
/// metrics; the server maps each to an HTTP status.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    #[error(
        "This model's maximum context length is {limit} tokens. However, you requested {total} \
         tokens ({prompt} in the messages, {max_tokens} in the completion). Please reduce the \
         length of the messages or completion."
    )]
    ContextLengthExceeded {
        prompt: usize,
        max_tokens: usize,
        total: usize,
        limit: usize,
    },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("invalid parameter `{field}`: {why}")]
    InvalidParam { field: &'static str, why: String },
    #[error("the server is busy: {waiting} requests are waiting (limit {limit}); retry later")]
    QueueFull { waiting: usize, limit: usize },
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("internal error: {0}")]
    Internal(String),
    /// Refused or failed on a remote node (PD): that node's original error,
    /// unchanged (K9).
    #[error("{message}")]
    Remote {
        status: u16,
        code: String,
        message: String,
    },
}

impl RequestError {
    pub fn kind(&self) -> &'static str {
        match self {
            RequestError::ContextLengthExceeded { .. } => "context_length_exceeded",
            RequestError::EmptyPrompt => "empty_prompt",
            RequestError::InvalidParam { .. } => "invalid_parameter",
            RequestError::QueueFull { .. } => "queue_full",
            RequestError::ShuttingDown => "shutting_down",
            RequestError::Internal(_) => "internal_error",
            RequestError::Remote { .. } => "remote_error",
        }
    }
}

/// A generation request, tokenised.
#[derive(Clone, Debug)]
pub struct GenRequest {
    pub tenant: TenantId,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub params: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Return the chosen token's log-probability and this many alternatives
    /// (`None`: no logprobs).
    pub logprobs: Option<usize>,
}

impl GenRequest {
    pub fn greedy(tenant: TenantId, prompt: Vec<u32>, max_tokens: usize) -> GenRequest {
        GenRequest {
            tenant,
            prompt,
            max_tokens,
            params: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
        }
    }
}

/// One generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenEvent {
    pub id: u32,
    /// Text that became final with this token (may be empty: held back for
    /// UTF-8 completion or a possible stop string).
    pub text: String,
    pub logprob: Option<f32>,
    /// (token id, logprob) of the most likely alternatives.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Token counts, as OpenAI reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
}

/// The end of a request.
#[derive(Clone, Debug, PartialEq)]
pub struct DoneEvent {
    pub finish: FinishReason,
    pub usage: Usage,
    /// Text held back at the end (a partial stop-string prefix that never
    /// completed); already included in no earlier token event.
    pub tail_text: String,
    pub queue_ms: f64,
    pub ttft_ms: f64,
    pub total_ms: f64,
    pub pages: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token(TokenEvent),
    Done(DoneEvent),
    Error(RequestError),
}

/// The caller's side of a request: events, and cancellation on drop.
pub struct RequestHandle {
    pub id: RequestId,
    events: tmpsc::UnboundedReceiver<Event>,
    cancel: Arc<AtomicBool>,
    /// Called once on the first cancel (a backend that must be told, e.g.
    /// the PD gateway, rather than poll the flag).
    on_cancel: Option<Box<dyn Fn() + Send + Sync>>,
    /// KV pages allocated to the request so far ([`PAGES_UNKNOWN`] until
    /// the backend says), for the request log: a request refused while it
    /// held pages is part of the incident's signature.
    pages: Arc<AtomicU64>,
}

/// [`RequestHandle::pages_cell`] before the backend has said.
pub const PAGES_UNKNOWN: u64 = u64::MAX;

/// Something that runs requests: the unified [`Engine`], or a PD gateway.
/// The HTTP layer serves any backend.
pub trait Backend: Send + Sync {
    /// Queues a request (validated against the backend's limit).
    fn submit(&self, req: GenRequest) -> Result<RequestHandle, RequestError>;
    /// The largest `prompt + max_tokens` accepted now (K8; a PD gateway's
    /// changes when a node restarts with another pool).
    fn max_request_tokens(&self) -> usize;
    /// Occupancy and counters.
    fn stats(&self) -> EngineStats;
    /// The KV pool's capacity in tokens, where one pool serves the
    /// requests (the unified engine; a PD gateway has none of its own).
    fn kv_capacity_tokens(&self) -> Option<usize> {
        None
    }
    /// Stops admitting; `drain`: let running requests finish.
    fn shutdown(&self, drain: bool);
    /// Whether requests can be served now (a PD gateway: a pair is up).
    fn ready(&self) -> bool {
        true
    }
    /// More Prometheus text for `/metrics` (a PD gateway's counters).
    fn metrics_text(&self) -> String {
        String::new()
    }
}

impl Backend for Engine {
    fn submit(&self, req: GenRequest) -> Result<RequestHandle, RequestError> {
        Engine::submit(self, req)
    }
    fn max_request_tokens(&self) -> usize {
        self.capacity.max_request_tokens
    }
    fn stats(&self) -> EngineStats {
        Engine::stats(self)
    }
    fn kv_capacity_tokens(&self) -> Option<usize> {
        Some(self.capacity.pool_tokens as usize)
    }
    fn shutdown(&self, drain: bool) {
        Engine::shutdown(self, drain)
    }
}

impl RequestHandle {
    /// Next event (async); `None` after Done/Error.
    pub async fn next(&mut self) -> Option<Event> {
        self.events.recv().await
    }

    /// Next event, blocking the thread (not for async contexts).
    pub fn blocking_next(&mut self) -> Option<Event> {
        self.events.blocking_recv()
    }

    /// Cooperative cancel: the engine frees the request's pages at its next
    /// step. Dropping the handle does the same.
    pub fn cancel(&self) {
        if !self.cancel.swap(true, Ordering::AcqRel) {
            if let Some(f) = &self.on_cancel {
                f();
            }
        }
    }

    /// A handle over events produced elsewhere (a backend other than the
    /// engine); `on_cancel` runs once when the caller cancels or drops it.
    pub fn new(
        id: RequestId,
        events: tmpsc::UnboundedReceiver<Event>,
        on_cancel: Box<dyn Fn() + Send + Sync>,
    ) -> RequestHandle {
        RequestHandle {
            id,
            events,
            cancel: Arc::new(AtomicBool::new(false)),
            on_cancel: Some(on_cancel),
            pages: Arc::new(AtomicU64::new(PAGES_UNKNOWN)),
        }
    }

    /// KV pages allocated to the request so far (`None`: the backend does
    /// not know, or has not said).
    pub fn pages_allocated(&self) -> Option<usize> {
        match self.pages.load(Ordering::Acquire) {
            PAGES_UNKNOWN => None,
            n => Some(n as usize),
        }
    }

    /// The page count, for a reader that outlives the handle (the request
    /// log writes after the handle is gone).
    pub fn pages_cell(&self) -> Arc<AtomicU64> {
        self.pages.clone()
    }

    /// A handle whose page count the backend keeps in `cell`.
    pub fn with_pages_cell(mut self, cell: Arc<AtomicU64>) -> RequestHandle {
        self.pages = cell;
        self
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        self.cancel();
    }
}

pub(crate) enum Command {
    Submit(Box<Submitted>),
    Shutdown { drain: bool },
}

pub(crate) struct Submitted {
    pub id: RequestId,
    pub req: GenRequest,
    pub events: tmpsc::UnboundedSender<Event>,
    pub cancel: Arc<AtomicBool>,
    /// The handle's page count, set on admission.
    pub pages: Arc<AtomicU64>,
    pub submitted_at: std::time::Instant,
    /// `fault-incident` only: run as the incident's placeholder.
    #[cfg(feature = "fault-incident")]
    pub placeholder: bool,
}

/// Handle to a running engine. Cheap to share (`Arc` it).
pub struct Engine {
    tx: SyncSender<Command>,
    capacity: CapacityInfo,
    vocab: usize,
    eos: Vec<u32>,
    next_id: AtomicU64,
    shutting_down: AtomicBool,
    waiting: Arc<AtomicU64>,
    stats: Arc<Mutex<EngineStats>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    queue_max: usize,
}

impl Engine {
    /// Measures the pool against the model's window (K8), allocates the
    /// pool, and starts the engine thread.
    pub fn start(
        model: Model,
        tokenizer: Tokenizer,
        cfg: EngineConfig,
    ) -> Result<Engine, StartError> {
        let (shape, pages, capacity) = measure(&model, &cfg)?;
        let max_request = capacity.max_request_tokens;
        #[allow(unused_mut)]
        let mut pool = kv::Pool::new(shape, pages, kv::PoolOptions { poison: cfg.poison })?;
        #[cfg(feature = "fault-incident")]
        {
            tracing::error!(
                "FAULT-INCIDENT BUILD: over-long requests run as placeholders reading stale KV; \
                 for testing isoserve probe only"
            );
            pool.set_faults(kv::Faults::incident());
        }
        if cfg.poison == Poison::Off {
            tracing::warn!("freed KV pages will not be poisoned (--kv-poison off)");
        }
        let (tx, rx) = mpsc::sync_channel(cfg.queue_max);
        let stats = Arc::new(Mutex::new(EngineStats::new(pool.stats())));
        let waiting = Arc::new(AtomicU64::new(0));
        let vocab = model.config.vocab;
        let eos = tokenizer.eos_ids().to_vec();
        let core = core::Core::new(
            model,
            tokenizer,
            pool,
            cfg.clone(),
            max_request,
            stats.clone(),
            waiting.clone(),
        );
        let thread = std::thread::Builder::new()
            .name("isoserve-engine".into())
            .spawn(move || core.run(rx))
            .map_err(|e| StartError::Config(format!("cannot start the engine thread: {e}")))?;
        Ok(Engine {
            tx,
            capacity,
            vocab,
            eos,
            next_id: AtomicU64::new(1),
            shutting_down: AtomicBool::new(false),
            waiting,
            stats,
            thread: Mutex::new(Some(thread)),
            queue_max: cfg.queue_max,
        })
    }

    pub fn capacity(&self) -> &CapacityInfo {
        &self.capacity
    }

    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Validates and queues a request. Over-long requests are refused here,
    /// before the queue, the pool or the model see them (K8).
    pub fn submit(&self, req: GenRequest) -> Result<RequestHandle, RequestError> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(RequestError::ShuttingDown);
        }
        #[cfg(feature = "fault-incident")]
        let (req, placeholder) = incident_placeholder(req, self.capacity.max_request_tokens);
        validate(&req, self.capacity.max_request_tokens, self.vocab)?;
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (etx, erx) = tmpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        // Nothing allocated until the engine admits it.
        let pages = Arc::new(AtomicU64::new(0));
        let sub = Submitted {
            id,
            req,
            events: etx,
            cancel: cancel.clone(),
            pages: pages.clone(),
            submitted_at: std::time::Instant::now(),
            #[cfg(feature = "fault-incident")]
            placeholder,
        };
        // Take a queue slot first (count on submit, give back when the
        // request leaves the queue), so the limit holds exactly.
        let waiting = self.waiting.fetch_add(1, Ordering::AcqRel) as usize;
        if waiting >= self.queue_max {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(RequestError::QueueFull {
                waiting,
                limit: self.queue_max,
            });
        }
        match self.tx.try_send(Command::Submit(Box::new(sub))) {
            Ok(()) => Ok(RequestHandle {
                id,
                events: erx,
                cancel,
                on_cancel: None,
                pages,
            }),
            Err(TrySendError::Full(_)) => {
                self.waiting.fetch_sub(1, Ordering::AcqRel);
                Err(RequestError::QueueFull {
                    waiting: self.queue_max,
                    limit: self.queue_max,
                })
            }
            Err(TrySendError::Disconnected(_)) => {
                self.waiting.fetch_sub(1, Ordering::AcqRel);
                Err(RequestError::ShuttingDown)
            }
        }
    }

    /// A snapshot of occupancy and counters (updated every step).
    pub fn stats(&self) -> EngineStats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Stops admitting; `drain`: finish queued and running requests, else
    /// cancel them (their clients get `ShuttingDown`). Then joins the thread.
    pub fn shutdown(&self, drain: bool) {
        self.shutting_down.store(true, Ordering::Relaxed);
        // A blocking send: the queue drains as the engine runs.
        let _ = self.tx.send(Command::Shutdown { drain });
        let handle = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = handle {
            let _ = h.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown(false);
    }
}

/// Checks a configuration and measures the KV pool it gives against the
/// model's window (K8): the pool's shape, its page count and the capacity
/// table, or the reason the node must not start.
pub fn measure(
    model: &Model,
    cfg: &EngineConfig,
) -> Result<(KvShape, u64, CapacityInfo), StartError> {
    if cfg.step_tokens_max == 0 || cfg.step_tokens_max > model::BATCH_ROWS_MAX {
        return Err(StartError::Config(format!(
            "step token budget must be 1..={}",
            model::BATCH_ROWS_MAX
        )));
    }
    if cfg.running_max == 0 || cfg.running_max > cfg.step_tokens_max {
        return Err(StartError::Config(
            "running requests must be 1..=step token budget (each decodes one row per step)".into(),
        ));
    }
    if cfg.queue_max == 0 {
        return Err(StartError::Config(
            "queue must hold at least one request".into(),
        ));
    }
    let shape: KvShape = model.kv_shape(cfg.page_size_tokens, cfg.kv_dtype)?;
    let pages = match cfg.kv_pages {
        Some(p) => p,
        None => kv::pages_for_budget(&shape, cfg.kv_memory_bytes),
    };
    let pool_tokens = kv::capacity_tokens(&shape, pages);
    let window = model.config.context_length;
    let max_request = match cfg.max_context {
        Some(mc) => {
            if mc == 0 {
                return Err(StartError::Config("--max-context must be positive".into()));
            }
            if mc > window {
                return Err(StartError::MaxContextTooLarge {
                    max_context: mc,
                    what: "the model's context window",
                    limit: window as u64,
                });
            }
            if mc as u64 > pool_tokens {
                return Err(StartError::MaxContextTooLarge {
                    max_context: mc,
                    what: "the KV pool",
                    limit: pool_tokens,
                });
            }
            if mc < window {
                tracing::warn!(
                        "advertising a context window of {mc} tokens, below the model's {window} (--max-context)"
                    );
            }
            mc
        }
        None => {
            if pool_tokens < window as u64 {
                return Err(StartError::PoolSmallerThanWindow {
                    pool_tokens,
                    window_tokens: window,
                });
            }
            window
        }
    };
    let capacity = CapacityInfo {
        model_window_tokens: window,
        pool_tokens,
        pool_pages: pages,
        page_size_tokens: cfg.page_size_tokens,
        max_request_tokens: max_request,
    };
    Ok((shape, pages, capacity))
}

/// The checks every node makes before anything is allocated.
/// `fault-incident` only: the incident's placeholder path. An over-long
/// request keeps its last tokens that fit and is marked to compute only the
/// final one.
#[cfg(feature = "fault-incident")]
fn incident_placeholder(mut req: GenRequest, max_request: usize) -> (GenRequest, bool) {
    let over = req.prompt.len() + req.max_tokens > max_request;
    if over {
        let keep = max_request.saturating_sub(req.max_tokens).max(1);
        let cut = req.prompt.len().saturating_sub(keep);
        req.prompt.drain(..cut);
        req.max_tokens = req
            .max_tokens
            .min(max_request.saturating_sub(req.prompt.len()).max(1));
    }
    (req, over)
}

pub fn validate(req: &GenRequest, max_request: usize, vocab: usize) -> Result<(), RequestError> {
    if req.prompt.is_empty() {
        return Err(RequestError::EmptyPrompt);
    }
    if req.max_tokens == 0 || req.max_tokens > MAX_TOKENS_MAX {
        return Err(RequestError::InvalidParam {
            field: "max_tokens",
            why: format!("must be 1..={MAX_TOKENS_MAX}"),
        });
    }
    let total = req.prompt.len().saturating_add(req.max_tokens);
    if total > max_request {
        return Err(RequestError::ContextLengthExceeded {
            prompt: req.prompt.len(),
            max_tokens: req.max_tokens,
            total,
            limit: max_request,
        });
    }
    if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(RequestError::InvalidParam {
            field: "prompt",
            why: format!("token id {bad} is outside the vocabulary of {vocab}"),
        });
    }
    req.params
        .validate()
        .map_err(|e| RequestError::InvalidParam {
            field: e.field,
            why: e.why,
        })?;
    model::sample::StopStrings::new(req.stop.clone()).map_err(|e| RequestError::InvalidParam {
        field: e.field,
        why: e.why,
    })?;
    if req.logprobs.is_some_and(|n| n > TOP_LOGPROBS_MAX) {
        return Err(RequestError::InvalidParam {
            field: "top_logprobs",
            why: format!("must be 0..={TOP_LOGPROBS_MAX}"),
        });
    }
    Ok(())
}
