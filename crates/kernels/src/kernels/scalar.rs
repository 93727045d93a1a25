//! Portable reference kernels. They define the exact arithmetic every SIMD
//! level reproduces (see the crate docs, "Determinism").

use super::{ActParts, OutPtr};
use crate::blocks::{block32, block_isum, kblock32, kblock_isum, ksuper};
use crate::formats::{WeightMatrix, WeightType, QK, QK_K};
use std::ops::Range;

/// Rows per work item (only the granularity of the thread split).
pub(crate) const PANEL_ROWS: usize = 4;

/// `dot(x_row, w_row)` in the canonical order of [`crate::blocks`]:
///
/// ```text
/// acc = 0
/// for each 32-weight block b in order:
///     acc = fma(isum_b as f32, dw[b] * d_x[b], acc)   // isum_b exact i32
///     acc = fma(mw[b], s_x[b], acc)                     // types with a min
/// ```
#[inline(always)]
pub(crate) fn dot_row(ty: WeightType, wrow: &[u8], qs: &[i8], d: &[f32], s: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for b in 0..d.len() {
        let blk = block32(ty, wrow, b);
        let isum = block_isum(&blk, &qs[b * QK..(b + 1) * QK]);
        acc = (isum as f32).mul_add(blk.dw * d[b], acc);
        if let Some(m) = blk.mw {
            acc = m.mul_add(s[b], acc);
        }
    }
    acc
}

/// `dot(x_row, w_row)` of a K-quant row with the 256-column activation form,
/// in the canonical order of [`crate::blocks::ksuper`]:
///
/// ```text
/// acc = 0
/// for each 256-weight super-block s in order:
///     sumi = Σ_b sc·Σ codes·qx;  summ = Σ_b m·S_b       // exact i32
///     acc = fma(sumi as f32, d_s * d_x[s], acc)
///     acc = fma(summ as f32, (−dmin_s) * d_x[s], acc)   // Q4_K, Q5_K
/// ```
#[inline(always)]
pub(crate) fn dot_row_k(ty: WeightType, wrow: &[u8], qs: &[i8], d: &[f32], sums: &[i16]) -> f32 {
    let mut acc = 0.0f32;
    for (sb, &dx) in d.iter().enumerate() {
        let (mut sumi, mut summ) = (0i32, 0i32);
        for j in 0..QK_K / QK {
            let b = 8 * sb + j;
            let k = kblock32(ty, wrow, b);
            sumi += kblock_isum(&k, &qs[b * QK..(b + 1) * QK]);
            summ += k.m * i32::from(sums[b]);
        }
        let (dw, mneg) = ksuper(ty, wrow, sb);
        acc = (sumi as f32).mul_add(dw * dx, acc);
        if ty != WeightType::Q6_K {
            acc = (summ as f32).mul_add(mneg * dx, acc);
        }
    }
    acc
}

/// Computes output columns `panels * PANEL_ROWS ..` for every activation row.
///
/// # Safety
/// `out` must point to an `n × w.rows` buffer, no other thread may access the
/// columns of the rows in `panels` concurrently.
pub(crate) unsafe fn matmul_panels(
    w: &WeightMatrix<'_>,
    x: &ActParts<'_>,
    out: OutPtr,
    panels: Range<usize>,
) {
    let nb = w.cols / QK;
    let r_end = (panels.end * PANEL_ROWS).min(w.rows);
    for r in panels.start * PANEL_ROWS..r_end {
        let wrow = w.row(r);
        for i in 0..x.n {
            let v = if w.ty.is_k_quant() {
                dot_row_k(
                    w.ty,
                    wrow,
                    &x.kqs[i * w.cols..(i + 1) * w.cols],
                    &x.kd[i * nb / 8..(i + 1) * nb / 8],
                    &x.ksums[i * nb..(i + 1) * nb],
                )
            } else {
                dot_row(
                    w.ty,
                    wrow,
                    &x.qs[i * w.cols..(i + 1) * w.cols],
                    &x.d[i * nb..(i + 1) * nb],
                    &x.s[i * nb..(i + 1) * nb],
                )
            };
            // SAFETY: in bounds (i < n, r < rows) and owned by this call.
            unsafe { *out.0.add(i * w.rows + r) = v };
        }
    }
}
