//! Writing GGUF files: a [`GgufWriter`] and ggml's reference quantisers.
//! The synthetic test model built with them lives in the `testkit` crate
//! (`testkit::synthetic`), which only tests depend on.

use std::path::Path;

use half::f16;

use crate::dequant::check_sizes;
use crate::error::{GgufError, Result};
use crate::types::{GgmlType, QK};
use crate::value::{Value, ValueType};
use crate::DEFAULT_ALIGNMENT;

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    data: Vec<u8>,
}

/// Builds a GGUF file in memory; [`write`](GgufWriter::write) or
/// [`to_bytes`](GgufWriter::to_bytes) lays it out. Metadata and tensors are
/// written in insertion order.
pub struct GgufWriter {
    version: u32,
    kvs: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty GGUF v3 file.
    pub fn new() -> Self {
        GgufWriter {
            version: 3,
            kvs: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Sets the version written in the header (any value: invalid versions
    /// are useful for tests).
    pub fn set_version(&mut self, version: u32) -> &mut Self {
        self.version = version;
        self
    }

    /// Sets `general.alignment` (as `u32`), which also sets the alignment the
    /// data is laid out with.
    pub fn set_alignment(&mut self, alignment: u32) -> &mut Self {
        self.add_kv("general.alignment", Value::U32(alignment))
    }

    /// Adds (or replaces) a metadata key/value.
    pub fn add_kv(&mut self, key: impl Into<String>, value: impl Into<Value>) -> &mut Self {
        let key = key.into();
        let value = value.into();
        match self.kvs.iter_mut().find(|(k, _)| *k == key) {
            Some(slot) => slot.1 = value,
            None => self.kvs.push((key, value)),
        }
        self
    }

    /// Adds a tensor from its raw encoded bytes; checks the size matches.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> Result<&mut Self> {
        let name = name.into();
        let n = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let expected = n.and_then(|n| ty.bytes_for(n)).ok_or_else(|| {
            GgufError::InvalidArgument(format!(
                "tensor {name:?}: dims {dims:?} are not whole {ty} blocks or overflow"
            ))
        })?;
        if expected != data.len() as u64 {
            return Err(GgufError::SizeMismatch {
                what: "tensor data",
                expected,
                actual: data.len() as u64,
            });
        }
        Ok(self.add_tensor_unchecked(name, dims, ty.type_id(), data))
    }

    /// Adds a tensor from f32 values, encoding them as `ty` (quantising
    /// row by row with ggml's reference quantisers).
    pub fn add_tensor_f32(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        values: &[f32],
    ) -> Result<&mut Self> {
        let data = quantize(ty, values)?;
        self.add_tensor(name, dims, ty, data)
    }

    /// Adds a tensor with any type id and any bytes, unchecked: for building
    /// invalid files in tests.
    pub fn add_tensor_unchecked(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        type_id: u32,
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors.push(PendingTensor {
            name: name.into(),
            dims: dims.to_vec(),
            type_id,
            data,
        });
        self
    }

    fn alignment(&self) -> Result<u64> {
        match self.kvs.iter().find(|(k, _)| k == "general.alignment") {
            None => Ok(DEFAULT_ALIGNMENT),
            Some((_, v)) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => Ok(a),
                _ => Err(GgufError::InvalidArgument(format!(
                    "general.alignment {v:?} is not a non-zero power of two"
                ))),
            },
        }
    }

    /// Lays the file out in memory.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let align = self.alignment()?;
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            put_str(&mut out, k);
            out.extend_from_slice(&v.value_type().id().to_le_bytes());
            put_value(&mut out, v)?;
        }
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = align_up(offset + t.data.len() as u64, align);
        }
        pad_to(&mut out, align);
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            pad_to(&mut out, align);
        }
        Ok(out)
    }

    /// Writes the file to `path`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = self.to_bytes()?;
        std::fs::write(path, bytes).map_err(|source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        })
    }
}

fn align_up(x: u64, align: u64) -> u64 {
    x.div_ceil(align) * align
}

fn pad_to(out: &mut Vec<u8>, align: u64) {
    let len = align_up(out.len() as u64, align) as usize;
    out.resize(len, 0);
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) -> Result<()> {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_bits().to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_bits().to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(items) => {
            let elem = items.first().map_or(ValueType::U8, Value::value_type);
            if let Some(bad) = items.iter().find(|i| i.value_type() != elem) {
                return Err(GgufError::InvalidArgument(format!(
                    "array mixes {} and {} elements",
                    elem.name(),
                    bad.value_type().name()
                )));
            }
            out.extend_from_slice(&elem.id().to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                put_value(out, i)?;
            }
        }
    }
    Ok(())
}

#[inline]
fn put_f16(out: &mut Vec<u8>, x: f32) {
    out.extend_from_slice(&f16::from_f32(x).to_bits().to_le_bytes());
}

fn whole_blocks(t: GgmlType, x: &[f32]) -> Result<()> {
    let (w, b) = t.block_size();
    check_sizes(t, x.len(), x.len() / w * b, "quantize input length")
}

/// ggml's `quantize_row_q4_0_ref`: `x.len()` must be a multiple of 32.
pub fn quantize_row_q4_0(x: &[f32]) -> Result<Vec<u8>> {
    whole_blocks(GgmlType::Q4_0, x)?;
    let mut out = Vec::with_capacity(x.len() / QK * 18);
    for blk in x.chunks_exact(QK) {
        let mut amax = 0.0f32;
        let mut max = 0.0f32;
        for &v in blk {
            if amax < v.abs() {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(&mut out, d);
        for j in 0..QK / 2 {
            let q = |v: f32| ((v * id + 8.5) as i8).clamp(0, 15) as u8;
            out.push(q(blk[j]) | (q(blk[j + QK / 2]) << 4));
        }
    }
    Ok(out)
}

/// ggml's `quantize_row_q4_1_ref`: `x.len()` must be a multiple of 32.
pub fn quantize_row_q4_1(x: &[f32]) -> Result<Vec<u8>> {
    whole_blocks(GgmlType::Q4_1, x)?;
    let mut out = Vec::with_capacity(x.len() / QK * 20);
    for blk in x.chunks_exact(QK) {
        let mut min = f32::MAX;
        let mut max = -f32::MAX;
        for &v in blk {
            if v < min {
                min = v;
            }
            if v > max {
                max = v;
            }
        }
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(&mut out, d);
        put_f16(&mut out, min);
        for j in 0..QK / 2 {
            let q = |v: f32| (((v - min) * id + 0.5) as i8).clamp(0, 15) as u8;
            out.push(q(blk[j]) | (q(blk[j + QK / 2]) << 4));
        }
    }
    Ok(out)
}

/// ggml's `quantize_row_q8_0_ref`: `x.len()` must be a multiple of 32.
pub fn quantize_row_q8_0(x: &[f32]) -> Result<Vec<u8>> {
    whole_blocks(GgmlType::Q8_0, x)?;
    let mut out = Vec::with_capacity(x.len() / QK * 34);
    for blk in x.chunks_exact(QK) {
        let amax = blk.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        put_f16(&mut out, d);
        for &v in blk {
            out.push(((v * id).round() as i8) as u8);
        }
    }
    Ok(out)
}

/// Encodes `x` as type `t` (F32: little-endian bytes; F16: round to nearest
/// even; quantised types: ggml's reference quantisers).
pub fn quantize(t: GgmlType, x: &[f32]) -> Result<Vec<u8>> {
    match t {
        GgmlType::F32 => Ok(x.iter().flat_map(|v| v.to_le_bytes()).collect()),
        GgmlType::F16 => {
            let mut out = Vec::with_capacity(x.len() * 2);
            for &v in x {
                put_f16(&mut out, v);
            }
            Ok(out)
        }
        GgmlType::Q4_0 => quantize_row_q4_0(x),
        GgmlType::Q4_1 => quantize_row_q4_1(x),
        GgmlType::Q8_0 => quantize_row_q8_0(x),
        // Their quantisers live with the kernels (`kernels::quantize_row`);
        // add their bytes with `add_tensor`.
        GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
            Err(GgufError::InvalidArgument(format!(
                "the writer does not quantise {t}: quantise with kernels::quantize_row and add the bytes"
            )))
        }
    }
}

/// The byte-level (GPT-2) character standing for each byte.
pub fn gpt2_byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..256u32 {
        let printable =
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let cp = if printable {
            b
        } else {
            extra += 1;
            255 + extra
        };
        out[b as usize] = char::from_u32(cp).unwrap_or('\u{FFFD}');
    }
    out
}

/// A model of some of `file`'s blocks — `keep`, in order, renumbered
/// from 0 — and everything that is not a block (embeddings, the final
/// norm, the output head, the tokenizer): a draft for self-speculation
/// (the first layers, or the first and the last, skipping the middle),
/// with the model's own vocabulary by construction. Metadata is copied
/// but the block count (`{arch}.block_count`), and the model's name says
/// which layers it kept.
pub fn select_layers(file: &crate::GgufFile, keep: &[usize]) -> Result<GgufWriter> {
    let arch = file.get_str("general.architecture")?.to_string();
    let count_key = format!("{arch}.block_count");
    let blocks = file.get_u64(&count_key)?;
    if keep.is_empty() || keep.iter().any(|&l| l as u64 >= blocks) {
        return Err(GgufError::InvalidArgument(format!(
            "layers {keep:?}: the model has {blocks} (0..{blocks})"
        )));
    }
    if keep.windows(2).any(|w| w[0] >= w[1]) {
        return Err(GgufError::InvalidArgument(format!(
            "layers {keep:?}: give each once, in increasing order"
        )));
    }
    // Per-layer metadata arrays (Gemma's sliding-window pattern, some
    // models' per-layer head counts) are kept for the kept layers.
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata() {
        let v = match v {
            Value::Array(items)
                if k.starts_with(&format!("{arch}.")) && items.len() as u64 == blocks =>
            {
                Value::Array(keep.iter().map(|&l| items[l].clone()).collect())
            }
            _ => v.clone(),
        };
        w.add_kv(k.clone(), v);
    }
    w.add_kv(count_key, Value::U32(keep.len() as u32));
    // Gemma 3's sliding-window layers given by a period (every `period`-th
    // layer global; 6 if unsaid, as `model::Config` reads it) are the
    // kept layers' own roles after renumbering only by chance: where the
    // period would give a kept layer another role, the roles are written
    // out, one flag a layer.
    let swa = format!("{arch}.attention.sliding_window_pattern");
    if file.contains_key(&format!("{arch}.attention.sliding_window"))
        && !matches!(file.get(&swa), Some(Value::Array(_)))
    {
        let period = file.get_u64(&swa).unwrap_or(6) as usize;
        let local = |l: usize| period == 0 || l % period < period - 1;
        if keep
            .iter()
            .enumerate()
            .any(|(new, &old)| local(new) != local(old))
        {
            let flags = keep.iter().map(|&l| Value::Bool(local(l))).collect();
            w.add_kv(swa, Value::Array(flags));
        }
    }
    let name = file.get_str("general.name").unwrap_or("model").to_string();
    w.add_kv(
        "general.name",
        Value::String(format!("{name} (layers {keep:?} of {blocks})")),
    );
    for t in file.tensors() {
        let block = t
            .name
            .strip_prefix("blk.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(n, rest)| Some((n.parse::<usize>().ok()?, rest)));
        let name = match block {
            None => t.name.clone(),
            Some((b, rest)) => match keep.iter().position(|&l| l == b) {
                Some(new) => format!("blk.{new}.{rest}"),
                None => continue,
            },
        };
        let data = file.tensor(&t.name)?.bytes().to_vec();
        w.add_tensor(name, &t.dims, t.ggml_type, data)?;
    }
    Ok(w)
}
