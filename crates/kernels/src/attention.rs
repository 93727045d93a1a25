//! Causal attention over paged K/V, flash-attention style, on the CPU.
//!
//! # What it computes
//!
//! For every query row (a token at position `pos` of a sequence) and every
//! query head `h` of KV group `g = h / (n_head / n_kv_head)`:
//! `out = Σ_t softmax_t(q·k_t / √d) · v_t` over the positions `t ≤ pos` of
//! the row's sequence (with a sliding window `w`: `pos − w < t ≤ pos`), whose
//! K/V rows live in pages ([`KvPage`]: `f32` or `f16`, token-major,
//! `n_kv_head × head_dim` values per token).
//!
//! # How
//!
//! * **One pass per KV group.** A work item is (block of rows of one
//!   sequence, KV group, chunk of positions): each K/V tile of the group is
//!   read (and, for `f16`, converted) once and used by every query head of
//!   the group and every row of the block — decode's three heads per group,
//!   and up to [`BLOCK_ROWS`] rows of a prompt.
//! * **Online softmax over tiles** of [`TILE`] positions (fixed by
//!   position, whatever the page size): a running maximum, sum and
//!   accumulator per (row, head); no score array as long as the context.
//! * **Split over positions.** A row's positions are cut into chunks of
//!   [`CHUNK_POSITIONS`] (whole pages); chunks are items of their own, so a
//!   single long sequence spreads over every thread, and the chunks'
//!   partial results are merged in chunk order afterwards.
//!
//! # Determinism contract (invariant K12)
//!
//! A row's output depends only on its query, its position and the K/V
//! values — never on the batch, the blocks, the thread count, or the
//! kernel level. Tiles and chunks are fixed by positions and the page
//! size; within them the operations and their order are fixed:
//!
//! ```text
//! s_t   = dot(q, k_t) · scale     dot: 8 lanes, lane l = fma over dims ≡ l (mod 8) in order,
//!                                 then ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)), then the rest by fma
//! tile: m' = max(m, max_t s_t); α = exp(m − m') (0 on the first tile)
//!       p_t = exp(s_t − m');   lanes_l = Σ_{t ≡ l mod 8} p_t in order;  l = fma(l, α, tree(lanes))
//!       acc = acc·α;  acc = fma(p_t, v_t, acc) for t in order;  m = m'
//! merge chunks in order: m = max(ma, mb); a = exp(ma − m); b = exp(mb − m)
//!       l = fma(lb, b, la·a); acc = fma(accb, b, acca·a)
//! out = acc · (1 / l)
//! ```
//!
//! With a sliding window, a row's tiles are cut at its first position
//! (`[max(TILE·i, pos + 1 − w), …)`, fixed by its position), tiles and chunks
//! wholly before it are skipped, and the merge starts at its first chunk.
//!
//! `exp` is this module's own (a Cephes-style polynomial with fma), so the
//! scalar reference and the AVX2 build give the same bits.
//!
//! # Example
//!
//! ```
//! use kernels::attention::{attention, AttnRow, AttnScratch, AttnShape, KvPage, KvRows};
//! use kernels::ThreadPool;
//!
//! // One head of 8 dims, one page of 4 slots; the row at position 1 reads
//! // slots 0 and 1.
//! let shape = AttnShape { n_head: 1, n_kv_head: 1, head_dim: 8, page_size: 4, window: None };
//! let k = vec![0.0f32; 16];
//! let v: Vec<f32> = (0..16).map(|i| (i / 8) as f32).collect(); // v_0 = 0, v_1 = 1
//! let pages = [KvPage { k: KvRows::F32(&k), v: KvRows::F32(&v), slots: 2 }];
//! let rows = [AttnRow { pos: 1, pages: 0..1 }];
//! let q = vec![1.0f32; 8];
//! let mut out = vec![0.0f32; 8];
//! let threads = ThreadPool::new(1);
//! attention(&threads, shape, &pages, &rows, &q, &mut out, &mut AttnScratch::default());
//! // Equal scores: the mean of v_0 and v_1.
//! assert!(out.iter().all(|&o| (o - 0.5).abs() < 1e-6));
//! ```

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use half::f16;

use crate::{KernelLevel, ThreadPool};

/// Rows of one sequence that share a pass over its K/V tiles.
pub const BLOCK_ROWS: usize = 8;
/// Positions per tile of the online softmax: tiles are
/// `[TILE·i, TILE·(i+1))`, whatever the page size.
pub const TILE: usize = 64;
/// Positions per chunk, `[CHUNK_POSITIONS·c, CHUNK_POSITIONS·(c+1))`; a
/// multiple of [`TILE`].
pub const CHUNK_POSITIONS: usize = 256;
const _: () = assert!(CHUNK_POSITIONS.is_multiple_of(TILE));
/// Largest head dimension.
pub const HEAD_DIM_MAX: usize = 256;
/// Below this many work items per thread, items are split by KV group.
const ITEMS_PER_THREAD_MIN: usize = 4;

/// K or V rows of one page of one layer: `slots × kv_width` values,
/// token-major.
#[derive(Clone, Copy, Debug)]
pub enum KvRows<'a> {
    /// `f32` values.
    F32(&'a [f32]),
    /// `f16` values.
    F16(&'a [f16]),
    /// GGML `q8_0` blocks: an `f16` scale then 32 `i8` ([`Q8_BLOCK_BYTES`]
    /// bytes for 32 values); a block never straddles two heads.
    Q8_0(&'a [u8]),
}

/// Values in one `q8_0` block.
pub const Q8_BLOCK: usize = 32;
/// Bytes of one `q8_0` block.
pub const Q8_BLOCK_BYTES: usize = 34;

impl KvRows<'_> {
    /// Values held.
    fn len(&self) -> usize {
        match self {
            KvRows::F32(x) => x.len(),
            KvRows::F16(x) => x.len(),
            KvRows::Q8_0(x) => x.len() / Q8_BLOCK_BYTES * Q8_BLOCK,
        }
    }
}

/// The written slots of one page of one layer.
#[derive(Clone, Copy, Debug)]
pub struct KvPage<'a> {
    /// Keys, `slots × kv_width`.
    pub k: KvRows<'a>,
    /// Values, `slots × kv_width`.
    pub v: KvRows<'a>,
    /// Token slots readable.
    pub slots: usize,
}

/// Head geometry and page size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Query heads.
    pub n_head: usize,
    /// KV heads (`n_head` is a multiple).
    pub n_kv_head: usize,
    /// Dimensions per head.
    pub head_dim: usize,
    /// Token slots per page.
    pub page_size: usize,
    /// Sliding window: a row at `pos` attends to the last `w` positions
    /// only (`pos + 1 − w ..= pos`); `None`: to all of `0..=pos`.
    pub window: Option<usize>,
}

impl AttnShape {
    fn kv_width(&self) -> usize {
        self.n_kv_head * self.head_dim
    }
    fn group(&self) -> usize {
        self.n_head / self.n_kv_head
    }
    fn chunks(&self, pos: usize) -> usize {
        pos / CHUNK_POSITIONS + 1
    }
    /// First position a row at `pos` attends to.
    fn lo(&self, pos: usize) -> usize {
        match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        }
    }
    /// Floats of one partial result: max, sum, accumulator.
    fn partial(&self) -> usize {
        self.head_dim + 2
    }
}

/// One query row: it attends to positions `0..=pos` of the sequence whose
/// pages are `pages` (indices into the page list, in sequence order).
/// Consecutive rows with the same `pages` share passes over the K/V.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttnRow {
    /// Position of the row's token.
    pub pos: usize,
    /// The sequence's pages in the page list.
    pub pages: Range<usize>,
}

/// Reusable buffers (grow only).
#[derive(Default)]
pub struct AttnScratch {
    partials: Vec<f32>,
    offsets: Vec<usize>,
    items: Vec<Item>,
    tiles: Vec<Mutex<TileBuf>>,
}

#[derive(Clone, Copy, Debug)]
struct Item {
    rows: (u32, u32),
    /// KV groups `groups.0..groups.1`.
    groups: (u32, u32),
    chunk: u32,
}

/// A task's K/V tile: rows as `f32` (converted into `k`/`v` when stored
/// as `f16`).
struct TileBuf {
    k: Vec<f32>,
    v: Vec<f32>,
    k_base: [*const f32; TILE],
    v_base: [*const f32; TILE],
    k_rows: [*const f32; TILE],
    v_rows: [*const f32; TILE],
}

// SAFETY: the row pointers are scratch, rewritten before every use within
// one task; no pointer is read after its tile.
unsafe impl Send for TileBuf {}

#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: hands disjoint sub-slices to the pool's tasks (see the uses).
unsafe impl Send for SyncPtr {}
// SAFETY: as for `Send`.
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Attention of every row and head (see the module documentation) with
/// the process's kernel level. `q` and `out` hold `rows.len() × n_head ×
/// head_dim` values.
///
/// # Panics
/// If the shapes disagree: a row whose position lies beyond its pages'
/// slots, a page shorter than its slots, `q`/`out` of the wrong length, a
/// head dimension over [`HEAD_DIM_MAX`]. The caller checked these.
pub fn attention(
    threads: &ThreadPool,
    shape: AttnShape,
    pages: &[KvPage<'_>],
    rows: &[AttnRow],
    q: &[f32],
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    attention_with_level(
        KernelLevel::active(),
        threads,
        shape,
        pages,
        rows,
        q,
        out,
        scratch,
    )
}

/// [`attention`] at a given kernel level (levels give the same bits).
#[allow(clippy::too_many_arguments)]
pub fn attention_with_level(
    level: KernelLevel,
    threads: &ThreadPool,
    shape: AttnShape,
    pages: &[KvPage<'_>],
    rows: &[AttnRow],
    q: &[f32],
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    let (hd, kvw) = (shape.head_dim, shape.kv_width());
    let dim = shape.n_head * hd;
    assert!(hd > 0 && hd <= HEAD_DIM_MAX, "head dim {hd}");
    assert!(shape.n_kv_head > 0 && shape.n_head.is_multiple_of(shape.n_kv_head));
    assert!(shape.page_size > 0);
    assert_eq!(q.len(), rows.len() * dim);
    assert_eq!(out.len(), rows.len() * dim);
    for r in rows {
        let need = r.pos / shape.page_size;
        assert!(need < r.pages.len(), "position {} beyond the pages", r.pos);
        let last = &pages[r.pages.start + need];
        assert!(
            last.slots > r.pos % shape.page_size,
            "position {} unwritten",
            r.pos
        );
    }
    for p in pages {
        assert!(p.k.len() >= p.slots * kvw && p.v.len() >= p.slots * kvw);
        if matches!(p.k, KvRows::Q8_0(_)) || matches!(p.v, KvRows::Q8_0(_)) {
            assert!(
                hd.is_multiple_of(Q8_BLOCK),
                "q8_0 pages need head_dim % 32 == 0"
            );
        }
    }
    assert!(level.is_supported(), "kernel level {level:?} on this CPU");
    let level = match level {
        KernelLevel::Scalar => KernelLevel::Scalar,
        _ if hd.is_multiple_of(8) => KernelLevel::Avx2,
        _ => KernelLevel::Scalar,
    };
    // Partial results: per row, per head, per chunk.
    let part = shape.partial();
    scratch.offsets.clear();
    let mut total = 0;
    for r in rows {
        scratch.offsets.push(total);
        total += shape.n_head * shape.chunks(r.pos) * part;
    }
    scratch.partials.clear();
    scratch.partials.resize(total, 0.0);
    if shape.window.is_some() {
        // Chunks wholly before a row's window are never run: they stay
        // empty (m = −∞), and the merge skips them.
        for p in scratch.partials.chunks_exact_mut(part) {
            p[0] = f32::NEG_INFINITY;
        }
    }
    // Items: blocks of consecutive rows of one sequence × chunks, each
    // over every KV group (a page's K and V are read front to back by one
    // thread) — or one group each when that leaves fewer than four items
    // per thread (short contexts; the split never changes a result).
    scratch.items.clear();
    let mut b0 = 0;
    while b0 < rows.len() {
        let mut b1 = b0 + 1;
        while b1 < rows.len() && b1 - b0 < BLOCK_ROWS && rows[b1].pages == rows[b0].pages {
            b1 += 1;
        }
        let chunks = rows[b0..b1]
            .iter()
            .map(|r| shape.chunks(r.pos))
            .max()
            .unwrap_or(0);
        let c_lo = rows[b0..b1]
            .iter()
            .map(|r| shape.lo(r.pos) / CHUNK_POSITIONS)
            .min()
            .unwrap_or(0);
        for c in c_lo..chunks {
            scratch.items.push(Item {
                rows: (b0 as u32, b1 as u32),
                groups: (0, shape.n_kv_head as u32),
                chunk: c as u32,
            });
        }
        b0 = b1;
    }
    if scratch.items.len() < ITEMS_PER_THREAD_MIN * threads.n_threads() && shape.n_kv_head > 1 {
        let whole = std::mem::take(&mut scratch.items);
        for it in whole {
            for g in 0..shape.n_kv_head as u32 {
                scratch.items.push(Item {
                    groups: (g, g + 1),
                    ..it
                });
            }
        }
    }
    let nt = threads.n_threads();
    while scratch.tiles.len() < nt {
        scratch.tiles.push(Mutex::new(TileBuf {
            k: Vec::new(),
            v: Vec::new(),
            k_base: [std::ptr::null(); TILE],
            v_base: [std::ptr::null(); TILE],
            k_rows: [std::ptr::null(); TILE],
            v_rows: [std::ptr::null(); TILE],
        }));
    }
    let next = AtomicUsize::new(0);
    let parts = SyncPtr(scratch.partials.as_mut_ptr());
    let (items, offsets, tiles) = (&scratch.items, &scratch.offsets, &scratch.tiles);
    threads.broadcast(|task| {
        let mut tile = tiles[task].lock().unwrap_or_else(|e| e.into_inner());
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(item) = items.get(i) else { break };
            run_item(
                level, shape, pages, rows, q, *item, &mut tile, parts, offsets,
            );
        }
    });
    // Merge each (row, head)'s chunks in order.
    let outp = SyncPtr(out.as_mut_ptr());
    let (partials, offsets) = (&scratch.partials, &scratch.offsets);
    threads.parallel_for(rows.len() * shape.n_head, |range| {
        for i in range {
            let (r, h) = (i / shape.n_head, i % shape.n_head);
            let n = shape.chunks(rows[r].pos);
            let base = offsets[r] + h * n * part;
            // SAFETY: each (row, head) owns out[r*dim + h*hd ..][..hd].
            let dst =
                unsafe { std::slice::from_raw_parts_mut(outp.get().add(r * dim + h * hd), hd) };
            let src = &partials[base..base + n * part];
            match level {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the level was checked against the CPU.
                KernelLevel::Avx2 | KernelLevel::Avx512 => unsafe { avx2::merge(src, hd, dst) },
                _ => merge(src, hd, dst),
            }
        }
    });
}

/// Merges a (row, head)'s chunk partials in order into its output.
#[inline(always)]
fn merge(parts: &[f32], hd: usize, out: &mut [f32]) {
    let part = hd + 2;
    // Leading chunks wholly before a sliding window were never run (m =
    // −∞): start at the first that was (every row attends to itself, so
    // one exists; without a window it is the first).
    let first = parts
        .chunks_exact(part)
        .position(|p| p[0] != f32::NEG_INFINITY)
        .unwrap_or(0);
    let parts = &parts[first * part..];
    let mut acc = [0.0f32; HEAD_DIM_MAX];
    let acc = &mut acc[..hd];
    acc.copy_from_slice(&parts[2..part]);
    let (mut m, mut l) = (parts[0], parts[1]);
    for p in parts.chunks_exact(part).skip(1) {
        let mn = m.max(p[0]);
        let a = exp_ref(m - mn);
        let b = exp_ref(p[0] - mn);
        l = p[1].mul_add(b, l * a);
        for (x, &y) in acc.iter_mut().zip(&p[2..]) {
            *x = y.mul_add(b, *x * a);
        }
        m = mn;
    }
    let inv = 1.0 / l;
    for (o, &x) in out.iter_mut().zip(acc.iter()) {
        *o = x * inv;
    }
}

#[allow(clippy::too_many_arguments)]
fn run_item(
    level: KernelLevel,
    shape: AttnShape,
    pages: &[KvPage<'_>],
    rows: &[AttnRow],
    q: &[f32],
    item: Item,
    tile: &mut TileBuf,
    parts: SyncPtr,
    offsets: &[usize],
) {
    let (hd, ps, kvw) = (shape.head_dim, shape.page_size, shape.kv_width());
    let (group, dim, part) = (shape.group(), shape.n_head * hd, shape.partial());
    let scale = 1.0 / (hd as f32).sqrt();
    let block = item.rows.0 as usize..item.rows.1 as usize;
    let groups = item.groups.0 as usize..item.groups.1 as usize;
    let c = item.chunk as usize;
    let max_pos = block
        .clone()
        .map(|r| rows[r].pos)
        .max()
        .expect("a block has rows");
    let first = c * CHUNK_POSITIONS;
    let end = ((c + 1) * CHUNK_POSITIONS).min(max_pos + 1);
    // This item's partials: (row, head) of its groups, chunk c.
    let state = |r: usize, h: usize| -> &mut [f32] {
        let n = shape.chunks(rows[r].pos);
        let off = offsets[r] + (h * n + c) * part;
        // SAFETY: (row, head, chunk) is written by this item alone; the
        // buffer outlives the broadcast.
        unsafe { std::slice::from_raw_parts_mut(parts.get().add(off), part) }
    };
    let heads = groups.start * group..groups.end * group;
    for r in block.clone() {
        if rows[r].pos >= first {
            for h in heads.clone() {
                let st = state(r, h);
                st[0] = f32::NEG_INFINITY;
                st[1..].fill(0.0);
            }
        }
    }
    let seq = &pages[rows[block.start].pages.clone()];
    tile.k.resize(TILE * kvw, 0.0);
    tile.v.resize(TILE * kvw, 0.0);
    // Tiles before every row's window are not read at all.
    let lo_min = block
        .clone()
        .map(|r| shape.lo(rows[r].pos))
        .min()
        .unwrap_or(0);
    let mut t0 = first.max(lo_min / TILE * TILE);
    while t0 < end {
        let t1 = (t0 + TILE).min(end);
        // Whole K/V rows of the tile, read front to back once (converted
        // to f32 if stored as f16); each group then points into them.
        let n = t1 - t0;
        // (Only this item's groups: an item of one group converts a third.)
        let (g0, width) = (groups.start, groups.len() * hd);
        gather(level, seq, ps, kvw, t0..t1, g0 * hd, width, tile);
        for g in groups.clone() {
            for i in 0..n {
                // SAFETY: row i holds `width` ≥ (g − g0 + 1)·hd values.
                unsafe {
                    tile.k_rows[i] = tile.k_base[i].add((g - g0) * hd);
                    tile.v_rows[i] = tile.v_base[i].add((g - g0) * hd);
                }
            }
            let (kr, vr) = (&tile.k_rows, &tile.v_rows);
            let qh = |r: usize, h: usize| &q[r * dim + h * hd..r * dim + (h + 1) * hd];
            // A row's keys in this tile: `skip..n` (skip > 0 only in the
            // tile where its window starts).
            let tile_of = |(skip, n): (usize, usize)| Tile {
                k: &kr[skip..n],
                v: &vr[skip..n],
                n: n - skip,
            };
            let pairs = level >= KernelLevel::Avx2 && hd.is_multiple_of(32);
            // One head over the tile alone (the reference, or AVX2's
            // one-head pass).
            let single = |r: usize, h: usize, n: (usize, usize)| match level {
                #[cfg(target_arch = "x86_64")]
                KernelLevel::Avx2 | KernelLevel::Avx512 => {
                    // SAFETY: the level was checked against the CPU
                    // (KernelLevel::active or the caller); hd % 8 == 0.
                    unsafe { avx2::tile_update(qh(r, h), tile_of(n), scale, state(r, h)) }
                }
                _ => tile_update_ref(qh(r, h), tile_of(n), scale, state(r, h)),
            };
            // Two (row, head) states over the same n keys in one pass: each
            // K and V load serves both, and per state the operations are
            // those of the one-head pass, so the bits are the same.
            let double = |(r0, h0): (usize, usize), (r1, h1): (usize, usize), n: (usize, usize)| {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `pairs` holds only with AVX2 checked against the
                // CPU and hd % 32 == 0; two different states.
                unsafe {
                    avx2::tile_update2(
                        qh(r0, h0),
                        qh(r1, h1),
                        tile_of(n),
                        scale,
                        state(r0, h0),
                        state(r1, h1),
                    )
                };
                #[cfg(not(target_arch = "x86_64"))]
                {
                    single(r0, h0, n);
                    single(r1, h1, n);
                }
            };
            // A group of odd size leaves one head a row: it waits here for
            // the next row's, and the two go together when they cover the
            // same keys (full tiles; in a prompt, most of them).
            let mut waiting: Option<(usize, usize, (usize, usize))> = None;
            for r in block.clone() {
                let pos = rows[r].pos;
                let lo = shape.lo(pos);
                if pos < t0 || lo >= t1 {
                    continue;
                }
                let n = (lo.saturating_sub(t0), n.min(pos + 1 - t0));
                let mut h = g * group;
                while h < (g + 1) * group {
                    if !pairs {
                        single(r, h, n);
                        h += 1;
                    } else if group == 3 {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: `pairs`: AVX2 checked against the CPU and
                        // hd % 32 == 0; three different states.
                        unsafe {
                            avx2::tile_update3(
                                [qh(r, h), qh(r, h + 1), qh(r, h + 2)],
                                tile_of(n),
                                scale,
                                [state(r, h), state(r, h + 1), state(r, h + 2)],
                            )
                        };
                        h += 3;
                    } else if h + 1 < (g + 1) * group {
                        double((r, h), (r, h + 1), n);
                        h += 2;
                    } else {
                        match waiting.take() {
                            Some((r0, h0, n0)) if n0 == n => double((r0, h0), (r, h), n),
                            Some((r0, h0, n0)) => {
                                single(r0, h0, n0);
                                waiting = Some((r, h, n));
                            }
                            None => waiting = Some((r, h, n)),
                        }
                        h += 1;
                    }
                }
            }
            if let Some((r, h, n)) = waiting {
                single(r, h, n);
            }
        }
        t0 = t1;
    }
}

/// Points `tile.k_base`/`v_base` at values `off..off + hd` of the K and
/// V rows of `positions` of a sequence's pages: the pages' own `f32` rows,
/// or `f16` rows converted into the tile's buffers.
#[allow(clippy::too_many_arguments)]
fn gather(
    level: KernelLevel,
    seq: &[KvPage<'_>],
    ps: usize,
    kvw: usize,
    positions: Range<usize>,
    off: usize,
    hd: usize,
    tile: &mut TileBuf,
) {
    #[cfg(target_arch = "x86_64")]
    if level >= KernelLevel::Avx2 && hd.is_multiple_of(8) {
        // SAFETY: the level was checked against the CPU; hd % 8 == 0.
        unsafe { avx2::gather(seq, ps, kvw, positions, off, hd, tile) };
        return;
    }
    let _ = level;
    gather_with(
        seq,
        ps,
        kvw,
        positions,
        off,
        hd,
        tile,
        |src, dst| {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = s.to_f32();
            }
        },
        |src, dst| {
            for (b, o) in src
                .chunks_exact(Q8_BLOCK_BYTES)
                .zip(dst.chunks_exact_mut(Q8_BLOCK))
            {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                for (x, &q) in o.iter_mut().zip(&b[2..]) {
                    *x = d * (q as i8) as f32;
                }
            }
        },
    )
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn gather_with(
    seq: &[KvPage<'_>],
    ps: usize,
    kvw: usize,
    positions: Range<usize>,
    off: usize,
    hd: usize,
    tile: &mut TileBuf,
    convert: impl Fn(&[f16], &mut [f32]),
    dequant: impl Fn(&[u8], &mut [f32]),
) {
    let t0 = positions.start;
    // q8_0: bytes of a row, and of the `hd` values at `off` (both whole
    // blocks: `off` and `hd` are multiples of the head dimension, which the
    // caller checked is a multiple of 32 for q8_0 pages).
    let (row8, hd8) = (
        kvw / Q8_BLOCK * Q8_BLOCK_BYTES,
        hd / Q8_BLOCK * Q8_BLOCK_BYTES,
    );
    for p in positions {
        let (page, i) = (&seq[p / ps], p - t0);
        let at = (p % ps) * kvw + off;
        let at8 = (p % ps) * row8 + off / Q8_BLOCK * Q8_BLOCK_BYTES;
        match (page.k, page.v) {
            (KvRows::F32(k), KvRows::F32(v)) => {
                tile.k_base[i] = k[at..at + hd].as_ptr();
                tile.v_base[i] = v[at..at + hd].as_ptr();
            }
            (k, v) => {
                assert!((i + 1) * hd <= tile.k.len().min(tile.v.len()));
                // One raw pointer per buffer for the whole tile: rows
                // written later never invalidate a row pointer taken
                // earlier.
                let (kb, vb) = (tile.k.as_mut_ptr(), tile.v.as_mut_ptr());
                for (src, base) in [(k, kb), (v, vb)] {
                    // SAFETY: row i lies inside the buffer (asserted), and
                    // no other reference to it lives here.
                    let buf = unsafe { std::slice::from_raw_parts_mut(base.add(i * hd), hd) };
                    match src {
                        KvRows::F32(x) => buf.copy_from_slice(&x[at..at + hd]),
                        KvRows::F16(x) => convert(&x[at..at + hd], buf),
                        KvRows::Q8_0(x) => dequant(&x[at8..at8 + hd8], buf),
                    }
                }
                // SAFETY: as above.
                unsafe {
                    tile.k_base[i] = kb.add(i * hd);
                    tile.v_base[i] = vb.add(i * hd);
                }
            }
        }
    }
}

/// `n` keys and values of one tile: row `t` (`hd` values, `f32`) at
/// `k[t]` and `v[t]`.
#[derive(Clone, Copy)]
struct Tile<'a> {
    k: &'a [*const f32],
    v: &'a [*const f32],
    n: usize,
}

/// The reference tile update (the contract's order, scalar).
fn tile_update_ref(q: &[f32], t: Tile, scale: f32, st: &mut [f32]) {
    let hd = q.len();
    let mut s = [0.0f32; TILE];
    for (i, si) in s[..t.n].iter_mut().enumerate() {
        // SAFETY: the tile holds n rows of at least hd values.
        let k = unsafe { std::slice::from_raw_parts(t.k[i], hd) };
        *si = dot_ref(q, k) * scale;
    }
    let mt = s[..t.n].iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let m = st[0];
    let mn = m.max(mt);
    let alpha = if m == f32::NEG_INFINITY {
        0.0
    } else {
        exp_ref(m - mn)
    };
    let mut lanes = [0.0f32; 8];
    for (i, si) in s[..t.n].iter_mut().enumerate() {
        *si = exp_ref(*si - mn);
        lanes[i % 8] += *si;
    }
    st[1] = st[1].mul_add(alpha, tree8(lanes));
    let acc = &mut st[2..2 + hd];
    for a in acc.iter_mut() {
        *a *= alpha;
    }
    for (i, &p) in s[..t.n].iter().enumerate() {
        // SAFETY: as above.
        let v = unsafe { std::slice::from_raw_parts(t.v[i], hd) };
        for (a, &x) in acc.iter_mut().zip(v) {
            *a = p.mul_add(x, *a);
        }
    }
    st[0] = mn;
}

#[inline(always)]
fn tree8(l: [f32; 8]) -> f32 {
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// The contract's dot product.
fn dot_ref(a: &[f32], b: &[f32]) -> f32 {
    let n8 = a.len() / 8 * 8;
    let mut lanes = [0.0f32; 8];
    for j in (0..n8).step_by(8) {
        for l in 0..8 {
            lanes[l] = a[j + l].mul_add(b[j + l], lanes[l]);
        }
    }
    let mut r = tree8(lanes);
    for d in n8..a.len() {
        r = a[d].mul_add(b[d], r);
    }
    r
}

const EXP_MIN: f32 = -87.3;
const EXP_MAX: f32 = 88.3;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x` by the contract: clamp, `n = round(x·log2 e)`, `r = x − n·ln 2`
/// (two fma steps), a degree-6 polynomial by fma, times `2^n`. Within 2
/// ulp of `exp` over the clamped range.
#[inline(always)]
#[allow(clippy::manual_clamp)] // NaN → EXP_MIN, as `_mm256_max_ps` gives
pub fn exp_ref(x: f32) -> f32 {
    let x = x.max(EXP_MIN).min(EXP_MAX);
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_P[0];
    for &c in &EXP_P[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Tile, EXP_MAX, EXP_MIN, EXP_P, LN2_HI, LN2_LO, LOG2E, TILE};

    /// [`super::merge`] built with FMA (`mul_add` is one instruction).
    ///
    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn merge(parts: &[f32], hd: usize, out: &mut [f32]) {
        super::merge(parts, hd, out)
    }

    /// [`super::gather`] with F16C conversions inline.
    ///
    /// # Safety
    /// AVX2 and F16C; `hd % 8 == 0`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn gather(
        seq: &[super::KvPage<'_>],
        ps: usize,
        kvw: usize,
        positions: std::ops::Range<usize>,
        off: usize,
        hd: usize,
        tile: &mut super::TileBuf,
    ) {
        super::gather_with(
            seq,
            ps,
            kvw,
            positions,
            off,
            hd,
            tile,
            |src, dst| {
                let n = src.len().min(dst.len());
                let mut i = 0;
                while i + 8 <= n {
                    // SAFETY: i + 8 <= n <= both lengths; F16C is enabled.
                    unsafe {
                        let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
                        _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
                    }
                    i += 8;
                }
            },
            |src, dst| {
                for (b, o) in src
                    .chunks_exact(super::Q8_BLOCK_BYTES)
                    .zip(dst.chunks_exact_mut(super::Q8_BLOCK))
                {
                    // SAFETY: b holds 34 bytes, o 32 floats; AVX2 and F16C
                    // are enabled. scale × q rounds once, as the reference.
                    unsafe {
                        let d = _mm256_cvtph_ps(_mm_set1_epi16(i16::from_le_bytes([b[0], b[1]])));
                        for j in 0..4 {
                            let q = _mm_loadl_epi64(b.as_ptr().add(2 + 8 * j).cast());
                            let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                            _mm256_storeu_ps(o.as_mut_ptr().add(8 * j), _mm256_mul_ps(d, x));
                        }
                    }
                }
            },
        )
    }

    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
        // SAFETY: register arithmetic only; the caller runs with AVX2 and
        // FMA.
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

    /// The contract's 8-lane reduction of one vector.
    #[inline(always)]
    unsafe fn tree(a: __m256) -> f32 {
        // SAFETY: register arithmetic (AVX2 in the caller).
        unsafe {
            let s = _mm256_hadd_ps(a, a); // l0+l1, l2+l3 | l4+l5, l6+l7
            let s = _mm256_hadd_ps(s, s); // (l0+l1)+(l2+l3) | (l4+l5)+(l6+l7)
            _mm_cvtss_f32(_mm_add_ss(
                _mm256_castps256_ps128(s),
                _mm256_extractf128_ps(s, 1),
            ))
        }
    }

    /// Dot products of `q` with 8 keys, reduced by the contract's tree.
    #[inline(always)]
    unsafe fn dot8(q: *const f32, k: &[*const f32], hd: usize) -> __m256 {
        // SAFETY: q holds hd values, k 8 rows of hd (caller).
        unsafe {
            let mut a = [_mm256_setzero_ps(); 8];
            let mut j = 0;
            while j < hd {
                let qj = _mm256_loadu_ps(q.add(j));
                for (t, at) in a.iter_mut().enumerate() {
                    *at = _mm256_fmadd_ps(qj, _mm256_loadu_ps(k[t].add(j)), *at);
                }
                j += 8;
            }
            // Pairs within each key, then the halves: lane t of the result
            // is ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)) of key t.
            let h01 = _mm256_hadd_ps(a[0], a[1]);
            let h23 = _mm256_hadd_ps(a[2], a[3]);
            let h45 = _mm256_hadd_ps(a[4], a[5]);
            let h67 = _mm256_hadd_ps(a[6], a[7]);
            let lo = _mm256_hadd_ps(h01, h23);
            let hi = _mm256_hadd_ps(h45, h67);
            _mm256_add_ps(
                _mm256_permute2f128_ps(lo, hi, 0x20),
                _mm256_permute2f128_ps(lo, hi, 0x31),
            )
        }
    }

    #[inline(always)]
    unsafe fn dot1(q: *const f32, k: *const f32, hd: usize) -> f32 {
        // SAFETY: q and k hold hd values (caller).
        unsafe {
            let mut a = _mm256_setzero_ps();
            let mut j = 0;
            while j < hd {
                a = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(j)), _mm256_loadu_ps(k.add(j)), a);
                j += 8;
            }
            tree(a)
        }
    }

    /// The contract's tile update, 8 lanes at a time.
    ///
    /// # Safety
    /// AVX2, FMA; `q.len() % 8 == 0`; the tile as [`super::Tile`] says.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile_update(q: &[f32], t: Tile, scale: f32, st: &mut [f32]) {
        let hd = q.len();
        let mut s = [0.0f32; TILE];
        // SAFETY: as the callee's contracts say (the caller's).
        unsafe {
            let mut i = 0;
            while i + 8 <= t.n {
                let d = dot8(q.as_ptr(), &t.k[i..i + 8], hd);
                _mm256_storeu_ps(
                    s.as_mut_ptr().add(i),
                    _mm256_mul_ps(d, _mm256_set1_ps(scale)),
                );
                i += 8;
            }
            while i < t.n {
                s[i] = dot1(q.as_ptr(), t.k[i], hd) * scale;
                i += 1;
            }
            let alpha = softmax(&mut s, t.n, st);
            let acc = st.as_mut_ptr().add(2);
            if hd == 64 {
                let mut a = [_mm256_setzero_ps(); 8];
                for (c, ac) in a.iter_mut().enumerate() {
                    *ac = _mm256_mul_ps(_mm256_loadu_ps(acc.add(c * 8)), _mm256_set1_ps(alpha));
                }
                for (i, &p) in s[..t.n].iter().enumerate() {
                    let vp = _mm256_set1_ps(p);
                    let v = t.v[i];
                    for (c, ac) in a.iter_mut().enumerate() {
                        *ac = _mm256_fmadd_ps(vp, _mm256_loadu_ps(v.add(c * 8)), *ac);
                    }
                }
                for (c, ac) in a.iter().enumerate() {
                    _mm256_storeu_ps(acc.add(c * 8), *ac);
                }
            } else {
                let mut c = 0;
                while c < hd {
                    let mut ac = _mm256_mul_ps(_mm256_loadu_ps(acc.add(c)), _mm256_set1_ps(alpha));
                    for (i, &p) in s[..t.n].iter().enumerate() {
                        let v = t.v[i].add(c);
                        ac = _mm256_fmadd_ps(_mm256_set1_ps(p), _mm256_loadu_ps(v), ac);
                    }
                    _mm256_storeu_ps(acc.add(c), ac);
                    c += 8;
                }
            }
        }
    }

    /// Two query vectors over the same tile (two heads of a KV group, one
    /// row): each K and V load serves both. Per head, the same operations
    /// in the same order as [`tile_update`], so the same bits.
    ///
    /// # Safety
    /// AVX2, FMA; `q0.len() == q1.len()`, a multiple of 32; the tile as
    /// [`super::Tile`] says.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile_update2(
        q0: &[f32],
        q1: &[f32],
        t: Tile,
        scale: f32,
        st0: &mut [f32],
        st1: &mut [f32],
    ) {
        let hd = q0.len();
        let (mut s0, mut s1) = ([0.0f32; TILE], [0.0f32; TILE]);
        // SAFETY: every pointer stays within the tile's n rows of hd
        // values, the score arrays (TILE ≥ n) and the states (hd + 2).
        unsafe {
            let vscale = _mm256_set1_ps(scale);
            let mut i = 0;
            while i + 4 <= t.n {
                let mut a0 = [_mm256_setzero_ps(); 4];
                let mut a1 = [_mm256_setzero_ps(); 4];
                let mut j = 0;
                while j < hd {
                    let x0 = _mm256_loadu_ps(q0.as_ptr().add(j));
                    let x1 = _mm256_loadu_ps(q1.as_ptr().add(j));
                    for k in 0..4 {
                        let kv = _mm256_loadu_ps(t.k[i + k].add(j));
                        a0[k] = _mm256_fmadd_ps(x0, kv, a0[k]);
                        a1[k] = _mm256_fmadd_ps(x1, kv, a1[k]);
                    }
                    j += 8;
                }
                for (a, s) in [(&a0, &mut s0), (&a1, &mut s1)] {
                    let h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
                    let four = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                    _mm_storeu_ps(
                        s.as_mut_ptr().add(i),
                        _mm_mul_ps(four, _mm256_castps256_ps128(vscale)),
                    );
                }
                i += 4;
            }
            while i < t.n {
                s0[i] = dot1(q0.as_ptr(), t.k[i], hd) * scale;
                s1[i] = dot1(q1.as_ptr(), t.k[i], hd) * scale;
                i += 1;
            }
            let al0 = _mm256_set1_ps(softmax(&mut s0, t.n, st0));
            let al1 = _mm256_set1_ps(softmax(&mut s1, t.n, st1));
            let (acc0, acc1) = (st0.as_mut_ptr().add(2), st1.as_mut_ptr().add(2));
            let mut c = 0;
            while c < hd {
                let mut b0 = [_mm256_setzero_ps(); 4];
                let mut b1 = [_mm256_setzero_ps(); 4];
                for d in 0..4 {
                    b0[d] = _mm256_mul_ps(_mm256_loadu_ps(acc0.add(c + d * 8)), al0);
                    b1[d] = _mm256_mul_ps(_mm256_loadu_ps(acc1.add(c + d * 8)), al1);
                }
                for i in 0..t.n {
                    let (p0, p1) = (_mm256_set1_ps(s0[i]), _mm256_set1_ps(s1[i]));
                    let v = t.v[i].add(c);
                    for d in 0..4 {
                        let vv = _mm256_loadu_ps(v.add(d * 8));
                        b0[d] = _mm256_fmadd_ps(p0, vv, b0[d]);
                        b1[d] = _mm256_fmadd_ps(p1, vv, b1[d]);
                    }
                }
                for d in 0..4 {
                    _mm256_storeu_ps(acc0.add(c + d * 8), b0[d]);
                    _mm256_storeu_ps(acc1.add(c + d * 8), b1[d]);
                }
                c += 32;
            }
        }
    }

    /// The tile's online-softmax step on `s[..n]` (scaled scores, turned
    /// into weights): updates the state's max and sum, returns α.
    /// Three query vectors over the same tile (a KV group of three heads,
    /// as SmolLM2's): each K and V load serves all three. Per head, the
    /// same operations in the same order as [`tile_update`], so the same
    /// bits. Registers: 3 keys × 3 heads of dot accumulators, then 16
    /// dimensions × 3 heads of output accumulators.
    ///
    /// # Safety
    /// AVX2, FMA; the three `q` of one length, a multiple of 16; the tile
    /// as [`super::Tile`] says.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::needless_range_loop)] // register arrays indexed by head and lane
    pub(super) unsafe fn tile_update3(q: [&[f32]; 3], t: Tile, scale: f32, st: [&mut [f32]; 3]) {
        let hd = q[0].len();
        let mut s = [[0.0f32; TILE]; 3];
        let [st0, st1, st2] = st;
        // SAFETY: every pointer stays within the tile's n rows of hd
        // values, the score arrays (TILE ≥ n) and the states (hd + 2).
        unsafe {
            let vscale = _mm_set1_ps(scale);
            let mut i = 0;
            while i + 3 <= t.n {
                let mut a = [[_mm256_setzero_ps(); 3]; 3];
                let mut j = 0;
                while j < hd {
                    let x = [
                        _mm256_loadu_ps(q[0].as_ptr().add(j)),
                        _mm256_loadu_ps(q[1].as_ptr().add(j)),
                        _mm256_loadu_ps(q[2].as_ptr().add(j)),
                    ];
                    for k in 0..3 {
                        let kv = _mm256_loadu_ps(t.k[i + k].add(j));
                        for (ah, xh) in a.iter_mut().zip(&x) {
                            ah[k] = _mm256_fmadd_ps(*xh, kv, ah[k]);
                        }
                    }
                    j += 8;
                }
                for (ah, sh) in a.iter().zip(s.iter_mut()) {
                    // Lane k: ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)) of key k,
                    // the contract's tree (lane 3 repeats key 2, unused).
                    let h =
                        _mm256_hadd_ps(_mm256_hadd_ps(ah[0], ah[1]), _mm256_hadd_ps(ah[2], ah[2]));
                    let four = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                    let mut out = [0.0f32; 4];
                    _mm_storeu_ps(out.as_mut_ptr(), _mm_mul_ps(four, vscale));
                    sh[i..i + 3].copy_from_slice(&out[..3]);
                }
                i += 3;
            }
            while i < t.n {
                for (qh, sh) in q.iter().zip(s.iter_mut()) {
                    sh[i] = dot1(qh.as_ptr(), t.k[i], hd) * scale;
                }
                i += 1;
            }
            let [s0, s1, s2] = &mut s;
            let al = [
                _mm256_set1_ps(softmax(s0, t.n, st0)),
                _mm256_set1_ps(softmax(s1, t.n, st1)),
                _mm256_set1_ps(softmax(s2, t.n, st2)),
            ];
            let acc = [
                st0.as_mut_ptr().add(2),
                st1.as_mut_ptr().add(2),
                st2.as_mut_ptr().add(2),
            ];
            let mut c = 0;
            while c < hd {
                let mut b = [[_mm256_setzero_ps(); 2]; 3];
                for h in 0..3 {
                    for d in 0..2 {
                        b[h][d] = _mm256_mul_ps(_mm256_loadu_ps(acc[h].add(c + d * 8)), al[h]);
                    }
                }
                for i in 0..t.n {
                    let p = [
                        _mm256_set1_ps(s[0][i]),
                        _mm256_set1_ps(s[1][i]),
                        _mm256_set1_ps(s[2][i]),
                    ];
                    let v = t.v[i].add(c);
                    for d in 0..2 {
                        let vv = _mm256_loadu_ps(v.add(d * 8));
                        for h in 0..3 {
                            b[h][d] = _mm256_fmadd_ps(p[h], vv, b[h][d]);
                        }
                    }
                }
                for h in 0..3 {
                    for d in 0..2 {
                        _mm256_storeu_ps(acc[h].add(c + d * 8), b[h][d]);
                    }
                }
                c += 16;
            }
        }
    }

    #[inline(always)]
    unsafe fn softmax(s: &mut [f32; TILE], n: usize, st: &mut [f32]) -> f32 {
        // SAFETY: loads and stores within `s` (TILE ≥ n rounded up to 8,
        // as TILE is a multiple of 8); register arithmetic otherwise.
        unsafe {
            // The tile's maximum (exact in any order).
            let mut vm = _mm256_set1_ps(f32::NEG_INFINITY);
            let mut i = 0;
            while i + 8 <= n {
                vm = _mm256_max_ps(vm, _mm256_loadu_ps(s.as_ptr().add(i)));
                i += 8;
            }
            let vm = _mm256_max_ps(vm, _mm256_permute2f128_ps(vm, vm, 1));
            let vm = _mm256_max_ps(vm, _mm256_shuffle_ps(vm, vm, 0b01_00_11_10));
            let vm = _mm256_max_ps(vm, _mm256_shuffle_ps(vm, vm, 0b10_11_00_01));
            let mut mt = _mm256_cvtss_f32(vm);
            while i < n {
                mt = mt.max(s[i]);
                i += 1;
            }
            let m = st[0];
            let mn = m.max(mt);
            let alpha = if m == f32::NEG_INFINITY {
                0.0
            } else {
                super::exp_ref(m - mn)
            };
            let vmn = _mm256_set1_ps(mn);
            let mut lanes = _mm256_setzero_ps();
            let mut i = 0;
            while i < n {
                let x = _mm256_loadu_ps(s.as_ptr().add(i));
                let mut p = exp8(_mm256_sub_ps(x, vmn));
                if n - i < 8 {
                    let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                    let keep = _mm256_cmpgt_epi32(_mm256_set1_epi32((n - i) as i32), idx);
                    p = _mm256_and_ps(p, _mm256_castsi256_ps(keep));
                }
                _mm256_storeu_ps(s.as_mut_ptr().add(i), p);
                lanes = _mm256_add_ps(lanes, p);
                i += 8;
            }
            st[1] = st[1].mul_add(alpha, tree(lanes));
            st[0] = mn;
            alpha
        }
    }
}

#[cfg(test)]
mod tests;
