//! AVX-512 (F/BW/VL + VNNI) kernels.
//!
//! Work unit: a *panel* of 16 consecutive weight rows (a partial last panel
//! is computed as the full panel ending at the last row, storing only its own
//! lanes). Spans of 4 (or 2, or 1) blocks of the 16 rows are loaded with
//! 128-bit loads and transposed with in-lane unpacks, so that lane `r` of a
//! 512-bit vector holds 4 consecutive weight codes of row `r` (fields that
//! straddle the dword grid after a 2-byte scale are realigned with shifts).
//! Each activation row then computes the integer block dot products of all 16
//! weight rows at once with `vpdpbusd` (unsigned weight codes × signed
//! activations broadcast 4 at a time) and applies the block scales in exactly
//! the canonical order of [`super::scalar::dot_row`], one lane per weight row.
//!
//! * 1–3 activation rows ([`panel_direct`]): decoded blocks are consumed
//!   straight from registers; memory-bound, with software prefetch.
//! * More rows ([`panel`]): decoded blocks go to an L1-resident buffer (up to
//!   `KB` blocks) reused by every activation row, `NA` rows per register tile.

use super::{avx512_k, ActParts, OutPtr};
use crate::formats::{WeightMatrix, WeightType, QK};
use core::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::ops::Range;

pub(crate) const PANEL_ROWS: usize = 16;
/// Most blocks expanded per chunk (640 bytes each, so 30 KiB): the whole
/// row for cols <= 1536; longer rows are split into equal chunks.
const KB: usize = 48;
/// Software prefetch distance, in panels. The hardware prefetchers do not
/// follow the 16 interleaved row streams well; prefetching into L2 (T1)
/// rather than L1 avoids exhausting the L1 miss buffers (measured: 2×
/// faster for Q8_0 rows of 612 bytes).
const PF_PANELS: usize = 2;
/// Activation rows per register tile.
const NA: usize = 4;
/// Largest direct-path batch that decodes Q4_1 in spans of 4 blocks.
const SPAN4_MAX_M: usize = 1;

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;
const Q5_0: u8 = 3;
const Q5_1: u8 = 4;

/// Formats with a per-block minimum.
const fn has_min(f: u8) -> bool {
    f == Q4_1 || f == Q5_1
}
/// Formats with a fifth bit per code (in a u32 after the scales).
const fn five_bit(f: u8) -> bool {
    f == Q5_0 || f == Q5_1
}
/// Byte offset in a block of the 16 bytes of nibbles.
const fn nibbles_at(f: u8) -> usize {
    match f {
        Q4_1 => 4,
        Q5_0 => 6,
        Q5_1 => 8,
        _ => 2,
    }
}
/// Byte offset in a block of the fifth bits (Q5_0, Q5_1).
const fn qh_at(f: u8) -> usize {
    if f == Q5_0 {
        2
    } else {
        4
    }
}
/// The offset the codes carry (`q − offset` is the weight's integer).
const fn code_offset(f: u8) -> i32 {
    match f {
        Q4_0 => 8,
        Q5_0 => 16,
        Q8_0 => 128,
        _ => 0,
    }
}

/// Ors each code's fifth bit (bit c of the lane's `qh` for column c) into
/// bit 4 of the codes: `wv[q]` holds columns 4q..4q+4, `wv[4+q]` columns
/// 16+4q..16+4q+4. Four bits of a lane go to its four bytes by a multiply
/// (`t · 0x00204081` puts bit j of t at bit 8j, with no carries for t < 16).
#[inline(always)]
unsafe fn add_fifth_bits(wv: &mut [__m512i; 8], qh: __m512i) {
    // SAFETY: register operations (features enabled by the callers).
    unsafe {
        let nib = _mm512_set1_epi32(0xF);
        let spread = _mm512_set1_epi32(0x0020_4081);
        let ones = _mm512_set1_epi32(0x0101_0101);
        for (g, v) in wv.iter_mut().enumerate() {
            let shift = if g < 4 { 4 * g } else { 16 + 4 * (g - 4) };
            let t = _mm512_and_si512(_mm512_srlv_epi32(qh, _mm512_set1_epi32(shift as i32)), nib);
            let bits = _mm512_and_si512(_mm512_mullo_epi32(t, spread), ones);
            *v = _mm512_or_si512(*v, _mm512_slli_epi32::<4>(bits));
        }
    }
}

/// One expanded block of a 16-row panel.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct PBlock {
    /// `w[g]` lane r = weight codes of row r, columns 4g..4g+4 of the block,
    /// as unsigned bytes (Q8_0: `q + 128`).
    w: [__m512i; 8],
    /// Block scale `d` of each row.
    dw: __m512,
    /// Block minimum `m` of each row (Q4_1 only).
    mw: __m512,
}

/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C; `out` must
/// be valid for `x.n × w.rows` floats, with no concurrent access to the
/// columns of the rows in `panels`; `w` must be valid (`validate()`), with
/// `x.cols == w.cols`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn matmul_panels(
    w: &WeightMatrix<'_>,
    x: &ActParts<'_>,
    out: OutPtr,
    panels: Range<usize>,
) {
    match w.ty {
        // SAFETY: this function's contract (CPU features, bounds) is
        // `run`'s.
        WeightType::Q4_0 => unsafe { run::<Q4_0>(w, x, out, panels) },
        // SAFETY: as above.
        WeightType::Q4_1 => unsafe { run::<Q4_1>(w, x, out, panels) },
        // SAFETY: as above.
        WeightType::Q8_0 => unsafe { run::<Q8_0>(w, x, out, panels) },
        // SAFETY: as above.
        WeightType::Q5_0 => unsafe { run::<Q5_0>(w, x, out, panels) },
        // SAFETY: as above.
        WeightType::Q5_1 => unsafe { run::<Q5_1>(w, x, out, panels) },
        // Decode rows: the K-quant GEMV (bit-identical to the scalar
        // reference, as the AVX2 tile is).
        // SAFETY: as above (its contract is this one's).
        WeightType::Q4_K | WeightType::Q5_K | WeightType::Q6_K if x.n <= avx512_k::MAX_N => unsafe {
            avx512_k::gemv(w, x, out, panels, PANEL_ROWS)
        },
        // Prefill rows: the AVX2 tile, on the same rows (its panels are
        // half as tall).
        WeightType::Q4_K | WeightType::Q5_K | WeightType::Q6_K => {
            const HALVES: usize = PANEL_ROWS / super::avx2::PANEL_ROWS;
            let last = w.rows.div_ceil(super::avx2::PANEL_ROWS);
            let p = (panels.start * HALVES).min(last)..(panels.end * HALVES).min(last);
            // SAFETY: the same rows and outputs; AVX2 is implied by this
            // level.
            unsafe { super::avx2::matmul_panels(w, x, out, p) }
        }
        _ => unreachable!("{}: not a quantised format", w.ty.name()),
    }
}

/// Source rows of a panel.
trait Rows: Copy {
    /// 16 bytes at byte `off` of panel row `k` (`k < 16`).
    ///
    /// # Safety
    /// `off + 16` must not exceed the row length.
    ///
    /// # Safety
    /// Row `k` must exist and `off + 16` bytes must be inside it.
    unsafe fn load16(&self, k: usize, off: usize) -> __m128i;

    /// Byte offsets of the 16 rows from `base()`, for gathers.
    fn offsets(&self) -> __m512i;
    fn base(&self) -> *const u8;
}

/// 16 consecutive rows: row `4i + j` starts at `q[j] + i * r4`, which keeps
/// the addressing in a few registers.
#[derive(Clone, Copy)]
struct UniformRows {
    q: [*const u8; 4],
    r4: usize,
    rb: usize,
}

impl Rows for UniformRows {
    /// # Safety
    /// Row `k` must exist and `off + 16` bytes must be inside it.
    #[inline(always)]
    unsafe fn load16(&self, k: usize, off: usize) -> __m128i {
        // SAFETY: row k exists and off + 16 <= row length (caller).
        unsafe { _mm_loadu_si128(self.q[k & 3].add((k >> 2) * self.r4 + off) as *const __m128i) }
    }
    #[inline(always)]
    fn offsets(&self) -> __m512i {
        let mut o = [0i32; PANEL_ROWS];
        for (k, v) in o.iter_mut().enumerate() {
            *v = (k * self.rb) as i32;
        }
        // SAFETY: reading a local array.
        unsafe { _mm512_loadu_si512(o.as_ptr() as *const _) }
    }
    #[inline(always)]
    fn base(&self) -> *const u8 {
        self.q[0]
    }
}

/// Fewer than 16 rows in the whole matrix: missing rows repeat the last one
/// (their lanes are never stored).
#[derive(Clone, Copy)]
struct ClampedRows {
    base: *const u8,
    offs: [usize; PANEL_ROWS],
}

impl Rows for ClampedRows {
    /// # Safety
    /// Row `k` must exist and `off + 16` bytes must be inside it.
    #[inline(always)]
    unsafe fn load16(&self, k: usize, off: usize) -> __m128i {
        // SAFETY: as for UniformRows.
        unsafe { _mm_loadu_si128(self.base.add(self.offs[k] + off) as *const __m128i) }
    }
    #[inline(always)]
    fn offsets(&self) -> __m512i {
        let mut o = [0i32; PANEL_ROWS];
        for (v, &x) in o.iter_mut().zip(&self.offs) {
            *v = x as i32;
        }
        // SAFETY: reading a local array.
        unsafe { _mm512_loadu_si512(o.as_ptr() as *const _) }
    }
    #[inline(always)]
    fn base(&self) -> *const u8 {
        self.base
    }
}

const fn block_bytes(f: u8) -> usize {
    match f {
        Q4_0 => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        Q5_1 => 24,
        _ => 34,
    }
}

/// # Safety
/// As [`matmul_panels`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn run<const F: u8>(
    w: &WeightMatrix<'_>,
    x: &ActParts<'_>,
    out: OutPtr,
    panels: Range<usize>,
) {
    let rb = w.row_bytes();
    let rows = w.rows;
    let start = w.bytes.as_ptr();
    // Prefetch only this call's rows (other panels belong to other threads,
    // whose L2 would not see our prefetches), and warm up its first panels.
    let lo = start as usize + (panels.start * PANEL_ROWS * rb).min(w.bytes.len());
    let pf_limit = start as usize + (panels.end * PANEL_ROWS * rb).min(w.bytes.len());
    let warm_end = pf_limit.min(lo + PF_PANELS * PANEL_ROWS * rb);
    for a in (lo..warm_end).step_by(64) {
        // Prefetches never fault; the address is inside the matrix.
        _mm_prefetch::<_MM_HINT_T1>(a as *const i8);
    }
    for p in panels {
        let r0 = p * PANEL_ROWS;
        if rows >= PANEL_ROWS {
            // A partial last panel is computed as the full panel ending at the
            // last row; only its own rows are stored.
            let first = r0.min(rows - PANEL_ROWS);
            let nr = (rows - r0).min(PANEL_ROWS);
            let skip = r0 - first;
            let mask = (((1u32 << nr) - 1) << skip) as u16;
            // SAFETY: rows first..first+16 exist.
            let q = unsafe { [0, 1, 2, 3].map(|j| start.add((first + j) * rb)) };
            let src = UniformRows { q, r4: 4 * rb, rb };
            // SAFETY: forwarded; the panel is inside the matrix.
            unsafe {
                match x.n {
                    1 => panel_direct::<F, _, 1>(w, x, out, src, first, mask, pf_limit),
                    2 => panel_direct::<F, _, 2>(w, x, out, src, first, mask, pf_limit),
                    3 => panel_direct::<F, _, 3>(w, x, out, src, first, mask, pf_limit),
                    _ => panel::<F, _>(w, x, out, src, first, mask, pf_limit),
                }
            };
        } else {
            let mut offs = [0usize; PANEL_ROWS];
            for (k, o) in offs.iter_mut().enumerate() {
                *o = k.min(rows - 1) * rb;
            }
            let src = ClampedRows { base: start, offs };
            let mask = ((1u32 << rows) - 1) as u16;
            // SAFETY: as above.
            unsafe {
                match x.n {
                    1 => panel_direct::<F, _, 1>(w, x, out, src, 0, mask, pf_limit),
                    2 => panel_direct::<F, _, 2>(w, x, out, src, 0, mask, pf_limit),
                    3 => panel_direct::<F, _, 3>(w, x, out, src, 0, mask, pf_limit),
                    _ => panel::<F, _>(w, x, out, src, 0, mask, pf_limit),
                }
            };
        }
    }
}

/// Computes one panel starting at row `r0`, storing the lanes in `mask`.
///
/// # Safety
/// The CPU must support the features enabled above; the panel's rows and
/// outputs must be in bounds, and no other thread may write those outputs.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn panel<const F: u8, R: Rows>(
    w: &WeightMatrix<'_>,
    x: &ActParts<'_>,
    out: OutPtr,
    src: R,
    r0: usize,
    mask: __mmask16,
    pf_limit: usize,
) {
    let rb = w.row_bytes();
    let nb = w.cols / QK;
    let bb = block_bytes(F);
    let mut buf = [MaybeUninit::<PBlock>::uninit(); KB];
    let bufp = buf.as_mut_ptr() as *mut PBlock;
    // Chunks of at most KB blocks, of equal size (multiple of 4 blocks).
    let n_chunks = nb.div_ceil(KB);
    let chunk = (nb.div_ceil(n_chunks).div_ceil(4) * 4).min(KB);
    // Prefetch: lines of the panel PF_PANELS ahead, spread over the blocks.
    let panel_lines = (PANEL_ROWS * rb).div_ceil(64);
    let pf_per_block = panel_lines.div_ceil(nb);
    let pf_base = src.base().wrapping_add(PF_PANELS * PANEL_ROWS * rb) as usize;
    let vidx = src.offsets();
    let mut c0 = 0;
    while c0 < nb {
        let kb = (nb - c0).min(chunk);
        let mut b = 0;
        while b < kb {
            let span = if kb - b >= 4 {
                4
            } else if kb - b >= 2 {
                2
            } else {
                1
            };
            let first_line = (c0 + b) * pf_per_block;
            for l in first_line..first_line + span * pf_per_block {
                let a = pf_base + 64 * l;
                if a < pf_limit {
                    // Prefetches never fault; the address is inside the matrix.
                    _mm_prefetch::<_MM_HINT_T1>(a as *const i8);
                }
            }
            let off = (c0 + b) * bb;
            let store = |k: usize, wv: &[__m512i; 8], dw: __m512, mw: __m512| {
                // SAFETY: slot b + k < kb <= KB; plain data written without
                // reading the (possibly uninitialised) slot.
                unsafe {
                    let p = bufp.add(b + k);
                    (*p).w = *wv;
                    (*p).dw = dw;
                    (*p).mw = mw;
                }
            };
            // SAFETY: blocks c0+b..c0+b+span exist in every row.
            unsafe { decode::<F, R>(&src, vidx, span, off, store) };
            b += span;
        }
        let ctx = TileCtx {
            buf: bufp,
            kb,
            c0,
            nb,
            first: c0 == 0,
            rows: w.rows,
            r0,
            mask,
            full: mask == u16::MAX,
        };
        let mut i = 0;
        while i < x.n {
            let m = (x.n - i).min(NA);
            // SAFETY: rows i..i+m exist; the chunk was expanded above.
            unsafe {
                match m {
                    4 => tile::<F, 4>(&ctx, x, i, out),
                    3 => tile::<F, 3>(&ctx, x, i, out),
                    2 => tile::<F, 2>(&ctx, x, i, out),
                    _ => tile::<F, 1>(&ctx, x, i, out),
                }
            }
            i += m;
        }
        c0 += kb;
    }
}

/// Loads 16 bytes at `off` from each of the 16 rows and transposes them so
/// that lane `r` of result `d` is the `d`-th little-endian dword of row `r`.
///
/// # Safety
/// The CPU must support the features enabled above; `off + 16` bytes must
/// be inside each of the 16 rows.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn transpose4<R: Rows>(src: &R, off: usize) -> [__m512i; 4] {
    // SAFETY: k is a row of the panel; the caller guarantees `off + 16`
    // bytes are inside each row.
    let ld = |k: usize| unsafe { src.load16(k, off) };
    // z[j] = [row j | row 4+j | row 8+j | row 12+j] (128-bit lanes).
    let mut z = [_mm512_setzero_si512(); 4];
    for (j, zj) in z.iter_mut().enumerate() {
        let v = _mm512_castsi128_si512(ld(j));
        let v = _mm512_inserti32x4::<1>(v, ld(4 + j));
        let v = _mm512_inserti32x4::<2>(v, ld(8 + j));
        *zj = _mm512_inserti32x4::<3>(v, ld(12 + j));
    }
    // In-lane 4×4 dword transpose: lane L element k of result d becomes
    // dword d of z[k] lane L, i.e. of row 4L + k.
    let t0 = _mm512_unpacklo_epi32(z[0], z[1]);
    let t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    let t2 = _mm512_unpacklo_epi32(z[2], z[3]);
    let t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    [
        _mm512_unpacklo_epi64(t0, t2),
        _mm512_unpackhi_epi64(t0, t2),
        _mm512_unpacklo_epi64(t1, t3),
        _mm512_unpackhi_epi64(t1, t3),
    ]
}

/// Decodes `SPAN` consecutive blocks starting at byte `off` of each row,
/// where the span is `ND` whole dwords (`ND * 4 == SPAN * block bytes`), and
/// calls `f(k, codes, d, m)` for each block `k` of the span (lane = row;
/// `m` is zero except for Q4_1). The span is transposed dword by dword;
/// fields that straddle the dword grid (Q4_0/Q8_0 codes after a 2-byte
/// scale) are realigned with shifts.
///
/// # Safety
/// The CPU must support the features enabled above; the span must lie
/// inside each row.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn decode_span<const F: u8, R: Rows, const SPAN: usize, const ND: usize>(
    src: &R,
    off: usize,
    mut f: impl FnMut(usize, &[__m512i; 8], __m512, __m512),
) {
    debug_assert_eq!(ND * 4, SPAN * block_bytes(F));
    let mut t = [_mm512_setzero_si512(); ND];
    let mut c = 0;
    loop {
        let c0 = c.min(ND - 4);
        // SAFETY: dwords c0..c0+4 lie inside the span, inside every row.
        let v = unsafe { transpose4(src, off + 4 * c0) };
        t[c0..c0 + 4].copy_from_slice(&v);
        if c0 == ND - 4 {
            break;
        }
        c += 4;
    }
    // The dword starting at byte `o` of the span.
    let dword = |o: usize| {
        if o.is_multiple_of(4) {
            t[o / 4]
        } else {
            _mm512_or_si512(
                _mm512_srli_epi32::<16>(t[o / 4]),
                _mm512_slli_epi32::<16>(t[o / 4 + 1]),
            )
        }
    };
    // The f16 at byte `o`, in the low half of each lane.
    let half = |o: usize| {
        if o.is_multiple_of(4) {
            t[o / 4]
        } else {
            _mm512_srli_epi32::<16>(t[o / 4])
        }
    };
    let bb = block_bytes(F);
    for k in 0..SPAN {
        let bo = k * bb;
        let mut wv = [_mm512_setzero_si512(); 8];
        if F == Q8_0 {
            let x80 = _mm512_set1_epi8(0x80u8 as i8);
            for (g, v) in wv.iter_mut().enumerate() {
                *v = _mm512_xor_si512(dword(bo + 2 + 4 * g), x80);
            }
        } else {
            let m4 = _mm512_set1_epi8(0x0F);
            let nib = bo + nibbles_at(F);
            for q in 0..4 {
                let d = dword(nib + 4 * q);
                wv[q] = _mm512_and_si512(d, m4);
                wv[4 + q] = _mm512_and_si512(_mm512_srli_epi32::<4>(d), m4);
            }
            if five_bit(F) {
                // SAFETY: register operations.
                unsafe { add_fifth_bits(&mut wv, dword(bo + qh_at(F))) };
            }
        }
        let dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(half(bo)));
        let mw = if has_min(F) {
            _mm512_cvtph_ps(_mm512_cvtepi32_epi16(half(bo + 2)))
        } else {
            _mm512_setzero_ps()
        };
        f(k, &wv, dw, mw);
    }
}

/// Decodes the single block at byte `off` of each row (odd block counts);
/// calls `f(0, codes, d, m)` as [`decode_span`] does.
///
/// # Safety
/// The CPU must support the features enabled above; the block must lie
/// inside each row.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn decode_one<const F: u8, R: Rows>(
    src: &R,
    vidx: __m512i,
    off: usize,
    mut f: impl FnMut(usize, &[__m512i; 8], __m512, __m512),
) {
    // SAFETY: every row has this whole block; the dword at its start holds d
    // (and m for Q4_1) and is inside the block.
    let g = unsafe { _mm512_i32gather_epi32::<1>(vidx, src.base().add(off) as *const _) };
    let dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
    let mut wv = [_mm512_setzero_si512(); 8];
    if F == Q8_0 {
        let x80 = _mm512_set1_epi8(0x80u8 as i8);
        // SAFETY: bytes 2..34 of the block.
        let (t, u) = unsafe { (transpose4(src, off + 2), transpose4(src, off + 18)) };
        for q in 0..4 {
            wv[q] = _mm512_xor_si512(t[q], x80);
            wv[4 + q] = _mm512_xor_si512(u[q], x80);
        }
    } else {
        let m4 = _mm512_set1_epi8(0x0F);
        // SAFETY: the 16 nibble bytes of the block.
        let t = unsafe { transpose4(src, off + nibbles_at(F)) };
        for q in 0..4 {
            wv[q] = _mm512_and_si512(t[q], m4);
            wv[4 + q] = _mm512_and_si512(_mm512_srli_epi32::<4>(t[q]), m4);
        }
        if five_bit(F) {
            // SAFETY: every row has this whole block; its fifth bits are the
            // dword at qh_at.
            unsafe {
                let qh =
                    _mm512_i32gather_epi32::<1>(vidx, src.base().add(off + qh_at(F)) as *const _);
                add_fifth_bits(&mut wv, qh);
            }
        }
    }
    let mw = if has_min(F) {
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(g)))
    } else {
        _mm512_setzero_ps()
    };
    f(0, &wv, dw, mw);
}

/// Decodes `span` blocks (4, 2 or 1) at byte `off` of each row.
///
/// # Safety
/// The CPU must support the features enabled above; the blocks must lie
/// inside each row.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn decode<const F: u8, R: Rows>(
    src: &R,
    vidx: __m512i,
    span: usize,
    off: usize,
    f: impl FnMut(usize, &[__m512i; 8], __m512, __m512),
) {
    // SAFETY: forwarded (the caller guarantees the blocks exist).
    unsafe {
        match (span, F) {
            (4, Q4_0) => decode_span::<F, R, 4, 18>(src, off, f),
            (4, Q4_1) => decode_span::<F, R, 4, 20>(src, off, f),
            (4, Q5_0) => decode_span::<F, R, 4, 22>(src, off, f),
            (4, Q5_1) => decode_span::<F, R, 4, 24>(src, off, f),
            (4, _) => decode_span::<F, R, 4, 34>(src, off, f),
            (2, Q4_0) => decode_span::<F, R, 2, 9>(src, off, f),
            (2, Q4_1) => decode_span::<F, R, 2, 10>(src, off, f),
            (2, Q5_0) => decode_span::<F, R, 2, 11>(src, off, f),
            (2, Q5_1) => decode_span::<F, R, 2, 12>(src, off, f),
            (2, _) => decode_span::<F, R, 2, 17>(src, off, f),
            _ => decode_one::<F, R>(src, vidx, off, f),
        }
    }
}

/// Small batches (`M` ≤ 3 activation rows; at 4 the register pressure makes
/// the buffered path faster): decodes and consumes each block directly from
/// registers (no expansion buffer), with the same per-lane arithmetic as
/// [`tile`].
///
/// # Safety
/// As [`panel`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn panel_direct<const F: u8, R: Rows, const M: usize>(
    w: &WeightMatrix<'_>,
    x: &ActParts<'_>,
    out: OutPtr,
    src: R,
    r0: usize,
    mask: __mmask16,
    pf_limit: usize,
) {
    let rb = w.row_bytes();
    let nb = w.cols / QK;
    let bb = block_bytes(F);
    let cols = w.cols;
    let panel_lines = (PANEL_ROWS * rb).div_ceil(64);
    let pf_per_block = panel_lines.div_ceil(nb);
    let pf_base = src.base().wrapping_add(PF_PANELS * PANEL_ROWS * rb) as usize;
    let vidx = src.offsets();
    let (qa, dp, sp, sump) = (x.qs.as_ptr(), x.d.as_ptr(), x.s.as_ptr(), x.sums.as_ptr());
    let mut acc = [_mm512_setzero_ps(); M];
    let mut b = 0;
    while b < nb {
        // Spans of 4 blocks need many registers; Q4_0/Q8_0 (which realign
        // half of their blocks) run faster with spans of 2.
        let span = if nb - b >= 4 && F == Q4_1 && M <= SPAN4_MAX_M {
            4
        } else if nb - b >= 2 {
            2
        } else {
            1
        };
        let first_line = b * pf_per_block;
        for l in first_line..first_line + span * pf_per_block {
            let a = pf_base + 64 * l;
            if a < pf_limit {
                // Prefetches never fault; the address is inside the matrix.
                _mm_prefetch::<_MM_HINT_T1>(a as *const i8);
            }
        }
        let b0 = b;
        let step = |k: usize, wv: &[__m512i; 8], dw: __m512, mw: __m512| {
            let gb = b0 + k;
            let mut s0 = [_mm512_setzero_si512(); M];
            let mut s1 = [_mm512_setzero_si512(); M];
            for g in 0..8 {
                for t in 0..M {
                    // SAFETY: bytes 4g..4g+4 of block gb of activation row t.
                    let a = unsafe {
                        (qa.add(t * cols + gb * QK + 4 * g) as *const i32).read_unaligned()
                    };
                    if g < 4 {
                        s0[t] = _mm512_dpbusd_epi32(s0[t], wv[g], _mm512_set1_epi32(a));
                    } else {
                        s1[t] = _mm512_dpbusd_epi32(s1[t], wv[g], _mm512_set1_epi32(a));
                    }
                }
            }
            for t in 0..M {
                let k = t * nb + gb;
                // SAFETY: block k of the activations exists.
                let (da, sa, sum) = unsafe { (*dp.add(k), *sp.add(k), *sump.add(k)) };
                let mut isum = _mm512_add_epi32(s0[t], s1[t]);
                if code_offset(F) != 0 {
                    isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(code_offset(F) * sum));
                }
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(da));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[t]);
                if has_min(F) {
                    acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sa), acc[t]);
                }
            }
        };
        // SAFETY: blocks b..b+span exist in every row.
        unsafe { decode::<F, R>(&src, vidx, span, b * bb, step) };
        b += span;
    }
    for t in 0..M {
        // SAFETY: row t of `out`, columns r0.. of the lanes in `mask` (valid).
        unsafe { _mm512_mask_storeu_ps(out.0.add(t * w.rows + r0), mask, acc[t]) };
    }
}

struct TileCtx {
    buf: *const PBlock,
    kb: usize,
    c0: usize,
    nb: usize,
    first: bool,
    rows: usize,
    r0: usize,
    mask: __mmask16,
    full: bool,
}

/// Accumulates the chunk into activation rows `i0..i0+M` × the panel, with the
/// running sums kept in `out` between chunks.
///
/// # Safety
/// The CPU must support the features enabled above; rows `i0..i0 + M` of
/// `x` and the panel's outputs in `out` must be in bounds, and no other
/// thread may write those outputs.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const F: u8, const M: usize>(c: &TileCtx, x: &ActParts<'_>, i0: usize, out: OutPtr) {
    let cols = c.nb * QK;
    let mut acc = [_mm512_setzero_ps(); M];
    let mut optr = [std::ptr::null_mut::<f32>(); M];
    let mut qa = [std::ptr::null::<i8>(); M];
    let mut bi = [0usize; M];
    for t in 0..M {
        // SAFETY: in bounds of `out` (row i0+t < n, columns r0..r0+nr).
        optr[t] = unsafe { out.0.add((i0 + t) * c.rows + c.r0) };
        // SAFETY: in bounds of qs (row i0+t, block c0).
        qa[t] = unsafe { x.qs.as_ptr().add((i0 + t) * cols + c.c0 * QK) };
        bi[t] = (i0 + t) * c.nb + c.c0;
        if !c.first {
            // SAFETY: the lanes read are those of valid output columns.
            acc[t] = unsafe {
                if c.full {
                    _mm512_loadu_ps(optr[t])
                } else {
                    _mm512_maskz_loadu_ps(c.mask, optr[t])
                }
            };
        }
    }
    let (dp, sp, sump) = (x.d.as_ptr(), x.s.as_ptr(), x.sums.as_ptr());
    for b in 0..c.kb {
        // SAFETY: slot b < kb was written by `expand` for this chunk.
        let pb = unsafe { &*c.buf.add(b) };
        let mut s0 = [_mm512_setzero_si512(); M];
        let mut s1 = [_mm512_setzero_si512(); M];
        for g in 0..4 {
            for t in 0..M {
                // SAFETY: bytes 4g..4g+4 of block b of the row's chunk.
                let a = unsafe { (qa[t].add(b * QK + 4 * g) as *const i32).read_unaligned() };
                s0[t] = _mm512_dpbusd_epi32(s0[t], pb.w[g], _mm512_set1_epi32(a));
            }
        }
        for g in 4..8 {
            for t in 0..M {
                // SAFETY: as above.
                let a = unsafe { (qa[t].add(b * QK + 4 * g) as *const i32).read_unaligned() };
                s1[t] = _mm512_dpbusd_epi32(s1[t], pb.w[g], _mm512_set1_epi32(a));
            }
        }
        for t in 0..M {
            let k = bi[t] + b;
            let mut isum = _mm512_add_epi32(s0[t], s1[t]);
            if code_offset(F) != 0 {
                // SAFETY: k < n * nb.
                let sum = unsafe { *sump.add(k) };
                isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(code_offset(F) * sum));
            }
            // SAFETY: k < n * nb.
            let da = unsafe { *dp.add(k) };
            let scale = _mm512_mul_ps(pb.dw, _mm512_set1_ps(da));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[t]);
            if has_min(F) {
                // SAFETY: as above.
                let sa = unsafe { *sp.add(k) };
                acc[t] = _mm512_fmadd_ps(pb.mw, _mm512_set1_ps(sa), acc[t]);
            }
        }
    }
    for t in 0..M {
        // SAFETY: only valid output columns are written.
        unsafe {
            if c.full {
                _mm512_storeu_ps(optr[t], acc[t]);
            } else {
                _mm512_mask_storeu_ps(optr[t], c.mask, acc[t]);
            }
        }
    }
}
