//! Kernel implementations, one module per [`KernelLevel`].

// Index loops over registers, lanes and blocks read better than iterator
// chains in SIMD code.
#![allow(clippy::needless_range_loop)]

use crate::formats::WeightMatrix;
use crate::level::KernelLevel;
use std::ops::Range;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512_k;
pub(crate) mod scalar;

/// Borrowed view of quantised activations for the kernels.
pub(crate) struct ActParts<'a> {
    pub n: usize,
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub s: &'a [f32],
    pub sums: &'a [i32],
    /// Per block, the (−16·P0, −16·P1) i16 pair of `quant::pair_offsets`.
    pub off16: &'a [i32],
    /// The 256-column form (K-quant weights): codes, per-256 scales and
    /// per-32 sums; empty when not computed.
    pub kqs: &'a [i8],
    pub kd: &'a [f32],
    pub ksums: &'a [i16],
}

/// Output pointer shared by the threads of one matmul; each thread writes a
/// disjoint set of output columns (weight rows).
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub *mut f32);

// SAFETY: used only to write disjoint elements from different threads, while
// the `&mut [f32]` it was derived from is borrowed for the whole call.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Accessor so closures capture the whole (Sync) wrapper, not the field.
    pub(crate) fn get(self) -> OutPtr {
        self
    }
}

/// Weight rows per work item of `level`.
pub(crate) fn panel_rows(level: KernelLevel) -> usize {
    match level {
        #[cfg(target_arch = "x86_64")]
        KernelLevel::Avx512 => avx512::PANEL_ROWS,
        #[cfg(target_arch = "x86_64")]
        KernelLevel::Avx2 => avx2::PANEL_ROWS,
        _ => scalar::PANEL_ROWS,
    }
}

/// Runs panels `panels` of a quantised matmul at `level`.
///
/// # Safety
/// `level` must be supported; `w` valid and quantised with `w.cols` equal to
/// the activations' columns; `out` valid for `x.n × w.rows` floats with no
/// concurrent access to the columns of the rows in these panels.
pub(crate) unsafe fn run_panels(
    level: KernelLevel,
    w: &WeightMatrix<'_>,
    x: &ActParts<'_>,
    out: OutPtr,
    panels: Range<usize>,
) {
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        match level {
            #[cfg(target_arch = "x86_64")]
            KernelLevel::Avx512 => avx512::matmul_panels(w, x, out, panels),
            #[cfg(target_arch = "x86_64")]
            KernelLevel::Avx2 => avx2::matmul_panels(w, x, out, panels),
            _ => scalar::matmul_panels(w, x, out, panels),
        }
    }
}
