//! Portable reference kernels. They define the exact arithmetic every SIMD
//! level reproduces (see the crate docs, "Determinism").

use super::{ActParts, OutPtr};
use crate::formats::{f16_at, WeightMatrix, WeightType, QK};
use std::ops::Range;

/// Rows per work item (only the granularity of the thread split).
pub(crate) const PANEL_ROWS: usize = 4;

/// Exact integer dot product of one weight block with 32 activations, using
/// the *stored* weight codes: unsigned nibbles for Q4_0/Q4_1 (the `-8` of
/// Q4_0 is applied by the caller), signed bytes for Q8_0.
#[inline(always)]
fn block_isum(ty: WeightType, blk: &[u8], qa: &[i8]) -> i32 {
    match ty {
        WeightType::Q4_0 | WeightType::Q4_1 => {
            let nib = &blk[ty.block_bytes() - 16..];
            let mut s = 0i32;
            for j in 0..16 {
                s += (nib[j] & 0xF) as i32 * qa[j] as i32;
                s += (nib[j] >> 4) as i32 * qa[j + 16] as i32;
            }
            s
        }
        WeightType::Q8_0 => {
            let mut s = 0i32;
            for j in 0..QK {
                s += blk[2 + j] as i8 as i32 * qa[j] as i32;
            }
            s
        }
        WeightType::F32 | WeightType::F16 => unreachable!("not a quantised type"),
    }
}

/// `dot(x_row, w_row)` in the canonical order:
///
/// ```text
/// acc = 0
/// for each block b in order:
///     acc = fma(isum_b as f32, d_w[b] * d_x[b], acc)   // isum_b exact i32
///     acc = fma(m_w[b], s_x[b], acc)                     // Q4_1 only
/// ```
///
/// with `isum_b = Σ (q_w - 8) q_x` (Q4_0), `Σ q_w q_x` (Q4_1, unsigned
/// nibbles), `Σ q_w q_x` (Q8_0).
#[inline(always)]
pub(crate) fn dot_row(
    ty: WeightType,
    wrow: &[u8],
    qs: &[i8],
    d: &[f32],
    s: &[f32],
    sums: &[i32],
) -> f32 {
    let bb = ty.block_bytes();
    let mut acc = 0.0f32;
    for (b, blk) in wrow.chunks_exact(bb).enumerate() {
        let qa = &qs[b * QK..(b + 1) * QK];
        let dw = f16_at(blk, 0);
        let mut isum = block_isum(ty, blk, qa);
        if ty == WeightType::Q4_0 {
            isum -= 8 * sums[b];
        }
        acc = (isum as f32).mul_add(dw * d[b], acc);
        if ty == WeightType::Q4_1 {
            acc = f16_at(blk, 2).mul_add(s[b], acc);
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
            let v = dot_row(
                w.ty,
                wrow,
                &x.qs[i * w.cols..(i + 1) * w.cols],
                &x.d[i * nb..(i + 1) * nb],
                &x.s[i * nb..(i + 1) * nb],
                &x.sums[i * nb..(i + 1) * nb],
            );
            // SAFETY: in bounds (i < n, r < rows) and owned by this call.
            unsafe { *out.0.add(i * w.rows + r) = v };
        }
    }
}
