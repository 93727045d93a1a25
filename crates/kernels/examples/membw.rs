//! Memory read-bandwidth probe: `cargo run -p kernels --release --example membw`.
use std::hint::black_box;
use std::time::Instant;

fn sum(s: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    for v in s.chunks_exact(8) {
        for l in 0..8 {
            acc[l] = acc[l].wrapping_add(v[l]);
        }
    }
    acc.iter().fold(0, |a, b| a.wrapping_add(*b))
}

fn main() {
    let words = 64usize << 20;
    let buf: Vec<u64> = (0..words as u64).collect();
    for threads in [1usize, 2, 1, 2] {
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            std::thread::scope(|s| {
                for c in 0..threads {
                    let part = &buf[c * words / threads..(c + 1) * words / threads];
                    s.spawn(move || black_box(sum(part)));
                }
            });
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "{threads} threads: {:.1} GB/s",
            (words * 8) as f64 / best / 1e9
        );
        let pool = kernels::ThreadPool::new(threads);
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            pool.parallel_for(threads, |r| {
                for c in r {
                    black_box(sum(&buf[c * words / threads..(c + 1) * words / threads]));
                }
            });
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "{threads} threads (pool): {:.1} GB/s",
            (words * 8) as f64 / best / 1e9
        );
    }
}
