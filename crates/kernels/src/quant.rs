//! Activation quantisation to Q8 blocks of 32 (llama.cpp's `Q8_0`/`Q8_1`
//! activations, with the scale kept in `f32`) and, for K-quant weights, to
//! Q8 super-blocks of 256 (llama.cpp's `Q8_K`: one scale per 256 columns,
//! plus the per-32 sums the K-quant minimums need).

use crate::formats::{WeightType, QK, QK_K};
use crate::kernels::ActParts;
use crate::level::KernelLevel;
use crate::pool::ThreadPool;

/// One quantised activation row, borrowed from a [`QuantizedActivations`].
///
/// For block `b` (columns `32b..32b+32`): `x[j] ≈ d[b] * qs[j]`,
/// `sums[b] = Σ qs[32b..32b+32]` and `s[b] = d[b] * sums[b] as f32`.
#[derive(Clone, Copy, Debug)]
pub struct Q8Row<'a> {
    /// Quantised values, `cols` of them.
    pub qs: &'a [i8],
    /// Per-block scales.
    pub d: &'a [f32],
    /// Per-block `d * sum`.
    pub s: &'a [f32],
    /// Per-block sums of `qs`.
    pub sums: &'a [i32],
}

/// Which forms [`QuantizedActivations`] computes. Each quantised weight type
/// consumes one: K-quants (Q4_K, Q5_K, Q6_K) the 256-column form, the
/// others the 32-column form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActForms {
    /// Q8 blocks of 32 (`d = max|x|/127` per 32 columns).
    pub blocks32: bool,
    /// Q8 super-blocks of 256 (`d = max|x|/127` per 256 columns, sums per
    /// 32); computed only when the columns are a multiple of 256.
    pub super256: bool,
}

impl ActForms {
    /// Both forms (the default).
    pub const ALL: ActForms = ActForms {
        blocks32: true,
        super256: true,
    };

    /// The forms the matmuls of these weight types need (F32/F16 need none).
    pub fn for_weights(types: impl IntoIterator<Item = WeightType>) -> ActForms {
        let mut f = ActForms {
            blocks32: false,
            super256: false,
        };
        for t in types {
            if t.is_k_quant() {
                f.super256 = true;
            } else if t.is_quantized() {
                f.blocks32 = true;
            }
        }
        f
    }
}

impl Default for ActForms {
    fn default() -> Self {
        ActForms::ALL
    }
}

/// One activation row in the 256-column form, borrowed from a
/// [`QuantizedActivations`]: `x[j] ≈ d[j / 256] * qs[j]`, `sums[b] =
/// Σ qs[32b..32b+32]`.
#[derive(Clone, Copy, Debug)]
pub struct Q8KRow<'a> {
    /// Quantised values, `cols` of them.
    pub qs: &'a [i8],
    /// Per-256 scales.
    pub d: &'a [f32],
    /// Per-32 sums of `qs` (|sum| ≤ 32 · 127).
    pub sums: &'a [i16],
}

/// A batch of `n` activation rows of `cols` values each, quantised per row
/// into Q8 blocks of 32: `d = max|x| / 127`, `q = round_ties_even(x / d)`
/// (computed as `x * (1/d)`), `q ∈ [-127, 127]`, plus the per-block integer
/// sum of `q` and `s = d * sum` (needed for the `m` term of Q4_1 and the
/// offsets of Q4_0/Q8_0).
///
/// The buffers are owned and reused: [`QuantizedActivations::quantize`]
/// allocates only when the batch is larger than any batch seen before (or
/// than the capacity given to [`QuantizedActivations::new`]).
///
/// K-quant weights take a second form of the same rows ([`ActForms`]): the
/// same algorithm over blocks of 256 (one `d` per 256 columns, `i16` sums
/// per 32), so their sub-block scales and minimums stay in exact integer
/// arithmetic and one float step serves 256 weights. Both forms are
/// computed by default; [`QuantizedActivations::set_forms`] limits a buffer
/// to what its consumers need.
///
/// Quantisation of a row depends only on that row's values (never on the
/// other rows in the batch), and gives bitwise identical results at every
/// [`KernelLevel`].
#[derive(Clone, Debug, Default)]
pub struct QuantizedActivations {
    n: usize,
    cols: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
    sums: Vec<i32>,
    /// Per block, the i16 pair (−16·P0, −16·P1) of [`pair_offsets`].
    off16: Vec<i32>,
    /// Forms the next `quantize*` computes.
    want: ActForms,
    /// Forms the current rows hold.
    have: ActForms,
    kqs: Vec<i8>,
    kd: Vec<f32>,
    ksums: Vec<i16>,
}

impl QuantizedActivations {
    /// Preallocates room for `max_rows` rows of `cols` values (`cols` must be a
    /// multiple of 32).
    pub fn new(max_rows: usize, cols: usize) -> Self {
        assert!(
            cols.is_multiple_of(QK),
            "QuantizedActivations: cols = {cols} is not a multiple of {QK}"
        );
        let nb = cols / QK;
        let k = cols.is_multiple_of(QK_K);
        QuantizedActivations {
            n: 0,
            cols,
            qs: vec![0; max_rows * cols],
            d: vec![0.0; max_rows * nb],
            s: vec![0.0; max_rows * nb],
            sums: vec![0; max_rows * nb],
            off16: vec![0; max_rows * nb],
            want: ActForms::ALL,
            have: ActForms {
                blocks32: false,
                super256: false,
            },
            // The 256-column form exists only for such rows (and is
            // computed by default).
            kqs: vec![0; if k { max_rows * cols } else { 0 }],
            kd: vec![0.0; if k { max_rows * nb / 8 } else { 0 }],
            ksums: vec![0; if k { max_rows * nb } else { 0 }],
        }
    }

    /// Sets the forms later `quantize*` calls compute (see [`ActForms`]).
    pub fn set_forms(&mut self, forms: ActForms) {
        self.want = forms;
    }

    /// Whether the current rows hold the form the matmul of `ty` needs.
    pub fn has_form_for(&self, ty: WeightType) -> bool {
        if ty.is_k_quant() {
            self.have.super256
        } else {
            self.have.blocks32
        }
    }

    /// Number of rows currently held.
    pub fn n_rows(&self) -> usize {
        self.n
    }

    /// Values per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Rows of `cols()` values that fit without reallocating, in every
    /// form the buffer is set to compute.
    pub fn capacity_rows(&self) -> usize {
        let k = self.want.super256 && self.cols.is_multiple_of(QK_K);
        let rows = |len: usize| len.checked_div(self.cols).unwrap_or(0);
        match (self.want.blocks32, k) {
            (true, true) => rows(self.qs.len()).min(rows(self.kqs.len())),
            (false, true) => rows(self.kqs.len()),
            _ => rows(self.qs.len()),
        }
    }

    /// Quantises `x` (`n × cols`, row-major, `x.len()` a multiple of `cols`)
    /// with the process-wide kernel level.
    pub fn quantize(&mut self, x: &[f32], cols: usize) {
        self.quantize_with_level(KernelLevel::active(), x, cols);
    }

    /// As [`QuantizedActivations::quantize`] with an explicit level (the
    /// result is the same at every level; only speed differs).
    pub fn quantize_with_level(&mut self, level: KernelLevel, x: &[f32], cols: usize) {
        let nblk = self.prepare(level, x, cols);
        if self.have.blocks32 {
            quantize_level(
                level,
                x,
                &mut self.qs[..nblk * QK],
                &mut self.d[..nblk],
                &mut self.s[..nblk],
                &mut self.sums[..nblk],
                &mut self.off16[..nblk],
            );
        }
        if self.have.super256 {
            quantize_k_level(
                level,
                x,
                &mut self.kqs[..nblk * QK],
                &mut self.kd[..nblk / 8],
                &mut self.ksums[..nblk],
            );
        }
    }

    /// As [`QuantizedActivations::quantize`], splitting large batches over
    /// the threads of `pool` (blocks are independent, so the result is the
    /// same).
    pub fn quantize_par(&mut self, pool: &ThreadPool, x: &[f32], cols: usize) {
        self.quantize_par_with_level(pool, KernelLevel::active(), x, cols);
    }

    /// [`QuantizedActivations::quantize_par`] at an explicit level.
    pub fn quantize_par_with_level(
        &mut self,
        pool: &ThreadPool,
        level: KernelLevel,
        x: &[f32],
        cols: usize,
    ) {
        let nblk = self.prepare(level, x, cols);
        if nblk < 2048 || pool.n_threads() == 1 {
            self.quantize_with_level(level, x, cols);
            return;
        }
        if self.have.super256 {
            let p = KParts {
                qs: self.kqs.as_mut_ptr(),
                d: self.kd.as_mut_ptr(),
                sums: self.ksums.as_mut_ptr(),
            };
            pool.parallel_for(nblk / 8, |r| {
                let p = p.get();
                let len = r.end - r.start;
                // SAFETY: `prepare` sized the K buffers for `nblk / 8`
                // super-blocks, the ranges are disjoint and `self` stays
                // mutably borrowed for the whole call.
                unsafe {
                    quantize_k_level(
                        level,
                        &x[r.start * QK_K..r.end * QK_K],
                        std::slice::from_raw_parts_mut(p.qs.add(r.start * QK_K), len * QK_K),
                        std::slice::from_raw_parts_mut(p.d.add(r.start), len),
                        std::slice::from_raw_parts_mut(p.sums.add(8 * r.start), 8 * len),
                    )
                }
            });
        }
        if !self.have.blocks32 {
            return;
        }
        let p = Parts {
            qs: self.qs.as_mut_ptr(),
            d: self.d.as_mut_ptr(),
            s: self.s.as_mut_ptr(),
            sums: self.sums.as_mut_ptr(),
            off16: self.off16.as_mut_ptr(),
        };
        pool.parallel_for(nblk, |r| {
            let p = p.get();
            let len = r.end - r.start;
            // SAFETY: `prepare` sized every buffer for `nblk` blocks, the
            // ranges handed out by parallel_for are disjoint, and `self` stays
            // mutably borrowed (so no other access) for the whole call.
            unsafe {
                quantize_level(
                    level,
                    &x[r.start * QK..r.end * QK],
                    std::slice::from_raw_parts_mut(p.qs.add(r.start * QK), len * QK),
                    std::slice::from_raw_parts_mut(p.d.add(r.start), len),
                    std::slice::from_raw_parts_mut(p.s.add(r.start), len),
                    std::slice::from_raw_parts_mut(p.sums.add(r.start), len),
                    std::slice::from_raw_parts_mut(p.off16.add(r.start), len),
                )
            }
        });
    }

    /// Checks the arguments, sizes the buffers and sets the shape; returns the
    /// number of blocks.
    fn prepare(&mut self, level: KernelLevel, x: &[f32], cols: usize) -> usize {
        assert!(
            cols > 0 && cols.is_multiple_of(QK),
            "quantize: cols = {cols} is not a positive multiple of {QK}"
        );
        assert!(
            x.len().is_multiple_of(cols),
            "quantize: x.len() = {} is not a multiple of cols = {cols}",
            x.len()
        );
        assert!(level.is_supported(), "quantize: {level:?} not supported");
        let n = x.len() / cols;
        let nb = cols / QK;
        self.cols = cols;
        self.n = n;
        self.have = ActForms {
            blocks32: self.want.blocks32,
            super256: self.want.super256 && cols.is_multiple_of(QK_K),
        };
        if self.have.blocks32 {
            if self.qs.len() < n * cols {
                self.qs.resize(n * cols, 0);
            }
            if self.d.len() < n * nb {
                self.d.resize(n * nb, 0.0);
                self.s.resize(n * nb, 0.0);
                self.sums.resize(n * nb, 0);
                self.off16.resize(n * nb, 0);
            }
        }
        if self.have.super256 {
            if self.kqs.len() < n * cols {
                self.kqs.resize(n * cols, 0);
            }
            if self.ksums.len() < n * nb {
                self.ksums.resize(n * nb, 0);
                self.kd.resize(n * nb / 8, 0.0);
            }
        }
        n * nb
    }

    /// Row `i` (`i < n_rows()`) in the 256-column form (which must have
    /// been computed, see [`ActForms`]).
    pub fn row_k(&self, i: usize) -> Q8KRow<'_> {
        assert!(i < self.n, "row {i} out of range ({} rows)", self.n);
        assert!(
            self.have.super256,
            "row_k: the 256-column form was not computed"
        );
        let nb = self.cols / QK;
        Q8KRow {
            qs: &self.kqs[i * self.cols..(i + 1) * self.cols],
            d: &self.kd[i * nb / 8..(i + 1) * nb / 8],
            sums: &self.ksums[i * nb..(i + 1) * nb],
        }
    }

    /// Dequantised value of row `i` in the form the matmul of `ty` reads
    /// (for tests).
    pub fn dequantize_row_for(&self, ty: WeightType, i: usize, out: &mut [f32]) {
        if ty.is_k_quant() {
            let r = self.row_k(i);
            for (j, o) in out.iter_mut().enumerate().take(self.cols) {
                *o = r.d[j / QK_K] * r.qs[j] as f32;
            }
        } else {
            self.dequantize_row(i, out);
        }
    }

    /// Row `i` (`i < n_rows()`).
    pub fn row(&self, i: usize) -> Q8Row<'_> {
        assert!(i < self.n, "row {i} out of range ({} rows)", self.n);
        assert!(
            self.have.blocks32,
            "row: the 32-column form was not computed"
        );
        let nb = self.cols / QK;
        Q8Row {
            qs: &self.qs[i * self.cols..(i + 1) * self.cols],
            d: &self.d[i * nb..(i + 1) * nb],
            s: &self.s[i * nb..(i + 1) * nb],
            sums: &self.sums[i * nb..(i + 1) * nb],
        }
    }

    /// Dequantised value of row `i` (for tests and debugging).
    pub fn dequantize_row(&self, i: usize, out: &mut [f32]) {
        let r = self.row(i);
        for (j, o) in out.iter_mut().enumerate().take(self.cols) {
            *o = r.d[j / QK] * r.qs[j] as f32;
        }
    }

    /// The kernels' view of all rows (a form that was not computed is
    /// empty).
    pub(crate) fn kernel_parts(&self) -> ActParts<'_> {
        let nblk = self.n * (self.cols / QK);
        let (b32, k) = (self.have.blocks32, self.have.super256);
        let take = |on: bool, len: usize| if on { len } else { 0 };
        ActParts {
            n: self.n,
            qs: &self.qs[..take(b32, self.n * self.cols)],
            d: &self.d[..take(b32, nblk)],
            s: &self.s[..take(b32, nblk)],
            sums: &self.sums[..take(b32, nblk)],
            off16: &self.off16[..take(b32, nblk)],
            kqs: &self.kqs[..take(k, self.n * self.cols)],
            kd: &self.kd[..take(k, nblk / 8)],
            ksums: &self.ksums[..take(k, nblk)],
        }
    }

    /// Row `i`'s per-block offset pairs: the i16 pair (−16·P0, −16·P1), P0
    /// the sum of the codes at columns ≡ 0, 1 (mod 4), P1 at ≡ 2, 3 (for
    /// tests).
    pub fn row_offsets(&self, i: usize) -> &[i32] {
        let nb = self.cols / QK;
        assert!(i < self.n && self.have.blocks32, "row_offsets: no row {i}");
        &self.off16[i * nb..(i + 1) * nb]
    }
}

/// Raw K-form buffer pointers shared by the threads of `quantize_par`.
#[derive(Clone, Copy)]
struct KParts {
    qs: *mut i8,
    d: *mut f32,
    sums: *mut i16,
}

// SAFETY: only used to write disjoint super-block ranges while the owning
// `QuantizedActivations` is mutably borrowed.
unsafe impl Send for KParts {}
// SAFETY: as above.
unsafe impl Sync for KParts {}

impl KParts {
    /// Accessor so closures capture the whole (Sync) wrapper.
    fn get(self) -> KParts {
        self
    }
}

/// Raw buffer pointers shared by the threads of `quantize_par`, each of
/// which writes a disjoint range of blocks.
#[derive(Clone, Copy)]
struct Parts {
    qs: *mut i8,
    d: *mut f32,
    s: *mut f32,
    sums: *mut i32,
    off16: *mut i32,
}

// SAFETY: only used to write disjoint block ranges while the owning
// `QuantizedActivations` is mutably borrowed.
unsafe impl Send for Parts {}
// SAFETY: as above.
unsafe impl Sync for Parts {}

impl Parts {
    /// Accessor so closures capture the whole (Sync) wrapper.
    fn get(self) -> Parts {
        self
    }
}

/// Quantises whole blocks (`x.len() == 32 * d.len()`) at `level`, which must
/// be supported.
fn quantize_level(
    level: KernelLevel,
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
    sums: &mut [i32],
    off16: &mut [i32],
) {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers check that the level is supported, so the CPU has
        // the features the function is compiled for.
        KernelLevel::Avx512 => unsafe {
            quantize_avx512(x, qs, d, s, sums);
            for (o, q) in off16.iter_mut().zip(qs.chunks_exact(QK)) {
                *o = pair_offsets(q);
            }
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        KernelLevel::Avx2 => unsafe { quantize_avx2(x, qs, d, s, sums, off16) },
        _ => quantize_blocks(x, qs, d, s, sums, off16),
    }
}

/// The AVX2 tile's starting value for Q4_0/Q5_0 blocks (which then need no
/// separate offset term): with `P0 = Σ q[j]` over the columns `j ≡ 0, 1
/// (mod 4)` of a block and `P1` over `j ≡ 2, 3` — the two i16 halves of a
/// `maddubs` dword — the i16 pair `(−16·P0, −16·P1)` packed in an i32
/// (|16·P| ≤ 16 · 16 · 127 fits). Q4_0 halves it.
#[inline(always)]
pub(crate) fn pair_offsets(q: &[i8]) -> i32 {
    let (mut p0, mut p1) = (0i32, 0i32);
    for (j, &v) in q.iter().enumerate().take(QK) {
        if j % 4 < 2 {
            p0 += i32::from(v);
        } else {
            p1 += i32::from(v);
        }
    }
    pack_offsets(p0, p1)
}

#[inline(always)]
fn pack_offsets(p0: i32, p1: i32) -> i32 {
    let lo = (-16 * p0) as i16 as u16 as u32;
    let hi = (-16 * p1) as i16 as u16 as u32;
    (lo | hi << 16) as i32
}

/// Quantises whole super-blocks (`x.len() == 256 * d.len()`) into the
/// 256-column form at `level`, which must be supported. AVX-512 machines run
/// the AVX2 code (same bits).
fn quantize_k_level(level: KernelLevel, x: &[f32], qs: &mut [i8], d: &mut [f32], sums: &mut [i16]) {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers check that the level is supported; every AVX-512
        // level CPU has AVX2 and FMA.
        KernelLevel::Avx512 | KernelLevel::Avx2 => unsafe { quantize_k_avx2(x, qs, d, sums) },
        _ => quantize_k_blocks(x, qs, d, sums),
    }
}

/// The 32-column algorithm over blocks of 256: `amax` over the super-block
/// (NaN ignored), `d = amax/127`, `q = round_ties_even(x · (1/d))` clamped
/// to ±127 (NaN → 0), and the integer sum of each 32 codes.
#[inline(always)]
fn quantize_k_blocks(x: &[f32], qs: &mut [i8], d: &mut [f32], sums: &mut [i16]) {
    for (((xb, qb), db), sb) in x
        .chunks_exact(QK_K)
        .zip(qs.chunks_exact_mut(QK_K))
        .zip(d.iter_mut())
        .zip(sums.chunks_exact_mut(QK_K / QK))
    {
        let (dd, id) = scale_of(xb);
        for ((x32, q32), s) in xb.chunks_exact(QK).zip(qb.chunks_exact_mut(QK)).zip(sb) {
            // |sum| ≤ 32 · 127 fits.
            *s = quant32(x32, id, q32) as i16;
        }
        *db = dd;
    }
}

/// `(d, 1/d)` of a block: `d = max|x| / 127` (NaN ignored), `1/d = 0` when
/// `d = 0`.
#[inline(always)]
fn scale_of(x: &[f32]) -> (f32, f32) {
    scale_from_amax(x.iter().fold(0.0f32, |a, v| a.max(v.abs())))
}

/// `(d, 1/d)` from `max|x|` (every level's quantiser).
#[inline(always)]
fn scale_from_amax(amax: f32) -> (f32, f32) {
    let dd = amax / 127.0;
    (dd, if dd != 0.0 { 1.0 / dd } else { 0.0 })
}

/// Quantises `x` with `x · id` (ties to even, clamped to ±127, NaN → 0)
/// into `q`; returns the sum of the codes.
#[inline(always)]
fn quant32(x: &[f32], id: f32, q: &mut [i8]) -> i32 {
    let mut sum = 0i32;
    for (q, &v) in q.iter_mut().zip(x) {
        // `as i8` saturates and maps NaN to 0, so this never fails.
        let qi = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
        *q = qi;
        sum += qi as i32;
    }
    sum
}

/// AVX2 version of `quantize_k_blocks`, bitwise equal (the per-32 steps are
/// those of `quantize_avx2`).
///
/// # Safety
/// The CPU must support AVX2 and FMA (the slice lengths are asserted).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_k_avx2(x: &[f32], qs: &mut [i8], d: &mut [f32], sums: &mut [i16]) {
    let nsb = d.len();
    assert!(x.len() >= nsb * QK_K && qs.len() >= nsb * QK_K && sums.len() >= nsb * 8);
    for sb in 0..nsb {
        // SAFETY: the super-block lies inside x and qs (asserted above).
        unsafe {
            let xp = x.as_ptr().add(sb * QK_K);
            let amax = amax_avx2(xp, QK_K / 8);
            let (dd, id) = scale_from_amax(amax);
            for k in 0..QK_K / QK {
                let (sum, _) =
                    quant32_avx2(xp.add(k * QK), id, qs.as_mut_ptr().add(sb * QK_K + k * QK));
                *sums.get_unchecked_mut(sb * 8 + k) = sum as i16;
            }
            *d.get_unchecked_mut(sb) = dd;
        }
    }
}

/// `max |x|` over `vecs` × 8 floats at `xp`, NaN ignored (as `f32::max`).
///
/// # Safety
/// AVX2; `8 · vecs` floats readable at `xp`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn amax_avx2(xp: *const f32, vecs: usize) -> f32 {
    use core::arch::x86_64::*;
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let mut m = _mm256_setzero_ps();
    for k in 0..vecs {
        // SAFETY: inside the caller's range.
        let v = unsafe { _mm256_loadu_ps(xp.add(8 * k)) };
        // max(|x|, acc) returns acc when |x| is NaN, like f32::max.
        m = _mm256_max_ps(_mm256_and_ps(v, abs_mask), m);
    }
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let m1 = _mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2));
    _mm_cvtss_f32(m1)
}

/// Quantises the 32 floats at `xp` with `x · id` (ties to even, clamped to
/// ±127, NaN → 0) into `qp`; returns their sum and the sum `P0` of the codes
/// at columns `j ≡ 0, 1 (mod 4)` (see [`pair_offsets`]).
///
/// # Safety
/// AVX2; 32 floats readable at `xp`, 32 bytes writable at `qp`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn quant32_avx2(xp: *const f32, id: f32, qp: *mut i8) -> (i32, i32) {
    use core::arch::x86_64::*;
    let lo = _mm256_set1_ps(-127.0);
    let hi = _mm256_set1_ps(127.0);
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let idv = _mm256_set1_ps(id);
    // SAFETY: inside the caller's ranges.
    let v = [0, 8, 16, 24].map(|o| unsafe { _mm256_loadu_ps(xp.add(o)) });
    let q = v.map(|vi| {
        let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(vi, idv),
        );
        let ord = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
        let c = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
        _mm256_and_si256(_mm256_cvtps_epi32(c), ord)
    });
    let p01 = _mm256_packs_epi32(q[0], q[1]);
    let p23 = _mm256_packs_epi32(q[2], q[3]);
    let p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), order);
    // SAFETY: as above.
    unsafe { _mm256_storeu_si256(qp as *mut __m256i, p) };
    let t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    let t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
    let t2 = _mm_add_epi32(t4, _mm_unpackhi_epi64(t4, t4));
    let t1 = _mm_add_epi32(t2, _mm_shuffle_epi32::<1>(t2));
    // Lane l of q[k] is column 8k + l: columns ≡ 0, 1 (mod 4) are lanes
    // 0, 1, 4, 5.
    let e = _mm256_blend_epi32::<0b1100_1100>(t, _mm256_setzero_si256());
    let e4 = _mm_add_epi32(_mm256_castsi256_si128(e), _mm256_extracti128_si256::<1>(e));
    let e1 = _mm_add_epi32(e4, _mm_shuffle_epi32::<1>(e4));
    (_mm_cvtsi128_si32(t1), _mm_cvtsi128_si32(e1))
}

#[inline(always)]
fn quantize_blocks(
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
    sums: &mut [i32],
    off16: &mut [i32],
) {
    for (((((xb, qb), db), sb), sumb), ob) in x
        .chunks_exact(QK)
        .zip(qs.chunks_exact_mut(QK))
        .zip(d.iter_mut())
        .zip(s.iter_mut())
        .zip(sums.iter_mut())
        .zip(off16.iter_mut())
    {
        let (dd, id) = scale_of(xb);
        let sum = quant32(xb, id, qb);
        *db = dd;
        *sumb = sum;
        *sb = dd * sum as f32;
        *ob = pair_offsets(qb);
    }
}

/// AVX2 quantisation, bitwise equal to `quantize_blocks` (see
/// `quantize_avx512`).
///
/// # Safety
/// The CPU must support AVX2 and FMA (the slice lengths are asserted).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_avx2(
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
    sums: &mut [i32],
    off16: &mut [i32],
) {
    let nblk = d.len();
    assert!(x.len() >= nblk * QK && qs.len() >= nblk * QK && s.len() >= nblk && sums.len() >= nblk);
    assert!(off16.len() >= nblk);
    for b in 0..nblk {
        // SAFETY: the block lies inside x and qs (asserted above).
        unsafe {
            let xp = x.as_ptr().add(b * QK);
            let amax = amax_avx2(xp, QK / 8);
            let (dd, id) = scale_from_amax(amax);
            let (sum, p0) = quant32_avx2(xp, id, qs.as_mut_ptr().add(b * QK));
            *d.get_unchecked_mut(b) = dd;
            *sums.get_unchecked_mut(b) = sum;
            *s.get_unchecked_mut(b) = dd * sum as f32;
            *off16.get_unchecked_mut(b) = pack_offsets(p0, sum - p0);
        }
    }
}

/// AVX-512 quantisation, bitwise equal to `quantize_blocks`: same `amax`
/// (NaN ignored), same `d`, `1/d`, `x * (1/d)`, ties-to-even rounding,
/// clamping, NaN → 0 and integer sum.
///
/// # Safety
/// The CPU must support the AVX-512 features enabled above (the slice
/// lengths are asserted).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn quantize_avx512(
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
    sums: &mut [i32],
) {
    use core::arch::x86_64::*;
    let nblk = d.len();
    assert!(x.len() >= nblk * QK && qs.len() >= nblk * QK && s.len() >= nblk && sums.len() >= nblk);
    for b in 0..nblk {
        // SAFETY: the block lies inside x and qs (asserted above).
        unsafe {
            let xp = x.as_ptr().add(b * QK);
            let v0 = _mm512_loadu_ps(xp);
            let v1 = _mm512_loadu_ps(xp.add(16));
            // max(|x|, acc) returns acc when |x| is NaN, like f32::max.
            let m = _mm512_max_ps(
                _mm512_abs_ps(v1),
                _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps()),
            );
            let amax = _mm512_reduce_max_ps(m);
            let (dd, id) = scale_from_amax(amax);
            let idv = _mm512_set1_ps(id);
            let lo = _mm512_set1_ps(-127.0);
            let hi = _mm512_set1_ps(127.0);
            let q = |v: __m512| {
                let p = _mm512_mul_ps(v, idv);
                let r =
                    _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(p);
                // Clamp in float (1/d can overflow to inf for subnormal d),
                // NaN lanes become 0.
                let ord = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(r, r);
                let c = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
                _mm512_maskz_cvtps_epi32(ord, c)
            };
            let (q0, q1) = (q(v0), q(v1));
            let qp = qs.as_mut_ptr().add(b * QK);
            _mm_storeu_si128(qp as *mut __m128i, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128(qp.add(16) as *mut __m128i, _mm512_cvtepi32_epi8(q1));
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            *d.get_unchecked_mut(b) = dd;
            *sums.get_unchecked_mut(b) = sum;
            *s.get_unchecked_mut(b) = dd * sum as f32;
        }
    }
}
