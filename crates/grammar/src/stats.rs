//! What the grammar engine did, lock-free: each step's mask time and each
//! cold compile's, in buckets a factor √2 apart (fine enough to read a
//! p50 and a p99 from), and the cache's hits and misses. A compiler's
//! compiled grammars and their matchers share its counters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Buckets: the upper bound of bucket `k` is 1 µs × 2^(k/2), so the last
/// of the 44 is about 4 s; slower ones count in the last.
pub const BUCKETS: usize = 44;

/// The upper bound of bucket `k`, in seconds, to three significant digits
/// (so an exposition shows `0.000181`, not its binary expansion).
pub fn bucket_bound_s(k: usize) -> f64 {
    let x = 1e-6 * 2f64.powf(k as f64 / 2.0);
    format!("{x:.2e}").parse().unwrap_or(x)
}

/// A latency histogram.
#[derive(Debug)]
pub struct Timings {
    counts: [AtomicU64; BUCKETS],
    sum_ns: AtomicU64,
}

impl Default for Timings {
    fn default() -> Self {
        Timings {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

impl Timings {
    pub fn record(&self, d: Duration) {
        let s = d.as_secs_f64();
        let k = (0..BUCKETS)
            .find(|&k| s <= bucket_bound_s(k))
            .unwrap_or(BUCKETS - 1);
        self.counts[k].fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> Histogram {
        Histogram {
            counts: self
                .counts
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect(),
            sum_s: self.sum_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }
}

/// A histogram as read: per-bucket counts (not cumulative) and the sum.
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    pub counts: Vec<u64>,
    pub sum_s: f64,
}

/// Every bucket, empty.
impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            sum_s: 0.0,
        }
    }
}

impl Histogram {
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// (upper bound in seconds, count in that bucket) for each bucket.
    pub fn buckets(&self) -> Vec<(f64, u64)> {
        self.counts
            .iter()
            .enumerate()
            .map(|(k, &c)| (bucket_bound_s(k), c))
            .collect()
    }

    /// The `q` quantile's bucket bound (an upper estimate within √2).
    pub fn quantile_s(&self, q: f64) -> Option<f64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let want = ((n as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (k, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= want {
                return Some(bucket_bound_s(k));
            }
        }
        Some(bucket_bound_s(BUCKETS - 1))
    }
}

/// The grammar engine's counters.
#[derive(Debug, Default)]
pub struct GrammarStats {
    /// One step's mask for one sequence.
    pub masks: Timings,
    /// One cold compile (a cache miss, or `compile_cold`).
    pub compiles: Timings,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    /// Steps whose mask failed (a bound, or no token allowed).
    pub mask_failures: AtomicU64,
}

/// [`GrammarStats`] as read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StatsSnapshot {
    pub masks: Histogram,
    pub compiles: Histogram,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub mask_failures: u64,
}

impl GrammarStats {
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            masks: self.masks.snapshot(),
            compiles: self.compiles.snapshot(),
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
            cache_misses: self.cache_misses.load(Ordering::Relaxed),
            mask_failures: self.mask_failures.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_come_from_the_buckets() {
        let t = Timings::default();
        for _ in 0..98 {
            t.record(Duration::from_micros(50));
        }
        t.record(Duration::from_millis(3));
        t.record(Duration::from_secs(100));
        let h = t.snapshot();
        assert_eq!(h.count(), 100);
        let p50 = h.quantile_s(0.5).unwrap();
        assert!((50e-6..=50e-6 * 1.5).contains(&p50), "{p50}");
        let p99 = h.quantile_s(0.99).unwrap();
        assert!((3e-3..=3e-3 * 1.5).contains(&p99), "{p99}");
        // The slowest counts in the last bucket.
        assert_eq!(h.counts[BUCKETS - 1], 1);
        assert!((h.sum_s - (98.0 * 50e-6 + 3e-3 + 100.0)).abs() < 1e-6);
        assert_eq!(Histogram::default().quantile_s(0.5), None);
    }
}
