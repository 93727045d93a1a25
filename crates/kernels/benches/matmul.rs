//! Matmul benchmarks for the SmolLM2-135M shapes (dim 576, ffn 1536, kv 192,
//! vocab 49152; Q4_1 layers, Q8_0 output matrix).
//!
//! `cargo bench -p kernels --bench matmul` runs the criterion groups, then
//! prints a memory-bandwidth reference and whole-model estimates.
//! Kernel level: `ISOSERVE_KERNEL`, threads: `ISOSERVE_THREADS`.
//! `cargo bench -p kernels --bench matmul -- --estimate-only` skips criterion.

use criterion::{black_box, BenchmarkId, Criterion, Throughput};
use kernels::{matmul, KernelLevel, QuantizedActivations, ThreadPool, WeightMatrix, WeightType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};

const DIM: usize = 576;
const KV: usize = 192;
const FFN: usize = 1536;
const VOCAB: usize = 49152;
const LAYERS: usize = 30;

/// (name, type, rows, cols, uses per layer) — the output matrix is used once.
const SHAPES: [(&str, WeightType, usize, usize, usize); 5] = [
    ("q4_1_576x576", WeightType::Q4_1, DIM, DIM, 2), // wq, wo
    ("q4_1_192x576", WeightType::Q4_1, KV, DIM, 2),  // wk, wv
    ("q4_1_1536x576", WeightType::Q4_1, FFN, DIM, 2), // gate, up
    ("q4_1_576x1536", WeightType::Q4_1, DIM, FFN, 1), // down
    ("q8_0_49152x576", WeightType::Q8_0, VOCAB, DIM, 0), // output
];

struct Case {
    name: &'static str,
    ty: WeightType,
    rows: usize,
    cols: usize,
    per_layer: usize,
    bytes: Vec<u8>,
}

fn random_matrix(rng: &mut StdRng, ty: WeightType, rows: usize, cols: usize) -> Vec<u8> {
    let bb = ty.block_bytes();
    let mut b = vec![0u8; rows * cols / 32 * bb];
    rng.fill(&mut b[..]);
    for blk in b.chunks_exact_mut(bb) {
        let d = half::f16::from_f32(rng.gen_range(0.001..0.02))
            .to_bits()
            .to_le_bytes();
        blk[..2].copy_from_slice(&d);
        if ty == WeightType::Q4_1 {
            let m = half::f16::from_f32(rng.gen_range(-0.2..0.0))
                .to_bits()
                .to_le_bytes();
            blk[2..4].copy_from_slice(&m);
        }
    }
    b
}

fn cases() -> Vec<Case> {
    let mut rng = StdRng::seed_from_u64(42);
    SHAPES
        .iter()
        .map(|&(name, ty, rows, cols, per_layer)| Case {
            name,
            ty,
            rows,
            cols,
            per_layer,
            bytes: random_matrix(&mut rng, ty, rows, cols),
        })
        .collect()
}

fn acts(n: usize, cols: usize) -> QuantizedActivations {
    let mut rng = StdRng::seed_from_u64(n as u64);
    let x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let mut q = QuantizedActivations::new(n, cols);
    q.quantize(&x, cols);
    q
}

fn bench_matmul(c: &mut Criterion, pool: &ThreadPool, cases: &[Case]) {
    for &n in &[1usize, 64, 512] {
        let mut g = c.benchmark_group(format!("matmul_n{n}"));
        g.warm_up_time(Duration::from_millis(500));
        g.measurement_time(Duration::from_secs(if n == 1 { 2 } else { 3 }));
        g.sample_size(if n == 512 { 10 } else { 30 });
        for case in cases {
            let w = WeightMatrix::new(case.ty, &case.bytes, case.rows, case.cols).unwrap();
            if n == 1 {
                g.throughput(Throughput::Bytes(case.bytes.len() as u64));
            } else {
                // "elements" = floating-point operations (2 per multiply-add).
                g.throughput(Throughput::Elements((2 * case.rows * case.cols * n) as u64));
            }
            let x = acts(n, case.cols);
            let mut out = vec![0.0f32; n * case.rows];
            g.bench_function(BenchmarkId::from_parameter(case.name), |b| {
                b.iter(|| matmul(pool, w, black_box(&x), &mut out))
            });
        }
        g.finish();
    }
    let mut g = c.benchmark_group("pool");
    g.bench_function("dispatch_empty", |b| {
        b.iter(|| {
            pool.parallel_for(pool.n_threads(), |r| {
                black_box(r);
            })
        })
    });
    // Real hand-off: each thread's item takes ~2 µs of arithmetic, so the
    // caller cannot finish all items before the workers join. Compare with
    // `work_alone` (one item on the caller) to see the overhead.
    let work = || {
        let mut v = 1u64;
        for i in 0..2000u64 {
            v = black_box(v.wrapping_mul(6364136223846793005).wrapping_add(i));
        }
        v
    };
    g.bench_function("work_alone", |b| b.iter(|| black_box(work())));
    g.bench_function("broadcast_work_per_thread", |b| {
        b.iter(|| {
            pool.broadcast(|_| {
                black_box(work());
            })
        })
    });
    g.finish();
    let mut g = c.benchmark_group("quantize");
    let mut rng = StdRng::seed_from_u64(7);
    let x: Vec<f32> = (0..512 * DIM).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let mut q = QuantizedActivations::new(512, DIM);
    g.throughput(Throughput::Elements(DIM as u64));
    g.bench_function("576x1", |b| {
        b.iter(|| q.quantize(black_box(&x[..DIM]), DIM))
    });
    g.throughput(Throughput::Elements((512 * DIM) as u64));
    g.bench_function("576x512", |b| b.iter(|| q.quantize(black_box(&x), DIM)));
    g.finish();
}

/// Median seconds per call of `f` over `iters` calls after `warm` calls.
fn time_median(warm: usize, iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..warm {
        f();
    }
    let mut t: Vec<f64> = (0..iters)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[iters / 2]
}

/// Read bandwidth of a 512 MiB buffer with `threads` threads (GB/s).
fn read_bandwidth(pool: &ThreadPool) -> f64 {
    let words = 64 << 20; // 64 Mi u64 = 512 MiB
    let buf: Vec<u64> = (0..words as u64).collect();
    let chunks = pool.n_threads();
    let t = time_median(1, 5, || {
        pool.parallel_for_chunked(chunks, 1, |r| {
            for c in r {
                let s = &buf[c * words / chunks..(c + 1) * words / chunks];
                let mut acc = [0u64; 8];
                for v in s.chunks_exact(8) {
                    for l in 0..8 {
                        acc[l] = acc[l].wrapping_add(v[l]);
                    }
                }
                black_box(acc);
            }
        })
    });
    (words * 8) as f64 / t / 1e9
}

/// Whole-model matmul passes over distinct per-layer weights (96 MB, more
/// than the L3 cache, so decoding streams the weights from DRAM as in real
/// use). Returns (best seconds per pass with the output matrix applied to
/// all rows, best seconds of the output matrix alone).
fn model_pass(
    pool: &ThreadPool,
    layers: &[Vec<Case>],
    output: &Case,
    n: usize,
    iters: usize,
) -> (f64, f64) {
    let xd = acts(n, DIM);
    let xf = acts(n, FFN);
    let mut out = vec![0.0f32; n * VOCAB];
    let mut best = f64::MAX;
    let mut best_out = f64::MAX;
    for _ in 0..iters {
        let t = Instant::now();
        for layer in layers {
            for case in layer {
                let w = WeightMatrix::new(case.ty, &case.bytes, case.rows, case.cols).unwrap();
                let x = if case.cols == DIM { &xd } else { &xf };
                for _ in 0..case.per_layer {
                    matmul(pool, w, x, &mut out[..n * case.rows]);
                }
            }
        }
        let t1 = Instant::now();
        let w = WeightMatrix::new(output.ty, &output.bytes, output.rows, output.cols).unwrap();
        matmul(pool, w, &xd, &mut out);
        best = best.min(t.elapsed().as_secs_f64());
        best_out = best_out.min(t1.elapsed().as_secs_f64());
    }
    (best, best_out)
}

fn estimate(pool: &ThreadPool, cases: &[Case]) {
    println!(
        "\n== estimates: level {:?}, {} threads (best of several runs; the machine may be shared) ==",
        KernelLevel::active(),
        pool.n_threads()
    );
    let bw1 = read_bandwidth(&ThreadPool::new(1));
    let bw = read_bandwidth(pool);
    println!(
        "memory read bandwidth: {bw1:.1} GB/s (1 thread), {bw:.1} GB/s ({} threads)",
        pool.n_threads()
    );
    println!("per shape (weights cache-resident for n=1 since the same matrix repeats):");
    for case in cases {
        let w = WeightMatrix::new(case.ty, &case.bytes, case.rows, case.cols).unwrap();
        let mut line = format!("{:>16}:", case.name);
        for &n in &[1usize, 64, 512] {
            let x = acts(n, case.cols);
            let mut out = vec![0.0f32; n * case.rows];
            let iters = if n == 1 {
                301
            } else if n == 64 {
                31
            } else {
                7
            };
            let t = time_median(3, iters, || matmul(pool, w, &x, &mut out));
            if n == 1 {
                line += &format!(
                    "  n=1 {:8.1} µs {:6.1} GB/s",
                    t * 1e6,
                    case.bytes.len() as f64 / t / 1e9
                );
            } else {
                line += &format!(
                    "  n={n} {:8.2} ms {:6.1} GFLOP/s",
                    t * 1e3,
                    2.0 * (case.rows * case.cols * n) as f64 / t / 1e9
                );
            }
        }
        println!("{line}");
    }
    // Distinct weights for every layer.
    let mut rng = StdRng::seed_from_u64(9);
    let layers: Vec<Vec<Case>> = (0..LAYERS)
        .map(|_| {
            SHAPES
                .iter()
                .filter(|s| s.4 > 0)
                .map(|&(name, ty, rows, cols, per_layer)| Case {
                    name,
                    ty,
                    rows,
                    cols,
                    per_layer,
                    bytes: random_matrix(&mut rng, ty, rows, cols),
                })
                .collect()
        })
        .collect();
    let output = cases.iter().find(|c| c.per_layer == 0).unwrap();
    let layer_bytes: usize = layers
        .iter()
        .flatten()
        .map(|c| c.bytes.len() * c.per_layer)
        .sum();
    let total = layer_bytes + output.bytes.len();
    let (t1, t1_out) = model_pass(pool, &layers, output, 1, 15);
    println!(
        "decode  (n=1, weights from DRAM): {:.2} ms/token -> {:.0} tok/s ({:.1} MB/token, {:.1} GB/s; output matrix {:.2} ms = {:.1} GB/s); bandwidth floor {:.0} tok/s",
        t1 * 1e3,
        1.0 / t1,
        total as f64 / 1e6,
        total as f64 / t1 / 1e9,
        t1_out * 1e3,
        output.bytes.len() as f64 / t1_out / 1e9,
        bw * 1e9 / total as f64
    );
    for (n, iters) in [(64usize, 4usize), (512, 2)] {
        let (t, t_out) = model_pass(pool, &layers, output, n, iters);
        let last_only = t - t_out + t1_out;
        println!(
            "prefill (n={n}): {:.1} ms -> {:.0} tok/s with logits for the last token only ({:.0} tok/s with logits for every token)",
            last_only * 1e3,
            n as f64 / last_only,
            n as f64 / t
        );
    }
}

fn main() {
    let pool = ThreadPool::from_env();
    let cases = cases();
    let estimate_only = std::env::args().any(|a| a == "--estimate-only");
    if !estimate_only {
        let mut c = Criterion::default().configure_from_args();
        bench_matmul(&mut c, &pool, &cases);
        c.final_summary();
    }
    // Skip the estimate when criterion only lists / tests the benchmarks.
    if !std::env::args().any(|a| a == "--list" || a == "--test") {
        estimate(&pool, &cases);
    }
}
