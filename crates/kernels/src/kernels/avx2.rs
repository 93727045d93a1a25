//! AVX2 + FMA + F16C kernels: the AVX-512 design (see `avx512.rs`) with
//! 8-row panels and `vpmaddubsw`/`vpmaddwd` instead of `vpdpbusd`.
//!
//! Q4 formats: the 8 `maddubs` products of a block (each pair sum bounded by
//! 2·15·127 = 3810) are summed in i16 (≤ 30480, no saturation) and widened
//! once with `madd(·, 1)`. Q8_0: `|w|` × `sign(x, w)` (pair sums ≤
//! 2·128·127 = 32512), widened after every `maddubs`.

use super::{ActParts, OutPtr};
use crate::formats::{WeightMatrix, WeightType, QK};
use core::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::ops::Range;

pub(crate) const PANEL_ROWS: usize = 8;
const KB: usize = 16;
const NA: usize = 4;
const PF_PANELS: usize = 4;

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct PBlock {
    /// Unsigned weight codes (Q8_0: |q|), lane r = row r, columns 4g..4g+4.
    w: [__m256i; 8],
    /// Q8_0 only: the signed codes (sign source for `vpsignb`).
    ws: [__m256i; 8],
    dw: __m256,
    mw: __m256,
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C; otherwise as
/// `avx512::matmul_panels`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn matmul_panels(
    w: &WeightMatrix<'_>,
    x: &ActParts<'_>,
    out: OutPtr,
    panels: Range<usize>,
) {
    match w.ty {
        // SAFETY: this function's contract (CPU features, bounds) is
        // `run`'s.
        WeightType::Q4_0 => unsafe { run::<Q4_0>(w, x, out, panels) },
        // SAFETY: as above.
        WeightType::Q4_1 => unsafe { run::<Q4_1>(w, x, out, panels) },
        // SAFETY: as above.
        WeightType::Q8_0 => unsafe { run::<Q8_0>(w, x, out, panels) },
        WeightType::F32 | WeightType::F16 => unreachable!("not a quantised type"),
    }
}

/// # Safety
/// As [`matmul_panels`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run<const F: u8>(
    w: &WeightMatrix<'_>,
    x: &ActParts<'_>,
    out: OutPtr,
    panels: Range<usize>,
) {
    let rb = w.row_bytes();
    let nb = w.cols / QK;
    let bb = w.ty.block_bytes();
    let rows = w.rows;
    let mut buf = [MaybeUninit::<PBlock>::uninit(); KB];
    let bufp = buf.as_mut_ptr() as *mut PBlock;
    // Software prefetch into L2 of the panel PF_PANELS ahead (see avx512.rs).
    let panel_lines = (PANEL_ROWS * rb).div_ceil(64);
    let pf_per_block = panel_lines.div_ceil(nb);
    let bytes_end = w.bytes.as_ptr_range().end as usize;
    for p in panels {
        let r0 = p * PANEL_ROWS;
        let nr = (rows - r0).min(PANEL_ROWS);
        // SAFETY: r0 < rows.
        let base = unsafe { w.bytes.as_ptr().add(r0 * rb) };
        let pf_base = base.wrapping_add(PF_PANELS * PANEL_ROWS * rb) as usize;
        let mut offs = [0usize; PANEL_ROWS];
        for (k, o) in offs.iter_mut().enumerate() {
            *o = k.min(nr - 1) * rb;
        }
        let mut mask = [0i32; PANEL_ROWS];
        for (k, m) in mask.iter_mut().enumerate() {
            *m = if k < nr { -1 } else { 0 };
        }
        // SAFETY: reading a local array.
        let mask = unsafe { _mm256_loadu_si256(mask.as_ptr() as *const __m256i) };
        let full = nr == PANEL_ROWS;
        let mut c0 = 0;
        while c0 < nb {
            let kb = (nb - c0).min(KB);
            for b in 0..kb {
                let first_line = (c0 + b) * pf_per_block;
                for l in first_line..first_line + pf_per_block {
                    let a = pf_base + 64 * l;
                    if a < bytes_end {
                        // Prefetches never fault; the address is inside the matrix.
                        _mm_prefetch::<_MM_HINT_T1>(a as *const i8);
                    }
                }
                // SAFETY: block c0+b exists in every (clamped) row.
                unsafe { expand::<F>(base, &offs, (c0 + b) * bb, bufp.add(b)) };
            }
            let ctx = TileCtx {
                buf: bufp,
                kb,
                c0,
                nb,
                first: c0 == 0,
                rows,
                r0,
                mask,
                full,
            };
            let mut i = 0;
            while i < x.n {
                let m = (x.n - i).min(NA);
                // SAFETY: rows i..i+m exist; the chunk was expanded above.
                unsafe {
                    match m {
                        4 => tile::<F, 4>(&ctx, x, i, out),
                        3 => tile::<F, 3>(&ctx, x, i, out),
                        2 => tile::<F, 2>(&ctx, x, i, out),
                        _ => tile::<F, 1>(&ctx, x, i, out),
                    }
                }
                i += m;
            }
            c0 += kb;
        }
    }
}

/// Lane `r` of result `d` = dword `d` of the 16 bytes at `off` in row `r`.
///
/// # Safety
/// The CPU must support AVX2; 16 bytes at `off` must be readable in every
/// row `base + offs[r]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose4(base: *const u8, offs: &[usize; PANEL_ROWS], off: usize) -> [__m256i; 4] {
    // SAFETY: the caller guarantees 16 readable bytes at `off` in each row.
    let ld = |k: usize| unsafe { _mm_loadu_si128(base.add(offs[k] + off) as *const __m128i) };
    let mut z = [_mm256_setzero_si256(); 4];
    for (j, zj) in z.iter_mut().enumerate() {
        *zj = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(ld(j)), ld(4 + j));
    }
    let t0 = _mm256_unpacklo_epi32(z[0], z[1]);
    let t1 = _mm256_unpackhi_epi32(z[0], z[1]);
    let t2 = _mm256_unpacklo_epi32(z[2], z[3]);
    let t3 = _mm256_unpackhi_epi32(z[2], z[3]);
    [
        _mm256_unpacklo_epi64(t0, t2),
        _mm256_unpackhi_epi64(t0, t2),
        _mm256_unpacklo_epi64(t1, t3),
        _mm256_unpackhi_epi64(t1, t3),
    ]
}

/// # Safety
/// The CPU must support AVX2 and F16C; 2 bytes at `off` must be readable
/// in every row `base + offs[r]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x8(base: *const u8, offs: &[usize; PANEL_ROWS], off: usize) -> __m256 {
    let mut h = [0u16; PANEL_ROWS];
    for k in 0..PANEL_ROWS {
        // SAFETY: two bytes inside block of row k.
        h[k] = unsafe { (base.add(offs[k] + off) as *const u16).read_unaligned() };
    }
    // SAFETY: reading a local array.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(h.as_ptr() as *const __m128i) })
}

/// # Safety
/// The CPU must support the features enabled above; block `boff` must lie
/// inside every row `base + offs[r]`, and `dst` must be valid for a write.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn expand<const F: u8>(
    base: *const u8,
    offs: &[usize; PANEL_ROWS],
    boff: usize,
    dst: *mut PBlock,
) {
    // SAFETY: inside block `boff` of each row (as every read below).
    let dw = unsafe { f16x8(base, offs, boff) };
    let mut w = [_mm256_setzero_si256(); 8];
    let mut ws = [_mm256_setzero_si256(); 8];
    if F == Q8_0 {
        // SAFETY: inside block `boff` of each row (a Q8_0 block is 34 bytes).
        let (t, u) = unsafe {
            (
                transpose4(base, offs, boff + 2),
                transpose4(base, offs, boff + 18),
            )
        };
        ws[..4].copy_from_slice(&t);
        ws[4..].copy_from_slice(&u);
        for g in 0..8 {
            w[g] = _mm256_abs_epi8(ws[g]);
        }
    } else {
        let m4 = _mm256_set1_epi8(0x0F);
        // SAFETY: inside block `boff` of each row (the quants follow the
        // scale, and the minimum for Q4_1).
        let t = unsafe { transpose4(base, offs, boff + if F == Q4_1 { 4 } else { 2 }) };
        for q in 0..4 {
            w[q] = _mm256_and_si256(t[q], m4);
            w[4 + q] = _mm256_and_si256(_mm256_srli_epi16::<4>(t[q]), m4);
        }
    }
    // SAFETY: dst is a PBlock slot; plain data written without reading.
    unsafe {
        (*dst).w = w;
        (*dst).dw = dw;
        if F == Q8_0 {
            (*dst).ws = ws;
        }
        if F == Q4_1 {
            (*dst).mw = f16x8(base, offs, boff + 2);
        }
    }
}

struct TileCtx {
    buf: *const PBlock,
    kb: usize,
    c0: usize,
    nb: usize,
    first: bool,
    rows: usize,
    r0: usize,
    mask: __m256i,
    full: bool,
}

/// # Safety
/// The CPU must support the features enabled above; rows `i0..i0 + M` of
/// `x` and the panel's outputs in `out` must be in bounds, and no other
/// thread may write those outputs.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const F: u8, const M: usize>(c: &TileCtx, x: &ActParts<'_>, i0: usize, out: OutPtr) {
    let cols = c.nb * QK;
    let mut acc = [_mm256_setzero_ps(); M];
    let mut optr = [std::ptr::null_mut::<f32>(); M];
    let mut qa = [std::ptr::null::<i8>(); M];
    let mut bi = [0usize; M];
    for t in 0..M {
        // SAFETY: in bounds (see avx512.rs).
        optr[t] = unsafe { out.0.add((i0 + t) * c.rows + c.r0) };
        // SAFETY: row i0 + t < the activation rows, column c.c0 * QK <
        // cols (see avx512.rs).
        qa[t] = unsafe { x.qs.as_ptr().add((i0 + t) * cols + c.c0 * QK) };
        bi[t] = (i0 + t) * c.nb + c.c0;
        if !c.first {
            // SAFETY: optr[t] points at 8 in-bounds outputs when `full`,
            // else at the masked ones only.
            acc[t] = unsafe {
                if c.full {
                    _mm256_loadu_ps(optr[t])
                } else {
                    _mm256_maskload_ps(optr[t], c.mask)
                }
            };
        }
    }
    let ones = _mm256_set1_epi16(1);
    let (dp, sp, sump) = (x.d.as_ptr(), x.s.as_ptr(), x.sums.as_ptr());
    for b in 0..c.kb {
        // SAFETY: slot b was expanded for this chunk.
        let pb = unsafe { &*c.buf.add(b) };
        let mut isum = [_mm256_setzero_si256(); M];
        if F == Q8_0 {
            for g in 0..8 {
                for t in 0..M {
                    // SAFETY: bytes of block b of the row's chunk.
                    let a = unsafe { (qa[t].add(b * QK + 4 * g) as *const i32).read_unaligned() };
                    let sa = _mm256_sign_epi8(_mm256_set1_epi32(a), pb.ws[g]);
                    let p = _mm256_maddubs_epi16(pb.w[g], sa);
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, ones));
                }
            }
        } else {
            let mut s16 = [_mm256_setzero_si256(); M];
            for g in 0..8 {
                for t in 0..M {
                    // SAFETY: as above.
                    let a = unsafe { (qa[t].add(b * QK + 4 * g) as *const i32).read_unaligned() };
                    let p = _mm256_maddubs_epi16(pb.w[g], _mm256_set1_epi32(a));
                    s16[t] = _mm256_add_epi16(s16[t], p);
                }
            }
            for t in 0..M {
                isum[t] = _mm256_madd_epi16(s16[t], ones);
            }
        }
        for t in 0..M {
            let k = bi[t] + b;
            let mut is = isum[t];
            if F == Q4_0 {
                // SAFETY: k < n * nb.
                is = _mm256_sub_epi32(is, _mm256_set1_epi32(8 * unsafe { *sump.add(k) }));
            }
            // SAFETY: k < n * nb.
            let da = unsafe { *dp.add(k) };
            let scale = _mm256_mul_ps(pb.dw, _mm256_set1_ps(da));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), scale, acc[t]);
            if F == Q4_1 {
                // SAFETY: k < n * nb.
                let sa = unsafe { *sp.add(k) };
                acc[t] = _mm256_fmadd_ps(pb.mw, _mm256_set1_ps(sa), acc[t]);
            }
        }
    }
    for t in 0..M {
        // SAFETY: only valid output columns are written.
        unsafe {
            if c.full {
                _mm256_storeu_ps(optr[t], acc[t]);
            } else {
                _mm256_maskstore_ps(optr[t], c.mask, acc[t]);
            }
        }
    }
}
