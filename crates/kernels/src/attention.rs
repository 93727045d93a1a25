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
//! * **K/V read in place, converted in registers.** A pass reads each key
//!   and value straight from its page in the stored type (`f32`, `f16`, or
//!   `q8_0` blocks) and converts it in registers; nothing is copied. A
//!   block of several rows over `f16`/`q8_0` pages converts each tile to
//!   `f32` once instead, for all its rows (the same values, so the same
//!   bits).
//! * **One pass per KV group.** A pass carries every query head of the
//!   group (up to four at once) against a tile: each K and V load serves
//!   them all — decode's three heads per group, and every row of a block.
//! * **Online softmax over tiles** of [`TILE`] positions (fixed by
//!   position, whatever the page size): a running maximum, sum and
//!   accumulator per (row, head); no score array as long as the context.
//!   Scores are computed 16 keys at a time and reduced together; the
//!   softmax runs on 16 positions a vector.
//! * **Split over positions.** A row's positions are cut into chunks of
//!   [`CHUNK_POSITIONS`] (whole pages); spans of consecutive chunks are
//!   work items, so a single long sequence spreads over every thread, and
//!   the chunks' partial results are merged in chunk order afterwards.
//! * **Prefetch.** A pass fetches the next tile's rows as it goes, a line
//!   or two per key: a decode step reads its K/V from memory, in pages too
//!   short for the hardware prefetchers to follow.
//!
//! # Determinism contract (invariant K12)
//!
//! A row's output depends only on its query, its position and the K/V
//! values — never on the batch, the blocks, the thread count, or the
//! kernel level. Tiles and chunks are fixed by positions and the page
//! size; within them the operations and their order are fixed:
//!
//! ```text
//! k, v  = the stored values as f32: f16 exactly; q8_0 as d·q (one rounding)
//! s_t   = dot(q, k_t) · scale     dot: 16 lanes, lane l = fma over dims ≡ l (mod 16) in order,
//!                                 then fold halves: l+(l+8), then +4, +2, +1
//!   q8_0 keys: dot on integers. The query is quantised per block of 32
//!       (d = max|x|/127, c = round_even(x·(1/d))); per block b, i_b = Σ c·k
//!       exactly (i32); dot = fma(i_B, d_B·dk_B, … fma(i_0, d_0·dk_0, 0))
//! tile: m' = max(m, max_t s_t); α = exp(m − m') (0 on the first tile)
//!       p_t = exp(s_t − m');   lanes_l = Σ_{t ≡ l mod 16} p_t in order;  l = fma(l, α, fold(lanes))
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
//! `exp` is this module's own (a Cephes-style polynomial with fma). The
//! tile kernel is written once over 16 lanes (`lanes::Lanes`): plain arrays
//! (the reference), two AVX2 registers, or one AVX-512 register, each
//! lane-wise IEEE arithmetic; so every level gives the same bits. The head
//! dimension is a multiple of [`HEAD_DIM_MULTIPLE`].
//!
//! # Example
//!
//! ```
//! use kernels::attention::{attention, AttnRow, AttnScratch, AttnShape, KvPage, KvRows};
//! use kernels::ThreadPool;
//!
//! // One head of 16 dims, one page of 4 slots; the row at position 1 reads
//! // slots 0 and 1.
//! let shape = AttnShape { n_head: 1, n_kv_head: 1, head_dim: 16, page_size: 4, window: None };
//! let k = vec![0.0f32; 32];
//! let v: Vec<f32> = (0..32).map(|i| (i / 16) as f32).collect(); // v_0 = 0, v_1 = 1
//! let pages = [KvPage { k: KvRows::F32(&k), v: KvRows::F32(&v), slots: 2 }];
//! let rows = [AttnRow { pos: 1, pages: 0..1 }];
//! let q = vec![1.0f32; 16];
//! let mut out = vec![0.0f32; 16];
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
/// The head dimension is a multiple of this (the kernels' lane count).
pub const HEAD_DIM_MULTIPLE: usize = 16;
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
    /// Chunks `chunks.0..chunks.1`, run in order by one task (each its own
    /// partial result): the task prefetches across their boundaries.
    chunks: (u32, u32),
}

/// A task's view of one tile: the positions' K/V rows, and (for blocks of
/// several rows over `f16`/`q8_0` pages) the group's rows converted to `f32`
/// once for every row to share.
struct TileBuf {
    k: Vec<f32>,
    v: Vec<f32>,
    /// Position `i` of the tile: the start of its K (V) row in its page.
    k_row: [*const u8; TILE],
    v_row: [*const u8; TILE],
    /// The next tile's rows, and the current KV head's part of them: a
    /// decode pass prefetches them as it goes.
    k_next: [*const u8; TILE],
    v_next: [*const u8; TILE],
    k_ahead: [*const u8; TILE],
    v_ahead: [*const u8; TILE],
    /// Against `q8_0` keys, the block's queries quantised: (row, head) at
    /// `row·n_head + head`.
    q8: Vec<tile::Q8Query>,
    /// The current KV head's `hd` values of position `i` (in the pages,
    /// or in `k`/`v` when converted).
    k_head: [*const u8; TILE],
    v_head: [*const u8; TILE],
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
    assert!(
        hd > 0 && hd <= HEAD_DIM_MAX && hd.is_multiple_of(HEAD_DIM_MULTIPLE),
        "head dim {hd}"
    );
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
        assert!(
            kv_type(&p.k) == kv_type(&p.v) && kv_type(&p.k) == kv_type(&pages[0].k),
            "one storage type for every page's K and V"
        );
        if matches!(p.k, KvRows::Q8_0(_)) || matches!(p.v, KvRows::Q8_0(_)) {
            assert!(
                hd.is_multiple_of(Q8_BLOCK),
                "q8_0 pages need head_dim % 32 == 0"
            );
        }
    }
    assert!(level.is_supported(), "kernel level {level:?} on this CPU");
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
    let nt = threads.n_threads();
    // Blocks: (rows, first chunk, chunks).
    let mut blocks = Vec::new();
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
        blocks.push((b0, b1, c_lo, chunks));
        b0 = b1;
    }
    // Consecutive chunks of a block go to one task, in spans as long as
    // still leaves four items per thread.
    let total: usize = blocks.iter().map(|&(_, _, lo, hi)| hi - lo).sum();
    let span = (total / (ITEMS_PER_THREAD_MIN * nt)).max(1);
    for (b0, b1, c_lo, chunks) in blocks {
        let mut c = c_lo;
        while c < chunks {
            let c1 = (c + span).min(chunks);
            scratch.items.push(Item {
                rows: (b0 as u32, b1 as u32),
                groups: (0, shape.n_kv_head as u32),
                chunks: (c as u32, c1 as u32),
            });
            c = c1;
        }
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
    while scratch.tiles.len() < nt {
        scratch.tiles.push(Mutex::new(TileBuf {
            k: Vec::new(),
            v: Vec::new(),
            k_row: [std::ptr::null(); TILE],
            v_row: [std::ptr::null(); TILE],
            q8: Vec::new(),
            k_next: [std::ptr::null(); TILE],
            v_next: [std::ptr::null(); TILE],
            k_ahead: [std::ptr::null(); TILE],
            v_ahead: [std::ptr::null(); TILE],
            k_head: [std::ptr::null(); TILE],
            v_head: [std::ptr::null(); TILE],
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
    let max_pos = block
        .clone()
        .map(|r| rows[r].pos)
        .max()
        .expect("a block has rows");
    // This item's partial of (row, head) for chunk c.
    let state = |r: usize, h: usize, c: usize| -> *mut f32 {
        let n = shape.chunks(rows[r].pos);
        let off = offsets[r] + (h * n + c) * part;
        // SAFETY: (row, head, chunk) is written by this item alone; the
        // buffer outlives the broadcast and holds `off + part` values.
        unsafe { parts.get().add(off) }
    };
    let heads = groups.start * group..groups.end * group;
    let chunks = item.chunks.0 as usize..item.chunks.1 as usize;
    for c in chunks.clone() {
        for r in block.clone() {
            if rows[r].pos >= c * CHUNK_POSITIONS {
                for h in heads.clone() {
                    // SAFETY: as in `state`.
                    let st = unsafe { std::slice::from_raw_parts_mut(state(r, h, c), part) };
                    st[0] = f32::NEG_INFINITY;
                    st[1..].fill(0.0);
                }
            }
        }
    }
    let seq = &pages[rows[block.start].pages.clone()];
    let dt = kv_type(&seq[0].k);
    let (row_bytes, head_bytes) = match dt {
        tile::F32 => (kvw * 4, hd * 4),
        tile::F16 => (kvw * 2, hd * 2),
        _ => (
            kvw / Q8_BLOCK * Q8_BLOCK_BYTES,
            hd / Q8_BLOCK * Q8_BLOCK_BYTES,
        ),
    };
    if dt == tile::Q8 {
        // Each query quantised once for the item (the same codes whichever
        // item or pass uses them).
        tile.q8.clear();
        tile.q8
            .resize_with(block.len() * shape.n_head, tile::Q8Query::zero);
        for r in block.clone() {
            for h in heads.clone() {
                // SAFETY: a query of hd values (hd % 32 == 0 for q8_0,
                // checked on entry).
                tile.q8[(r - block.start) * shape.n_head + h] =
                    unsafe { tile::quantize_query(q[r * dim + h * hd..][..hd].as_ptr(), hd) };
            }
        }
    }
    // Several rows share each tile: convert it to f32 once (the same values
    // the pass converts in registers, so the same bits).
    let convert = block.len() > 1 && dt != tile::F32;
    if convert {
        tile.k.resize(TILE * hd, 0.0);
        tile.v.resize(TILE * hd, 0.0);
    }
    // The item's tiles, in order: chunk by chunk, tiles of TILE positions
    // up to the block's last position; tiles before every row's window
    // are not read at all.
    let lo_min = block
        .clone()
        .map(|r| shape.lo(rows[r].pos))
        .min()
        .unwrap_or(0);
    let tile_at = |c: usize, t0: usize| -> Option<(usize, usize, usize)> {
        let end = ((c + 1) * CHUNK_POSITIONS).min(max_pos + 1);
        if t0 < end {
            Some((c, t0, (t0 + TILE).min(end)))
        } else if c + 1 < chunks.end {
            let t0 = (c + 1) * CHUNK_POSITIONS;
            (t0 <= max_pos).then(|| (c + 1, t0, (t0 + TILE).min(max_pos + 1)))
        } else {
            None
        }
    };
    let c0 = chunks.start;
    let mut at = tile_at(c0, (c0 * CHUNK_POSITIONS).max(lo_min / TILE * TILE));
    while let Some((c, t0, t1)) = at {
        let n = t1 - t0;
        let following = tile_at(c, t1);
        let next = following.map_or(0..0, |(_, a, b)| a..b);
        rows_of(seq, ps, row_bytes, t0..t1, &mut tile.k_row, &mut tile.v_row);
        // The next tile's rows: the block's first row's passes prefetch
        // them as they go, a line or two per key (a decode step's K/V comes
        // from memory, in pages too short for the hardware prefetchers to
        // follow; measured at depth 8192: 17 ms for 30 layers without, 7.7
        // with, 14.7 fetching the whole tile at once, 8.9 two tiles ahead).
        // A converting block fetches them now. No effect on any value.
        rows_of(
            seq,
            ps,
            row_bytes,
            next.clone(),
            &mut tile.k_next,
            &mut tile.v_next,
        );
        if convert {
            prefetch_rows(&tile.k_next[..next.len()], row_bytes);
            prefetch_rows(&tile.v_next[..next.len()], row_bytes);
        }
        for g in groups.clone() {
            for i in 0..n {
                // SAFETY: the row holds every KV head: g·head_bytes +
                // head_bytes <= row_bytes.
                unsafe {
                    tile.k_head[i] = tile.k_row[i].add(g * head_bytes);
                    tile.v_head[i] = tile.v_row[i].add(g * head_bytes);
                }
            }
            let ahead = if convert { 0 } else { next.len() };
            for i in 0..ahead {
                // SAFETY: as above.
                unsafe {
                    tile.k_ahead[i] = tile.k_next[i].add(g * head_bytes);
                    tile.v_ahead[i] = tile.v_next[i].add(g * head_bytes);
                }
            }
            // q8_0 keys stay codes (their dot products are integer).
            let (kdt, vdt) = if convert {
                // SAFETY: the level runs here; n rows of hd values in `dt`,
                // into buffers of TILE·hd.
                unsafe {
                    if dt != tile::Q8 {
                        tile::convert(level, dt, &tile.k_head[..n], hd, tile.k.as_mut_ptr());
                    }
                    tile::convert(level, dt, &tile.v_head[..n], hd, tile.v.as_mut_ptr());
                }
                for i in 0..n {
                    if dt != tile::Q8 {
                        tile.k_head[i] = tile.k[i * hd..].as_ptr().cast();
                    }
                    tile.v_head[i] = tile.v[i * hd..].as_ptr().cast();
                }
                (if dt == tile::Q8 { dt } else { tile::F32 }, tile::F32)
            } else {
                (dt, dt)
            };
            let state = |r: usize, h: usize| state(r, h, c);
            let q8 = |r: usize, h: usize| -> *const tile::Q8Query {
                if dt == tile::Q8 {
                    &tile.q8[(r - block.start) * shape.n_head + h]
                } else {
                    std::ptr::null()
                }
            };
            let qh = |r: usize, h: usize| q[r * dim + h * hd..][..hd].as_ptr();
            // The first pass of the tile prefetches the next one.
            let mut pf = ahead;
            let mut run = |entries: &[(usize, usize)], skip: usize, upto: usize| {
                let ahead = tile::Ahead {
                    k: &tile.k_ahead[..pf],
                    v: &tile.v_ahead[..pf],
                    bytes: head_bytes,
                };
                pf = 0;
                let (k, v) = (&tile.k_head[skip..upto], &tile.v_head[skip..upto]);
                macro_rules! go {
                    ($g:literal) => {{
                        let e: [(usize, usize); $g] = entries.try_into().expect("size");
                        let pass = tile::Pass {
                            q: e.map(|(r, h)| qh(r, h)),
                            st: e.map(|(r, h)| state(r, h)),
                            q8: e.map(|(r, h)| q8(r, h)),
                            k,
                            v,
                            ahead,
                            hd,
                            scale,
                        };
                        // SAFETY: the level was checked against the CPU;
                        // queries of hd values, states of hd + 2 that this
                        // item alone writes (each entry a different (row,
                        // head)), up to TILE rows of hd values in
                        // `kdt`/`vdt`, quantised queries when q8_0.
                        unsafe { tile::run::<$g>(level, kdt, vdt, &pass) }
                    }};
                }
                match entries.len() {
                    1 => go!(1),
                    2 => go!(2),
                    3 => go!(3),
                    4 => go!(4),
                    5 => go!(5),
                    _ => go!(6),
                }
            };
            // Rows that attend to the whole tile share passes, up to
            // HEADS_MAX (row, head) entries each; a row that attends to
            // part of it (its own tile, or where its window starts) runs
            // alone.
            let mut shared = [(0usize, 0usize); tile::HEADS_MAX];
            let mut ns = 0;
            for r in block.clone() {
                let pos = rows[r].pos;
                let lo = shape.lo(pos);
                if pos < t0 || lo >= t1 {
                    continue;
                }
                // The row's keys in this tile: `skip..upto`.
                let (skip, upto) = (lo.saturating_sub(t0), n.min(pos + 1 - t0));
                let heads = g * group..(g + 1) * group;
                if skip == 0 && upto == n {
                    for h in heads {
                        shared[ns] = (r, h);
                        ns += 1;
                        if ns == tile::HEADS_MAX {
                            run(&shared, 0, n);
                            ns = 0;
                        }
                    }
                } else {
                    let mut own = [(0usize, 0usize); tile::HEADS_MAX];
                    let mut no = 0;
                    for h in heads {
                        own[no] = (r, h);
                        no += 1;
                        if no == tile::HEADS_MAX {
                            run(&own, skip, upto);
                            no = 0;
                        }
                    }
                    if no > 0 {
                        run(&own[..no], skip, upto);
                    }
                }
            }
            if ns > 0 {
                run(&shared[..ns], 0, n);
            }
        }
        at = following;
    }
}

/// Prefetches rows of `bytes` each.
fn prefetch_rows(rows: &[*const u8], bytes: usize) {
    for &row in rows {
        tile::prefetch(row, bytes);
    }
}

/// The tile kernels' name for a page's storage type.
fn kv_type(rows: &KvRows<'_>) -> u8 {
    match rows {
        KvRows::F32(_) => tile::F32,
        KvRows::F16(_) => tile::F16,
        KvRows::Q8_0(_) => tile::Q8,
    }
}

/// The K and V row starts of `positions` (at most [`TILE`]) of a
/// sequence's pages, into `k[i]`, `v[i]`: one division per call, bounds
/// checked per page.
fn rows_of(
    seq: &[KvPage<'_>],
    ps: usize,
    row_bytes: usize,
    positions: Range<usize>,
    k: &mut [*const u8; TILE],
    v: &mut [*const u8; TILE],
) {
    let mut i = 0;
    let mut p = positions.start;
    while p < positions.end {
        let (page, slot) = (&seq[p / ps], p % ps);
        let take = (ps - slot).min(positions.end - p);
        let span = slot * row_bytes..(slot + take) * row_bytes;
        let (kb, vb) = (
            &rows_bytes(&page.k)[span.clone()],
            &rows_bytes(&page.v)[span],
        );
        for j in 0..take {
            k[i + j] = kb[j * row_bytes..].as_ptr();
            v[i + j] = vb[j * row_bytes..].as_ptr();
        }
        i += take;
        p += take;
    }
}

/// A page's K or V values as bytes.
fn rows_bytes<'a>(rows: &KvRows<'a>) -> &'a [u8] {
    match *rows {
        KvRows::F32(x) => bytemuck_f32(x),
        KvRows::F16(x) => {
            // SAFETY: f16 is two plain bytes; the slice covers the same
            // memory.
            unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), x.len() * 2) }
        }
        KvRows::Q8_0(x) => x,
    }
}

fn bytemuck_f32(x: &[f32]) -> &[u8] {
    // SAFETY: f32 is four plain bytes; the slice covers the same memory.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), x.len() * 4) }
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
    /// [`super::merge`] built with FMA (`mul_add` is one instruction).
    ///
    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn merge(parts: &[f32], hd: usize, out: &mut [f32]) {
        super::merge(parts, hd, out)
    }
}

mod lanes;
mod tile;

#[cfg(test)]
mod tests;
