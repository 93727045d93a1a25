//! The draft model (`--draft-model`): a smaller model of the same
//! vocabulary that proposes what the target model verifies.
//!
//! Its K/V lives in a pool of its own, shaped for it (its layers, its
//! heads), with the target pool's page size and as many pages. That pool
//! is a `kv::Pool` like the target's, so every check of K1–K7 holds in it
//! as it does in the target's: a request's draft pages are allocated for
//! its owner (the same request, the same tenant, the same scope), every
//! access names that owner and a live epoch, reads stop at the written
//! watermark, freed pages are poisoned, and the canaries are checked. The
//! draft pool keeps no prefix cache: a draft page is never shared, so no
//! scope question arises.
//!
//! A request's draft pages hold the draft model's K/V of a prefix of its
//! history (`dcomputed` positions) and, while a draft is verified, of the
//! draft's tokens past it (`dwritten`). After the verification the rows
//! past what the target kept are rolled back (K3, read back), as the
//! target's are. The prefix catches up lazily: the positions the draft has
//! not seen — the prompt at first (also on a decode node, whose prompt K/V
//! came by transfer into the target pool only), then what was kept from
//! other drafts' sources and the model's own tokens — are run through the
//! draft model in its first pass of a step, in chunks under the step's
//! budget.
//!
//! A draft is greedy (the draft model's argmax): deterministic, so the
//! verification keeps the target's distribution exactly (see `spec`).

use std::time::Instant;

use kv::{PageRef, Pool};
use model::{Forward, ModelError, Row, SeqCtx};

use super::{Active, Clock};

/// The draft model and its pool.
pub(crate) struct DraftModel {
    pub fwd: Box<dyn Forward>,
    pub pool: Pool,
    rows: Vec<Row>,
    /// Seconds a draft pass took (a weighted average of recent passes;
    /// `None` until one was timed).
    pass_secs: Option<f64>,
    /// Draft passes run, draft rows run (catch-up included).
    pub passes_total: u64,
    pub rows_total: u64,
    /// Tests: a pass's cost in rows, set rather than timed.
    #[cfg(test)]
    pub fixed_pass_rows: Option<f64>,
    /// Tests: leave a verified draft's rejected rows written (the
    /// mutation the per-tick watermark check must catch).
    #[cfg(test)]
    pub skip_rewind: bool,
}

/// A pass's weight in the average of pass times.
const PASS_WEIGHT: f64 = 0.2;

impl DraftModel {
    pub fn new(fwd: Box<dyn Forward>, pool: Pool) -> DraftModel {
        DraftModel {
            fwd,
            pool,
            rows: Vec::new(),
            pass_secs: None,
            passes_total: 0,
            rows_total: 0,
            #[cfg(test)]
            fixed_pass_rows: None,
            #[cfg(test)]
            skip_rewind: false,
        }
    }

    /// What a draft pass costs, in rows of the target's step (a row
    /// costing `row_secs`); `None` before a pass was timed.
    pub fn pass_rows(&self, row_secs: Option<f64>) -> Option<f64> {
        #[cfg(test)]
        if self.fixed_pass_rows.is_some() {
            return self.fixed_pass_rows;
        }
        match (self.pass_secs, row_secs) {
            (Some(p), Some(r)) if r > 0.0 => Some(p / r),
            _ => None,
        }
    }

    /// Drafts for `plans` — (index in `running`, tokens wanted) — into
    /// each request's `draft`, and returns how many each got (0 while its
    /// pages are catching up with its history). Rows of one pass are at
    /// most `rows_max`.
    pub fn draft(
        &mut self,
        running: &mut [Active],
        plans: &[(usize, usize)],
        rows_max: usize,
        clock: &Clock,
    ) -> Result<Vec<usize>, ModelError> {
        let rows_max = rows_max.min(self.fwd.rows_max()).max(1);
        let mut got = vec![0usize; plans.len()];
        // Pass 1: each request's positions the draft has not seen, up to
        // its last token, whose logits give the first draft token.
        self.rows.clear();
        let mut ready = vec![false; plans.len()];
        for (j, &(i, _)) in plans.iter().enumerate() {
            let a = &running[i];
            let end = a.history.len();
            let left = rows_max - self.rows.len();
            let n = (end - a.dcomputed).min(left);
            for pos in a.dcomputed..a.dcomputed + n {
                self.rows.push(Row {
                    seq: j,
                    pos,
                    token: a.history[pos],
                    logits: pos + 1 == end,
                });
            }
            ready[j] = a.dcomputed + n == end;
        }
        let mut tokens: Vec<u32> = vec![0; plans.len()];
        self.pass(running, plans, clock, &mut tokens)?;
        for (j, &(i, _)) in plans.iter().enumerate() {
            let a = &mut running[i];
            let ran = self.rows.iter().filter(|r| r.seq == j).count();
            a.dcomputed += ran;
            a.dwritten = a.dcomputed;
            a.draft.clear();
            if ready[j] {
                a.draft.push(tokens[j]);
            }
        }
        // Passes 2..: each drafted token in, the next out.
        let k_max = plans.iter().map(|p| p.1).max().unwrap_or(0);
        for depth in 1..k_max {
            self.rows.clear();
            for (j, &(i, k)) in plans.iter().enumerate() {
                let a = &running[i];
                if ready[j] && k > depth && self.rows.len() >= rows_max {
                    // No room at this depth: its draft ends here (a later
                    // depth would leave a gap in its pages).
                    ready[j] = false;
                }
                if ready[j] && k > depth {
                    let token = *a.draft.last().expect("a ready plan drafted");
                    self.rows.push(Row {
                        seq: j,
                        pos: a.history.len() - 1 + depth,
                        token,
                        logits: true,
                    });
                }
            }
            if self.rows.is_empty() {
                break;
            }
            self.pass(running, plans, clock, &mut tokens)?;
            for r in self.rows.clone() {
                let a = &mut running[plans[r.seq].0];
                a.dwritten = r.pos + 1;
                a.draft.push(tokens[r.seq]);
            }
        }
        for (j, &(i, _)) in plans.iter().enumerate() {
            got[j] = running[i].draft.len();
        }
        Ok(got)
    }

    /// Runs `self.rows` and leaves each row-with-logits' argmax in
    /// `tokens[seq]`.
    fn pass(
        &mut self,
        running: &[Active],
        plans: &[(usize, usize)],
        clock: &Clock,
        tokens: &mut [u32],
    ) -> Result<(), ModelError> {
        if self.rows.is_empty() {
            return Ok(());
        }
        let seqs: Vec<SeqCtx<'_>> = plans
            .iter()
            .map(|&(i, _)| SeqCtx {
                owner: running[i].owner,
                pages: &running[i].dpages,
            })
            .collect();
        let started: Instant = clock();
        self.fwd.forward(&mut self.pool, &seqs, &self.rows)?;
        let secs = (clock() - started).as_secs_f64();
        self.passes_total += 1;
        self.rows_total += self.rows.len() as u64;
        // A pass of draft tokens (one row a request) is what drafting costs;
        // a catch-up pass of many rows would overstate it.
        if self.rows.len() <= plans.len() {
            self.pass_secs = Some(match self.pass_secs {
                None => secs,
                Some(p) => (1.0 - PASS_WEIGHT) * p + PASS_WEIGHT * secs,
            });
        }
        let vocab = self.fwd.vocab();
        let logits = self.fwd.logits();
        let want = self.rows.iter().filter(|r| r.logits).count();
        if logits.len() < want * vocab {
            return Err(ModelError::Batch(format!(
                "the draft model returned {} logits for {want} rows of {vocab}",
                logits.len()
            )));
        }
        let mut k = 0;
        for r in &self.rows {
            if r.logits {
                tokens[r.seq] = model::sample::argmax(&logits[k * vocab..(k + 1) * vocab]);
                k += 1;
            }
        }
        Ok(())
    }

    /// After a verification kept the target's history up to `keep`
    /// positions: the draft pages' rows past it are rolled back and read
    /// back (K3), as the target's.
    pub fn settle(&mut self, a: &mut Active, ps: usize) -> Result<(), String> {
        // Valid: the history the draft had seen, and the drafted tokens
        // the target kept (they are the history now, but its last token).
        let keep = a.dwritten.min(a.history.len() - 1).max(a.dcomputed);
        let written_end = a.dwritten;
        a.dcomputed = keep;
        a.dwritten = keep;
        if keep >= written_end {
            return Ok(());
        }
        #[cfg(test)]
        if self.skip_rewind {
            return Ok(());
        }
        rewind(&mut self.pool, a.owner, &a.dpages, keep, written_end, ps)
    }

    /// Frees a request's draft pages.
    pub fn free(&mut self, a: &Active) {
        for &h in a.dpages.iter().rev() {
            if let Err(e) = self.pool.free(h, a.owner) {
                tracing::error!(request = a.id.0, %e, "unexpected draft page free outcome");
            }
        }
    }
}

/// Rolls `pages`' rows from position `keep` to `written_end` back, then
/// reads the page holding `keep` back: it must say `keep % ps` rows (the
/// target's pages and the draft model's alike).
pub(crate) fn rewind(
    pool: &mut Pool,
    owner: kv::Owner,
    pages: &[PageRef],
    keep: usize,
    written_end: usize,
    ps: usize,
) -> Result<(), String> {
    let (first, last) = (keep / ps, (written_end - 1) / ps);
    for (p, &page) in pages.iter().enumerate().take(last + 1).skip(first) {
        let slots = if p == first { keep % ps } else { 0 };
        pool.rewind(page, owner, slots)
            .map_err(|e| format!("cannot roll a draft back: {e}"))?;
    }
    let page = pages[keep / ps];
    let left = pool.written_slots(page, owner).map_err(|e| e.to_string())?;
    if left != keep % ps {
        return Err(format!(
            "a rolled-back draft left {left} rows written in page {}, not {}",
            page.index,
            keep % ps
        ));
    }
    Ok(())
}
