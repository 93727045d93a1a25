//! Sampling: greedy, temperature, top-k, top-p, min-p, logit bias,
//! repetition, presence and frequency penalties, seeded; and stop
//! conditions.
//!
//! Pure functions of (logits, history, parameters, rng state): the same seed
//! gives the same tokens, and greedy (temperature 0) never touches the rng.

use std::collections::HashMap;

pub use request::{
    FinishReason, ParamError, SamplingParams, STOP_STRINGS_MAX, STOP_STRING_BYTES_MAX, TOP_K_MAX,
};

/// splitmix64: tiny, seedable, identical on every platform.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Per-request sampler: parameters, rng and reusable scratch.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    candidates: Vec<(f32, u32)>,
    counts: HashMap<u32, u32>,
}

/// Index of the largest value; the lowest index wins ties, NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = Rng::new(params.seed);
        Sampler {
            params,
            rng,
            candidates: Vec::new(),
            counts: HashMap::new(),
        }
    }

    /// A sampler that continues a random stream where another left off
    /// (prefill samples the first token, decode the rest: greedy never
    /// touches the rng, seeded sampling stays one stream across nodes).
    pub fn with_rng_state(params: SamplingParams, state: u64) -> Sampler {
        let mut s = Sampler::new(params);
        s.rng = Rng(state);
        s
    }

    /// The rng's state (see [`Sampler::with_rng_state`]).
    pub fn rng_state(&self) -> u64 {
        self.rng.0
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token. `logits` is modified (biases and penalties
    /// applied). `history` is the prompt and the tokens generated so far.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        // OpenAI's order: the request's biases first, then penalties.
        for &(t, b) in &self.params.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        self.apply_penalties(logits, history);
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        self.candidates.clear();
        self.candidates.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, v)| v.is_finite())
                .map(|(i, &v)| (v * inv_t, i as u32)),
        );
        if self.candidates.is_empty() {
            return argmax(logits);
        }
        // Descending by logit, ties by lower id: a total, deterministic order.
        let order = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        let k = if p.top_k > 0 {
            p.top_k.min(self.candidates.len())
        } else {
            self.candidates.len()
        };
        if k < self.candidates.len() {
            self.candidates.select_nth_unstable_by(k - 1, order);
            self.candidates.truncate(k);
        }
        self.candidates.sort_unstable_by(order);
        let max = self.candidates[0].0;
        let mut total = 0.0f64;
        for c in self.candidates.iter_mut() {
            c.0 = ((c.0 - max) as f64).exp() as f32;
            total += c.0 as f64;
        }
        // min-p: drop tokens whose probability is below min_p × the top one.
        if p.min_p > 0.0 {
            let floor = p.min_p * self.candidates[0].0;
            let keep = self
                .candidates
                .iter()
                .take_while(|c| c.0 >= floor)
                .count()
                .max(1);
            self.candidates.truncate(keep);
            total = self.candidates.iter().map(|c| c.0 as f64).sum();
        }
        // top-p: smallest prefix whose mass reaches top_p.
        if p.top_p < 1.0 {
            let mut acc = 0.0f64;
            let mut keep = self.candidates.len();
            for (i, c) in self.candidates.iter().enumerate() {
                acc += c.0 as f64 / total;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            self.candidates.truncate(keep);
            total = self.candidates.iter().map(|c| c.0 as f64).sum();
        }
        let mut r = self.rng.next_f64() * total;
        for c in &self.candidates {
            r -= c.0 as f64;
            if r < 0.0 {
                return c.1;
            }
        }
        self.candidates.last().map(|c| c.1).unwrap_or(0)
    }

    fn apply_penalties(&mut self, logits: &mut [f32], history: &[u32]) {
        let p = &self.params;
        if p.repetition_penalty == 1.0 && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0 {
            return;
        }
        self.counts.clear();
        for &t in history {
            *self.counts.entry(t).or_insert(0) += 1;
        }
        for (&t, &n) in &self.counts {
            let Some(l) = logits.get_mut(t as usize) else {
                continue;
            };
            if p.repetition_penalty != 1.0 {
                *l = if *l > 0.0 {
                    *l / p.repetition_penalty
                } else {
                    *l * p.repetition_penalty
                };
            }
            *l -= p.presence_penalty + p.frequency_penalty * n as f32;
        }
    }
}

/// Stop strings over streamed text: holds back just enough text that a stop
/// string split across tokens is never emitted, and cuts the output before
/// the stop string (OpenAI semantics).
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    pending: String,
    /// The stop string that matched (its index).
    matched: Option<usize>,
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> Result<StopStrings, ParamError> {
        request::validate_stops(&stops)?;
        Ok(StopStrings {
            stops,
            pending: String::new(),
            matched: None,
        })
    }

    /// Feeds new text; returns (text safe to emit now, stopped?).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (text.to_string(), false);
        }
        self.pending.push_str(text);
        // The earliest match; of two at one place, the first listed.
        let hit = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(k, s)| self.pending.find(s.as_str()).map(|at| (at, k)))
            .min();
        if let Some((at, k)) = hit {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            self.matched = Some(k);
            return (out, true);
        }
        // Keep the longest suffix that is a prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for n in (1..s.len().min(self.pending.len() + 1)).rev() {
                if self.pending.is_char_boundary(self.pending.len() - n)
                    && s.is_char_boundary(n)
                    && self.pending.ends_with(&s[..n])
                {
                    keep = keep.max(n);
                    break;
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// The stop string that ended the text, if one did (its index).
    pub fn matched(&self) -> Option<usize> {
        self.matched
    }

    /// Text held back at the end of generation (no stop string matched).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax_lowest_index_on_ties() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&mut [0.1, 3.0, 3.0, -1.0], &[]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0]), 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_seed_dependent() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.0,
                seed,
                ..SamplingParams::default()
            });
            (0..50)
                .map(|_| s.sample(&mut logits.clone(), &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn top_k_1_is_greedy_and_top_p_min_p_restrict() {
        let logits = vec![1.0, 5.0, 4.9, 0.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 1,
            ..SamplingParams::default()
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&mut logits.clone(), &[]), 1);
        }
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.6,
            ..SamplingParams::default()
        });
        for _ in 0..50 {
            assert!([1, 2].contains(&s.sample(&mut logits.clone(), &[])));
        }
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            ..SamplingParams::default()
        });
        for _ in 0..50 {
            assert!([1, 2].contains(&s.sample(&mut logits.clone(), &[])));
        }
    }

    #[test]
    fn temperature_distribution_matches_softmax() {
        let logits = vec![0.0f32, (2.0f32).ln()]; // p = 1/3, 2/3
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 3,
            ..SamplingParams::default()
        });
        let ones = (0..30_000)
            .filter(|_| s.sample(&mut logits.clone(), &[]) == 1)
            .count();
        let frac = ones as f64 / 30_000.0;
        assert!((frac - 2.0 / 3.0).abs() < 0.015, "{frac}");
    }

    #[test]
    fn penalties_apply_to_history() {
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::default()
        });
        let mut l = vec![4.0, 3.0, -1.0];
        assert_eq!(s.sample(&mut l, &[0, 2]), 1);
        assert_eq!(l, vec![2.0, 3.0, -2.0]);
        let mut s = Sampler::new(SamplingParams {
            presence_penalty: 1.0,
            frequency_penalty: 0.5,
            ..SamplingParams::default()
        });
        let mut l = vec![4.0, 3.0];
        s.sample(&mut l, &[0, 0]);
        assert_eq!(l, vec![2.0, 3.0]);
    }

    #[test]
    fn logit_bias_bans_and_forces_tokens_greedy_or_sampled() {
        let logits = vec![1.0, 5.0, 4.9, 0.0];
        // Greedy: banning the argmax gives the runner-up.
        let mut s = Sampler::new(SamplingParams {
            logit_bias: vec![(1, -100.0)],
            ..SamplingParams::default()
        });
        let mut l = logits.clone();
        assert_eq!(s.sample(&mut l, &[]), 2);
        assert_eq!(l[1], -95.0, "the bias is added to the logit");
        // Sampled: +100 on the least likely token takes every draw.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 5,
            logit_bias: vec![(3, 100.0)],
            ..SamplingParams::default()
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&mut logits.clone(), &[]), 3);
        }
        // Before penalties: a biased token then penalised by its history.
        let mut s = Sampler::new(SamplingParams {
            logit_bias: vec![(0, 2.0)],
            repetition_penalty: 2.0,
            ..SamplingParams::default()
        });
        let mut l = vec![4.0, 3.5];
        assert_eq!(s.sample(&mut l, &[0]), 1);
        assert_eq!(l, vec![3.0, 3.5], "(4 + 2) / 2");
        // An id past the logits (refused earlier by request::validate) is
        // skipped, not a panic.
        let mut s = Sampler::new(SamplingParams {
            logit_bias: vec![(9, 5.0)],
            ..SamplingParams::default()
        });
        assert_eq!(s.sample(&mut logits.clone(), &[]), 1);
    }

    #[test]
    fn invalid_logit_bias_is_refused() {
        for bias in [
            vec![(1, 100.5)],
            vec![(1, f32::NAN)],
            vec![(2, 1.0), (1, 1.0)],
            vec![(1, 1.0), (1, 2.0)],
            (0..=request::LOGIT_BIAS_MAX as u32)
                .map(|t| (t, 1.0))
                .collect(),
        ] {
            let p = SamplingParams {
                logit_bias: bias,
                ..SamplingParams::default()
            };
            assert_eq!(p.validate().unwrap_err().field, "logit_bias");
        }
        let ok = SamplingParams {
            logit_bias: vec![(0, -100.0), (7, 100.0)],
            ..SamplingParams::default()
        };
        ok.validate().expect("in range");
    }

    #[test]
    fn invalid_params_name_the_field() {
        let bad = SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "top_p");
        let bad = SamplingParams {
            temperature: -1.0,
            ..SamplingParams::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "temperature");
        let bad = SamplingParams {
            temperature: f32::NAN,
            ..SamplingParams::default()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn stop_strings_split_across_chunks() {
        let mut st = StopStrings::new(vec!["STOP".into()]).unwrap();
        let mut out = String::new();
        let mut stopped = false;
        for chunk in ["Hello S", "T", "OP there"] {
            let (t, s) = st.push(chunk);
            out.push_str(&t);
            if s {
                stopped = true;
                break;
            }
        }
        assert!(stopped);
        assert_eq!(out, "Hello ");
        assert_eq!(st.matched(), Some(0));
        // Which one matched: the earliest in the text, whatever the order.
        let mut st = StopStrings::new(vec!["later".into(), "soon".into()]).unwrap();
        assert!(st.push("a soon and later").1);
        assert_eq!(st.matched(), Some(1));
        let mut st = StopStrings::new(vec!["xyz".into()]).unwrap();
        let (t, s) = st.push("ab x");
        assert_eq!((t.as_str(), s), ("ab ", false));
        assert_eq!(st.flush(), "x");
        assert!(StopStrings::new(vec!["".into()]).is_err());
        assert!(StopStrings::new(vec!["a".into(); 5]).is_err());
        // Multi-byte text never splits inside a char.
        let mut st = StopStrings::new(vec!["é!".into()]).unwrap();
        let (t, s) = st.push("café");
        assert_eq!((t.as_str(), s), ("caf", false));
        let (t, s) = st.push("!");
        assert_eq!((t.as_str(), s), ("", true));
    }
}
