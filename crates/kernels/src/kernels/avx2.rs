//! AVX2 + FMA + F16C kernels: the AVX-512 design (see `avx512.rs`) with
//! 8-row panels and `vpmaddubsw`/`vpmaddwd` instead of `vpdpbusd`.
//!
//! Every format is expanded to 32-weight blocks of 8 rows ([`PBlock`]) in the
//! canonical form of [`crate::blocks`], so the tile code is shared:
//!
//! * 4-bit codes (Q4_0, Q4_1, Q4_K): the 8 `maddubs` products of a block
//!   (pair sums ≤ 2·15·127 = 3810) are summed in i16 (≤ 30480, no
//!   saturation) and widened once with `madd(·, 1)` (Q4_K: `madd(·, sc)`,
//!   its sub-block scale).
//! * Q4_0 and Q5_0 start that i16 sum at the codes' offset times the
//!   activations (the quantiser's `pair_offsets`: −8 or −16 × the sums of
//!   the codes under each i16 half), so it holds Σ (q − 8)·x or Σ (q − 16)·x
//!   (≤ 16·16·127 = 32512 per half, at every step) and needs no offset term
//!   afterwards; Q5_0 is widened once like the 4-bit codes.
//! * The other 5-bit codes (Q5_1, Q5_K): pair sums ≤ 2·31·127 = 7874, so
//!   each half block (4 products, ≤ 31496) is widened on its own.
//! * Q8_0: `|w|` × `sign(x, w)` (pair sums ≤ 2·128·127 = 32512), widened
//!   after every `maddubs`.
//! * Q6_K: `|q − 32|` × `sign(x, q − 32)` (pair sums ≤ 2·32·127 = 8128, 4 per
//!   half: ≤ 32512); each half is widened by `madd` with its `i8` scale, so
//!   the scales stay in the exact integer sum.
//!
//! K-quant super-blocks (8 blocks) are expanded together: their codes and
//! fifth or high bits are transposed once and their packed scales decoded
//! once per row. Their tile (`tile_k`) reads the activations' 256-column
//! form: each block's i16 sums are widened by `madd` with the block's
//! integer scale (Q6_K: each half's), the 8 blocks add up in i32, the
//! minimums enter as 4 `madd`s of (m, m') pairs with the per-32 activation
//! sums, and the float step (cvt, mul, fma) comes once per super-block.

use super::{ActParts, OutPtr};
use crate::blocks::scale_min_k4;
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
const Q5_0: u8 = 3;
const Q5_1: u8 = 4;
const Q4_K: u8 = 5;
const Q5_K: u8 = 6;
const Q6_K: u8 = 7;

/// Formats whose codes are signed (`|w|` × `sign(x, w)`).
const fn signed(f: u8) -> bool {
    f == Q8_0 || f == Q6_K
}
/// Formats with a per-block minimum term.
const fn has_min(f: u8) -> bool {
    matches!(f, Q4_1 | Q5_1 | Q4_K | Q5_K)
}
/// K-quants: super-blocks with integer sub-block scales, dotted with the
/// activations' 256-column form (`tile_k`).
const fn is_k(f: u8) -> bool {
    matches!(f, Q4_K | Q5_K | Q6_K)
}
/// Formats with 5-bit unsigned codes.
const fn five_bit(f: u8) -> bool {
    matches!(f, Q5_0 | Q5_1 | Q5_K)
}

#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct PBlock {
    /// Unsigned weight codes (Q8_0: |q|), lane r = row r, columns 4g..4g+4.
    w: [__m256i; 8],
    /// Signed formats: the signed codes (sign source for `vpsignb`).
    ws: [__m256i; 8],
    /// The scale (K-quants: the super-block's `d`).
    dw: __m256,
    /// The minimum (K-quants: the super-block's `−dmin`).
    mw: __m256,
    /// K-quants: the two halves' integer scales as i16 pairs (`madd`
    /// multipliers; Q4_K/Q5_K: the sub-block scale in both).
    sc: [__m256i; 2],
    /// Q4_K/Q5_K, blocks 0..4 of a super-block: the i16 pair (m_2k, m_2k+1)
    /// of sub-block minimums, for `madd` with the activations' per-32 sums.
    mn: __m256i,
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
        // SAFETY: as above.
        WeightType::Q5_0 => unsafe { run::<Q5_0>(w, x, out, panels) },
        // SAFETY: as above.
        WeightType::Q5_1 => unsafe { run::<Q5_1>(w, x, out, panels) },
        // SAFETY: as above.
        WeightType::Q4_K => unsafe { run::<Q4_K>(w, x, out, panels) },
        // SAFETY: as above.
        WeightType::Q5_K => unsafe { run::<Q5_K>(w, x, out, panels) },
        // SAFETY: as above.
        WeightType::Q6_K => unsafe { run::<Q6_K>(w, x, out, panels) },
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
    // 32-weight blocks per stored block (8 for K-quant super-blocks).
    let per = w.ty.block_len() / QK;
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
                if (c0 + b) % per == 0 {
                    // SAFETY: stored block (c0+b)/per exists in every (clamped)
                    // row; KB is a multiple of `per`, so its `per` slots are
                    // inside this chunk's buffer.
                    unsafe { expand::<F>(base, &offs, (c0 + b) / per * bb, bufp.add(b)) };
                }
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
                    if is_k(F) {
                        match m {
                            4 => tile_k::<F, 4>(&ctx, x, i, out),
                            3 => tile_k::<F, 3>(&ctx, x, i, out),
                            2 => tile_k::<F, 2>(&ctx, x, i, out),
                            _ => tile_k::<F, 1>(&ctx, x, i, out),
                        }
                    } else {
                        match m {
                            4 => tile::<F, 4>(&ctx, x, i, out),
                            3 => tile::<F, 3>(&ctx, x, i, out),
                            2 => tile::<F, 2>(&ctx, x, i, out),
                            _ => tile::<F, 1>(&ctx, x, i, out),
                        }
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

/// Expands stored block `boff` of every row into `dst`: one [`PBlock`] for
/// the 32-weight formats, eight consecutive ones for a K-quant super-block.
///
/// # Safety
/// The CPU must support the features enabled above; the stored block at
/// `boff` must lie inside every row `base + offs[r]`, and `dst` must be valid
/// for writing one (K-quants: eight) `PBlock`s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn expand<const F: u8>(
    base: *const u8,
    offs: &[usize; PANEL_ROWS],
    boff: usize,
    dst: *mut PBlock,
) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        match F {
            Q4_K | Q5_K => expand_k4_k5::<F>(base, offs, boff, dst),
            Q6_K => expand_q6_k(base, offs, boff, dst),
            _ => expand32::<F>(base, offs, boff, dst),
        }
    }
}

/// A `vpshufb` control of 32 bytes: byte `i` of each 128-bit half is
/// `f(i)` (`i` in 0..16).
#[inline(always)]
fn dword_bytes(f: impl Fn(usize) -> i8) -> [i8; 32] {
    let mut c = [0i8; 32];
    for (i, b) in c.iter_mut().enumerate() {
        *b = f(i % 16);
    }
    c
}

/// The fifth bits of a Q5_0/Q5_1 block: byte `i` of lane `r` of result `g`
/// is `0x10` if bit `4g + i` of row `r`'s `qh` is set.
///
/// # Safety
/// The CPU must support AVX2; 4 bytes at `off` must be readable in every row.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_high_bits(base: *const u8, offs: &[usize; PANEL_ROWS], off: usize) -> [__m256i; 8] {
    let mut qh = [0u32; PANEL_ROWS];
    for k in 0..PANEL_ROWS {
        // SAFETY: four bytes inside the block of row k.
        qh[k] = unsafe { (base.add(offs[k] + off) as *const u32).read_unaligned() };
    }
    // SAFETY: reading a local array.
    let v = unsafe { _mm256_loadu_si256(qh.as_ptr() as *const __m256i) };
    let hi = _mm256_set1_epi8(0x10);
    let mut out = [_mm256_setzero_si256(); 8];
    for g in 0..8 {
        // Byte g/2 of each dword, repeated 4 times, then its bits 4(g%2)..+4.
        let k = (g / 2) as i8;
        // SAFETY: reading a local array.
        let ctrl = unsafe {
            _mm256_loadu_si256(dword_bytes(|i| k + 4 * (i / 4) as i8).as_ptr() as *const __m256i)
        };
        let sh = 4 * (g % 2) as u32;
        let bits = _mm256_set1_epi32(i32::from_le_bytes([
            (1u32 << sh) as u8,
            (1u32 << (sh + 1)) as u8,
            (1u32 << (sh + 2)) as u8,
            (1u32 << (sh + 3)) as u8,
        ]));
        let t = _mm256_and_si256(_mm256_shuffle_epi8(v, ctrl), bits);
        out[g] = _mm256_and_si256(_mm256_cmpeq_epi8(t, bits), hi);
    }
    out
}

/// # Safety
/// As [`expand`], for the 32-weight formats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn expand32<const F: u8>(
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
        // Quants follow the scale, the minimum (Q4_1, Q5_1) and the fifth
        // bits (Q5_0, Q5_1).
        let qs_off = match F {
            Q4_0 => 2,
            Q4_1 => 4,
            Q5_0 => 6,
            _ => 8,
        };
        let m4 = _mm256_set1_epi8(0x0F);
        // SAFETY: inside block `boff` of each row.
        let t = unsafe { transpose4(base, offs, boff + qs_off) };
        for q in 0..4 {
            w[q] = _mm256_and_si256(t[q], m4);
            w[4 + q] = _mm256_and_si256(_mm256_srli_epi16::<4>(t[q]), m4);
        }
        if five_bit(F) {
            // SAFETY: the 4 bytes before the quants are `qh`.
            let h = unsafe { q5_high_bits(base, offs, boff + qs_off - 4) };
            for g in 0..8 {
                w[g] = _mm256_or_si256(w[g], h[g]);
            }
        }
    }
    // SAFETY: dst is a PBlock slot; plain data written without reading.
    unsafe {
        (*dst).w = w;
        (*dst).dw = dw;
        if F == Q8_0 {
            (*dst).ws = ws;
        }
        if has_min(F) {
            (*dst).mw = f16x8(base, offs, boff + 2);
        }
    }
}

/// # Safety
/// As [`expand`], for Q4_K and Q5_K.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn expand_k4_k5<const F: u8>(
    base: *const u8,
    offs: &[usize; PANEL_ROWS],
    boff: usize,
    dst: *mut PBlock,
) {
    // SAFETY: every read below is inside the super-block `boff` of each row
    // (Q4_K: d, dmin, scales[12], qs[128]; Q5_K: qh[32] before qs), and
    // `dst` has room for the 8 blocks.
    unsafe {
        let d = f16x8(base, offs, boff);
        let dmin = f16x8(base, offs, boff + 2);
        let mut sc = [[0i32; PANEL_ROWS]; 8];
        let mut mn = [[0i32; PANEL_ROWS]; 8];
        for r in 0..PANEL_ROWS {
            let s = std::slice::from_raw_parts(base.add(offs[r] + boff + 4), 12);
            for j in 0..8 {
                let (a, m) = scale_min_k4(s, j);
                sc[j][r] = i32::from(a);
                mn[j][r] = i32::from(m);
            }
        }
        let qs_off = boff + if F == Q5_K { 48 } else { 16 };
        let mut qt = [_mm256_setzero_si256(); 32];
        for k in 0..8 {
            qt[4 * k..4 * k + 4].copy_from_slice(&transpose4(base, offs, qs_off + 16 * k));
        }
        let mut ht = [_mm256_setzero_si256(); 8];
        if F == Q5_K {
            ht[..4].copy_from_slice(&transpose4(base, offs, boff + 16));
            ht[4..].copy_from_slice(&transpose4(base, offs, boff + 32));
        }
        let m4 = _mm256_set1_epi8(0x0F);
        let hi = _mm256_set1_epi8(0x10);
        let neg = _mm256_set1_ps(-0.0);
        for j in 0..8 {
            // Sub-blocks 2c and 2c+1 are the low and high nibbles of the
            // 32 bytes of chunk c.
            let chunk = &qt[8 * (j / 2)..8 * (j / 2) + 8];
            let bit = _mm256_set1_epi8((1u32 << j) as u8 as i8);
            let mut w = [_mm256_setzero_si256(); 8];
            for g in 0..8 {
                let nib = if j % 2 == 0 {
                    chunk[g]
                } else {
                    _mm256_srli_epi16::<4>(chunk[g])
                };
                w[g] = _mm256_and_si256(nib, m4);
                if F == Q5_K {
                    let h = _mm256_cmpeq_epi8(_mm256_and_si256(ht[g], bit), bit);
                    w[g] = _mm256_or_si256(w[g], _mm256_and_si256(h, hi));
                }
            }
            // Lanes hold 0..63: (v, v) as an i16 pair is v | v << 16.
            let pair = |lo: &[i32; PANEL_ROWS], hi: &[i32; PANEL_ROWS]| {
                let l = _mm256_loadu_si256(lo.as_ptr() as *const __m256i);
                let h = _mm256_loadu_si256(hi.as_ptr() as *const __m256i);
                _mm256_or_si256(l, _mm256_slli_epi32::<16>(h))
            };
            let p = dst.add(j);
            (*p).w = w;
            let scp = pair(&sc[j], &sc[j]);
            (*p).sc = [scp, scp];
            (*p).dw = d;
            (*p).mw = _mm256_xor_ps(dmin, neg);
            if j < 4 {
                (*p).mn = pair(&mn[2 * j], &mn[2 * j + 1]);
            }
        }
    }
}

/// # Safety
/// As [`expand`], for Q6_K.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn expand_q6_k(base: *const u8, offs: &[usize; PANEL_ROWS], boff: usize, dst: *mut PBlock) {
    // SAFETY: every read below is inside the super-block `boff` of each row
    // (ql[128], qh[64], scales[16], d), and `dst` has room for the 8 blocks.
    unsafe {
        let d = f16x8(base, offs, boff + 208);
        let mut lt = [_mm256_setzero_si256(); 32];
        for k in 0..8 {
            lt[4 * k..4 * k + 4].copy_from_slice(&transpose4(base, offs, boff + 16 * k));
        }
        let mut ht = [_mm256_setzero_si256(); 16];
        for k in 0..4 {
            ht[4 * k..4 * k + 4].copy_from_slice(&transpose4(base, offs, boff + 128 + 16 * k));
        }
        let st = transpose4(base, offs, boff + 192);
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(0x03);
        let c32 = _mm256_set1_epi8(32);
        for j in 0..8 {
            let (half, run) = (j / 4, j % 4);
            let nsh = _mm_cvtsi32_si128(4 * (run / 2) as i32);
            let hsh = _mm_cvtsi32_si128(2 * run as i32);
            let mut w = [_mm256_setzero_si256(); 8];
            let mut ws = [_mm256_setzero_si256(); 8];
            for g in 0..8 {
                let l = lt[16 * half + 8 * (run % 2) + g];
                let nib = _mm256_and_si256(_mm256_srl_epi16(l, nsh), m4);
                let h = _mm256_and_si256(_mm256_srl_epi16(ht[8 * half + g], hsh), m2);
                let q = _mm256_or_si256(nib, _mm256_slli_epi16::<4>(h));
                ws[g] = _mm256_sub_epi8(q, c32);
                w[g] = _mm256_abs_epi8(ws[g]);
            }
            // Scales 8·half + 2·run and the next one: byte k of each dword
            // of st[k / 4], sign-extended into both i16 halves of the dword.
            let mut scv = [_mm256_setzero_si256(); 2];
            for (e, v) in scv.iter_mut().enumerate() {
                let idx = 8 * half + 2 * run + e;
                let k = (idx % 4) as i8;
                let z = -128i8;
                // (Inside the function's unsafe block: a local array.)
                let ctrl = _mm256_loadu_si256(
                    dword_bytes(|i| if i % 2 == 0 { z } else { k + 4 * (i / 4) as i8 }).as_ptr()
                        as *const __m256i,
                );
                *v = _mm256_srai_epi16::<8>(_mm256_shuffle_epi8(st[idx / 4], ctrl));
            }
            let p = dst.add(j);
            (*p).w = w;
            (*p).ws = ws;
            (*p).dw = d;
            (*p).sc = scv;
        }
    }
}

/// `s16[t] += maddubs(w_g, x_g)` for the 4-column groups `groups` of block
/// `b` and each activation row `t` (`x_g` broadcast, its signs taken from the
/// codes for signed formats), in i16 with wrapping adds.
///
/// # Safety
/// The CPU must support AVX2; `qa[t] + 32·b` must point at 32 readable
/// activation bytes of row `t`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_groups<const F: u8, const M: usize>(
    pb: &PBlock,
    qa: &[*const i8; M],
    b: usize,
    groups: Range<usize>,
    s16: &mut [__m256i; M],
) {
    for g in groups {
        for t in 0..M {
            // SAFETY: inside the 32 bytes of block b (the caller's contract).
            let a = unsafe { (qa[t].add(b * QK + 4 * g) as *const i32).read_unaligned() };
            let mut av = _mm256_set1_epi32(a);
            if signed(F) {
                av = _mm256_sign_epi8(av, pb.ws[g]);
            }
            s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(pb.w[g], av));
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
    let (dp, sp) = (x.d.as_ptr(), x.s.as_ptr());
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
        } else if F == Q4_0 || F == Q4_1 || F == Q5_0 {
            // Q4_0/Q5_0 start from the codes' offset times the activations
            // (`pair_offsets`), so the i16 sums hold Σ (q − off)·x, which
            // fits (≤ 16·16·127 per half) — and with wrapping adds only the
            // final value has to.
            let mut s16 = [_mm256_setzero_si256(); M];
            if F == Q4_0 || F == Q5_0 {
                for t in 0..M {
                    // SAFETY: block bi[t] + b of the activations exists.
                    let o = _mm256_set1_epi32(unsafe { *x.off16.as_ptr().add(bi[t] + b) });
                    s16[t] = if F == Q4_0 {
                        _mm256_srai_epi16::<1>(o)
                    } else {
                        o
                    };
                }
            }
            // SAFETY: block b of every row's chunk.
            unsafe { add_groups::<F, M>(pb, &qa, b, 0..8, &mut s16) };
            for t in 0..M {
                isum[t] = _mm256_madd_epi16(s16[t], ones);
            }
        } else {
            // Two halves of 4 products each, widened separately (5-bit
            // codes).
            for h in 0..2 {
                let mut s16 = [_mm256_setzero_si256(); M];
                // SAFETY: block b of every row's chunk.
                unsafe { add_groups::<F, M>(pb, &qa, b, 4 * h..4 * h + 4, &mut s16) };
                for t in 0..M {
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(s16[t], ones));
                }
            }
        }
        for t in 0..M {
            let k = bi[t] + b;
            let is = isum[t];
            // SAFETY: k < n * nb.
            let da = unsafe { *dp.add(k) };
            let scale = _mm256_mul_ps(pb.dw, _mm256_set1_ps(da));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), scale, acc[t]);
            if has_min(F) {
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

/// The tile of the K-quants: as [`tile`], but over the activations'
/// 256-column form, with the sub-block scales applied in the exact integer
/// sum and one float step per super-block (see `blocks::ksuper`):
///
/// ```text
/// sumi = Σ_blocks madd(Σ_g maddubs(w_g, x_g), sc)     // i32 lanes
/// summ = Σ_{k<4} madd((m_2k, m_2k+1), (S_2k, S_2k+1))   // Q4_K, Q5_K
/// acc  = fma(sumi as f32, d·dx, acc);  acc = fma(summ as f32, (−dmin)·dx, acc)
/// ```
///
/// # Safety
/// As [`tile`]; the chunk starts on a super-block (`KB` is a multiple of 8).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_k<const F: u8, const M: usize>(
    c: &TileCtx,
    x: &ActParts<'_>,
    i0: usize,
    out: OutPtr,
) {
    let cols = c.nb * QK;
    let nsb = c.nb / 8;
    let mut acc = [_mm256_setzero_ps(); M];
    let mut optr = [std::ptr::null_mut::<f32>(); M];
    let mut qa = [std::ptr::null::<i8>(); M];
    for t in 0..M {
        // SAFETY: in bounds (see `tile`).
        optr[t] = unsafe { out.0.add((i0 + t) * c.rows + c.r0) };
        // SAFETY: row i0 + t exists, column c.c0 * QK < cols.
        qa[t] = unsafe { x.kqs.as_ptr().add((i0 + t) * cols + c.c0 * QK) };
        if !c.first {
            // SAFETY: as in `tile`.
            acc[t] = unsafe {
                if c.full {
                    _mm256_loadu_ps(optr[t])
                } else {
                    _mm256_maskload_ps(optr[t], c.mask)
                }
            };
        }
    }
    for s in 0..c.kb / 8 {
        let mut isum = [_mm256_setzero_si256(); M];
        for j in 0..8 {
            let b = 8 * s + j;
            // SAFETY: slot b was expanded for this chunk.
            let pb = unsafe { &*c.buf.add(b) };
            if F == Q4_K {
                let mut s16 = [_mm256_setzero_si256(); M];
                // SAFETY: block b of every row's chunk.
                unsafe { add_groups::<F, M>(pb, &qa, b, 0..8, &mut s16) };
                for t in 0..M {
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(s16[t], pb.sc[0]));
                }
            } else {
                for h in 0..2 {
                    let mut s16 = [_mm256_setzero_si256(); M];
                    // SAFETY: block b of every row's chunk.
                    unsafe { add_groups::<F, M>(pb, &qa, b, 4 * h..4 * h + 4, &mut s16) };
                    for t in 0..M {
                        isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(s16[t], pb.sc[h]));
                    }
                }
            }
        }
        // SAFETY: slots 8s..8s+4 were expanded for this chunk.
        let p0 = unsafe { &*c.buf.add(8 * s) };
        let sb = (c.c0 + 8 * s) / 8;
        for t in 0..M {
            let row = i0 + t;
            // SAFETY: row < n, sb < nsb.
            let dx = _mm256_set1_ps(unsafe { *x.kd.as_ptr().add(row * nsb + sb) });
            acc[t] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(isum[t]),
                _mm256_mul_ps(p0.dw, dx),
                acc[t],
            );
            if has_min(F) {
                // SAFETY: the row's 8 sums of super-block sb (16 bytes).
                let sp = unsafe { x.ksums.as_ptr().add(row * c.nb + 8 * sb) } as *const i32;
                let mut summ = _mm256_setzero_si256();
                for k in 0..4 {
                    // SAFETY: slot 8s+k expanded; sp[k] inside the 16 bytes.
                    let (mn, sk) =
                        unsafe { ((*c.buf.add(8 * s + k)).mn, sp.add(k).read_unaligned()) };
                    summ = _mm256_add_epi32(summ, _mm256_madd_epi16(mn, _mm256_set1_epi32(sk)));
                }
                acc[t] =
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_mul_ps(p0.mw, dx), acc[t]);
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
