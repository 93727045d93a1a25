//! The memory roofline `isoserve bench` prints beside its decode speeds:
//! the read bandwidth of a buffer larger than the last-level cache (with
//! the forward pass's thread count), the bytes one decoded token reads
//! (the weights, plus the K/V at that depth in the KV dtype in use), the
//! tok/s that bandwidth allows, and the fraction reached.

use std::time::Instant;

use gguf::GgufFile;
use model::Config;

/// The last-level cache's size from sysfs (the largest cache of cpu0), or
/// 32 MiB when sysfs does not say.
fn llc_bytes() -> usize {
    let mut best = 0usize;
    for i in 0..8 {
        let p = format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size");
        let Ok(s) = std::fs::read_to_string(&p) else {
            continue;
        };
        let s = s.trim();
        let (num, mult) = match s.strip_suffix('K') {
            Some(n) => (n, 1 << 10),
            None => match s.strip_suffix('M') {
                Some(n) => (n, 1 << 20),
                None => (s, 1),
            },
        };
        if let Ok(n) = num.parse::<usize>() {
            best = best.max(n * mult);
        }
    }
    if best == 0 {
        32 << 20
    } else {
        best
    }
}

/// A read-bandwidth probe: a buffer 8× the last-level cache (at least
/// 256 MiB), written once, that `threads` threads sum in equal shares.
/// Kept so that each test can be measured beside its own probe: on a
/// shared machine the bandwidth drifts from minute to minute (44.7 to 57.5
/// GB/s between two runs here).
pub struct Bandwidth {
    buf: Vec<u64>,
    threads: usize,
}

impl Bandwidth {
    /// Allocates and fills the buffer.
    pub fn new(threads: usize) -> Bandwidth {
        let words = (8 * llc_bytes()).max(256 << 20) / 8;
        // Written once so the pages are resident (not the zero page).
        let buf = (0..words as u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9))
            .collect();
        Bandwidth {
            buf,
            threads: threads.max(1),
        }
    }

    /// Bytes per second, best of `passes` passes.
    pub fn measure(&self, passes: usize) -> f64 {
        let words = self.buf.len();
        let chunk = words.div_ceil(self.threads);
        let mut best = 0.0f64;
        for _ in 0..passes.max(1) {
            let t = Instant::now();
            let sums: Vec<u64> = std::thread::scope(|s| {
                let handles: Vec<_> = self
                    .buf
                    .chunks(chunk)
                    .map(|part| {
                        s.spawn(move || {
                            // Eight independent sums: the loop vectorises
                            // and memory, not the adds, bounds it.
                            let mut acc = [0u64; 8];
                            for c in part.chunks_exact(8) {
                                for (a, x) in acc.iter_mut().zip(c) {
                                    *a = a.wrapping_add(*x);
                                }
                            }
                            acc.iter().fold(0u64, |a, x| a.wrapping_add(*x))
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap_or(0)).collect()
            });
            std::hint::black_box(sums);
            best = best.max((words * 8) as f64 / t.elapsed().as_secs_f64());
        }
        best
    }
}

/// Bytes of weights one decoded token reads: every tensor, except that an
/// untied token embedding is read one row at a time (a tied one is the
/// output head, read whole).
pub fn weight_bytes(file: &GgufFile) -> u64 {
    let tensors = file.tensors();
    let total: u64 = tensors.iter().map(|t| t.byte_size()).sum();
    let tied = !tensors.iter().any(|t| t.name == "output.weight");
    match (tied, tensors.iter().find(|t| t.name == "token_embd.weight")) {
        (false, Some(e)) => total - e.byte_size() + e.row_byte_size(),
        _ => total,
    }
}

/// Bytes of K and V one decoded token reads at `depth` tokens of context:
/// every layer's keys and values up to the depth (a sliding-window layer
/// up to its window).
pub fn kv_bytes(config: &Config, dtype: kv::DType, depth: usize) -> u64 {
    kv_bytes_of(
        config.n_kv_head * config.head_dim,
        &config.swa_layers,
        config.n_layer,
        config.sliding_window,
        dtype,
        depth,
    )
}

/// [`kv_bytes`] from the shape's numbers: `width` K (or V) values a token
/// a layer, which of the `layers` slide over a `window`.
fn kv_bytes_of(
    width: usize,
    swa_layers: &[bool],
    layers: usize,
    window: Option<usize>,
    dtype: kv::DType,
    depth: usize,
) -> u64 {
    let row = dtype.row_bytes(width) as u64;
    (0..layers)
        .map(|l| {
            let swa = swa_layers.get(l).copied().unwrap_or(false);
            let seen = match (swa, window) {
                (true, Some(w)) => depth.min(w),
                _ => depth,
            };
            2 * row * seen as u64
        })
        .sum()
}

/// One roofline line: tok/s measured, bytes a token reads, the tok/s the
/// bandwidth allows, and the fraction reached.
pub fn line(tok_s: f64, weights: u64, kv: u64, bandwidth: f64) -> String {
    let bytes = weights + kv;
    let allowed = bandwidth / bytes as f64;
    format!(
        "{tok_s:.1} tok/s; a token reads {:.1} MB (weights {:.1} + K/V {:.1}); \
         roofline {allowed:.0} tok/s at {:.1} GB/s: {:.0}% reached",
        bytes as f64 / 1e6,
        weights as f64 / 1e6,
        kv as f64 / 1e6,
        bandwidth / 1e9,
        100.0 * tok_s / allowed
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_read_count_what_a_token_reads() {
        let r = kv::DType::F16.row_bytes(3 * 64) as u64;
        assert_eq!(r, 3 * 64 * 2);
        // The default model's shape: 30 layers, 3 KV heads of 64 at 4096
        // tokens of f16 K/V read ≈94 MB (issue 36's figure).
        let f16 = |swa: &[bool], w, depth| kv_bytes_of(192, swa, 30, w, kv::DType::F16, depth);
        let none = vec![false; 30];
        assert_eq!(f16(&none, None, 4096), 30 * 2 * r * 4096);
        assert!((f16(&none, None, 4096) as f64 / 1e6 - 94.4).abs() < 0.1);
        // A sliding-window layer reads its window at most.
        let mut one = none.clone();
        one[0] = true;
        assert_eq!(f16(&one, Some(512), 4096), 29 * 2 * r * 4096 + 2 * r * 512);
        assert_eq!(f16(&none, None, 0), 0);
        // q8_0: 34 bytes a block of 32.
        assert_eq!(kv::DType::Q8_0.row_bytes(192) as u64, 6 * 34);
    }
}
