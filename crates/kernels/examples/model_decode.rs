//! Whole-model matmul timing with distinct weights per layer (so weights
//! stream from DRAM as in real decoding):
//! `cargo run -p kernels --release --example model_decode -- [n] [iters]`.
use kernels::{matmul, QuantizedActivations, ThreadPool, WeightMatrix, WeightType};
use std::time::Instant;

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let n: usize = a.first().and_then(|s| s.parse().ok()).unwrap_or(1);
    let iters: usize = a.get(1).and_then(|s| s.parse().ok()).unwrap_or(20);
    let (dim, kv, ffn, vocab, layers) = (576, 192, 1536, 49152, 30);
    let shapes = [
        (dim, dim),
        (kv, dim),
        (kv, dim),
        (dim, dim),
        (ffn, dim),
        (ffn, dim),
        (dim, ffn),
    ];
    let mut seed = 0x9E3779B97F4A7C15u64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut mk = |ty: WeightType, rows: usize, cols: usize| {
        let mut b = vec![0u8; rows * ty.row_bytes(cols)];
        for blk in b.chunks_exact_mut(ty.block_bytes()) {
            for x in blk.iter_mut() {
                *x = rnd() as u8;
            }
            blk[1] = 0x20;
            if ty == WeightType::Q4_1 {
                blk[3] = 0xa0;
            }
        }
        (ty, rows, cols, b)
    };
    let mut mats = vec![];
    for _ in 0..layers {
        for &(r, c) in &shapes {
            mats.push(mk(WeightType::Q4_1, r, c));
        }
    }
    let output = mk(WeightType::Q8_0, vocab, dim);
    let total: usize = mats.iter().map(|m| m.3.len()).sum::<usize>() + output.3.len();
    let pool = ThreadPool::from_env();
    let mut qd = QuantizedActivations::new(n, dim);
    let mut qf = QuantizedActivations::new(n, ffn);
    let xd: Vec<f32> = (0..n * dim)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let xf: Vec<f32> = (0..n * ffn)
        .map(|i| ((i * 41 % 97) as f32 - 48.0) / 48.0)
        .collect();
    qd.quantize(&xd, dim);
    qf.quantize(&xf, ffn);
    let mut out = vec![0.0f32; n * vocab];
    let mut times = vec![];
    let mut tout = vec![];
    for _ in 0..iters {
        let t = Instant::now();
        for (ty, rows, cols, b) in &mats {
            let w = WeightMatrix::new(*ty, b, *rows, *cols).unwrap();
            let x = if *cols == dim { &qd } else { &qf };
            matmul(&pool, w, x, &mut out[..n * rows]);
        }
        let t1 = Instant::now();
        let w = WeightMatrix::new(output.0, &output.3, output.1, output.2).unwrap();
        matmul(&pool, w, &qd, &mut out[..n * vocab]);
        times.push(t.elapsed().as_secs_f64());
        tout.push(t1.elapsed().as_secs_f64());
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    tout.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let (best, med) = (times[0], times[iters / 2]);
    println!(
        "{} threads, n={n}: {:.1} MB weights; best {:.2} ms ({:.0} tok/s, {:.1} GB/s), median {:.2} ms ({:.0} tok/s); output matrix best {:.2} ms",
        pool.n_threads(),
        total as f64 / 1e6,
        best * 1e3,
        n as f64 / best,
        total as f64 / best / 1e9,
        med * 1e3,
        n as f64 / med,
        tout[0] * 1e3
    );
}
