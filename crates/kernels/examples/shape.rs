//! Times one matmul shape: `cargo run -p kernels --release --example shape -- q4_1 576 576 1 [threads] [iters]`.
use kernels::{matmul, QuantizedActivations, ThreadPool, WeightMatrix, WeightType};
use std::time::Instant;

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let ty = match a.first().map(String::as_str).unwrap_or("q4_1") {
        "q4_0" => WeightType::Q4_0,
        "q8_0" => WeightType::Q8_0,
        _ => WeightType::Q4_1,
    };
    let p = |i: usize, d: usize| a.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (rows, cols, n, threads, iters) = (p(1, 576), p(2, 576), p(3, 1), p(4, 2), p(5, 20));
    // Enough distinct copies to exceed the L3 cache, so n=1 runs read DRAM.
    let mbytes = rows * ty.row_bytes(cols);
    let cached = std::env::var("CACHED").is_ok();
    let copies = if n == 1 && !cached {
        (256 << 20) / mbytes + 1
    } else {
        1
    };
    let mut seed = 0x12345678u64;
    let mut rnd = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut bytes = vec![0u8; mbytes * copies];
    for blk in bytes.chunks_exact_mut(ty.block_bytes()) {
        for b in blk.iter_mut() {
            *b = rnd() as u8;
        }
        blk[1] = 0x20; // small positive f16 scale
        if ty == WeightType::Q4_1 {
            blk[3] = 0xa0;
        }
    }
    let x: Vec<f32> = (0..n * cols)
        .map(|_| (rnd() % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let mut q = QuantizedActivations::new(n, cols);
    q.quantize(&x, cols);
    let pool = ThreadPool::new(threads);
    let mut out = vec![0.0f32; n * rows];
    let mut best = f64::MAX;
    let mut times = vec![];
    for it in 0..iters {
        let c = it % copies;
        let w = WeightMatrix::new(ty, &bytes[c * mbytes..(c + 1) * mbytes], rows, cols).unwrap();
        let t = Instant::now();
        matmul(&pool, w, &q, &mut out);
        let e = t.elapsed().as_secs_f64();
        times.push(e);
        best = best.min(e);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let med = times[times.len() / 2];
    println!(
        "{ty:?} {rows}x{cols} n={n} threads={threads}: best {:.1} µs median {:.1} µs | {:.1} GB/s | {:.1} GFLOP/s (best)",
        best * 1e6,
        med * 1e6,
        mbytes as f64 / best / 1e9,
        2.0 * (rows * cols * n) as f64 / best / 1e9
    );
}
