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
use super::{Q8_BLOCK, Q8_BLOCK_BYTES, TILE};
use crate::KernelLevel;

/// How the tile's K/V rows are stored.
pub(super) const F32: u8 = 0;
pub(super) const F16: u8 = 1;
pub(super) const Q8: u8 = 2;

/// Most query heads one pass carries (a larger group runs in passes).
pub(super) const HEADS_MAX: usize = 4;

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
unsafe fn update<L: Lanes, const DT: u8, const G: usize>(p: &Pass<'_, G>) {
    let (n, hd) = (p.k.len(), p.hd);
    debug_assert!(n <= TILE && p.v.len() == n && hd.is_multiple_of(16));
    const { assert!(DT != Q8 || Q8_BLOCK == 32) };
    let chunks = hd / 16;
    let mut s = [[0.0f32; TILE]; G];
    // SAFETY: every pointer stays inside the rows (hd values each), the
    // queries and states (caller), and the score arrays (TILE, a multiple
    // of 16).
    unsafe {
        let zero = L::zero();
        let mut acc = [[zero; 16]; G];
        let mut kb = 0;
        while kb < n {
            let m = (n - kb).min(16);
            for t in 0..16 {
                if t >= m {
                    for a in acc.iter_mut() {
                        a[t] = zero;
                    }
                    continue;
                }
                let row = p.k[kb + t];
                if let (Some(&ka), Some(&va)) = (p.ahead.k.get(kb + t), p.ahead.v.get(kb + t)) {
                    prefetch(ka, p.ahead.bytes);
                    prefetch(va, p.ahead.bytes);
                }
                let mut a = [zero; G];
                for c in 0..chunks {
                    let kv = chunk::<L, DT>(row, c);
                    for h in 0..G {
                        a[h] = L::fma(L::load(p.q[h].add(16 * c)), kv, a[h]);
                    }
                }
                for h in 0..G {
                    acc[h][t] = a[h];
                }
            }
            for h in 0..G {
                L::tree16(&acc[h])
                    .mul(L::splat(p.scale))
                    .store(s[h].as_mut_ptr().add(kb));
            }
            kb += 16;
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
            if L::PV_CHUNKS >= 4 && left >= 4 {
                weigh::<L, DT, G, 4>(p, &s, &alpha, c0);
                c0 += 4;
            } else if left >= 2 {
                weigh::<L, DT, G, 2>(p, &s, &alpha, c0);
                c0 += 2;
            } else {
                weigh::<L, DT, G, 1>(p, &s, &alpha, c0);
                c0 += 1;
            }
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
        for t in 0..p.v.len() {
            let row = p.v[t];
            for d in 0..N {
                let vv = chunk::<L, DT>(row, c0 + d);
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
fn scalar<const DT: u8, const G: usize>(p: &Pass<'_, G>) {
    // SAFETY: `Scalar` uses no instructions beyond the baseline; the
    // pointers are the caller's contract (`run`).
    unsafe { update::<Scalar, DT, G>(p) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2<const DT: u8, const G: usize>(p: &Pass<'_, G>) {
    // SAFETY: built with AVX2/FMA/F16C, which the caller checked.
    unsafe { update::<super::lanes::Avx2, DT, G>(p) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn avx512<const DT: u8, const G: usize>(p: &Pass<'_, G>) {
    // SAFETY: built with AVX-512, which the caller checked.
    unsafe { update::<super::lanes::Avx512, DT, G>(p) }
}

/// One pass at `level`, K/V stored as `dt`.
///
/// # Safety
/// `level` runs on this CPU; the pass's pointers are valid: queries and
/// rows for `hd` values (`hd % 16 == 0`) in their types, states for
/// `hd + 2`, with no other access to the states meanwhile; `k.len() ==
/// v.len() <= TILE`.
pub(super) unsafe fn run<const G: usize>(level: KernelLevel, dt: u8, p: &Pass<'_, G>) {
    debug_assert!(level.is_supported());
    // SAFETY: the level was checked against the CPU (caller).
    unsafe {
        match (level, dt) {
            #[cfg(target_arch = "x86_64")]
            (KernelLevel::Avx512, F32) => avx512::<F32, G>(p),
            #[cfg(target_arch = "x86_64")]
            (KernelLevel::Avx512, F16) => avx512::<F16, G>(p),
            #[cfg(target_arch = "x86_64")]
            (KernelLevel::Avx512, _) => avx512::<Q8, G>(p),
            #[cfg(target_arch = "x86_64")]
            (KernelLevel::Avx2, F32) => avx2::<F32, G>(p),
            #[cfg(target_arch = "x86_64")]
            (KernelLevel::Avx2, F16) => avx2::<F16, G>(p),
            #[cfg(target_arch = "x86_64")]
            (KernelLevel::Avx2, _) => avx2::<Q8, G>(p),
            (_, F32) => scalar::<F32, G>(p),
            (_, F16) => scalar::<F16, G>(p),
            _ => scalar::<Q8, G>(p),
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
