//! ggml tensor types and their block layouts.

use std::fmt;

use crate::kquants::{Q4_K_BLOCK_BYTES, Q5_K_BLOCK_BYTES, Q6_K_BLOCK_BYTES, QK_K};

/// Weights per block for the 32-weight block types (Q4_0 … Q8_0).
pub const QK: usize = 32;
/// Bytes of one Q4_0 block: f16 scale `d` + 16 bytes of nibbles.
pub const Q4_0_BLOCK_BYTES: usize = 18;
/// Bytes of one Q4_1 block: f16 scale `d`, f16 minimum `m`, 16 bytes of nibbles.
pub const Q4_1_BLOCK_BYTES: usize = 20;
/// Bytes of one Q8_0 block: f16 scale `d` + 32 signed bytes.
pub const Q8_0_BLOCK_BYTES: usize = 34;
/// Bytes of one Q5_0 block: f16 `d`, 4 bytes of fifth bits, 16 of nibbles.
pub const Q5_0_BLOCK_BYTES: usize = 22;
/// Bytes of one Q5_1 block: f16 `d`, f16 `m`, 4 bytes of fifth bits, 16 of nibbles.
pub const Q5_1_BLOCK_BYTES: usize = 24;

/// The ggml tensor types this crate reads.
///
/// Any other type id in a file is rejected at open time with
/// [`GgufError::UnsupportedTensorType`](crate::GgufError::UnsupportedTensorType).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit IEEE float, id 0.
    F32,
    /// 16-bit IEEE float, id 1.
    F16,
    /// 4-bit symmetric blocks of 32, id 2.
    Q4_0,
    /// 4-bit blocks of 32 with scale and minimum, id 3.
    Q4_1,
    /// 5-bit symmetric blocks of 32, id 6.
    Q5_0,
    /// 5-bit blocks of 32 with scale and minimum, id 7.
    Q5_1,
    /// 8-bit symmetric blocks of 32, id 8.
    Q8_0,
    /// 4-bit super-blocks of 256 (scales and mins per 32), id 12.
    Q4_K,
    /// 5-bit super-blocks of 256, id 13.
    Q5_K,
    /// 6-bit super-blocks of 256 (an i8 scale per 16), id 14.
    Q6_K,
}

impl GgmlType {
    /// All supported types.
    pub const ALL: [GgmlType; 10] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    /// The ggml type id written in GGUF files.
    pub fn type_id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
        }
    }

    /// The type for a ggml type id, if supported.
    pub fn from_type_id(id: u32) -> Option<GgmlType> {
        match id {
            0 => Some(GgmlType::F32),
            1 => Some(GgmlType::F16),
            2 => Some(GgmlType::Q4_0),
            3 => Some(GgmlType::Q4_1),
            6 => Some(GgmlType::Q5_0),
            7 => Some(GgmlType::Q5_1),
            8 => Some(GgmlType::Q8_0),
            12 => Some(GgmlType::Q4_K),
            13 => Some(GgmlType::Q5_K),
            14 => Some(GgmlType::Q6_K),
            _ => None,
        }
    }

    /// ggml's name of the type (`"Q4_1"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
        }
    }

    /// `(weights_per_block, bytes_per_block)`; see [`type_block_size`].
    pub fn block_size(self) -> (usize, usize) {
        type_block_size(self)
    }

    /// Whether the type is a block-quantised type.
    pub fn is_quantized(self) -> bool {
        !matches!(self, GgmlType::F32 | GgmlType::F16)
    }

    /// Bytes taken by `n_weights` weights, or `None` if `n_weights` is not a
    /// whole number of blocks or the size overflows.
    pub fn bytes_for(self, n_weights: u64) -> Option<u64> {
        let (w, b) = type_block_size(self);
        let (w, b) = (w as u64, b as u64);
        if !n_weights.is_multiple_of(w) {
            return None;
        }
        (n_weights / w).checked_mul(b)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `(weights_per_block, bytes_per_block)` of a type: F32 `(1, 4)`, F16
/// `(1, 2)`, Q4_0 `(32, 18)`, Q4_1 `(32, 20)`, Q5_0 `(32, 22)`, Q5_1
/// `(32, 24)`, Q8_0 `(32, 34)`, Q4_K `(256, 144)`, Q5_K `(256, 176)`, Q6_K
/// `(256, 210)`.
pub fn type_block_size(t: GgmlType) -> (usize, usize) {
    match t {
        GgmlType::F32 => (1, 4),
        GgmlType::F16 => (1, 2),
        GgmlType::Q4_0 => (QK, Q4_0_BLOCK_BYTES),
        GgmlType::Q4_1 => (QK, Q4_1_BLOCK_BYTES),
        GgmlType::Q5_0 => (QK, Q5_0_BLOCK_BYTES),
        GgmlType::Q5_1 => (QK, Q5_1_BLOCK_BYTES),
        GgmlType::Q8_0 => (QK, Q8_0_BLOCK_BYTES),
        GgmlType::Q4_K => (QK_K, Q4_K_BLOCK_BYTES),
        GgmlType::Q5_K => (QK_K, Q5_K_BLOCK_BYTES),
        GgmlType::Q6_K => (QK_K, Q6_K_BLOCK_BYTES),
    }
}

/// ggml's name for any known type id, supported or not (e.g. 12 → `"Q4_K"`).
pub fn ggml_type_name(type_id: u32) -> Option<&'static str> {
    Some(match type_id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        4 => "Q4_2 (removed)",
        5 => "Q4_3 (removed)",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        31 => "Q4_0_4_4 (removed)",
        32 => "Q4_0_4_8 (removed)",
        33 => "Q4_0_8_8 (removed)",
        34 => "TQ1_0",
        35 => "TQ2_0",
        36 => "IQ4_NL_4_4 (removed)",
        37 => "IQ4_NL_4_8 (removed)",
        38 => "IQ4_NL_8_8 (removed)",
        39 => "MXFP4",
        40 => "NVFP4",
        41 => "Q1_0",
        _ => return None,
    })
}
