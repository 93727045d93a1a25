//! The batch core: owns the model, the tokenizer's decoders and the pool;
//! runs the request state machine and the batching loop. The unified
//! engine's thread runs it over local requests ([`Core::run`]); a PD node
//! (the `pd` crate) drives it over remote ones ([`Core::start_prefill`],
//! [`Core::start_decode`], [`Core::step_if_running`] and the
//! [`Core::take_outbox`] of what they produced).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv::{FreeOutcome, Owner, PageRef, Pool, RequestId, TenantId};
use model::sample::{FinishReason, Sampler, StopStrings};
use model::{Forward, Row, Runner, SeqCtx};
use request::Constraint;
use tokenizer::{StreamDecoder, Tokenizer};
use tokio::sync::mpsc as tmpsc;

use crate::{
    Command, DoneEvent, EngineConfig, EngineStats, Event, PrefixCache, RequestError, Submitted,
    TokenEvent, Usage,
};

/// Steps with fewer rows are dominated by per-step overhead and would
/// understate the rate.
pub const PREFILL_RATE_ROWS_MIN: usize = 64;

/// What a running request is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Unified: prefill, then decode; the engine owns the pages.
    Full,
    /// Prefill role: compute the prompt's KV and the first token, then hand
    /// the request back (pages stay allocated: the transfer machine frees
    /// them).
    PrefillOnly,
    /// Decode role: the prompt's KV arrived by transfer; decode from the
    /// first token (the transfer machine frees the pages).
    DecodeOnly,
}

/// Where a request's events go.
pub(crate) enum Sink {
    /// A caller in this process (unified role).
    Local {
        events: tmpsc::Sender<Event>,
        cancel: Arc<AtomicBool>,
    },
    /// A remote gateway, through the node's outbox (PD roles).
    Remote { conn: u64 },
}

/// What a PD role's engine produced for the node loop to act on.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// A token, the end or a failure of a remote request.
    Event {
        req: RequestId,
        conn: u64,
        event: Event,
    },
    /// Prefill computed the prompt and sampled the first token.
    Computed {
        req: RequestId,
        first: u32,
        /// (logprob, top alternatives) when asked for.
        logprobs: Option<(f32, Vec<(u32, f32)>)>,
        sampler_state: u64,
    },
}

pub(crate) struct Active {
    mode: Mode,
    id: RequestId,
    owner: Owner,
    /// Arrival order (unified role; 0 on PD roles).
    seq: u64,
    /// Order among the tenant's requests (lower first).
    priority: i32,
    prompt: Vec<u32>,
    max_tokens: usize,
    ignore_eos: bool,
    logprobs: Option<usize>,
    sampler: Sampler,
    /// Where the output stands in its grammar (structured outputs): the
    /// sequence's own state, dropped with it. `None` while it is with the
    /// mask workers (or without a grammar).
    grammar: Option<grammar::Matcher>,
    /// Its next mask: with the workers, computed, or late (see
    /// [`Masking`]).
    masking: Masking,
    stops: StopStrings,
    decoder: StreamDecoder,
    pages: Vec<PageRef>,
    /// Which of `pages` are cached (shared, read-only, released rather
    /// than freed); Full mode only.
    shared: Vec<bool>,
    /// Prefix-cache keys of the full pages of `history` known so far.
    keys: Vec<u64>,
    /// Prompt tokens whose KV came from the cache.
    cached_tokens: usize,
    /// Positions of `history` whose KV is computed: the prompt's, and
    /// after preemption whatever is recomputed; one short of `history`
    /// while decoding (the last token is the next row).
    computed: usize,
    /// Tokens generated so far (EOS included when it ended the request).
    generated: Vec<u32>,
    /// Prompt followed by generated tokens (for penalties).
    history: Vec<u32>,
    sink: Sink,
    submitted_at: Instant,
    admitted_at: Instant,
    /// Admissions before this one (the core's count): orders requests
    /// admitted at one driver time (one tick admits several).
    admission: u64,
    first_token_at: Option<Instant>,
    /// Its drafter (speculative decoding), if it has anything to draft
    /// from: its prediction, or `--speculative ngram`.
    drafter: Option<spec::Drafter>,
    /// The step's draft: tokens verified as rows after the decode row at
    /// `draft_pos`, and how many of them the sampled tokens equalled.
    draft: Vec<u32>,
    draft_pos: usize,
    draft_kept: usize,
    /// The draft model's pace for this request (`--draft-model`, and
    /// pages for it in the draft pool).
    model_drafter: Option<spec::ModelDrafter>,
    /// Its pages in the draft model's pool (same owner), and the positions
    /// of `history` whose draft K/V they hold; past those, while a draft
    /// is verified, the drafted tokens' (`dwritten`).
    dpages: Vec<PageRef>,
    dcomputed: usize,
    dwritten: usize,
}

/// A constrained request's next mask (structured outputs).
#[derive(Default)]
pub(crate) struct Masking {
    /// Its matcher is with the mask workers, computing `ready`.
    in_flight: bool,
    /// The mask for the next token, once computed (an error: the grammar
    /// could not be followed).
    ready: Option<Result<grammar::Mask, String>>,
    /// How long its last mask took (cheap masks are computed first).
    cost_ns: u64,
    /// Logits whose mask was not ready when the forward pass ended: the
    /// token is sampled as soon as it is, and the request takes no row
    /// until then (a slow grammar holds its own request, not the step).
    stash: Option<Box<Stash>>,
}

/// A row's logits and log-probabilities, kept until the row's mask is ready.
pub(crate) struct Stash {
    logits: Vec<f32>,
    lp: Vec<f32>,
    top: Vec<(u32, f32)>,
}

impl Active {
    /// It has a grammar: its matcher is here or with the workers, or its
    /// mask (an error, if the matcher was lost) waits to be used.
    fn constrained(&self) -> bool {
        self.grammar.is_some() || self.masking.in_flight || self.masking.ready.is_some()
    }

    /// Its logits wait for their mask: no row until its token is sampled.
    fn stashed(&self) -> bool {
        self.masking.stash.is_some()
    }

    /// One row a step: the last sampled token. Otherwise the request is
    /// prefilling its prompt or, after preemption, recomputing its history.
    fn decoding(&self) -> bool {
        !self.generated.is_empty() && self.computed + 1 == self.history.len()
    }
    /// It takes a decode row this step: decoding, its token sampled, its
    /// reader with room.
    fn takes_decode_row(&self) -> bool {
        self.decoding() && !self.stashed() && self.has_room()
    }
    fn cancelled(&self) -> bool {
        match &self.sink {
            Sink::Local { events, cancel } => cancel.load(Ordering::Relaxed) || events.is_closed(),
            // Remote requests are stopped by their transfer machine.
            Sink::Remote { .. } => false,
        }
    }
    /// Room for what one step can emit (a token and the end): a request
    /// whose reader fell [`request::REQUEST_EVENTS_MAX`] − 1 events behind
    /// waits (back-pressure), holding its pages.
    fn has_room(&self) -> bool {
        self.room() >= EVENTS_PER_STEP_MAX
    }

    /// Events its reader has room for (remote requests: the node's outbox
    /// is not bounded per request).
    fn room(&self) -> usize {
        match &self.sink {
            Sink::Local { events, .. } => events.capacity(),
            Sink::Remote { .. } => usize::MAX,
        }
    }
}

/// How often a batch whose every request waits for its reader looks again.
const BACKPRESSURE_POLL: std::time::Duration = std::time::Duration::from_millis(5);

/// Events one step emits for a request at most: a token, then its end.
const EVENTS_PER_STEP_MAX: usize = 2;

/// Sends an event to a request's sink.
fn emit(outbox: &mut Vec<Outcome>, a: &Active, event: Event) {
    match &a.sink {
        Sink::Local { events, .. } => match events.try_send(event) {
            Ok(()) | Err(tmpsc::error::TrySendError::Closed(_)) => {}
            // `has_room` keeps a request out of the step before this can
            // happen; were it to, the reader sees its stream end without
            // `Done`, which the server reports as an error.
            Err(tmpsc::error::TrySendError::Full(_)) => {
                debug_assert!(false, "request {} overflowed its event channel", a.id.0);
                tracing::error!(request = a.id.0, "event channel full; event dropped");
            }
        },
        Sink::Remote { conn } => outbox.push(Outcome::Event {
            req: a.id,
            conn: *conn,
            event,
        }),
    }
}

/// A request the decode role starts from transferred KV.
pub struct DecodeJob {
    pub req: RequestId,
    pub owner: Owner,
    pub conn: u64,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub params: model::sample::SamplingParams,
    pub sampler_state: u64,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub logprobs: Option<usize>,
    pub pages: Vec<PageRef>,
    pub first_token: u32,
    pub first_logprobs: Option<(f32, Vec<(u32, f32)>)>,
    /// The request's priority and its tenant's weight (K13).
    pub priority: i32,
    pub weight: u32,
    /// The output's grammar, compiled by the node in the request's scope:
    /// decode continues from its state after `first_token`.
    pub grammar: Option<Arc<grammar::Compiled>>,
    /// The request's prediction (drafts; see [`request::GenRequest`]).
    pub prediction: Vec<u32>,
}

/// A prompt the prefill role computes into its own pages.
pub struct PrefillJob {
    pub req: RequestId,
    pub owner: Owner,
    pub prompt: Vec<u32>,
    pub params: model::sample::SamplingParams,
    pub logprobs: Option<usize>,
    pub pages: Vec<PageRef>,
    /// Leading prompt positions whose KV `pages` already hold (cached
    /// pages the transfer machine acquired): computed from here on.
    pub cached_tokens: usize,
    /// The request's priority and its tenant's weight (K13): prompt chunks
    /// go to the least-served tenant first, as in the unified engine.
    pub priority: i32,
    pub weight: u32,
    /// The output's grammar: the first token is sampled under it.
    pub grammar: Option<Arc<grammar::Compiled>>,
}

/// The batch core over a forward step `F` (production: the real model,
/// [`Runner`]; schedule tests: a stand-in).
pub struct Core<F: Forward = Runner> {
    fwd: F,
    tokenizer: Tokenizer,
    pool: Pool,
    cfg: EngineConfig,
    /// Events of remote requests and prefill results (PD roles).
    outbox: Vec<Outcome>,
    max_request: usize,
    /// Active tenants' lines and service counts (K13).
    tenants: BTreeMap<TenantId, TenantQueue>,
    /// Requests submitted so far (their arrival order).
    arrivals: u64,
    /// Requests admitted so far (running ones are ordered by it).
    admissions: u64,
    running: Vec<Active>,
    rows: Vec<Row>,
    stats: Arc<Mutex<EngineStats>>,
    waiting_count: Arc<AtomicU64>,
    local: EngineStats,
    shutdown: Option<bool>,
    /// The pool map the operator console reads (refilled after a step
    /// only while someone reads it).
    console: Arc<crate::console::ConsoleCell>,
    console_work: crate::console::MapWork,
    /// The keyed hash of prefix-cache keys: a per-process random SipHash
    /// key, so no one can craft two prefixes with one key.
    prefix_keys: kv::PrefixKeys,
    /// `fault-incident` builds with `ISOSERVE_FAULT_SHARED_CACHE=1`: one
    /// cache scope for every tenant — the side channel `isoserve probe`'s
    /// prefix-cache check must catch (tests/http/test_probe.py).
    #[cfg(feature = "fault-incident")]
    global_scope: bool,
    /// `fault-incident` builds with `ISOSERVE_FAULT_STALE_READ=1`: after
    /// freeing a request's pages, read one through its old handle — a
    /// use-after-free the pool must refuse and count (`stale_handle`), for
    /// the operator console's browser test (tests/http/test_console.py).
    #[cfg(feature = "fault-incident")]
    stale_read: bool,
    /// The driver's clock: every time a request's timings and the
    /// prefill rate are made of (admission, first token, end, the
    /// forward's length) is read from it. The engine's driver gives the
    /// system's; tests a hand-moved one. (The console cell times its own
    /// map refreshes for the console.)
    clock: Clock,
    /// The last time read: the clock must never run backwards.
    last_time: Option<Instant>,
    /// The mask workers, started with the first constrained request.
    masks: Option<masks::Masks>,
    /// What a row costs a verification step (speculation's drafters weigh
    /// their drafts against it).
    row_cost: spec::RowCost,
    /// Earlier requests' prompts and outputs, by cache scope, for
    /// `--speculative suffix` (K11: a request drafts from its own scope's).
    suffix: spec::SuffixCache,
    /// `fault-incident` builds with `ISOSERVE_FAULT_SHARED_DRAFT_POOL=1`:
    /// one suffix-cache scope for every tenant — the cross-tenant draft
    /// `isoserve probe`'s draft check must catch (tests/http/test_probe.py).
    #[cfg(feature = "fault-incident")]
    shared_drafts: bool,
    /// The draft model and its pool (`--draft-model`).
    draft: Option<draft::DraftModel>,
}

/// A driver's clock (see [`Core::set_clock`]).
pub type Clock = Arc<dyn Fn() -> Instant + Send + Sync>;

/// The compiled grammar a constraint carries, if it was compiled in this
/// process by the `grammar` crate.
pub fn compiled_of(c: &Constraint) -> Option<Arc<grammar::Compiled>> {
    c.compiled
        .clone()
        .and_then(|a| a.downcast::<grammar::Compiled>().ok())
}

impl<F: Forward> Core<F> {
    pub fn new(
        fwd: F,
        tokenizer: Tokenizer,
        pool: Pool,
        cfg: EngineConfig,
        max_request: usize,
        stats: Arc<Mutex<EngineStats>>,
        waiting_count: Arc<AtomicU64>,
    ) -> Core<F> {
        Core {
            fwd,
            tokenizer,
            outbox: Vec::new(),
            rows: Vec::with_capacity(cfg.step_tokens),
            tenants: BTreeMap::new(),
            arrivals: 0,
            admissions: 0,
            running: Vec::with_capacity(cfg.max_running),
            local: EngineStats::new(pool.stats()),
            pool,
            cfg,
            max_request,
            stats,
            waiting_count,
            shutdown: None,
            console: Arc::new(crate::console::ConsoleCell::new()),
            console_work: crate::console::MapWork::default(),
            prefix_keys: kv::PrefixKeys::random(),
            clock: Arc::new(Instant::now),
            last_time: None,
            masks: None,
            row_cost: spec::RowCost::default(),
            suffix: spec::SuffixCache::default(),
            draft: None,
            #[cfg(feature = "fault-incident")]
            shared_drafts: {
                let on =
                    std::env::var_os("ISOSERVE_FAULT_SHARED_DRAFT_POOL").is_some_and(|v| v == "1");
                if on {
                    tracing::error!(
                        "FAULT-INCIDENT BUILD: one suffix-cache scope for every tenant \
                         (ISOSERVE_FAULT_SHARED_DRAFT_POOL=1); for testing isoserve probe only"
                    );
                }
                on
            },
            #[cfg(feature = "fault-incident")]
            global_scope: {
                let on = std::env::var_os("ISOSERVE_FAULT_SHARED_CACHE").is_some_and(|v| v == "1");
                if on {
                    tracing::error!(
                        "FAULT-INCIDENT BUILD: one prefix-cache scope for every tenant \
                         (ISOSERVE_FAULT_SHARED_CACHE=1); for testing isoserve probe only"
                    );
                }
                on
            },
            #[cfg(feature = "fault-incident")]
            stale_read: {
                let on = std::env::var_os("ISOSERVE_FAULT_STALE_READ").is_some_and(|v| v == "1");
                if on {
                    tracing::error!(
                        "FAULT-INCIDENT BUILD: every finished request's first page is read again \
                         after its free (ISOSERVE_FAULT_STALE_READ=1); for testing only"
                    );
                }
                on
            },
        }
    }

    /// Speculates with a draft model (`--draft-model`): a smaller model of
    /// the same vocabulary, whose K/V gets a pool of its own shape with as
    /// many pages of the same size as the target's, under the same checks
    /// (see `core::draft`). Refused, and named, when the vocabularies'
    /// sizes differ or the draft's window is shorter than the window
    /// served.
    pub fn set_draft(&mut self, fwd: Box<dyn Forward>) -> Result<(), crate::StartError> {
        let (want, got) = (self.fwd.vocab(), fwd.vocab());
        if want != got {
            return Err(crate::StartError::Config(format!(
                "the draft model's vocabulary has {got} tokens, the model's {want}"
            )));
        }
        if fwd.context_length() < self.max_request {
            return Err(crate::StartError::Config(format!(
                "the draft model's context window of {} tokens is shorter than the {} served",
                fwd.context_length(),
                self.max_request
            )));
        }
        let shape = fwd.kv_shape(self.cfg.page_size_tokens, self.cfg.kv_dtype)?;
        let pool = Pool::new(
            shape,
            u64::from(self.pool.pages_total()),
            kv::PoolOptions {
                poison: self.cfg.poison,
            },
        )?;
        self.local.draft_pool = Some(pool.stats());
        self.draft = Some(draft::DraftModel::new(fwd, pool));
        Ok(())
    }

    /// The draft model's pool, if there is a draft model.
    pub fn draft_pool(&self) -> Option<&Pool> {
        self.draft.as_ref().map(|d| &d.pool)
    }

    /// The driver's clock (the engine's: the system's monotonic one).
    pub fn set_clock(&mut self, clock: Clock) {
        self.clock = clock;
        self.last_time = None;
    }

    /// The time now, from the driver's clock. Time never runs backwards
    /// here: every duration the core reports is a difference of two of
    /// these.
    fn now(&mut self) -> Instant {
        let now = (self.clock)();
        if let Some(before) = self.last_time {
            assert!(now >= before, "the driver's clock ran backwards");
        }
        self.last_time = Some(now);
        now
    }

    /// The next admission's number.
    fn next_admission(&mut self) -> u64 {
        self.admissions += 1;
        self.admissions
    }

    pub(crate) fn run(mut self, rx: Receiver<Command>) {
        loop {
            // Intake: block when idle, otherwise take what is there. A
            // console map half taken is finished first, a slice per turn,
            // with commands taken between slices (no request waits for
            // more than a slice).
            if self.running.is_empty() && !self.has_work() {
                if self.shutdown.is_some() {
                    break;
                }
                if !self.console_pending() {
                    match rx.recv() {
                        Ok(cmd) => self.command(cmd),
                        Err(_) => break,
                    }
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.command(cmd),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.shutdown.get_or_insert(false);
                        break;
                    }
                }
            }
            if !self.tick() {
                // Every running request waits for its reader: wait for a
                // command or a reader, polling (readers do not wake us).
                match rx.recv_timeout(BACKPRESSURE_POLL) {
                    Ok(cmd) => self.command(cmd),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => {
                        self.shutdown.get_or_insert(false);
                    }
                }
            }
            self.publish();
        }
        self.publish();
    }

    /// One turn of the unified loop after intake: cancel everything on a
    /// hard shutdown, reap cancelled requests, admit from the queue, run a
    /// step. False when requests run but none could take a row (every one
    /// waits for its reader).
    pub(crate) fn tick(&mut self) -> bool {
        if self.shutdown == Some(false) {
            self.cancel_all(RequestError::ShuttingDown);
        }
        self.reap_cancelled();
        self.admit();
        let stepped = self.running.is_empty() || self.step();
        self.prune_tenants();
        stepped
    }

    /// Requests wait (new or preempted).
    fn has_work(&self) -> bool {
        self.tenants.values().any(TenantQueue::has_work)
    }

    pub(crate) fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(sub) => {
                self.arrivals += 1;
                let arrival = self.arrivals;
                let q = self.tenant(sub.req.tenant, sub.req.weight);
                // By priority, then arrival.
                let at = q
                    .waiting
                    .partition_point(|(_, w)| w.req.priority <= sub.req.priority);
                q.waiting.insert(at, (arrival, *sub));
            }
            Command::Shutdown { drain } => {
                self.shutdown = Some(drain && self.shutdown != Some(false));
            }
            // The console asked for a fresh pool map: `publish` follows.
            Command::Wake => self.console.wake_done(),
        }
    }

    /// Publishes occupancy and counters to the shared stats.
    pub fn publish(&mut self) {
        // A scope's suffix-cache entries go with its last cached page
        // (evicted, or never cached: a request shorter than a page).
        if self.cfg.speculation.method == crate::SpecMethod::Suffix {
            let pool = &self.pool;
            #[cfg(feature = "fault-incident")]
            let shared = self.shared_drafts;
            #[cfg(not(feature = "fault-incident"))]
            let shared = false;
            // (The fault build keeps every scope's text under one key,
            // while any scope caches a page.)
            self.suffix.retain(|s| {
                if shared {
                    pool.pages_cached() > 0
                } else {
                    pool.caches_scope(s)
                }
            });
            (self.local.spec_suffix_scopes, self.local.spec_suffix_tokens) = self.suffix.size();
        }
        self.local.spec_row_cost = self.row_cost.ratio();
        self.local.pool = self.pool.stats();
        if let Some(d) = &self.draft {
            self.local.draft_pool = Some(d.pool.stats());
            self.local.spec_draft_passes_total = d.passes_total;
            self.local.spec_draft_rows_total = d.rows_total;
        }
        self.local.running = self.running.len();
        self.local.waiting = self.tenants.values().map(|q| q.waiting.len()).sum();
        self.local.preempted = self.tenants.values().map(|q| q.resumed.len()).sum();
        self.local.tenants.clear();
        for (&tenant, q) in &self.tenants {
            self.local.tenants.push(request::TenantLoad {
                tenant,
                running: 0,
                waiting: q.waiting.len(),
                preempted: q.resumed.len(),
                weight: q.weight,
                service: q.served,
            });
        }
        for a in &self.running {
            if let Some(t) = self
                .local
                .tenants
                .iter_mut()
                .find(|t| t.tenant == a.owner.tenant)
            {
                t.running += 1;
            }
        }
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = self.local.clone();
        if self.console.wanted() {
            self.console.refresh(&self.pool, &mut self.console_work);
        }
    }

    /// A console map is half taken and still wanted: an idle loop must not
    /// block before its next slice (a map nobody reads any more is left,
    /// and the thread blocks).
    pub fn console_pending(&self) -> bool {
        self.console_work.in_progress() && self.console.wanted()
    }

    /// The cell the console reads this core's pool map from.
    pub fn console(&self) -> Arc<crate::console::ConsoleCell> {
        self.console.clone()
    }

    /// `n` requests left the waiting queue (admitted, refused or cancelled):
    /// give their slots back to `Engine::submit`'s count.
    fn left_queue(&self, n: usize) {
        self.waiting_count.fetch_sub(n as u64, Ordering::AcqRel);
    }

    fn cancel_all(&mut self, err: RequestError) {
        for (_, q) in std::mem::take(&mut self.tenants) {
            self.left_queue(q.waiting.len());
            for (_, sub) in q.waiting {
                let _ = sub.events.try_send(Event::Error(err.clone()));
                self.local.requests_cancelled_total += 1;
            }
            for a in q.resumed {
                emit(&mut self.outbox, &a, Event::Error(err.clone()));
                self.local.requests_cancelled_total += 1;
            }
        }
        let running = std::mem::take(&mut self.running);
        for a in running {
            emit(&mut self.outbox, &a, Event::Error(err.clone()));
            self.release(&a);
            self.local.requests_cancelled_total += 1;
        }
    }

    /// Drops cancelled requests, waiting or running, freeing their pages.
    fn reap_cancelled(&mut self) {
        let (mut waiting, mut resumed) = (0, 0);
        for q in self.tenants.values_mut() {
            let before = q.waiting.len();
            q.waiting
                .retain(|(_, s)| !(s.cancel.load(Ordering::Relaxed) || s.events.is_closed()));
            waiting += before - q.waiting.len();
            // Preempted requests hold no pages.
            let before = q.resumed.len();
            q.resumed.retain(|a| !a.cancelled());
            resumed += before - q.resumed.len();
        }
        self.local.requests_cancelled_total += (waiting + resumed) as u64;
        self.left_queue(waiting);
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].cancelled() {
                let a = self.running.swap_remove(i);
                self.release(&a);
                self.local.requests_cancelled_total += 1;
            } else {
                i += 1;
            }
        }
    }

    /// Gives a finished or cancelled request's pages back: cached ones are
    /// released (deepest first, so they are evicted first), private ones
    /// freed.
    fn release(&mut self, a: &Active) {
        // The draft pages are the core's own, on every role.
        if let Some(d) = self.draft.as_mut() {
            d.free(a);
        }
        if a.mode != Mode::Full {
            // PD roles: the transfer machine owns the pages' lifecycle.
            return;
        }
        // Every page is private or shared, never both or neither.
        assert_eq!(
            a.pages.len(),
            a.shared.len(),
            "request {}'s page flags",
            a.id
        );
        for (&h, &shared) in a.pages.iter().zip(&a.shared).rev() {
            let outcome = match shared {
                true => self.pool.release(h, a.owner).map(|()| FreeOutcome::Freed),
                false => self.pool.free(h, a.owner),
            };
            match outcome {
                Ok(FreeOutcome::Freed) => {}
                // Unified role: nothing leases pages, so a deferral or an
                // error here is a bug — counted by the pool, logged here.
                other => {
                    tracing::error!(request = a.id.0, ?other, "unexpected page release outcome")
                }
            }
        }
        #[cfg(feature = "fault-incident")]
        if self.stale_read {
            if let Some(&h) = a.pages.first() {
                let read = self.pool.read_layer(h, a.owner, 0, 1).map(|_| ());
                tracing::error!(request = a.id.0, ?read, "FAULT: read a freed page");
            }
        }
    }

    /// Admission: fair share between tenants (K13), then room (K8). The
    /// tenant that has received the least service per weight goes first
    /// (ties: the earlier arrival); within a tenant, preempted requests
    /// resume first, then new ones by priority and arrival. A request is
    /// admitted whole (all its pages) or not at all. If it does not fit,
    /// running requests of tenants above their fair share of the batch
    /// (or of its own tenant at a worse priority) are preempted to make
    /// room, most recently admitted first ([`Core::make_room`]); if none
    /// can be, admission stops: no request passes the chosen one, so none
    /// starves.
    fn admit(&mut self) {
        // Tenants whose next request waits this tick for a running
        // request that is computing its prefix (it is not blocked on room).
        let mut deferred: Vec<TenantId> = Vec::new();
        for _ in 0..ADMISSIONS_PER_TICK_MAX {
            let Some(t) = self.next_tenant(&deferred) else {
                break;
            };
            let placed = match self.tenants[&t].resumed.is_empty() {
                false => self.resume(t),
                true => self.admit_new(t),
            };
            match placed {
                Placed::Admitted | Placed::Dropped => {}
                Placed::Deferred => deferred.push(t),
                Placed::NoRoom => break,
            }
        }
    }

    /// The active tenant to serve next: the least service per weight;
    /// ties go to the one running the fewest requests per weight (a
    /// tenant that just arrived starts level with the least served, and
    /// should not wait a step for it), then to the earliest arrival.
    fn next_tenant(&self, skip: &[TenantId]) -> Option<TenantId> {
        let running = |t: &TenantId, q: &TenantQueue| {
            let n = self
                .running
                .iter()
                .filter(|a| a.mode == Mode::Full && a.owner.tenant == *t)
                .count();
            n as f64 / f64::from(q.weight.max(1))
        };
        self.tenants
            .iter()
            .filter(|(t, q)| !skip.contains(t) && q.has_work())
            .map(|(t, q)| (t, q, running(t, q)))
            .min_by(|(_, a, ra), (_, b, rb)| {
                a.served
                    .total_cmp(&b.served)
                    .then(ra.total_cmp(rb))
                    .then(a.first_arrival().cmp(&b.first_arrival()))
            })
            .map(|(&t, _, _)| t)
    }

    /// Admits tenant `t`'s next new request, refuses it (K8 re-check), or
    /// says why it waits.
    fn admit_new(&mut self, t: TenantId) -> Placed {
        let ps = self.cfg.page_size_tokens;
        let q = &self.tenants[&t];
        let (_, sub) = q.waiting.front().expect("chosen: has a new request");
        // Re-check on this node, before any allocation (K8).
        let checked =
            crate::validate(&sub.req, self.max_request, self.fwd.vocab()).and_then(|()| {
                match &sub.req.grammar {
                    // `Engine::submit` compiles what its caller did not: the
                    // engine thread never compiles.
                    Some(c) if compiled_of(c).is_none() => Err(RequestError::Internal(
                        "the request's grammar reached the engine uncompiled".into(),
                    )),
                    _ => Ok(()),
                }
            });
        if let Err(e) = checked {
            let (_, sub) = self.pop_waiting(t);
            let _ = sub.events.try_send(Event::Error(e));
            self.local.requests_refused_total += 1;
            return Placed::Dropped;
        }
        let need_pages = (sub.req.prompt.len() + sub.req.max_tokens).div_ceil(ps);
        let priority = sub.req.priority;
        let owner = Owner::request(sub.id, sub.req.tenant, sub.req.cache_scope);
        #[cfg(feature = "fault-incident")]
        let owner = match self.global_scope {
            true => Owner::request(sub.id, sub.req.tenant, Some(kv::Scope::derived(0))),
            false => owner,
        };
        // The longest cached prefix of whole pages in the request's scope
        // (K11). The last prompt token is always computed: its logits give
        // the first token.
        let mut keys = Vec::new();
        let mut hits = Vec::new();
        if self.cfg.prefix_cache == PrefixCache::Tenant {
            self.prefix_keys
                .extend(ps, owner.scope, &sub.req.prompt, &mut keys);
            let reusable = ((sub.req.prompt.len() - 1) / ps).min(keys.len());
            self.pool
                .cached_prefix(owner.scope, &keys[..reusable], &mut hits);
            // A running request of the same scope is computing the next
            // page of this prefix right now (it publishes it within a few
            // steps): wait for it rather than compute the same KV twice —
            // conversations that open with one system prompt arrive
            // together. It makes progress without us, so this wait ends.
            let next = hits.len();
            if next < reusable
                && self.running.iter().any(|a| {
                    a.mode == Mode::Full
                        && !a.decoding()
                        && a.owner.scope == owner.scope
                        && a.keys.get(next) == Some(&keys[next])
                })
            {
                return Placed::Deferred;
            }
        }
        if !self.make_room(t, priority, need_pages - hits.len(), &hits) {
            return Placed::NoRoom;
        }
        let (seq, sub) = self.pop_waiting(t);
        let mut pages = Vec::with_capacity(need_pages);
        if let Err(e) = hold(&mut self.pool, owner, &hits, need_pages, &mut pages) {
            let _ = sub
                .events
                .try_send(Event::Error(RequestError::Internal(e.to_string())));
            self.local.requests_failed_total += 1;
            return Placed::Dropped;
        }
        if self.cfg.prefix_cache == PrefixCache::Tenant {
            self.local.prefix_cache_queries_total += 1;
            self.local.prefix_cache_query_tokens_total += sub.req.prompt.len() as u64;
            self.local.prefix_cache_hit_pages_total += hits.len() as u64;
            self.local.prefix_cache_hit_tokens_total += (hits.len() * ps) as u64;
        }
        let mut shared = vec![false; pages.len()];
        shared[..hits.len()].fill(true);
        let cached_tokens = hits.len() * ps;
        // Paired with the request log's read when the request ends.
        sub.pages.store(pages.len() as u64, Ordering::Release);
        let stops = match StopStrings::new(sub.req.stop.clone()) {
            Ok(s) => s,
            Err(e) => {
                // validate() accepted it; unreachable, but never panic.
                let _ = sub
                    .events
                    .try_send(Event::Error(RequestError::InvalidParam {
                        field: e.field,
                        why: e.why,
                    }));
                give_back(&mut self.pool, owner, &pages, hits.len());
                return Placed::Dropped;
            }
        };
        self.local.prompt_tokens_total += sub.req.prompt.len() as u64;
        let history = sub.req.prompt.clone();
        // The incident (test builds only): a placeholder computes only its
        // last token and reads the rest of its pages as it finds them.
        #[cfg(feature = "fault-incident")]
        let computed = if sub.placeholder {
            sub.req.prompt.len() - 1
        } else {
            cached_tokens
        };
        #[cfg(not(feature = "fault-incident"))]
        let computed = cached_tokens;
        let admission = self.next_admission();
        let admitted_at = self.now();
        self.running.push(Active {
            mode: Mode::Full,
            id: sub.id,
            owner,
            seq,
            priority,
            prompt: sub.req.prompt,
            max_tokens: sub.req.max_tokens,
            ignore_eos: sub.req.ignore_eos,
            logprobs: sub.req.logprobs,
            sampler: Sampler::new(sub.req.params),
            grammar: sub
                .req
                .grammar
                .as_ref()
                .and_then(compiled_of)
                .map(|g| g.matcher()),
            masking: Masking::default(),
            stops,
            decoder: self.tokenizer.stream_decoder().skip_special(true),
            pages,
            shared,
            keys,
            cached_tokens,
            computed,
            generated: Vec::with_capacity(sub.req.max_tokens.min(4096)),
            history,
            sink: Sink::Local {
                events: sub.events,
                cancel: sub.cancel,
            },
            submitted_at: sub.submitted_at,
            admitted_at,
            admission,
            first_token_at: None,
            drafter: spec::Drafter::new(sub.req.prediction, &self.cfg.speculation),
            draft: Vec::new(),
            draft_pos: 0,
            draft_kept: 0,
            model_drafter: None,
            dpages: Vec::new(),
            dcomputed: 0,
            dwritten: 0,
        });
        let a = self.running.last_mut().expect("just pushed");
        hold_draft(&mut self.draft, ps, a, &mut self.local);
        Placed::Admitted
    }

    /// Takes tenant `t`'s next new request out of the queue.
    fn pop_waiting(&mut self, t: TenantId) -> (u64, Submitted) {
        let w = self
            .tenants
            .get_mut(&t)
            .and_then(|q| q.waiting.pop_front())
            .expect("chosen: has a new request");
        self.left_queue(1);
        w
    }

    /// Puts tenant `t`'s oldest preempted request back in the batch: the
    /// cached pages of what it had computed (its full pages were cached
    /// when it was preempted, if they are still there), its other pages
    /// fresh; it recomputes the rest before it samples again, so its
    /// output is what it would have been (K12).
    fn resume(&mut self, t: TenantId) -> Placed {
        let ps = self.cfg.page_size_tokens;
        // Out of the line first: making room may preempt requests of this
        // very tenant into it, ahead of this one (they arrived earlier).
        let mut a = self
            .tenants
            .get_mut(&t)
            .and_then(|q| q.resumed.pop_front())
            .expect("chosen: has a preempted request");
        let need_pages = (a.prompt.len() + a.max_tokens).div_ceil(ps);
        let mut hits = Vec::new();
        if self.cfg.prefix_cache == PrefixCache::Tenant {
            // The last token of the history is always run (its logits).
            let reusable = ((a.history.len() - 1) / ps).min(a.keys.len());
            self.pool
                .cached_prefix(a.owner.scope, &a.keys[..reusable], &mut hits);
        }
        if !self.make_room(t, a.priority, need_pages - hits.len(), &hits) {
            // Back to the front of its line, by arrival.
            let q = self
                .tenants
                .get_mut(&t)
                .expect("a running or waiting tenant");
            let at = q.resumed.partition_point(|r| r.seq < a.seq);
            q.resumed.insert(at, a);
            return Placed::NoRoom;
        }
        let mut pages = Vec::with_capacity(need_pages);
        if let Err(e) = hold(&mut self.pool, a.owner, &hits, need_pages, &mut pages) {
            emit(
                &mut self.outbox,
                &a,
                Event::Error(RequestError::Internal(e.to_string())),
            );
            self.local.requests_failed_total += 1;
            return Placed::Dropped;
        }
        a.shared = vec![false; pages.len()];
        a.shared[..hits.len()].fill(true);
        a.pages = pages;
        a.computed = hits.len() * ps;
        hold_draft(&mut self.draft, ps, &mut a, &mut self.local);
        self.running.push(a);
        Placed::Admitted
    }

    /// Makes room for a request of tenant `t` at `priority` that needs
    /// `need` pages besides the cached `hits` it will hold: true once a
    /// batch slot and the pages are there. Preempts, one at a time and
    /// only while that can help, running requests of tenants holding more
    /// than their fair share of the batch — more running requests per
    /// weight than `t` would hold with this one — or of `t` itself at a
    /// worse priority; the tenant furthest over its share first, its most
    /// recently admitted request first (the least work lost).
    fn make_room(&mut self, t: TenantId, priority: i32, need: usize, hits: &[PageRef]) -> bool {
        for _ in 0..=self.running.len() {
            let slot = self.running.len() < self.cfg.max_running;
            // Cached pages about to be held stop being evictable.
            let available = self.pool.pages_available() as usize - self.pool.idle_among(hits);
            if slot && need <= available {
                return true;
            }
            let victims = self.victims(t, priority);
            // Only preempt if the victims' pages could cover the shortfall.
            // (A cached page another request also holds stays held.)
            let freeable: usize = victims
                .iter()
                .map(|&i| self.pool.freed_by_giving_back(&self.running[i].pages))
                .sum();
            let Some(&victim) = victims.first() else {
                return false;
            };
            if need > available + freeable {
                return false;
            }
            self.preempt(victim);
        }
        false
    }

    /// Running requests that tenant `t`'s request at `priority` may
    /// preempt, best victim first.
    fn victims(&self, t: TenantId, priority: i32) -> Vec<usize> {
        let mut running: BTreeMap<TenantId, usize> = BTreeMap::new();
        for a in self.running.iter().filter(|a| a.mode == Mode::Full) {
            *running.entry(a.owner.tenant).or_default() += 1;
        }
        let weight = |x: &TenantId| self.tenants.get(x).map_or(1, |q| q.weight) as usize;
        let mine = running.get(&t).copied().unwrap_or(0) + 1;
        let over = |v: &TenantId| running[v] * weight(&t) > mine * weight(v);
        let mut v: Vec<(usize, bool, f64, u64)> = self
            .running
            .iter()
            .enumerate()
            .filter(|(_, a)| a.mode == Mode::Full)
            .filter(|(_, a)| match a.owner.tenant == t {
                true => a.priority > priority,
                false => over(&a.owner.tenant),
            })
            .map(|(i, a)| {
                let x = a.owner.tenant;
                let share = running[&x] as f64 / weight(&x) as f64;
                (i, x != t, share, a.admission)
            })
            .collect();
        // Other tenants first, the furthest over its share first, the
        // latest admitted first.
        v.sort_by(|a, b| b.1.cmp(&a.1).then(b.2.total_cmp(&a.2)).then(b.3.cmp(&a.3)));
        v.into_iter().map(|x| x.0).collect()
    }

    /// Takes running request `i` out of the batch to resume later: its full
    /// computed pages go to the prefix cache first (so resuming costs
    /// little while they stay cached), then every page is given back; it
    /// waits first in its tenant's line.
    fn preempt(&mut self, i: usize) {
        // Its matcher comes home first (a mask is bounded by the grammar's
        // step limits; the bound here only guards a lost worker).
        let deadline = Instant::now() + MASK_WAIT_MAX;
        while self.running[i].masking.in_flight {
            match self.masks.as_mut().and_then(|m| m.recv(Some(deadline))) {
                Some(done) => self.mask_done(done),
                None => {
                    let a = &mut self.running[i];
                    a.masking.in_flight = false;
                    a.masking.ready = Some(Err("the grammar's mask was lost".into()));
                }
            }
        }
        let mut a = self.running.remove(i);
        // Logits waiting for their mask are recomputed on resuming (K12:
        // the same logits); the mask, if it came, is kept for them.
        a.masking.stash = None;
        if self.cfg.prefix_cache == PrefixCache::Tenant {
            let ps = self.cfg.page_size_tokens;
            let computed = a.computed;
            self.prefix_keys
                .extend(ps, a.owner.scope, &a.history[..computed], &mut a.keys);
            cache_pages(&mut self.pool, &mut a, computed / ps);
        }
        self.release(&a);
        a.pages.clear();
        a.shared.clear();
        a.computed = 0;
        a.dpages.clear();
        (a.dcomputed, a.dwritten) = (0, 0);
        self.local.requests_preempted_total += 1;
        let least = self.least_served();
        let q = self
            .tenants
            .entry(a.owner.tenant)
            .or_insert_with(|| TenantQueue::new(least, 1));
        let at = q.resumed.partition_point(|r| r.seq < a.seq);
        q.resumed.insert(at, a);
    }

    /// The tenant's line, made if it has none (starting level with the
    /// least-served active tenant), its weight updated.
    fn tenant(&mut self, t: TenantId, weight: u32) -> &mut TenantQueue {
        let least = self.least_served();
        let q = self
            .tenants
            .entry(t)
            .or_insert_with(|| TenantQueue::new(least, 1));
        q.weight = weight.max(1);
        q
    }

    /// The service count of the least-served active tenant (a tenant that
    /// becomes active starts there: no credit is banked while away).
    fn least_served(&self) -> f64 {
        self.tenants
            .values()
            .map(|q| q.served)
            .min_by(f64::total_cmp)
            .unwrap_or(0.0)
    }

    /// Forgets tenants with nothing waiting or running (bounds the map).
    fn prune_tenants(&mut self) {
        let running: BTreeSet<TenantId> = self.running.iter().map(|a| a.owner.tenant).collect();
        self.tenants
            .retain(|t, q| q.has_work() || running.contains(t));
    }

    /// A mask came back from the workers: the matcher goes home with it.
    /// (A request gone meanwhile — cancelled, failed — drops both.)
    fn mask_done(&mut self, done: masks::Done) {
        let Some(a) = self.running.iter_mut().find(|a| a.id == done.req) else {
            return;
        };
        // Paired with `send_mask`: one matcher away, one answer back.
        assert!(
            a.masking.in_flight && a.grammar.is_none() && a.masking.ready.is_none(),
            "request {}'s mask came back twice",
            a.id
        );
        a.masking.in_flight = false;
        a.grammar = Some(done.matcher);
        a.masking.cost_ns = done.took.as_nanos().min(u64::MAX as u128) as u64;
        a.masking.ready = Some(done.mask.map_err(|e| e.to_string()));
    }

    /// Takes the masks that came back (waiting until `deadline` for the
    /// first, if given) and samples every request whose logits waited for
    /// its mask. True if a token was sampled or a request ended.
    fn sample_stashed(&mut self, deadline: Option<Instant>) -> bool {
        // No mask workers: no constrained request ever ran, none waits.
        if self.masks.is_none() {
            return false;
        }
        let mut wait = deadline;
        while let Some(done) = self.masks.as_mut().and_then(|m| m.recv(wait)) {
            self.mask_done(done);
            wait = None;
        }
        let ready: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].stashed() && self.running[i].masking.ready.is_some())
            .collect();
        if ready.is_empty() {
            return false;
        }
        let now = self.now();
        let mut ended = Vec::new();
        for i in ready {
            let a = &mut self.running[i];
            let Some(mut stash) = a.masking.stash.take() else {
                continue;
            };
            let top = std::mem::take(&mut stash.top);
            match sample_row(
                now,
                &self.tokenizer,
                a,
                &mut stash.logits,
                &stash.lp,
                top,
                &mut self.outbox,
                &mut self.local,
                &mut self.masks,
            ) {
                RowEnd::Running => {}
                RowEnd::Ended(f) => ended.push((i, Ok(f))),
                RowEnd::Failed(e) => ended.push((i, Err(e))),
            }
        }
        self.end_requests(ended);
        true
    }

    /// Takes finished and failed requests out of the batch (`None`: a
    /// prefill handed back to its transfer) and tells their clients.
    fn end_requests(
        &mut self,
        mut ended: Vec<(usize, Result<Option<FinishReason>, RequestError>)>,
    ) {
        // Highest index first keeps the indices valid.
        ended.sort_by_key(|f| std::cmp::Reverse(f.0));
        let mut dones = Vec::with_capacity(ended.len());
        let mut errors = Vec::new();
        for (i, end) in ended {
            let a = self.running.swap_remove(i);
            match end {
                Ok(None) => {}
                Ok(Some(finish)) => dones.push(self.done_event(a, finish)),
                Err(e) => {
                    // (PD roles: `release` leaves the pages to the
                    // transfer machine, which the error reaches.)
                    self.release(&a);
                    errors.push((a, e));
                    self.local.requests_failed_total += 1;
                }
            }
        }
        if !errors.is_empty() {
            self.publish();
        }
        for (a, e) in errors {
            emit(&mut self.outbox, &a, Event::Error(e));
        }
        // Publish before telling the clients, so a client that reads the
        // stats after its Done sees its pages free.
        if !dones.is_empty() {
            self.publish();
        }
        for (a, done) in dones {
            emit(&mut self.outbox, &a, Event::Done(done));
        }
    }

    /// One forward step: a decode row per decoding request whose reader has
    /// room for what the step emits, then prompt chunks under the token
    /// budget. False when no row could run (every request waits for its
    /// reader).
    fn step(&mut self) -> bool {
        // Requests whose logits waited for their mask sample first (their
        // token then takes this step's row).
        self.sample_stashed(None);
        let budget = self.cfg.step_tokens;
        self.rows.clear();
        let spec = self.cfg.speculation;
        let decoding = self.running.iter().filter(|a| a.takes_decode_row()).count();
        // Draft rows this step may take: speculation gives way as the batch
        // fills the step by itself.
        let mut draft_rows = spec
            .rows_max
            .saturating_sub(decoding)
            .min(budget.saturating_sub(decoding));
        let row_cost = self.row_cost.ratio();
        // What a pass of the draft model costs, in rows of this step.
        let pass_rows = self
            .draft
            .as_ref()
            .and_then(|d| d.pass_rows(self.row_cost.row_secs()));
        // Requests the draft model drafts for, and the rows they reserve.
        let mut model_plans: Vec<(usize, usize)> = Vec::new();
        let mut reserved = 0;
        // Which running request each row belongs to: `seq` indexes `running`.
        for (i, a) in self.running.iter_mut().enumerate() {
            a.draft.clear();
            a.draft_kept = 0;
            if a.takes_decode_row() && self.rows.len() + reserved < budget {
                let pos = a.prompt.len() + a.generated.len() - 1;
                let token = *a
                    .generated
                    .last()
                    .expect("decoding implies a generated token");
                self.rows.push(Row {
                    seq: i,
                    pos,
                    token,
                    logits: true,
                });
                // Speculation: drafted tokens follow as rows of their own,
                // each sampled as a decode step would be (never under a
                // grammar: its masks are computed one token at a time).
                // A step emits at most the draft, the model's own token
                // and the end: the reader must have room for them all,
                // and the request for the tokens.
                let limit = draft_rows
                    .min(budget - self.rows.len() - reserved)
                    .min(a.max_tokens.saturating_sub(a.generated.len() + 1))
                    .min(a.room().saturating_sub(EVENTS_PER_STEP_MAX));
                let free = !a.constrained();
                if !free || limit == 0 {
                    continue;
                }
                let stored = match (&a.drafter, spec.method) {
                    (Some(_), crate::SpecMethod::Suffix) => self.suffix.entries(suffix_scope(
                        a.owner.scope,
                        #[cfg(feature = "fault-incident")]
                        self.shared_drafts,
                    )),
                    _ => &[],
                };
                let ctx = spec::StepCtx {
                    cfg: &spec,
                    row_cost,
                    batch: decoding,
                    stored,
                };
                a.draft_pos = pos;
                let mut n = 0;
                if let Some(d) = a.drafter.as_mut() {
                    n = d.propose(&a.history, limit, &ctx, &mut a.draft);
                    for (j, &token) in a.draft.iter().enumerate() {
                        self.rows.push(Row {
                            seq: i,
                            pos: pos + 1 + j,
                            token,
                            logits: true,
                        });
                    }
                    draft_rows -= n;
                }
                // Where the text sources have nothing to follow, the draft
                // model drafts (its passes run once every request's plan
                // is known, batched).
                let drafts_with_model = n == 0 && !a.dpages.is_empty();
                if let Some(m) = a.model_drafter.as_mut().filter(|_| drafts_with_model) {
                    let k = m.plan(limit, &ctx, pass_rows);
                    if k > 0 {
                        model_plans.push((i, k));
                        reserved += k;
                        draft_rows -= k;
                    }
                }
            }
        }
        // The draft model's passes, then its drafts' rows.
        let mut draft_failed = None;
        if !model_plans.is_empty() {
            let d = self
                .draft
                .as_mut()
                .expect("plans are made with a draft model");
            match d.draft(&mut self.running, &model_plans, budget, &self.clock) {
                Ok(got) => {
                    for (&(i, _), n) in model_plans.iter().zip(got) {
                        let a = &mut self.running[i];
                        if let Some(m) = a.model_drafter.as_mut() {
                            m.drafted(n);
                        }
                        for (j, &token) in a.draft.iter().enumerate() {
                            self.rows.push(Row {
                                seq: i,
                                pos: a.draft_pos + 1 + j,
                                token,
                                logits: true,
                            });
                        }
                    }
                }
                Err(e) => draft_failed = Some(e),
            }
        }
        // Then prompt chunks (and the recomputation of preempted requests)
        // under the budget, the least-served tenant's first (K13), so one
        // tenant's long prompts do not hold back another's first token.
        let served = |a: &Active| self.tenants.get(&a.owner.tenant).map_or(0.0, |q| q.served);
        let mut chunks: Vec<usize> = (0..self.running.len())
            .filter(|&i| !self.running[i].decoding() && !self.running[i].stashed())
            .collect();
        // Within a tenant: by priority, then the fewest positions left to
        // compute — a short prompt's first token does not wait for a long
        // prompt's whole prefill (the long one still gets what the short
        // ones leave of the budget, every step).
        chunks.sort_by(|&x, &y| {
            let (a, b) = (&self.running[x], &self.running[y]);
            served(a)
                .total_cmp(&served(b))
                .then(a.priority.cmp(&b.priority))
                .then((a.history.len() - a.computed).cmp(&(b.history.len() - b.computed)))
        });
        let mut catching_up = Vec::with_capacity(chunks.len());
        for i in chunks {
            let a = &self.running[i];
            let left = budget - self.rows.len();
            if left == 0 {
                break;
            }
            // A preempted request's last recomputed row samples a token:
            // it needs room in its reader's channel like a decode row.
            if !a.generated.is_empty() && !a.has_room() {
                continue;
            }
            catching_up.push(i);
            let end = (a.computed + left).min(a.history.len());
            for pos in a.computed..end {
                self.rows.push(Row {
                    seq: i,
                    pos,
                    token: a.history[pos],
                    logits: pos == a.history.len() - 1,
                });
            }
        }
        if self.rows.is_empty() {
            // Every running request waits for its mask or its reader
            // (back-pressure): a mask that comes back is the step's work.
            if self.running.iter().any(Active::stashed) {
                return self.sample_stashed(Some(Instant::now() + BACKPRESSURE_POLL));
            }
            return false;
        }
        // The grammar masks of the rows that sample: a matcher at home
        // without its next mask (a first token, a resumed request) goes to
        // the mask workers now; the others went when their last token was
        // sampled. Either way the mask is computed beside the forward pass.
        for ri in 0..self.rows.len() {
            let r = self.rows[ri];
            let a = &mut self.running[r.seq];
            if r.logits && a.constrained() && a.masking.ready.is_none() && !a.masking.in_flight {
                send_mask(&mut self.masks, a);
            }
        }
        let seqs: Vec<SeqCtx<'_>> = self
            .running
            .iter()
            .map(|a| SeqCtx {
                owner: a.owner,
                pages: &a.pages,
            })
            .collect();
        let started = (self.clock)();
        // A draft pass that failed (a refused draft-pool access: a bug)
        // fails the batch as a failed forward would.
        let mut result = match draft_failed {
            Some(e) => Err(e),
            None => self.fwd.forward(&mut self.pool, &seqs, &self.rows),
        };
        drop(seqs);
        // The step's masks: wait for them a quarter of the forward's time
        // more at most; a row whose mask is later keeps its logits and
        // samples when it comes (its request alone waits).
        let forward_s = ((self.clock)() - started).as_secs_f64();
        let grace = Duration::from_secs_f64((forward_s / 4.0).max(MASK_GRACE_MIN_S));
        let deadline = Instant::now() + grace;
        while self.rows.iter().any(|r| {
            r.logits && {
                let a = &self.running[r.seq];
                a.constrained() && a.masking.ready.is_none() && a.masking.in_flight
            }
        }) {
            let Some(done) = self.masks.as_mut().and_then(|m| m.recv(Some(deadline))) else {
                break;
            };
            self.mask_done(done);
        }
        let vocab = self.fwd.vocab();
        let logit_rows = self.rows.iter().filter(|r| r.logits).count();
        if result.is_ok() && self.fwd.logits().len() < logit_rows * vocab {
            // A forward that returned fewer logits than asked for is a bug;
            // fail the batch rather than sample from stale numbers.
            result = Err(model::ModelError::Batch(format!(
                "the forward step returned {} logits for {logit_rows} rows of {vocab}",
                self.fwd.logits().len()
            )));
        }
        self.local.steps_total += 1;
        // Decode and verification steps (no prompt rows) teach the drafters
        // what a row costs.
        if catching_up.is_empty() && result.is_ok() {
            self.row_cost.record(self.rows.len(), forward_s);
        }
        // Tokens are timed when the forward that made them ended.
        let now = self.now();
        let secs = (now - started).as_secs_f64();
        if result.is_ok() && self.rows.len() >= PREFILL_RATE_ROWS_MIN && secs > 0.0 {
            let rate = self.rows.len() as f64 / secs;
            let old = self.local.prefill_tokens_per_s;
            self.local.prefill_tokens_per_s = if old == 0.0 {
                rate
            } else {
                0.8 * old + 0.2 * rate
            };
        }
        if let Err(e) = result {
            // A refused KV access or a bad batch: fail every request in the
            // batch with the error; never serve what was computed.
            tracing::error!("forward step failed: {e}");
            let failed = std::mem::take(&mut self.running);
            for a in &failed {
                self.release(a);
                self.local.requests_failed_total += 1;
            }
            self.publish();
            for a in failed {
                emit(
                    &mut self.outbox,
                    &a,
                    Event::Error(RequestError::Internal(e.to_string())),
                );
            }
            return true;
        }
        // Advance computed positions and count each tenant's service.
        for r in &self.rows {
            let a = &mut self.running[r.seq];
            a.computed = a.computed.max(r.pos + 1);
            if let Some(q) = self.tenants.get_mut(&a.owner.tenant) {
                q.served += 1.0 / f64::from(q.weight.max(1));
            }
        }
        // A prompt (or a preempted request's history) just computed offers
        // its full pages to the prefix cache.
        if self.cfg.prefix_cache == PrefixCache::Tenant {
            let ps = self.cfg.page_size_tokens;
            for i in catching_up {
                let a = &mut self.running[i];
                if a.mode == Mode::Full && a.computed == a.history.len() {
                    let computed = a.computed;
                    self.prefix_keys
                        .extend(ps, a.owner.scope, &a.history[..computed], &mut a.keys);
                    cache_pages(&mut self.pool, a, computed / ps);
                }
            }
        }
        // Sample for every row that produced logits, in row order.
        let all_logits = self.fwd.logits();
        let mut k = 0;
        // (index in `running`, how it ended; `None`: handed back to the
        // prefill role's transfer).
        let mut finished: Vec<(usize, Option<FinishReason>)> = Vec::new();
        // Requests whose grammar could not be followed: they end with the
        // error, never with output the grammar does not accept.
        let mut failed: Vec<(usize, RequestError)> = Vec::new();
        // Requests that ended or failed in this step (their later rows,
        // drafts, are not sampled).
        let mut ended = vec![false; self.running.len()];
        for ri in 0..self.rows.len() {
            let r = self.rows[ri];
            if !r.logits {
                continue;
            }
            let logits = &mut all_logits[k * vocab..(k + 1) * vocab];
            k += 1;
            let a = &mut self.running[r.seq];
            // A row samples only if its input is the request's last token:
            // a draft row whose draft the previous row's token did not
            // equal (or after the request ended) computed a future that
            // did not happen.
            if ended[r.seq] || r.pos + 1 != a.history.len() || a.history[r.pos] != r.token {
                continue;
            }
            // Log-probabilities are the model's own distribution, before
            // the grammar's mask, biases and penalties.
            let (lp, top) = match a.logprobs {
                Some(n) => logprobs_of(logits, n),
                None => (Vec::new(), Vec::new()),
            };
            if a.constrained() && a.masking.ready.is_none() {
                // Its mask is late: keep the logits for when it comes.
                a.masking.stash = Some(Box::new(Stash {
                    logits: logits.to_vec(),
                    lp,
                    top,
                }));
                self.local.grammar_deferred_total += 1;
                continue;
            }
            match sample_row(
                now,
                &self.tokenizer,
                a,
                logits,
                &lp,
                top,
                &mut self.outbox,
                &mut self.local,
                &mut self.masks,
            ) {
                RowEnd::Running => {}
                RowEnd::Ended(f) => {
                    ended[r.seq] = true;
                    finished.push((r.seq, f));
                }
                RowEnd::Failed(e) => {
                    ended[r.seq] = true;
                    failed.push((r.seq, e));
                }
            }
            // The token sampled from the draft's row j - 1 equals draft
            // token j: kept.
            if !a.draft.is_empty() {
                let j = r.pos - a.draft_pos;
                if j == a.draft_kept && a.draft.get(j) == a.history.last() {
                    a.draft_kept += 1;
                }
            }
        }
        // Drafts verified: the rows past what was kept are rolled back.
        for (i, ended) in ended.iter_mut().enumerate() {
            if self.running[i].draft.is_empty() {
                continue;
            }
            if let Err(e) = self.settle_draft(i) {
                if !*ended {
                    *ended = true;
                    failed.push((i, e));
                }
            }
        }
        self.end_requests(
            finished
                .into_iter()
                .map(|(i, f)| (i, Ok(f)))
                .chain(failed.into_iter().map(|(i, e)| (i, Err(e))))
                .collect(),
        );
        true
    }

    /// After a step verified request `i`'s draft: counts it, tells its
    /// drafter what was kept, and rolls the rows past the request's
    /// history back in the pool (K3: a rejected row reads as unwritten
    /// until it is written again). The rollback is read back: a page that
    /// still claims a rejected row fails the request.
    fn settle_draft(&mut self, i: usize) -> Result<(), RequestError> {
        let ps = self.cfg.page_size_tokens;
        let a = &mut self.running[i];
        let drafted = a.draft.len();
        self.local.spec_drafts_total += 1;
        self.local.spec_draft_tokens_total += drafted as u64;
        self.local.spec_accepted_tokens_total += a.draft_kept as u64;
        if let Some(d) = a.drafter.as_mut() {
            d.verified(a.draft_kept);
        }
        if let Some(m) = a.model_drafter.as_mut() {
            m.verified(a.draft_kept);
        }
        // The draft model's rows past what was kept, in its own pool.
        if let Some(d) = self.draft.as_mut() {
            if a.dwritten > a.dcomputed {
                d.settle(a, ps).map_err(RequestError::Internal)?;
            }
        }
        // Rows written: the decode row and the draft's. Kept: the history
        // but its last token (sampled, not yet run).
        let written_end = a.draft_pos + 1 + drafted;
        let keep = a.history.len() - 1;
        a.computed = keep;
        if keep >= written_end {
            return Ok(());
        }
        draft::rewind(&mut self.pool, a.owner, &a.pages, keep, written_end, ps)
            .map_err(RequestError::Internal)
    }

    /// Ends a request that finished: its Done event; frees its pages (Full
    /// mode) and counts it.
    fn done_event(&mut self, mut a: Active, finish: FinishReason) -> (Active, DoneEvent) {
        // The suffix cache keeps what the request read and wrote for its
        // scope's later requests; scopes whose cached pages are all gone
        // lose theirs.
        if self.cfg.speculation.method == crate::SpecMethod::Suffix
            && self.cfg.prefix_cache == PrefixCache::Tenant
            && a.mode == Mode::Full
        {
            let scope = suffix_scope(
                a.owner.scope,
                #[cfg(feature = "fault-incident")]
                self.shared_drafts,
            );
            self.suffix
                .insert(scope, &a.history, self.cfg.speculation.suffix_tokens);
        }
        if a.mode == Mode::Full && self.cfg.prefix_cache == PrefixCache::Tenant {
            // Cache the whole conversation so far (a next turn starts with
            // it): every full page whose slots were all written — all of
            // history but the last token, which was sampled, never run.
            let ps = self.cfg.page_size_tokens;
            let written = a.history.len() - 1;
            self.prefix_keys
                .extend(ps, a.owner.scope, &a.history[..written], &mut a.keys);
            cache_pages(&mut self.pool, &mut a, written / ps);
        }
        // Text held back as a possible stop string's start is output after
        // all when the request ends otherwise (a stop string that matched
        // left nothing held back).
        let tail_text = a.stops.flush();
        let now = self.now();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let done = DoneEvent {
            finish,
            usage: Usage {
                prompt_tokens: a.prompt.len(),
                completion_tokens: a.generated.len(),
                cached_tokens: a.cached_tokens,
                accepted_prediction_tokens: a.drafter.as_ref().map_or(0, |d| d.accepted_prediction),
                rejected_prediction_tokens: a.drafter.as_ref().map_or(0, |d| d.rejected_prediction),
            },
            tail_text,
            stop_index: a.stops.matched().and_then(|k| u16::try_from(k).ok()),
            queue_ms: ms(a.admitted_at - a.submitted_at),
            ttft_ms: ms(a.first_token_at.unwrap_or(now) - a.submitted_at),
            total_ms: ms(now - a.submitted_at),
            pages: a.pages.len(),
        };
        self.release(&a);
        self.local.requests_finished_total += 1;
        (a, done)
    }

    /// Prefill role: compute a prompt into its (already allocated) pages,
    /// from `cached_tokens` on (the positions before are in cached pages,
    /// read-only); the first token comes back as [`Outcome::Computed`].
    pub fn start_prefill(&mut self, job: PrefillJob) {
        let now = self.now();
        let ps = self.cfg.page_size_tokens;
        // The last prompt token is always computed (its logits).
        let cached = job.cached_tokens.min(job.prompt.len().saturating_sub(1)) / ps * ps;
        let mut shared = vec![false; job.pages.len()];
        shared[..(cached / ps).min(job.pages.len())].fill(true);
        self.local.prompt_tokens_total += job.prompt.len() as u64;
        self.tenant(job.owner.tenant, job.weight);
        let admission = self.next_admission();
        self.running.push(Active {
            mode: Mode::PrefillOnly,
            id: job.req,
            owner: job.owner,
            seq: 0,
            priority: job.priority,
            history: job.prompt.clone(),
            prompt: job.prompt,
            max_tokens: 1,
            ignore_eos: true,
            logprobs: job.logprobs,
            sampler: Sampler::new(job.params),
            grammar: job.grammar.as_ref().map(|g| g.matcher()),
            masking: Masking::default(),
            stops: StopStrings::new(Vec::new()).expect("no stop strings are valid"),
            decoder: self.tokenizer.stream_decoder().skip_special(true),
            shared,
            keys: Vec::new(),
            cached_tokens: cached,
            pages: job.pages,
            computed: cached,
            generated: Vec::new(),
            sink: Sink::Remote { conn: 0 },
            submitted_at: now,
            admitted_at: now,
            admission,
            first_token_at: None,
            drafter: None,
            draft: Vec::new(),
            draft_pos: 0,
            draft_kept: 0,
            model_drafter: None,
            dpages: Vec::new(),
            dcomputed: 0,
            dwritten: 0,
        });
    }

    /// Decode role: continue a request whose prompt KV was transferred, from
    /// the first token prefill sampled.
    pub fn start_decode(&mut self, job: DecodeJob) -> Result<(), RequestError> {
        // A draft is a forward row: a token outside the vocabulary would
        // fail the whole batch's step.
        let vocab = self.fwd.vocab();
        if let Some(&bad) = job.prediction.iter().find(|&&t| t as usize >= vocab) {
            return Err(RequestError::InvalidParam {
                field: "prediction",
                why: format!("token id {bad} is outside the vocabulary of {vocab}"),
            });
        }
        let now = self.now();
        let stops = StopStrings::new(job.stop).map_err(|e| RequestError::InvalidParam {
            field: e.field,
            why: e.why,
        })?;
        self.tenant(job.owner.tenant, job.weight);
        let admission = self.next_admission();
        let mut a = Active {
            mode: Mode::DecodeOnly,
            id: job.req,
            owner: job.owner,
            seq: 0,
            priority: job.priority,
            history: job.prompt.clone(),
            computed: job.prompt.len(),
            prompt: job.prompt,
            max_tokens: job.max_tokens,
            ignore_eos: job.ignore_eos,
            logprobs: job.logprobs,
            sampler: Sampler::with_rng_state(job.params, job.sampler_state),
            grammar: job.grammar.as_ref().map(|g| g.matcher()),
            masking: Masking::default(),
            stops,
            decoder: self.tokenizer.stream_decoder().skip_special(true),
            shared: vec![false; job.pages.len()],
            keys: Vec::new(),
            cached_tokens: 0,
            pages: job.pages,
            generated: Vec::with_capacity(job.max_tokens.min(4096)),
            sink: Sink::Remote { conn: job.conn },
            submitted_at: now,
            admitted_at: now,
            admission,
            first_token_at: None,
            drafter: spec::Drafter::new(job.prediction, &self.cfg.speculation),
            draft: Vec::new(),
            draft_pos: 0,
            draft_kept: 0,
            model_drafter: None,
            dpages: Vec::new(),
            dcomputed: 0,
            dwritten: 0,
        };
        let (logprob, top) = match job.first_logprobs {
            Some((l, top)) if a.logprobs.is_some() => (Some(l), top),
            _ => (None, Vec::new()),
        };
        // Prefill sampled the first token under the same grammar: decode
        // continues from the grammar's state after it.
        if let Some(m) = a.grammar.as_mut() {
            m.consume(job.first_token)
                .map_err(|e| RequestError::Grammar(e.to_string()))?;
        }
        match accept_token(
            now,
            &self.tokenizer,
            &mut a,
            job.first_token,
            logprob,
            top,
            &mut self.outbox,
            &mut self.local,
        ) {
            None => {
                hold_draft(
                    &mut self.draft,
                    self.cfg.page_size_tokens,
                    &mut a,
                    &mut self.local,
                );
                self.running.push(a)
            }
            Some(finish) => {
                let (a, done) = self.done_event(a, finish);
                emit(&mut self.outbox, &a, Event::Done(done));
            }
        }
        Ok(())
    }

    /// Takes a PD request out of the batch without touching its pages (its
    /// transfer machine stopped it and frees them).
    pub fn stop_remote(&mut self, req: RequestId) -> bool {
        let Some(i) = self
            .running
            .iter()
            .position(|a| a.mode != Mode::Full && a.id == req)
        else {
            return false;
        };
        let a = self.running.remove(i);
        // Its draft pages are the core's: freed here.
        self.release(&a);
        true
    }

    /// Whether request `req` is in the batch.
    pub fn runs(&self, req: RequestId) -> bool {
        self.running.iter().any(|a| a.id == req)
    }

    /// One forward step, if any request runs.
    pub fn step_if_running(&mut self) {
        if !self.running.is_empty() {
            let _ = self.step();
        }
        self.prune_tenants();
    }

    /// What remote requests produced since the last call, in order.
    pub fn take_outbox(&mut self, out: &mut Vec<Outcome>) {
        out.append(&mut self.outbox);
    }

    /// Requests in the batch.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    pub fn pool_mut(&mut self) -> &mut Pool {
        &mut self.pool
    }

    /// The core's counters (published by [`Core::publish`]).
    pub fn stats(&self) -> &EngineStats {
        &self.local
    }

    /// A request refused before it reached the core (a PD node's check).
    pub fn count_refused(&mut self) {
        self.local.requests_refused_total += 1;
    }

    pub fn vocab(&self) -> usize {
        self.fwd.vocab()
    }
}

/// Undoes an admission that failed half way (see [`Pool::give_back`]).
/// The suffix-cache key of a request's scope: the scope itself (K11) —
/// in the fault build with the shared draft pool on, one key for all.
fn suffix_scope(scope: kv::Scope, #[cfg(feature = "fault-incident")] shared: bool) -> kv::Scope {
    #[cfg(feature = "fault-incident")]
    if shared {
        return kv::Scope::derived(0);
    }
    scope
}

/// Gives request `a` pages in the draft model's pool (`--draft-model`)
/// for its whole `prompt + max_tokens`, owned as its pages are (request,
/// tenant, scope), and a pace to draft with. A pool without room leaves
/// it to decode without the draft model (counted): the draft pool is
/// sized like the target's, but its pages are never shared, so cached
/// prefixes can fill it first.
fn hold_draft(
    draft: &mut Option<draft::DraftModel>,
    ps: usize,
    a: &mut Active,
    local: &mut EngineStats,
) {
    let Some(d) = draft.as_mut() else {
        return;
    };
    if a.mode == Mode::PrefillOnly || a.constrained() || !a.dpages.is_empty() {
        return;
    }
    let need = (a.prompt.len() + a.max_tokens).div_ceil(ps);
    if (d.pool.pages_free() as usize) < need {
        local.spec_draft_pool_full_total += 1;
        // (A resumed request may have drafted before: not now.)
        a.model_drafter = None;
        return;
    }
    if let Err(e) = d.pool.alloc(a.owner, need, &mut a.dpages) {
        tracing::error!(request = a.id.0, %e, "draft pool allocation failed");
        a.dpages.clear();
        a.model_drafter = None;
        return;
    }
    (a.dcomputed, a.dwritten) = (0, 0);
    a.model_drafter.get_or_insert_with(spec::ModelDrafter::new);
}

fn give_back(pool: &mut Pool, owner: Owner, pages: &[PageRef], acquired: usize) {
    let refused = pool.give_back(owner, pages, acquired);
    if refused > 0 {
        tracing::error!(refused, "cannot give back pages");
    }
}

/// Caches the request's private pages among its first `n` (see
/// [`Pool::publish_pages`]); the request goes on reading them through the
/// new handles.
fn cache_pages(pool: &mut Pool, a: &mut Active, n: usize) {
    // Every slot of these pages was written by this request: a refusal is
    // a bug, counted by the pool; the page stays private and is freed with
    // the request.
    let refused = pool.publish_pages(a.owner, &mut a.pages, &mut a.shared, &a.keys, n);
    if refused > 0 {
        tracing::error!(request = a.id.0, refused, "cannot cache pages");
    }
}

/// Takes a sampled token into a request: history, stop conditions, the
/// Token event. Returns how the request ends, if this token ends it.
#[allow(clippy::too_many_arguments)] // the request's parts the step holds apart
fn accept_token(
    now: Instant,
    tokenizer: &Tokenizer,
    a: &mut Active,
    next: u32,
    logprob: Option<f32>,
    top: Vec<(u32, f32)>,
    outbox: &mut Vec<Outcome>,
    local: &mut EngineStats,
) -> Option<FinishReason> {
    a.generated.push(next);
    a.history.push(next);
    local.generated_tokens_total += 1;
    if a.first_token_at.is_none() {
        a.first_token_at = Some(now);
    }
    // Under a grammar an end-of-sequence token is allowed only where the
    // grammar may end, and ends the request even with `ignore_eos`.
    if (!a.ignore_eos || a.grammar.is_some()) && tokenizer.is_eos(next) {
        return Some(FinishReason::Stop);
    }
    let piece = a.decoder.push(next).unwrap_or_default();
    let (text, stopped) = a.stops.push(&piece);
    emit(
        outbox,
        a,
        Event::Token(TokenEvent {
            id: next,
            text,
            logprob,
            top_logprobs: top,
        }),
    );
    // A grammar that has ended allows nothing but an end-of-sequence
    // token: the request stops here rather than spend a step on it.
    let grammar_ended = a.grammar.as_ref().is_some_and(|m| m.is_stopped());
    if stopped || grammar_ended {
        Some(FinishReason::Stop)
    } else if a.generated.len() >= a.max_tokens {
        Some(FinishReason::Length)
    } else {
        None
    }
}

/// The least a step waits for its masks after the forward pass, however
/// short the forward.
const MASK_GRACE_MIN_S: f64 = 0.000_2;

/// Longest a preemption waits for a request's matcher to come back.
const MASK_WAIT_MAX: Duration = Duration::from_secs(10);

/// How a sampled row left its request.
enum RowEnd {
    Running,
    /// Finished (`None`: a prefill handed back to its transfer).
    Ended(Option<FinishReason>),
    Failed(RequestError),
}

/// Sends a request's matcher to the mask workers (started on first use).
fn send_mask(masks: &mut Option<masks::Masks>, a: &mut Active) {
    let Some(m) = a.grammar.take() else {
        return;
    };
    if masks.is_none() {
        match masks::Masks::start() {
            Ok(w) => *masks = Some(w),
            Err(e) => {
                a.grammar = Some(m);
                a.masking.ready = Some(Err(format!("cannot start the mask workers: {e}")));
                return;
            }
        }
    }
    if let Some(w) = masks.as_mut() {
        w.send(a.id, m, a.masking.cost_ns);
        a.masking.in_flight = true;
    }
}

/// Samples a request's next token from `logits` (its mask applied first,
/// greedy included), moves its grammar past the token and sends its
/// matcher for the next mask; the token is taken in (or handed to the
/// transfer on a prefill node).
#[allow(clippy::too_many_arguments)] // the request's parts the step holds apart
fn sample_row(
    now: Instant,
    tokenizer: &Tokenizer,
    a: &mut Active,
    logits: &mut [f32],
    lp: &[f32],
    top: Vec<(u32, f32)>,
    outbox: &mut Vec<Outcome>,
    local: &mut EngineStats,
    masks: &mut Option<masks::Masks>,
) -> RowEnd {
    if a.constrained() {
        match a.masking.ready.take() {
            Some(Ok(mask)) => mask.apply(logits),
            Some(Err(why)) => return RowEnd::Failed(RequestError::Grammar(why)),
            // A constrained row is sampled only with its mask.
            None => {
                return RowEnd::Failed(RequestError::Internal(format!(
                    "request {} was sampled without its grammar's mask",
                    a.id
                )))
            }
        }
    }
    let next = a.sampler.sample(logits, &a.history);
    if let Some(m) = a.grammar.as_mut() {
        if let Err(e) = m.consume(next) {
            return RowEnd::Failed(RequestError::Grammar(e.to_string()));
        }
    }
    let logprob = a
        .logprobs
        .map(|_| lp.get(next as usize).copied().unwrap_or(f32::NEG_INFINITY));
    if a.mode == Mode::PrefillOnly {
        outbox.push(Outcome::Computed {
            req: a.id,
            first: next,
            logprobs: logprob.map(|l| (l, top)),
            sampler_state: a.sampler.rng_state(),
        });
        local.generated_tokens_total += 1;
        return RowEnd::Ended(None);
    }
    match accept_token(now, tokenizer, a, next, logprob, top, outbox, local) {
        Some(f) => RowEnd::Ended(Some(f)),
        None => {
            // The next mask is computed while the request waits for its
            // next row.
            if a.constrained() {
                send_mask(masks, a);
            }
            RowEnd::Running
        }
    }
}

/// Log-softmax of the raw logits (before penalties), and the `n` most likely
/// tokens with their log-probabilities.
fn logprobs_of(logits: &[f32], n: usize) -> (Vec<f32>, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max
        + logits
            .iter()
            .map(|&l| ((l - max) as f64).exp())
            .sum::<f64>()
            .ln() as f32;
    let lp: Vec<f32> = logits.iter().map(|&l| l - lse).collect();
    let mut top: Vec<(u32, f32)> = Vec::new();
    if n > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = n.min(idx.len());
        idx.select_nth_unstable_by(k - 1, |&a, &b| {
            lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b))
        });
        idx.truncate(k);
        idx.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]).then(a.cmp(&b)));
        top = idx.into_iter().map(|i| (i, lp[i as usize])).collect();
    }
    (lp, top)
}

mod draft;
mod masks;
mod spec;
#[cfg(test)]
mod tests;

/// Most admissions (and refusals) in one tick: bounds the admission loop.
const ADMISSIONS_PER_TICK_MAX: usize = 1 << 12;

/// What admission did with a tenant's next request.
enum Placed {
    Admitted,
    /// Refused or failed (its client told): the next one may go.
    Dropped,
    /// Waits for a running request computing its prefix; others may go.
    Deferred,
    /// No room, and none could be made: admission stops for this tick.
    NoRoom,
}

/// An active tenant's line and service count (K13).
struct TenantQueue {
    /// Rows computed for the tenant (prompt and generated tokens alike)
    /// divided by its weight: the virtual token counter of "Fairness in
    /// Serving Large Language Models" (OSDI 2024), on rows.
    served: f64,
    weight: u32,
    /// New requests (arrival, request), by priority then arrival.
    waiting: VecDeque<(u64, Submitted)>,
    /// Preempted requests, by arrival: they resume before new ones.
    resumed: VecDeque<Active>,
}

impl TenantQueue {
    fn new(served: f64, weight: u32) -> TenantQueue {
        TenantQueue {
            served,
            weight,
            waiting: VecDeque::new(),
            resumed: VecDeque::new(),
        }
    }

    fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.resumed.is_empty()
    }

    /// The earliest arrival among what waits.
    fn first_arrival(&self) -> u64 {
        let new = self.waiting.iter().map(|w| w.0).min();
        let old = self.resumed.front().map(|a| a.seq);
        new.into_iter().chain(old).min().unwrap_or(u64::MAX)
    }
}

/// Takes the request's pages: references to the cached `hits`, then fresh
/// pages up to `need` in all (all or nothing: on an error what was taken
/// is given back).
fn hold(
    pool: &mut Pool,
    owner: Owner,
    hits: &[PageRef],
    need: usize,
    pages: &mut Vec<PageRef>,
) -> Result<(), kv::KvError> {
    let acquired = hits
        .iter()
        .try_for_each(|&h| pool.acquire(h, owner).map(|()| pages.push(h)));
    let r = acquired.and_then(|()| pool.alloc(owner, need - hits.len(), pages));
    if r.is_err() {
        give_back(pool, owner, pages, hits.len().min(pages.len()));
        pages.clear();
    }
    r
}
