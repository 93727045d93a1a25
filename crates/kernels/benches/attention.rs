//! Attention kernel benchmark at SmolLM2-135M's shape (9 query heads over
//! 3 KV heads of 64, pages of 16 slots, 30 layers of K/V so the caches do
//! not hold them, as in a real step).
//!
//! `cargo bench -p kernels --bench attention` prints, per depth and KV
//! type, the time of one decode row over all 30 layers and of a 256-row
//! prefill chunk at that depth, with the bytes of K/V read and the rate.
//! Kernel level: `ISOSERVE_KERNEL`; threads: `ISOSERVE_THREADS`; depths:
//! `ATTN_BENCH_DEPTHS=512,2048`; KV types: `ATTN_BENCH_KINDS=f16,q8_0`;
//! `ATTN_BENCH_DECODE_ONLY=1` skips the prefill chunk; `ATTN_BENCH_HOT=1`
//! reads one layer's K/V for all 30 (cache-resident); `ATTN_BENCH_READ=1`
//! also times reading the same bytes doing nothing else.

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
    window: None,
};
const KVW: usize = 192;

enum Store {
    F32(Vec<Vec<f32>>),
    F16(Vec<Vec<f16>>),
    Q8(Vec<Vec<u8>>),
}

/// GGML `q8_0` blocks of `x` (as the pool writes them).
fn q8(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in x.chunks(32) {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(f16::from_f32(d).to_le_bytes());
        out.extend(b.iter().map(|v| ((v * id).round() as i8) as u8));
    }
    out
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
                Store::Q8(p) => KvPage {
                    k: KvRows::Q8_0(&p[2 * i][..n * KVW / 32 * 34]),
                    v: KvRows::Q8_0(&p[2 * i + 1][..n * KVW / 32 * 34]),
                    slots: n,
                },
            }
        })
        .collect()
}

fn bytemuck<T>(x: &[T]) -> &[u8] {
    // SAFETY: plain values (f32, f16) viewed as their bytes.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), std::mem::size_of_val(x)) }
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
        let kinds = std::env::var("ATTN_BENCH_KINDS").unwrap_or_else(|_| "f32,f16,q8_0".into());
        for kind in kinds.split(',') {
            let per_layer = depth.div_ceil(PAGE);
            let n = LAYERS * per_layer * 2;
            let val = |i: usize| ((i * 2654435761) % 1000) as f32 / 1000.0 - 0.5;
            let row = |p: usize| {
                (0..PAGE * KVW)
                    .map(|i| val(p * 7 + i))
                    .collect::<Vec<f32>>()
            };
            let store = match kind {
                "f32" => Store::F32((0..n).map(row).collect()),
                "q8_0" => Store::Q8((0..n).map(|p| q8(&row(p))).collect()),
                _ => Store::F16(
                    (0..n)
                        .map(|p| {
                            (0..PAGE * KVW)
                                .map(|i| f16::from_f32(val(p * 7 + i)))
                                .collect()
                        })
                        .collect(),
                ),
            };
            let row_bytes = match kind {
                "f32" => KVW * 4,
                "q8_0" => KVW / 32 * 34,
                _ => KVW * 2,
            };
            let bytes_per_layer = depth * row_bytes * 2;
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
                // ATTN_BENCH_READ=1: also the time to read the same bytes in
                // the same order with the same threads, doing nothing else
                // (the floor this layout allows).
                if rows_n == 1 && std::env::var_os("ATTN_BENCH_READ").is_some() {
                    let mut times = Vec::new();
                    for _ in 0..reps {
                        let t = Instant::now();
                        for lp in &layer_pages {
                            let sum = std::sync::atomic::AtomicU64::new(0);
                            threads.parallel_for(lp.len(), |range| {
                                let mut acc = 0u64;
                                for p in &lp[range] {
                                    for rows in [p.k, p.v] {
                                        let bytes: &[u8] = match rows {
                                            KvRows::F32(x) => bytemuck(x),
                                            KvRows::F16(x) => bytemuck(x),
                                            KvRows::Q8_0(x) => x,
                                        };
                                        for c in bytes.chunks_exact(64) {
                                            acc = acc.wrapping_add(u64::from_le_bytes(
                                                c[..8].try_into().unwrap(),
                                            ));
                                        }
                                    }
                                }
                                sum.fetch_add(acc, std::sync::atomic::Ordering::Relaxed);
                            });
                            std::hint::black_box(sum.into_inner());
                        }
                        times.push(t.elapsed().as_secs_f64());
                    }
                    times.sort_by(f64::total_cmp);
                    let t = times[times.len() / 2];
                    let gb = (bytes_per_layer * LAYERS) as f64 / 1e9;
                    println!(
                        "depth {depth:5} {kind} read only: {:8.3} ms ({:.1} GB/s)",
                        t * 1e3,
                        gb / t
                    );
                }
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
                    "depth {depth:5} {} {:>9}: {:8.3} ms for 30 layers, best {:.3} ({:.0} MB of K/V read once: {:.1} GB/s)",
                    kind,
                    if rows_n == 1 { "decode" } else { "256 rows" },
                    t * 1e3,
                    times[0] * 1e3,
                    gb * 1e3,
                    gb / t
                );
            }
        }
    }
}
