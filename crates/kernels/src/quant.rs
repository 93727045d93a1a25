//! Activation quantisation to Q8 blocks of 32 (llama.cpp's `Q8_0`/`Q8_1`
//! activations, with the scale kept in `f32`).

use crate::formats::QK;
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
        QuantizedActivations {
            n: 0,
            cols,
            qs: vec![0; max_rows * cols],
            d: vec![0.0; max_rows * nb],
            s: vec![0.0; max_rows * nb],
            sums: vec![0; max_rows * nb],
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

    /// Rows of `cols()` values that fit without reallocating.
    pub fn capacity_rows(&self) -> usize {
        self.qs.len().checked_div(self.cols).unwrap_or(0)
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
        quantize_level(
            level,
            x,
            &mut self.qs[..nblk * QK],
            &mut self.d[..nblk],
            &mut self.s[..nblk],
            &mut self.sums[..nblk],
        );
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
            quantize_level(
                level,
                x,
                &mut self.qs[..nblk * QK],
                &mut self.d[..nblk],
                &mut self.s[..nblk],
                &mut self.sums[..nblk],
            );
            return;
        }
        let p = Parts {
            qs: self.qs.as_mut_ptr(),
            d: self.d.as_mut_ptr(),
            s: self.s.as_mut_ptr(),
            sums: self.sums.as_mut_ptr(),
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
        if self.qs.len() < n * cols {
            self.qs.resize(n * cols, 0);
        }
        if self.d.len() < n * nb {
            self.d.resize(n * nb, 0.0);
            self.s.resize(n * nb, 0.0);
            self.sums.resize(n * nb, 0);
        }
        n * nb
    }

    /// Row `i` (`i < n_rows()`).
    pub fn row(&self, i: usize) -> Q8Row<'_> {
        assert!(i < self.n, "row {i} out of range ({} rows)", self.n);
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

    /// Raw parts for the kernels: (qs, d, s, sums) of all rows.
    pub(crate) fn parts(&self) -> (&[i8], &[f32], &[f32], &[i32]) {
        let nblk = self.n * (self.cols / QK);
        (
            &self.qs[..self.n * self.cols],
            &self.d[..nblk],
            &self.s[..nblk],
            &self.sums[..nblk],
        )
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
) {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers check that the level is supported, so the CPU has
        // the features the function is compiled for.
        KernelLevel::Avx512 => unsafe { quantize_avx512(x, qs, d, s, sums) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        KernelLevel::Avx2 => unsafe { quantize_avx2(x, qs, d, s, sums) },
        _ => quantize_blocks(x, qs, d, s, sums),
    }
}

#[inline(always)]
fn quantize_blocks(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32], sums: &mut [i32]) {
    for ((((xb, qb), db), sb), sumb) in x
        .chunks_exact(QK)
        .zip(qs.chunks_exact_mut(QK))
        .zip(d.iter_mut())
        .zip(s.iter_mut())
        .zip(sums.iter_mut())
    {
        let mut amax = 0.0f32;
        for &v in xb {
            amax = amax.max(v.abs());
        }
        let dd = amax / 127.0;
        let id = if dd != 0.0 { 1.0 / dd } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in qb.iter_mut().zip(xb) {
            // `as i8` saturates and maps NaN to 0, so this never fails.
            let qi = (v * id).round_ties_even().clamp(-127.0, 127.0) as i8;
            *q = qi;
            sum += qi as i32;
        }
        *db = dd;
        *sumb = sum;
        *sb = dd * sum as f32;
    }
}

/// AVX2 quantisation, bitwise equal to `quantize_blocks` (see
/// `quantize_avx512`).
///
/// # Safety
/// The CPU must support AVX2 and FMA (the slice lengths are asserted).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_avx2(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32], sums: &mut [i32]) {
    use core::arch::x86_64::*;
    let nblk = d.len();
    assert!(x.len() >= nblk * QK && qs.len() >= nblk * QK && s.len() >= nblk && sums.len() >= nblk);
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let lo = _mm256_set1_ps(-127.0);
    let hi = _mm256_set1_ps(127.0);
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..nblk {
        // SAFETY: the block lies inside x and qs (asserted above).
        unsafe {
            let xp = x.as_ptr().add(b * QK);
            let v = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(xp.add(o)));
            // max(|x|, acc) returns acc when |x| is NaN, like f32::max.
            let mut m = _mm256_setzero_ps();
            for vi in v {
                m = _mm256_max_ps(_mm256_and_ps(vi, abs_mask), m);
            }
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let m1 = _mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2));
            let amax = _mm_cvtss_f32(m1);
            let dd = amax / 127.0;
            let id = if dd != 0.0 { 1.0 / dd } else { 0.0 };
            let idv = _mm256_set1_ps(id);
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
            _mm256_storeu_si256(qs.as_mut_ptr().add(b * QK) as *mut __m256i, p);
            let t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
            let t2 = _mm_add_epi32(t4, _mm_unpackhi_epi64(t4, t4));
            let t1 = _mm_add_epi32(t2, _mm_shuffle_epi32::<1>(t2));
            let sum = _mm_cvtsi128_si32(t1);
            *d.get_unchecked_mut(b) = dd;
            *sums.get_unchecked_mut(b) = sum;
            *s.get_unchecked_mut(b) = dd * sum as f32;
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
            let dd = amax / 127.0;
            let id = if dd != 0.0 { 1.0 / dd } else { 0.0 };
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
