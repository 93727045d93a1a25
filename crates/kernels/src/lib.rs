//! Quantised matrix multiplication kernels for isoserve (CPU inference).
//!
//! # What it computes
//!
//! `out[i * rows + r] = dot(x_i, w_r)`: activation rows `x_i` (a batch of
//! `n` rows of `cols` values) times a weight matrix `w` of `rows` output
//! features. Weights stay in their raw GGUF layout ([`WeightMatrix`]): each
//! row is `cols / 32` consecutive blocks, rows are consecutive.
//!
//! | type  | bytes / 32 weights | layout | value |
//! |-------|----|--------|-------|
//! | Q4_0  | 18 | `f16 d`, 16 bytes: low nibble = weight `j`, high = `j + 16` | `d·(q − 8)` |
//! | Q4_1  | 20 | `f16 d`, `f16 m`, 16 nibble bytes as above | `d·q + m` |
//! | Q5_0  | 22 | `f16 d`, `u32` fifth bits, 16 nibble bytes | `d·(q − 16)` |
//! | Q5_1  | 24 | `f16 d`, `f16 m`, `u32` fifth bits, 16 nibble bytes | `d·q + m` |
//! | Q8_0  | 34 | `f16 d`, 32 × `i8` | `d·q` |
//! | Q4_K / Q5_K / Q6_K | 144 / 176 / 210 per 256 | super-blocks: 8 sub-blocks with 6-bit scales and mins (Q6_K: 16 `i8` scales) | `d·sc·q − dmin·m` (Q6_K: `d·sc·(q − 32)`) |
//! | F32 / F16 | 4 / 2 per weight | plain little-endian | |
//!
//! Every quantised format is one canonical form of 32-weight blocks
//! (integer codes, a scale, an optional minimum, Q6_K's two half scales;
//! see `blocks.rs`): dequantisation, the scalar kernel and every SIMD
//! kernel compute the same thing from it. [`quantize_row`] writes the
//! blocks ggml's reference quantisers (`llama-quantize` without an
//! importance matrix) write, bit for bit.
//!
//! As in llama.cpp, activations are quantised per row into Q8 blocks of 32
//! ([`QuantizedActivations`]: `d = max|x|/127`, `q = round(x/d)`, plus the
//! per-block sum of `q` for the `m` term of Q4_1 and the offsets of Q4_0), and
//! each block dot product is an exact integer. K-quant weights take a second
//! form of the same rows, blocks of 256 (llama.cpp's `Q8_K`; [`ActForms`]):
//! with one activation scale per super-block, the sub-blocks' integer scales
//! and minimums stay in the exact integer sum and one float step serves 256
//! weights instead of 32 (Q4_K 1.2–1.3×, Q6_K 1.5× faster in prefill than
//! with per-32 activations). [`matmul`] handles the quantised weight types;
//! F32/F16 (and, slowly, any type) take `f32` activations through
//! [`matmul_f32`].
//!
//! # Kernel levels
//!
//! [`KernelLevel::Scalar`] (portable reference), [`KernelLevel::Avx2`]
//! (AVX2 + FMA + F16C, every format) and [`KernelLevel::Avx512`] (AVX-512
//! BW/VL + VNNI `vpdpbusd`, for Q4_0/Q4_1/Q8_0; the other formats run the
//! AVX2 kernels at this level, with the same bits). The level is chosen once per process by
//! [`KernelLevel::active`]: the best one the CPU supports, or the one named by
//! the environment variable `ISOSERVE_KERNEL=scalar|avx2|avx512`. Tests and
//! benchmarks call a level directly with [`matmul_with_level`].
//!
//! The SIMD kernels work on *panels* of 16 (AVX-512) or 8 (AVX2) weight
//! rows. A panel's raw GGUF blocks are transposed on the fly (128-bit loads,
//! in-lane dword unpacks) so that one vector lane holds one weight row; the
//! integer block dot products of all rows of the panel then take one
//! `vpdpbusd` per 4 columns, with 4 activation values broadcast.
//!
//! * Decode (1–3 activation rows) is memory-bound: blocks are decoded and
//!   consumed directly from registers, the panel two steps ahead is
//!   prefetched into L2, and each thread streams one contiguous range of
//!   rows.
//! * Prefill (batches) is compute-bound: each expanded weight block (640
//!   bytes per 16 rows) is kept in an L1-resident buffer and reused by every
//!   activation row, 4 rows per register tile (32 `vpdpbusd` per block per
//!   tile, plus 3 float operations per row and block for the scales).
//!
//! # Determinism contract (invariant K12)
//!
//! Every output element is computed by this exact sequence, shared by all
//! kernel levels, tile shapes and thread splits:
//!
//! ```text
//! acc = 0.0f32
//! for b in 0..cols/32 (in order):
//!     isum = Σ_j qw[j]·qx[j]                      // exact i32
//!     acc  = fma(isum as f32, d_w[b] * d_x[b], acc)
//!     acc  = fma(m_w[b], d_x[b]·Σ qx, acc)         // formats with a minimum
//! out = acc
//! ```
//!
//! (`qw` is the signed code `q − 8` for Q4_0, the unsigned nibble for Q4_1,
//! the signed byte for Q8_0.) K-quants follow the same pattern per 256-weight
//! super-block `s` with the 256-column activations:
//!
//! ```text
//! for s in 0..cols/256 (in order):
//!     sumi = Σ_sub sc·Σ_j qw[j]·qx[j];  summ = Σ_sub m·Σ qx     // exact i32
//!     acc  = fma(sumi as f32, d_w[s] * d_x[s], acc)
//!     acc  = fma(summ as f32, (−dmin_w[s]) * d_x[s], acc)      // Q4_K, Q5_K
//! ```
//!
//! (`sc`: the 6-bit sub-block scale, or Q6_K's `i8` scale per 16 weights;
//! `m`: the 6-bit minimum.) SIMD kernels vectorise across weight rows —
//! never across the blocks of one dot product — so lane arithmetic is the
//! scalar arithmetic. Consequently `out[i * rows + r]` is **bitwise**
//! identical whatever the batch size `n`, the position `i` of the row in the
//! batch, the number of threads and the kernel level. The same holds for
//! activation quantisation and for [`matmul_f32`] (which has its own fixed
//! order, see there).
//!
//! # Threading
//!
//! [`ThreadPool`] keeps `n − 1` persistent workers (the caller is thread 0);
//! they spin for a short while after each job and then park on a condvar.
//! A job hands out chunks of items through an atomic counter, so dispatch
//! costs about a microsecond, allocates nothing, and a descheduled worker
//! never stalls a job (its chunks are taken over; a worker that arrives late
//! finds the job closed). [`matmul`] splits the weight rows in whole panels
//! (one range per thread for decode, four per thread for batches);
//! [`ThreadPool::parallel_for`] and [`ThreadPool::broadcast`] serve other
//! operations. A panic inside a task is re-raised on the calling thread after
//! all tasks finished; the pool remains usable. Environment: `ISOSERVE_THREADS`
//! sets the default pool size ([`ThreadPool::from_env`]).
//!
//! # Example
//!
//! ```
//! use kernels::{matmul, quantize_row, QuantizedActivations, ThreadPool, WeightMatrix, WeightType};
//!
//! let (rows, cols, n) = (64, 576, 2);
//! let wf: Vec<f32> = (0..rows * cols).map(|i| ((i * 7 % 31) as f32 - 15.0) / 40.0).collect();
//! let mut bytes = Vec::new();
//! for r in wf.chunks(cols) {
//!     quantize_row(WeightType::Q4_1, r, &mut bytes);
//! }
//! let w = WeightMatrix::new(WeightType::Q4_1, &bytes, rows, cols).unwrap();
//!
//! let pool = ThreadPool::new(2);
//! let x: Vec<f32> = (0..n * cols).map(|i| (i % 13) as f32 / 13.0 - 0.5).collect();
//! let mut xq = QuantizedActivations::new(n, cols); // reusable scratch
//! xq.quantize(&x, cols);
//! let mut out = vec![0.0f32; n * rows];
//! matmul(&pool, w, &xq, &mut out);
//!
//! // Row 1 computed alone is bitwise identical to row 1 of the batch.
//! let mut one = QuantizedActivations::new(1, cols);
//! one.quantize(&x[cols..], cols);
//! let mut out1 = vec![0.0f32; rows];
//! matmul(&pool, w, &one, &mut out1);
//! assert!(out1.iter().zip(&out[rows..]).all(|(a, b)| a.to_bits() == b.to_bits()));
//! ```

#![warn(missing_docs)]

pub mod attention;
mod blocks;
mod formats;
mod kernels;
mod kquantize;
mod level;
mod matmul;
mod pool;
mod quant;

pub use formats::{dequantize_row, quantize_row, ShapeError, WeightMatrix, WeightType, QK, QK_K};
pub use level::{KernelLevel, KERNEL_ENV};
pub use matmul::{matmul, matmul_f32, matmul_f32_with_level, matmul_with_level, reference_dot};
pub use pool::{default_threads, split_range, ThreadPool, THREADS_ENV};
pub use quant::{ActForms, Q8KRow, Q8Row, QuantizedActivations};
