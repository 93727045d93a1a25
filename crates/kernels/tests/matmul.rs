//! Correctness and determinism tests of the quantised matmul kernels.

use kernels::{
    dequantize_row, matmul_f32_with_level, matmul_with_level, quantize_row, reference_dot,
    ActForms, KernelLevel, QuantizedActivations, ThreadPool, WeightMatrix, WeightType,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const QTYPES: [WeightType; 8] = [
    WeightType::Q4_0,
    WeightType::Q4_1,
    WeightType::Q5_0,
    WeightType::Q5_1,
    WeightType::Q8_0,
    WeightType::Q4_K,
    WeightType::Q5_K,
    WeightType::Q6_K,
];

/// A format added to `WeightType::ALL` is tested here too.
#[test]
fn qtypes_are_every_quantised_type() {
    let all: Vec<WeightType> = WeightType::ALL
        .into_iter()
        .filter(|t| t.is_quantized())
        .collect();
    assert_eq!(QTYPES.to_vec(), all);
}

/// `cols` if `ty` can have rows of that length, else the next multiple of
/// its block (K-quant super-blocks are 256 weights).
fn fit(ty: WeightType, cols: usize) -> usize {
    cols.next_multiple_of(ty.block_len())
}

fn f16b(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// Random raw bytes of a `rows × cols` matrix: random scales and codes
/// (covering the full code ranges, including -128 for Q8_0).
fn random_weights(rng: &mut StdRng, ty: WeightType, rows: usize, cols: usize) -> Vec<u8> {
    let mut b = Vec::with_capacity(rows * ty.row_bytes(cols));
    match ty {
        WeightType::F32 | WeightType::F16 => {
            let x: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
            for r in x.chunks(cols.max(1)) {
                quantize_row(ty, r, &mut b);
            }
        }
        _ => {
            let bytes = |rng: &mut StdRng, b: &mut Vec<u8>, k: usize| {
                b.extend((0..k).map(|_| rng.gen::<u8>()));
            };
            for _ in 0..rows * cols / ty.block_len() {
                let d: f32 = rng.gen_range(0.0005..0.05) * if rng.gen() { 1.0 } else { -1.0 };
                let dk: f32 = rng.gen_range(0.00001..0.002);
                match ty {
                    WeightType::Q4_0 | WeightType::Q4_1 | WeightType::Q5_0 | WeightType::Q5_1 => {
                        b.extend_from_slice(&f16b(d));
                        if matches!(ty, WeightType::Q4_1 | WeightType::Q5_1) {
                            b.extend_from_slice(&f16b(rng.gen_range(-0.4..0.1)));
                        }
                        let qh = if matches!(ty, WeightType::Q5_0 | WeightType::Q5_1) {
                            4
                        } else {
                            0
                        };
                        bytes(rng, &mut b, qh + 16);
                    }
                    WeightType::Q8_0 => {
                        b.extend_from_slice(&f16b(d));
                        bytes(rng, &mut b, 32);
                    }
                    WeightType::Q4_K | WeightType::Q5_K => {
                        b.extend_from_slice(&f16b(dk));
                        b.extend_from_slice(&f16b(dk * rng.gen_range(0.0..4.0)));
                        let qh = if ty == WeightType::Q5_K { 32 } else { 0 };
                        bytes(rng, &mut b, 12 + qh + 128);
                    }
                    WeightType::Q6_K => {
                        bytes(rng, &mut b, 128 + 64 + 16);
                        b.extend_from_slice(&f16b(d / 64.0));
                    }
                    WeightType::F32 | WeightType::F16 => unreachable!(),
                }
            }
        }
    }
    b
}

/// Activation-like values: mostly small, a few outliers, some exact zeros.
fn random_acts(rng: &mut StdRng, n: usize, cols: usize) -> Vec<f32> {
    (0..n * cols)
        .map(|_| match rng.gen_range(0..100) {
            0 => rng.gen_range(-30.0..30.0),
            1 => 0.0,
            _ => rng.gen_range(-2.0..2.0),
        })
        .collect()
}

fn run(level: KernelLevel, pool: &ThreadPool, w: WeightMatrix<'_>, x: &[f32]) -> Vec<f32> {
    let mut q = QuantizedActivations::new(1, w.cols);
    q.quantize_with_level(level, x, w.cols);
    let mut out = vec![f32::NAN; q.n_rows() * w.rows];
    matmul_with_level(pool, level, w, &q, &mut out);
    out
}

fn levels() -> Vec<KernelLevel> {
    KernelLevel::supported().collect()
}

fn assert_bits_eq(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            x.to_bits() == y.to_bits(),
            "{what}: element {k} differs: {x:e} vs {y:e}"
        );
    }
}

#[test]
fn scalar_matches_dequantized_reference() {
    let mut rng = StdRng::seed_from_u64(1);
    let pool = ThreadPool::new(1);
    for ty in QTYPES {
        for &(rows, cols) in &[(7, 32), (5, 96), (9, 576), (4, 1536)] {
            let cols = fit(ty, cols);
            let wb = random_weights(&mut rng, ty, rows, cols);
            let w = WeightMatrix::new(ty, &wb, rows, cols).unwrap();
            let n = 3;
            let x = random_acts(&mut rng, n, cols);
            let out = run(KernelLevel::Scalar, &pool, w, &x);
            let mut q = QuantizedActivations::new(n, cols);
            q.quantize_with_level(KernelLevel::Scalar, &x, cols);
            let mut wf = vec![0.0f32; cols];
            let mut xdq = vec![0.0f32; cols];
            for i in 0..n {
                q.dequantize_row_for(ty, i, &mut xdq);
                let xi = &x[i * cols..(i + 1) * cols];
                for r in 0..rows {
                    w.dequantize_row(r, &mut wf);
                    let got = out[i * rows + r] as f64;
                    // (1) Same math on the dequantised activations: only f32
                    // rounding of the block accumulation differs.
                    let exact = reference_dot(ty, w.row(r), &xdq);
                    let mag: f64 = wf.iter().zip(&xdq).map(|(a, b)| (a * b).abs() as f64).sum();
                    assert!(
                        (got - exact).abs() <= 2e-6 * mag + 1e-6,
                        "{ty:?} {rows}x{cols} row {r} act {i}: {got} vs {exact} (mag {mag})"
                    );
                    // (2) Against the unquantised activations: bounded by the
                    // activation quantisation error |x - d q| <= d/2.
                    let truth = reference_dot(ty, w.row(r), xi);
                    // (K-quants read the 256-column form: one d per 256.)
                    let dx = |j: usize| {
                        if ty.is_k_quant() {
                            q.row_k(i).d[j / 256]
                        } else {
                            q.row(i).d[j / 32]
                        }
                    };
                    let bound: f64 = (0..cols)
                        .map(|j| wf[j].abs() as f64 * dx(j) as f64 * 0.5)
                        .sum();
                    assert!(
                        (got - truth).abs() <= bound * 1.01 + 2e-6 * mag + 1e-6,
                        "{ty:?} quantisation error too large: {got} vs {truth} (bound {bound})"
                    );
                }
            }
        }
    }
}

/// Every SIMD level reproduces the scalar reference bit for bit (a stronger
/// property than the required "within tolerance"), on odd shapes.
#[test]
fn levels_match_scalar_on_odd_shapes() {
    let mut rng = StdRng::seed_from_u64(2);
    let pool = ThreadPool::new(2);
    let simd: Vec<_> = levels()
        .into_iter()
        .filter(|&l| l != KernelLevel::Scalar)
        .collect();
    if simd.is_empty() {
        eprintln!("no SIMD level on this CPU; nothing to compare");
    }
    let ns: Vec<usize> = (1..=9).chain([33]).collect();
    for ty in QTYPES {
        for &rows in &[1usize, 3, 17, 33, 577] {
            for &cols in &[32usize, 64, 96, 256, 576, 1536, 2304] {
                if cols % ty.block_len() != 0 {
                    continue;
                }
                let wb = random_weights(&mut rng, ty, rows, cols);
                let w = WeightMatrix::new(ty, &wb, rows, cols).unwrap();
                for &n in &ns {
                    if rows * cols * n > 577 * 1536 * 9 && n != 33 {
                        continue; // keep the run short: largest shape at n ≤ 9 and 33
                    }
                    let x = random_acts(&mut rng, n, cols);
                    let want = run(KernelLevel::Scalar, &pool, w, &x);
                    for &l in &simd {
                        let got = run(l, &pool, w, &x);
                        assert_bits_eq(
                            &got,
                            &want,
                            &format!("{ty:?} {l:?} rows {rows} cols {cols} n {n}"),
                        );
                    }
                }
            }
        }
    }
}

/// Codes and activations at their extremes, arranged so that the i16 sums
/// of the AVX2 tile reach their bounds: Q4_0/Q5_0 codes 0 or the maximum,
/// activations ±127, split by column mod 4 (the two i16 halves of a
/// `maddubs` dword). Catches an overflow or a wrong split of the offsets.
#[test]
fn extreme_codes_and_activations_match_scalar() {
    let pool = ThreadPool::new(1);
    let cols = 64;
    let pats: [fn(usize) -> bool; 4] = [|_| true, |_| false, |j| j % 4 < 2, |j| j % 4 >= 2];
    for ty in [
        WeightType::Q4_0,
        WeightType::Q5_0,
        WeightType::Q5_1,
        WeightType::Q4_1,
    ] {
        let mut wb = Vec::new();
        for hi in pats {
            for b in 0..cols / 32 {
                let _ = b;
                let code = |j: usize| {
                    if hi(j) {
                        if matches!(ty, WeightType::Q4_0 | WeightType::Q4_1) {
                            15u8
                        } else {
                            31
                        }
                    } else {
                        0
                    }
                };
                wb.extend(f16b(1.0));
                if matches!(ty, WeightType::Q4_1 | WeightType::Q5_1) {
                    wb.extend(f16b(-0.5));
                }
                if matches!(ty, WeightType::Q5_0 | WeightType::Q5_1) {
                    let qh: u32 = (0..32).filter(|&j| code(j) >= 16).map(|j| 1u32 << j).sum();
                    wb.extend(qh.to_le_bytes());
                }
                wb.extend((0..16).map(|i| (code(i) & 15) | (code(i + 16) & 15) << 4));
            }
        }
        let w = WeightMatrix::new(ty, &wb, pats.len(), cols).unwrap();
        let mut x = Vec::new();
        for pos in pats {
            x.extend((0..cols).map(|j| if pos(j) { 1.0f32 } else { -1.0 }));
        }
        let want = run(KernelLevel::Scalar, &pool, w, &x);
        for l in levels() {
            assert_bits_eq(&run(l, &pool, w, &x), &want, &format!("{ty:?} {l:?}"));
        }
        // And the scalar result is the exact dot product (d = 1, |x| = 127 d_x).
        let mut q = QuantizedActivations::new(4, cols);
        q.quantize(&x, cols);
        for (i, xi) in x.chunks(cols).enumerate() {
            let mut xdq = vec![0.0; cols];
            q.dequantize_row(i, &mut xdq);
            assert!(xdq.iter().zip(xi).all(|(a, b)| a == b));
            for r in 0..pats.len() {
                let exact = reference_dot(ty, w.row(r), xi);
                assert_eq!(
                    want[i * pats.len() + r] as f64,
                    exact,
                    "{ty:?} row {r} act {i}"
                );
            }
        }
    }
}

/// K-quant super-blocks at their extremes: every code at its maximum or
/// minimum (Q6_K: q − 32 = 31 or −32), the largest scales (6-bit 63; Q6_K's
/// i8 127 and −128), activations ±127 in patterns that split the `maddubs`
/// pairs. The SIMD kernels' i16 pair sums then reach their bounds (Q6_K's
/// `maddubs(q, x) − maddubs(32, x)` too); a saturation or a wrong scale
/// lane would part from the scalar reference's exact integer sums.
#[test]
fn extreme_k_quant_codes_and_scales_match_scalar() {
    let pool = ThreadPool::new(2);
    let cols = 512;
    let pats: [fn(usize) -> bool; 4] = [|_| true, |_| false, |j| j % 4 < 2, |j| j % 2 == 0];
    for ty in [WeightType::Q4_K, WeightType::Q5_K, WeightType::Q6_K] {
        let mut wb = Vec::new();
        let mut rows = 0;
        for high in [true, false] {
            for sc in [0xFFu8, 0x80, 0x7F] {
                rows += 1;
                for _ in 0..cols / 256 {
                    let code = if high { 0xFF } else { 0x00 };
                    match ty {
                        WeightType::Q6_K => {
                            wb.extend([code; 128]); // ql
                            wb.extend([code; 64]); // qh
                            wb.extend([sc; 16]); // i8 scales
                            wb.extend(f16b(1.0));
                        }
                        _ => {
                            wb.extend(f16b(1.0));
                            wb.extend(f16b(0.5));
                            wb.extend([sc; 12]); // 6-bit scales and mins
                            if ty == WeightType::Q5_K {
                                wb.extend([code; 32]); // qh
                            }
                            wb.extend([code; 128]);
                        }
                    }
                }
            }
        }
        let w = WeightMatrix::new(ty, &wb, rows, cols).unwrap();
        for n in 1..=5 {
            let mut x = Vec::new();
            for i in 0..n {
                let pos = pats[i % pats.len()];
                x.extend((0..cols).map(|j| if pos(j) { 1.0f32 } else { -1.0 }));
            }
            let want = run(KernelLevel::Scalar, &pool, w, &x);
            for l in levels() {
                assert_bits_eq(&run(l, &pool, w, &x), &want, &format!("{ty:?} {l:?} n {n}"));
            }
        }
    }
}

/// Rows longer than one expansion chunk (65 blocks: chunks of 36 + 29 with a
/// trailing single block) and a weight matrix smaller than one panel.
#[test]
fn levels_match_scalar_on_long_rows() {
    let mut rng = StdRng::seed_from_u64(6);
    let pool = ThreadPool::new(2);
    for ty in QTYPES {
        for &(rows, cols) in &[(40usize, 2080usize), (5, 4096)] {
            let cols = fit(ty, cols);
            let wb = random_weights(&mut rng, ty, rows, cols);
            let w = WeightMatrix::new(ty, &wb, rows, cols).unwrap();
            for n in [1usize, 2, 5] {
                let x = random_acts(&mut rng, n, cols);
                let want = run(KernelLevel::Scalar, &pool, w, &x);
                for l in levels() {
                    let got = run(l, &pool, w, &x);
                    assert_bits_eq(&got, &want, &format!("{ty:?} {l:?} {rows}x{cols} n {n}"));
                }
            }
        }
    }
}

/// K12: a row's output does not depend on the batch it is in, its position
/// or the number of threads.
#[test]
fn batch_invariance_is_bitwise() {
    let mut rng = StdRng::seed_from_u64(3);
    let pools: Vec<ThreadPool> = [1, 2, 3, 4].into_iter().map(ThreadPool::new).collect();
    for level in levels() {
        for ty in QTYPES {
            let (rows, cols) = if level == KernelLevel::Scalar {
                (37, fit(ty, 576))
            } else {
                (577, fit(ty, 576))
            };
            let wb = random_weights(&mut rng, ty, rows, cols);
            let w = WeightMatrix::new(ty, &wb, rows, cols).unwrap();
            let row = random_acts(&mut rng, 1, cols);
            let alone = run(level, &pools[0], w, &row);
            for &n in &[1usize, 2, 3, 7, 16, 33] {
                let mut positions = vec![0, n / 2, n - 1];
                positions.dedup();
                for &pos in &positions {
                    let mut x = random_acts(&mut rng, n, cols);
                    x[pos * cols..(pos + 1) * cols].copy_from_slice(&row);
                    for pool in &pools {
                        let out = run(level, pool, w, &x);
                        assert_bits_eq(
                            &out[pos * rows..(pos + 1) * rows],
                            &alone,
                            &format!(
                                "{level:?} {ty:?} n {n} pos {pos} threads {}",
                                pool.n_threads()
                            ),
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn quantization_properties() {
    let mut rng = StdRng::seed_from_u64(4);
    let cols = 96;
    let mut x = random_acts(&mut rng, 5, cols);
    x[32..64].fill(0.0); // an all-zero block
    let mut want: Option<QuantizedActivations> = None;
    for level in levels() {
        let mut q = QuantizedActivations::new(5, cols);
        q.quantize_with_level(level, &x, cols);
        assert_eq!(q.n_rows(), 5);
        let mut dq = vec![0.0; cols];
        for i in 0..5 {
            let r = q.row(i);
            q.dequantize_row(i, &mut dq);
            for b in 0..cols / 32 {
                let blk = &r.qs[b * 32..(b + 1) * 32];
                assert_eq!(r.sums[b], blk.iter().map(|&v| v as i32).sum::<i32>());
                assert_eq!(r.s[b], r.d[b] * r.sums[b] as f32);
                // The offset pair: −16 × the codes at columns ≡ 0,1 and
                // ≡ 2,3 (mod 4), as two i16.
                let p = |m: usize| -> i16 {
                    let s: i32 = (0..32)
                        .filter(|j| j % 4 / 2 == m)
                        .map(|j| blk[j] as i32)
                        .sum();
                    (-16 * s) as i16
                };
                let o = q.row_offsets(i)[b];
                assert_eq!(
                    (o as i16, (o >> 16) as i16),
                    (p(0), p(1)),
                    "{level:?} offsets"
                );
                assert!(blk.iter().all(|&v| v >= -127));
                let amax = x[i * cols + b * 32..i * cols + b * 32 + 32]
                    .iter()
                    .fold(0.0f32, |a, v| a.max(v.abs()));
                assert_eq!(r.d[b], amax / 127.0);
            }
            for j in 0..cols {
                let err = (dq[j] - x[i * cols + j]).abs();
                assert!(
                    err <= r.d[j / 32] * 0.5001 + 1e-12,
                    "quantisation error {err}"
                );
            }
        }
        assert!(q.row(0).d[1] == 0.0 && q.row(0).qs[32..64].iter().all(|&v| v == 0));
        // Parallel quantisation gives the same result.
        let pool = ThreadPool::new(3);
        let big = random_acts(&mut StdRng::seed_from_u64(44), 700, cols);
        let mut a = QuantizedActivations::new(0, cols);
        let mut b = QuantizedActivations::new(0, cols);
        a.quantize_with_level(level, &big, cols);
        b.quantize_par_with_level(&pool, level, &big, cols);
        for i in 0..700 {
            assert_eq!(a.row(i).qs, b.row(i).qs);
            assert_eq!(a.row(i).d, b.row(i).d);
            assert_eq!(a.row(i).s, b.row(i).s);
            assert_eq!(a.row(i).sums, b.row(i).sums);
            assert_eq!(a.row_offsets(i), b.row_offsets(i));
        }
        // Identical at every level.
        if let Some(w) = &want {
            for i in 0..5 {
                assert_eq!(w.row(i).qs, q.row(i).qs);
                assert_eq!(w.row(i).d, q.row(i).d);
            }
        } else {
            want = Some(q);
        }
    }
}

#[test]
fn quantization_levels_agree_on_edge_cases() {
    let cols = 32 * 6;
    let mut x = vec![0.0f32; cols];
    // Block 0: subnormal values (1/d overflows to inf); block 1: NaN and inf;
    // block 2: -0.0 and exact ties; block 3: huge values; block 4: one
    // nonzero; block 5: alternating signs.
    for j in 0..32 {
        x[j] = if j % 3 == 0 { 1e-40 } else { -3e-41 };
        x[32 + j] = j as f32 - 10.0;
        x[64 + j] = if j % 2 == 0 {
            -0.0
        } else {
            (j as f32 - 15.5) * 127.0 / 16.5
        };
        x[96 + j] = (j as f32 - 16.0) * 1e37;
        x[160 + j] = if j % 2 == 0 { 0.5 } else { -0.5 };
    }
    x[32 + 3] = f32::NAN;
    x[32 + 4] = f32::INFINITY;
    x[64 + 31] = 16.5 * 127.0 / 16.5; // amax; other entries give .5 ties
    x[128 + 7] = -2.5;
    let mut want = QuantizedActivations::new(1, cols);
    want.quantize_with_level(KernelLevel::Scalar, &x, cols);
    for level in levels() {
        let mut q = QuantizedActivations::new(1, cols);
        q.quantize_with_level(level, &x, cols);
        let (a, b) = (q.row(0), want.row(0));
        assert_eq!(a.qs, b.qs, "{level:?} codes");
        assert_eq!(a.sums, b.sums, "{level:?} sums");
        assert_eq!(q.row_offsets(0), want.row_offsets(0), "{level:?} offsets");
        for (u, v) in a.d.iter().zip(b.d).chain(a.s.iter().zip(b.s)) {
            assert_eq!(u.to_bits(), v.to_bits(), "{level:?} scales");
        }
    }
}

/// The 256-column form (K-quant activations): one `d = amax/127` per 256
/// columns, codes within ±127 and their per-32 sums, the dequantisation
/// error within d/2, the same at every level and in parallel.
#[test]
fn quantization_k_form_properties() {
    let mut rng = StdRng::seed_from_u64(14);
    let cols = 512;
    let n = 5;
    let mut x = random_acts(&mut rng, n, cols);
    x[256..512].fill(0.0); // an all-zero super-block
    x[cols + 7] = f32::NAN; // NaN is ignored by amax and quantised to 0
    x[2 * cols + 300] = 1e-40; // a subnormal super-block maximum (1/d = inf)
    for j in 256..512 {
        if j != 300 {
            x[2 * cols + j] = -3e-41;
        }
    }
    let mut want: Option<QuantizedActivations> = None;
    let pool = ThreadPool::new(3);
    for level in levels() {
        let mut q = QuantizedActivations::new(n, cols);
        q.quantize_with_level(level, &x, cols);
        let mut dq = vec![0.0; cols];
        for i in 0..n {
            let r = q.row_k(i);
            q.dequantize_row_for(WeightType::Q4_K, i, &mut dq);
            for sb in 0..cols / 256 {
                let xs = &x[i * cols + sb * 256..i * cols + sb * 256 + 256];
                let amax = xs.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                assert_eq!(r.d[sb], amax / 127.0, "{level:?} row {i} super-block {sb}");
            }
            for b in 0..cols / 32 {
                let blk = &r.qs[b * 32..(b + 1) * 32];
                assert!(blk.iter().all(|&v| v >= -127));
                assert_eq!(r.sums[b] as i32, blk.iter().map(|&v| v as i32).sum::<i32>());
            }
            for j in 0..cols {
                let v = x[i * cols + j];
                if v.is_finite() && r.d[j / 256].is_normal() {
                    let err = (dq[j] - v).abs();
                    assert!(err <= r.d[j / 256] * 0.5001 + 1e-12, "error {err}");
                }
            }
        }
        assert!(q.row_k(0).d[1] == 0.0 && q.row_k(0).qs[256..].iter().all(|&v| v == 0));
        assert_eq!(q.row_k(1).qs[7], 0, "NaN → 0");
        // Parallel quantisation gives the same result.
        let big = random_acts(&mut StdRng::seed_from_u64(45), 300, cols);
        let (mut a, mut b) = (
            QuantizedActivations::new(0, cols),
            QuantizedActivations::new(0, cols),
        );
        a.quantize_with_level(level, &big, cols);
        b.quantize_par_with_level(&pool, level, &big, cols);
        for i in 0..300 {
            let (u, v) = (a.row_k(i), b.row_k(i));
            assert_eq!((u.qs, u.sums), (v.qs, v.sums));
            assert_eq!(u.d, v.d);
        }
        // Identical at every level, bit for bit.
        if let Some(w) = &want {
            for i in 0..n {
                let (u, v) = (w.row_k(i), q.row_k(i));
                assert_eq!((u.qs, u.sums), (v.qs, v.sums), "{level:?}");
                for (a, b) in u.d.iter().zip(v.d) {
                    assert_eq!(a.to_bits(), b.to_bits(), "{level:?}");
                }
            }
        } else {
            want = Some(q);
        }
    }
}

/// Each buffer computes only the forms it is set to; a matmul whose weights
/// need a form that was not computed is refused with the form's name, and
/// columns that are not a multiple of 256 have no 256-column form.
#[test]
fn forms_are_computed_as_set() {
    let cols = 256;
    let x = vec![0.5f32; 2 * cols];
    let mut q = QuantizedActivations::new(2, cols);
    q.quantize(&x, cols);
    assert!(q.has_form_for(WeightType::Q4_0) && q.has_form_for(WeightType::Q6_K));
    q.set_forms(ActForms::for_weights([WeightType::Q6_K, WeightType::F32]));
    q.quantize(&x, cols);
    assert!(!q.has_form_for(WeightType::Q4_0) && q.has_form_for(WeightType::Q4_K));
    q.set_forms(ActForms::for_weights([WeightType::Q8_0]));
    q.quantize(&x, cols);
    assert!(q.has_form_for(WeightType::Q8_0) && !q.has_form_for(WeightType::Q5_K));
    let wb = vec![0u8; WeightType::Q4_K.row_bytes(cols)];
    let w = WeightMatrix::new(WeightType::Q4_K, &wb, 1, cols).unwrap();
    let mut out = vec![0.0; 2];
    let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        matmul_with_level(&ThreadPool::new(1), KernelLevel::Scalar, w, &q, &mut out)
    }))
    .unwrap_err();
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("Q4_K") && msg.contains("256-column"), "{msg}");
    let mut q = QuantizedActivations::new(1, 96);
    q.quantize(&[1.0; 96], 96);
    assert!(q.has_form_for(WeightType::Q4_0) && !q.has_form_for(WeightType::Q4_K));
}

#[test]
fn quantization_reuses_buffers_and_survives_non_finite() {
    let cols = 64;
    let mut q = QuantizedActivations::new(8, cols);
    let cap = q.capacity_rows();
    assert_eq!(cap, 8);
    q.quantize(&vec![0.0; cols], cols);
    let p0 = q.row(0).qs.as_ptr();
    for n in [1, 8, 3, 8] {
        let x = vec![0.25f32; n * cols];
        q.quantize(&x, cols);
        assert_eq!(q.n_rows(), n);
    }
    assert_eq!(q.capacity_rows(), cap);
    assert_eq!(q.row(0).qs.as_ptr(), p0, "buffers were reallocated");
    let mut x = vec![1.0f32; cols];
    x[3] = f32::NAN;
    x[40] = f32::INFINITY;
    q.quantize(&x, cols);
    assert!(q.row(0).qs.iter().all(|&v| (-127..=127).contains(&v)));
    // Growing beyond the capacity is allowed (it reallocates once).
    q.quantize(&vec![0.5f32; 20 * cols], cols);
    assert_eq!(q.n_rows(), 20);
    // The 256-column form is preallocated too.
    let mut q = QuantizedActivations::new(4, 512);
    assert_eq!(q.capacity_rows(), 4);
    q.quantize(&vec![0.0; 512], 512);
    let p0 = q.row_k(0).qs.as_ptr();
    for n in [4, 1, 4] {
        q.quantize(&vec![0.25f32; n * 512], 512);
    }
    assert_eq!(q.row_k(0).qs.as_ptr(), p0, "K buffers were reallocated");
}

#[test]
fn matmul_f32_matches_reference_and_is_invariant() {
    let mut rng = StdRng::seed_from_u64(5);
    let pools: Vec<ThreadPool> = [1, 3].into_iter().map(ThreadPool::new).collect();
    for ty in [
        WeightType::F32,
        WeightType::F16,
        WeightType::Q4_1,
        WeightType::Q8_0,
        WeightType::Q5_0,
        WeightType::Q4_K,
        WeightType::Q6_K,
    ] {
        let cols = if ty.is_quantized() { fit(ty, 96) } else { 77 };
        let rows = 19;
        let wb = random_weights(&mut rng, ty, rows, cols);
        let w = WeightMatrix::new(ty, &wb, rows, cols).unwrap();
        let n = 11;
        let x = random_acts(&mut rng, n, cols);
        let mut want = vec![0.0; n * rows];
        matmul_f32_with_level(&pools[0], KernelLevel::Scalar, w, &x, &mut want);
        let mut wf = vec![0.0f32; cols];
        for i in 0..n {
            for r in 0..rows {
                dequantize_row(ty, w.row(r), &mut wf);
                let xi = &x[i * cols..(i + 1) * cols];
                let exact = reference_dot(ty, w.row(r), xi);
                let mag: f64 = wf.iter().zip(xi).map(|(a, b)| (a * b).abs() as f64).sum();
                let got = want[i * rows + r] as f64;
                assert!(
                    (got - exact).abs() <= 1e-6 * mag + 1e-7,
                    "{ty:?}: {got} vs {exact}"
                );
            }
        }
        for level in levels() {
            for pool in &pools {
                let mut out = vec![0.0; n * rows];
                matmul_f32_with_level(pool, level, w, &x, &mut out);
                assert_bits_eq(&out, &want, &format!("matmul_f32 {ty:?} {level:?}"));
                // Row 4 alone.
                let mut one = vec![0.0; rows];
                matmul_f32_with_level(pool, level, w, &x[4 * cols..5 * cols], &mut one);
                assert_bits_eq(&one, &want[4 * rows..5 * rows], "matmul_f32 alone");
            }
        }
    }
}

#[test]
fn empty_batches_are_no_ops() {
    let pool = ThreadPool::new(2);
    let wb = vec![0u8; 3 * 20];
    let w = WeightMatrix::new(WeightType::Q4_1, &wb, 3, 32).unwrap();
    let mut q = QuantizedActivations::new(0, 32);
    q.quantize(&[], 32);
    let mut out: Vec<f32> = vec![];
    for level in levels() {
        matmul_with_level(&pool, level, w, &q, &mut out);
    }
}

#[test]
fn weight_matrix_validation() {
    let b = vec![0u8; 40];
    assert!(WeightMatrix::new(WeightType::Q4_1, &b, 2, 32).is_ok());
    assert!(WeightMatrix::new(WeightType::Q4_1, &b, 1, 32).is_err());
    assert!(WeightMatrix::new(WeightType::Q4_1, &b, 2, 33).is_err());
    assert!(WeightMatrix::new(WeightType::F32, &b, 2, 5).is_ok());
    let e = WeightMatrix::new(WeightType::Q8_0, &b, 2, 32).unwrap_err();
    assert!(e.to_string().contains("expected 68"), "{e}");
}

#[test]
#[should_panic(expected = "use matmul_f32")]
fn matmul_rejects_float_weights() {
    let pool = ThreadPool::new(1);
    let b = vec![0u8; 4 * 32];
    let w = WeightMatrix::new(WeightType::F32, &b, 1, 32).unwrap();
    let mut q = QuantizedActivations::new(1, 32);
    q.quantize(&[0.0; 32], 32);
    matmul_with_level(&pool, KernelLevel::Scalar, w, &q, &mut [0.0]);
}

#[test]
#[should_panic(expected = "columns")]
fn matmul_rejects_mismatched_columns() {
    let pool = ThreadPool::new(1);
    let b = vec![0u8; 2 * 20];
    let w = WeightMatrix::new(WeightType::Q4_1, &b, 1, 64).unwrap();
    let mut q = QuantizedActivations::new(1, 32);
    q.quantize(&[0.0; 32], 32);
    matmul_with_level(&pool, KernelLevel::Scalar, w, &q, &mut [0.0]);
}

#[test]
#[should_panic(expected = "out.len()")]
fn matmul_rejects_wrong_output_length() {
    let pool = ThreadPool::new(1);
    let b = vec![0u8; 2 * 20];
    let w = WeightMatrix::new(WeightType::Q4_1, &b, 2, 32).unwrap();
    let mut q = QuantizedActivations::new(1, 32);
    q.quantize(&[0.0; 32], 32);
    matmul_with_level(&pool, KernelLevel::Scalar, w, &q, &mut [0.0]);
}

/// The K-quant dequantisation (through the canonical 32-weight blocks)
/// equals `gguf`'s reference, which is checked against the Python `gguf`
/// package: bit for bit, on random super-blocks.
#[test]
fn k_quant_dequantisation_matches_the_gguf_reference() {
    let mut rng = StdRng::seed_from_u64(11);
    type Reference = fn(&[u8], &mut [f32]);
    let cases: [(WeightType, Reference); 3] = [
        (WeightType::Q4_K, gguf::kquants::dequantize_q4_k),
        (WeightType::Q5_K, gguf::kquants::dequantize_q5_k),
        (WeightType::Q6_K, gguf::kquants::dequantize_q6_k),
    ];
    for (ty, reference) in cases {
        let wb = random_weights(&mut rng, ty, 16, 256);
        let (mut got, mut want) = (vec![0.0f32; 256], vec![0.0f32; 256]);
        for blk in wb.chunks_exact(ty.block_bytes()) {
            dequantize_row(ty, blk, &mut got);
            reference(blk, &mut want);
            assert_bits_eq(&got, &want, ty.name());
        }
    }
}

/// Q5_0/Q5_1: the reference quantiser's codes dequantise to within half a
/// step of the input (the fifth bit is packed and read back correctly).
#[test]
fn q5_quantise_round_trip() {
    let mut rng = StdRng::seed_from_u64(12);
    for ty in [WeightType::Q5_0, WeightType::Q5_1] {
        let x: Vec<f32> = (0..32 * 40).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let mut b = Vec::new();
        quantize_row(ty, &x, &mut b);
        assert_eq!(b.len(), ty.row_bytes(x.len()));
        let mut y = vec![0.0f32; x.len()];
        dequantize_row(ty, &b, &mut y);
        for (blk, (xs, ys)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
            // Q5_0: codes −16..15 of d = −max/16, so the end opposite the
            // largest magnitude can be a whole step off; Q5_1: half a step.
            let (lo, hi) = xs
                .iter()
                .fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
            let (step, frac) = match ty {
                WeightType::Q5_0 => (lo.abs().max(hi.abs()) / 16.0, 1.0),
                _ => ((hi - lo) / 31.0, 0.5),
            };
            for (j, (a, b)) in xs.iter().zip(ys).enumerate() {
                assert!(
                    (a - b).abs() <= step * frac * 1.01 + 1e-3,
                    "{ty:?} block {blk} weight {j}: {a} -> {b} (step {step})"
                );
            }
        }
    }
}

/// The reference quantisers write the blocks llama.cpp's `llama-quantize`
/// wrote for the same weights, bit for bit (fixtures and how they were made:
/// scripts/llama-quantize-fixtures.py). Eight rows of 256: gaussian,
/// heavy-tailed, all positive, partly zero, tiny, an outlier, all negative,
/// all zero.
#[test]
fn quantiser_matches_llama_quantize() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama-quantize");
    let input: Vec<f32> = std::fs::read(dir.join("input.f32"))
        .expect("fixture input.f32")
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    assert_eq!(input.len(), 8 * 256);
    for ty in [
        WeightType::Q4_K,
        WeightType::Q5_K,
        WeightType::Q6_K,
        WeightType::Q5_0,
        WeightType::Q5_1,
    ] {
        let want = std::fs::read(dir.join(format!("{}.bin", ty.name()))).expect("fixture");
        let rb = ty.row_bytes(256);
        assert_eq!(want.len(), 8 * rb, "{ty:?} fixture size");
        for (r, x) in input.chunks_exact(256).enumerate() {
            let mut got = Vec::new();
            quantize_row(ty, x, &mut got);
            let want = &want[r * rb..(r + 1) * rb];
            if got != want {
                let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap();
                panic!("{ty:?} row {r}: first difference at byte {at} of {rb}");
            }
        }
    }
}
