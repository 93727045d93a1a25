//! Every quantised weight format seen as 32-weight blocks: the one
//! definition of the arithmetic that dequantisation, the scalar kernels and
//! (lane for lane) the SIMD kernels share.
//!
//! A row of `cols` weights is `cols / 32` blocks whatever its format; a
//! K-quant super-block of 256 is 8 consecutive blocks. Block `b` is
//! `(codes, dw, mw, sc)` with
//!
//! ```text
//! w[j] = (dw · sc[j / 16]) · codes[j] + mw          (mw = 0 when absent)
//! ```
//!
//! | type | `codes` | `dw` | `mw` | `sc` |
//! |---|---|---|---|---|
//! | Q4_0 | `q − 8` | `d` | – | 1 |
//! | Q4_1 | `q` (0..15) | `d` | `m` | 1 |
//! | Q5_0 | `q − 16` | `d` | – | 1 |
//! | Q5_1 | `q` (0..31) | `d` | `m` | 1 |
//! | Q8_0 | `q` | `d` | – | 1 |
//! | Q4_K / Q5_K | `q` (0..15 / 0..31) | `d · sc_j` (exact in f32) | `−(dmin · m_j)` | 1 |
//! | Q6_K | `q − 32` | `d` | – | the two 16-weight `i8` scales |
//!
//! and the dot product with an activation block (`qx`, scale `dx`, `s = dx·Σqx`):
//!
//! ```text
//! isum = sc[0]·Σ_{j<16} codes[j]·qx[j] + sc[1]·Σ_{j≥16} codes[j]·qx[j]   // exact i32
//! acc  = fma(isum as f32, dw · dx, acc)
//! acc  = fma(mw, s, acc)                                             // when mw exists
//! ```
//!
//! `d·sc_j` is exact (an f16 significand times a 6-bit integer fits in
//! f32's), so folding the sub-block scale into `dw` loses nothing; Q6_K's
//! signed 8-bit scales stay in the integer sum, where they are exact too.
//!
//! That form defines dequantisation. K-quant *matmuls* use the integer form
//! of a whole super-block instead ([`kblock32`], [`ksuper`]), with the
//! activations' 256-column form: scales and minimums stay integers until one
//! float step per super-block.

use crate::formats::{f16_at, WeightType, QK, QK_K};

/// One 32-weight block in the canonical form (see the module docs).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Block32 {
    pub codes: [i8; QK],
    pub dw: f32,
    pub mw: Option<f32>,
    pub sc: [i32; 2],
}

/// Sub-block `j`'s 6-bit scale and min from a Q4_K/Q5_K super-block's 12
/// packed bytes.
#[inline(always)]
pub(crate) fn scale_min_k4(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Nibble `j` (0..32) of a 32-weight block: low nibbles of `qs[0..16]` are
/// weights 0..16, high nibbles weights 16..32.
#[inline(always)]
fn nibble(qs: &[u8], j: usize) -> u8 {
    if j < 16 {
        qs[j] & 0x0F
    } else {
        qs[j - 16] >> 4
    }
}

/// Block `b` of a row of type `ty` (`row` holds whole blocks of `ty`).
#[inline(always)]
pub(crate) fn block32(ty: WeightType, row: &[u8], b: usize) -> Block32 {
    let mut codes = [0i8; QK];
    let bb = ty.block_bytes();
    match ty {
        WeightType::Q4_0 | WeightType::Q4_1 => {
            let blk = &row[b * bb..(b + 1) * bb];
            let (qs, off, mw) = if ty == WeightType::Q4_0 {
                (&blk[2..], 8, None)
            } else {
                (&blk[4..], 0, Some(f16_at(blk, 2)))
            };
            for (j, c) in codes.iter_mut().enumerate() {
                *c = nibble(qs, j) as i8 - off;
            }
            Block32 {
                codes,
                dw: f16_at(blk, 0),
                mw,
                sc: [1, 1],
            }
        }
        WeightType::Q5_0 | WeightType::Q5_1 => {
            let blk = &row[b * bb..(b + 1) * bb];
            let (h, off, mw) = if ty == WeightType::Q5_0 {
                (2, 16, None)
            } else {
                (4, 0, Some(f16_at(blk, 2)))
            };
            let qh = u32::from_le_bytes([blk[h], blk[h + 1], blk[h + 2], blk[h + 3]]);
            let qs = &blk[h + 4..];
            for (j, c) in codes.iter_mut().enumerate() {
                let hi = ((qh >> j) & 1) as u8;
                *c = (nibble(qs, j) | hi << 4) as i8 - off;
            }
            Block32 {
                codes,
                dw: f16_at(blk, 0),
                mw,
                sc: [1, 1],
            }
        }
        WeightType::Q8_0 => {
            let blk = &row[b * bb..(b + 1) * bb];
            for (c, &q) in codes.iter_mut().zip(&blk[2..]) {
                *c = q as i8;
            }
            Block32 {
                codes,
                dw: f16_at(blk, 0),
                mw: None,
                sc: [1, 1],
            }
        }
        WeightType::Q4_K | WeightType::Q5_K => {
            let k = kblock32(ty, row, b);
            let (d, mneg) = ksuper(ty, row, b / 8);
            // d·sc is exact (see the module docs); −(dmin·m) = (−dmin)·m.
            Block32 {
                codes: k.codes,
                dw: d * k.sc[0] as f32,
                mw: Some(mneg * k.m as f32),
                sc: [1, 1],
            }
        }
        WeightType::Q6_K => {
            let k = kblock32(ty, row, b);
            Block32 {
                codes: k.codes,
                dw: ksuper(ty, row, b / 8).0,
                mw: None,
                sc: k.sc,
            }
        }
        WeightType::F32 | WeightType::F16 => unreachable!("{} is not block-quantised", ty.name()),
    }
}

/// Block `b` (of 8 per super-block) of a K-quant row in the integer form
/// of the super-block dot product (see [`ksuper`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct KBlock {
    /// Q4_K/Q5_K: the unsigned code (0..15 / 0..31); Q6_K: `q − 32`.
    pub codes: [i8; QK],
    /// The two 16-weight halves' integer scales (Q4_K/Q5_K: the 6-bit
    /// sub-block scale twice).
    pub sc: [i32; 2],
    /// Q4_K/Q5_K: the 6-bit sub-block minimum; Q6_K: 0.
    pub m: i32,
}

/// Super-block `sb`'s float factors: `(d, −dmin)` (Q6_K: `(d, 0)`), so that
///
/// ```text
/// w[j] = d·sc·codes[j] + (−dmin)·m
/// ```
///
/// and a super-block's dot product with 256-column activations (`qx`, scale
/// `dx`, per-32 sums `S`) is
///
/// ```text
/// sumi = Σ_blocks Σ_halves sc·Σ codes·qx        // exact i32
/// summ = Σ_blocks m·S                           // exact i32
/// acc  = fma(sumi as f32, d · dx, acc)
/// acc  = fma(summ as f32, (−dmin) · dx, acc)    // Q4_K, Q5_K
/// ```
#[inline(always)]
pub(crate) fn ksuper(ty: WeightType, row: &[u8], sb: usize) -> (f32, f32) {
    let bb = ty.block_bytes();
    let blk = &row[sb * bb..(sb + 1) * bb];
    match ty {
        WeightType::Q6_K => (f16_at(blk, 208), 0.0),
        _ => (f16_at(blk, 0), -f16_at(blk, 2)),
    }
}

/// Block `b` of a K-quant row (`ty` is Q4_K, Q5_K or Q6_K).
#[inline(always)]
pub(crate) fn kblock32(ty: WeightType, row: &[u8], b: usize) -> KBlock {
    let mut codes = [0i8; QK];
    let bb = ty.block_bytes();
    let (sb, j) = (b / 8, b % 8);
    let blk = &row[sb * bb..(sb + 1) * bb];
    match ty {
        WeightType::Q4_K | WeightType::Q5_K => {
            let (sc, m) = scale_min_k4(&blk[4..16], j);
            let (qh, qs) = if ty == WeightType::Q5_K {
                (Some(&blk[16..48]), &blk[48..176])
            } else {
                (None, &blk[16..144])
            };
            let chunk = &qs[32 * (j / 2)..32 * (j / 2) + 32];
            let shift = 4 * (j % 2);
            for (l, c) in codes.iter_mut().enumerate() {
                let mut q = (chunk[l] >> shift) & 0x0F;
                if let Some(qh) = qh {
                    q |= ((qh[l] >> j) & 1) << 4;
                }
                *c = q as i8;
            }
            KBlock {
                codes,
                sc: [i32::from(sc); 2],
                m: i32::from(m),
            }
        }
        WeightType::Q6_K => {
            let (half, run) = (j / 4, j % 4);
            let ql = &blk[64 * half + 32 * (run % 2)..][..32];
            let qh = &blk[128 + 32 * half..][..32];
            let (nshift, hshift) = (4 * (run / 2), 2 * run);
            for (l, c) in codes.iter_mut().enumerate() {
                let q = ((ql[l] >> nshift) & 0x0F) | (((qh[l] >> hshift) & 3) << 4);
                *c = q as i8 - 32;
            }
            let scales = &blk[192..208];
            let s0 = 8 * half + 2 * run;
            KBlock {
                codes,
                sc: [i32::from(scales[s0] as i8), i32::from(scales[s0 + 1] as i8)],
                m: 0,
            }
        }
        _ => unreachable!("{} is not a K-quant", ty.name()),
    }
}

/// The exact integer part of a K-quant block's dot product:
/// `sc[0]·Σ_{j<16} codes·qx + sc[1]·Σ_{j≥16} codes·qx`.
#[inline(always)]
pub(crate) fn kblock_isum(blk: &KBlock, qx: &[i8]) -> i32 {
    let half = |r: std::ops::Range<usize>| -> i32 {
        r.map(|j| i32::from(blk.codes[j]) * i32::from(qx[j])).sum()
    };
    blk.sc[0] * half(0..16) + blk.sc[1] * half(16..32)
}

/// The exact integer part of the canonical block dot product.
#[inline(always)]
pub(crate) fn block_isum(blk: &Block32, qx: &[i8]) -> i32 {
    let half = |r: std::ops::Range<usize>| -> i32 {
        r.map(|j| i32::from(blk.codes[j]) * i32::from(qx[j])).sum()
    };
    blk.sc[0] * half(0..16) + blk.sc[1] * half(16..32)
}

/// Dequantises block `b` into `out` (32 weights), as the module docs say.
#[inline(always)]
pub(crate) fn dequantize_block(ty: WeightType, row: &[u8], b: usize, out: &mut [f32]) {
    let blk = block32(ty, row, b);
    for (h, o) in out.chunks_exact_mut(16).enumerate() {
        let scale = blk.dw * blk.sc[h] as f32;
        for (o, &c) in o.iter_mut().zip(&blk.codes[16 * h..16 * h + 16]) {
            *o = match blk.mw {
                Some(m) => scale * f32::from(c) + m,
                None => scale * f32::from(c),
            };
        }
    }
}

const _: () = assert!(QK_K == 8 * QK);
