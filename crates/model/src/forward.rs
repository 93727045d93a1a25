//! The LLaMA forward pass over a batch of rows from several sequences, with
//! paged attention that reads and writes K/V only through `kv::Pool`
//! handles.
//!
//! Batch invariance (K12): every per-row computation (embedding, norms,
//! RoPE, matmuls — see `kernels` — and attention) depends only on that row's
//! data and its own sequence's KV, in a fixed reduction order; so a row's
//! logits are bitwise identical whatever else is in the batch and whichever
//! pages hold its KV.

use gguf::{GgmlType, GgufFile};
use kernels::attention::{AttnRow, AttnScratch, AttnShape, KvPage, KvRows};
use kernels::{ActForms, QuantizedActivations, ThreadPool, WeightMatrix, WeightType};
use kv::{DType, KvError, KvShape, LayerView, Owner, PageRef, Pool};

use crate::config::{Activation, Arch, Config, RopeStyle};
use crate::ModelError;

/// Rows per forward call (a limit on everything: the scheduler's token
/// budget must stay under it).
pub const BATCH_ROWS_MAX: usize = 4096;

#[derive(Clone, Copy, Debug)]
struct Mat {
    ty: WeightType,
    bytes: &'static [u8],
    rows: usize,
    cols: usize,
}

impl Mat {
    fn wm(&self) -> WeightMatrix<'static> {
        WeightMatrix {
            ty: self.ty,
            bytes: self.bytes,
            rows: self.rows,
            cols: self.cols,
        }
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    q: Mat,
    k: Mat,
    v: Mat,
    o: Mat,
    /// Qwen 2: biases added to Q, K and V.
    qkv_bias: Option<[Vec<f32>; 3]>,
    /// Qwen 3, Gemma 3: per-head RMSNorm weights of Q and K (`head_dim`).
    qk_norm: Option<[Vec<f32>; 2]>,
    /// Gemma 3: RMSNorm of the attention and MLP outputs before the
    /// residual add.
    post_norms: Option<[Vec<f32>; 2]>,
    ffn_norm: Vec<f32>,
    gate: Mat,
    up: Mat,
    down: Mat,
}

/// cos/sin of RoPE per (position, pair): `context_length × rope_dim/2` each.
struct RopeTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// θ_i = pos · scale · base^(−2i/d) / factor_i, in f64 then rounded.
    fn new(c: &Config, base: f32, factors: Option<&[f32]>) -> RopeTable {
        let half = c.rope_dim / 2;
        let mut cos = vec![0.0; c.context_length * half];
        let mut sin = vec![0.0; c.context_length * half];
        for pos in 0..c.context_length {
            let p = pos as f64 * c.rope_freq_scale as f64;
            for i in 0..half {
                let mut freq = (base as f64).powf(-2.0 * i as f64 / c.rope_dim as f64);
                if let Some(f) = factors {
                    freq /= f[i] as f64;
                }
                let ang = p * freq;
                cos[pos * half + i] = ang.cos() as f32;
                sin[pos * half + i] = ang.sin() as f32;
            }
        }
        RopeTable { cos, sin }
    }
}

/// A loaded model: config, weights (zero-copy views of the mmapped GGUF),
/// RoPE tables and the kernels' thread pool.
pub struct Model {
    pub config: Config,
    file: &'static GgufFile,
    embd: Mat,
    output: Mat,
    output_norm: Vec<f32>,
    layers: Vec<Layer>,
    rope: RopeTable,
    /// The sliding-window layers' own table (Gemma 3), if their base differs.
    rope_swa: Option<RopeTable>,
    threads: std::sync::Arc<ThreadPool>,
}

/// One sequence taking part in a forward call: its owner and its pages, in
/// sequence order (page `j` holds positions `j*page_size ..`).
#[derive(Clone, Copy, Debug)]
pub struct SeqCtx<'a> {
    pub owner: Owner,
    pub pages: &'a [PageRef],
}

/// One row of a batch: token `token` at position `pos` of sequence `seq`
/// (an index into the `seqs` slice). Rows of one sequence come in position
/// order. `logits`: compute this row's logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    pub seq: usize,
    pub pos: usize,
    pub token: u32,
    pub logits: bool,
}

/// Preallocated buffers for forward calls of up to `max_rows` rows.
pub struct Scratch {
    max_rows: usize,
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    qa_dim: QuantizedActivations,
    qa_q: QuantizedActivations,
    qa_ffn: QuantizedActivations,
    /// The attention kernel's partial results and tiles.
    attn: AttnScratch,
    /// Logits of the rows that asked for them, in row order, vocab each.
    pub logits: Vec<f32>,
}

impl Scratch {
    pub fn new(model: &Model, max_rows: usize) -> Scratch {
        let c = &model.config;
        let max_rows = max_rows.clamp(1, BATCH_ROWS_MAX);
        Scratch {
            max_rows,
            x: vec![0.0; max_rows * c.dim],
            h: vec![0.0; max_rows * c.dim],
            q: vec![0.0; max_rows * c.q_dim()],
            k: vec![0.0; max_rows * c.kv_dim()],
            v: vec![0.0; max_rows * c.kv_dim()],
            att: vec![0.0; max_rows * c.q_dim()],
            o: vec![0.0; max_rows * c.dim],
            gate: vec![0.0; max_rows * c.ffn_dim],
            up: vec![0.0; max_rows * c.ffn_dim],
            qa_dim: QuantizedActivations::new(max_rows, c.dim),
            qa_q: QuantizedActivations::new(max_rows, c.q_dim()),
            qa_ffn: QuantizedActivations::new(max_rows, c.ffn_dim),
            attn: AttnScratch::default(),
            logits: Vec::with_capacity(c.vocab),
        }
    }

    pub fn max_rows(&self) -> usize {
        self.max_rows
    }
}

fn weight_type(t: GgmlType) -> WeightType {
    match t {
        GgmlType::F32 => WeightType::F32,
        GgmlType::F16 => WeightType::F16,
        GgmlType::Q4_0 => WeightType::Q4_0,
        GgmlType::Q4_1 => WeightType::Q4_1,
        GgmlType::Q8_0 => WeightType::Q8_0,
        GgmlType::Q5_0 => WeightType::Q5_0,
        GgmlType::Q5_1 => WeightType::Q5_1,
        GgmlType::Q4_K => WeightType::Q4_K,
        GgmlType::Q5_K => WeightType::Q5_K,
        GgmlType::Q6_K => WeightType::Q6_K,
    }
}

impl Model {
    /// Loads a GGUF (llama, qwen2, qwen3 or gemma3). The file is memory-mapped for the life of
    /// the process: the weights are read in place, never copied, and the map
    /// is deliberately leaked (one model per process; `&'static` lets worker
    /// threads borrow weights without reference counting).
    pub fn load(
        path: &std::path::Path,
        threads: impl Into<std::sync::Arc<ThreadPool>>,
    ) -> Result<Model, ModelError> {
        let file: &'static GgufFile = Box::leak(Box::new(GgufFile::open(path)?));
        Model::from_file(file, threads)
    }

    /// (`threads` may be shared: a draft model runs on its target's pool.)
    pub fn from_file(
        file: &'static GgufFile,
        threads: impl Into<std::sync::Arc<ThreadPool>>,
    ) -> Result<Model, ModelError> {
        let threads = threads.into();
        let config = Config::from_gguf(file)?;
        let mat = |name: &str, rows: usize, cols: usize| -> Result<Mat, ModelError> {
            let t = file
                .tensor(name)
                .map_err(|_| ModelError::MissingTensor(name.to_string()))?;
            let (tr, tc) = (t.rows() as usize, t.cols() as usize);
            if (tr, tc) != (rows, cols) {
                return Err(ModelError::Unsupported(format!(
                    "tensor {name} is {tr}×{tc}, expected {rows}×{cols}"
                )));
            }
            let ty = weight_type(t.ggml_type());
            let m = Mat {
                ty,
                bytes: t.bytes(),
                rows,
                cols,
            };
            m.wm()
                .validate()
                .map_err(|e| ModelError::Unsupported(format!("tensor {name}: {e:?}")))?;
            Ok(m)
        };
        let vec = |name: &str, len: usize| -> Result<Vec<f32>, ModelError> {
            let t = file
                .tensor(name)
                .map_err(|_| ModelError::MissingTensor(name.to_string()))?;
            if t.n_elements() as usize != len {
                return Err(ModelError::Unsupported(format!(
                    "tensor {name} has {} elements, expected {len}",
                    t.n_elements()
                )));
            }
            Ok(t.dequantize()?)
        };
        let c = &config;
        let (qd, kvd, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);
        let mut layers = Vec::with_capacity(c.n_layer);
        for l in 0..c.n_layer {
            let p = |s: &str| format!("blk.{l}.{s}.weight");
            let b = |s: &str| format!("blk.{l}.{s}.bias");
            let qkv_bias = if c.family == Arch::Qwen2 {
                Some([
                    vec(&b("attn_q"), qd)?,
                    vec(&b("attn_k"), kvd)?,
                    vec(&b("attn_v"), kvd)?,
                ])
            } else {
                None
            };
            let qk_norm = if matches!(c.family, Arch::Qwen3 | Arch::Gemma3) {
                Some([vec(&p("attn_q_norm"), hd)?, vec(&p("attn_k_norm"), hd)?])
            } else {
                None
            };
            let post_norms = if c.family == Arch::Gemma3 {
                Some([
                    vec(&p("post_attention_norm"), c.dim)?,
                    vec(&p("post_ffw_norm"), c.dim)?,
                ])
            } else {
                None
            };
            layers.push(Layer {
                attn_norm: vec(&p("attn_norm"), c.dim)?,
                q: mat(&p("attn_q"), qd, c.dim)?,
                k: mat(&p("attn_k"), kvd, c.dim)?,
                v: mat(&p("attn_v"), kvd, c.dim)?,
                o: mat(&p("attn_output"), c.dim, qd)?,
                qkv_bias,
                qk_norm,
                post_norms,
                ffn_norm: vec(&p("ffn_norm"), c.dim)?,
                gate: mat(&p("ffn_gate"), c.ffn_dim, c.dim)?,
                up: mat(&p("ffn_up"), c.ffn_dim, c.dim)?,
                down: mat(&p("ffn_down"), c.dim, c.ffn_dim)?,
            });
        }
        let embd = mat("token_embd.weight", c.vocab, c.dim)?;
        let output = if file.tensor_info("output.weight").is_some() {
            mat("output.weight", c.vocab, c.dim)?
        } else {
            embd
        };
        let output_norm = vec("output_norm.weight", c.dim)?;
        // Llama 3.1+: per-pair frequency divisors (`rope_freqs.weight`).
        let factors = match file.tensor_info("rope_freqs.weight") {
            Some(_) => {
                let f = vec("rope_freqs.weight", c.rope_dim / 2)?;
                if f.iter().any(|&v| !(v > 0.0 && v.is_finite())) {
                    return Err(ModelError::Unsupported(
                        "rope_freqs.weight holds a non-positive factor".into(),
                    ));
                }
                Some(f)
            }
            None => None,
        };
        let rope = RopeTable::new(c, c.rope_base, factors.as_deref());
        let rope_swa = (c.swa_layers.iter().any(|&s| s) && c.rope_base_swa != c.rope_base)
            .then(|| RopeTable::new(c, c.rope_base_swa, factors.as_deref()));
        Ok(Model {
            config,
            file,
            embd,
            output,
            output_norm,
            layers,
            rope,
            rope_swa,
            threads,
        })
    }

    pub fn gguf(&self) -> &'static GgufFile {
        self.file
    }

    pub fn threads(&self) -> &ThreadPool {
        &self.threads
    }

    /// The kernels' thread pool, to share (a draft model's).
    pub fn threads_shared(&self) -> std::sync::Arc<ThreadPool> {
        self.threads.clone()
    }

    /// The KV page shape this model needs.
    pub fn kv_shape(&self, page_size: usize, dtype: DType) -> Result<KvShape, KvError> {
        KvShape::new(
            self.config.n_layer,
            self.config.n_kv_head,
            self.config.head_dim,
            page_size,
            dtype,
        )
    }

    /// Runs one forward step over `rows`, writing each row's K/V into its
    /// sequence's pages and leaving the logits of rows with `logits: true`
    /// in `s.logits` (in row order, `vocab` each).
    pub fn forward(
        &self,
        pool: &mut Pool,
        seqs: &[SeqCtx<'_>],
        rows: &[Row],
        s: &mut Scratch,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let n = rows.len();
        if n == 0 {
            s.logits.clear();
            return Ok(());
        }
        if n > s.max_rows {
            return Err(ModelError::Batch(format!(
                "{n} rows exceed the scratch capacity of {}",
                s.max_rows
            )));
        }
        let shape = *pool.shape();
        if shape.layers != c.n_layer || shape.token_width() != c.kv_dim() {
            return Err(ModelError::Batch(
                "KV pool shape does not match the model".into(),
            ));
        }
        let ps = shape.page_size;
        for r in rows {
            let seq = seqs
                .get(r.seq)
                .ok_or_else(|| ModelError::Batch(format!("row names sequence {}", r.seq)))?;
            if r.pos >= c.context_length {
                return Err(ModelError::Batch(format!(
                    "position {} beyond the context window {}",
                    r.pos, c.context_length
                )));
            }
            if r.pos / ps >= seq.pages.len() {
                return Err(ModelError::Batch(format!(
                    "position {} needs page {}, sequence holds {}",
                    r.pos,
                    r.pos / ps,
                    seq.pages.len()
                )));
            }
            if r.token as usize >= c.vocab {
                return Err(ModelError::Batch(format!(
                    "token id {} out of vocabulary ({})",
                    r.token, c.vocab
                )));
            }
        }
        let (dim, kvd, ffn, qd) = (c.dim, c.kv_dim(), c.ffn_dim, c.q_dim());
        // Embedding.
        let erb = self.embd.ty.row_bytes(dim);
        for (i, r) in rows.iter().enumerate() {
            let t = r.token as usize;
            kernels::dequantize_row(
                self.embd.ty,
                &self.embd.bytes[t * erb..(t + 1) * erb],
                &mut s.x[i * dim..(i + 1) * dim],
            );
        }
        if let Some(e) = c.embed_scale {
            for x in &mut s.x[..n * dim] {
                *x *= e;
            }
        }
        let plan = AttnPlan::new(seqs.len(), rows, ps);
        for (l, layer) in self.layers.iter().enumerate() {
            // Attention block.
            rmsnorm_rows(
                &s.x[..n * dim],
                &layer.attn_norm,
                c.rms_eps,
                &mut s.h[..n * dim],
            );
            s.qa_dim
                .set_forms(ActForms::for_weights([layer.q.ty, layer.k.ty, layer.v.ty]));
            s.qa_dim.quantize(&s.h[..n * dim], dim);
            self.mm(layer.q, &s.qa_dim, &s.h[..n * dim], &mut s.q[..n * qd]);
            self.mm(layer.k, &s.qa_dim, &s.h[..n * dim], &mut s.k[..n * kvd]);
            self.mm(layer.v, &s.qa_dim, &s.h[..n * dim], &mut s.v[..n * kvd]);
            if let Some([bq, bk, bv]) = &layer.qkv_bias {
                add_rows(&mut s.q[..n * qd], bq);
                add_rows(&mut s.k[..n * kvd], bk);
                add_rows(&mut s.v[..n * kvd], bv);
            }
            if let Some([nq, nk]) = &layer.qk_norm {
                // Per head (rows of head_dim), in place.
                rmsnorm_rows_in_place(&mut s.q[..n * qd], nq, c.rms_eps);
                rmsnorm_rows_in_place(&mut s.k[..n * kvd], nk, c.rms_eps);
            }
            let rope = match &self.rope_swa {
                Some(t) if c.window_of(l).is_some() => t,
                _ => &self.rope,
            };
            for (i, r) in rows.iter().enumerate() {
                self.rope(rope, &mut s.q[i * qd..(i + 1) * qd], r.pos, c.n_head);
                self.rope(rope, &mut s.k[i * kvd..(i + 1) * kvd], r.pos, c.n_kv_head);
            }
            for (i, r) in rows.iter().enumerate() {
                let seq = &seqs[r.seq];
                pool.write_token(
                    seq.pages[r.pos / ps],
                    seq.owner,
                    l,
                    r.pos % ps,
                    &s.k[i * kvd..(i + 1) * kvd],
                    &s.v[i * kvd..(i + 1) * kvd],
                )?;
            }
            self.attention(
                pool,
                seqs,
                &plan,
                l,
                &s.q[..n * qd],
                &mut s.att[..n * qd],
                &mut s.attn,
            )?;
            s.qa_q.set_forms(ActForms::for_weights([layer.o.ty]));
            s.qa_q.quantize(&s.att[..n * qd], qd);
            self.mm(layer.o, &s.qa_q, &s.att[..n * qd], &mut s.o[..n * dim]);
            residual_add(
                &mut s.x[..n * dim],
                &s.o[..n * dim],
                layer.post_norms.as_ref().map(|[a, _]| a.as_slice()),
                c.rms_eps,
                &mut s.h[..n * dim],
            );
            // Feed-forward block.
            rmsnorm_rows(
                &s.x[..n * dim],
                &layer.ffn_norm,
                c.rms_eps,
                &mut s.h[..n * dim],
            );
            s.qa_dim
                .set_forms(ActForms::for_weights([layer.gate.ty, layer.up.ty]));
            s.qa_dim.quantize(&s.h[..n * dim], dim);
            self.mm(
                layer.gate,
                &s.qa_dim,
                &s.h[..n * dim],
                &mut s.gate[..n * ffn],
            );
            self.mm(layer.up, &s.qa_dim, &s.h[..n * dim], &mut s.up[..n * ffn]);
            // Element-wise, so spread over the threads in any split.
            let (act, up) = (c.activation, &s.up[..n * ffn]);
            self.threads
                .for_each_chunk_mut(&mut s.gate[..n * ffn], ACT_CHUNK, |k, gate| {
                    let up = &up[k * ACT_CHUNK..k * ACT_CHUNK + gate.len()];
                    match act {
                        Activation::Silu => {
                            for (g, u) in gate.iter_mut().zip(up) {
                                *g = *g / (1.0 + (-*g).exp()) * u;
                            }
                        }
                        Activation::GeluTanh => {
                            for (g, u) in gate.iter_mut().zip(up) {
                                *g = gelu_tanh(*g) * u;
                            }
                        }
                    }
                });
            s.qa_ffn.set_forms(ActForms::for_weights([layer.down.ty]));
            s.qa_ffn.quantize(&s.gate[..n * ffn], ffn);
            self.mm(
                layer.down,
                &s.qa_ffn,
                &s.gate[..n * ffn],
                &mut s.o[..n * dim],
            );
            residual_add(
                &mut s.x[..n * dim],
                &s.o[..n * dim],
                layer.post_norms.as_ref().map(|[_, f]| f.as_slice()),
                c.rms_eps,
                &mut s.h[..n * dim],
            );
        }
        // Logits for the rows that want them.
        let mut m = 0;
        for (i, r) in rows.iter().enumerate() {
            if r.logits {
                let (src, dst) = (i * dim, m * dim);
                rmsnorm_rows(
                    &s.x[src..src + dim],
                    &self.output_norm,
                    c.rms_eps,
                    &mut s.h[dst..dst + dim],
                );
                m += 1;
            }
        }
        s.logits.clear();
        s.logits.resize(m * c.vocab, 0.0);
        if m > 0 {
            s.qa_dim.set_forms(ActForms::for_weights([self.output.ty]));
            s.qa_dim.quantize(&s.h[..m * dim], dim);
            self.mm(self.output, &s.qa_dim, &s.h[..m * dim], &mut s.logits);
            if let Some(cap) = c.logit_softcap {
                for v in &mut s.logits {
                    *v = (*v / cap).tanh() * cap;
                }
            }
        }
        Ok(())
    }

    fn mm(&self, w: Mat, qa: &QuantizedActivations, x: &[f32], out: &mut [f32]) {
        if w.ty.is_quantized() {
            kernels::matmul(&self.threads, w.wm(), qa, out);
        } else {
            kernels::matmul_f32(&self.threads, w.wm(), x, out);
        }
    }

    /// RoPE of each head of `x` at `pos`: on adjacent pairs (GGUF's llama
    /// convention: the converter permuted Q and K so that pairs are
    /// (2i, 2i+1)) or on halves (ggml's NEOX mode: (i, i + rope_dim/2)).
    fn rope(&self, t: &RopeTable, x: &mut [f32], pos: usize, heads: usize) {
        let c = &self.config;
        let half = c.rope_dim / 2;
        let cos = &t.cos[pos * half..(pos + 1) * half];
        let sin = &t.sin[pos * half..(pos + 1) * half];
        for h in 0..heads {
            let v = &mut x[h * c.head_dim..h * c.head_dim + c.rope_dim];
            // Pair i is (step·i, step·i + off).
            let (step, off) = match c.rope_style {
                RopeStyle::Adjacent => (2, 1),
                RopeStyle::Halves => (1, half),
            };
            for i in 0..half {
                let (ja, jb) = (step * i, step * i + off);
                let (a, b) = (v[ja], v[jb]);
                v[ja] = a * cos[i] - b * sin[i];
                v[jb] = a * sin[i] + b * cos[i];
            }
        }
    }

    /// Causal attention of every (row, head) over its own sequence's pages
    /// (`kernels::attention`: one pass per KV group, online softmax over
    /// tiles, long sequences split over the threads). Every page is read
    /// through `Pool::read_layer` once per (sequence, layer) for the slots
    /// the sequence's rows need, so a stale handle, a foreign page or an
    /// unwritten slot is an error (K1–K3) before any arithmetic.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        pool: &Pool,
        seqs: &[SeqCtx<'_>],
        plan: &AttnPlan,
        layer: usize,
        q: &[f32],
        out: &mut [f32],
        scratch: &mut AttnScratch,
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let ps = pool.shape().page_size;
        let mut pages: Vec<KvPage<'_>> = Vec::with_capacity(plan.pages);
        for (seq, &need) in seqs.iter().zip(&plan.need) {
            for j in 0..need.div_ceil(ps) {
                let n = ps.min(need - j * ps);
                let (k, v) = match pool.read_layer(seq.pages[j], seq.owner, layer, n)? {
                    LayerView::F32 { k, v } => (KvRows::F32(k), KvRows::F32(v)),
                    LayerView::F16 { k, v } => (KvRows::F16(k), KvRows::F16(v)),
                    LayerView::Q8_0 { k, v } => (KvRows::Q8_0(k), KvRows::Q8_0(v)),
                };
                pages.push(KvPage { k, v, slots: n });
            }
        }
        debug_assert_eq!(pages.len(), plan.pages);
        let arows = &plan.rows;
        let shape = AttnShape {
            n_head: c.n_head,
            n_kv_head: c.n_kv_head,
            head_dim: c.head_dim,
            page_size: ps,
            window: c.window_of(layer),
        };
        kernels::attention::attention(&self.threads, shape, &pages, arows, q, out, scratch);
        Ok(())
    }
}

/// What every layer's attention reads, the same for all layers of a step:
/// positions per sequence (`need`), each row's pages in the page list, and
/// the list's length.
struct AttnPlan {
    need: Vec<usize>,
    rows: Vec<AttnRow>,
    pages: usize,
}

impl AttnPlan {
    fn new(n_seqs: usize, rows: &[Row], ps: usize) -> AttnPlan {
        let mut need = vec![0usize; n_seqs];
        for r in rows {
            need[r.seq] = need[r.seq].max(r.pos + 1);
        }
        let mut ranges = Vec::with_capacity(n_seqs);
        let mut pages = 0;
        for &n in &need {
            ranges.push(pages..pages + n.div_ceil(ps));
            pages += n.div_ceil(ps);
        }
        let rows = rows
            .iter()
            .map(|r| AttnRow {
                pos: r.pos,
                pages: ranges[r.seq].clone(),
            })
            .collect();
        AttnPlan { need, rows, pages }
    }
}

/// Adds `b` to each `b.len()`-long row of `x`.
fn add_rows(x: &mut [f32], b: &[f32]) {
    for row in x.chunks_exact_mut(b.len()) {
        for (v, &bv) in row.iter_mut().zip(b) {
            *v += bv;
        }
    }
}

/// GELU, tanh approximation (as ggml's `gelu` and PyTorch's
/// `approximate="tanh"`).
///
/// Computed as `x · σ(2u)`, which equals `½x(1 + tanh u)` exactly in real
/// arithmetic and costs one `exp` instead of a `tanh`.
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x);
    x / (1.0 + (-2.0 * u).exp())
}

/// Elements per task of the MLP's element-wise activation.
const ACT_CHUNK: usize = 4096;

/// `x += o`, or `x += rmsnorm(o, post)` (Gemma's post-norms; `tmp` holds
/// the normed rows).
fn residual_add(x: &mut [f32], o: &[f32], post: Option<&[f32]>, eps: f32, tmp: &mut [f32]) {
    let add = match post {
        Some(w) => {
            rmsnorm_rows(o, w, eps, tmp);
            &*tmp
        }
        None => o,
    };
    for (x, a) in x.iter_mut().zip(add) {
        *x += a;
    }
}

/// [`rmsnorm_rows`] of rows no longer than a head, in place (the same
/// arithmetic, through a stack copy).
fn rmsnorm_rows_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    let mut tmp = [0.0f32; kernels::attention::HEAD_DIM_MAX];
    assert!(d <= tmp.len(), "per-head norm of {d} values");
    for row in x.chunks_exact_mut(d) {
        rmsnorm_rows(row, w, eps, &mut tmp[..d]);
        row.copy_from_slice(&tmp[..d]);
    }
}

/// RMSNorm of each `w.len()`-long row of `x` into `out`.
fn rmsnorm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mut lanes = [0.0f32; 8];
        for ch in xr.chunks_exact(8) {
            for i in 0..8 {
                lanes[i] += ch[i] * ch[i];
            }
        }
        let ss: f32 = lanes.iter().sum();
        let inv = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, &xv), &wv) in or.iter_mut().zip(xr).zip(w) {
            *o = xv * inv * wv;
        }
    }
}
