use half::f16;
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::*;

/// A sequence's K/V: `len` tokens of `kvw` values each, K and V.
struct Seq {
    k: Vec<f32>,
    v: Vec<f32>,
    len: usize,
}

fn seq(rng: &mut StdRng, len: usize, kvw: usize) -> Seq {
    let mut g = |n: usize| {
        (0..n)
            .map(|_| rng.gen_range(-2.0f32..2.0))
            .collect::<Vec<_>>()
    };
    Seq {
        k: g(len * kvw),
        v: g(len * kvw),
        len,
    }
}

/// How the test pages store K and V.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Store {
    F32,
    F16,
    Q8,
}

/// The storage types a head geometry allows (`q8_0` blocks must not
/// straddle heads).
fn stores(sh: AttnShape) -> Vec<Store> {
    let mut v = vec![Store::F32, Store::F16];
    if sh.head_dim.is_multiple_of(Q8_BLOCK) {
        v.push(Store::Q8);
    }
    v
}

/// GGML's `q8_0` quantiser (the pool's, restated: kernels does not depend
/// on kv).
fn q8(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in x.chunks(Q8_BLOCK) {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(f16::from_f32(d).to_le_bytes());
        out.extend(b.iter().map(|v| ((v * id).round() as i8) as u8));
    }
    out
}

fn q8_value(bytes: &[u8], j: usize) -> f32 {
    let b = &bytes[j / Q8_BLOCK * Q8_BLOCK_BYTES..][..Q8_BLOCK_BYTES];
    f16::from_le_bytes([b[0], b[1]]).to_f32() * f32::from(b[2 + j % Q8_BLOCK] as i8)
}

/// Pages of the sequences in every storage type (f16 and q8_0 data rounded).
struct Paged {
    k32: Vec<Vec<f32>>,
    v32: Vec<Vec<f32>>,
    k16: Vec<Vec<f16>>,
    v16: Vec<Vec<f16>>,
    k8: Vec<Vec<u8>>,
    v8: Vec<Vec<u8>>,
    slots: Vec<usize>,
    /// Per sequence: its pages.
    ranges: Vec<Range<usize>>,
}

fn paged(seqs: &[Seq], kvw: usize, ps: usize) -> Paged {
    let mut p = Paged {
        k32: vec![],
        v32: vec![],
        k16: vec![],
        v16: vec![],
        k8: vec![],
        v8: vec![],
        slots: vec![],
        ranges: vec![],
    };
    for s in seqs {
        let start = p.slots.len();
        for j in 0..s.len.div_ceil(ps) {
            let n = ps.min(s.len - j * ps);
            let k = &s.k[j * ps * kvw..(j * ps + n) * kvw];
            let v = &s.v[j * ps * kvw..(j * ps + n) * kvw];
            p.k32.push(k.to_vec());
            p.v32.push(v.to_vec());
            p.k16.push(k.iter().map(|&x| f16::from_f32(x)).collect());
            p.v16.push(v.iter().map(|&x| f16::from_f32(x)).collect());
            if kvw.is_multiple_of(Q8_BLOCK) {
                p.k8.push(q8(k));
                p.v8.push(q8(v));
            }
            p.slots.push(n);
        }
        p.ranges.push(start..p.slots.len());
    }
    p
}

impl Paged {
    fn pages(&self, store: Store) -> Vec<KvPage<'_>> {
        (0..self.slots.len())
            .map(|i| {
                let (k, v) = match store {
                    Store::F32 => (KvRows::F32(&self.k32[i]), KvRows::F32(&self.v32[i])),
                    Store::F16 => (KvRows::F16(&self.k16[i]), KvRows::F16(&self.v16[i])),
                    Store::Q8 => (KvRows::Q8_0(&self.k8[i]), KvRows::Q8_0(&self.v8[i])),
                };
                KvPage {
                    k,
                    v,
                    slots: self.slots[i],
                }
            })
            .collect()
    }
}

fn run(
    level: KernelLevel,
    threads: usize,
    shape: AttnShape,
    pages: &[KvPage<'_>],
    rows: &[AttnRow],
    q: &[f32],
) -> Vec<f32> {
    let mut out = vec![f32::NAN; q.len()];
    let pool = ThreadPool::new(threads);
    attention_with_level(
        level,
        &pool,
        shape,
        pages,
        rows,
        q,
        &mut out,
        &mut AttnScratch::default(),
    );
    out
}

fn levels() -> Vec<KernelLevel> {
    KernelLevel::ALL
        .into_iter()
        .filter(|l| l.is_supported())
        .collect()
}

/// Naive attention in f64 over the stored (possibly rounded) values.
fn naive(shape: AttnShape, pages: &Paged, store: Store, rows: &[AttnRow], q: &[f32]) -> Vec<f64> {
    let (hd, kvw, ps) = (shape.head_dim, shape.kv_width(), shape.page_size);
    let dim = shape.n_head * hd;
    let val = |i: usize, j: usize, kv: usize| -> f64 {
        match (store, kv) {
            (Store::F32, 0) => f64::from(pages.k32[i][j]),
            (Store::F32, _) => f64::from(pages.v32[i][j]),
            (Store::F16, 0) => f64::from(pages.k16[i][j].to_f32()),
            (Store::F16, _) => f64::from(pages.v16[i][j].to_f32()),
            (Store::Q8, 0) => f64::from(q8_value(&pages.k8[i], j)),
            (Store::Q8, _) => f64::from(q8_value(&pages.v8[i], j)),
        }
    };
    // Against q8_0 keys the query is quantised too (the contract's integer
    // dot products): the reference uses the values its codes stand for.
    let q: Vec<f32> = match store {
        Store::Q8 => q
            .chunks(Q8_BLOCK)
            .flat_map(|b| {
                // SAFETY: a block of 32 values.
                let z = unsafe { tile::quantize_query(b.as_ptr(), Q8_BLOCK) };
                (0..Q8_BLOCK).map(move |i| z.d[0] * f32::from(z.q[i]))
            })
            .collect(),
        _ => q.to_vec(),
    };
    let mut out = vec![0.0; rows.len() * dim];
    for (ri, r) in rows.iter().enumerate() {
        for h in 0..shape.n_head {
            let g = h / shape.group();
            let qv = &q[ri * dim + h * hd..ri * dim + (h + 1) * hd];
            let at = |t: usize, d: usize, kv: usize| {
                val(r.pages.start + t / ps, (t % ps) * kvw + g * hd + d, kv)
            };
            // Positions attended: the window's, else all up to pos.
            let lo = shape.window.map_or(0, |w| (r.pos + 1).saturating_sub(w));
            let s: Vec<f64> = (lo..=r.pos)
                .map(|t| {
                    (0..hd).map(|d| f64::from(qv[d]) * at(t, d, 0)).sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = w.iter().sum();
            for d in 0..hd {
                out[ri * dim + h * hd + d] =
                    (lo..=r.pos).map(|t| w[t - lo] * at(t, d, 1)).sum::<f64>() / z;
            }
        }
    }
    out
}

struct Case {
    seqs: Vec<Seq>,
    /// (sequence, position)
    rows: Vec<(usize, usize)>,
    q: Vec<f32>,
}

fn case(rng: &mut StdRng, shape: AttnShape, lens: &[usize], rows: Vec<(usize, usize)>) -> Case {
    let seqs = lens
        .iter()
        .map(|&l| seq(rng, l, shape.kv_width()))
        .collect();
    let n = rows.len() * shape.n_head * shape.head_dim;
    let q = (0..n).map(|_| rng.gen_range(-1.5f32..1.5)).collect();
    Case { seqs, rows, q }
}

fn attn_rows(c: &Case, p: &Paged) -> Vec<AttnRow> {
    c.rows
        .iter()
        .map(|&(s, pos)| AttnRow {
            pos,
            pages: p.ranges[s].clone(),
        })
        .collect()
}

fn shape(n_head: usize, n_kv_head: usize, head_dim: usize, page_size: usize) -> AttnShape {
    AttnShape {
        n_head,
        n_kv_head,
        head_dim,
        page_size,
        window: None,
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn exp_is_within_two_ulp_of_libm_over_its_range() {
    let mut x = -87.0f32;
    while x < 88.0 {
        let (a, b) = (exp_ref(x), x.exp());
        let ulp = (a.to_bits() as i64 - b.to_bits() as i64).abs();
        assert!(ulp <= 2, "exp({x}) = {a} vs {b}: {ulp} ulp");
        x += 0.0137;
    }
    assert_eq!(exp_ref(0.0), 1.0);
    assert_eq!(exp_ref(f32::NEG_INFINITY), exp_ref(-87.3));
}

#[test]
fn matches_a_float64_softmax_in_every_shape_and_storage() {
    let mut rng = StdRng::seed_from_u64(7);
    // SmolLM2's heads (9 over 3 KV groups of 64), odd head dims, pages
    // smaller and larger than a tile, chunks.
    for (sh, lens) in [
        (shape(9, 3, 64, 16), vec![1, 40, 1100]),
        (shape(9, 3, 64, 16), vec![5]),
        (shape(4, 4, 16, 4), vec![3, 77]),
        (shape(2, 1, 48, 100), vec![250]),
        (shape(2, 2, 16, 512), vec![700]),
    ] {
        let rows: Vec<(usize, usize)> = lens
            .iter()
            .enumerate()
            .flat_map(|(s, &l)| [(s, 0), (s, l / 2), (s, l - 1)])
            .chain((0..lens[0].min(12)).map(|p| (0, p)))
            .collect();
        let c = case(&mut rng, sh, &lens, rows);
        let p = paged(&c.seqs, sh.kv_width(), sh.page_size);
        let rows = attn_rows(&c, &p);
        for store in stores(sh) {
            let want = naive(sh, &p, store, &rows, &c.q);
            for level in levels() {
                let got = run(level, 2, sh, &p.pages(store), &rows, &c.q);
                let err = got
                    .iter()
                    .zip(&want)
                    .map(|(&a, &b)| (f64::from(a) - b).abs())
                    .fold(0.0, f64::max);
                assert!(err < 2e-5, "{sh:?} {store:?} {level:?}: max error {err}");
            }
        }
    }
}

#[test]
fn every_level_gives_the_same_bits_k12() {
    let mut rng = StdRng::seed_from_u64(11);
    // Groups of 3 (three heads a pass), 2, 5 (two pairs, then the odd head
    // paired with the next row's) and 1 (rows paired).
    for sh in [
        shape(9, 3, 64, 16),
        shape(4, 2, 32, 7),
        shape(2, 1, 16, 64),
        shape(5, 1, 32, 16),
        shape(4, 4, 32, 16),
    ] {
        let c = case(
            &mut rng,
            sh,
            &[1300, 9],
            vec![
                (0, 1299),
                (0, 1298),
                (0, 600),
                (0, 601),
                (0, 5),
                (1, 8),
                (1, 0),
            ],
        );
        let p = paged(&c.seqs, sh.kv_width(), sh.page_size);
        let rows = attn_rows(&c, &p);
        for store in stores(sh) {
            let pages = p.pages(store);
            let want = bits(&run(KernelLevel::Scalar, 1, sh, &pages, &rows, &c.q));
            for level in levels() {
                for threads in [1, 2, 3] {
                    let got = bits(&run(level, threads, sh, &pages, &rows, &c.q));
                    assert!(got == want, "{sh:?} {store:?} {level:?} threads {threads}");
                }
            }
        }
    }
}

#[test]
fn a_rows_output_does_not_depend_on_the_rows_beside_it_k12() {
    // A prompt's rows computed in one batch (blocks of 8 rows), in other
    // chunkings, and one by one, give the same bits.
    let mut rng = StdRng::seed_from_u64(3);
    let sh = shape(9, 3, 64, 16);
    let len = 1100;
    let c = case(&mut rng, sh, &[len], (0..len).map(|p| (0, p)).collect());
    let p = paged(&c.seqs, sh.kv_width(), sh.page_size);
    let rows = attn_rows(&c, &p);
    let pages = p.pages(Store::F16);
    let dim = sh.n_head * sh.head_dim;
    let level = KernelLevel::active();
    let whole = bits(&run(level, 2, sh, &pages, &rows, &c.q));
    for step in [1, 3, 8, 13, 512] {
        let mut got = Vec::new();
        let mut start = 0;
        while start < len {
            let end = (start + step).min(len);
            got.extend(bits(&run(
                level,
                2,
                sh,
                &pages,
                &rows[start..end],
                &c.q[start * dim..end * dim],
            )));
            start = end;
        }
        assert!(got == whole, "chunks of {step}");
    }
    // Interleaved with another sequence's rows (other blocks).
    let c2 = case(
        &mut rng,
        sh,
        &[len, 30],
        vec![(0, 1000), (1, 29), (0, 1001)],
    );
    let p2 = paged(&c2.seqs, sh.kv_width(), sh.page_size);
    let rows2 = attn_rows(&c2, &p2);
    let pages2 = p2.pages(Store::Q8);
    let mixed = bits(&run(level, 2, sh, &pages2, &rows2, &c2.q));
    for (i, r) in rows2.iter().enumerate() {
        let alone = bits(&run(
            level,
            1,
            sh,
            &pages2,
            std::slice::from_ref(r),
            &c2.q[i * dim..(i + 1) * dim],
        ));
        assert!(alone[..] == mixed[i * dim..(i + 1) * dim], "row {i}");
    }
}

/// `cargo test --release -p kernels tile_update_speed -- --ignored --nocapture`:
/// one KV group of three heads over one 64-key tile in L1, many times (the
/// kernel's compute rate without memory), per level and storage type.
#[test]
#[ignore]
fn tile_update_speed() {
    let hd = 64;
    let mut rng = StdRng::seed_from_u64(1);
    let kf: Vec<f32> = (0..TILE * hd).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let vf: Vec<f32> = (0..TILE * hd).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let kh: Vec<f16> = kf.iter().map(|&x| f16::from_f32(x)).collect();
    let vh: Vec<f16> = vf.iter().map(|&x| f16::from_f32(x)).collect();
    let (k8, v8) = (q8(&kf), q8(&vf));
    let q: Vec<f32> = (0..3 * hd).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let mut st = vec![0.0f32; 3 * (hd + 2)];
    let reps = 100_000;
    for (dt, kb, vb, row) in [
        (tile::F32, bytemuck_f32(&kf), bytemuck_f32(&vf), hd * 4),
        (
            tile::F16,
            rows_bytes(&KvRows::F16(&kh)),
            rows_bytes(&KvRows::F16(&vh)),
            hd * 2,
        ),
        (tile::Q8, &k8[..], &v8[..], hd / 32 * 34),
    ] {
        // SAFETY: three heads of hd values.
        let q8s: Vec<tile::Q8Query> = (0..3)
            .map(|h| unsafe { tile::quantize_query(q[h * hd..].as_ptr(), hd) })
            .collect();
        let kr: Vec<*const u8> = (0..TILE).map(|i| kb[i * row..].as_ptr()).collect();
        let vr: Vec<*const u8> = (0..TILE).map(|i| vb[i * row..].as_ptr()).collect();
        for level in levels() {
            for h in 0..3 {
                st[h * (hd + 2)] = f32::NEG_INFINITY;
            }
            let sp = st.as_mut_ptr();
            let qp = q.as_ptr();
            // SAFETY: levels() holds only levels this CPU runs; every
            // pointer covers hd values (states hd + 2).
            let pass = unsafe {
                tile::Pass::<3> {
                    q: [qp, qp.add(hd), qp.add(2 * hd)],
                    st: [sp, sp.add(hd + 2), sp.add(2 * (hd + 2))],
                    k: &kr,
                    v: &vr,
                    ahead: tile::Ahead {
                        k: &[],
                        v: &[],
                        bytes: 0,
                    },
                    q8: [&q8s[0] as *const _, &q8s[1], &q8s[2]],
                    hd,
                    scale: 0.125,
                }
            };
            let start = std::time::Instant::now();
            for _ in 0..reps {
                // SAFETY: as above.
                unsafe { tile::run::<3>(level, dt, dt, &pass) };
            }
            let ns = start.elapsed().as_secs_f64() * 1e9 / reps as f64;
            println!(
                "{level:?} type {dt}: {ns:.0} ns per 3-head 64-key tile, {:.1} ns per key",
                ns / TILE as f64
            );
        }
    }
}

#[test]
fn the_page_size_does_not_change_a_bit_k12() {
    // Tiles and chunks are fixed by position, so the same K/V in pages of
    // 16, 7 or 300 slots gives the same output.
    let mut rng = StdRng::seed_from_u64(5);
    let base = shape(9, 3, 64, 16);
    let c = case(
        &mut rng,
        base,
        &[700],
        vec![(0, 699), (0, 300), (0, 63), (0, 64)],
    );
    let mut want: [Option<Vec<u32>>; 3] = [None, None, None];
    for ps in [16, 7, 300, 1] {
        let sh = AttnShape {
            page_size: ps,
            ..base
        };
        let p = paged(&c.seqs, sh.kv_width(), ps);
        let rows = attn_rows(&c, &p);
        for (i, store) in stores(sh).into_iter().enumerate() {
            let got = bits(&run(
                KernelLevel::active(),
                2,
                sh,
                &p.pages(store),
                &rows,
                &c.q,
            ));
            match &want[i] {
                None => want[i] = Some(got),
                Some(w) => assert!(*w == got, "page size {ps}, {store:?}"),
            }
        }
    }
}

/// Sliding windows (Gemma 3's local layers): a row attends to its last `w`
/// positions only — against the f64 softmax over exactly those, with
/// windows inside a tile, across tiles and chunks, wider than the sequence,
/// and of one position; and every level, thread count and batch gives the
/// same bits (K12).
#[test]
fn sliding_windows_attend_to_the_last_w_positions_only() {
    let mut rng = StdRng::seed_from_u64(23);
    for (base, window, lens) in [
        (shape(4, 1, 32, 16), 512, vec![1300, 20]),
        (shape(4, 1, 32, 16), 70, vec![700]),
        (shape(9, 3, 64, 16), 5, vec![300]),
        (shape(2, 2, 16, 7), 1, vec![90]),
        (shape(2, 1, 16, 512), 300, vec![900]),
        (shape(4, 1, 32, 16), 4096, vec![600]),
    ] {
        let sh = AttnShape {
            window: Some(window),
            ..base
        };
        let rows: Vec<(usize, usize)> = lens
            .iter()
            .enumerate()
            .flat_map(|(s, &l)| [(s, 0), (s, l / 2), (s, l - 1)])
            .chain((0..lens[0].min(20)).map(|p| (0, lens[0] - 20 + p)))
            .chain([
                (0, window.min(lens[0] - 1)),
                (0, (window + 63).min(lens[0] - 1)),
            ])
            .collect();
        let c = case(&mut rng, sh, &lens, rows);
        let p = paged(&c.seqs, sh.kv_width(), sh.page_size);
        let rows = attn_rows(&c, &p);
        for store in stores(sh) {
            let pages = p.pages(store);
            let want = naive(sh, &p, store, &rows, &c.q);
            let reference = bits(&run(KernelLevel::Scalar, 1, sh, &pages, &rows, &c.q));
            for level in levels() {
                for threads in [1, 2] {
                    let got = run(level, threads, sh, &pages, &rows, &c.q);
                    let err = got
                        .iter()
                        .zip(&want)
                        .map(|(&a, &b)| (f64::from(a) - b).abs())
                        .fold(0.0, f64::max);
                    assert!(err < 2e-5, "{sh:?} {store:?} {level:?}: max error {err}");
                    assert!(
                        bits(&got) == reference,
                        "{sh:?} {store:?} {level:?} threads {threads}"
                    );
                }
            }
            // One row at a time gives the bits of the batch.
            let dim = sh.n_head * sh.head_dim;
            for (i, r) in rows.iter().enumerate() {
                let one = run(
                    KernelLevel::active(),
                    2,
                    sh,
                    &pages,
                    std::slice::from_ref(r),
                    &c.q[i * dim..(i + 1) * dim],
                );
                assert!(
                    bits(&one) == reference[i * dim..(i + 1) * dim],
                    "{sh:?} row {i} alone"
                );
            }
        }
    }
}

#[test]
fn q8_0_codes_of_every_value_give_the_same_bits_at_every_level_k12() {
    // Pages of q8_0 codes over the whole i8 range (−128 included, which
    // the quantiser never writes but a page could hold), one row and a
    // block of rows, every level and thread count: the integer dot
    // products are exact, so the bits agree.
    let mut rng = StdRng::seed_from_u64(11);
    let sh = shape(9, 3, 64, 16);
    let kvw = sh.kv_width();
    let len: usize = 300;
    let pages_n = len.div_ceil(16);
    let block = |rng: &mut StdRng| {
        let mut b = f16::from_f32(rng.gen_range(0.001f32..0.05))
            .to_le_bytes()
            .to_vec();
        b.extend((0..Q8_BLOCK).map(|_| rng.gen_range(-128i32..=127) as i8 as u8));
        b
    };
    let bytes = |rng: &mut StdRng| -> Vec<u8> {
        (0..16 * kvw / Q8_BLOCK).flat_map(|_| block(rng)).collect()
    };
    let ks: Vec<Vec<u8>> = (0..pages_n).map(|_| bytes(&mut rng)).collect();
    let vs: Vec<Vec<u8>> = (0..pages_n).map(|_| bytes(&mut rng)).collect();
    let pages: Vec<KvPage<'_>> = (0..pages_n)
        .map(|i| KvPage {
            k: KvRows::Q8_0(&ks[i]),
            v: KvRows::Q8_0(&vs[i]),
            slots: 16.min(len - 16 * i),
        })
        .collect();
    let rows: Vec<AttnRow> = [299, 17, 200, 201, 202, 203]
        .iter()
        .map(|&pos| AttnRow {
            pos,
            pages: 0..pages_n,
        })
        .collect();
    let q: Vec<f32> = (0..rows.len() * 9 * 64)
        .map(|_| rng.gen_range(-3.0f32..3.0))
        .collect();
    let want = bits(&run(KernelLevel::Scalar, 1, sh, &pages, &rows, &q));
    assert!(want.iter().all(|&b| f32::from_bits(b).is_finite()));
    for level in levels() {
        for threads in [1, 2, 3] {
            let got = bits(&run(level, threads, sh, &pages, &rows, &q));
            assert!(got == want, "{level:?} threads {threads}");
            // One row alone gives its bits in the block too.
            let one = bits(&run(level, threads, sh, &pages, &rows[..1], &q[..9 * 64]));
            assert!(one[..] == want[..9 * 64], "{level:?} alone");
        }
    }
}
