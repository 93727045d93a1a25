//! A tiny random LLaMA model written as GGUF, laid out like the real
//! SmolLM2 file (same tensor names, metadata keys, tensor types and
//! tokenizer/chat-template keys): fast tests of the loader, tokenizer,
//! forward pass, engine and server without the real model.

use std::path::Path;

use gguf::write::{gpt2_byte_chars, GgufWriter};
use gguf::{GgmlType, GgufError};

type Result<T> = std::result::Result<T, GgufError>;

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
