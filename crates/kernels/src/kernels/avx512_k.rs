//! AVX-512 K-quant GEMV: Q4_K, Q5_K and Q6_K against one to three
//! activation rows (decode), one weight row at a time.
//!
//! Decode reads every weight once per token, so the kernel's work per byte
//! must stay below what memory delivers: the AVX2 tile (`avx2.rs`), which
//! transposes 8 rows' super-blocks into panels, reached 51–74% of the
//! memory roofline on a Q4_K_M model where Q4_1 reached 82–88%. Here a
//! super-block's 256 codes are decoded straight into four 64-byte
//! registers in block order (blocks 2k and 2k+1 in register k), multiplied
//! with the activations' 256-column form by `vpmaddubsw`, and the
//! sub-block scales enter by `vpmaddwd` with a vector that `vpermw` spreads
//! from the eight (Q6_K: sixteen) decoded scales. The integer sums are
//! exact, so their order is free; the float steps are the scalar
//! reference's ([`super::scalar::dot_row_k`]) in the same order, one
//! output at a time: the results are bit-identical to it.
//!
//! Bounds of the i16 pair sums (activations |q| ≤ 127): Q4_K 2·15·127 =
//! 3810, Q5_K 2·31·127 = 7874; Q6_K takes `maddubs(q, x) − maddubs(32, x)`,
//! each at most 2·63·127 = 16002 and their difference 2·32·127 = 8128 in
//! size. None saturates.
//!
//! More than three activation rows (prefill) run the AVX2 tile, which
//! reuses each decoded panel across rows.

use super::{ActParts, OutPtr};
use crate::blocks::ksuper;
use crate::formats::{WeightMatrix, WeightType, QK, QK_K};
use core::arch::x86_64::*;
use std::ops::Range;

/// Activation rows this GEMV serves; more go to the AVX2 tile.
pub(crate) const MAX_N: usize = 3;

/// Bytes ahead of the super-block in use that each step prefetches (a
/// row or two: the rows of a thread's panels are one contiguous stream).
const PF_BYTES: usize = 1024;

/// Computes the rows of `panels` (of `panel_rows` rows each) for `x.n ≤
/// MAX_N` activation rows.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL; `w` valid and a K-quant with
/// `w.cols` equal to the activations' columns and their 256-column form
/// computed; `out` valid for `x.n × w.rows` floats with no concurrent
/// access to the outputs of these rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn gemv(
    w: &WeightMatrix<'_>,
    x: &ActParts<'_>,
    out: OutPtr,
    panels: Range<usize>,
    panel_rows: usize,
) {
    debug_assert!(x.n >= 1 && x.n <= MAX_N);
    let rows = (panels.start * panel_rows).min(w.rows)..(panels.end * panel_rows).min(w.rows);
    // SAFETY: forwarded from this function's contract.
    unsafe {
        match (w.ty, x.n) {
            (WeightType::Q4_K, 1) => rows_of::<Q4K, 1>(w, x, out, rows),
            (WeightType::Q4_K, 2) => rows_of::<Q4K, 2>(w, x, out, rows),
            (WeightType::Q4_K, _) => rows_of::<Q4K, 3>(w, x, out, rows),
            (WeightType::Q5_K, 1) => rows_of::<Q5K, 1>(w, x, out, rows),
            (WeightType::Q5_K, 2) => rows_of::<Q5K, 2>(w, x, out, rows),
            (WeightType::Q5_K, _) => rows_of::<Q5K, 3>(w, x, out, rows),
            (WeightType::Q6_K, 1) => rows_of::<Q6K, 1>(w, x, out, rows),
            (WeightType::Q6_K, 2) => rows_of::<Q6K, 2>(w, x, out, rows),
            (WeightType::Q6_K, _) => rows_of::<Q6K, 3>(w, x, out, rows),
            _ => unreachable!("{}: not a K-quant", w.ty.name()),
        }
    }
}

/// One K-quant format's super-block: its integer sums against the
/// activations of one row.
trait Format {
    const TY: WeightType;
    const BYTES: usize;
    /// The super-block's codes, decoded into four registers (register k:
    /// blocks 2k and 2k+1, one unsigned code a byte), and its scales
    /// spread to the 32 i16 lanes of each register's `maddubs` pairs.
    ///
    /// # Safety
    /// `blk` points at a whole super-block of this format.
    unsafe fn decode(blk: *const u8) -> Decoded;
    /// Whether the codes carry the offset 32 (Q6_K: `q − 32`).
    const OFFSET32: bool;
}

struct Decoded {
    codes: [__m512i; 4],
    scales: [__m512i; 4],
    /// Q4_K/Q5_K: the eight sub-block minimums as i16.
    mins: __m128i,
}

struct Q4K;
struct Q5K;
struct Q6K;

/// The four registers' scale vectors from the decoded scales `sc` and the
/// index function of the format.
#[inline(always)]
unsafe fn spread(sc: __m512i, idx: unsafe fn(usize) -> __m512i) -> [__m512i; 4] {
    // SAFETY: register operations (features enabled by the callers).
    unsafe {
        [
            _mm512_permutexvar_epi16(idx(0), sc),
            _mm512_permutexvar_epi16(idx(1), sc),
            _mm512_permutexvar_epi16(idx(2), sc),
            _mm512_permutexvar_epi16(idx(3), sc),
        ]
    }
}

/// `vpermw` indices spreading eight i16 scales over the 32 pair lanes of
/// register k (blocks 2k and 2k+1: lanes 0..16 and 16..32).
#[inline(always)]
unsafe fn spread8(k: usize) -> __m512i {
    let mut idx = [0i16; 32];
    for (i, v) in idx.iter_mut().enumerate() {
        *v = (2 * k + i / 16) as i16;
    }
    // SAFETY: reading a local array.
    unsafe { _mm512_loadu_si512(idx.as_ptr() as *const _) }
}

/// The 6-bit scales and minimums of a Q4_K/Q5_K super-block's 12 packed
/// bytes (`crate::blocks::scale_min_k4` for all eight at once), as eight
/// i16 each.
#[inline(always)]
unsafe fn scales_mins_k4(s: *const u8) -> (__m128i, __m128i) {
    const M6: u32 = 0x3F3F_3F3F;
    const M4: u32 = 0x0F0F_0F0F;
    const M2: u32 = 0x0303_0303;
    // SAFETY: the 12 bytes are inside the super-block (caller).
    let (a, b, c) = unsafe {
        (
            (s as *const u32).read_unaligned(),
            (s.add(4) as *const u32).read_unaligned(),
            (s.add(8) as *const u32).read_unaligned(),
        )
    };
    let sc = u64::from(a & M6) | u64::from((c & M4) | ((a >> 6) & M2) << 4) << 32;
    let m = u64::from(b & M6) | u64::from(((c >> 4) & M4) | ((b >> 6) & M2) << 4) << 32;
    // SAFETY: register-only operations (the features are enabled by the
    // callers' target_feature).
    unsafe {
        (
            _mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)),
            _mm_cvtepu8_epi16(_mm_cvtsi64_si128(m as i64)),
        )
    }
}

/// Q4_K/Q5_K codes of 128 bytes of nibbles (`qs`), in block order.
#[inline(always)]
unsafe fn nibbles_k4(qs: *const u8) -> [__m512i; 4] {
    // SAFETY: 128 bytes at qs (caller); register operations otherwise.
    unsafe {
        let m = _mm512_set1_epi8(0x0F);
        let mut c = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            // Chunks 2h and 2h+1 (32 bytes each): low nibbles are blocks 4h
            // and 4h+2, high nibbles blocks 4h+1 and 4h+3.
            let q = _mm512_loadu_si512(qs.add(64 * h) as *const _);
            let lo = _mm512_and_si512(q, m);
            let hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m);
            c[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);
            c[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xEE);
        }
        c
    }
}

/// A Q4_K/Q5_K super-block's scales, minimums and nibble codes (`qs` at
/// byte `qs_at`; Q5_K adds its fifth bits to the codes).
#[inline(always)]
unsafe fn decode_k4(blk: *const u8, qs_at: usize) -> Decoded {
    // SAFETY: d, dmin, scales[12] and the 128 bytes at qs_at are inside the
    // super-block (caller).
    unsafe {
        let (sc, mins) = scales_mins_k4(blk.add(4));
        Decoded {
            codes: nibbles_k4(blk.add(qs_at)),
            scales: spread(_mm512_castsi128_si512(sc), spread8),
            mins,
        }
    }
}

impl Format for Q4K {
    const TY: WeightType = WeightType::Q4_K;
    const BYTES: usize = 144;
    const OFFSET32: bool = false;
    #[inline(always)]
    unsafe fn decode(blk: *const u8) -> Decoded {
        // SAFETY: a whole Q4_K super-block (caller): qs at 16.
        unsafe { decode_k4(blk, 16) }
    }
}

impl Format for Q5K {
    const TY: WeightType = WeightType::Q5_K;
    const BYTES: usize = 176;
    const OFFSET32: bool = false;
    #[inline(always)]
    unsafe fn decode(blk: *const u8) -> Decoded {
        // SAFETY: d, dmin, scales[12], qh[32], qs[128] are inside the
        // super-block.
        unsafe {
            let mut dec = decode_k4(blk, 48);
            // Block j's fifth bits are bit j of qh[0..32]: register k holds
            // blocks 2k (bytes 0..32) and 2k+1 (bytes 32..64), so it tests
            // bit 2k of [qh | qh >> 1].
            let qh = _mm256_loadu_si256(blk.add(16) as *const __m256i);
            let qh = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 1), 1);
            let one = _mm512_set1_epi8(1);
            let sixteen = _mm512_set1_epi8(16);
            for (k, c) in dec.codes.iter_mut().enumerate() {
                let bits = match k {
                    0 => qh,
                    1 => _mm512_srli_epi16(qh, 2),
                    2 => _mm512_srli_epi16(qh, 4),
                    _ => _mm512_srli_epi16(qh, 6),
                };
                let set = _mm512_test_epi8_mask(bits, one);
                *c = _mm512_mask_add_epi8(*c, set, *c, sixteen);
            }
            dec
        }
    }
}

/// `vpermw` indices for Q6_K register k (half k/2; runs 0,1 or 2,3): pair
/// lane i covers weights 2i and 2i+1, so scale 8·half + 4·(k%2) + i/8.
#[inline(always)]
unsafe fn spread16(k: usize) -> __m512i {
    let mut idx = [0i16; 32];
    for (i, v) in idx.iter_mut().enumerate() {
        *v = (8 * (k / 2) + 4 * (k % 2) + i / 8) as i16;
    }
    // SAFETY: reading a local array.
    unsafe { _mm512_loadu_si512(idx.as_ptr() as *const _) }
}

impl Format for Q6K {
    const TY: WeightType = WeightType::Q6_K;
    const BYTES: usize = 210;
    const OFFSET32: bool = true;
    #[inline(always)]
    unsafe fn decode(blk: *const u8) -> Decoded {
        // SAFETY: ql[128], qh[64], scales[16] and d are inside the
        // super-block.
        unsafe {
            let m4 = _mm512_set1_epi8(0x0F);
            let m30 = _mm512_set1_epi8(0x30);
            let sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(
                blk.add(192) as *const __m128i
            )));
            let mut codes = [_mm512_setzero_si512(); 4];
            for h in 0..2 {
                // Half h: ql[64h..64h+64] holds runs 0 and 1 (low nibbles,
                // bytes 0..32 and 32..64) and runs 2 and 3 (high nibbles);
                // run r's two high bits are bits 2r, 2r+1 of qh[32h..].
                let ql = _mm512_loadu_si512(blk.add(64 * h) as *const _);
                let qh = _mm256_loadu_si256(blk.add(128 + 32 * h) as *const __m256i);
                let qh =
                    _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
                let lo = _mm512_and_si512(ql, m4);
                let hi = _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4);
                codes[2 * h] = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(qh, 4), m30));
                codes[2 * h + 1] = _mm512_or_si512(hi, _mm512_and_si512(qh, m30));
            }
            Decoded {
                codes,
                scales: spread(sc, spread16),
                mins: _mm_setzero_si128(),
            }
        }
    }
}

/// Rows `rows` of the output for `N` activation rows.
///
/// # Safety
/// As [`gemv`], with `F::TY == w.ty` and `x.n == N`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn rows_of<F: Format, const N: usize>(
    w: &WeightMatrix<'_>,
    x: &ActParts<'_>,
    out: OutPtr,
    rows: Range<usize>,
) {
    assert_eq!(w.ty, F::TY);
    assert_eq!(x.n, N);
    assert_eq!(w.ty.block_bytes(), F::BYTES);
    let nsb = w.cols / QK_K;
    let nb = w.cols / QK;
    assert!(x.kqs.len() >= N * w.cols && x.kd.len() >= N * nsb && x.ksums.len() >= N * nb);
    let end = w.bytes.as_ptr_range().end;
    // SAFETY: every pointer below stays inside `w.bytes` (whole
    // super-blocks of rows < w.rows) or the activations' forms (sizes
    // asserted above); prefetches never fault.
    unsafe {
        let thirty_two = _mm512_set1_epi8(32);
        for r in rows {
            let row = w.row(r);
            let mut acc = [0.0f32; N];
            for sb in 0..nsb {
                let blk = row.as_ptr().add(sb * F::BYTES);
                let ahead = blk.wrapping_add(PF_BYTES);
                if ahead < end {
                    _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64) as *const i8);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(128) as *const i8);
                }
                let dec = F::decode(blk);
                let (dw, mneg) = ksuper(F::TY, row, sb);
                for (i, a) in acc.iter_mut().enumerate() {
                    let xs = x.kqs.as_ptr().add(i * w.cols + sb * QK_K);
                    let mut sum = _mm512_setzero_si512();
                    for k in 0..4 {
                        let xk = _mm512_loadu_si512(xs.add(64 * k) as *const _);
                        let mut p = _mm512_maddubs_epi16(dec.codes[k], xk);
                        if F::OFFSET32 {
                            p = _mm512_sub_epi16(p, _mm512_maddubs_epi16(thirty_two, xk));
                        }
                        sum = _mm512_add_epi32(sum, _mm512_madd_epi16(p, dec.scales[k]));
                    }
                    let sumi = _mm512_reduce_add_epi32(sum);
                    let dx = x.kd[i * nsb + sb];
                    // The scalar reference's float steps, in its order.
                    *a = (sumi as f32).mul_add(dw * dx, *a);
                    if !F::OFFSET32 {
                        let s = _mm_loadu_si128(
                            x.ksums.as_ptr().add(i * nb + sb * (QK_K / QK)) as *const __m128i
                        );
                        let m = _mm_madd_epi16(dec.mins, s);
                        let m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0b01_00_11_10));
                        let m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0b10_11_00_01));
                        let summ = _mm_cvtsi128_si32(m);
                        *a = (summ as f32).mul_add(mneg * dx, *a);
                    }
                }
            }
            for (i, &a) in acc.iter().enumerate() {
                *out.0.add(i * w.rows + r) = a;
            }
        }
    }
}
