//! Speculative decoding's drafter: what a request proposes to verify next.
//!
//! Pure state over the request's own tokens: its prediction (OpenAI's
//! Predicted Outputs) and, with `--speculative ngram`, its prompt and
//! output so far (prompt lookup). Nothing here reads another request's
//! text, so nothing here can carry one tenant's text into another's drafts.
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
//! How many tokens to draft adapts to the request's acceptance: it doubles
//! after a draft kept whole, drops to one more than what was kept after a
//! partial one, and after drafts kept nothing the drafter sits out a
//! growing number of steps — text that matches nothing decodes one row a
//! step, as without speculation.

use crate::{SpecMethod, Speculation};

/// Where a draft's tokens come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// The request's prediction.
    Prediction,
    /// The request's prompt and output so far (prompt lookup).
    History,
}

/// A position in a source: `at` is the source's token that equals the
/// request's last token; the draft continues from `at + 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cursor {
    src: Source,
    at: usize,
}

/// Steps a drafter sits out at most after drafts that kept nothing.
const IDLE_STEPS_MAX: u32 = 16;

/// How far past where the output last followed the prediction a short
/// tail (one or two tokens) realigns it: a deletion or an insertion of
/// about this many tokens.
const REALIGN_WINDOW: usize = 16;

/// The shortest tail that realigns the output anywhere in the prediction.
const REALIGN_FAR_MIN: usize = 3;

/// A request's drafter.
#[derive(Clone, Debug)]
pub(crate) struct Drafter {
    prediction: Vec<u32>,
    cursor: Option<Cursor>,
    /// The prediction's position the output was last aligned to: a search
    /// prefers what comes after it (an edit moves forward through a file).
    floor: usize,
    /// Tokens the next draft may hold (adapted).
    k: usize,
    /// Drafts in a row that kept nothing, and steps left to sit out.
    misses: u32,
    idle: u32,
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
            cursor,
            floor: 0,
            k: cfg.k_max.clamp(1, 4),
            misses: 0,
            idle: 0,
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
        cfg: &Speculation,
        out: &mut Vec<u32>,
    ) -> usize {
        out.clear();
        self.pending = None;
        if self.idle > 0 {
            self.idle -= 1;
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
            self.cursor = self.search(history, cfg);
        }
        let Some(c) = self.cursor else {
            return 0;
        };
        if c.src == Source::Prediction {
            self.floor = c.at;
        }
        let k = self.k.min(self.k_max(cfg)).min(limit);
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
        }
    }

    /// The longest tail of `history` found in the prediction (near the
    /// floor, any length; else, three tokens or more, the first occurrence
    /// after the floor or the last before it), then in the history itself
    /// (the latest occurrence that has a token after it).
    fn search(&self, history: &[u32], cfg: &Speculation) -> Option<Cursor> {
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
        let n_max = cfg.ngram_max.min(history.len());
        if cfg.method == SpecMethod::Ngram {
            for n in (cfg.ngram_min.max(1)..=n_max).rev() {
                let tail = &history[history.len() - n..];
                // Not the tail itself: an occurrence with a token after it.
                if let Some(at) = find_last(history, tail, history.len() - 1) {
                    return Some(Cursor {
                        src: Source::History,
                        at,
                    });
                }
            }
        }
        None
    }

    /// The verification of the pending draft kept `kept` of its tokens.
    pub fn verified(&mut self, kept: usize, cfg: &Speculation) {
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
        let k_max = match src {
            Source::Prediction => cfg.prediction_k_max,
            Source::History => cfg.k_max,
        }
        .max(1);
        if kept == drafted {
            self.k = (self.k * 2).min(k_max);
            self.misses = 0;
        } else if kept > 0 {
            self.k = (kept + 1).min(k_max);
            self.misses = 0;
        } else {
            self.k = 1;
            self.misses += 1;
            // Sit out 0, 1, 3, 7, then 15 steps after 1, 2, 3, 4, 5 misses.
            self.idle = ((1u32 << (self.misses - 1).min(4)) - 1).min(IDLE_STEPS_MAX);
        }
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
        }
    }

    #[test]
    fn prompt_lookup_follows_the_latest_earlier_occurrence_of_the_tail() {
        let c = cfg(SpecMethod::Ngram);
        let mut d = Drafter::new(Vec::new(), &c).unwrap();
        let mut out = Vec::new();
        // "1 2 3" twice before the tail: the later one is followed by 7 8 6 1.
        let h = [1, 2, 3, 9, 9, 5, 1, 2, 3, 7, 8, 6, 1, 2, 3];
        assert_eq!(d.propose(&h, 8, &c, &mut out), 4);
        assert_eq!(out, [7, 8, 6, 1]);
        // Two kept, then the model said 4 where the source says 6: a
        // substitution is guessed once (the source goes on after the 6).
        d.verified(2, &c);
        let h2 = [&h[..], &[7, 8, 4]].concat();
        assert_eq!(d.propose(&h2, 8, &c, &mut out), 3);
        assert_eq!(out, [1, 2, 3]);
        // It was not one (the model said 5): "8 4 5" and its tails occur
        // nowhere before, so nothing is drafted.
        d.verified(0, &c);
        let h3 = [&h2[..], &[5]].concat();
        assert_eq!(d.propose(&h3, 8, &c, &mut out), 0);
    }

    #[test]
    fn a_kept_draft_continues_from_the_cursor_without_a_search() {
        let c = cfg(SpecMethod::Off);
        let pred: Vec<u32> = (100..140).collect();
        let mut d = Drafter::new(pred, &c).unwrap();
        let mut out = Vec::new();
        // The first token sampled was the prediction's first.
        let mut h = vec![1, 2, 100];
        assert_eq!(d.propose(&h, 32, &c, &mut out), 4);
        assert_eq!(out, [101, 102, 103, 104]);
        // All kept, and the model's own next token was 105: k doubles.
        h.extend([101, 102, 103, 104, 105]);
        d.verified(4, &c);
        assert_eq!(d.propose(&h, 32, &c, &mut out), 8);
        assert_eq!(out, (106..114).collect::<Vec<_>>());
        assert_eq!(d.accepted_prediction, 4);
        // Three kept, then the output parted (it said 7).
        h.extend([106, 107, 108, 7]);
        d.verified(3, &c);
        assert_eq!((d.accepted_prediction, d.rejected_prediction), (7, 5));
        // A substitution is guessed: the prediction goes on after 109.
        assert_eq!(d.propose(&h, 32, &c, &mut out), 4);
        assert_eq!(out, [110, 111, 112, 113]);
        // It was not one (the model said 8): nothing kept, and no second
        // guess; "7 8" and "8" are nowhere in the prediction.
        h.push(8);
        d.verified(0, &c);
        assert_eq!(d.propose(&h, 32, &c, &mut out), 0);
        // The output came back to the prediction at 112 (an edit replaced
        // 109 to 111 with 7 8): one token so near realigns it.
        h.push(112);
        assert_eq!(d.propose(&h, 32, &c, &mut out), 1);
        assert_eq!(out, [113]);
        // Far ahead, a single token does not realign; three tokens do.
        let mut far = Drafter::new((100..140).collect(), &c).unwrap();
        assert_eq!(far.propose(&[1, 2, 5, 138], 32, &c, &mut out), 0);
        assert_eq!(far.propose(&[1, 136, 137, 138], 32, &c, &mut out), 1);
        assert_eq!(out, [139]);
    }

    #[test]
    fn drafts_that_keep_nothing_make_the_drafter_sit_out_growing_spells() {
        let c = cfg(SpecMethod::Ngram);
        let mut d = Drafter::new(Vec::new(), &c).unwrap();
        let mut out = Vec::new();
        let h = [5, 6, 1, 5, 6];
        let mut drafted_steps = Vec::new();
        for step in 0..40 {
            if d.propose(&h, 8, &c, &mut out) > 0 {
                drafted_steps.push(step);
                d.verified(0, &c);
                // The cursor moved past the rejected draft: put it back
                // where the search would find it, as a fresh output would.
                d.cursor = None;
            }
        }
        // Gaps of 0, 1, 3, 7, then 15 steps.
        assert_eq!(drafted_steps, [0, 1, 3, 7, 15, 31]);
    }

    #[test]
    fn limits_bound_every_draft() {
        let c = cfg(SpecMethod::Off);
        let mut d = Drafter::new((0..100).collect(), &c).unwrap();
        let mut out = Vec::new();
        assert_eq!(d.propose(&[0], 2, &c, &mut out), 2);
        assert_eq!(out, [1, 2]);
        d.verified(2, &c);
        // k may grow, never past prediction_k_max, and never past `limit`.
        let mut h = vec![0, 1, 2, 3];
        for _ in 0..6 {
            let n = d.propose(&h, 100, &c, &mut out);
            assert!(n <= c.prediction_k_max);
            h.extend_from_slice(&out.clone());
            let next = *h.last().unwrap() + 1;
            d.verified(n, &c);
            h.push(next);
        }
        assert_eq!(d.propose(&h, 100, &c, &mut out), c.prediction_k_max);
        // The end of the prediction ends the draft.
        let mut d = Drafter::new(vec![1, 2], &c).unwrap();
        assert_eq!(d.propose(&[1], 100, &c, &mut out), 1);
        d.verified(1, &c);
        assert_eq!(d.propose(&[1, 2, 3], 100, &c, &mut out), 0);
    }

    #[test]
    fn without_a_prediction_or_a_method_there_is_no_drafter() {
        assert!(Drafter::new(Vec::new(), &cfg(SpecMethod::Off)).is_none());
    }
}
