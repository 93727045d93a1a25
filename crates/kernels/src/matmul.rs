//! Public matmul entry points.

use crate::formats::{dequantize_row, WeightMatrix, WeightType, QK};
use crate::kernels::{self, OutPtr};
use crate::level::KernelLevel;
use crate::pool::ThreadPool;
use crate::quant::QuantizedActivations;

/// `out[i * w.rows + r] = dot(x_i, w_r)` for quantised weights (every
/// block-quantised [`WeightType`]) and Q8-quantised activations (which must
/// hold the form the type needs, see [`crate::ActForms`]), using the
/// process-wide [`KernelLevel::active`] level and all threads of `pool`.
///
/// `out.len()` must be `x.n_rows() * w.rows` and `x.cols() == w.cols`.
/// The value of each output element depends only on the weight row and the
/// activation row (bitwise), not on the batch, the position in the batch or
/// the number of threads.
pub fn matmul(pool: &ThreadPool, w: WeightMatrix<'_>, x: &QuantizedActivations, out: &mut [f32]) {
    matmul_with_level(pool, KernelLevel::active(), w, x, out);
}

/// [`matmul`] at an explicit kernel level (for tests and benchmarks).
///
/// Panics if `level` is not supported by this CPU, if the weight type is not
/// quantised (use [`matmul_f32`]), if the activations lack the form it
/// needs or if the shapes disagree.
pub fn matmul_with_level(
    pool: &ThreadPool,
    level: KernelLevel,
    w: WeightMatrix<'_>,
    x: &QuantizedActivations,
    out: &mut [f32],
) {
    if let Err(e) = w.validate() {
        panic!("matmul: invalid weight matrix: {e}");
    }
    assert!(
        w.ty.is_quantized(),
        "matmul: {:?} weights take f32 activations, use matmul_f32",
        w.ty
    );
    assert!(
        level.is_supported(),
        "matmul: kernel level {level:?} is not supported by this CPU"
    );
    let n = x.n_rows();
    if n == 0 || w.rows == 0 {
        assert!(
            out.is_empty() || n * w.rows == out.len(),
            "matmul: out has the wrong length"
        );
        return;
    }
    assert_eq!(
        x.cols(),
        w.cols,
        "matmul: activations have {} columns but the weights have {}",
        x.cols(),
        w.cols
    );
    assert_eq!(
        out.len(),
        n * w.rows,
        "matmul: out.len() must be n_rows ({n}) × weight rows ({})",
        w.rows
    );
    // Lane offsets inside a panel are i32 (gather indices).
    assert!(
        w.row_bytes().saturating_mul(kernels::panel_rows(level)) < i32::MAX as usize,
        "matmul: rows too long ({} bytes)",
        w.row_bytes()
    );
    assert!(
        x.has_form_for(w.ty),
        "matmul: {} weights need the activations' {} form, which was not computed (see ActForms)",
        w.ty.name(),
        if w.ty.is_k_quant() {
            "256-column"
        } else {
            "32-column"
        }
    );
    let acts = x.kernel_parts();
    let n_panels = w.rows.div_ceil(kernels::panel_rows(level));
    let outp = OutPtr(out.as_mut_ptr());
    // Up to ~8 activation rows are memory-bound: one contiguous range per thread
    // keeps the software prefetch stream going (a new range starts cold).
    // Batches are compute-bound: smaller chunks balance the threads better.
    // Ranges are claimed dynamically, so a descheduled worker's range is
    // taken over by another thread. Results do not depend on the split.
    let chunks_per_thread = if n <= 8 { 1 } else { 4 };
    let chunk = n_panels.div_ceil(pool.n_threads() * chunks_per_thread);
    pool.parallel_for_chunked(n_panels, chunk, |panels| {
        // SAFETY: the level is supported; `w` was validated and matches the
        // activations; `out` has n × rows elements and stays mutably borrowed
        // for this whole call; parallel_for hands out disjoint panel ranges,
        // so no two threads write the same output column.
        unsafe { kernels::run_panels(level, &w, &acts, outp.get(), panels) };
    });
}

/// Lanes of the fixed-order f32 dot product of [`matmul_f32`].
const LANES: usize = 16;

/// `out[i * w.rows + r] = dot(x_i, w_r)` with `f32` activations
/// (`x.len() == n * w.cols`, `out.len() == n * w.rows`), for any weight type
/// (quantised weights are dequantised on the fly). Not a hot path: intended
/// for F32/F16 tensors.
///
/// The reduction order is fixed (16 interleaved lanes, lane `l` sums the
/// products of columns `j ≡ l (mod 16)` in increasing `j`, then a fixed
/// pairwise tree), so results are bitwise independent of the batch, the
/// threads and the kernel level.
pub fn matmul_f32(pool: &ThreadPool, w: WeightMatrix<'_>, x: &[f32], out: &mut [f32]) {
    matmul_f32_with_level(pool, KernelLevel::active(), w, x, out);
}

/// [`matmul_f32`] at an explicit kernel level.
pub fn matmul_f32_with_level(
    pool: &ThreadPool,
    level: KernelLevel,
    w: WeightMatrix<'_>,
    x: &[f32],
    out: &mut [f32],
) {
    if let Err(e) = w.validate() {
        panic!("matmul_f32: invalid weight matrix: {e}");
    }
    assert!(
        level.is_supported(),
        "matmul_f32: kernel level {level:?} is not supported"
    );
    if w.cols == 0 {
        out.fill(0.0);
        return;
    }
    assert!(
        x.len().is_multiple_of(w.cols),
        "matmul_f32: x.len() = {} is not a multiple of cols = {}",
        x.len(),
        w.cols
    );
    let n = x.len() / w.cols;
    assert_eq!(
        out.len(),
        n * w.rows,
        "matmul_f32: out.len() must be n ({n}) × rows ({})",
        w.rows
    );
    if n == 0 || w.rows == 0 {
        return;
    }
    const GRAIN: usize = 8;
    let outp = OutPtr(out.as_mut_ptr());
    pool.parallel_for(w.rows.div_ceil(GRAIN), |items| {
        let rows = items.start * GRAIN..(items.end * GRAIN).min(w.rows);
        let out = outp.get();
        match level {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: level supported; rows disjoint across threads.
            KernelLevel::Avx512 => unsafe { f32_rows_avx512(&w, x, n, out, rows) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            KernelLevel::Avx2 => unsafe { f32_rows_avx2(&w, x, n, out, rows) },
            // SAFETY: rows disjoint across threads.
            _ => unsafe { f32_rows(&w, x, n, out, rows) },
        }
    });
}

/// # Safety
/// The CPU must support the features enabled above; otherwise as
/// `f32_rows` (output rows disjoint from other threads').
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn f32_rows_avx512(
    w: &WeightMatrix<'_>,
    x: &[f32],
    n: usize,
    out: OutPtr,
    rows: std::ops::Range<usize>,
) {
    // SAFETY: forwarded.
    unsafe { f32_rows(w, x, n, out, rows) }
}

/// # Safety
/// The CPU must support the features enabled above; otherwise as
/// `f32_rows` (output rows disjoint from other threads').
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f32_rows_avx2(
    w: &WeightMatrix<'_>,
    x: &[f32],
    n: usize,
    out: OutPtr,
    rows: std::ops::Range<usize>,
) {
    // SAFETY: forwarded.
    unsafe { f32_rows(w, x, n, out, rows) }
}

/// # Safety
/// `out` valid for `n × w.rows` floats; no concurrent access to the columns
/// `rows`.
#[inline(always)]
unsafe fn f32_rows(
    w: &WeightMatrix<'_>,
    x: &[f32],
    n: usize,
    out: OutPtr,
    rows: std::ops::Range<usize>,
) {
    // Columns are processed in chunks (dequantised once per chunk into a
    // stack buffer); the lane accumulators of a row live on the stack too, so
    // nothing is allocated. Chunk boundaries are multiples of LANES, so the
    // lane assignment (and hence the result) does not depend on CHUNK.
    const CHUNK: usize = 256;
    const MAXN: usize = 8;
    let cols = w.cols;
    let bl = w.ty.block_len();
    let bb = w.ty.block_bytes();
    let mut buf = [0.0f32; CHUNK];
    for r in rows {
        let wrow = w.row(r);
        let mut i0 = 0;
        while i0 < n {
            let m = (n - i0).min(MAXN);
            let mut acc = [[0.0f32; LANES]; MAXN];
            let mut c0 = 0;
            while c0 < cols {
                let len = (cols - c0).min(CHUNK);
                // CHUNK is a multiple of QK, so chunks hold whole blocks.
                let wb = &wrow[c0 / bl * bb..(c0 + len).div_ceil(bl) * bb];
                dequantize_row(w.ty, wb, &mut buf[..len]);
                for (t, acc) in acc.iter_mut().enumerate().take(m) {
                    let xr = &x[(i0 + t) * cols + c0..(i0 + t) * cols + c0 + len];
                    lanes_accumulate(acc, &buf[..len], xr);
                }
                c0 += len;
            }
            for (t, acc) in acc.iter().enumerate().take(m) {
                // SAFETY: (i0+t) < n and r < rows: in bounds; column r is
                // owned by this thread.
                unsafe { *out.0.add((i0 + t) * w.rows + r) = reduce_lanes(acc) };
            }
            i0 += m;
        }
    }
}

#[inline(always)]
fn lanes_accumulate(acc: &mut [f32; LANES], w: &[f32], x: &[f32]) {
    let mut wc = w.chunks_exact(LANES);
    let mut xc = x.chunks_exact(LANES);
    for (wv, xv) in (&mut wc).zip(&mut xc) {
        for l in 0..LANES {
            acc[l] += wv[l] * xv[l];
        }
    }
    for (l, (a, b)) in wc.remainder().iter().zip(xc.remainder()).enumerate() {
        acc[l] += a * b;
    }
}

#[inline(always)]
fn reduce_lanes(acc: &[f32; LANES]) -> f32 {
    let mut a = *acc;
    let mut h = LANES / 2;
    while h > 0 {
        for l in 0..h {
            a[l] += a[l + h];
        }
        h /= 2;
    }
    a[0]
}

/// The "spec" dot product: dequantise the weight row to f32 and accumulate
/// `w_j * x_j` in f64. Used by tests as ground truth.
pub fn reference_dot(ty: WeightType, wrow: &[u8], x: &[f32]) -> f64 {
    let mut wf = vec![0.0f32; x.len()];
    dequantize_row(ty, wrow, &mut wf);
    wf.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum()
}

const _: () = assert!(256 % QK == 0 && 256 % LANES == 0);
