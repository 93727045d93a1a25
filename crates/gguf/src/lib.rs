//! A zero-copy reader for GGUF v2/v3 model files.
//!
//! [`GgufFile::open`] memory-maps a file and parses the header, every
//! metadata key/value (all GGUF value types, nested arrays included) and every
//! tensor description. Tensor data is never copied: [`GgufFile::tensor`]
//! returns a [`TensorView`] whose [`bytes`](TensorView::bytes) borrow the map.
//!
//! Parsing is defensive: every read is bounds-checked, counts and lengths are
//! capped (and checked against the bytes left before anything is allocated),
//! every tensor's byte range must lie inside the file, and only the tensor
//! types [`GgmlType`] lists (F32, F16, Q4_0, Q4_1, Q8_0) are accepted. Any
//! malformed input gives a typed [`GgufError`], never a panic.
//!
//! [`dequantize_row`] is a scalar reference dequantiser, bit-exact with ggml
//! and the `gguf` Python package. The [`write`](mod@write) module writes GGUF files
//! (for tests), including a tiny random LLaMA model shaped like the real one.
//!
//! ```no_run
//! use gguf::{GgufFile, GgmlType};
//!
//! # fn main() -> Result<(), gguf::GgufError> {
//! let file = GgufFile::open("/root/.cache/isoserve/SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! assert_eq!(file.get_str("general.architecture")?, "llama");
//! let n_layers = file.get_u32("llama.block_count")?;
//! let eps = file.get_f32("llama.attention.layer_norm_rms_epsilon")?;
//!
//! let wq = file.tensor("blk.0.attn_q.weight")?;
//! assert_eq!(wq.ggml_type(), GgmlType::Q4_1);
//! let mut row = vec![0.0f32; wq.cols() as usize];
//! gguf::dequantize_row(wq.ggml_type(), wq.row_bytes(0)?, &mut row)?;
//! println!("{n_layers} layers, eps {eps}, wq[0][0] = {}", row[0]);
//! # Ok(())
//! # }
//! ```

#![forbid(unsafe_op_in_unsafe_fn)]

mod dequant;
mod error;
pub mod kquants;
mod parse;
mod types;
mod value;
pub mod write;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

pub use dequant::{dequantize, dequantize_row};
pub use error::{GgufError, Result};
pub use parse::{
    DEFAULT_ALIGNMENT, MAX_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_ARRAY_LEN, MAX_DIMS, MAX_KEY_LEN,
    MAX_KV_COUNT, MAX_STRING_LEN, MAX_TENSOR_COUNT, MAX_TOTAL_ARRAY_ELEMENTS,
};
pub use types::{
    ggml_type_name, type_block_size, GgmlType, Q4_0_BLOCK_BYTES, Q4_1_BLOCK_BYTES,
    Q8_0_BLOCK_BYTES, QK,
};
pub use value::{Value, ValueType};

/// Description of one tensor in a GGUF file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Shape in ggml order: `dims[0]` is the contiguous row length.
    pub dims: Vec<u64>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Offset of the data relative to the start of the data section
    /// ([`GgufFile::data_offset`]).
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements (product of the dims; 1 for zero dims).
    pub fn n_elements(&self) -> u64 {
        // Overflow was ruled out when the file was opened; saturate anyway
        // for infos built by hand.
        self.dims.iter().fold(1u64, |a, &d| a.saturating_mul(d))
    }

    /// Row length (`dims[0]`, or 1 for a zero-dimensional tensor).
    pub fn cols(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows: the product of `dims[1..]`.
    pub fn rows(&self) -> u64 {
        self.dims
            .iter()
            .skip(1)
            .fold(1u64, |a, &d| a.saturating_mul(d))
    }

    /// Size in bytes of the tensor's data.
    pub fn byte_size(&self) -> u64 {
        self.ggml_type
            .bytes_for(self.n_elements())
            .unwrap_or(u64::MAX)
    }

    /// Size in bytes of one row.
    pub fn row_byte_size(&self) -> u64 {
        self.ggml_type.bytes_for(self.cols()).unwrap_or(u64::MAX)
    }
}

enum Backing {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// An opened, validated GGUF file.
pub struct GgufFile {
    backing: Backing,
    path: Option<PathBuf>,
    version: u32,
    metadata: BTreeMap<String, Value>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("file_len", &self.file_len())
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses a GGUF file.
    ///
    /// The file must not be modified while the returned value (or any view
    /// borrowed from it) is alive.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let backing = if len == 0 {
            // Mapping an empty file fails on some platforms; parse reports
            // the truncation.
            Backing::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only and the documented contract is that
            // the file is not modified while mapped. All accesses are
            // bounds-checked against the map's length.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
            Backing::Mmap(map)
        };
        Self::from_backing(backing, Some(path.to_path_buf()))
    }

    /// Parses a GGUF file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        Self::from_backing(Backing::Owned(bytes), None)
    }

    fn from_backing(backing: Backing, path: Option<PathBuf>) -> Result<GgufFile> {
        let p = parse::parse(backing.bytes())?;
        Ok(GgufFile {
            backing,
            path,
            version: p.version,
            metadata: p.metadata,
            tensors: p.tensors,
            tensor_index: p.tensor_index,
            alignment: p.alignment,
            data_offset: p.data_offset,
        })
    }

    /// The path the file was opened from (`None` for [`from_bytes`](Self::from_bytes)).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Total file length in bytes.
    pub fn file_len(&self) -> u64 {
        self.backing.bytes().len() as u64
    }

    /// Data alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset of the tensor data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// All metadata, sorted by key.
    pub fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.metadata
    }

    /// One metadata value, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// Whether a metadata key is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.metadata.contains_key(key)
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.metadata
            .get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    fn typed<'s, T>(
        &'s self,
        key: &str,
        expected: &'static str,
        f: impl FnOnce(&'s Value) -> Option<T>,
    ) -> Result<T> {
        let v = self.require(key)?;
        f(v).ok_or_else(|| GgufError::WrongType {
            key: key.to_string(),
            expected,
            found: describe(v),
        })
    }

    /// A metadata integer of any integer type whose value fits in `u32`.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.typed(key, "integer fitting u32", Value::as_u32)
    }

    /// A metadata integer of any integer type whose value fits in `u64`.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.typed(key, "integer fitting u64", Value::as_u64)
    }

    /// A metadata integer of any integer type whose value fits in `i32`.
    pub fn get_i32(&self, key: &str) -> Result<i32> {
        self.typed(key, "integer fitting i32", Value::as_i32)
    }

    /// A metadata integer of any integer type whose value fits in `i64`.
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.typed(key, "integer fitting i64", Value::as_i64)
    }

    /// A metadata float (`f32`, or `f64` rounded).
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.typed(key, "float", Value::as_f32)
    }

    /// A metadata float (`f64`, or `f32` widened).
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.typed(key, "float", Value::as_f64)
    }

    /// A metadata bool.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.typed(key, "bool", Value::as_bool)
    }

    /// A metadata string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.typed(key, "string", Value::as_str)
    }

    /// A metadata array of any element type.
    pub fn get_array(&self, key: &str) -> Result<&[Value]> {
        self.typed(key, "array", Value::as_array)
    }

    /// A metadata array of strings (borrowed).
    pub fn get_string_array(&self, key: &str) -> Result<Vec<&str>> {
        self.typed(key, "array of string", |v| {
            v.as_array()?.iter().map(Value::as_str).collect()
        })
    }

    /// A metadata array of integers that each fit in `i32`.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>> {
        self.typed(key, "array of integers fitting i32", |v| {
            v.as_array()?.iter().map(Value::as_i32).collect()
        })
    }

    /// A metadata array of integers that each fit in `u32`.
    pub fn get_u32_array(&self, key: &str) -> Result<Vec<u32>> {
        self.typed(key, "array of integers fitting u32", |v| {
            v.as_array()?.iter().map(Value::as_u32).collect()
        })
    }

    /// A metadata array of floats.
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        self.typed(key, "array of floats", |v| {
            v.as_array()?.iter().map(Value::as_f32).collect()
        })
    }

    /// All tensor descriptions, in file order.
    /// SHA-256 over every tensor (name, type, dims, bytes) and every
    /// metadata entry except `general.*` (names and descriptions): two
    /// files with the same fingerprint have the same weights, quantisation,
    /// hyper-parameters (dims, rope) and tokenizer. Nodes that exchange KV
    /// compare it before pairing. Reads every tensor byte (≈0.3 s per
    /// 100 MB).
    pub fn fingerprint(&self) -> Result<[u8; 32]> {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(b"isoserve-model-fingerprint-v1");
        for (k, v) in self.metadata() {
            if k.starts_with("general.") {
                continue;
            }
            h.update((k.len() as u64).to_le_bytes());
            h.update(k.as_bytes());
            let v = format!("{v:?}");
            h.update((v.len() as u64).to_le_bytes());
            h.update(v.as_bytes());
        }
        for t in self.tensors() {
            let view = self.tensor(&t.name)?;
            h.update((t.name.len() as u64).to_le_bytes());
            h.update(t.name.as_bytes());
            h.update(format!("{:?}", view.ggml_type()).as_bytes());
            for d in view.dims() {
                h.update(d.to_le_bytes());
            }
            h.update((view.bytes().len() as u64).to_le_bytes());
            h.update(view.bytes());
        }
        Ok(h.finalize().into())
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// One tensor's description, if present.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// A zero-copy view of one tensor.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| GgufError::TensorNotFound(name.to_string()))?;
        let bytes = self.backing.bytes();
        let oob = || GgufError::TensorOutOfBounds {
            name: info.name.clone(),
            start: self.data_offset.saturating_add(info.offset),
            size: info.byte_size(),
            file_len: bytes.len() as u64,
        };
        // Validated at open; re-checked without panicking.
        let start = self
            .data_offset
            .checked_add(info.offset)
            .and_then(|s| usize::try_from(s).ok())
            .ok_or_else(oob)?;
        let size = usize::try_from(info.byte_size()).map_err(|_| oob())?;
        let data = start
            .checked_add(size)
            .and_then(|end| bytes.get(start..end))
            .ok_or_else(oob)?;
        Ok(TensorView { info, data })
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::Array(items) => format!("{} (len {})", v.type_description(), items.len()),
        Value::F32(x) => format!("f32 {x}"),
        Value::F64(x) => format!("f64 {x}"),
        Value::Bool(b) => format!("bool {b}"),
        other => match other.as_i128() {
            Some(i) => format!("{} {i}", other.type_description()),
            None => other.type_description(),
        },
    }
}

/// A zero-copy view of one tensor's data inside a [`GgufFile`].
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    info: &'a TensorInfo,
    data: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// The tensor's description.
    pub fn info(&self) -> &'a TensorInfo {
        self.info
    }

    /// Tensor name.
    pub fn name(&self) -> &'a str {
        &self.info.name
    }

    /// The raw data, borrowed from the file map.
    pub fn bytes(&self) -> &'a [u8] {
        self.data
    }

    /// Element type.
    pub fn ggml_type(&self) -> GgmlType {
        self.info.ggml_type
    }

    /// Shape in ggml order.
    pub fn dims(&self) -> &'a [u64] {
        &self.info.dims
    }

    /// Row length (`dims[0]`).
    pub fn cols(&self) -> u64 {
        self.info.cols()
    }

    /// Number of rows (product of `dims[1..]`).
    pub fn rows(&self) -> u64 {
        self.info.rows()
    }

    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.info.n_elements()
    }

    /// Bytes of one row.
    pub fn row_byte_size(&self) -> u64 {
        self.info.row_byte_size()
    }

    /// The raw bytes of row `row`.
    pub fn row_bytes(&self, row: u64) -> Result<&'a [u8]> {
        let rb = self.row_byte_size();
        let out_of_range = || {
            GgufError::InvalidArgument(format!(
                "row {row} out of range for tensor {:?} with {} rows",
                self.info.name,
                self.rows()
            ))
        };
        if row >= self.rows() {
            return Err(out_of_range());
        }
        let start = row
            .checked_mul(rb)
            .and_then(|s| usize::try_from(s).ok())
            .ok_or_else(out_of_range)?;
        let end = usize::try_from(rb)
            .ok()
            .and_then(|rb| start.checked_add(rb))
            .ok_or_else(out_of_range)?;
        self.data.get(start..end).ok_or_else(out_of_range)
    }

    /// Dequantises row `row` into `out` (`out.len()` must equal `cols()`).
    pub fn dequantize_row(&self, row: u64, out: &mut [f32]) -> Result<()> {
        dequantize_row(self.ggml_type(), self.row_bytes(row)?, out)
    }

    /// Dequantises the whole tensor.
    pub fn dequantize(&self) -> Result<Vec<f32>> {
        dequantize(self.ggml_type(), self.data)
    }
}
