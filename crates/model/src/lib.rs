//! `model` — LLaMA-family models (Llama, Qwen 2/3) and Gemma 3 on CPU: configuration from GGUF metadata,
//! the forward pass with paged attention over the [`kv`] pool, and sampling.
//!
//! It reads and writes K/V *only* through `kv::Pool` handles, so every KV
//! access of the forward pass is checked for epoch, owner and watermark
//! (K1–K3). It knows nothing about HTTP, tenants' keys or scheduling: the
//! engine decides which rows run together.
//!
//! ```no_run
//! use kv::{DType, Owner, Pool, PoolOptions, RequestId, TenantId};
//! use model::{Model, Row, Scratch, SeqCtx};
//!
//! let model = Model::load("model.gguf".as_ref(), kernels::ThreadPool::from_env())?;
//! let shape = model.kv_shape(16, DType::F32)?;
//! let mut pool = Pool::new(shape, 64, PoolOptions::default())?;
//! let owner = Owner::new(RequestId(1), TenantId(1));
//! let mut pages = Vec::new();
//! pool.alloc(owner, 1, &mut pages)?;
//! let prompt = [504u32, 3575, 282, 4649, 314]; // "The capital of France is"
//! let rows: Vec<Row> = prompt.iter().enumerate()
//!     .map(|(pos, &token)| Row { seq: 0, pos, token, logits: pos == prompt.len() - 1 })
//!     .collect();
//! let mut scratch = Scratch::new(&model, 64);
//! model.forward(&mut pool, &[SeqCtx { owner, pages: &pages }], &rows, &mut scratch)?;
//! let next = model::sample::argmax(&scratch.logits); // " Paris"
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]

pub mod config;
pub mod forward;
pub mod sample;
pub mod step;

pub use config::Config;
pub use forward::{Model, Row, Scratch, SeqCtx, BATCH_ROWS_MAX};
pub use step::{Forward, Runner};

/// Errors of loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    #[error("KV pool refused an access: {0}")]
    Kv(#[from] kv::KvError),
    #[error("model not supported: {0}")]
    Unsupported(String),
    #[error("model file has no tensor `{0}`")]
    MissingTensor(String),
    #[error("invalid batch: {0}")]
    Batch(String),
}

/// Whether `draft` can draft for `model` (`--draft-model`): the same
/// tokenizer — its kind, every token's text and the special tokens' ids —
/// so a draft token id means the same text to both. The error names the
/// first difference.
pub fn same_vocabulary(model: &gguf::GgufFile, draft: &gguf::GgufFile) -> Result<(), String> {
    let kind = |f: &gguf::GgufFile| f.get_str("tokenizer.ggml.model").unwrap_or("?").to_string();
    if kind(model) != kind(draft) {
        return Err(format!(
            "its tokenizer is `{}`, the model's is `{}`",
            kind(draft),
            kind(model)
        ));
    }
    let tokens = |f: &gguf::GgufFile| {
        f.get_string_array("tokenizer.ggml.tokens")
            .map_err(|e| e.to_string())
            .map(|t| t.into_iter().map(str::to_string).collect::<Vec<_>>())
    };
    let (a, b) = (tokens(model)?, tokens(draft)?);
    if a.len() != b.len() {
        return Err(format!(
            "its vocabulary has {} tokens, the model's {}",
            b.len(),
            a.len()
        ));
    }
    if let Some(i) = (0..a.len()).find(|&i| a[i] != b[i]) {
        return Err(format!(
            "its token {i} is {:?}, the model's is {:?}",
            b[i], a[i]
        ));
    }
    for key in [
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
    ] {
        let id = |f: &gguf::GgufFile| f.get_u64(key).ok();
        if id(model) != id(draft) {
            return Err(format!(
                "its {key} is {:?}, the model's {:?}",
                id(draft),
                id(model)
            ));
        }
    }
    Ok(())
}
