//! Sixteen `f32` lanes, three ways: plain arrays (the reference), a pair of
//! AVX2 registers, one AVX-512 register.
//!
//! The attention tile kernel ([`super::tile`]) is written once, generic over
//! [`Lanes`]; each level instantiates it inside a `#[target_feature]`
//! function. Every operation here is lane-wise IEEE arithmetic (add, mul,
//! fma, max, exact conversions) or a reduction whose order is fixed by its
//! definition, never by the register width — which is why the three levels
//! give the same bits (invariant K12).
//!
//! The one reduction order, *fold halves*: lanes `j` and `j + 8` are added
//! (8 sums), then `j` and `j + 4`, then `j` and `j + 2`, then the last two.

#![allow(clippy::missing_safety_doc)] // every method: the level's CPU features, pointers valid for 16 values
#![allow(clippy::needless_range_loop)] // register arrays indexed by head, block and key

use half::f16;

use super::tile::{Q8Query, NB_MAX};
use super::{EXP_MAX, EXP_MIN, EXP_P, LN2_HI, LN2_LO, LOG2E, Q8_BLOCK, Q8_BLOCK_BYTES};

/// Sixteen `f32` lanes (see the module documentation).
///
/// # Safety
/// Every method may use the level's instructions: call them only inside a
/// function built with the level's target features, on a CPU that has them.
/// Pointer arguments are valid for 16 values (8 bytes for [`Lanes::load_i8`]
/// reads 16).
pub(super) trait Lanes: Copy {
    /// Dimension chunks of 16 the weighted sum of V keeps in registers per
    /// head (register pressure only; never changes a bit).
    const PV_CHUNKS: usize;
    unsafe fn zero() -> Self;
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    /// 16 `f16` values (bits), converted exactly.
    unsafe fn load_f16(p: *const u16) -> Self;
    /// One `f16` (bits), converted exactly.
    unsafe fn f16(bits: u16) -> f32;
    /// 16 `i8` values, converted exactly.
    unsafe fn load_i8(p: *const i8) -> Self;
    /// 16 `i32` values, converted (exactly below 2^24, as integer dot
    /// products of `q8_0` blocks are).
    unsafe fn load_i32(p: *const i32) -> Self;
    /// `out[h][b][t]`: the exact integer dot product of query `h`'s codes
    /// with block `b` of key `t`'s `q8_0` row (`rows[t]`), for blocks
    /// `0..nb`; 0 for `t >= rows.len()` (at most 16 rows).
    unsafe fn q8_dots<const G: usize>(
        rows: &[*const u8],
        q: &[&Q8Query; G],
        nb: usize,
        out: &mut [[[i32; 16]; NB_MAX]; G],
    );
    unsafe fn store(self, p: *mut f32);
    unsafe fn add(self, b: Self) -> Self;
    unsafe fn sub(self, b: Self) -> Self;
    unsafe fn mul(self, b: Self) -> Self;
    /// `a · b + c`, rounded once.
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    unsafe fn max(self, b: Self) -> Self;
    /// Lanes `n..16` set to `fill`.
    unsafe fn first_or(self, n: usize, fill: f32) -> Self;
    /// The contract's `exp` ([`super::exp_ref`]) in every lane.
    unsafe fn exp(self) -> Self;
    /// The largest lane (exact in any order for numbers).
    unsafe fn hmax(self) -> f32;
    /// Fold-halves sum of the lanes.
    unsafe fn tree(self) -> f32;
    /// Lane `t` = [`Lanes::tree`] of `a[t]`.
    unsafe fn tree16(a: &[Self; 16]) -> Self;
}

/// The reference: plain arrays, `f32::mul_add` (an exact fma everywhere).
#[derive(Clone, Copy)]
pub(super) struct Scalar([f32; 16]);

impl Scalar {
    #[inline(always)]
    fn map(self, b: Self, f: impl Fn(f32, f32) -> f32) -> Self {
        Scalar(std::array::from_fn(|i| f(self.0[i], b.0[i])))
    }
}

/// Fold-halves sum of 16 values (the contract's order).
#[inline(always)]
pub(super) fn fold16(l: &[f32; 16]) -> f32 {
    let a: [f32; 8] = std::array::from_fn(|j| l[j] + l[j + 8]);
    let b: [f32; 4] = std::array::from_fn(|j| a[j] + a[j + 4]);
    let c: [f32; 2] = std::array::from_fn(|j| b[j] + b[j + 2]);
    c[0] + c[1]
}

impl Lanes for Scalar {
    const PV_CHUNKS: usize = 4;
    #[inline(always)]
    unsafe fn zero() -> Self {
        Scalar([0.0; 16])
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Scalar([x; 16])
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: p valid for 16 values (trait contract).
        Scalar(std::array::from_fn(|i| unsafe { *p.add(i) }))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u16) -> Self {
        Scalar(std::array::from_fn(|i| {
            // SAFETY: as above.
            f16::from_bits(unsafe { p.add(i).read_unaligned() }).to_f32()
        }))
    }
    #[inline(always)]
    unsafe fn f16(bits: u16) -> f32 {
        f16::from_bits(bits).to_f32()
    }
    #[inline(always)]
    unsafe fn load_i8(p: *const i8) -> Self {
        // SAFETY: as above.
        Scalar(std::array::from_fn(|i| f32::from(unsafe { *p.add(i) })))
    }
    #[inline(always)]
    unsafe fn load_i32(p: *const i32) -> Self {
        // SAFETY: as above.
        Scalar(std::array::from_fn(|i| unsafe { *p.add(i) } as f32))
    }
    #[inline(always)]
    unsafe fn q8_dots<const G: usize>(
        rows: &[*const u8],
        q: &[&Q8Query; G],
        nb: usize,
        out: &mut [[[i32; 16]; NB_MAX]; G],
    ) {
        for (h, qh) in q.iter().enumerate() {
            for b in 0..nb {
                for t in 0..16 {
                    out[h][b][t] = match rows.get(t) {
                        Some(&r) => (0..Q8_BLOCK)
                            .map(|i| {
                                // SAFETY: the row holds nb whole blocks.
                                let k = unsafe { *r.add(b * Q8_BLOCK_BYTES + 2 + i) } as i8;
                                i32::from(qh.q[Q8_BLOCK * b + i]) * i32::from(k)
                            })
                            .sum(),
                        None => 0,
                    };
                }
            }
        }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        for (i, x) in self.0.into_iter().enumerate() {
            // SAFETY: as above.
            unsafe { *p.add(i) = x };
        }
    }
    #[inline(always)]
    unsafe fn add(self, b: Self) -> Self {
        self.map(b, |x, y| x + y)
    }
    #[inline(always)]
    unsafe fn sub(self, b: Self) -> Self {
        self.map(b, |x, y| x - y)
    }
    #[inline(always)]
    unsafe fn mul(self, b: Self) -> Self {
        self.map(b, |x, y| x * y)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Scalar(std::array::from_fn(|i| a.0[i].mul_add(b.0[i], c.0[i])))
    }
    #[inline(always)]
    unsafe fn max(self, b: Self) -> Self {
        // As `maxps`: the second operand when either is NaN.
        self.map(b, |x, y| if x > y { x } else { y })
    }
    #[inline(always)]
    unsafe fn first_or(self, n: usize, fill: f32) -> Self {
        Scalar(std::array::from_fn(
            |i| if i < n { self.0[i] } else { fill },
        ))
    }
    #[inline(always)]
    unsafe fn exp(self) -> Self {
        Scalar(self.0.map(super::exp_ref))
    }
    #[inline(always)]
    unsafe fn hmax(self) -> f32 {
        self.0
            .into_iter()
            .fold(f32::NEG_INFINITY, |a, b| if a > b { a } else { b })
    }
    #[inline(always)]
    unsafe fn tree(self) -> f32 {
        fold16(&self.0)
    }
    #[inline(always)]
    unsafe fn tree16(a: &[Self; 16]) -> Self {
        Scalar(std::array::from_fn(|t| fold16(&a[t].0)))
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{
        Lanes, Q8Query, EXP_MAX, EXP_MIN, EXP_P, LN2_HI, LN2_LO, LOG2E, NB_MAX, Q8_BLOCK,
        Q8_BLOCK_BYTES,
    };

    /// Lanes 0–7 in `.0[0]`, 8–15 in `.0[1]`.
    #[derive(Clone, Copy)]
    pub(in crate::attention) struct Avx2([__m256; 2]);

    /// Fold-halves of 8 lanes (the last three steps of the contract's tree).
    #[inline(always)]
    unsafe fn fold8(a: __m256) -> f32 {
        // SAFETY: register arithmetic; AVX2 in the caller.
        unsafe {
            let b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
            _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 0b01)))
        }
    }

    /// Lane t of the result = fold8 of `a[t]` (8 keys at once).
    #[inline(always)]
    unsafe fn fold8x8(a: [__m256; 8]) -> __m256 {
        // SAFETY: register arithmetic; AVX2 in the caller.
        unsafe {
            // j + j+4: per pair of keys, [key 2i: 4 lanes | key 2i+1: 4 lanes].
            let c: [__m256; 4] = std::array::from_fn(|i| {
                let (x, y) = (a[2 * i], a[2 * i + 1]);
                _mm256_add_ps(
                    _mm256_permute2f128_ps(x, y, 0x20),
                    _mm256_permute2f128_ps(x, y, 0x31),
                )
            });
            // j + j+2: per 128-bit half h, [key h of c_a: 2 | key h of c_b: 2].
            let d: [__m256; 2] = std::array::from_fn(|i| {
                let (x, y) = (_mm256_castps_pd(c[2 * i]), _mm256_castps_pd(c[2 * i + 1]));
                _mm256_add_ps(
                    _mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                    _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)),
                )
            });
            // The last pair: half h holds keys [h, 2+h, 4+h, 6+h].
            let e = _mm256_add_ps(
                _mm256_shuffle_ps(d[0], d[1], 0b10_00_10_00),
                _mm256_shuffle_ps(d[0], d[1], 0b11_01_11_01),
            );
            // Lane 4h + r holds key 2r + h.
            _mm256_permutevar8x32_ps(e, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
        }
    }

    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
        // SAFETY: register arithmetic; AVX2 and FMA in the caller.
        unsafe {
            let x = _mm256_min_ps(
                _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)),
                _mm256_set1_ps(EXP_MAX),
            );
            let n = _mm256_round_ps(
                _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
            );
            let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
            let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
            let mut p = _mm256_set1_ps(EXP_P[0]);
            for &c in &EXP_P[1..] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
            }
            let y = _mm256_add_ps(
                _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
                _mm256_set1_ps(1.0),
            );
            let e = _mm256_slli_epi32(
                _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                23,
            );
            _mm256_mul_ps(y, _mm256_castsi256_ps(e))
        }
    }

    impl Avx2 {
        #[inline(always)]
        unsafe fn map(self, b: Self, f: impl Fn(__m256, __m256) -> __m256) -> Self {
            Avx2([f(self.0[0], b.0[0]), f(self.0[1], b.0[1])])
        }
    }

    impl Lanes for Avx2 {
        const PV_CHUNKS: usize = 2;
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: AVX in the caller.
            unsafe { Avx2([_mm256_setzero_ps(); 2]) }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            // SAFETY: AVX in the caller.
            unsafe { Avx2([_mm256_set1_ps(x); 2]) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: p valid for 16 values; AVX in the caller.
            unsafe { Avx2([_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]) }
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> Self {
            // SAFETY: p valid for 16 values; F16C in the caller.
            unsafe {
                Avx2([
                    _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(8).cast())),
                ])
            }
        }
        #[inline(always)]
        unsafe fn f16(bits: u16) -> f32 {
            // SAFETY: F16C in the caller.
            unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits)))) }
        }
        #[inline(always)]
        unsafe fn load_i8(p: *const i8) -> Self {
            // SAFETY: p valid for 16 bytes; AVX2 in the caller.
            unsafe {
                let b = _mm_loadu_si128(p.cast());
                Avx2([
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b))),
                ])
            }
        }
        #[inline(always)]
        unsafe fn load_i32(p: *const i32) -> Self {
            // SAFETY: p valid for 16 values; AVX in the caller.
            unsafe {
                Avx2([
                    _mm256_cvtepi32_ps(_mm256_loadu_si256(p.cast())),
                    _mm256_cvtepi32_ps(_mm256_loadu_si256(p.add(8).cast())),
                ])
            }
        }
        #[inline(always)]
        unsafe fn q8_dots<const G: usize>(
            rows: &[*const u8],
            q: &[&Q8Query; G],
            nb: usize,
            out: &mut [[[i32; 16]; NB_MAX]; G],
        ) {
            // SAFETY: rows of nb whole blocks; queries of nb blocks; AVX2
            // in the caller. Products widened to i16 pairs (`madd`): exact.
            unsafe {
                for b in 0..nb {
                    let qw: [[__m256i; 2]; G] = std::array::from_fn(|h| {
                        let x = _mm256_loadu_si256(q[h].q.as_ptr().add(Q8_BLOCK * b).cast());
                        [
                            _mm256_cvtepi8_epi16(_mm256_castsi256_si128(x)),
                            _mm256_cvtepi8_epi16(_mm256_extracti128_si256(x, 1)),
                        ]
                    });
                    for t in 0..16 {
                        let Some(&r) = rows.get(t) else {
                            for o in out.iter_mut() {
                                o[b][t] = 0;
                            }
                            continue;
                        };
                        let k = _mm256_loadu_si256(r.add(b * Q8_BLOCK_BYTES + 2).cast());
                        let kw = [
                            _mm256_cvtepi8_epi16(_mm256_castsi256_si128(k)),
                            _mm256_cvtepi8_epi16(_mm256_extracti128_si256(k, 1)),
                        ];
                        for h in 0..G {
                            let x = _mm256_add_epi32(
                                _mm256_madd_epi16(kw[0], qw[h][0]),
                                _mm256_madd_epi16(kw[1], qw[h][1]),
                            );
                            let x = _mm_add_epi32(
                                _mm256_castsi256_si128(x),
                                _mm256_extracti128_si256(x, 1),
                            );
                            let x = _mm_add_epi32(x, _mm_unpackhi_epi64(x, x));
                            let x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0b01));
                            out[h][b][t] = _mm_cvtsi128_si32(x);
                        }
                    }
                }
            }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            // SAFETY: p valid for 16 values; AVX in the caller.
            unsafe {
                _mm256_storeu_ps(p, self.0[0]);
                _mm256_storeu_ps(p.add(8), self.0[1]);
            }
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            // SAFETY: AVX in the caller.
            unsafe { self.map(b, |x, y| _mm256_add_ps(x, y)) }
        }
        #[inline(always)]
        unsafe fn sub(self, b: Self) -> Self {
            // SAFETY: AVX in the caller.
            unsafe { self.map(b, |x, y| _mm256_sub_ps(x, y)) }
        }
        #[inline(always)]
        unsafe fn mul(self, b: Self) -> Self {
            // SAFETY: AVX in the caller.
            unsafe { self.map(b, |x, y| _mm256_mul_ps(x, y)) }
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            // SAFETY: FMA in the caller.
            unsafe {
                Avx2([
                    _mm256_fmadd_ps(a.0[0], b.0[0], c.0[0]),
                    _mm256_fmadd_ps(a.0[1], b.0[1], c.0[1]),
                ])
            }
        }
        #[inline(always)]
        unsafe fn max(self, b: Self) -> Self {
            // SAFETY: AVX in the caller.
            unsafe { self.map(b, |x, y| _mm256_max_ps(x, y)) }
        }
        #[inline(always)]
        unsafe fn first_or(self, n: usize, fill: f32) -> Self {
            // SAFETY: AVX2 in the caller.
            unsafe {
                let n = _mm256_set1_epi32(n.min(16) as i32);
                let lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let hi = _mm256_add_epi32(lo, _mm256_set1_epi32(8));
                let f = _mm256_set1_ps(fill);
                // blendv takes the second operand where the mask is set.
                Avx2([
                    _mm256_blendv_ps(f, self.0[0], _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, lo))),
                    _mm256_blendv_ps(f, self.0[1], _mm256_castsi256_ps(_mm256_cmpgt_epi32(n, hi))),
                ])
            }
        }
        #[inline(always)]
        unsafe fn exp(self) -> Self {
            // SAFETY: AVX2 and FMA in the caller.
            unsafe { Avx2([exp8(self.0[0]), exp8(self.0[1])]) }
        }
        #[inline(always)]
        unsafe fn hmax(self) -> f32 {
            // SAFETY: AVX in the caller.
            unsafe {
                let m = _mm256_max_ps(self.0[0], self.0[1]);
                let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
                let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
                _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 0b01)))
            }
        }
        #[inline(always)]
        unsafe fn tree(self) -> f32 {
            // SAFETY: AVX in the caller.
            unsafe { fold8(_mm256_add_ps(self.0[0], self.0[1])) }
        }
        #[inline(always)]
        unsafe fn tree16(a: &[Self; 16]) -> Self {
            // SAFETY: AVX2 in the caller.
            unsafe {
                let half = |h: usize| {
                    fold8x8(std::array::from_fn(|t| {
                        let x = a[8 * h + t];
                        _mm256_add_ps(x.0[0], x.0[1])
                    }))
                };
                Avx2([half(0), half(1)])
            }
        }
    }

    /// For 16 keys' vectors of two blocks' partial sums (lanes 0–7 the
    /// even block, 8–15 the odd), the sums per key: (even blocks, odd
    /// blocks), lane t for key t. Integer: any order is exact.
    #[inline(always)]
    unsafe fn sums16(a: &[__m512i; 16]) -> (__m512i, __m512i) {
        // SAFETY: register arithmetic; AVX-512F in the caller.
        unsafe {
            // j + j+4: B_i blocks: [key 2i even, key 2i odd, key 2i+1 even, key 2i+1 odd].
            let b: [__m512i; 8] = std::array::from_fn(|i| {
                let (x, y) = (a[2 * i], a[2 * i + 1]);
                _mm512_add_epi32(
                    _mm512_shuffle_i32x4::<0b10_00_10_00>(x, y),
                    _mm512_shuffle_i32x4::<0b11_01_11_01>(x, y),
                )
            });
            // j + j+2: C_k block r = [item r of B_2k: 2 | item r of B_2k+1: 2].
            let c: [__m512i; 4] = std::array::from_fn(|k| {
                let (x, y) = (b[2 * k], b[2 * k + 1]);
                _mm512_add_epi32(_mm512_unpacklo_epi64(x, y), _mm512_unpackhi_epi64(x, y))
            });
            // The last pair: D_k block r lane s = item r of B_4k+s.
            let d: [__m512i; 2] = std::array::from_fn(|k| {
                let (x, y) = (
                    _mm512_castsi512_ps(c[2 * k]),
                    _mm512_castsi512_ps(c[2 * k + 1]),
                );
                _mm512_add_epi32(
                    _mm512_castps_si512(_mm512_shuffle_ps::<0b10_00_10_00>(x, y)),
                    _mm512_castps_si512(_mm512_shuffle_ps::<0b11_01_11_01>(x, y)),
                )
            });
            // Key κ: in B_{κ/2} (D_{κ/8}, lane s = κ/2 mod 4), item r = 0
            // (even block) or 1 (odd) for κ even, 2 or 3 for κ odd.
            let idx = |odd: i32| {
                let at = |k: i32| (k / 8) * 16 + 4 * ((k % 2) * 2 + odd) + (k / 2) % 4;
                _mm512_setr_epi32(
                    at(0),
                    at(1),
                    at(2),
                    at(3),
                    at(4),
                    at(5),
                    at(6),
                    at(7),
                    at(8),
                    at(9),
                    at(10),
                    at(11),
                    at(12),
                    at(13),
                    at(14),
                    at(15),
                )
            };
            (
                _mm512_permutex2var_epi32(d[0], idx(0), d[1]),
                _mm512_permutex2var_epi32(d[0], idx(1), d[1]),
            )
        }
    }

    /// One AVX-512 register.
    #[derive(Clone, Copy)]
    pub(in crate::attention) struct Avx512(__m512);

    impl Lanes for Avx512 {
        const PV_CHUNKS: usize = 4;
        #[inline(always)]
        unsafe fn zero() -> Self {
            // SAFETY: AVX-512F in the caller.
            unsafe { Avx512(_mm512_setzero_ps()) }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            // SAFETY: AVX-512F in the caller.
            unsafe { Avx512(_mm512_set1_ps(x)) }
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            // SAFETY: p valid for 16 values; AVX-512F in the caller.
            unsafe { Avx512(_mm512_loadu_ps(p)) }
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const u16) -> Self {
            // SAFETY: p valid for 16 values; AVX-512F in the caller.
            unsafe { Avx512(_mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))) }
        }
        #[inline(always)]
        unsafe fn f16(bits: u16) -> f32 {
            // SAFETY: F16C in the caller.
            unsafe { Avx2::f16(bits) }
        }
        #[inline(always)]
        unsafe fn load_i8(p: *const i8) -> Self {
            // SAFETY: p valid for 16 bytes; AVX-512F in the caller.
            unsafe {
                Avx512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                    p.cast(),
                ))))
            }
        }
        #[inline(always)]
        unsafe fn load_i32(p: *const i32) -> Self {
            // SAFETY: p valid for 16 values; AVX-512F in the caller.
            unsafe { Avx512(_mm512_cvtepi32_ps(_mm512_loadu_si512(p.cast()))) }
        }
        #[inline(always)]
        unsafe fn q8_dots<const G: usize>(
            rows: &[*const u8],
            q: &[&Q8Query; G],
            nb: usize,
            out: &mut [[[i32; 16]; NB_MAX]; G],
        ) {
            // SAFETY: rows of nb whole blocks; queries of HEAD_DIM_MAX codes
            // (zero past hd); AVX-512 F/BW/VNNI in the caller.
            unsafe {
                // Two blocks a register: key codes + 128 (unsigned) times the
                // query's codes (signed), by `vpdpbusd`; then 128·Σq off.
                let bias = _mm512_set1_epi8(0x80u8 as i8);
                let mut pb = 0;
                while pb < nb {
                    let two = pb + 1 < nb;
                    let qz: [__m512i; G] = std::array::from_fn(|h| {
                        _mm512_loadu_si512(q[h].q.as_ptr().add(Q8_BLOCK * pb).cast())
                    });
                    let mut a = [[_mm512_setzero_si512(); 16]; G];
                    for (t, &r) in rows.iter().enumerate() {
                        let lo = _mm256_loadu_si256(r.add(pb * Q8_BLOCK_BYTES + 2).cast());
                        let hi = if two {
                            _mm256_loadu_si256(r.add((pb + 1) * Q8_BLOCK_BYTES + 2).cast())
                        } else {
                            lo // against zero query codes: adds nothing
                        };
                        let k = _mm512_xor_si512(
                            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi),
                            bias,
                        );
                        for h in 0..G {
                            a[h][t] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k, qz[h]);
                        }
                    }
                    for h in 0..G {
                        let (even, odd) = sums16(&a[h]);
                        let ce = _mm512_set1_epi32(128 * q[h].sum[pb]);
                        _mm512_storeu_si512(
                            out[h][pb].as_mut_ptr().cast(),
                            _mm512_sub_epi32(even, ce),
                        );
                        if two {
                            let co = _mm512_set1_epi32(128 * q[h].sum[pb + 1]);
                            _mm512_storeu_si512(
                                out[h][pb + 1].as_mut_ptr().cast(),
                                _mm512_sub_epi32(odd, co),
                            );
                        }
                    }
                    pb += 2;
                }
            }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            // SAFETY: p valid for 16 values; AVX-512F in the caller.
            unsafe { _mm512_storeu_ps(p, self.0) }
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            // SAFETY: AVX-512F in the caller.
            unsafe { Avx512(_mm512_add_ps(self.0, b.0)) }
        }
        #[inline(always)]
        unsafe fn sub(self, b: Self) -> Self {
            // SAFETY: AVX-512F in the caller.
            unsafe { Avx512(_mm512_sub_ps(self.0, b.0)) }
        }
        #[inline(always)]
        unsafe fn mul(self, b: Self) -> Self {
            // SAFETY: AVX-512F in the caller.
            unsafe { Avx512(_mm512_mul_ps(self.0, b.0)) }
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            // SAFETY: AVX-512F in the caller.
            unsafe { Avx512(_mm512_fmadd_ps(a.0, b.0, c.0)) }
        }
        #[inline(always)]
        unsafe fn max(self, b: Self) -> Self {
            // SAFETY: AVX-512F in the caller.
            unsafe { Avx512(_mm512_max_ps(self.0, b.0)) }
        }
        #[inline(always)]
        unsafe fn first_or(self, n: usize, fill: f32) -> Self {
            let k: __mmask16 = if n >= 16 { !0 } else { (1u16 << n) - 1 };
            // SAFETY: AVX-512F in the caller.
            unsafe { Avx512(_mm512_mask_mov_ps(_mm512_set1_ps(fill), k, self.0)) }
        }
        #[inline(always)]
        unsafe fn exp(self) -> Self {
            // SAFETY: register arithmetic; AVX-512F in the caller. The
            // operations of `exp8`, lane for lane.
            unsafe {
                let x = _mm512_min_ps(
                    _mm512_max_ps(self.0, _mm512_set1_ps(EXP_MIN)),
                    _mm512_set1_ps(EXP_MAX),
                );
                let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                );
                let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
                let r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
                let mut p = _mm512_set1_ps(EXP_P[0]);
                for &c in &EXP_P[1..] {
                    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
                }
                let y = _mm512_add_ps(
                    _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
                    _mm512_set1_ps(1.0),
                );
                let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
                    _mm512_cvtps_epi32(n),
                    _mm512_set1_epi32(127),
                ));
                Avx512(_mm512_mul_ps(y, _mm512_castsi512_ps(e)))
            }
        }
        #[inline(always)]
        unsafe fn hmax(self) -> f32 {
            // SAFETY: AVX-512F in the caller.
            unsafe {
                let m = _mm256_max_ps(
                    _mm512_castps512_ps256(self.0),
                    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0))),
                );
                Avx2([m, m]).hmax()
            }
        }
        #[inline(always)]
        unsafe fn tree(self) -> f32 {
            // SAFETY: AVX-512F in the caller.
            unsafe {
                fold8(_mm256_add_ps(
                    _mm512_castps512_ps256(self.0),
                    _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0))),
                ))
            }
        }
        #[inline(always)]
        unsafe fn tree16(a: &[Self; 16]) -> Self {
            // SAFETY: register arithmetic; AVX-512F in the caller.
            unsafe {
                // j + j+8: [key 2i: 8 lanes | key 2i+1: 8 lanes].
                let b: [__m512; 8] = std::array::from_fn(|i| {
                    let (x, y) = (a[2 * i].0, a[2 * i + 1].0);
                    _mm512_add_ps(
                        _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
                        _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
                    )
                });
                // j + j+4: 128-bit block i holds key i of the four.
                let c: [__m512; 4] = std::array::from_fn(|i| {
                    let (x, y) = (b[2 * i], b[2 * i + 1]);
                    _mm512_add_ps(
                        _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
                        _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
                    )
                });
                // j + j+2: block i holds [key i of c_a: 2 | key i of c_b: 2].
                let d: [__m512; 2] = std::array::from_fn(|i| {
                    let (x, y) = (_mm512_castps_pd(c[2 * i]), _mm512_castps_pd(c[2 * i + 1]));
                    _mm512_add_ps(
                        _mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                        _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)),
                    )
                });
                // The last pair: block i holds keys [i, 4+i, 8+i, 12+i].
                let e = _mm512_add_ps(
                    _mm512_shuffle_ps::<0b10_00_10_00>(d[0], d[1]),
                    _mm512_shuffle_ps::<0b11_01_11_01>(d[0], d[1]),
                );
                // Lane 4i + r holds key 4r + i.
                let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
                Avx512(_mm512_permutexvar_ps(idx, e))
            }
        }
    }
}
