//! The LLaMA forward pass over a batch of rows from several sequences, with
//! paged attention that reads and writes K/V only through `kv::Pool`
//! handles.
//!
//! Batch invariance (K12): every per-row computation (embedding, norms,
//! RoPE, matmuls — see `kernels` — and attention) depends only on that row's
//! data and its own sequence's KV, in a fixed reduction order; so a row's
//! logits are bitwise identical whatever else is in the batch and whichever
//! pages hold its KV.

use std::sync::Mutex;

use gguf::{GgmlType, GgufFile};
use kernels::{QuantizedActivations, ThreadPool, WeightMatrix, WeightType};
use kv::{DType, KvError, KvShape, LayerView, Owner, PageRef, Pool};

use crate::config::Config;
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
    ffn_norm: Vec<f32>,
    gate: Mat,
    up: Mat,
    down: Mat,
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
    /// cos/sin per (position, pair), `context_length × rope_dim/2`.
    rope_cos: Vec<f32>,
    rope_sin: Vec<f32>,
    threads: ThreadPool,
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
    qa_ffn: QuantizedActivations,
    /// Per-thread attention score buffers (context_length each).
    scores: Vec<Mutex<Vec<f32>>>,
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
            q: vec![0.0; max_rows * c.dim],
            k: vec![0.0; max_rows * c.kv_dim()],
            v: vec![0.0; max_rows * c.kv_dim()],
            att: vec![0.0; max_rows * c.dim],
            o: vec![0.0; max_rows * c.dim],
            gate: vec![0.0; max_rows * c.ffn_dim],
            up: vec![0.0; max_rows * c.ffn_dim],
            qa_dim: QuantizedActivations::new(max_rows, c.dim),
            qa_ffn: QuantizedActivations::new(max_rows, c.ffn_dim),
            scores: (0..model.threads.n_threads())
                .map(|_| Mutex::new(vec![0.0; c.context_length]))
                .collect(),
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
    }
}

impl Model {
    /// Loads a LLaMA-family GGUF. The file is memory-mapped for the life of
    /// the process: the weights are read in place, never copied, and the map
    /// is deliberately leaked (one model per process; `&'static` lets worker
    /// threads borrow weights without reference counting).
    pub fn load(path: &std::path::Path, threads: ThreadPool) -> Result<Model, ModelError> {
        let file: &'static GgufFile = Box::leak(Box::new(GgufFile::open(path)?));
        Model::from_file(file, threads)
    }

    pub fn from_file(file: &'static GgufFile, threads: ThreadPool) -> Result<Model, ModelError> {
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
        let mut layers = Vec::with_capacity(c.n_layer);
        for l in 0..c.n_layer {
            let p = |s: &str| format!("blk.{l}.{s}.weight");
            layers.push(Layer {
                attn_norm: vec(&p("attn_norm"), c.dim)?,
                q: mat(&p("attn_q"), c.dim, c.dim)?,
                k: mat(&p("attn_k"), c.kv_dim(), c.dim)?,
                v: mat(&p("attn_v"), c.kv_dim(), c.dim)?,
                o: mat(&p("attn_output"), c.dim, c.dim)?,
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
        let half = c.rope_dim / 2;
        let mut rope_cos = vec![0.0; c.context_length * half];
        let mut rope_sin = vec![0.0; c.context_length * half];
        for pos in 0..c.context_length {
            for i in 0..half {
                let freq = (c.rope_base as f64).powf(-2.0 * i as f64 / c.rope_dim as f64);
                let ang = pos as f64 * freq;
                rope_cos[pos * half + i] = ang.cos() as f32;
                rope_sin[pos * half + i] = ang.sin() as f32;
            }
        }
        Ok(Model {
            config,
            file,
            embd,
            output,
            output_norm,
            layers,
            rope_cos,
            rope_sin,
            threads,
        })
    }

    pub fn gguf(&self) -> &'static GgufFile {
        self.file
    }

    pub fn threads(&self) -> &ThreadPool {
        &self.threads
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
        let (dim, kvd, ffn) = (c.dim, c.kv_dim(), c.ffn_dim);
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
        for (l, layer) in self.layers.iter().enumerate() {
            // Attention block.
            rmsnorm_rows(
                &s.x[..n * dim],
                &layer.attn_norm,
                c.rms_eps,
                &mut s.h[..n * dim],
            );
            s.qa_dim.quantize(&s.h[..n * dim], dim);
            self.mm(layer.q, &s.qa_dim, &s.h[..n * dim], &mut s.q[..n * dim]);
            self.mm(layer.k, &s.qa_dim, &s.h[..n * dim], &mut s.k[..n * kvd]);
            self.mm(layer.v, &s.qa_dim, &s.h[..n * dim], &mut s.v[..n * kvd]);
            for (i, r) in rows.iter().enumerate() {
                self.rope(&mut s.q[i * dim..(i + 1) * dim], r.pos, c.n_head);
                self.rope(&mut s.k[i * kvd..(i + 1) * kvd], r.pos, c.n_kv_head);
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
                rows,
                l,
                &s.q[..n * dim],
                &mut s.att[..n * dim],
                &s.scores,
            )?;
            s.qa_dim.quantize(&s.att[..n * dim], dim);
            self.mm(layer.o, &s.qa_dim, &s.att[..n * dim], &mut s.o[..n * dim]);
            for (x, o) in s.x[..n * dim].iter_mut().zip(&s.o[..n * dim]) {
                *x += o;
            }
            // Feed-forward block.
            rmsnorm_rows(
                &s.x[..n * dim],
                &layer.ffn_norm,
                c.rms_eps,
                &mut s.h[..n * dim],
            );
            s.qa_dim.quantize(&s.h[..n * dim], dim);
            self.mm(
                layer.gate,
                &s.qa_dim,
                &s.h[..n * dim],
                &mut s.gate[..n * ffn],
            );
            self.mm(layer.up, &s.qa_dim, &s.h[..n * dim], &mut s.up[..n * ffn]);
            for (g, u) in s.gate[..n * ffn].iter_mut().zip(&s.up[..n * ffn]) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
            s.qa_ffn.quantize(&s.gate[..n * ffn], ffn);
            self.mm(
                layer.down,
                &s.qa_ffn,
                &s.gate[..n * ffn],
                &mut s.o[..n * dim],
            );
            for (x, o) in s.x[..n * dim].iter_mut().zip(&s.o[..n * dim]) {
                *x += o;
            }
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
            s.qa_dim.quantize(&s.h[..m * dim], dim);
            self.mm(self.output, &s.qa_dim, &s.h[..m * dim], &mut s.logits);
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

    /// RoPE on adjacent pairs (GGUF's llama convention: the converter
    /// permuted Q and K so that pairs are (2i, 2i+1)).
    fn rope(&self, x: &mut [f32], pos: usize, heads: usize) {
        let c = &self.config;
        let half = c.rope_dim / 2;
        let cos = &self.rope_cos[pos * half..(pos + 1) * half];
        let sin = &self.rope_sin[pos * half..(pos + 1) * half];
        for h in 0..heads {
            let v = &mut x[h * c.head_dim..h * c.head_dim + c.rope_dim];
            for i in 0..half {
                let (a, b) = (v[2 * i], v[2 * i + 1]);
                v[2 * i] = a * cos[i] - b * sin[i];
                v[2 * i + 1] = a * sin[i] + b * cos[i];
            }
        }
    }

    /// Causal attention of every (row, head) over its own sequence's pages,
    /// in parallel across threads. Every page is read through
    /// `Pool::read_layer` once per (row, layer) — for all heads — so a stale
    /// handle, a foreign page or an unwritten slot is an error (K1–K3)
    /// before any arithmetic.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        pool: &Pool,
        seqs: &[SeqCtx<'_>],
        rows: &[Row],
        layer: usize,
        q: &[f32],
        out: &mut [f32],
        scores: &[Mutex<Vec<f32>>],
    ) -> Result<(), ModelError> {
        let c = &self.config;
        let (hd, kvd, group) = (c.head_dim, c.kv_dim(), c.group());
        let ps = pool.shape().page_size;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut views: Vec<LayerView<'_>> = Vec::new();
        let mut view_start: Vec<usize> = Vec::with_capacity(rows.len() + 1);
        for r in rows {
            view_start.push(views.len());
            let seq = &seqs[r.seq];
            let len = r.pos + 1;
            for j in 0..len.div_ceil(ps) {
                let n = ps.min(len - j * ps);
                views.push(pool.read_layer(seq.pages[j], seq.owner, layer, n)?);
            }
        }
        view_start.push(views.len());
        let items = rows.len() * c.n_head;
        let out_ptr = SyncPtr(out.as_mut_ptr());
        let nt = self.threads.n_threads();
        self.threads.broadcast(|tid| {
            let range = kernels::split_range(items, nt, tid);
            if range.is_empty() {
                return;
            }
            let mut sc = scores[tid].lock().unwrap_or_else(|e| e.into_inner());
            for item in range {
                let (ri, h) = (item / c.n_head, item % c.n_head);
                let len = rows[ri].pos + 1;
                let qh = &q[ri * c.dim + h * hd..ri * c.dim + (h + 1) * hd];
                let pages = &views[view_start[ri]..view_start[ri + 1]];
                let acc = attend_one(pages, qh, h / group, hd, kvd, ps, scale, &mut sc[..len]);
                // SAFETY: each (row, head) item owns the disjoint range
                // [ri*dim + h*hd, +hd) of `out`, which outlives the broadcast.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(out_ptr.get().add(ri * c.dim + h * hd), hd)
                };
                dst.copy_from_slice(&acc[..hd]);
            }
        });
        Ok(())
    }
}

/// Head dimension limit for the stack accumulator in `attend_one`.
pub const HEAD_DIM_MAX: usize = 256;

#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: used only to hand disjoint sub-slices to worker threads (see the
// call site); the pointer itself is plain data.
unsafe impl Send for SyncPtr {}
// SAFETY: as for `Send`: threads write disjoint sub-slices only.
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Attention of one query head: dispatches once per process to a build of
/// the same code with AVX2+FMA enabled when the CPU has them. The arithmetic
/// (order and operations; no FMA contraction) is identical in both builds,
/// and the choice never depends on the batch, so K12 holds either way.
#[allow(clippy::too_many_arguments)]
fn attend_one(
    pages: &[LayerView<'_>],
    qh: &[f32],
    g: usize,
    hd: usize,
    kvd: usize,
    ps: usize,
    scale: f32,
    sc: &mut [f32],
) -> [f32; HEAD_DIM_MAX] {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static AVX2: OnceLock<bool> = OnceLock::new();
        let avx2 = *AVX2.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        });
        if avx2 && hd.is_multiple_of(8) {
            // SAFETY: the CPU supports AVX2 and FMA (checked above).
            return unsafe { attend_one_avx2(pages, qh, g, hd, kvd, ps, scale, sc) };
        }
    }
    attend_one_generic(pages, qh, g, hd, kvd, ps, scale, sc, dot)
}

/// # Safety
/// The CPU must support AVX2 and FMA, and the head dimension must be a
/// multiple of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_one_avx2(
    pages: &[LayerView<'_>],
    qh: &[f32],
    g: usize,
    hd: usize,
    kvd: usize,
    ps: usize,
    scale: f32,
    sc: &mut [f32],
) -> [f32; HEAD_DIM_MAX] {
    attend_one_generic(pages, qh, g, hd, kvd, ps, scale, sc, |a, b| {
        // SAFETY: this function only runs where AVX2 is available, and hd
        // is a multiple of 8 (checked by the caller).
        unsafe { dot_avx2(a, b) }
    })
}

/// `dot` with AVX2: the same lanes, products, sums and reduction order as
/// the portable `dot`, so both give the same bits.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    debug_assert_eq!(n % 8, 0);
    let mut acc = _mm256_setzero_ps();
    let mut c = 0;
    while c + 8 <= n {
        // SAFETY: c + 8 <= n <= both lengths.
        let x = unsafe { _mm256_loadu_ps(a.as_ptr().add(c)) };
        // SAFETY: as above.
        let y = unsafe { _mm256_loadu_ps(b.as_ptr().add(c)) };
        acc = _mm256_add_ps(acc, _mm256_mul_ps(x, y));
        c += 8;
    }
    let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    let t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let u = _mm_add_ss(t, _mm_shuffle_ps(t, t, 1));
    _mm_cvtss_f32(u)
}

/// Attention of one query head (of KV group `g`) over the checked views of
/// its sequence's pages; `sc` holds one score per position.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_one_generic(
    pages: &[LayerView<'_>],
    qh: &[f32],
    g: usize,
    hd: usize,
    kvd: usize,
    ps: usize,
    scale: f32,
    sc: &mut [f32],
    dot_f32: impl Fn(&[f32], &[f32]) -> f32,
) -> [f32; HEAD_DIM_MAX] {
    let mut max = f32::NEG_INFINITY;
    for (j, view) in pages.iter().enumerate() {
        let scores = &mut sc[j * ps..];
        match view {
            LayerView::F32 { k, .. } => {
                for (t, kr) in k.chunks_exact(kvd).enumerate() {
                    let s = dot_f32(qh, &kr[g * hd..(g + 1) * hd]) * scale;
                    scores[t] = s;
                    max = max.max(s);
                }
            }
            LayerView::F16 { k, .. } => {
                for (t, kr) in k.chunks_exact(kvd).enumerate() {
                    let s = dot_f16(qh, &kr[g * hd..(g + 1) * hd]) * scale;
                    scores[t] = s;
                    max = max.max(s);
                }
            }
        }
    }
    let mut sum = 0.0f32;
    for s in sc.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    let mut acc = [0.0f32; HEAD_DIM_MAX];
    let acc_h = &mut acc[..hd];
    for (j, view) in pages.iter().enumerate() {
        let weights = &sc[j * ps..];
        match view {
            LayerView::F32 { v, .. } => {
                for (t, vr) in v.chunks_exact(kvd).enumerate() {
                    let w = weights[t] * inv;
                    for (a, x) in acc_h.iter_mut().zip(&vr[g * hd..(g + 1) * hd]) {
                        *a += w * x;
                    }
                }
            }
            LayerView::F16 { v, .. } => {
                for (t, vr) in v.chunks_exact(kvd).enumerate() {
                    let w = weights[t] * inv;
                    for (a, x) in acc_h.iter_mut().zip(&vr[g * hd..(g + 1) * hd]) {
                        *a += w * x.to_f32();
                    }
                }
            }
        }
    }
    acc
}

/// Dot product with 8 independent lanes, in a fixed order (deterministic).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i];
        }
    }
    // s_i = l_i + l_{i+4}; then (s0 + s2) + (s1 + s3): the order the AVX2
    // build's horizontal reduction uses.
    let s: [f32; 4] = std::array::from_fn(|i| lanes[i] + lanes[i + 4]);
    let mut r = (s[0] + s[2]) + (s[1] + s[3]);
    for (x, y) in ar.iter().zip(br) {
        r += x * y;
    }
    r
}

#[inline(always)]
fn dot_f16(a: &[f32], b: &[half::f16]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            lanes[i] += x[i] * y[i].to_f32();
        }
    }
    let mut s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
        + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y.to_f32();
    }
    s
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
