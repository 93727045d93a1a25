//! The tile update: `G` query heads of one KV group, for one row, against
//! one tile of up to [`TILE`] keys and values — read straight from the
//! pages in their stored type and converted in registers.
//!
//! One generic body ([`update`]) over [`Lanes`], instantiated per level
//! inside a `#[target_feature]` function, so the levels share the order of
//! operations by construction (the contract in [`super`]'s documentation).

// Register arrays indexed by head, chunk and key: index loops read best.
#![allow(clippy::needless_range_loop)]

use super::lanes::{Lanes, Scalar};
use super::{HEAD_DIM_MAX, Q8_BLOCK, Q8_BLOCK_BYTES, TILE};
use crate::KernelLevel;

/// How the tile's K/V rows are stored.
pub(super) const F32: u8 = 0;
pub(super) const F16: u8 = 1;
pub(super) const Q8: u8 = 2;

/// Most (row, head) entries one pass carries: a KV group's heads, of one
/// row or of several rows that attend to the same keys.
pub(super) const HEADS_MAX: usize = 6;

/// One pass: `G` heads' queries and states against `n` keys.
pub(super) struct Pass<'a, const G: usize> {
    /// Each head's query, `hd` values.
    pub q: [*const f32; G],
    /// Each head's state: max, sum, `hd` accumulators.
    pub st: [*mut f32; G],
    /// Key `t`'s `hd` values of this KV head, in the stored type.
    pub k: &'a [*const u8],
    /// Value `t`'s, likewise.
    pub v: &'a [*const u8],
    /// Rows to prefetch as the pass goes (the next tile's).
    pub ahead: Ahead<'a>,
    /// Against `q8_0` keys: each head's query quantised
    /// ([`quantize_query`]); otherwise null.
    pub q8: [*const Q8Query; G],
    pub hd: usize,
    pub scale: f32,
}

/// K and V rows (`bytes` each) a pass prefetches, one of each per key.
#[derive(Clone, Copy)]
pub(super) struct Ahead<'a> {
    pub k: &'a [*const u8],
    pub v: &'a [*const u8],
    pub bytes: usize,
}

/// Asks for the cache lines of `bytes` at `p` (a hint: it never faults and
/// changes no value).
#[inline(always)]
pub(super) fn prefetch(p: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let mut o = 0;
        while o < bytes {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                    p.wrapping_add(o).cast(),
                )
            };
            o += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, bytes);
}

/// The 16 values of chunk `c` (dimensions `16c..16c+16`) of a row.
#[inline(always)]
unsafe fn chunk<L: Lanes, const DT: u8>(row: *const u8, c: usize) -> L {
    // SAFETY: the row holds hd values in its type and 16c + 16 <= hd
    // (caller); a q8_0 row is whole blocks.
    unsafe {
        match DT {
            F32 => L::load(row.cast::<f32>().add(16 * c)),
            F16 => L::load_f16(row.cast::<u16>().add(16 * c)),
            _ => {
                let b = row.add(c / 2 * Q8_BLOCK_BYTES);
                let d = L::f16(u16::from_le_bytes([*b, *b.add(1)]));
                L::load_i8(b.add(2 + 16 * (c % 2)).cast()).mul(L::splat(d))
            }
        }
    }
}

/// The contract's tile update for `G` heads (see [`super`]): scores in
/// blocks of 16 keys (16-lane dot products, reduced fold-halves), the
/// online softmax in lanes of 16 positions, the weighted sum of V in order.
#[inline(always)]
unsafe fn update<L: Lanes, const KDT: u8, const VDT: u8, const G: usize>(p: &Pass<'_, G>) {
    let (n, hd) = (p.k.len(), p.hd);
    debug_assert!(n <= TILE && p.v.len() == n && hd.is_multiple_of(16));
    const { assert!(Q8_BLOCK == 32 && VDT != Q8 || KDT == Q8) };
    let chunks = hd / 16;
    let mut s = [[0.0f32; TILE]; G];
    // SAFETY: every pointer stays inside the rows (hd values each), the
    // queries and states (caller), and the score arrays (TILE, a multiple
    // of 16).
    unsafe {
        let zero = L::zero();
        if KDT == Q8 {
            q8_scores::<L, G>(p, &mut s);
        }
        if KDT != Q8 {
            if chunks == 4 {
                scores::<L, KDT, G, 4>(p, &mut s);
            } else {
                scores::<L, KDT, G, 0>(p, &mut s);
            }
        }
        let mut alpha = [0.0f32; G];
        for h in 0..G {
            let st = p.st[h];
            let mut vm = L::splat(f32::NEG_INFINITY);
            let mut i = 0;
            while i < n {
                let x = L::load(s[h].as_ptr().add(i));
                // Lanes past the tile count as −∞ for the maximum.
                let x = if n - i < 16 {
                    x.first_or(n - i, f32::NEG_INFINITY)
                } else {
                    x
                };
                vm = vm.max(x);
                i += 16;
            }
            let mt = vm.hmax();
            let m = *st;
            let mn = if m > mt { m } else { mt };
            alpha[h] = if m == f32::NEG_INFINITY {
                0.0
            } else {
                super::exp_ref(m - mn)
            };
            let vmn = L::splat(mn);
            let mut lanes = zero;
            let mut i = 0;
            while i < n {
                let e = L::load(s[h].as_ptr().add(i)).sub(vmn).exp();
                let e = if n - i < 16 {
                    e.first_or(n - i, 0.0)
                } else {
                    e
                };
                e.store(s[h].as_mut_ptr().add(i));
                lanes = lanes.add(e);
                i += 16;
            }
            *st.add(1) = (*st.add(1)).mul_add(alpha[h], lanes.tree());
            *st = mn;
        }
        // The weighted sum of V, a few dimension chunks at a time with
        // their accumulators in registers (a constant count per call, so
        // the compiler keeps them there).
        let mut c0 = 0;
        while c0 < chunks {
            let left = chunks - c0;
            // Accumulators in registers: G × N × (16 lanes) within what
            // the level has (AVX2: 16 registers of 8 lanes).
            let two = L::PV_CHUNKS >= 4 || G <= 3;
            if L::PV_CHUNKS >= 4 && left >= 4 {
                weigh::<L, VDT, G, 4>(p, &s, &alpha, c0);
                c0 += 4;
            } else if two && left >= 2 {
                weigh::<L, VDT, G, 2>(p, &s, &alpha, c0);
                c0 += 2;
            } else {
                weigh::<L, VDT, G, 1>(p, &s, &alpha, c0);
                c0 += 1;
            }
        }
    }
}

/// Scores of `f32`/`f16` keys, 16 at a time: per key, 16-lane dot products
/// (lane l over dimensions ≡ l mod 16, in order), the 16 keys' lanes then
/// reduced together (fold halves), times the scale. `C` dimension chunks
/// of 16, known at compile time (the query then stays in registers), or 0:
/// `hd / 16` at run time.
#[inline(always)]
unsafe fn scores<L: Lanes, const KDT: u8, const G: usize, const C: usize>(
    p: &Pass<'_, G>,
    s: &mut [[f32; TILE]; G],
) {
    let n = p.k.len();
    let chunks = if C > 0 { C } else { p.hd / 16 };
    // SAFETY: as in `update`.
    unsafe {
        let zero = L::zero();
        // The query in registers when its size is known.
        let mut qr = [[zero; 4]; G];
        if C > 0 {
            for h in 0..G {
                for c in 0..C.min(4) {
                    qr[h][c] = L::load(p.q[h].add(16 * c));
                }
            }
        }
        let mut acc = [[zero; 16]; G];
        let mut kb = 0;
        while kb < n {
            let m = (n - kb).min(16);
            for t in 0..m {
                if let Some(&ka) = p.ahead.k.get(kb + t) {
                    prefetch(ka, p.ahead.bytes);
                }
                let row = p.k[kb + t];
                let mut a = [zero; G];
                for c in 0..chunks {
                    let kv = chunk::<L, KDT>(row, c);
                    for h in 0..G {
                        let q = if C > 0 && c < 4 {
                            qr[h][c]
                        } else {
                            L::load(p.q[h].add(16 * c))
                        };
                        a[h] = L::fma(q, kv, a[h]);
                    }
                }
                for h in 0..G {
                    acc[h][t] = a[h];
                }
            }
            for t in m..16 {
                for a in acc.iter_mut() {
                    a[t] = zero;
                }
            }
            for h in 0..G {
                L::tree16(&acc[h])
                    .mul(L::splat(p.scale))
                    .store(s[h].as_mut_ptr().add(kb));
            }
            kb += 16;
        }
    }
}

/// A query quantised as `q8_0` for the integer dot products against
/// `q8_0` keys: per block of 32, `d = max|x| / 127` and `q = round(x / d)`
/// (`x · (1/d)`, ties to even), with `Σ q` per block.
pub(super) struct Q8Query {
    pub q: [i8; HEAD_DIM_MAX],
    pub d: [f32; NB_MAX],
    pub sum: [i32; NB_MAX],
}

impl Q8Query {
    /// All zero (a placeholder until quantised).
    pub fn zero() -> Q8Query {
        Q8Query {
            q: [0; HEAD_DIM_MAX],
            d: [0.0; NB_MAX],
            sum: [0; NB_MAX],
        }
    }
}

/// Most `q8_0` blocks in a head.
pub(super) const NB_MAX: usize = HEAD_DIM_MAX / Q8_BLOCK;

/// Quantises `hd` values at `x` (the reference; every level runs this).
///
/// # Safety
/// `x` valid for `hd` values, `hd % 32 == 0`, `hd <= HEAD_DIM_MAX`.
#[inline(always)]
pub(super) unsafe fn quantize_query(x: *const f32, hd: usize) -> Q8Query {
    let mut out = Q8Query::zero();
    for b in 0..hd / Q8_BLOCK {
        // SAFETY: 32·b + 32 <= hd values (caller).
        let xs = unsafe { std::slice::from_raw_parts(x.add(Q8_BLOCK * b), Q8_BLOCK) };
        let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0;
        for (i, &v) in xs.iter().enumerate() {
            let q = (v * id).round_ties_even() as i8;
            out.q[Q8_BLOCK * b + i] = q;
            sum += i32::from(q);
        }
        out.d[b] = d;
        out.sum[b] = sum;
    }
    out
}

/// Scores against `q8_0` keys (the contract's integer path): per key and
/// block, the exact integer dot product of the quantised query and the
/// key's codes; `s = Σ_b fma(isum_b, d_q,b · d_k,b, ·)` in block order from
/// 0, then `· scale`. Scores 16 keys at a time.
#[inline(always)]
unsafe fn q8_scores<L: Lanes, const G: usize>(p: &Pass<'_, G>, s: &mut [[f32; TILE]; G]) {
    let (n, hd) = (p.k.len(), p.hd);
    let nb = hd / Q8_BLOCK;
    // SAFETY: queries of hd values (caller); rows of nb whole blocks.
    unsafe {
        let qq: [&Q8Query; G] = std::array::from_fn(|h| &*p.q8[h]);
        let mut isum = [[[0i32; 16]; NB_MAX]; G];
        // The 16 keys' block scales as f16 bits, converted 16 at a time
        // (exactly, as one by one).
        let mut dk = [[0u16; 16]; NB_MAX];
        let mut kb = 0;
        while kb < n {
            let m = (n - kb).min(16);
            let rows = &p.k[kb..kb + m];
            for (i, _) in rows.iter().enumerate() {
                if let Some(&ka) = p.ahead.k.get(kb + i) {
                    prefetch(ka, p.ahead.bytes);
                }
            }
            L::q8_dots::<G>(rows, &qq, nb, &mut isum);
            for (b, dkb) in dk.iter_mut().enumerate().take(nb) {
                for t in 0..16 {
                    dkb[t] = match rows.get(t) {
                        Some(&r) => r.add(b * Q8_BLOCK_BYTES).cast::<u16>().read_unaligned(),
                        None => 0,
                    };
                    // The pages are little-endian GGML blocks.
                    dkb[t] = u16::from_le(dkb[t]);
                }
            }
            let mut dkf = [L::zero(); NB_MAX];
            for b in 0..nb {
                dkf[b] = L::load_f16(dk[b].as_ptr());
            }
            for h in 0..G {
                let mut acc = L::zero();
                for b in 0..nb {
                    let dd = L::splat(qq[h].d[b]).mul(dkf[b]);
                    acc = L::fma(L::load_i32(isum[h][b].as_ptr()), dd, acc);
                }
                acc.mul(L::splat(p.scale)).store(s[h].as_mut_ptr().add(kb));
            }
            kb += 16;
        }
    }
}

/// `acc = acc·α`, then `acc = fma(p_t, v_t, acc)` for the tile's keys in
/// order, for chunks `c0..c0 + N` of every head's accumulator.
#[inline(always)]
unsafe fn weigh<L: Lanes, const DT: u8, const G: usize, const N: usize>(
    p: &Pass<'_, G>,
    s: &[[f32; TILE]; G],
    alpha: &[f32; G],
    c0: usize,
) {
    // SAFETY: the states hold hd + 2 values and 16·(c0 + N) <= hd; rows as
    // in `update`.
    unsafe {
        let mut b = [[L::zero(); N]; G];
        for h in 0..G {
            let al = L::splat(alpha[h]);
            for d in 0..N {
                b[h][d] = L::load(p.st[h].add(2 + 16 * (c0 + d))).mul(al);
            }
        }
        // q8_0 values: the tile's block scales converted 16 keys at a
        // time up front (exactly, as one by one), for the blocks of
        // chunks c0..c0+N.
        let n = p.v.len();
        let mut vd = [[0.0f32; TILE]; 3];
        let b0 = c0 / 2;
        if DT == Q8 {
            for (j, vdj) in vd.iter_mut().enumerate().take((c0 + N).div_ceil(2) - b0) {
                let mut t0 = 0;
                while t0 < n {
                    let mut bits = [0u16; 16];
                    for (i, b) in bits.iter_mut().enumerate().take((n - t0).min(16)) {
                        *b = u16::from_le(
                            p.v[t0 + i]
                                .add((b0 + j) * Q8_BLOCK_BYTES)
                                .cast::<u16>()
                                .read_unaligned(),
                        );
                    }
                    L::load_f16(bits.as_ptr()).store(vdj.as_mut_ptr().add(t0));
                    t0 += 16;
                }
            }
        }
        for t in 0..n {
            let row = p.v[t];
            // The next tile's values are fetched here, its keys while
            // scoring: the misses spread over the whole pass.
            if c0 == 0 {
                if let Some(&va) = p.ahead.v.get(t) {
                    prefetch(va, p.ahead.bytes);
                }
            }
            for d in 0..N {
                let vv = if DT == Q8 {
                    let c = c0 + d;
                    let b = row.add(c / 2 * Q8_BLOCK_BYTES);
                    L::load_i8(b.add(2 + 16 * (c % 2)).cast()).mul(L::splat(vd[c / 2 - b0][t]))
                } else {
                    chunk::<L, DT>(row, c0 + d)
                };
                for h in 0..G {
                    b[h][d] = L::fma(L::splat(s[h][t]), vv, b[h][d]);
                }
            }
        }
        for h in 0..G {
            for d in 0..N {
                b[h][d].store(p.st[h].add(2 + 16 * (c0 + d)));
            }
        }
    }
}

/// The reference instantiation.
fn scalar<const K: u8, const V: u8, const G: usize>(p: &Pass<'_, G>) {
    // SAFETY: `Scalar` uses no instructions beyond the baseline; the
    // pointers are the caller's contract (`run`).
    unsafe { update::<Scalar, K, V, G>(p) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2<const K: u8, const V: u8, const G: usize>(p: &Pass<'_, G>) {
    // SAFETY: built with AVX2/FMA/F16C, which the caller checked.
    unsafe { update::<super::lanes::Avx2, K, V, G>(p) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn avx512<const K: u8, const V: u8, const G: usize>(p: &Pass<'_, G>) {
    // SAFETY: built with AVX-512, which the caller checked.
    unsafe { update::<super::lanes::Avx512, K, V, G>(p) }
}

/// One pass at `level`, keys stored as `kdt` and values as `vdt`: both
/// the pages' type, or `q8_0` keys with values converted to `f32`.
///
/// # Safety
/// `level` runs on this CPU; the pass's pointers are valid: queries and
/// rows for `hd` values (`hd % 16 == 0`) in their types, states for
/// `hd + 2`, with no other access to the states meanwhile; `k.len() ==
/// v.len() <= TILE`.
pub(super) unsafe fn run<const G: usize>(level: KernelLevel, kdt: u8, vdt: u8, p: &Pass<'_, G>) {
    debug_assert!(level.is_supported());
    macro_rules! at_level {
        ($f:ident) => {
            match (kdt, vdt) {
                (F32, _) => $f::<F32, F32, G>(p),
                (F16, _) => $f::<F16, F16, G>(p),
                (_, F32) => $f::<Q8, F32, G>(p),
                _ => $f::<Q8, Q8, G>(p),
            }
        };
    }
    // SAFETY: the level was checked against the CPU (caller).
    unsafe {
        match level {
            #[cfg(target_arch = "x86_64")]
            KernelLevel::Avx512 => at_level!(avx512),
            #[cfg(target_arch = "x86_64")]
            KernelLevel::Avx2 => at_level!(avx2),
            _ => at_level!(scalar),
        }
    }
}

#[inline(always)]
unsafe fn convert_with<L: Lanes, const DT: u8>(rows: &[*const u8], hd: usize, out: *mut f32) {
    for (i, &row) in rows.iter().enumerate() {
        for c in 0..hd / 16 {
            // SAFETY: rows of hd values in their type; out holds rows.len()
            // × hd values (caller).
            unsafe { chunk::<L, DT>(row, c).store(out.add(i * hd + 16 * c)) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn convert_avx512<const DT: u8>(rows: &[*const u8], hd: usize, out: *mut f32) {
    // SAFETY: the caller's contract.
    unsafe { convert_with::<super::lanes::Avx512, DT>(rows, hd, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn convert_avx2<const DT: u8>(rows: &[*const u8], hd: usize, out: *mut f32) {
    // SAFETY: the caller's contract.
    unsafe { convert_with::<super::lanes::Avx2, DT>(rows, hd, out) }
}

/// Rows stored as `dt` (not `F32`) converted to `f32`, row `i` at
/// `out[i·hd..]`: the values [`chunk`] gives in registers, so a pass over
/// the converted rows gives the same bits as one over the stored rows.
///
/// # Safety
/// As [`run`]; `out` valid for `rows.len() × hd` values.
pub(super) unsafe fn convert(
    level: KernelLevel,
    dt: u8,
    rows: &[*const u8],
    hd: usize,
    out: *mut f32,
) {
    // SAFETY: the caller's contract.
    unsafe {
        match (level, dt) {
            #[cfg(target_arch = "x86_64")]
            (KernelLevel::Avx512, F16) => convert_avx512::<F16>(rows, hd, out),
            #[cfg(target_arch = "x86_64")]
            (KernelLevel::Avx512, _) => convert_avx512::<Q8>(rows, hd, out),
            #[cfg(target_arch = "x86_64")]
            (KernelLevel::Avx2, F16) => convert_avx2::<F16>(rows, hd, out),
            #[cfg(target_arch = "x86_64")]
            (KernelLevel::Avx2, _) => convert_avx2::<Q8>(rows, hd, out),
            (_, F16) => convert_with::<Scalar, F16>(rows, hd, out),
            _ => convert_with::<Scalar, Q8>(rows, hd, out),
        }
    }
}
