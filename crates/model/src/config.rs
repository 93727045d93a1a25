//! Model hyper-parameters, read from GGUF metadata (no hard-coded dims).

use gguf::GgufFile;

use crate::ModelError;

/// Architectures (`general.architecture`) this forward pass runs.
pub const SUPPORTED_ARCHS: &[&str] = &["llama", "qwen2", "qwen3", "gemma3"];

/// The architecture family: which blocks the forward pass uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// LLaMA 1–3 (and SmolLM2): pre-norm, SwiGLU, adjacent-pair RoPE.
    Llama,
    /// Qwen 2 / 2.5: as LLaMA with Q/K/V biases and half-split RoPE.
    Qwen2,
    /// Qwen 3: as Qwen 2 without biases, with per-head RMSNorm of Q and K.
    Qwen3,
    /// Gemma 3: embeddings × √dim, GeGLU (tanh), norms before and after
    /// attention and MLP, per-head Q/K norm, sliding-window layers.
    Gemma3,
}

/// Which dimensions RoPE pairs up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// `(2i, 2i + 1)`: GGUF's llama (the converter permuted Q and K).
    Adjacent,
    /// `(i, i + rope_dim / 2)`: ggml's NEOX mode (Qwen, Gemma).
    Halves,
}

/// The MLP's gate activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x · σ(x)` (SwiGLU).
    Silu,
    /// GELU, tanh approximation (GeGLU).
    GeluTanh,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub arch: String,
    pub family: Arch,
    pub n_layer: usize,
    pub dim: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    /// Dimensions per head (`attention.key_length`, else `dim / n_head`).
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub vocab: usize,
    /// The model's advertised context window (`{arch}.context_length`).
    pub context_length: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    /// RoPE base of the sliding-window layers (Gemma 3: 10 000 unless
    /// `rope.freq_base_swa` says otherwise).
    pub rope_base_swa: f32,
    /// Positions are multiplied by this before RoPE (`rope.scaling.type =
    /// linear`: `1 / rope.scaling.factor`; else 1).
    pub rope_freq_scale: f32,
    /// Dimensions of each head that RoPE rotates (from the front).
    pub rope_dim: usize,
    pub rope_style: RopeStyle,
    pub activation: Activation,
    /// Sliding-window size of the layers marked in `swa_layers`.
    pub sliding_window: Option<usize>,
    /// Per layer: attends only to the last `sliding_window` positions.
    pub swa_layers: Vec<bool>,
    /// Multiplier of the token embeddings (Gemma: √dim).
    pub embed_scale: Option<f32>,
    /// `final_logit_softcapping`: logits = c · tanh(logits / c).
    pub logit_softcap: Option<f32>,
}

impl Config {
    pub fn from_gguf(f: &GgufFile) -> Result<Config, ModelError> {
        let arch = f.get_str("general.architecture")?.to_string();
        let family = match arch.as_str() {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "gemma3" => Arch::Gemma3,
            _ => {
                return Err(ModelError::Unsupported(format!(
                    "architecture `{arch}` (supported: {})",
                    SUPPORTED_ARCHS.join(", ")
                )))
            }
        };
        let k = |name: &str| format!("{arch}.{name}");
        let u = |name: &str| -> Result<usize, ModelError> { Ok(f.get_u32(&k(name))? as usize) };
        let opt_u = |name: &str| -> Result<Option<usize>, ModelError> {
            if f.contains_key(&k(name)) {
                Ok(Some(u(name)?))
            } else {
                Ok(None)
            }
        };
        let opt_f = |name: &str| -> Result<Option<f32>, ModelError> {
            if f.contains_key(&k(name)) {
                Ok(Some(f.get_f32(&k(name))?))
            } else {
                Ok(None)
            }
        };
        let n_layer = u("block_count")?;
        let dim = u("embedding_length")?;
        let n_head = u("attention.head_count")?;
        let n_kv_head = opt_u("attention.head_count_kv")?.unwrap_or(n_head);
        let ffn_dim = u("feed_forward_length")?;
        let context_length = u("context_length")?;
        let rms_eps = f.get_f32(&k("attention.layer_norm_rms_epsilon"))?;
        let rope_base = opt_f("rope.freq_base")?.unwrap_or(10_000.0);
        if n_head == 0 || n_kv_head == 0 || n_head % n_kv_head != 0 {
            return Err(ModelError::Unsupported(format!(
                "head layout: {n_head} heads, {n_kv_head} kv heads"
            )));
        }
        let head_dim = match opt_u("attention.key_length")? {
            Some(kl) => {
                if let Some(vl) = opt_u("attention.value_length")? {
                    if vl != kl {
                        return Err(ModelError::Unsupported(format!(
                            "key length {kl} ≠ value length {vl}"
                        )));
                    }
                }
                kl
            }
            None if dim % n_head == 0 => dim / n_head,
            None => {
                return Err(ModelError::Unsupported(format!(
                    "dim {dim} is not a multiple of {n_head} heads"
                )))
            }
        };
        let rope_dim = opt_u("rope.dimension_count")?.unwrap_or(head_dim);
        let rope_freq_scale = match f.get_str(&k("rope.scaling.type")).ok() {
            None | Some("none") => 1.0,
            Some("linear") => match opt_f("rope.scaling.factor")? {
                Some(factor) if factor > 0.0 => 1.0 / factor,
                _ => {
                    return Err(ModelError::Unsupported(
                        "linear rope scaling without a positive factor".into(),
                    ))
                }
            },
            Some(other) => {
                return Err(ModelError::Unsupported(format!(
                    "rope scaling `{other}` (supported: none, linear, and Llama 3's rope_freqs factors)"
                )))
            }
        };
        let vocab = match f.tensor_info("token_embd.weight") {
            Some(t) => t.rows() as usize,
            None => return Err(ModelError::MissingTensor("token_embd.weight".into())),
        };
        let gemma = family == Arch::Gemma3;
        let sliding_window = if gemma {
            opt_u("attention.sliding_window")?.filter(|&w| w > 0)
        } else {
            None
        };
        // Gemma 3: every sixth layer is global (llama.cpp's default pattern
        // 6), unless the file gives a pattern: an integer period or one
        // flag per layer.
        let swa_layers = match sliding_window {
            None => vec![false; n_layer],
            Some(_) => match f.get(&k("attention.sliding_window_pattern")) {
                Some(gguf::Value::Array(a)) => {
                    let flags: Vec<bool> = a
                        .iter()
                        .map(|v| matches!(v, gguf::Value::Bool(true)))
                        .collect();
                    if flags.len() != n_layer {
                        return Err(ModelError::Unsupported(format!(
                            "sliding_window_pattern has {} entries for {n_layer} layers",
                            flags.len()
                        )));
                    }
                    flags
                }
                _ => {
                    let period = opt_u("attention.sliding_window_pattern")?.unwrap_or(6);
                    (0..n_layer)
                        .map(|l| period == 0 || l % period < period - 1)
                        .collect()
                }
            },
        };
        let rope_base_swa = opt_f("rope.freq_base_swa")?.unwrap_or(10_000.0);
        let logit_softcap = opt_f("final_logit_softcapping")?.filter(|&c| c > 0.0);
        let cfg = Config {
            arch: arch.clone(),
            family,
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
            rope_base_swa,
            rope_freq_scale,
            rope_dim,
            rope_style: if family == Arch::Llama {
                RopeStyle::Adjacent
            } else {
                RopeStyle::Halves
            },
            activation: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            sliding_window,
            swa_layers,
            embed_scale: gemma.then(|| (dim as f32).sqrt()),
            logit_softcap,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), ModelError> {
        let bad = |why: String| Err(ModelError::Unsupported(why));
        if self.n_layer == 0 || self.n_layer > 1024 {
            return bad(format!("{} layers", self.n_layer));
        }
        if !self.dim.is_multiple_of(32)
            || !self.ffn_dim.is_multiple_of(32)
            || !self.q_dim().is_multiple_of(32)
        {
            return bad(format!(
                "dims must be multiples of 32 (dim {}, ffn {}, heads × head dim {})",
                self.dim,
                self.ffn_dim,
                self.q_dim()
            ));
        }
        if !self
            .head_dim
            .is_multiple_of(kernels::attention::HEAD_DIM_MULTIPLE)
        {
            return bad(format!(
                "head dimension {} is not a multiple of {}",
                self.head_dim,
                kernels::attention::HEAD_DIM_MULTIPLE
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
        if !(self.rms_eps > 0.0 && self.rope_base > 0.0 && self.rope_base_swa > 0.0) {
            return bad("non-positive rms epsilon or rope base".into());
        }
        if self.sliding_window == Some(0) {
            return bad("sliding window of 0".into());
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

    /// Width of the queries and of the attention output (`n_head ×
    /// head_dim`; Gemma's differs from `dim`).
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// The window of layer `l`, if it is a sliding-window layer.
    pub fn window_of(&self, l: usize) -> Option<usize> {
        if self.swa_layers.get(l).copied().unwrap_or(false) {
            self.sliding_window
        } else {
            None
        }
    }
}
