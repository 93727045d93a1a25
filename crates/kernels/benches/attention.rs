//! Attention kernel benchmark at SmolLM2-135M's shape (9 query heads over
//! 3 KV heads of 64, pages of 16 slots, 30 layers of K/V so the caches do
//! not hold them, as in a real step).
//!
//! `cargo bench -p kernels --bench attention` prints, per depth and KV
//! type, the time of one decode row over all 30 layers and of a 256-row
//! prefill chunk at that depth, with the bytes of K/V read and the rate.
//! Kernel level: `ISOSERVE_KERNEL`; threads: `ISOSERVE_THREADS`.

use std::time::Instant;

use half::f16;
use kernels::attention::{attention, AttnRow, AttnScratch, AttnShape, KvPage, KvRows};
use kernels::{KernelLevel, ThreadPool};

const LAYERS: usize = 30;
const PAGE: usize = 16;
const SHAPE: AttnShape = AttnShape {
    n_head: 9,
    n_kv_head: 3,
    head_dim: 64,
    page_size: PAGE,
};
const KVW: usize = 192;

enum Store {
    F32(Vec<Vec<f32>>),
    F16(Vec<Vec<f16>>),
}

fn pages(store: &Store, depth: usize, layer: usize) -> Vec<KvPage<'_>> {
    let per_layer = depth.div_ceil(PAGE);
    (0..per_layer)
        .map(|j| {
            let i = layer * per_layer + j;
            let n = PAGE.min(depth - j * PAGE);
            match store {
                Store::F32(p) => KvPage {
                    k: KvRows::F32(&p[2 * i][..n * KVW]),
                    v: KvRows::F32(&p[2 * i + 1][..n * KVW]),
                    slots: n,
                },
                Store::F16(p) => KvPage {
                    k: KvRows::F16(&p[2 * i][..n * KVW]),
                    v: KvRows::F16(&p[2 * i + 1][..n * KVW]),
                    slots: n,
                },
            }
        })
        .collect()
}

fn main() {
    let threads = ThreadPool::from_env();
    println!(
        "attention bench: kernels {:?}, {} threads",
        KernelLevel::active(),
        threads.n_threads()
    );
    let mut scratch = AttnScratch::default();
    let depths: Vec<usize> = std::env::var("ATTN_BENCH_DEPTHS")
        .ok()
        .map(|v| v.split(',').filter_map(|d| d.parse().ok()).collect())
        .unwrap_or_else(|| vec![512, 2048, 4096, 8192]);
    let rows_set: Vec<usize> = match std::env::var_os("ATTN_BENCH_DECODE_ONLY") {
        Some(_) => vec![1],
        None => vec![1, 256],
    };
    for depth in depths {
        for half in [false, true] {
            let per_layer = depth.div_ceil(PAGE);
            let n = LAYERS * per_layer * 2;
            let val = |i: usize| ((i * 2654435761) % 1000) as f32 / 1000.0 - 0.5;
            let store = match half {
                false => Store::F32(
                    (0..n)
                        .map(|p| (0..PAGE * KVW).map(|i| val(p * 7 + i)).collect())
                        .collect(),
                ),
                true => Store::F16(
                    (0..n)
                        .map(|p| {
                            (0..PAGE * KVW)
                                .map(|i| f16::from_f32(val(p * 7 + i)))
                                .collect()
                        })
                        .collect(),
                ),
            };
            let bytes_per_layer = depth * KVW * 2 * if half { 2 } else { 4 };
            for &rows_n in &rows_set {
                let rows: Vec<AttnRow> = (0..rows_n)
                    .map(|r| AttnRow {
                        pos: depth - rows_n + r,
                        pages: 0..per_layer,
                    })
                    .collect();
                let q: Vec<f32> = (0..rows_n * 576).map(|i| val(i) * 4.0).collect();
                let mut out = vec![0.0f32; q.len()];
                // ATTN_BENCH_HOT=1: every layer reads layer 0's K/V (in cache).
                let hot = std::env::var_os("ATTN_BENCH_HOT").is_some();
                let layer_pages: Vec<Vec<KvPage<'_>>> = (0..LAYERS)
                    .map(|l| pages(&store, depth, if hot { 0 } else { l }))
                    .collect();
                let reps = if rows_n == 1 { 100 } else { 3 };
                let mut times = Vec::new();
                for _ in 0..reps {
                    let t = Instant::now();
                    for lp in &layer_pages {
                        attention(&threads, SHAPE, lp, &rows, &q, &mut out, &mut scratch);
                    }
                    times.push(t.elapsed().as_secs_f64());
                }
                times.sort_by(f64::total_cmp);
                let t = times[times.len() / 2];
                let gb = (bytes_per_layer * LAYERS) as f64 / 1e9;
                println!(
                    "depth {depth:5} {} {:>9}: {:8.3} ms for 30 layers ({:.0} MB of K/V read once: {:.1} GB/s)",
                    if half { "f16" } else { "f32" },
                    if rows_n == 1 { "decode" } else { "256 rows" },
                    t * 1e3,
                    gb * 1e3,
                    gb / t
                );
            }
        }
    }
}
