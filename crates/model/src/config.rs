//! Model hyper-parameters, read from GGUF metadata (no hard-coded dims).

use gguf::GgufFile;

use crate::ModelError;

/// Architectures whose forward pass is the LLaMA one implemented here.
pub const SUPPORTED_ARCHS: &[&str] = &["llama"];

#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub arch: String,
    pub n_layer: usize,
    pub dim: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub vocab: usize,
    /// The model's advertised context window (`{arch}.context_length`).
    pub context_length: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    /// Dimensions of each head that RoPE rotates (from the front).
    pub rope_dim: usize,
}

impl Config {
    pub fn from_gguf(f: &GgufFile) -> Result<Config, ModelError> {
        let arch = f.get_str("general.architecture")?.to_string();
        if !SUPPORTED_ARCHS.contains(&arch.as_str()) {
            return Err(ModelError::Unsupported(format!(
                "architecture `{arch}` (supported: {})",
                SUPPORTED_ARCHS.join(", ")
            )));
        }
        let k = |name: &str| format!("{arch}.{name}");
        let u = |name: &str| -> Result<usize, ModelError> { Ok(f.get_u32(&k(name))? as usize) };
        let n_layer = u("block_count")?;
        let dim = u("embedding_length")?;
        let n_head = u("attention.head_count")?;
        let n_kv_head = if f.contains_key(&k("attention.head_count_kv")) {
            u("attention.head_count_kv")?
        } else {
            n_head
        };
        let ffn_dim = u("feed_forward_length")?;
        let context_length = u("context_length")?;
        let rms_eps = f.get_f32(&k("attention.layer_norm_rms_epsilon"))?;
        let rope_base = if f.contains_key(&k("rope.freq_base")) {
            f.get_f32(&k("rope.freq_base"))?
        } else {
            10_000.0
        };
        if n_head == 0 || n_kv_head == 0 || dim % n_head != 0 || n_head % n_kv_head != 0 {
            return Err(ModelError::Unsupported(format!(
                "head layout: dim {dim}, {n_head} heads, {n_kv_head} kv heads"
            )));
        }
        let head_dim = dim / n_head;
        let rope_dim = if f.contains_key(&k("rope.dimension_count")) {
            u("rope.dimension_count")?
        } else {
            head_dim
        };
        let vocab = match f.tensor_info("token_embd.weight") {
            Some(t) => t.rows() as usize,
            None => return Err(ModelError::MissingTensor("token_embd.weight".into())),
        };
        let cfg = Config {
            arch,
            n_layer,
            dim,
            n_head,
            n_kv_head,
            head_dim,
            ffn_dim,
            vocab,
            context_length,
            rms_eps,
            rope_base,
            rope_dim,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), ModelError> {
        let bad = |why: String| Err(ModelError::Unsupported(why));
        if self.n_layer == 0 || self.n_layer > 1024 {
            return bad(format!("{} layers", self.n_layer));
        }
        if !self.dim.is_multiple_of(32) || !self.ffn_dim.is_multiple_of(32) {
            return bad(format!(
                "dims must be multiples of 32 (dim {}, ffn {})",
                self.dim, self.ffn_dim
            ));
        }
        if self.head_dim > kernels::attention::HEAD_DIM_MAX {
            return bad(format!(
                "head dimension {} over {}",
                self.head_dim,
                kernels::attention::HEAD_DIM_MAX
            ));
        }
        if self.rope_dim > self.head_dim || !self.rope_dim.is_multiple_of(2) {
            return bad(format!("rope dimension {}", self.rope_dim));
        }
        if self.context_length == 0 {
            return bad("context length 0".into());
        }
        if !(self.rms_eps > 0.0 && self.rope_base > 0.0) {
            return bad("non-positive rms epsilon or rope base".into());
        }
        Ok(())
    }

    /// Query heads per KV head (grouped-query attention).
    pub fn group(&self) -> usize {
        self.n_head / self.n_kv_head
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim
    }
}
