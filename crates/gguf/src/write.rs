//! Writing GGUF files, for tests: a [`GgufWriter`], ggml's reference
//! quantisers, and [`write_synthetic_llama`], a tiny random LLaMA model laid
//! out like the real SmolLM2 file (same tensor names, metadata keys, tensor
//! types and tokenizer/chat-template keys).

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
    }
}

/// SmolLM2-135M-Instruct's chat template, verbatim.
pub const SMOLLM2_CHAT_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Shape and options of the synthetic model.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticConfig {
    /// `llama.block_count`.
    pub n_layers: u32,
    /// `llama.embedding_length`; a multiple of 32.
    pub dim: u32,
    /// `llama.attention.head_count`.
    pub n_heads: u32,
    /// `llama.attention.head_count_kv`; divides `n_heads`.
    pub n_kv_heads: u32,
    /// `llama.feed_forward_length`; a multiple of 32.
    pub ffn_dim: u32,
    /// `llama.context_length`.
    pub context_length: u32,
    /// `llama.rope.freq_base`.
    pub rope_freq_base: f32,
    /// `llama.attention.layer_norm_rms_epsilon`.
    pub rms_eps: f32,
    /// Type of the projection and FFN matrices (the real file: Q4_1).
    pub matrix_type: GgmlType,
    /// Type of `token_embd.weight` (the real file: Q8_0).
    pub embedding_type: GgmlType,
    /// When false, an `output.weight` (type `matrix_type`) is written too;
    /// when true (as in the real file) the embeddings are tied.
    pub tied_embeddings: bool,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        SyntheticConfig {
            n_layers: 2,
            dim: 64,
            n_heads: 4,
            n_kv_heads: 2,
            ffn_dim: 128,
            context_length: 256,
            rope_freq_base: 10000.0,
            rms_eps: 1e-5,
            matrix_type: GgmlType::Q4_1,
            embedding_type: GgmlType::Q8_0,
            tied_embeddings: true,
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

/// Special tokens at the start of the synthetic vocabulary (ids 0, 1, 2).
pub const SYNTHETIC_SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Merges of the synthetic vocabulary, in rank order (byte-level strings).
pub const SYNTHETIC_MERGES: [(&str, &str); 17] = [
    ("Ġ", "t"),
    ("Ġ", "a"),
    ("h", "e"),
    ("i", "n"),
    ("Ġt", "he"),
    ("e", "r"),
    ("o", "n"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġw", "or"),
    ("l", "d"),
    ("Ġwor", "ld"),
    ("H", "e"),
    ("l", "l"),
    ("He", "ll"),
    ("Hell", "o"),
    ("Ġ", "Ġ"),
];

/// The synthetic vocabulary: `(tokens, token_types, merges)`. Ids 0..3 are
/// the special tokens (type 3, CONTROL), ids `3 + b` are the 256 byte tokens
/// in byte order, then one token per merge (type 1, NORMAL).
pub fn synthetic_vocab() -> (Vec<String>, Vec<i32>, Vec<String>) {
    let mut tokens: Vec<String> = SYNTHETIC_SPECIAL_TOKENS
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut types = vec![3i32; tokens.len()];
    for c in gpt2_byte_chars() {
        tokens.push(c.to_string());
        types.push(1);
    }
    let mut merges = Vec::new();
    for (a, b) in SYNTHETIC_MERGES {
        tokens.push(format!("{a}{b}"));
        types.push(1);
        merges.push(format!("{a} {b}"));
    }
    (tokens, types, merges)
}

/// SplitMix64: a small deterministic generator for the random weights.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn fill(&mut self, n: usize, scale: f32, bias: f32) -> Vec<f32> {
        (0..n).map(|_| bias + scale * self.uniform()).collect()
    }
}

fn check_config(cfg: &SyntheticConfig) -> Result<()> {
    let bad = |m: &str| Err(GgufError::InvalidArgument(format!("SyntheticConfig: {m}")));
    if cfg.n_layers == 0 || cfg.n_heads == 0 || cfg.n_kv_heads == 0 {
        return bad("n_layers, n_heads and n_kv_heads must be non-zero");
    }
    if cfg.dim == 0 || cfg.dim % 32 != 0 || cfg.ffn_dim == 0 || cfg.ffn_dim % 32 != 0 {
        return bad("dim and ffn_dim must be non-zero multiples of 32");
    }
    if cfg.dim % cfg.n_heads != 0 || (cfg.dim / cfg.n_heads) % 2 != 0 {
        return bad("dim / n_heads must be an even integer");
    }
    if cfg.n_heads % cfg.n_kv_heads != 0 {
        return bad("n_kv_heads must divide n_heads");
    }
    Ok(())
}

/// A writer holding the synthetic LLaMA model (see [`write_synthetic_llama`]);
/// tests may add or replace entries before writing.
pub fn synthetic_llama_writer(cfg: &SyntheticConfig, seed: u64) -> Result<GgufWriter> {
    check_config(cfg)?;
    let (tokens, types, merges) = synthetic_vocab();
    let n_vocab = tokens.len() as u64;
    let dim = u64::from(cfg.dim);
    let ffn = u64::from(cfg.ffn_dim);
    let head_dim = cfg.dim / cfg.n_heads;
    let kv_dim = u64::from(head_dim * cfg.n_kv_heads);

    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "llama")
        .add_kv("general.type", "model")
        .add_kv("general.name", "isoserve synthetic llama")
        .add_kv("llama.block_count", cfg.n_layers)
        .add_kv("llama.context_length", cfg.context_length)
        .add_kv("llama.embedding_length", cfg.dim)
        .add_kv("llama.feed_forward_length", cfg.ffn_dim)
        .add_kv("llama.attention.head_count", cfg.n_heads)
        .add_kv("llama.attention.head_count_kv", cfg.n_kv_heads)
        .add_kv("llama.rope.freq_base", cfg.rope_freq_base)
        .add_kv("llama.attention.layer_norm_rms_epsilon", cfg.rms_eps)
        .add_kv("general.file_type", 3u32)
        .add_kv("llama.vocab_size", n_vocab as u32)
        .add_kv("llama.rope.dimension_count", head_dim)
        .add_kv("tokenizer.ggml.add_space_prefix", false)
        .add_kv("tokenizer.ggml.add_bos_token", false)
        .add_kv("tokenizer.ggml.model", "gpt2")
        .add_kv("tokenizer.ggml.pre", "smollm")
        .add_kv("tokenizer.ggml.tokens", tokens)
        .add_kv("tokenizer.ggml.token_type", types)
        .add_kv("tokenizer.ggml.merges", merges)
        .add_kv("tokenizer.ggml.bos_token_id", 1u32)
        .add_kv("tokenizer.ggml.eos_token_id", 2u32)
        .add_kv("tokenizer.ggml.unknown_token_id", 0u32)
        .add_kv("tokenizer.ggml.padding_token_id", 2u32)
        .add_kv("tokenizer.chat_template", SMOLLM2_CHAT_TEMPLATE)
        .add_kv("general.quantization_version", 2u32);

    let mut rng = Rng(seed);
    let count = |a: u64, b: u64| (a * b) as usize;
    let emb = rng.fill(count(dim, n_vocab), 1.0, 0.0);
    w.add_tensor_f32(
        "token_embd.weight",
        &[dim, n_vocab],
        cfg.embedding_type,
        &emb,
    )?;
    let mt = cfg.matrix_type;
    // Uniform(-s, s) with s = sqrt(3 / fan_in) has variance 1 / fan_in.
    let scale = |fan_in: u64| (3.0 / fan_in as f32).sqrt();
    for l in 0..cfg.n_layers {
        let name = |t: &str| format!("blk.{l}.{t}.weight");
        let norm = rng.fill(dim as usize, 0.1, 1.0);
        w.add_tensor_f32(name("attn_norm"), &[dim], GgmlType::F32, &norm)?;
        let m = rng.fill(count(ffn, dim), scale(ffn), 0.0);
        w.add_tensor_f32(name("ffn_down"), &[ffn, dim], mt, &m)?;
        let m = rng.fill(count(dim, ffn), scale(dim), 0.0);
        w.add_tensor_f32(name("ffn_gate"), &[dim, ffn], mt, &m)?;
        let m = rng.fill(count(dim, ffn), scale(dim), 0.0);
        w.add_tensor_f32(name("ffn_up"), &[dim, ffn], mt, &m)?;
        let norm = rng.fill(dim as usize, 0.1, 1.0);
        w.add_tensor_f32(name("ffn_norm"), &[dim], GgmlType::F32, &norm)?;
        let m = rng.fill(count(dim, kv_dim), scale(dim), 0.0);
        w.add_tensor_f32(name("attn_k"), &[dim, kv_dim], mt, &m)?;
        let m = rng.fill(count(dim, dim), scale(dim), 0.0);
        w.add_tensor_f32(name("attn_output"), &[dim, dim], mt, &m)?;
        let m = rng.fill(count(dim, dim), scale(dim), 0.0);
        w.add_tensor_f32(name("attn_q"), &[dim, dim], mt, &m)?;
        let m = rng.fill(count(dim, kv_dim), scale(dim), 0.0);
        w.add_tensor_f32(name("attn_v"), &[dim, kv_dim], mt, &m)?;
    }
    let norm = rng.fill(dim as usize, 0.1, 1.0);
    w.add_tensor_f32("output_norm.weight", &[dim], GgmlType::F32, &norm)?;
    if !cfg.tied_embeddings {
        let m = rng.fill(count(dim, n_vocab), scale(dim), 0.0);
        w.add_tensor_f32("output.weight", &[dim, n_vocab], mt, &m)?;
    }
    Ok(w)
}

/// Writes a tiny LLaMA-architecture GGUF with random weights (deterministic
/// in `seed`), shaped like SmolLM2: the same tensor names (no `output.weight`
/// unless `!cfg.tied_embeddings`), metadata keys, tensor types (matrices
/// Q4_1, `token_embd` Q8_0, norms F32 by default), a GPT-2 byte-level
/// vocabulary ([`synthetic_vocab`]) and SmolLM2's chat template.
pub fn write_synthetic_llama(
    path: impl AsRef<Path>,
    cfg: SyntheticConfig,
    seed: u64,
) -> Result<()> {
    synthetic_llama_writer(&cfg, seed)?.write(path)
}
