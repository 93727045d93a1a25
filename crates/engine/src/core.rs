//! The engine thread: owns the model, the tokenizer's decoders and the pool;
//! runs the request state machine and the batching loop.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kv::{FreeOutcome, Owner, PageRef, Pool, PoolStats, RequestId};
use model::sample::{FinishReason, Sampler, StopStrings};
use model::{Model, Row, Scratch, SeqCtx};
use tokenizer::{StreamDecoder, Tokenizer};
use tokio::sync::mpsc as tmpsc;

use crate::{Command, DoneEvent, EngineConfig, Event, RequestError, Submitted, TokenEvent, Usage};

/// Occupancy and counters, refreshed after every step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    pub pool: PoolStats,
    pub running: usize,
    pub waiting: usize,
    pub prompt_tokens_total: u64,
    pub generated_tokens_total: u64,
    pub steps_total: u64,
    pub requests_finished_total: u64,
    pub requests_cancelled_total: u64,
    pub requests_failed_total: u64,
    /// Requests refused by the engine thread's own re-check (the submit-side
    /// check should have caught them first; non-zero means a bug upstream).
    pub requests_refused_total: u64,
}

impl EngineStats {
    pub(crate) fn new(pool: PoolStats) -> EngineStats {
        EngineStats {
            pool,
            ..EngineStats::default()
        }
    }
}

struct Active {
    id: RequestId,
    owner: Owner,
    prompt: Vec<u32>,
    max_tokens: usize,
    ignore_eos: bool,
    logprobs: Option<usize>,
    sampler: Sampler,
    stops: StopStrings,
    decoder: StreamDecoder,
    pages: Vec<PageRef>,
    /// Prompt positions whose KV is computed.
    prefilled: usize,
    /// Tokens generated so far (EOS included when it ended the request).
    generated: Vec<u32>,
    /// Prompt followed by generated tokens (for penalties).
    history: Vec<u32>,
    events: tmpsc::UnboundedSender<Event>,
    cancel: Arc<AtomicBool>,
    submitted_at: Instant,
    admitted_at: Instant,
    first_token_at: Option<Instant>,
}

impl Active {
    fn decoding(&self) -> bool {
        self.prefilled == self.prompt.len()
    }
    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed) || self.events.is_closed()
    }
}

pub(crate) struct Core {
    model: Model,
    tokenizer: Tokenizer,
    pool: Pool,
    cfg: EngineConfig,
    max_request: usize,
    waiting: VecDeque<Submitted>,
    running: Vec<Active>,
    scratch: Scratch,
    rows: Vec<Row>,
    stats: Arc<Mutex<EngineStats>>,
    waiting_count: Arc<AtomicU64>,
    local: EngineStats,
    shutdown: Option<bool>,
}

impl Core {
    pub(crate) fn new(
        model: Model,
        tokenizer: Tokenizer,
        pool: Pool,
        cfg: EngineConfig,
        max_request: usize,
        stats: Arc<Mutex<EngineStats>>,
        waiting_count: Arc<AtomicU64>,
    ) -> Core {
        let scratch = Scratch::new(&model, cfg.step_tokens_max);
        Core {
            model,
            tokenizer,
            rows: Vec::with_capacity(cfg.step_tokens_max),
            waiting: VecDeque::with_capacity(cfg.queue_max),
            running: Vec::with_capacity(cfg.running_max),
            local: EngineStats::new(pool.stats()),
            pool,
            cfg,
            max_request,
            scratch,
            stats,
            waiting_count,
            shutdown: None,
        }
    }

    pub(crate) fn run(mut self, rx: Receiver<Command>) {
        loop {
            // Intake: block when idle, otherwise take what is there.
            if self.running.is_empty() && self.waiting.is_empty() {
                if self.shutdown.is_some() {
                    break;
                }
                match rx.recv() {
                    Ok(cmd) => self.command(cmd),
                    Err(_) => break,
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
            if self.shutdown == Some(false) {
                self.cancel_all(RequestError::ShuttingDown);
            }
            self.reap_cancelled();
            self.admit();
            if !self.running.is_empty() {
                self.step();
            }
            self.publish();
        }
        self.publish();
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(sub) => self.waiting.push_back(*sub),
            Command::Shutdown { drain } => {
                self.shutdown = Some(drain && self.shutdown != Some(false));
            }
        }
    }

    fn publish(&mut self) {
        self.local.pool = self.pool.stats();
        self.local.running = self.running.len();
        self.local.waiting = self.waiting.len();
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = self.local.clone();
    }

    /// `n` requests left the waiting queue (admitted, refused or cancelled):
    /// give their slots back to `Engine::submit`'s count.
    fn left_queue(&self, n: usize) {
        self.waiting_count.fetch_sub(n as u64, Ordering::AcqRel);
    }

    fn cancel_all(&mut self, err: RequestError) {
        let n = self.waiting.len();
        for sub in self.waiting.drain(..) {
            let _ = sub.events.send(Event::Error(err.clone()));
            self.local.requests_cancelled_total += 1;
        }
        self.left_queue(n);
        let running = std::mem::take(&mut self.running);
        for a in running {
            let _ = a.events.send(Event::Error(err.clone()));
            self.release(&a);
            self.local.requests_cancelled_total += 1;
        }
    }

    /// Drops cancelled requests, waiting or running, freeing their pages.
    fn reap_cancelled(&mut self) {
        let before = self.waiting.len();
        self.waiting
            .retain(|s| !(s.cancel.load(Ordering::Relaxed) || s.events.is_closed()));
        self.local.requests_cancelled_total += (before - self.waiting.len()) as u64;
        self.left_queue(before - self.waiting.len());
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

    fn release(&mut self, a: &Active) {
        for &h in &a.pages {
            match self.pool.free(h, a.owner) {
                Ok(FreeOutcome::Freed) => {}
                // Unified role: nothing leases pages, so a deferral or an
                // error here is a bug — counted by the pool, logged here.
                other => {
                    tracing::error!(request = a.id.0, ?other, "unexpected page release outcome")
                }
            }
        }
    }

    /// FIFO admission: the head waits until the pool has pages for its whole
    /// request (all or nothing). No request behind it passes it, so none
    /// starves.
    fn admit(&mut self) {
        while self.running.len() < self.cfg.running_max {
            let Some(sub) = self.waiting.front() else {
                break;
            };
            let need_tokens = sub.req.prompt.len() + sub.req.max_tokens;
            // Re-check on this node, before any allocation (K8).
            if let Err(e) = crate::validate(&sub.req, self.max_request, self.model.config.vocab) {
                let sub = self.waiting.pop_front().expect("front exists");
                self.left_queue(1);
                let _ = sub.events.send(Event::Error(e));
                self.local.requests_refused_total += 1;
                continue;
            }
            let need_pages = need_tokens.div_ceil(self.cfg.page_size_tokens);
            if need_pages > self.pool.pages_free() as usize {
                break;
            }
            let sub = self.waiting.pop_front().expect("front exists");
            self.left_queue(1);
            let owner = Owner::new(sub.id, sub.req.tenant);
            let mut pages = Vec::with_capacity(need_pages);
            if let Err(e) = self.pool.alloc(owner, need_pages, &mut pages) {
                let _ = sub
                    .events
                    .send(Event::Error(RequestError::Internal(e.to_string())));
                self.local.requests_failed_total += 1;
                continue;
            }
            let stops = match StopStrings::new(sub.req.stop.clone()) {
                Ok(s) => s,
                Err(e) => {
                    // validate() accepted it; unreachable, but never panic.
                    let _ = sub.events.send(Event::Error(RequestError::InvalidParam {
                        field: e.field,
                        why: e.why,
                    }));
                    for h in pages {
                        let _ = self.pool.free(h, owner);
                    }
                    continue;
                }
            };
            self.local.prompt_tokens_total += sub.req.prompt.len() as u64;
            let history = sub.req.prompt.clone();
            self.running.push(Active {
                id: sub.id,
                owner,
                prompt: sub.req.prompt,
                max_tokens: sub.req.max_tokens,
                ignore_eos: sub.req.ignore_eos,
                logprobs: sub.req.logprobs,
                sampler: Sampler::new(sub.req.params),
                stops,
                decoder: self.tokenizer.stream_decoder().skip_special(true),
                pages,
                prefilled: 0,
                generated: Vec::with_capacity(sub.req.max_tokens.min(4096)),
                history,
                events: sub.events,
                cancel: sub.cancel,
                submitted_at: sub.submitted_at,
                admitted_at: Instant::now(),
                first_token_at: None,
            });
        }
    }

    /// One forward step: a decode row per decoding request, then prompt
    /// chunks under the token budget.
    fn step(&mut self) {
        let budget = self.cfg.step_tokens_max;
        self.rows.clear();
        // Which running request each row belongs to: `seq` indexes `running`.
        for (i, a) in self.running.iter().enumerate() {
            if a.decoding() && self.rows.len() < budget {
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
            }
        }
        for (i, a) in self.running.iter().enumerate() {
            let left = budget - self.rows.len();
            if left == 0 {
                break;
            }
            if a.decoding() {
                continue;
            }
            let end = (a.prefilled + left).min(a.prompt.len());
            for pos in a.prefilled..end {
                self.rows.push(Row {
                    seq: i,
                    pos,
                    token: a.prompt[pos],
                    logits: pos == a.prompt.len() - 1,
                });
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
        let result = self
            .model
            .forward(&mut self.pool, &seqs, &self.rows, &mut self.scratch);
        drop(seqs);
        self.local.steps_total += 1;
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
                let _ = a
                    .events
                    .send(Event::Error(RequestError::Internal(e.to_string())));
            }
            return;
        }
        // Advance prefill positions.
        for r in &self.rows {
            let a = &mut self.running[r.seq];
            if !a.decoding() && r.pos + 1 > a.prefilled {
                a.prefilled = r.pos + 1;
            }
        }
        // Sample for every row that produced logits, in row order.
        let vocab = self.model.config.vocab;
        let mut k = 0;
        let mut finished: Vec<(usize, FinishReason)> = Vec::new();
        for ri in 0..self.rows.len() {
            let r = self.rows[ri];
            if !r.logits {
                continue;
            }
            let logits = &mut self.scratch.logits[k * vocab..(k + 1) * vocab];
            k += 1;
            let a = &mut self.running[r.seq];
            let (lp, top) = match a.logprobs {
                Some(n) => logprobs_of(logits, n),
                None => (Vec::new(), Vec::new()),
            };
            let next = a.sampler.sample(logits, &a.history);
            a.generated.push(next);
            a.history.push(next);
            self.local.generated_tokens_total += 1;
            if a.first_token_at.is_none() {
                a.first_token_at = Some(Instant::now());
            }
            if !a.ignore_eos && self.tokenizer.is_eos(next) {
                finished.push((r.seq, FinishReason::Stop));
                continue;
            }
            let piece = a.decoder.push(next).unwrap_or_default();
            let (text, stopped) = a.stops.push(&piece);
            let logprob = a
                .logprobs
                .map(|_| lp.get(next as usize).copied().unwrap_or(f32::NEG_INFINITY));
            let _ = a.events.send(Event::Token(TokenEvent {
                id: next,
                text,
                logprob,
                top_logprobs: top,
            }));
            if stopped {
                finished.push((r.seq, FinishReason::Stop));
            } else if a.generated.len() >= a.max_tokens {
                finished.push((r.seq, FinishReason::Length));
            }
        }
        // Remove finished requests (highest index first keeps indices valid).
        finished.sort_by_key(|f| std::cmp::Reverse(f.0));
        let mut dones = Vec::with_capacity(finished.len());
        for (i, finish) in finished {
            let mut a = self.running.swap_remove(i);
            let tail_text = if finish == FinishReason::Length {
                a.stops.flush()
            } else {
                String::new()
            };
            let now = Instant::now();
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            let done = DoneEvent {
                finish,
                usage: Usage {
                    prompt_tokens: a.prompt.len(),
                    completion_tokens: a.generated.len(),
                },
                tail_text,
                queue_ms: ms(a.admitted_at - a.submitted_at),
                ttft_ms: ms(a.first_token_at.unwrap_or(now) - a.submitted_at),
                total_ms: ms(now - a.submitted_at),
                pages: a.pages.len(),
            };
            self.release(&a);
            self.local.requests_finished_total += 1;
            dones.push((a.events, done));
        }
        // Publish before telling the clients, so a client that reads the
        // stats after its Done sees its pages free.
        if !dones.is_empty() {
            self.publish();
        }
        for (events, done) in dones {
            let _ = events.send(Event::Done(done));
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
