//! GGUF weight formats: block layouts, validation and dequantisation.

use std::fmt;

/// Weights in one activation block, and in one block of the 32-weight
/// formats (Q4_0 … Q8_0). K-quants are super-blocks of [`QK_K`] = 8 × 32.
pub const QK: usize = 32;

/// Weights in one K-quant super-block (Q4_K, Q5_K, Q6_K).
pub const QK_K: usize = 256;

/// Element type of a weight matrix, with the GGUF on-disk layout (named as
/// ggml names them).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightType {
    /// 32 weights in 18 bytes: `f16 d`, 16 nibble bytes; `w = d * (q - 8)`.
    Q4_0,
    /// 32 weights in 20 bytes: `f16 d`, `f16 m`, 16 nibble bytes; `w = d * q + m`.
    Q4_1,
    /// 32 weights in 22 bytes: `f16 d`, `u32 qh` (fifth bits), 16 nibble
    /// bytes; `w = d * (q - 16)`.
    Q5_0,
    /// 32 weights in 24 bytes: `f16 d`, `f16 m`, `u32 qh`, 16 nibble bytes;
    /// `w = d * q + m`.
    Q5_1,
    /// 32 weights in 34 bytes: `f16 d`, 32 × `i8`; `w = d * q`.
    Q8_0,
    /// 256 weights in 144 bytes: `f16 d`, `f16 dmin`, 12 bytes of packed
    /// 6-bit scales and mins (one pair per 32 weights), 128 nibble bytes;
    /// `w = d·sc·q − dmin·m`.
    Q4_K,
    /// 256 weights in 176 bytes: as Q4_K plus 32 bytes of fifth bits.
    Q5_K,
    /// 256 weights in 210 bytes: 128 bytes of low nibbles, 64 of high
    /// 2-bit pairs, 16 `i8` scales (one per 16 weights), `f16 d`;
    /// `w = d·sc·(q − 32)`.
    Q6_K,
    /// Plain little-endian `f32`.
    F32,
    /// Plain little-endian IEEE half precision.
    F16,
}

impl WeightType {
    /// Weights per block (1 for the unquantised types).
    pub const fn block_len(self) -> usize {
        match self {
            WeightType::Q4_0
            | WeightType::Q4_1
            | WeightType::Q5_0
            | WeightType::Q5_1
            | WeightType::Q8_0 => QK,
            WeightType::Q4_K | WeightType::Q5_K | WeightType::Q6_K => QK_K,
            WeightType::F32 | WeightType::F16 => 1,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            WeightType::Q4_0 => 18,
            WeightType::Q4_1 => 20,
            WeightType::Q5_0 => 22,
            WeightType::Q5_1 => 24,
            WeightType::Q8_0 => 34,
            WeightType::Q4_K => 144,
            WeightType::Q5_K => 176,
            WeightType::Q6_K => 210,
            WeightType::F32 => 4,
            WeightType::F16 => 2,
        }
    }

    /// Whether the type is a K-quant (256-weight super-blocks with integer
    /// sub-block scales). Its matmuls take the activations' 256-column form
    /// ([`crate::ActForms::super256`]).
    pub const fn is_k_quant(self) -> bool {
        matches!(self, WeightType::Q4_K | WeightType::Q5_K | WeightType::Q6_K)
    }

    /// Whether the type is block-quantised (usable with [`crate::matmul`]).
    pub const fn is_quantized(self) -> bool {
        !matches!(self, WeightType::F32 | WeightType::F16)
    }

    /// ggml's name of the type.
    pub const fn name(self) -> &'static str {
        match self {
            WeightType::Q4_0 => "Q4_0",
            WeightType::Q4_1 => "Q4_1",
            WeightType::Q5_0 => "Q5_0",
            WeightType::Q5_1 => "Q5_1",
            WeightType::Q8_0 => "Q8_0",
            WeightType::Q4_K => "Q4_K",
            WeightType::Q5_K => "Q5_K",
            WeightType::Q6_K => "Q6_K",
            WeightType::F32 => "F32",
            WeightType::F16 => "F16",
        }
    }

    /// Every type, quantised ones first.
    pub const ALL: [WeightType; 10] = [
        WeightType::Q4_0,
        WeightType::Q4_1,
        WeightType::Q5_0,
        WeightType::Q5_1,
        WeightType::Q8_0,
        WeightType::Q4_K,
        WeightType::Q5_K,
        WeightType::Q6_K,
        WeightType::F32,
        WeightType::F16,
    ];

    /// Bytes taken by one row of `cols` weights. `cols` must be a multiple of
    /// [`WeightType::block_len`].
    pub const fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_len() * self.block_bytes()
    }
}

/// Why a [`WeightMatrix`] description is inconsistent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShapeError {
    /// `cols` is not a multiple of the block length of the type.
    ColsNotBlockMultiple {
        /// The weight type.
        ty: WeightType,
        /// The offending column count.
        cols: usize,
    },
    /// `bytes.len()` differs from `rows * row_bytes(cols)`.
    WrongByteLen {
        /// `rows * row_bytes(cols)`.
        expected: usize,
        /// `bytes.len()`.
        actual: usize,
    },
}

impl fmt::Display for ShapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShapeError::ColsNotBlockMultiple { ty, cols } => write!(
                f,
                "{ty:?} matrix: cols = {cols} is not a multiple of {}",
                ty.block_len()
            ),
            ShapeError::WrongByteLen { expected, actual } => {
                write!(f, "weight matrix has {actual} bytes, expected {expected}")
            }
        }
    }
}

impl std::error::Error for ShapeError {}

/// A borrowed weight matrix in raw GGUF layout: `rows` rows (output
/// features), each `cols` weights stored as `cols / 32` consecutive blocks
/// (or `cols` plain values for F32/F16); rows are consecutive.
///
/// The bytes need no particular alignment.
#[derive(Clone, Copy, Debug)]
pub struct WeightMatrix<'a> {
    /// Element type / block format.
    pub ty: WeightType,
    /// Raw bytes, exactly `rows * ty.row_bytes(cols)` of them.
    pub bytes: &'a [u8],
    /// Output features.
    pub rows: usize,
    /// Weights per row (a multiple of the block length).
    pub cols: usize,
}

impl<'a> WeightMatrix<'a> {
    /// Describes `bytes` as a `rows × cols` matrix of type `ty`, checking that
    /// the sizes agree.
    pub fn new(
        ty: WeightType,
        bytes: &'a [u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self, ShapeError> {
        let m = WeightMatrix {
            ty,
            bytes,
            rows,
            cols,
        };
        m.validate()?;
        Ok(m)
    }

    /// Checks the shape invariants (see [`WeightMatrix::new`]).
    pub fn validate(&self) -> Result<(), ShapeError> {
        if !self.cols.is_multiple_of(self.ty.block_len()) {
            return Err(ShapeError::ColsNotBlockMultiple {
                ty: self.ty,
                cols: self.cols,
            });
        }
        let expected = self.rows * self.ty.row_bytes(self.cols);
        if self.bytes.len() != expected {
            return Err(ShapeError::WrongByteLen {
                expected,
                actual: self.bytes.len(),
            });
        }
        Ok(())
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols)
    }

    /// The raw bytes of row `r`.
    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.bytes[r * rb..(r + 1) * rb]
    }

    /// Dequantises row `r` into `out` (`out.len() == cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        dequantize_row(self.ty, self.row(r), out);
    }
}

#[inline(always)]
pub(crate) fn f16_at(bytes: &[u8], off: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([bytes[off], bytes[off + 1]])).to_f32()
}

/// Dequantises one row of raw bytes (`out.len()` weights) to `f32`.
///
/// Panics if `bytes` is not exactly one row of `out.len()` weights.
pub fn dequantize_row(ty: WeightType, bytes: &[u8], out: &mut [f32]) {
    assert!(
        out.len().is_multiple_of(ty.block_len()),
        "dequantize_row: {} weights is not a multiple of the {ty:?} block length",
        out.len()
    );
    assert_eq!(
        bytes.len(),
        ty.row_bytes(out.len()),
        "dequantize_row: byte length does not match {} {ty:?} weights",
        out.len()
    );
    match ty {
        WeightType::F32 => {
            for (b, o) in bytes.chunks_exact(4).zip(out.iter_mut()) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        WeightType::F16 => {
            for (b, o) in bytes.chunks_exact(2).zip(out.iter_mut()) {
                *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        _ => {
            for (b, o) in out.chunks_exact_mut(QK).enumerate() {
                crate::blocks::dequantize_block(ty, bytes, b, o);
            }
        }
    }
}

/// Quantises one row of `f32` weights into raw GGUF bytes of type `ty`
/// (reference quantiser, as in ggml's `quantize_row_*_ref`). Used by tests
/// and benchmarks to build weight matrices; not optimised.
pub fn quantize_row(ty: WeightType, x: &[f32], out: &mut Vec<u8>) {
    assert!(
        x.len().is_multiple_of(ty.block_len()),
        "quantize_row: length not a multiple of the block length"
    );
    let h = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
    match ty {
        WeightType::Q4_0 => {
            for blk in x.chunks_exact(QK) {
                // ggml: d = max / -8 where max is the value of largest magnitude.
                let max = largest_magnitude(blk);
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&h(d));
                for j in 0..16 {
                    let q0 = ((blk[j] * id + 8.5) as i32).clamp(0, 15) as u8;
                    let q1 = ((blk[j + 16] * id + 8.5) as i32).clamp(0, 15) as u8;
                    out.push(q0 | (q1 << 4));
                }
            }
        }
        WeightType::Q4_1 => {
            for blk in x.chunks_exact(QK) {
                let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
                let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&h(d));
                out.extend_from_slice(&h(min));
                for j in 0..16 {
                    let q0 = (((blk[j] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                    let q1 = (((blk[j + 16] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
                    out.push(q0 | (q1 << 4));
                }
            }
        }
        WeightType::Q5_0 => {
            for blk in x.chunks_exact(QK) {
                let max = largest_magnitude(blk);
                let d = max / -16.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                // ggml truncates `x·id + 16.5` to i8, then caps at 31.
                let q: Vec<u8> = blk
                    .iter()
                    .map(|&v| ((v * id + 16.5) as i8).min(31) as u8)
                    .collect();
                out.extend_from_slice(&h(d));
                push_q5(&q, out);
            }
        }
        WeightType::Q5_1 => {
            for blk in x.chunks_exact(QK) {
                let min = blk.iter().copied().fold(f32::INFINITY, f32::min);
                let max = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (max - min) / 31.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q: Vec<u8> = blk
                    .iter()
                    .map(|&v| ((v - min) * id + 0.5) as i8 as u8)
                    .collect();
                out.extend_from_slice(&h(d));
                out.extend_from_slice(&h(min));
                push_q5(&q, out);
            }
        }
        WeightType::Q4_K | WeightType::Q5_K | WeightType::Q6_K => {
            crate::kquantize::quantize_row(ty, x, out);
        }
        WeightType::Q8_0 => {
            for blk in x.chunks_exact(QK) {
                let amax = blk.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&h(d));
                for &v in blk {
                    out.push((v * id).round().clamp(-127.0, 127.0) as i8 as u8);
                }
            }
        }
        WeightType::F32 => {
            for &v in x {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        WeightType::F16 => {
            for &v in x {
                out.extend_from_slice(&h(v));
            }
        }
    }
}

/// The value of largest magnitude (the first of equals), as ggml's
/// symmetric quantisers pick it.
fn largest_magnitude(blk: &[f32]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in blk {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// Packs 32 five-bit codes as Q5_0/Q5_1 store them: `u32` of fifth bits
/// (bit `j` = weight `j`), then nibbles (low = weight `j`, high = `j + 16`).
fn push_q5(q: &[u8], out: &mut Vec<u8>) {
    let qh = q
        .iter()
        .enumerate()
        .fold(0u32, |h, (j, &c)| h | (u32::from(c >> 4) & 1) << j);
    out.extend_from_slice(&qh.to_le_bytes());
    for j in 0..16 {
        out.push((q[j] & 0x0F) | (q[j + 16] & 0x0F) << 4);
    }
}
