//! Speculative decoding's drafter: what a request proposes to verify next.
//!
//! Pure state over the request's own tokens: its prediction (OpenAI's
//! Predicted Outputs) and, with `--speculative ngram`, its prompt and
//! output so far (prompt lookup). With `--speculative suffix`, also the
//! prompts and outputs of earlier requests of the same cache scope (K11),
//! kept in a [`SuffixCache`] keyed by scope: a request is only ever handed
//! its own scope's entries, so no tenant drafts from another's text, and
//! no acceptance rate (no speed) says what another tenant wrote.
//!
//! A draft is a guess. The batch core verifies it by running the request's
//! last token and the drafted tokens as rows of one forward step, sampling
//! each row as if it were an ordinary decode step, and keeping drafted
//! tokens only while the sampled token equals the draft: the tokens out are
//! the tokens without speculation (K12), only fewer steps make them.
//!
//! A cursor follows the source the last draft came from: while the output
//! keeps equal to it, the next draft continues where the last stopped
//! (no search). When the output parts from it, the drafter first guesses
//! a substitution (the model's token replaced the source's: the draft goes
//! on after it, once), then looks for the longest tail of the output in
//! the prediction — a single token is enough a few tokens ahead of where
//! the output last followed it (a deletion, or the end of an insertion),
//! three anywhere else — then in the request's own history
//! (`ngram_max` down to `ngram_min` tokens), and follows that.
//!
//! How many tokens to draft is chosen every step by a cost model: the
//! request's acceptance rate α (per drafted token, from its recent
//! verifications) against what one more row costs a step, as a share of a
//! one-row step (`c`, which the core fits from its own steps' times). A
//! draft of k tokens yields 1 + α + α² + … + α^k tokens a step for a step
//! 1 + c·k as long; the drafter drafts the k that yields the most tokens
//! per unit of time. When no draft pays (α too low for the cost), it still
//! probes with one token now and then — after probes that kept nothing it
//! sits out a growing number of steps — so text that matches nothing
//! decodes one row a step, as without speculation.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use kv::Scope;

use crate::{SpecMethod, Speculation};

/// Where a draft's tokens come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// The request's prediction.
    Prediction,
    /// The request's prompt and output so far (prompt lookup).
    History,
    /// An earlier request of the scope (the suffix cache), `stored`.
    Stored,
}

/// A position in a source: `at` is the source's token that equals the
/// request's last token; the draft continues from `at + 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cursor {
    src: Source,
    at: usize,
}

/// The longest tail looked up in the suffix cache's entries.
const STORED_NGRAM_MAX: usize = 12;

/// Steps a drafter sits out at most after drafts that kept nothing.
const IDLE_STEPS_MAX: u32 = 16;

/// The same for the draft model, whose probe costs a pass of it and the
/// catch-up of what it has not seen besides its row (measured: spells of
/// at most 16 steps cost 10% of single-stream decode when nothing
/// matched).
const MODEL_IDLE_STEPS_MAX: u32 = 256;

/// How far past where the output last followed the prediction a short
/// tail (one or two tokens) realigns it: a deletion or an insertion of
/// about this many tokens.
const REALIGN_WINDOW: usize = 16;

/// The shortest tail that realigns the output anywhere in the prediction.
const REALIGN_FAR_MIN: usize = 3;

/// What a step gives every drafter: the limits, what a row costs, the
/// step's batch, and the request's scope's suffix-cache entries.
pub(crate) struct StepCtx<'a> {
    pub cfg: &'a Speculation,
    /// One more row's cost as a share of a one-row step.
    pub row_cost: f64,
    /// The step's decode rows.
    pub batch: usize,
    /// Earlier requests' prompts and outputs of the request's own scope.
    pub stored: &'a [Arc<[u32]>],
}

/// A request's drafter.
#[derive(Clone, Debug)]
pub(crate) struct Drafter {
    prediction: Vec<u32>,
    /// The stored sequence a `Stored` cursor follows.
    stored: Option<Arc<[u32]>>,
    cursor: Option<Cursor>,
    /// The prediction's position the output was last aligned to: a search
    /// prefers what comes after it (an edit moves forward through a file).
    floor: usize,
    /// Its acceptance rate and its spells.
    pace: Pace,
    /// The draft being verified: its source and its length.
    pending: Option<(Source, usize)>,
    /// The last draft followed the source from an aligned cursor: where
    /// the output parts from it, a substitution may be guessed (once).
    followed: bool,
    /// Prediction tokens verified and kept, and verified and rejected.
    pub accepted_prediction: usize,
    pub rejected_prediction: usize,
}

impl Drafter {
    /// A drafter for a request with `prediction` (empty: none), or `None`
    /// when it has nothing to draft from.
    pub fn new(prediction: Vec<u32>, cfg: &Speculation) -> Option<Drafter> {
        if prediction.is_empty() && cfg.method == SpecMethod::Off {
            return None;
        }
        let cursor = (!prediction.is_empty()).then_some(Cursor {
            src: Source::Prediction,
            at: 0,
        });
        Some(Drafter {
            prediction,
            stored: None,
            cursor,
            floor: 0,
            // A prior worth a couple of verifications: the caller's
            // prediction is trusted more than a lookup in the request's
            // own text.
            pace: Pace::new(if cursor.is_some() { 6.0 } else { 3.0 }, IDLE_STEPS_MAX),
            pending: None,
            followed: false,
            accepted_prediction: 0,
            rejected_prediction: 0,
        })
    }

    fn k_max(&self, cfg: &Speculation) -> usize {
        match self.cursor.map(|c| c.src) {
            Some(Source::Prediction) => cfg.prediction_k_max,
            _ => cfg.k_max,
        }
    }

    /// Proposes up to `limit` tokens to follow `history` (the prompt and
    /// the output so far; its last token is the step's decode row) into
    /// `out` (cleared first). Returns how many.
    pub fn propose(
        &mut self,
        history: &[u32],
        limit: usize,
        step: &StepCtx<'_>,
        out: &mut Vec<u32>,
    ) -> usize {
        let cfg = step.cfg;
        out.clear();
        self.pending = None;
        if self.pace.resting() {
            return 0;
        }
        let Some(&last) = history.last() else {
            return 0;
        };
        let aligned = self
            .cursor
            .is_some_and(|c| self.source(c.src, history).get(c.at) == Some(&last));
        // A substitution: the model's token stands where the source's was,
        // and the source goes on after it. Guessed once where the output
        // parts from a source it followed; a failed guess leaves it to the
        // search.
        let guess = !aligned && self.followed && self.cursor.is_some();
        self.followed = false;
        if !aligned && !guess {
            self.cursor = self.search(history, cfg, step.stored);
        }
        let Some(c) = self.cursor else {
            return 0;
        };
        if c.src == Source::Prediction {
            self.floor = c.at;
        }
        let k = self.pace.choose(self.k_max(cfg).min(limit), step, 0.0);
        let src = self.source(c.src, history);
        let from = (c.at + 1).min(src.len());
        let to = (from + k).min(src.len());
        out.extend_from_slice(&src[from..to]);
        if !out.is_empty() {
            self.pending = Some((c.src, out.len()));
            self.followed = !guess;
        }
        out.len()
    }

    fn source<'a>(&'a self, src: Source, history: &'a [u32]) -> &'a [u32] {
        match src {
            Source::Prediction => &self.prediction,
            Source::History => history,
            Source::Stored => self.stored.as_deref().unwrap_or_default(),
        }
    }

    /// The longest tail of `history` found in the prediction (near the
    /// floor, any length; else, three tokens or more, the first occurrence
    /// after the floor or the last before it), then in the history itself
    /// (the latest occurrence that has a token after it).
    fn search(
        &mut self,
        history: &[u32],
        cfg: &Speculation,
        stored: &[Arc<[u32]>],
    ) -> Option<Cursor> {
        let n_max = cfg.ngram_max.max(REALIGN_FAR_MIN).min(history.len());
        if !self.prediction.is_empty() {
            let near = |at: &usize| *at <= self.floor + REALIGN_WINDOW;
            for n in (1..=n_max).rev() {
                let tail = &history[history.len() - n..];
                let after = find_after(&self.prediction, tail, self.floor);
                let at = match after.filter(near) {
                    Some(at) => Some(at),
                    None if n >= REALIGN_FAR_MIN => {
                        after.or_else(|| find_last(&self.prediction, tail, self.prediction.len()))
                    }
                    None => None,
                };
                if let Some(at) = at {
                    return Some(Cursor {
                        src: Source::Prediction,
                        at,
                    });
                }
            }
        }
        // The longest tail found in the request's own text (at most
        // `ngram_max` tokens) or, with the suffix cache, in its scope's
        // earlier requests (the latest first; up to [`STORED_NGRAM_MAX`]
        // tokens: a long match in an earlier answer is the template this
        // answer follows, and beats a short one in the prompt).
        let stored_max = if stored.is_empty() {
            0
        } else {
            STORED_NGRAM_MAX
        };
        let n_max = cfg.ngram_max.max(stored_max).min(history.len());
        if cfg.method != SpecMethod::Off {
            for n in (cfg.ngram_min.max(1)..=n_max).rev() {
                let tail = &history[history.len() - n..];
                // Not the tail itself: an occurrence with a token after it.
                let own = (n <= cfg.ngram_max)
                    .then(|| find_last(history, tail, history.len() - 1))
                    .flatten();
                if let Some(at) = own {
                    return Some(Cursor {
                        src: Source::History,
                        at,
                    });
                }
                for seq in stored.iter().rev() {
                    if let Some(at) = find_last(seq, tail, seq.len().saturating_sub(1)) {
                        self.stored = Some(seq.clone());
                        return Some(Cursor {
                            src: Source::Stored,
                            at,
                        });
                    }
                }
            }
        }
        None
    }

    /// The verification of the pending draft kept `kept` of its tokens.
    pub fn verified(&mut self, kept: usize) {
        let Some((src, drafted)) = self.pending.take() else {
            return;
        };
        debug_assert!(kept <= drafted);
        if src == Source::Prediction {
            self.accepted_prediction += kept;
            self.rejected_prediction += drafted - kept;
        }
        // The source's next token (`at + 1 + kept`) is what it says the
        // model's own token after the kept ones is: `propose` checks.
        if let Some(c) = self.cursor.as_mut() {
            c.at += 1 + kept;
        }
        self.pace.verified(kept, drafted);
    }
}

/// How a drafter paces itself: the evidence of its acceptance rate, and
/// the probes and spells of a drafter whose drafts do not pay.
#[derive(Clone, Debug)]
pub(crate) struct Pace {
    /// Verified draft tokens kept, and drafts that parted from the model
    /// (a rejected token), each decayed by [`DECAY`] a verification: the
    /// acceptance rate's evidence.
    kept_w: f64,
    parted_w: f64,
    /// The last draft was a probe (no draft paid): probes in a row, and
    /// steps left to sit out.
    probing: bool,
    misses: u32,
    idle: u32,
    /// The batch the last draft was made in (decode rows).
    batch: u32,
    /// The longest spell, in steps per decode row of the batch.
    idle_max: u32,
}

impl Pace {
    /// A prior of `kept` kept tokens against one parting; spells of at
    /// most `idle_max` steps per decode row of the batch.
    fn new(kept: f64, idle_max: u32) -> Pace {
        Pace {
            kept_w: kept,
            parted_w: 1.0,
            probing: false,
            misses: 0,
            idle: 0,
            batch: 1,
            idle_max,
        }
    }

    /// Sits out one step of a spell: true while it does.
    fn resting(&mut self) -> bool {
        if self.idle > 0 {
            self.idle -= 1;
            return true;
        }
        false
    }

    /// The draft length for this step, at most `k_max` (1 to `k_max`: a
    /// probe when no draft pays). `extra`: what each drafted token costs
    /// besides its row, in rows (a draft model's pass).
    fn choose(&mut self, k_max: usize, step: &StepCtx<'_>, extra: f64) -> usize {
        let best = best_k(self.acceptance(), step.row_cost, step.batch, k_max, extra);
        self.probing = best == 0;
        self.batch = u32::try_from(step.batch).unwrap_or(u32::MAX);
        best.max(1).min(k_max)
    }

    /// A draft of `drafted` tokens kept `kept`.
    fn verified(&mut self, kept: usize, drafted: usize) {
        self.kept_w = DECAY * self.kept_w + kept as f64;
        self.parted_w = DECAY * self.parted_w + f64::from(u8::from(kept < drafted));
        // A probe (no draft paid) is followed by a spell without drafts
        // that grows with the probes in a row — 0, 1, 3, 7, 15 steps, and on
        // up to 16 steps per decode row of the batch — whatever it kept:
        // while drafts do not pay, probing costs alone at most a row every
        // 16 steps, and in a batch of B at most a row every 16·B steps per
        // request (probes cost a full batch more). A draft that paid ends
        // the run.
        if self.probing {
            self.misses += 1;
            let cap = self.idle_max.saturating_mul(self.batch.max(1));
            self.idle = ((1u32 << (self.misses - 1).min(12)) - 1).min(cap);
        } else {
            self.misses = 0;
        }
    }

    /// The estimated chance that the model keeps the next drafted token.
    /// (A cautious estimate: two phantom rejections' worth of doubt, so a
    /// short lucky run does not buy long drafts.)
    fn acceptance(&self) -> f64 {
        self.kept_w / (self.kept_w + self.parted_w + 2.0)
    }
}

/// A request's pace with the draft model (`--draft-model`): the draft
/// model drafts where the request's text sources have nothing to follow,
/// and each drafted token costs a pass of it, which the cost model weighs.
#[derive(Clone, Debug)]
pub(crate) struct ModelDrafter {
    pace: Pace,
    /// The draft being verified: its length.
    pending: Option<usize>,
}

impl ModelDrafter {
    pub fn new() -> ModelDrafter {
        ModelDrafter {
            pace: Pace::new(3.0, MODEL_IDLE_STEPS_MAX),
            pending: None,
        }
    }

    /// How many tokens the draft model should draft this step, at most
    /// `limit` (0: none). `pass_rows`: a draft pass's cost in rows of the
    /// step, `None` before one was timed (a probe of one token times it).
    pub fn plan(&mut self, limit: usize, step: &StepCtx<'_>, pass_rows: Option<f64>) -> usize {
        self.pending = None;
        if limit == 0 || self.pace.resting() {
            return 0;
        }
        match pass_rows {
            Some(extra) => self.pace.choose(step.cfg.k_max.min(limit), step, extra),
            // Two tokens: the second is a pass of one row a request, the
            // pass whose time is what drafting costs (the first also
            // catches the draft model up, and is not timed).
            None => {
                self.pace.probing = true;
                self.pace.batch = u32::try_from(step.batch).unwrap_or(u32::MAX);
                limit.min(2)
            }
        }
    }

    /// The draft model drafted `n` tokens (the plan, once its pages caught
    /// up with the request).
    pub fn drafted(&mut self, n: usize) {
        self.pending = (n > 0).then_some(n);
    }

    /// The verification of the pending draft kept `kept` of its tokens.
    pub fn verified(&mut self, kept: usize) {
        if let Some(drafted) = self.pending.take() {
            self.pace.verified(kept, drafted);
        }
    }
}

/// How much more a draft's rows must yield, in tokens a row, than the
/// step's rows do without it.
const DRAFT_GAIN_MIN: f64 = 1.15;

/// Scopes the suffix cache holds at most (the least recently used one goes
/// first).
pub const SUFFIX_SCOPES_MAX: usize = 256;

/// Sequences one scope holds at most (the oldest goes first).
const SUFFIX_SEQS_MAX: usize = 64;

/// Speculation's cross-request memory (`--speculative suffix`): the
/// prompts and outputs of a scope's finished requests, for its later
/// requests to draft from. Keyed by K11's scope, as the prefix cache is;
/// bounded per scope (tokens and sequences) and in scopes; a scope's
/// entries are dropped with its last cached page (the engine asks the
/// pool), so they never outlive the scope's other cached state.
#[derive(Debug, Default)]
pub(crate) struct SuffixCache {
    scopes: HashMap<Scope, ScopeText>,
    /// Uses so far (the scopes' recency).
    clock: u64,
}

#[derive(Debug, Default)]
struct ScopeText {
    seqs: VecDeque<Arc<[u32]>>,
    tokens: usize,
    used: u64,
}

impl SuffixCache {
    /// `scope`'s entries, oldest first (empty if none).
    pub fn entries(&mut self, scope: Scope) -> &[Arc<[u32]>] {
        self.clock += 1;
        match self.scopes.get_mut(&scope) {
            Some(t) => {
                t.used = self.clock;
                t.seqs.make_contiguous()
            }
            None => &[],
        }
    }

    /// Keeps a finished request's prompt and output for its scope, within
    /// `tokens_max` tokens a scope (a longer one keeps its end).
    pub fn insert(&mut self, scope: Scope, seq: &[u32], tokens_max: usize) {
        if tokens_max == 0 || seq.len() < 2 {
            return;
        }
        self.clock += 1;
        if !self.scopes.contains_key(&scope) && self.scopes.len() >= SUFFIX_SCOPES_MAX {
            if let Some(&oldest) = self
                .scopes
                .iter()
                .min_by_key(|(_, t)| t.used)
                .map(|(s, _)| s)
            {
                self.scopes.remove(&oldest);
            }
        }
        let t = self.scopes.entry(scope).or_default();
        t.used = self.clock;
        let seq = &seq[seq.len().saturating_sub(tokens_max)..];
        t.tokens += seq.len();
        t.seqs.push_back(seq.into());
        while t.tokens > tokens_max || t.seqs.len() > SUFFIX_SEQS_MAX {
            let old = t.seqs.pop_front().expect("over a bound: not empty");
            t.tokens -= old.len();
        }
    }

    /// Drops every scope `keep` says no.
    pub fn retain(&mut self, mut keep: impl FnMut(Scope) -> bool) {
        self.scopes.retain(|&s, _| keep(s));
    }

    /// Scopes and tokens held.
    pub fn size(&self) -> (usize, usize) {
        (
            self.scopes.len(),
            self.scopes.values().map(|t| t.tokens).sum(),
        )
    }
}

/// How much a verification's evidence of the acceptance rate is worth at
/// the next (its weight halves in about three).
const DECAY: f64 = 0.8;

/// The draft length (0 to `k_max`) that yields the most tokens per unit
/// of time for the step's batch of `batch` decode rows: a draft of k
/// tokens each kept with chance `alpha` (while the ones before were) adds
/// α + … + α^k tokens to the step's `batch`, and k rows to a step that
/// costs, in rows, a fixed part (1 − c)/c plus one a row (`c` =
/// `row_cost`, a row's share of a one-row step). Alone (`batch` 1) a draft
/// pays when α beats c; in a batch of B it must beat the share of the
/// step that is per-row work, cB/(1 − c + cB): a full step has little
/// room for drafts.
///
/// `extra`: what each drafted token costs besides its row, in rows (the
/// draft model's pass; 0 for drafts that are looked up).
pub(crate) fn best_k(alpha: f64, row_cost: f64, batch: usize, k_max: usize, extra: f64) -> usize {
    let fixed = (1.0 - row_cost) / row_cost;
    let b = batch.max(1) as f64;
    // A draft's own rows must yield a margin more tokens per row than the
    // step does without it: the cost model is a line fitted to noisy
    // steps and α an estimate, and drafts that pay on paper by a few
    // percent lose in practice (measured: 16 streams of SmolLM2-135M lost
    // 7% without the margin).
    let base = b / (fixed + b);
    let (mut best, mut best_rate) = (0, base);
    let (mut gained, mut p) = (0.0, 1.0);
    for k in 1..=k_max {
        p *= alpha;
        gained += p;
        let cost = k as f64 * (1.0 + extra.max(0.0));
        let rate = (b + gained) / (fixed + b + cost);
        if gained / cost >= DRAFT_GAIN_MIN * base && rate > best_rate * 1.0001 {
            (best, best_rate) = (k, rate);
        }
    }
    best
}

/// Step time against rows, fitted as a line over recent verification
/// steps (exponentially forgotten): the marginal cost of a row as a share
/// of a one-row step, which the drafters weigh drafts against.
#[derive(Clone, Debug, Default)]
pub(crate) struct RowCost {
    /// A ratio set rather than fitted (tests, whose stand-in model's steps
    /// take no time worth fitting).
    fixed: Option<f64>,
    w: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
}

/// A row's share of a one-row step until the fit has evidence.
const ROW_COST_DEFAULT: f64 = 0.15;

/// Each step's weight in the fit decays by this a step (about 50 steps).
const ROW_COST_FORGET: f64 = 0.98;

/// The variance of the fitted steps' rows below which the fit is not
/// trusted.
const ROW_SPREAD_MIN: f64 = 1.0;

/// The most a row may cost, as a share of a one-row step (a fit that says
/// more has been misled by steps of very different kinds).
const ROW_COST_MAX: f64 = 0.5;

impl RowCost {
    #[cfg(test)]
    pub fn fixed(ratio: f64) -> RowCost {
        RowCost {
            fixed: Some(ratio),
            ..RowCost::default()
        }
    }

    /// A step of `rows` rows took `secs`.
    pub fn record(&mut self, rows: usize, secs: f64) {
        let (x, l) = (rows as f64, ROW_COST_FORGET);
        self.w = l * self.w + 1.0;
        self.sx = l * self.sx + x;
        self.sy = l * self.sy + secs;
        self.sxx = l * self.sxx + x * x;
        self.sxy = l * self.sxy + x * secs;
    }

    /// One more row's cost in seconds: the fit's slope when it is trusted,
    /// else the default share of the recent steps' one-row time; `None`
    /// before any step was timed.
    pub fn row_secs(&self) -> Option<f64> {
        if self.w <= 0.0 {
            return None;
        }
        let c = self.ratio();
        let (rows, secs) = (self.sx / self.w, self.sy / self.w);
        // A step of `rows` rows takes t1·(1 + c·(rows − 1)).
        let t1 = secs / (1.0 + c * (rows - 1.0).max(0.0));
        let r = c * t1;
        (r.is_finite() && r > 0.0).then_some(r)
    }

    /// One more row's cost as a share of a one-row step (clamped to
    /// [0.01, 0.5]; the default until steps of different sizes were seen).
    pub fn ratio(&self) -> f64 {
        if let Some(r) = self.fixed {
            return r;
        }
        let den = self.w * self.sxx - self.sx * self.sx;
        // Steps of nearly one size (a variance of rows under one) say
        // little about a row's cost: the slope would be noise.
        if self.w < 4.0 || den < self.w * self.w * ROW_SPREAD_MIN {
            return ROW_COST_DEFAULT;
        }
        let b = (self.w * self.sxy - self.sx * self.sy) / den;
        let a = (self.sy - b * self.sx) / self.w;
        // (NaN fails both comparisons too.)
        let sane = b > 0.0 && a + b > 0.0;
        if !sane {
            return ROW_COST_DEFAULT;
        }
        (b / (a + b)).clamp(0.01, ROW_COST_MAX)
    }
}

/// The index of the last token of the first occurrence of `pat` in `src`
/// that ends at or after `floor`.
fn find_after(src: &[u32], pat: &[u32], floor: usize) -> Option<usize> {
    let n = pat.len();
    if n == 0 || src.len() < n {
        return None;
    }
    let first_start = floor.saturating_sub(n - 1);
    (first_start..=src.len() - n)
        .find(|&s| src[s..s + n] == *pat)
        .map(|s| s + n - 1)
}

/// The index of the last token of the last occurrence of `pat` in `src`
/// that ends before `end` (exclusive).
fn find_last(src: &[u32], pat: &[u32], end: usize) -> Option<usize> {
    let n = pat.len();
    let end = end.min(src.len());
    if n == 0 || end < n {
        return None;
    }
    (0..=end - n)
        .rev()
        .find(|&s| src[s..s + n] == *pat)
        .map(|s| s + n - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(method: SpecMethod) -> Speculation {
        Speculation {
            method,
            k_max: 4,
            ngram_min: 2,
            ngram_max: 4,
            prediction_k_max: 8,
            rows_max: 64,
            suffix_tokens: 1024,
        }
    }

    /// Rows this cheap make every draft up to `limit` pay while the
    /// acceptance rate is fair: `limit` sets the draft's length.
    const CHEAP: f64 = 0.01;

    fn ctx(cfg: &Speculation, row_cost: f64) -> StepCtx<'_> {
        StepCtx {
            cfg,
            row_cost,
            batch: 1,
            stored: &[],
        }
    }

    #[test]
    fn prompt_lookup_follows_the_latest_earlier_occurrence_of_the_tail() {
        let c = cfg(SpecMethod::Ngram);
        let mut d = Drafter::new(Vec::new(), &c).unwrap();
        let mut out = Vec::new();
        // "1 2 3" twice before the tail: the later one is followed by 7 8 6 1.
        let h = [1, 2, 3, 9, 9, 5, 1, 2, 3, 7, 8, 6, 1, 2, 3];
        assert_eq!(d.propose(&h, 4, &ctx(&c, CHEAP), &mut out), 4);
        assert_eq!(out, [7, 8, 6, 1]);
        // Two kept, then the model said 4 where the source says 6: a
        // substitution is guessed once (the source goes on after the 6).
        d.verified(2);
        let h2 = [&h[..], &[7, 8, 4]].concat();
        assert_eq!(d.propose(&h2, 3, &ctx(&c, CHEAP), &mut out), 3);
        assert_eq!(out, [1, 2, 3]);
        // It was not one (the model said 5): "8 4 5" and its tails occur
        // nowhere before, so nothing is drafted.
        d.verified(0);
        let h3 = [&h2[..], &[5]].concat();
        assert_eq!(d.propose(&h3, 8, &ctx(&c, CHEAP), &mut out), 0);
    }

    #[test]
    fn a_kept_draft_continues_from_the_cursor_without_a_search() {
        let c = cfg(SpecMethod::Off);
        let pred: Vec<u32> = (100..140).collect();
        let mut d = Drafter::new(pred, &c).unwrap();
        let mut out = Vec::new();
        // The first token sampled was the prediction's first.
        let mut h = vec![1, 2, 100];
        assert_eq!(d.propose(&h, 4, &ctx(&c, CHEAP), &mut out), 4);
        assert_eq!(out, [101, 102, 103, 104]);
        // All kept, and the model's own next token was 105.
        h.extend([101, 102, 103, 104, 105]);
        d.verified(4);
        assert_eq!(d.propose(&h, 32, &ctx(&c, CHEAP), &mut out), 8);
        assert_eq!(out, (106..114).collect::<Vec<_>>());
        assert_eq!(d.accepted_prediction, 4);
        // Three kept, then the output parted (it said 7).
        h.extend([106, 107, 108, 7]);
        d.verified(3);
        assert_eq!((d.accepted_prediction, d.rejected_prediction), (7, 5));
        // A substitution is guessed: the prediction goes on after 109.
        assert_eq!(d.propose(&h, 4, &ctx(&c, CHEAP), &mut out), 4);
        assert_eq!(out, [110, 111, 112, 113]);
        // It was not one (the model said 8): nothing kept, and no second
        // guess; "7 8" and "8" are nowhere in the prediction.
        h.push(8);
        d.verified(0);
        assert_eq!(d.propose(&h, 32, &ctx(&c, CHEAP), &mut out), 0);
        // The output came back to the prediction at 112 (an edit replaced
        // 109 to 111 with 7 8): one token so near realigns it.
        h.push(112);
        assert_eq!(d.propose(&h, 1, &ctx(&c, CHEAP), &mut out), 1);
        assert_eq!(out, [113]);
        // Far ahead, a single token does not realign; three tokens do.
        let mut far = Drafter::new((100..140).collect(), &c).unwrap();
        assert_eq!(
            far.propose(&[1, 2, 5, 138], 32, &ctx(&c, CHEAP), &mut out),
            0
        );
        assert_eq!(
            far.propose(&[1, 136, 137, 138], 32, &ctx(&c, CHEAP), &mut out),
            1
        );
        assert_eq!(out, [139]);
    }

    /// Drafts that keep nothing lower the acceptance rate until no draft
    /// pays for its row; from then on the drafter only probes, one token
    /// at a time, sitting out growing spells between probes that keep
    /// nothing: a request whose drafts never match runs nearly every step
    /// with its one decode row.
    #[test]
    fn drafts_that_keep_nothing_make_the_drafter_sit_out_growing_spells() {
        let c = cfg(SpecMethod::Ngram);
        let mut d = Drafter::new(Vec::new(), &c).unwrap();
        let mut out = Vec::new();
        let h = [5, 6, 1, 5, 6];
        let mut drafted = Vec::new();
        for step in 0..64 {
            let n = d.propose(&h, 8, &ctx(&c, 0.2), &mut out);
            if n > 0 {
                drafted.push((step, n));
                d.verified(0);
                // Back where the search finds it, as a fresh output would be.
                d.cursor = None;
            }
        }
        let steps: Vec<usize> = drafted.iter().map(|&(s, _)| s).collect();
        assert_eq!(steps, [0, 1, 2, 3, 4, 5, 7, 11, 19, 35, 52]);
        // Single-token drafts, then probes.
        assert!(drafted.iter().all(|&(_, n)| n == 1), "{drafted:?}");
        // In a batch of 16 decode rows the spells grow on, to 256 steps.
        let batch = StepCtx {
            batch: 16,
            ..ctx(&c, 0.2)
        };
        let mut d = Drafter::new(Vec::new(), &c).unwrap();
        let mut steps = Vec::new();
        for step in 0..400 {
            if d.propose(&h, 8, &batch, &mut out) > 0 {
                steps.push(step);
                d.verified(0);
                d.cursor = None;
            }
        }
        let gaps: Vec<usize> = steps.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.iter().any(|&g| g > 100), "{steps:?}");
        assert!(gaps.iter().all(|&g| g <= 257), "{steps:?}");
    }

    /// The draft model's pace: before a pass was timed it probes with two
    /// tokens (the second pass, one row a request, is the one timed);
    /// once timed, a pass costing many rows drafts nothing but probes,
    /// with spells growing past the lookups' cap of 16 steps, up to 256;
    /// a cheap pass and kept drafts draft long.
    #[test]
    fn the_draft_models_pace_weighs_its_pass_and_sits_out_long_spells() {
        let c = cfg(SpecMethod::Off);
        let mut m = ModelDrafter::new();
        assert_eq!(m.plan(8, &ctx(&c, 0.2), None), 2);
        assert_eq!(m.plan(1, &ctx(&c, 0.2), None), 1);
        let mut steps = Vec::new();
        for step in 0..1200 {
            let k = m.plan(8, &ctx(&c, 0.2), Some(6.0));
            if k > 0 {
                assert_eq!(k, 1, "a draft costing 7 rows a token drafts only probes");
                m.drafted(k);
                m.verified(0);
                steps.push(step);
            }
        }
        let gaps: Vec<usize> = steps.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.iter().any(|&g| g > 200), "{steps:?}");
        assert!(gaps.iter().all(|&g| g <= 257), "{steps:?}");
        let mut m = ModelDrafter::new();
        let mut k = 0;
        for _ in 0..20 {
            k = m.plan(16, &ctx(&c, 0.1), Some(0.05));
            m.drafted(k);
            m.verified(k);
        }
        assert!(k >= 4, "a cheap draft that is always kept drafts {k}");
    }

    #[test]
    fn limits_bound_every_draft() {
        let c = cfg(SpecMethod::Off);
        let mut d = Drafter::new((0..100).collect(), &c).unwrap();
        let mut out = Vec::new();
        assert_eq!(d.propose(&[0], 2, &ctx(&c, CHEAP), &mut out), 2);
        assert_eq!(out, [1, 2]);
        d.verified(2);
        // Never past prediction_k_max, and never past `limit`.
        let mut h = vec![0, 1, 2, 3];
        for _ in 0..6 {
            let n = d.propose(&h, 100, &ctx(&c, CHEAP), &mut out);
            assert!((1..=c.prediction_k_max).contains(&n));
            h.extend_from_slice(&out.clone());
            let next = *h.last().unwrap() + 1;
            d.verified(n);
            h.push(next);
        }
        assert_eq!(
            d.propose(&h, 100, &ctx(&c, CHEAP), &mut out),
            c.prediction_k_max
        );
        assert_eq!(d.propose(&h, 3, &ctx(&c, CHEAP), &mut out), 3);
        // The end of the prediction ends the draft.
        let mut d = Drafter::new(vec![1, 2], &c).unwrap();
        assert_eq!(d.propose(&[1], 100, &ctx(&c, CHEAP), &mut out), 1);
        d.verified(1);
        assert_eq!(d.propose(&[1, 2, 3], 100, &ctx(&c, CHEAP), &mut out), 0);
    }

    #[test]
    fn the_draft_length_weighs_the_acceptance_rate_against_a_rows_cost() {
        // Nearly sure drafts on cheap rows: long; hopeless ones: none.
        assert!(best_k(0.95, 0.05, 1, 16, 0.0) >= 8);
        assert_eq!(best_k(0.05, 0.15, 1, 16, 0.0), 0);
        assert_eq!(best_k(0.95, 0.05, 1, 3, 0.0), 3);
        // Alone, a one-token draft pays when α beats c by the margin.
        assert_eq!(best_k(0.11, 0.1, 1, 1, 0.0), 0);
        assert_eq!(best_k(0.12, 0.1, 1, 1, 0.0), 1);
        // In a batch of 16 rows that cost a tenth of a one-row step each,
        // a step yields 16/25 = 0.64 tokens a row: a draft must beat 0.736.
        assert_eq!(best_k(0.73, 0.1, 16, 16, 0.0), 0);
        assert!(best_k(0.75, 0.1, 16, 16, 0.0) >= 1);
        // More acceptance never drafts less; dearer rows and fuller
        // batches never more.
        for c in [0.02, 0.1, 0.3, 0.8] {
            let ks: Vec<usize> = (0..=20)
                .map(|i| best_k(i as f64 / 20.0, c, 1, 32, 0.0))
                .collect();
            assert!(ks.windows(2).all(|w| w[0] <= w[1]), "c {c}: {ks:?}");
        }
        for a in [0.3, 0.6, 0.9, 0.99] {
            let ks: Vec<usize> = [0.01, 0.05, 0.1, 0.3, 1.0]
                .iter()
                .map(|&c| best_k(a, c, 1, 32, 0.0))
                .collect();
            assert!(ks.windows(2).all(|w| w[0] >= w[1]), "alpha {a}: {ks:?}");
            let ks: Vec<usize> = [1, 2, 4, 8, 16, 32]
                .iter()
                .map(|&b| best_k(a, 0.1, b, 32, 0.0))
                .collect();
            assert!(ks.windows(2).all(|w| w[0] >= w[1]), "alpha {a}: {ks:?}");
        }
    }

    #[test]
    fn a_rows_cost_is_fitted_from_the_steps_times() {
        let mut r = RowCost::default();
        assert_eq!(r.ratio(), ROW_COST_DEFAULT);
        // One-row steps alone say nothing of a row's cost.
        for _ in 0..20 {
            r.record(1, 0.002);
        }
        assert_eq!(r.ratio(), ROW_COST_DEFAULT);
        // 2 ms a step and 0.25 ms a row: a row is 1/8 of a one-row step.
        for _ in 0..50 {
            for rows in [1, 5, 9] {
                r.record(rows, 0.00175 + 0.00025 * rows as f64);
            }
        }
        assert!((r.ratio() - 0.125).abs() < 0.01, "{}", r.ratio());
    }

    /// The suffix cache hands a scope only its own entries, keeps each
    /// scope within its tokens and sequences, and as many scopes as its
    /// bound, the least recently used going first.
    #[test]
    fn the_suffix_cache_is_kept_per_scope_and_bounded() {
        let (a, b) = (Scope(1), Scope(2));
        let mut sc = SuffixCache::default();
        sc.insert(a, &[1, 2, 3], 10);
        sc.insert(b, &[7, 8, 9], 10);
        assert_eq!(sc.entries(a), [Arc::from(&[1, 2, 3][..])]);
        assert_eq!(sc.entries(b), [Arc::from(&[7, 8, 9][..])]);
        assert!(sc.entries(Scope(3)).is_empty());
        // Within 10 tokens: the oldest goes; a longer one keeps its end.
        sc.insert(a, &[4, 5, 6, 7, 8], 10);
        sc.insert(a, &[9, 10, 11], 10);
        assert_eq!(sc.entries(a).len(), 2);
        sc.insert(a, &(0..25).collect::<Vec<u32>>(), 10);
        assert_eq!(
            sc.entries(a),
            [Arc::from(&(15..25).collect::<Vec<u32>>()[..])]
        );
        assert_eq!(sc.size(), (2, 13));
        // Sequences: at most SUFFIX_SEQS_MAX a scope.
        for i in 0..100 {
            sc.insert(b, &[i, i + 1], 1 << 20);
        }
        assert_eq!(sc.entries(b).len(), SUFFIX_SEQS_MAX);
        // Scopes: the least recently used goes.
        for s in 10..(10 + SUFFIX_SCOPES_MAX as u64) {
            sc.entries(b);
            sc.insert(Scope(s), &[1, 2], 10);
        }
        assert_eq!(sc.size().0, SUFFIX_SCOPES_MAX);
        assert!(sc.entries(a).is_empty(), "the scope used least is gone");
        assert!(!sc.entries(b).is_empty());
        sc.retain(|s| s != b);
        assert!(sc.entries(b).is_empty());
    }

    /// A request drafts from its scope's earlier requests, the longest
    /// tail first.
    #[test]
    fn the_suffix_cache_drafts_what_the_scope_said_before() {
        let c = Speculation {
            method: SpecMethod::Suffix,
            ..cfg(SpecMethod::Ngram)
        };
        let stored: Vec<Arc<[u32]>> = vec![
            Arc::from(&[1, 2, 50, 51, 52, 53][..]),
            Arc::from(&[9, 1, 2, 60, 61, 62][..]),
        ];
        let step = StepCtx {
            cfg: &c,
            row_cost: CHEAP,
            batch: 1,
            stored: &stored,
        };
        let mut d = Drafter::new(Vec::new(), &c).unwrap();
        let mut out = Vec::new();
        // "1 2": the latest entry has it, followed by 60 61 62.
        assert_eq!(d.propose(&[7, 1, 2], 3, &step, &mut out), 3);
        assert_eq!(out, [60, 61, 62]);
        // "9 1 2" is longer and only in the second; "5 1 2" matches "1 2"
        // in both, the latest wins; with no entries, nothing.
        let mut d = Drafter::new(Vec::new(), &c).unwrap();
        assert_eq!(d.propose(&[9, 1, 2], 2, &step, &mut out), 2);
        assert_eq!(out, [60, 61]);
        let none = StepCtx {
            stored: &[],
            ..step
        };
        let mut d = Drafter::new(Vec::new(), &c).unwrap();
        assert_eq!(d.propose(&[7, 1, 2], 3, &none, &mut out), 0);
        // A template: an earlier answer matches the last six tokens, the
        // request's own text only the last two (longer than ngram_max's
        // 4 in neither): the longer match, in the earlier answer, wins.
        let answer: Vec<Arc<[u32]>> = vec![Arc::from(&[20, 21, 22, 23, 8, 9, 40, 41, 42][..])];
        let step = StepCtx {
            stored: &answer,
            ..step
        };
        let mut d = Drafter::new(Vec::new(), &c).unwrap();
        let history = [8, 9, 77, 20, 21, 22, 23, 8, 9];
        assert_eq!(d.propose(&history, 3, &step, &mut out), 3);
        assert_eq!(out, [40, 41, 42]);
    }

    #[test]
    fn without_a_prediction_or_a_method_there_is_no_drafter() {
        assert!(Drafter::new(Vec::new(), &cfg(SpecMethod::Off)).is_none());
    }
}
