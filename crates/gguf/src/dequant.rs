//! Scalar reference dequantisation (bit-exact with ggml's reference code and
//! the `gguf` Python package).

use half::f16;

use crate::error::{GgufError, Result};
use crate::kquants::QK_K;
use crate::types::{type_block_size, GgmlType, QK};

#[inline]
fn f16_at(bytes: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[i], bytes[i + 1]])).to_f32()
}

/// Checks that `bytes` holds exactly the encoding of `n_weights` weights of
/// type `t` and returns that byte count.
pub(crate) fn check_sizes(
    t: GgmlType,
    n_weights: usize,
    n_bytes: usize,
    what: &'static str,
) -> Result<()> {
    let (w, b) = type_block_size(t);
    if !n_weights.is_multiple_of(w) {
        return Err(GgufError::SizeMismatch {
            what,
            expected: (n_weights.div_ceil(w) * w) as u64,
            actual: n_weights as u64,
        });
    }
    let expected = (n_weights / w) as u64 * b as u64;
    if expected != n_bytes as u64 {
        return Err(GgufError::SizeMismatch {
            what,
            expected,
            actual: n_bytes as u64,
        });
    }
    Ok(())
}

/// Dequantises `out.len()` weights of type `t` from `bytes`.
///
/// `out.len()` must be a whole number of blocks of `t` and `bytes.len()` must
/// be exactly their encoded size; otherwise [`GgufError::SizeMismatch`].
///
/// Block layouts (little-endian):
/// - Q4_0 (18 bytes): f16 `d`, 16 bytes `qs`; `w[j] = ((qs[j] & 15) - 8) * d`,
///   `w[j + 16] = ((qs[j] >> 4) - 8) * d`.
/// - Q4_1 (20 bytes): f16 `d`, f16 `m`, 16 bytes `qs`;
///   `w[j] = (qs[j] & 15) * d + m`, `w[j + 16] = (qs[j] >> 4) * d + m`.
/// - Q5_0 (22 bytes): f16 `d`, u32 `qh`, 16 bytes `qs`; with
///   `q[j] = (qs[j] & 15) | bit j of qh << 4` and `q[j + 16] = (qs[j] >> 4) |
///   bit j + 16 of qh << 4`: `w = (q - 16) * d`.
/// - Q5_1 (24 bytes): f16 `d`, f16 `m`, u32 `qh`, 16 bytes `qs`; `w = q * d + m`.
/// - Q8_0 (34 bytes): f16 `d`, 32 × i8 `qs`; `w[j] = qs[j] * d`.
/// - Q4_K, Q5_K, Q6_K: [`crate::kquants`].
pub fn dequantize_row(t: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    check_sizes(t, out.len(), bytes.len(), "dequantize_row")?;
    match t {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        GgmlType::Q4_0 => {
            for (o, blk) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(18)) {
                let d = f16_at(blk, 0);
                let qs = &blk[2..18];
                for j in 0..QK / 2 {
                    let x0 = (qs[j] & 0x0F) as i32 - 8;
                    let x1 = (qs[j] >> 4) as i32 - 8;
                    o[j] = x0 as f32 * d;
                    o[j + QK / 2] = x1 as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, blk) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(20)) {
                let d = f16_at(blk, 0);
                let m = f16_at(blk, 2);
                let qs = &blk[4..20];
                for j in 0..QK / 2 {
                    let x0 = (qs[j] & 0x0F) as f32;
                    let x1 = (qs[j] >> 4) as f32;
                    o[j] = x0 * d + m;
                    o[j + QK / 2] = x1 * d + m;
                }
            }
        }
        GgmlType::Q8_0 => {
            for (o, blk) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(34)) {
                let d = f16_at(blk, 0);
                for (oj, &q) in o.iter_mut().zip(&blk[2..34]) {
                    *oj = (q as i8) as f32 * d;
                }
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let bb = type_block_size(t).1;
            for (o, blk) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(bb)) {
                let d = f16_at(blk, 0);
                let h = bb - 20;
                let qh = u32::from_le_bytes([blk[h], blk[h + 1], blk[h + 2], blk[h + 3]]);
                let qs = &blk[h + 4..];
                for j in 0..QK / 2 {
                    let x0 = (qs[j] & 0x0F) | (((qh >> j) & 1) as u8) << 4;
                    let x1 = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) as u8) << 4;
                    if t == GgmlType::Q5_0 {
                        o[j] = (x0 as i32 - 16) as f32 * d;
                        o[j + QK / 2] = (x1 as i32 - 16) as f32 * d;
                    } else {
                        let m = f16_at(blk, 2);
                        o[j] = x0 as f32 * d + m;
                        o[j + QK / 2] = x1 as f32 * d + m;
                    }
                }
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
            let bb = type_block_size(t).1;
            let f = match t {
                GgmlType::Q4_K => crate::kquants::dequantize_q4_k,
                GgmlType::Q5_K => crate::kquants::dequantize_q5_k,
                _ => crate::kquants::dequantize_q6_k,
            };
            for (o, blk) in out.chunks_exact_mut(QK_K).zip(bytes.chunks_exact(bb)) {
                f(blk, o);
            }
        }
    }
    Ok(())
}

/// Dequantises a whole buffer of type `t` into a new vector; `bytes.len()`
/// must be a whole number of blocks.
pub fn dequantize(t: GgmlType, bytes: &[u8]) -> Result<Vec<f32>> {
    let (w, b) = type_block_size(t);
    if !bytes.len().is_multiple_of(b) {
        return Err(GgufError::SizeMismatch {
            what: "dequantize",
            expected: (bytes.len().div_ceil(b) * b) as u64,
            actual: bytes.len() as u64,
        });
    }
    let mut out = vec![0.0f32; bytes.len() / b * w];
    dequantize_row(t, bytes, &mut out)?;
    Ok(out)
}
