//! A tiny random LLaMA model written as GGUF, laid out like the real
//! SmolLM2 file (same tensor names, metadata keys, tensor types and
//! tokenizer/chat-template keys): fast tests of the loader, tokenizer,
//! forward pass, engine and server without the real model.
//!
//! The same writer makes the other architectures' shapes ([`SyntheticConfig::arch`]:
//! `qwen2` with Q/K/V biases, `qwen3` with Q/K norms, `gemma3` with its
//! norms, head size and sliding-window layers; a Llama 3 `rope_freqs`
//! tensor), with any tensor type the kernels quantise (K-quants through
//! `kernels::quantize_row`, the blocks llama.cpp's quantiser writes).

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
    /// `general.architecture`: `llama`, `qwen2`, `qwen3` or `gemma3`.
    pub arch: &'static str,
    /// `attention.key_length`/`value_length` when set (Gemma's head size is
    /// not `dim / n_heads`).
    pub head_dim: Option<u32>,
    /// Gemma 3: `attention.sliding_window`; every `sliding_window_pattern`-th
    /// layer is global.
    pub sliding_window: Option<u32>,
    pub sliding_window_pattern: u32,
    /// `tokenizer.ggml.pre` (`smollm`, `llama-bpe`, `qwen2`, ...).
    pub pre: &'static str,
    /// Llama 3.1+: a `rope_freqs.weight` tensor of frequency divisors.
    pub rope_freqs: bool,
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
            arch: "llama",
            head_dim: None,
            sliding_window: None,
            sliding_window_pattern: 6,
            pre: "smollm",
            rope_freqs: false,
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
    if cfg.dim == 0
        || !cfg.dim.is_multiple_of(32)
        || cfg.ffn_dim == 0
        || !cfg.ffn_dim.is_multiple_of(32)
    {
        return bad("dim and ffn_dim must be non-zero multiples of 32");
    }
    if cfg.head_dim.is_none()
        && (!cfg.dim.is_multiple_of(cfg.n_heads) || !(cfg.dim / cfg.n_heads).is_multiple_of(2))
    {
        return bad("dim / n_heads must be an even integer");
    }
    if !["llama", "qwen2", "qwen3", "gemma3"].contains(&cfg.arch) {
        return bad("arch must be llama, qwen2, qwen3 or gemma3");
    }
    if !cfg.n_heads.is_multiple_of(cfg.n_kv_heads) {
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
    let head_dim = cfg.head_dim.unwrap_or(cfg.dim / cfg.n_heads);
    let kv_dim = u64::from(head_dim * cfg.n_kv_heads);
    let q_dim = u64::from(head_dim * cfg.n_heads);
    let a = cfg.arch;
    let k = |key: &str| format!("{a}.{key}");

    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", a)
        .add_kv("general.type", "model")
        .add_kv("general.name", format!("isoserve synthetic {a}"))
        .add_kv(k("block_count"), cfg.n_layers)
        .add_kv(k("context_length"), cfg.context_length)
        .add_kv(k("embedding_length"), cfg.dim)
        .add_kv(k("feed_forward_length"), cfg.ffn_dim)
        .add_kv(k("attention.head_count"), cfg.n_heads)
        .add_kv(k("attention.head_count_kv"), cfg.n_kv_heads)
        .add_kv(k("rope.freq_base"), cfg.rope_freq_base)
        .add_kv(k("attention.layer_norm_rms_epsilon"), cfg.rms_eps)
        .add_kv("general.file_type", 3u32)
        .add_kv(k("vocab_size"), n_vocab as u32)
        .add_kv(k("rope.dimension_count"), head_dim)
        .add_kv("tokenizer.ggml.add_space_prefix", false)
        .add_kv("tokenizer.ggml.add_bos_token", false)
        .add_kv("tokenizer.ggml.model", "gpt2")
        .add_kv("tokenizer.ggml.pre", cfg.pre)
        .add_kv("tokenizer.ggml.tokens", tokens)
        .add_kv("tokenizer.ggml.token_type", types)
        .add_kv("tokenizer.ggml.merges", merges)
        .add_kv("tokenizer.ggml.bos_token_id", 1u32)
        .add_kv("tokenizer.ggml.eos_token_id", 2u32)
        .add_kv("tokenizer.ggml.unknown_token_id", 0u32)
        .add_kv("tokenizer.ggml.padding_token_id", 2u32)
        .add_kv("tokenizer.chat_template", SMOLLM2_CHAT_TEMPLATE)
        .add_kv("general.quantization_version", 2u32);
    if let Some(hd) = cfg.head_dim {
        w.add_kv(k("attention.key_length"), hd)
            .add_kv(k("attention.value_length"), hd);
    }
    if let Some(sw) = cfg.sliding_window {
        w.add_kv(k("attention.sliding_window"), sw).add_kv(
            k("attention.sliding_window_pattern"),
            cfg.sliding_window_pattern,
        );
    }

    let mut rng = Rng(seed);
    let count = |a: u64, b: u64| (a * b) as usize;
    let emb = rng.fill(count(dim, n_vocab), 1.0, 0.0);
    add_matrix(
        &mut w,
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
        add_matrix(&mut w, name("ffn_down"), &[ffn, dim], mt, &m)?;
        let m = rng.fill(count(dim, ffn), scale(dim), 0.0);
        add_matrix(&mut w, name("ffn_gate"), &[dim, ffn], mt, &m)?;
        let m = rng.fill(count(dim, ffn), scale(dim), 0.0);
        add_matrix(&mut w, name("ffn_up"), &[dim, ffn], mt, &m)?;
        let norm = rng.fill(dim as usize, 0.1, 1.0);
        w.add_tensor_f32(name("ffn_norm"), &[dim], GgmlType::F32, &norm)?;
        let m = rng.fill(count(dim, kv_dim), scale(dim), 0.0);
        add_matrix(&mut w, name("attn_k"), &[dim, kv_dim], mt, &m)?;
        let m = rng.fill(count(q_dim, dim), scale(q_dim), 0.0);
        add_matrix(&mut w, name("attn_output"), &[q_dim, dim], mt, &m)?;
        let m = rng.fill(count(dim, q_dim), scale(dim), 0.0);
        add_matrix(&mut w, name("attn_q"), &[dim, q_dim], mt, &m)?;
        let m = rng.fill(count(dim, kv_dim), scale(dim), 0.0);
        add_matrix(&mut w, name("attn_v"), &[dim, kv_dim], mt, &m)?;
        if a == "qwen2" {
            for (t, n) in [("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)] {
                let b = rng.fill(n as usize, 0.5, 0.0);
                w.add_tensor_f32(format!("blk.{l}.{t}.bias"), &[n], GgmlType::F32, &b)?;
            }
        }
        if a == "qwen3" || a == "gemma3" {
            for t in ["attn_q_norm", "attn_k_norm"] {
                let n = rng.fill(head_dim as usize, 0.1, 1.0);
                w.add_tensor_f32(name(t), &[u64::from(head_dim)], GgmlType::F32, &n)?;
            }
        }
        if a == "gemma3" {
            for t in ["post_attention_norm", "post_ffw_norm"] {
                let n = rng.fill(dim as usize, 0.1, 1.0);
                w.add_tensor_f32(name(t), &[dim], GgmlType::F32, &n)?;
            }
        }
    }
    if cfg.rope_freqs {
        // Llama 3.1's shape: long wavelengths slowed down, short ones kept.
        let half = head_dim as usize / 2;
        let f: Vec<f32> = (0..half)
            .map(|i| 1.0 + 7.0 * (i as f32 / half as f32))
            .collect();
        w.add_tensor_f32("rope_freqs.weight", &[half as u64], GgmlType::F32, &f)?;
    }
    let norm = rng.fill(dim as usize, 0.1, 1.0);
    w.add_tensor_f32("output_norm.weight", &[dim], GgmlType::F32, &norm)?;
    if !cfg.tied_embeddings {
        let m = rng.fill(count(dim, n_vocab), scale(dim), 0.0);
        add_matrix(&mut w, "output.weight", &[dim, n_vocab], mt, &m)?;
    }
    Ok(w)
}

/// A matrix (GGUF dims `[cols, rows]`) of type `ty`: the writer's own
/// quantisers for the types it has, `kernels::quantize_row` (llama.cpp's
/// reference quantisers, bit for bit) for Q5_0/Q5_1 and the K-quants.
fn add_matrix(
    w: &mut GgufWriter,
    name: impl Into<String>,
    dims: &[u64],
    ty: GgmlType,
    values: &[f32],
) -> Result<()> {
    let name: String = name.into();
    let kt = match ty {
        GgmlType::Q5_0 => kernels::WeightType::Q5_0,
        GgmlType::Q5_1 => kernels::WeightType::Q5_1,
        GgmlType::Q4_K => kernels::WeightType::Q4_K,
        GgmlType::Q5_K => kernels::WeightType::Q5_K,
        GgmlType::Q6_K => kernels::WeightType::Q6_K,
        _ => {
            w.add_tensor_f32(name, dims, ty, values)?;
            return Ok(());
        }
    };
    let cols = dims[0] as usize;
    if !cols.is_multiple_of(kt.block_len()) {
        return Err(GgufError::InvalidArgument(format!(
            "{name}: {cols} columns are not whole {} blocks",
            kt.name()
        )));
    }
    let mut bytes = Vec::with_capacity(values.len() / kt.block_len() * kt.block_bytes());
    for row in values.chunks(cols) {
        kernels::quantize_row(kt, row, &mut bytes);
    }
    w.add_tensor(name, dims, ty, bytes)?;
    Ok(())
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

/// One tiny model per architecture (3 layers, dim 256 so K-quant matrices
/// fit): Llama 3 (`rope_freqs`, `llama-bpe`, Q4_K matrices, Q6_K
/// embeddings, untied output), Qwen 2 (biases, Q5_0), Qwen 3 (Q/K norms,
/// head size 64, Q5_K), Gemma 3 (head size 128 ≠ dim/heads, window 8 on
/// every other layer, Q4_K). Used by model/tests/architectures.rs and, via
/// `cargo run -p testkit --example write-tiny-models DIR`, by
/// scripts/compare-llama-cpp.
pub fn architecture_cases() -> Vec<(&'static str, SyntheticConfig)> {
    let base = SyntheticConfig {
        n_layers: 3,
        dim: 256,
        n_heads: 4,
        n_kv_heads: 2,
        ffn_dim: 512,
        context_length: 128,
        ..SyntheticConfig::default()
    };
    vec![
        (
            "llama3",
            SyntheticConfig {
                rope_freq_base: 500_000.0,
                matrix_type: GgmlType::Q4_K,
                embedding_type: GgmlType::Q6_K,
                tied_embeddings: false,
                pre: "llama-bpe",
                rope_freqs: true,
                ..base.clone()
            },
        ),
        (
            "qwen2",
            SyntheticConfig {
                arch: "qwen2",
                rope_freq_base: 1_000_000.0,
                matrix_type: GgmlType::Q5_0,
                pre: "qwen2",
                ..base.clone()
            },
        ),
        (
            "qwen3",
            SyntheticConfig {
                arch: "qwen3",
                n_kv_heads: 1,
                matrix_type: GgmlType::Q5_K,
                pre: "qwen2",
                head_dim: Some(64),
                ..base.clone()
            },
        ),
        (
            "gemma3",
            SyntheticConfig {
                arch: "gemma3",
                n_heads: 2,
                n_kv_heads: 1,
                head_dim: Some(128),
                matrix_type: GgmlType::Q4_K,
                embedding_type: GgmlType::Q8_0,
                rope_freq_base: 1_000_000.0,
                sliding_window: Some(8),
                sliding_window_pattern: 2,
                ..base
            },
        ),
    ]
}
