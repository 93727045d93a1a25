//! K-quant super-blocks (256 weights): Q4_K, Q5_K and Q6_K, dequantised one
//! block at a time — the reference the K-quant kernels (issue 20) will be
//! checked against, itself checked against the Python `gguf` package
//! (`tests/kquants.rs`). The arithmetic follows that reference's order in
//! f32 (`(d·sc)·q − dmin·m`), so the two agree bit for bit. Layouts:
//! `docs/models.md`.
//!
//! ```
//! use gguf::kquants::{dequantize_q6_k, Q6_K_BLOCK_BYTES, QK_K};
//! let mut block = [0u8; Q6_K_BLOCK_BYTES];
//! block[192] = 2; // the first 16 weights' scale
//! block[208..].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
//! let mut out = [0f32; QK_K];
//! dequantize_q6_k(&block, &mut out);
//! assert_eq!(out[0], 0.5 * 2.0 * -32.0); // q = 0 stands for −32
//! ```

/// Weights per super-block.
pub const QK_K: usize = 256;
pub const Q4_K_BLOCK_BYTES: usize = 144;
pub const Q5_K_BLOCK_BYTES: usize = 176;
pub const Q6_K_BLOCK_BYTES: usize = 210;

fn f16(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Sub-block `j`'s 6-bit scale and min from the 12 packed bytes.
fn scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q4_K and Q5_K share everything but the fifth bit.
fn dequantize_k4_k5(block: &[u8], qh: Option<&[u8]>, qs: &[u8], out: &mut [f32]) {
    let d = f16(block, 0);
    let dmin = f16(block, 2);
    let scales = &block[4..16];
    for run in 0..8 {
        let (sc, m) = scale_min(scales, run);
        let (scale, min) = (d * f32::from(sc), dmin * f32::from(m));
        let chunk = &qs[32 * (run / 2)..32 * (run / 2) + 32];
        let shift = 4 * (run % 2);
        for l in 0..32 {
            let mut q = (chunk[l] >> shift) & 0x0F;
            if let Some(qh) = qh {
                q |= ((qh[l] >> run) & 1) << 4;
            }
            out[32 * run + l] = scale * f32::from(q) - min;
        }
    }
}

/// One Q4_K block (`block.len() == 144`) into `out` (256 weights).
pub fn dequantize_q4_k(block: &[u8], out: &mut [f32]) {
    assert_eq!((block.len(), out.len()), (Q4_K_BLOCK_BYTES, QK_K));
    dequantize_k4_k5(block, None, &block[16..144], out);
}

/// One Q5_K block (`block.len() == 176`) into `out` (256 weights).
pub fn dequantize_q5_k(block: &[u8], out: &mut [f32]) {
    assert_eq!((block.len(), out.len()), (Q5_K_BLOCK_BYTES, QK_K));
    dequantize_k4_k5(block, Some(&block[16..48]), &block[48..176], out);
}

/// One Q6_K block (`block.len() == 210`) into `out` (256 weights).
pub fn dequantize_q6_k(block: &[u8], out: &mut [f32]) {
    assert_eq!((block.len(), out.len()), (Q6_K_BLOCK_BYTES, QK_K));
    let (ql, qh, scales) = (&block[..128], &block[128..192], &block[192..208]);
    let d = f16(block, 208);
    for half in 0..2 {
        let (ql, qh) = (
            &ql[64 * half..64 * half + 64],
            &qh[32 * half..32 * half + 32],
        );
        for run in 0..4 {
            // Runs: low nibbles of ql[0..32], of ql[32..64], then the high
            // nibbles of each; two bits of qh[l] at 0, 2, 4, 6.
            let lo = &ql[32 * (run % 2)..32 * (run % 2) + 32];
            let shift = 4 * (run / 2);
            for l in 0..32 {
                let q = ((lo[l] >> shift) & 0x0F) | (((qh[l] >> (2 * run)) & 3) << 4);
                let w = 128 * half + 32 * run + l;
                let sc = f32::from(scales[w / 16] as i8);
                out[w] = (d * sc) * f32::from(q as i8 - 32);
            }
        }
    }
}
