//! Single-thread matmul speed of every quantised format at one batch size,
//! on the two SmolLM2-like FFN shapes (1536×768 and 768×1536, so that
//! K-quant rows fit whole super-blocks):
//!
//! ```text
//! cargo run --release -p kernels --example formats [-- N_ROWS [REPS]]
//! ```
//!
//! Prints the best of REPS (default 7) runs per format in ms and GMAC/s.
//! Weights are `quantize_row` of a fixed pseudo-random matrix; activations
//! are quantised once, outside the timing. Only the process-wide kernel
//! level runs (`ISOSERVE_KERNEL` chooses another).
use kernels::{
    matmul, quantize_row, KernelLevel, QuantizedActivations, ThreadPool, WeightMatrix, WeightType,
};
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map_or(512, |s| s.parse().expect("N_ROWS"));
    let reps: usize = args.next().map_or(7, |s| s.parse().expect("REPS"));
    let pool = ThreadPool::new(1);
    let mut seed = 12345u64;
    let mut rnd = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    };
    println!(
        "level {:?}, {n} activation rows, best of {reps}",
        KernelLevel::active()
    );
    for &(rows, cols) in &[(1536usize, 768usize), (768, 1536)] {
        let x: Vec<f32> = (0..n * cols).map(|_| rnd()).collect();
        let mut qa = QuantizedActivations::new(n, cols);
        qa.quantize(&x, cols);
        let wf: Vec<f32> = (0..rows * cols).map(|_| rnd()).collect();
        for ty in WeightType::ALL.into_iter().filter(|t| t.is_quantized()) {
            let mut bytes = Vec::new();
            for r in wf.chunks(cols) {
                quantize_row(ty, r, &mut bytes);
            }
            let w = WeightMatrix::new(ty, &bytes, rows, cols).expect("shape");
            let mut out = vec![0f32; n * rows];
            let mut best = f64::MAX;
            for _ in 0..reps {
                let t = Instant::now();
                matmul(&pool, w, &qa, &mut out);
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!(
                "{rows}x{cols} {:5} {:8.2} ms {:6.1} GMAC/s",
                ty.name(),
                best * 1e3,
                (n * rows * cols) as f64 / best / 1e9
            );
        }
    }
}
