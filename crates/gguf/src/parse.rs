//! The GGUF parser: a bounds-checked cursor over the file bytes.
//!
//! Every read checks the bytes left first, every count is bounded both by a
//! fixed limit and by the bytes left in the file before anything is
//! allocated, and arithmetic on file-supplied numbers is checked.

use std::collections::{BTreeMap, HashMap};

use crate::error::{GgufError, Result};
use crate::types::{ggml_type_name, GgmlType};
use crate::value::{Value, ValueType};
use crate::TensorInfo;

/// `"GGUF"` as read little-endian.
pub(crate) const MAGIC: [u8; 4] = *b"GGUF";
/// Default data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Largest metadata key or tensor name accepted, in bytes.
pub const MAX_KEY_LEN: u64 = 1 << 16;
/// Largest metadata string value accepted, in bytes.
pub const MAX_STRING_LEN: u64 = 1 << 28;
/// Largest array length accepted (elements).
pub const MAX_ARRAY_LEN: u64 = 1 << 22;
/// Largest total number of array elements over all metadata.
pub const MAX_TOTAL_ARRAY_ELEMENTS: u64 = 1 << 23;
/// Deepest array nesting accepted.
pub const MAX_ARRAY_DEPTH: u32 = 8;
/// Most metadata key/value pairs accepted.
pub const MAX_KV_COUNT: u64 = 1 << 20;
/// Most tensors accepted.
pub const MAX_TENSOR_COUNT: u64 = 1 << 20;
/// Most dimensions of one tensor (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// Largest alignment accepted.
pub const MAX_ALIGNMENT: u64 = 1 << 20;

pub(crate) struct Parsed {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    pub tensor_index: HashMap<String, usize>,
    pub alignment: u64,
    pub data_offset: u64,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    array_elements: u64,
}

impl<'a> Cursor<'a> {
    fn file_len(&self) -> u64 {
        self.buf.len() as u64
    }

    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn truncated(&self, what: &'static str, needed: u64) -> GgufError {
        GgufError::Truncated {
            what,
            offset: self.pos as u64,
            needed,
            file_len: self.file_len(),
        }
    }

    fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.truncated(what, n));
        }
        // n <= remaining <= usize::MAX, so the conversion cannot fail.
        let n = usize::try_from(n).map_err(|_| self.truncated(what, n))?;
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N]> {
        let bytes = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &'static str, limit: u64) -> Result<String> {
        let len = self.u64(what)?;
        if len > limit {
            return Err(GgufError::LimitExceeded {
                what,
                value: len,
                limit,
            });
        }
        let offset = self.pos as u64;
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::InvalidUtf8 { what, offset }),
        }
    }

    fn value_type(&mut self, what: &'static str) -> Result<ValueType> {
        let offset = self.pos as u64;
        let id = self.u32(what)?;
        ValueType::from_id(id).ok_or(GgufError::InvalidValueType {
            type_id: id,
            offset,
        })
    }

    fn value(&mut self, ty: ValueType, depth: u32) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.u8("u8 value")?),
            ValueType::I8 => Value::I8(self.u8("i8 value")? as i8),
            ValueType::U16 => Value::U16(self.u16("u16 value")?),
            ValueType::I16 => Value::I16(self.u16("i16 value")? as i16),
            ValueType::U32 => Value::U32(self.u32("u32 value")?),
            ValueType::I32 => Value::I32(self.u32("i32 value")? as i32),
            ValueType::U64 => Value::U64(self.u64("u64 value")?),
            ValueType::I64 => Value::I64(self.u64("i64 value")? as i64),
            ValueType::F32 => Value::F32(f32::from_bits(self.u32("f32 value")?)),
            ValueType::F64 => Value::F64(f64::from_bits(self.u64("f64 value")?)),
            ValueType::Bool => {
                let offset = self.pos as u64;
                match self.u8("bool value")? {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    value => return Err(GgufError::InvalidBool { value, offset }),
                }
            }
            ValueType::String => Value::String(self.string("string value", MAX_STRING_LEN)?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::LimitExceeded {
                        what: "array nesting depth",
                        value: u64::from(depth) + 1,
                        limit: u64::from(MAX_ARRAY_DEPTH),
                    });
                }
                let elem = self.value_type("array element type")?;
                let count = self.u64("array length")?;
                if count > MAX_ARRAY_LEN {
                    return Err(GgufError::LimitExceeded {
                        what: "array length",
                        value: count,
                        limit: MAX_ARRAY_LEN,
                    });
                }
                // Every element takes at least this many bytes: refuse counts
                // the rest of the file cannot hold before allocating anything.
                let min_bytes = count.saturating_mul(elem.min_encoded_size());
                if min_bytes > self.remaining() {
                    return Err(self.truncated("array elements", min_bytes));
                }
                self.array_elements = self.array_elements.saturating_add(count);
                if self.array_elements > MAX_TOTAL_ARRAY_ELEMENTS {
                    return Err(GgufError::LimitExceeded {
                        what: "total metadata array elements",
                        value: self.array_elements,
                        limit: MAX_TOTAL_ARRAY_ELEMENTS,
                    });
                }
                // Grow with what is actually parsed rather than trusting count.
                let mut items = Vec::with_capacity(count.min(1 << 16) as usize);
                for _ in 0..count {
                    items.push(self.value(elem, depth + 1)?);
                }
                Value::Array(items)
            }
        })
    }
}

fn align_up(x: u64, align: u64) -> Option<u64> {
    // align is a non-zero power of two.
    x.checked_add(align - 1).map(|v| v & !(align - 1))
}

fn check_count(what: &'static str, value: u64, limit: u64) -> Result<()> {
    if value > limit {
        Err(GgufError::LimitExceeded { what, value, limit })
    } else {
        Ok(())
    }
}

pub(crate) fn parse(buf: &[u8]) -> Result<Parsed> {
    let mut c = Cursor {
        buf,
        pos: 0,
        array_elements: 0,
    };
    let magic: [u8; 4] = c.array("magic")?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32("version")?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let tensor_count = c.u64("tensor count")?;
    let kv_count = c.u64("metadata kv count")?;
    check_count("tensor count", tensor_count, MAX_TENSOR_COUNT)?;
    check_count("metadata kv count", kv_count, MAX_KV_COUNT)?;
    // A kv takes >= 8 (key len) + 4 (type) + 1 bytes; a tensor info >= 8 + 4 + 4 + 8.
    let min_bytes = kv_count
        .saturating_mul(13)
        .saturating_add(tensor_count.saturating_mul(24));
    if min_bytes > c.remaining() {
        return Err(c.truncated("metadata and tensor infos", min_bytes));
    }

    let mut metadata = BTreeMap::new();
    for _ in 0..kv_count {
        let key = c.string("metadata key", MAX_KEY_LEN)?;
        let ty = c.value_type("metadata value type")?;
        let value = c.value(ty, 0)?;
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.insert(key, value);
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => {
            let a = v.as_u64().ok_or_else(|| GgufError::WrongType {
                key: "general.alignment".into(),
                expected: "unsigned integer",
                found: v.type_description(),
            })?;
            if a == 0 || !a.is_power_of_two() || a > MAX_ALIGNMENT {
                return Err(GgufError::BadAlignment(a));
            }
            a
        }
    };

    let mut tensors = Vec::with_capacity(tensor_count.min(1 << 12) as usize);
    let mut tensor_index = HashMap::with_capacity(tensors.capacity());
    for _ in 0..tensor_count {
        let name = c.string("tensor name", MAX_KEY_LEN)?;
        let n_dims = c.u32("tensor dimension count")?;
        if n_dims > MAX_DIMS {
            return Err(GgufError::InvalidTensor {
                name,
                reason: format!("{n_dims} dimensions, at most {MAX_DIMS} allowed"),
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64("tensor dimension")?);
        }
        let type_id = c.u32("tensor type")?;
        let offset = c.u64("tensor offset")?;
        let ggml_type =
            GgmlType::from_type_id(type_id).ok_or_else(|| GgufError::UnsupportedTensorType {
                name: name.clone(),
                type_id,
                type_name: ggml_type_name(type_id),
            })?;
        let info = TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
        };
        validate_shape(&info)?;
        if offset % alignment != 0 {
            return Err(GgufError::InvalidTensor {
                name: info.name,
                reason: format!("offset {offset} is not a multiple of the alignment {alignment}"),
            });
        }
        if tensor_index.contains_key(&info.name) {
            return Err(GgufError::DuplicateTensor(info.name));
        }
        tensor_index.insert(info.name.clone(), tensors.len());
        tensors.push(info);
    }

    let data_offset = align_up(c.pos as u64, alignment).ok_or(GgufError::LimitExceeded {
        what: "data offset",
        value: c.pos as u64,
        limit: u64::MAX - alignment,
    })?;

    let file_len = c.file_len();
    for t in &tensors {
        // validate_shape guaranteed the size computes.
        let size = t.byte_size();
        let start = data_offset.checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(size));
        match (start, end) {
            (Some(_), Some(end)) if end <= file_len => {}
            _ => {
                return Err(GgufError::TensorOutOfBounds {
                    name: t.name.clone(),
                    start: data_offset.saturating_add(t.offset),
                    size,
                    file_len,
                })
            }
        }
    }

    Ok(Parsed {
        version,
        metadata,
        tensors,
        tensor_index,
        alignment,
        data_offset,
    })
}

/// Checks dims are sane, the element count and byte size compute without
/// overflow, and rows are whole blocks.
fn validate_shape(t: &TensorInfo) -> Result<()> {
    let bad = |reason: String| GgufError::InvalidTensor {
        name: t.name.clone(),
        reason,
    };
    let mut n: u64 = 1;
    for &d in &t.dims {
        if d > i64::MAX as u64 {
            return Err(bad(format!("dimension {d} exceeds i64::MAX")));
        }
        n = n
            .checked_mul(d)
            .ok_or_else(|| bad(format!("element count of dims {:?} overflows", t.dims)))?;
    }
    if n > i64::MAX as u64 {
        return Err(bad(format!("element count {n} exceeds i64::MAX")));
    }
    let (w, _) = t.ggml_type.block_size();
    let cols = t.dims.first().copied().unwrap_or(1);
    if cols % w as u64 != 0 {
        return Err(bad(format!(
            "row length {cols} is not a multiple of the {} block size {w}",
            t.ggml_type
        )));
    }
    if t.ggml_type.bytes_for(n).is_none() {
        return Err(bad(format!("byte size of {n} elements overflows")));
    }
    Ok(())
}
