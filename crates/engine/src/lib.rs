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

#![forbid(unsafe_code)]

pub mod console;
pub mod core;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

pub use crate::core::{Core, DecodeJob, Outcome, PrefillJob, PREFILL_RATE_ROWS_MIN};
use kv::{DType, KvShape, Poison, RequestId};
use model::{Forward, Model, Runner};
/// The request vocabulary (re-exported: callers of the engine speak it).
pub use request::{
    validate, Backend, DoneEvent, EngineStats, Event, GenRequest, RequestError, RequestHandle,
    TokenEvent, Usage, MAX_TOKENS_MAX, PAGES_UNKNOWN, TOP_LOGPROBS_MAX,
};
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
    pub step_tokens: usize,
    /// Requests running at once.
    pub max_running: usize,
    /// Requests waiting for admission (beyond it: `QueueFull`, HTTP 429).
    pub max_queue: usize,
    /// How the pool stores K/V (`--kv-dtype`).
    pub kv_dtype: DType,
    pub poison: Poison,
    /// Reuse cached KV of prompts' prefixes, within each request's scope
    /// (K11).
    pub prefix_cache: PrefixCache,
    /// Speculative decoding (`--speculative`, and every request's
    /// `prediction`).
    pub speculation: Speculation,
    /// A smaller GGUF of the same vocabulary that drafts tokens for the
    /// model to verify (`--draft-model`).
    pub draft_model: Option<std::path::PathBuf>,
}

/// `--speculative`: where drafts come from besides a request's prediction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SpecMethod {
    /// Only requests' predictions are drafted from.
    #[default]
    Off,
    /// Prompt lookup: the longest tail of the output found in the
    /// request's own prompt and output (vLLM's `ngram`, llama.cpp's lookup).
    Ngram,
    /// Prompt lookup, and the suffix cache: the prompts and outputs of
    /// earlier requests of the request's own cache scope (K11), for agents
    /// and batch jobs that repeat themselves (vLLM's `suffix`). Needs the
    /// prefix cache: its entries live and go with the scope's cached pages.
    Suffix,
}

/// Speculative decoding's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Speculation {
    pub method: SpecMethod,
    /// Draft tokens a request verifies in one step at most, from its own
    /// history (vLLM's `num_speculative_tokens`).
    pub k_max: usize,
    /// The shortest and longest tail of the output looked up
    /// (`prompt_lookup_min`, `prompt_lookup_max`).
    pub ngram_min: usize,
    pub ngram_max: usize,
    /// Draft tokens a request verifies in one step at most from its
    /// prediction.
    pub prediction_k_max: usize,
    /// Rows a step gives to drafts at most, over the whole batch, less one
    /// for each decoding request: a large batch already fills the step, so
    /// speculation turns itself down as the batch grows (none from this
    /// many decoding requests on).
    pub rows_max: usize,
    /// The suffix cache's tokens per scope (`SpecMethod::Suffix`).
    pub suffix_tokens: usize,
}

/// The largest `k_max` and `prediction_k_max` accepted.
pub const SPEC_K_MAX: usize = 64;

/// The largest `suffix_tokens` accepted (a scope's memory: 4 bytes a
/// token, for each of at most 256 scopes).
pub const SUFFIX_TOKENS_MAX: usize = 1 << 20;

impl Default for Speculation {
    fn default() -> Self {
        Speculation {
            method: SpecMethod::Off,
            k_max: 16,
            ngram_min: 2,
            ngram_max: 4,
            prediction_k_max: 32,
            rows_max: 32,
            suffix_tokens: 16_384,
        }
    }
}

/// `--prefix-cache`: whether the engine reuses KV across requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PrefixCache {
    /// Nothing is reused.
    Off,
    /// Whole pages of a prompt's prefix, within the request's cache scope
    /// (its tenant's, its operator-named group's, narrowed by its salt).
    #[default]
    Tenant,
}

impl EngineConfig {
    /// The effective configuration as one `key=value` line (flag names
    /// with `_`), logged at start so an operator — and the tests — see what
    /// every process really runs with.
    pub fn summary(&self) -> String {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        format!(
            "page_size={} kv_pages={} kv_memory_bytes={} max_context={} step_tokens={} \
             max_running={} max_queue={} kv_dtype={:?} kv_poison={:?} prefix_cache={:?} \
             speculative={:?} spec_k={} spec_ngram={}..={} spec_prediction_k={} spec_rows={} \
             suffix_cache_tokens={} draft_model={}",
            self.page_size_tokens,
            opt(self.kv_pages.map(|p| p.to_string())),
            self.kv_memory_bytes,
            opt(self.max_context.map(|c| c.to_string())),
            self.step_tokens,
            self.max_running,
            self.max_queue,
            self.kv_dtype,
            self.poison,
            self.prefix_cache,
            self.speculation.method,
            self.speculation.k_max,
            self.speculation.ngram_min,
            self.speculation.ngram_max,
            self.speculation.prediction_k_max,
            self.speculation.rows_max,
            self.speculation.suffix_tokens,
            opt(self.draft_model.as_ref().map(|p| p.display().to_string())),
        )
    }
}

/// Default KV budget: 1 GiB, about 46k tokens of the default model in f16.
pub const KV_MEMORY_BYTES_DEFAULT: u64 = 1 << 30;
impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            page_size_tokens: 16,
            kv_pages: None,
            kv_memory_bytes: KV_MEMORY_BYTES_DEFAULT,
            max_context: None,
            step_tokens: 256,
            max_running: 32,
            max_queue: 256,
            // As llama.cpp's default: half the memory and bandwidth of f32.
            kv_dtype: DType::F16,
            poison: Poison::Nan,
            prefix_cache: PrefixCache::Tenant,
            speculation: Speculation::default(),
            draft_model: None,
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
    /// How K/V values are stored, and what one token of K/V costs.
    pub kv_dtype: DType,
    pub kv_bytes_per_token: u64,
    /// The largest `prompt + max_tokens` accepted: min(model window, pool,
    /// `max_context`).
    pub max_request_tokens: usize,
    /// Whether the pool keeps a prefix cache (its idle pages count as
    /// available: an allocation evicts them).
    pub prefix_cache: PrefixCache,
}

impl CapacityInfo {
    /// The one-line capacity table printed at start.
    pub fn table(&self) -> String {
        format!(
            "capacity: model window {} tokens | KV pool {} tokens ({} pages × {} tokens) | KV {} ({} bytes a token, {} tokens per GiB) | max request {} tokens | prefix cache {}",
            self.model_window_tokens,
            self.pool_tokens,
            self.pool_pages,
            self.page_size_tokens,
            self.kv_dtype.name(),
            self.kv_bytes_per_token,
            (1u64 << 30) / self.kv_bytes_per_token.max(1),
            self.max_request_tokens,
            match self.prefix_cache {
                PrefixCache::Tenant => "per tenant, in the pool (idle cached pages are evicted when a request needs them, so they count as free)",
                PrefixCache::Off => "off",
            }
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
    fn console_nodes(&self) -> Vec<request::console::NodeView> {
        vec![self.console_view()]
    }
}

pub(crate) enum Command {
    Submit(Box<Submitted>),
    Shutdown {
        drain: bool,
    },
    /// Wakes an idle engine thread so it publishes (the console's fresh
    /// pool map).
    Wake,
}

pub(crate) struct Submitted {
    pub id: RequestId,
    pub req: GenRequest,
    pub events: tmpsc::Sender<Event>,
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
    max_queue: usize,
    console: Arc<console::ConsoleCell>,
    /// Compiles requests' grammars over the model's vocabulary, cached per
    /// cache scope (K11); the HTTP layer shares it ([`Engine::grammar`]).
    grammar: Arc<grammar::Compiler>,
}

impl Engine {
    /// Measures the pool against the model's window (K8), allocates the
    /// pool, and starts the engine thread.
    pub fn start(
        model: Model,
        tokenizer: Tokenizer,
        cfg: EngineConfig,
    ) -> Result<Engine, StartError> {
        let rows = cfg.step_tokens;
        let draft = load_draft(&model, &cfg)?;
        Engine::start_drafted(Runner::new(model, rows), draft, tokenizer, cfg)
    }

    /// [`Engine::start`] over any forward step (tests: a stand-in model).
    pub fn start_with<F: Forward>(
        fwd: F,
        tokenizer: Tokenizer,
        cfg: EngineConfig,
    ) -> Result<Engine, StartError> {
        Engine::start_drafted(fwd, None, tokenizer, cfg)
    }

    /// [`Engine::start_with`], with a draft model's forward step.
    pub fn start_drafted<F: Forward>(
        fwd: F,
        draft: Option<Box<dyn Forward>>,
        tokenizer: Tokenizer,
        cfg: EngineConfig,
    ) -> Result<Engine, StartError> {
        let (shape, pages, capacity) = measure(&fwd, &cfg)?;
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
        // One slot beyond the queue's limit: the console's wake-up.
        let (tx, rx) = mpsc::sync_channel(cfg.max_queue + 1);
        let stats = Arc::new(Mutex::new(EngineStats::new(pool.stats())));
        let waiting = Arc::new(AtomicU64::new(0));
        let vocab = fwd.vocab();
        let eos = tokenizer.eos_ids().to_vec();
        let grammar = grammar::Vocabulary::from_tokenizer(&tokenizer)
            .and_then(|v| grammar::Compiler::new(v, grammar::Limits::default()))
            .map(Arc::new)
            .map_err(|e| StartError::Config(format!("the grammar engine: {e}")))?;
        let mut core = core::Core::new(
            fwd,
            tokenizer,
            pool,
            cfg.clone(),
            max_request,
            stats.clone(),
            waiting.clone(),
        );
        if let Some(d) = draft {
            core.set_draft(d)?;
        }
        let console = core.console();
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
            max_queue: cfg.max_queue,
            console,
            grammar,
        })
    }

    /// The grammar compiler requests' constraints are compiled with: the
    /// HTTP layer compiles through it off its async threads, so the engine
    /// thread never compiles.
    pub fn grammar(&self) -> Arc<grammar::Compiler> {
        self.grammar.clone()
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
        #[allow(unused_mut)]
        let mut req = req;
        // A constraint not compiled by the caller is compiled here, on the
        // caller's thread: the engine thread only clones compiled ones.
        let scope = req.scope();
        if let Some(c) = req.grammar.as_mut() {
            if core::compiled_of(c).is_none() {
                let compiled = self.grammar.compile(scope, &c.spec).map_err(|e| {
                    RequestError::InvalidParam {
                        field: "response_format",
                        why: e.to_string(),
                    }
                })?;
                c.compiled = Some(compiled as Arc<dyn std::any::Any + Send + Sync>);
            }
        }
        let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let (etx, erx) = request::event_channel();
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
        if waiting >= self.max_queue {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(RequestError::QueueFull {
                waiting,
                limit: self.max_queue,
            });
        }
        match self.tx.try_send(Command::Submit(Box::new(sub))) {
            Ok(()) => Ok(RequestHandle::local(id, erx, cancel, pages)),
            Err(TrySendError::Full(_)) => {
                self.waiting.fetch_sub(1, Ordering::AcqRel);
                Err(RequestError::QueueFull {
                    waiting: self.max_queue,
                    limit: self.max_queue,
                })
            }
            Err(TrySendError::Disconnected(_)) => {
                self.waiting.fetch_sub(1, Ordering::AcqRel);
                Err(RequestError::ShuttingDown)
            }
        }
    }

    /// What the operator console shows of this engine: its pool map (taken
    /// by the engine thread after its current step; an idle thread is woken)
    /// and the pool's safety counters. Blocks at most
    /// [`console::FRESH_WAIT`].
    pub fn console_view(&self) -> request::console::NodeView {
        let snap = self.console.read(|| {
            // One wake-up in flight at most; the channel has a slot for it
            // beyond `max_queue`, so it never takes a request's place. A
            // full channel means a busy thread, which publishes anyway.
            if self.console.claim_wake() && self.tx.try_send(Command::Wake).is_err() {
                self.console.wake_done();
            }
        });
        console::node_view("engine", "unified", &snap, &self.stats().pool, Vec::new())
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
    model: &impl Forward,
    cfg: &EngineConfig,
) -> Result<(KvShape, u64, CapacityInfo), StartError> {
    if cfg.step_tokens == 0 || cfg.step_tokens > model.rows_max() {
        return Err(StartError::Config(format!(
            "step token budget must be 1..={}",
            model.rows_max()
        )));
    }
    if cfg.max_running == 0 || cfg.max_running > cfg.step_tokens {
        return Err(StartError::Config(
            "running requests must be 1..=step token budget (each decodes one row per step)".into(),
        ));
    }
    if cfg.max_queue == 0 {
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
    if pages == 0 {
        // No window fits, however small: say so rather than suggest
        // `--max-context 0` (K8).
        return Err(StartError::Config(format!(
            "the KV pool holds no page (one page of {} tokens takes {} bytes): give it more \
             memory with --kv-memory, or pages with --kv-pages",
            cfg.page_size_tokens,
            shape.page_bytes()
        )));
    }
    let window = model.context_length();
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
        kv_dtype: cfg.kv_dtype,
        kv_bytes_per_token: shape.bytes_per_token() as u64,
        max_request_tokens: max_request,
        prefix_cache: cfg.prefix_cache,
    };
    Ok((shape, pages, capacity))
}

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

/// Loads `cfg.draft_model` (`--draft-model`) to draft for `model`, on
/// `model`'s kernel threads: refused, and the difference named, unless
/// its tokenizer is the model's.
pub fn load_draft(
    model: &Model,
    cfg: &EngineConfig,
) -> Result<Option<Box<dyn Forward>>, StartError> {
    let Some(path) = &cfg.draft_model else {
        return Ok(None);
    };
    let bad = |why: String| StartError::Config(format!("--draft-model {}: {why}", path.display()));
    let draft = Model::load(path, model.threads_shared()).map_err(|e| bad(e.to_string()))?;
    model::same_vocabulary(model.gguf(), draft.gguf())
        .map_err(|why| bad(format!("not the model's vocabulary: {why}")))?;
    tracing::info!(
        "draft model {}: {} layers (the model has {})",
        path.display(),
        draft.config.n_layer,
        model.config.n_layer
    );
    Ok(Some(Box::new(Runner::new(draft, cfg.step_tokens))))
}
