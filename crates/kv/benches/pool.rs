//! Cost of the pool's checks against the work they guard, at the shape of
//! the default model (SmolLM2-135M: 30 layers, 3 KV heads × 64, 16 slots per
//! page). Run: `cargo bench -p kv --bench pool`. Figures in BENCHMARKS.md.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kv::{
    page_checksum, DType, KvShape, LayerView, Owner, Poison, Pool, PoolOptions, RequestId, TenantId,
};

const OWNER: Owner = Owner::new(RequestId(1), TenantId(1));

fn full_pool(dtype: DType) -> (Pool, Vec<kv::PageRef>) {
    let shape = KvShape::new(30, 3, 64, 16, dtype).unwrap();
    let mut pool = Pool::new(shape, 4, PoolOptions::default()).unwrap();
    let mut pages = Vec::new();
    pool.alloc(OWNER, 4, &mut pages).unwrap();
    let row: Vec<f32> = (0..shape.token_width()).map(|i| i as f32 * 1e-3).collect();
    for &h in &pages {
        for layer in 0..shape.layers {
            for slot in 0..shape.page_size {
                pool.write_token(h, OWNER, layer, slot, &row, &row).unwrap();
            }
        }
    }
    (pool, pages)
}

/// Reads every element once with 16 independent lanes (vectorisable): the
/// floor of what attention must do with the page's bytes.
fn sum_view(view: LayerView<'_>) -> f32 {
    fn lanes<T: Copy>(xs: &[T], f: impl Fn(T) -> f32) -> f32 {
        let mut acc = [0.0f32; 16];
        for chunk in xs.chunks_exact(16) {
            for (a, &x) in acc.iter_mut().zip(chunk) {
                *a += f(x);
            }
        }
        acc.iter().sum()
    }
    match view {
        LayerView::F32 { k, v } => lanes(k, |x| x) + lanes(v, |x| x),
        LayerView::F16 { k, v } => lanes(k, |x| x.to_f32()) + lanes(v, |x| x.to_f32()),
        LayerView::Q8_0 { k, v } => {
            // Scale × q per value, as attention's gather does.
            let q8 = |b: &[u8]| -> f32 {
                let mut acc = [0.0f32; 16];
                for blk in b.chunks_exact(kv::Q8_BLOCK_BYTES) {
                    let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                    for (j, &q) in blk[2..].iter().enumerate() {
                        acc[j % 16] += d * f32::from(q as i8);
                    }
                }
                acc.iter().sum()
            };
            q8(k) + q8(v)
        }
    }
}

fn bench(c: &mut Criterion) {
    for dtype in [DType::F32, DType::F16, DType::Q8_0] {
        let (pool, pages) = full_pool(dtype);
        let shape = *pool.shape();
        let h = pages[0];
        let name = dtype.name();
        let mut g = c.benchmark_group(format!("page_{name}"));
        g.throughput(Throughput::Bytes(shape.data_bytes() as u64));

        // The checks alone: handle + owner + watermark for every layer of a page.
        g.bench_function("read_checks_all_layers", |b| {
            b.iter(|| {
                for layer in 0..shape.layers {
                    black_box(pool.read_layer(black_box(h), OWNER, layer, 16).unwrap());
                }
            })
        });
        // The work they guard: reading every K/V byte of the page (checks included).
        g.bench_function("read_page_bytes_checked", |b| {
            b.iter(|| {
                let mut acc = 0.0f32;
                for layer in 0..shape.layers {
                    acc += sum_view(pool.read_layer(black_box(h), OWNER, layer, 16).unwrap());
                }
                black_box(acc)
            })
        });
        g.bench_function("canary_check", |b| {
            b.iter(|| pool.check_canary(black_box(h), OWNER).unwrap())
        });
        let mut bytes = vec![0u8; shape.data_bytes()];
        pool.export_page(h, OWNER, &mut bytes).unwrap();
        g.bench_function("checksum_xxh3", |b| {
            b.iter(|| black_box(page_checksum(kv::RequestId(1), 1, 0, black_box(&bytes))))
        });
        g.bench_function("checksum_crc32c", |b| {
            b.iter(|| black_box(crc32c::crc32c(black_box(&bytes))))
        });
        let mut dst = vec![0u8; shape.data_bytes()];
        g.bench_function("plain_copy", |b| {
            b.iter(|| {
                dst.copy_from_slice(black_box(&bytes));
                black_box(&dst);
            })
        });
        g.bench_function("export_page", |b| {
            b.iter(|| black_box(pool.export_page(h, OWNER, &mut dst).unwrap()))
        });
        g.finish();

        // Poison: free (with poison) + alloc, versus the same without poison.
        let mut g = c.benchmark_group(format!("free_alloc_{name}"));
        g.throughput(Throughput::Bytes(shape.page_bytes() as u64));
        for poison in [Poison::Nan, Poison::Off] {
            let mut pool = Pool::new(shape, 1, PoolOptions { poison }).unwrap();
            let mut pages = Vec::with_capacity(1);
            pool.alloc(OWNER, 1, &mut pages).unwrap();
            g.bench_function(format!("{poison:?}"), |b| {
                b.iter(|| {
                    let h = pages[0];
                    pool.free(h, OWNER).unwrap();
                    pages.clear();
                    pool.alloc(OWNER, 1, &mut pages).unwrap();
                })
            });
        }
        g.finish();
    }
}

/// The operator console's snapshot (`Pool::map_into` and the grid the
/// browser gets) at the default pool size: SmolLM2-135M, f16, the default
/// 1 GiB budget, half the pages held by 64 requests of 8 tenants. This is
/// what a console poll costs the engine thread (docs/console.md).
fn console_snapshot(c: &mut Criterion) {
    let shape = KvShape::new(30, 3, 64, 16, DType::F16).unwrap();
    let pages = kv::pages_for_budget(&shape, 1 << 30);
    let mut pool = Pool::new(shape, pages, PoolOptions::default()).unwrap();
    let mut held = Vec::new();
    for r in 0..64u64 {
        let owner = Owner::new(RequestId(r + 1), TenantId(r % 8));
        pool.alloc(owner, pages as usize / 128, &mut held).unwrap();
    }
    let mut map = request::console::PoolMap::default();
    pool.map_into(&mut map);
    let mut g = c.benchmark_group("console");
    g.throughput(Throughput::Elements(pages));
    g.bench_function(format!("map_into_{pages}_pages"), |b| {
        b.iter(|| {
            pool.map_into(&mut map);
            black_box(map.len())
        })
    });
    g.bench_function(format!("grid_{pages}_pages"), |b| {
        b.iter(|| black_box(map.grid(request::console::GRID_CELLS_MAX)))
    });
    g.finish();
}

criterion_group!(benches, bench, console_snapshot);
criterion_main!(benches);
