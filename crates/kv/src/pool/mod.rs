//! The pool: fixed page memory plus per-page metadata, and every check.
//! This file holds the types, the memory and the checks every operation
//! calls; the operations are grouped by what they do: `lifecycle`
//! (allocation, free, leases), `cache` (K11), `rows` (reads and writes),
//! `export` (transfer, canary, checksum) and `inspect`.

use std::alloc::{self, Layout};
use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use half::f16;

use crate::integrity::{canary_value, page_checksum};
use crate::shape::{DType, KvShape, PAGE_ALIGN_BYTES, Q8_BLOCK, Q8_BLOCK_BYTES, TRAILER_BYTES};
use crate::{KvError, Owner, PageRef, PoolStats, Scope};

/// Largest pool this crate will allocate. A limit on everything: a typo in
/// a memory flag gets an error, not an attempt to reserve a terabyte.
pub const POOL_BYTES_MAX: u64 = 1 << 40;
/// Largest number of pages (indices are u32).
pub const POOL_PAGES_MAX: u64 = 1 << 30;
/// Largest number of simultaneous leases on one page.
pub const LEASES_PER_PAGE_MAX: u32 = 1024;
/// Largest number of requests holding one cached page (K11).
pub const REFS_PER_PAGE_MAX: u32 = 1 << 20;

/// Byte written over a freed page. 0xFF.. is a NaN in both f16 and f32 (and
/// a `q8_0` block's scale 0xFFFF is an f16 NaN), so a read that slipped past
/// every check would still poison the logits rather than produce fluent text
/// from someone else's KV.
pub const POISON_NAN_BYTE: u8 = 0xFF;

/// What a free does to the page's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Poison {
    /// Overwrite with 0xFF bytes (NaN in f16 and f32). The default.
    Nan,
    /// Overwrite with zeros.
    Zero,
    /// Leave the bytes (faster; unwritten slots are still unreadable by K3).
    Off,
}

/// Start-up options of a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolOptions {
    pub poison: Poison,
}

impl Default for PoolOptions {
    fn default() -> Self {
        PoolOptions {
            poison: Poison::Nan,
        }
    }
}

/// What `free` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeOutcome {
    /// The page is back on the free list, its epoch bumped.
    Freed,
    /// The page is leased; it becomes free when the last lease is released.
    Deferred,
}

/// What `release_lease` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseOutcome {
    /// Other leases remain, or the owner has not freed the page.
    Released,
    /// This was the last lease of a page whose free was deferred: now free.
    ReleasedAndFreed,
}

/// A read-only view of the written K and V slots of one (page, layer).
#[derive(Clone, Copy, Debug)]
pub enum LayerView<'a> {
    F32 {
        k: &'a [f32],
        v: &'a [f32],
    },
    F16 {
        k: &'a [f16],
        v: &'a [f16],
    },
    /// `q8_0` blocks (see [`DType::Q8_0`]), `row_bytes` a slot.
    Q8_0 {
        k: &'a [u8],
        v: &'a [u8],
    },
}

impl LayerView<'_> {
    /// Number of token slots in the view.
    pub fn slots(&self, token_width: usize) -> usize {
        match self {
            LayerView::F32 { k, .. } => k.len() / token_width,
            LayerView::F16 { k, .. } => k.len() / token_width,
            LayerView::Q8_0 { k, .. } => k.len() / DType::Q8_0.row_bytes(token_width),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Meta {
    /// Odd while allocated, even while free; bumped on every alloc and free
    /// (by one) and on publication to the cache (by two).
    epoch: u64,
    /// A request's, or for a cached page [`Owner::cached`] of its scope.
    owner: Owner,
    leases: u32,
    /// The owner freed the page while it was leased (K4).
    free_pending: bool,
    /// Cached and shared (K11): read-only, readable in `owner.scope`,
    /// held by `refs` requests, filed under `key`.
    shared: bool,
    refs: u32,
    key: u64,
    /// When a shared page last became idle (no reference, no lease): its
    /// place in the eviction order.
    idle_since: u64,
}

impl Meta {
    fn allocated(&self) -> bool {
        self.epoch & 1 == 1
    }
}

/// `fault!(self, skip_x)`: whether a test switched check `x` off. Always
/// `false` (and compiled away) in a build without fault injection.
macro_rules! fault {
    ($pool:ident, $field:ident) => {{
        #[cfg(any(test, feature = "fault-injection"))]
        {
            $pool.faults.$field
        }
        #[cfg(not(any(test, feature = "fault-injection")))]
        {
            false
        }
    }};
}

/// Safety checks a test can switch off, to show that a test catches the
/// missing check (see the crate doc for which test catches which).
#[cfg(any(test, feature = "fault-injection"))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Faults {
    pub skip_epoch_check: bool,
    pub skip_owner_check: bool,
    pub skip_watermark_check: bool,
    pub skip_lease_deferral: bool,
    pub skip_double_free_check: bool,
    pub skip_canary_check: bool,
    pub skip_checksum_check: bool,
    pub skip_poison: bool,
    /// K11: let a request read a cached page of another scope.
    pub skip_scope_check: bool,
    /// K11: let a request write or free a cached (shared) page.
    pub skip_shared_write_check: bool,
    /// K3 for the cache: publish a page not every slot of which was written.
    pub skip_publish_check: bool,
    /// K5 for the cache: let a release take a reference that is not there.
    pub skip_refcount_check: bool,
    /// K3 for speculation: a rewind reports success and moves nothing
    /// (the batch core's read-back after a rollback must catch it).
    pub skip_rewind: bool,
}

#[cfg(any(test, feature = "fault-injection"))]
impl Faults {
    /// The pool as the incident's engine had it (the `fault-incident`
    /// builds): reads past a page's written slots are served, freed pages
    /// keep their contents.
    pub fn incident() -> Faults {
        Faults {
            skip_watermark_check: true,
            skip_poison: true,
            ..Faults::default()
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    refused_stale_handle: AtomicU64,
    refused_foreign_owner: AtomicU64,
    refused_unwritten_read: AtomicU64,
    refused_double_free: AtomicU64,
    refused_release_pending: AtomicU64,
    refused_out_of_range: AtomicU64,
    refused_write_gap: AtomicU64,
    refused_already_written: AtomicU64,
    refused_out_of_pages: AtomicU64,
    refused_lease_limit: AtomicU64,
    canary_mismatch: AtomicU64,
    checksum_mismatch: AtomicU64,
    refused_shared_write: AtomicU64,
    refused_foreign_scope: AtomicU64,
    refused_ref_underflow: AtomicU64,
    refused_unpublishable: AtomicU64,
    allocs: AtomicU64,
    frees: AtomicU64,
    frees_deferred: AtomicU64,
    cache_publishes: AtomicU64,
    cache_evictions: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> Counters {
        let c = |a: &AtomicU64| AtomicU64::new(a.load(Ordering::Relaxed));
        Counters {
            refused_stale_handle: c(&self.refused_stale_handle),
            refused_foreign_owner: c(&self.refused_foreign_owner),
            refused_unwritten_read: c(&self.refused_unwritten_read),
            refused_double_free: c(&self.refused_double_free),
            refused_release_pending: c(&self.refused_release_pending),
            refused_out_of_range: c(&self.refused_out_of_range),
            refused_write_gap: c(&self.refused_write_gap),
            refused_already_written: c(&self.refused_already_written),
            refused_out_of_pages: c(&self.refused_out_of_pages),
            refused_lease_limit: c(&self.refused_lease_limit),
            canary_mismatch: c(&self.canary_mismatch),
            checksum_mismatch: c(&self.checksum_mismatch),
            refused_shared_write: c(&self.refused_shared_write),
            refused_foreign_scope: c(&self.refused_foreign_scope),
            refused_ref_underflow: c(&self.refused_ref_underflow),
            refused_unpublishable: c(&self.refused_unpublishable),
            allocs: c(&self.allocs),
            frees: c(&self.frees),
            frees_deferred: c(&self.frees_deferred),
            cache_publishes: c(&self.cache_publishes),
            cache_evictions: c(&self.cache_evictions),
        }
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Owned, 64-byte aligned, zero-initialised page memory.
struct Memory {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl Memory {
    fn new(bytes: usize) -> Result<Memory, KvError> {
        let layout = Layout::from_size_align(bytes.max(PAGE_ALIGN_BYTES), PAGE_ALIGN_BYTES)
            .map_err(|_| KvError::InvalidSize {
                why: format!("{bytes} bytes is not a valid allocation size"),
            })?;
        // SAFETY: layout has non-zero size. Zeroed memory is committed lazily
        // by the OS, so a large pool costs nothing until pages are touched.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or(KvError::InvalidSize {
            why: format!("could not allocate {bytes} bytes for the KV pool"),
        })?;
        Ok(Memory { ptr, layout })
    }
}

impl Memory {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `layout.size()` bytes were allocated (zeroed) in `new`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Clone for Memory {
    fn clone(&self) -> Memory {
        // SAFETY: `alloc` with the same non-zero layout; copied in full below.
        let raw = unsafe { alloc::alloc(self.layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(self.layout)
        };
        // SAFETY: both regions are `layout.size()` bytes and do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), ptr.as_ptr(), self.layout.size())
        };
        Memory {
            ptr,
            layout: self.layout,
        }
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        // SAFETY: allocated in `Memory::new` with this very layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// The KV pool. See the crate documentation for the invariants it keeps.
pub struct Pool {
    shape: KvShape,
    options: PoolOptions,
    pages: u32,
    memory: Memory,
    meta: Vec<Meta>,
    /// Written slots per (page, layer), index `page * layers + layer` (K3).
    watermarks: Vec<u16>,
    /// Free page indices; LIFO, so a freed page is the next one handed out
    /// (which is exactly the reuse the checks must survive).
    free_list: Vec<u32>,
    pages_leased: u32,
    pages_release_pending: u32,
    /// Cached pages by (scope, key) (K11): one entry per shared page, so
    /// the index is bounded by the pool.
    cache_index: BTreeMap<(Scope, u64), u32>,
    /// Shared pages without references or leases, by `idle_since`:
    /// evicted oldest first when an allocation needs pages.
    evictable: BTreeMap<u64, u32>,
    idle_clock: u64,
    counters: Counters,
    #[cfg(any(test, feature = "fault-injection"))]
    faults: Faults,
}

// SAFETY: `Memory` is a plain heap allocation owned by the pool. All writes
// to it go through `&mut Pool`, all reads through `&Pool`, so Rust's aliasing
// rules for the pool carry over to the memory; counters are atomics.
unsafe impl Send for Pool {}
// SAFETY: as for `Send` above: shared access is `&Pool`, reads only.
unsafe impl Sync for Pool {}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("shape", &self.shape)
            .field("pages", &self.pages)
            .field("stats", &self.stats())
            .finish()
    }
}

/// A deep copy: memory, metadata and counters. For model checkers and
/// simulators that branch a whole node state (pools there are a few tiny
/// pages); a serving process never clones its pool.
impl Clone for Pool {
    fn clone(&self) -> Pool {
        Pool {
            shape: self.shape,
            options: self.options,
            pages: self.pages,
            memory: self.memory.clone(),
            meta: self.meta.clone(),
            watermarks: self.watermarks.clone(),
            free_list: self.free_list.clone(),
            pages_leased: self.pages_leased,
            pages_release_pending: self.pages_release_pending,
            cache_index: self.cache_index.clone(),
            evictable: self.evictable.clone(),
            idle_clock: self.idle_clock,
            counters: self.counters.snapshot(),
            #[cfg(any(test, feature = "fault-injection"))]
            faults: self.faults,
        }
    }
}

/// Equal when everything observable is: memory bytes, metadata, free-list
/// order (it decides which page is handed out next) and counters.
impl PartialEq for Pool {
    fn eq(&self, other: &Pool) -> bool {
        let same_faults = {
            #[cfg(any(test, feature = "fault-injection"))]
            {
                self.faults == other.faults
            }
            #[cfg(not(any(test, feature = "fault-injection")))]
            {
                true
            }
        };
        self.shape == other.shape
            && self.options == other.options
            && self.meta == other.meta
            && self.watermarks == other.watermarks
            && self.free_list == other.free_list
            && self.pages_leased == other.pages_leased
            && self.pages_release_pending == other.pages_release_pending
            && self.cache_index == other.cache_index
            && self.evictable == other.evictable
            && self.idle_clock == other.idle_clock
            && self.stats() == other.stats()
            && same_faults
            && self.memory.bytes() == other.memory.bytes()
    }
}

impl Eq for Pool {}

impl std::hash::Hash for Pool {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.shape.hash(state);
        self.meta.hash(state);
        self.watermarks.hash(state);
        self.free_list.hash(state);
        self.pages_leased.hash(state);
        self.pages_release_pending.hash(state);
        self.cache_index.hash(state);
        self.evictable.hash(state);
        self.idle_clock.hash(state);
        self.stats().fields().hash(state);
        self.memory.bytes().hash(state);
    }
}

mod cache;
mod export;
mod inspect;
mod lifecycle;
mod rows;

impl Pool {
    /// A pool of exactly `pages` pages.
    pub fn new(shape: KvShape, pages: u64, options: PoolOptions) -> Result<Pool, KvError> {
        shape.validate()?;
        if pages == 0 || pages > POOL_PAGES_MAX {
            return Err(KvError::InvalidSize {
                why: format!("page count {pages} must be in 1..={POOL_PAGES_MAX}"),
            });
        }
        let total = pages
            .checked_mul(shape.page_bytes() as u64)
            .filter(|&b| b <= POOL_BYTES_MAX)
            .ok_or_else(|| KvError::InvalidSize {
                why: format!(
                    "{pages} pages of {} bytes exceed the {POOL_BYTES_MAX}-byte limit",
                    shape.page_bytes()
                ),
            })?;
        let pages_u32 = pages as u32;
        let memory = Memory::new(total as usize)?;
        let free_epoch_meta = Meta {
            epoch: 0,
            owner: Owner::NONE,
            leases: 0,
            free_pending: false,
            shared: false,
            refs: 0,
            key: 0,
            idle_since: 0,
        };
        // Reverse order so that page 0 is handed out first.
        let free_list: Vec<u32> = (0..pages_u32).rev().collect();
        Ok(Pool {
            shape,
            options,
            pages: pages_u32,
            memory,
            meta: vec![free_epoch_meta; pages as usize],
            watermarks: vec![0; pages as usize * shape.layers],
            free_list,
            pages_leased: 0,
            pages_release_pending: 0,
            cache_index: BTreeMap::new(),
            evictable: BTreeMap::new(),
            idle_clock: 0,
            counters: Counters::default(),
            #[cfg(any(test, feature = "fault-injection"))]
            faults: Faults::default(),
        })
    }

    /// A pool holding as many whole pages as `budget_bytes` buys.
    pub fn with_budget(
        shape: KvShape,
        budget_bytes: u64,
        options: PoolOptions,
    ) -> Result<Pool, KvError> {
        shape.validate()?;
        let pages = crate::pages_for_budget(&shape, budget_bytes);
        if pages == 0 {
            return Err(KvError::InvalidSize {
                why: format!(
                    "a budget of {budget_bytes} bytes holds no page of {} bytes",
                    shape.page_bytes()
                ),
            });
        }
        Pool::new(shape, pages, options)
    }

    pub fn shape(&self) -> &KvShape {
        &self.shape
    }

    pub fn options(&self) -> PoolOptions {
        self.options
    }

    pub fn pages_total(&self) -> u32 {
        self.pages
    }

    /// Pages on the free list (cached pages not counted).
    pub fn pages_free(&self) -> u32 {
        self.free_list.len() as u32
    }

    /// Cached pages no request holds and no transfer leases: an allocation
    /// evicts them when the free list runs short.
    pub fn pages_evictable(&self) -> u32 {
        self.evictable.len() as u32
    }

    /// What an allocation can get: free plus evictable pages. Admission
    /// compares with this, so a warm cache never refuses a request an empty
    /// pool would take (K8).
    pub fn pages_available(&self) -> u32 {
        self.pages_free() + self.pages_evictable()
    }

    /// Pages cached (shared), held or not.
    pub fn pages_cached(&self) -> u32 {
        self.cache_index.len() as u32
    }

    /// Tokens the whole pool holds (K8).
    pub fn capacity_tokens(&self) -> u64 {
        crate::capacity_tokens(&self.shape, self.pages as u64)
    }

    #[cfg(any(test, feature = "fault-injection"))]
    pub fn set_faults(&mut self, faults: Faults) {
        self.faults = faults;
    }

    // ----------------------------------------------------------------- checks

    /// The one gate every access goes through: index in range, epoch current
    /// (K2), owner matches (K1). Returns the page's metadata.
    #[inline]
    fn check_handle(&self, h: PageRef, owner: Owner) -> Result<&Meta, KvError> {
        let Some(meta) = self.meta.get(h.index as usize) else {
            bump(&self.counters.refused_out_of_range);
            return Err(KvError::OutOfRange {
                index: h.index,
                pages: self.pages,
            });
        };
        if meta.epoch != h.epoch && !fault!(self, skip_epoch_check) {
            bump(&self.counters.refused_stale_handle);
            return Err(KvError::StaleHandle {
                index: h.index,
                handle_epoch: h.epoch,
                page_epoch: meta.epoch,
            });
        }
        if !meta.allocated() && !fault!(self, skip_epoch_check) {
            // Only reachable with a forged even-epoch handle.
            bump(&self.counters.refused_stale_handle);
            return Err(KvError::StaleHandle {
                index: h.index,
                handle_epoch: h.epoch,
                page_epoch: meta.epoch,
            });
        }
        if meta.owner != owner {
            if meta.shared && owner.is_request() {
                // A cached page: readable in its scope only (K11).
                if meta.owner.scope != owner.scope && !fault!(self, skip_scope_check) {
                    bump(&self.counters.refused_foreign_scope);
                    return Err(KvError::ForeignScope { index: h.index });
                }
            } else if !fault!(self, skip_owner_check) {
                bump(&self.counters.refused_foreign_owner);
                return Err(KvError::ForeignOwner { index: h.index });
            }
        }
        Ok(meta)
    }

    /// `check_handle` plus "not released": reads of the owner's own pages
    /// and of cached pages in its scope. The happy path is one bounds check
    /// and a few compares; the error paths are out of line.
    #[inline]
    fn check_read(&self, h: PageRef, owner: Owner) -> Result<(), KvError> {
        if let Some(m) = self.meta.get(h.index as usize) {
            if m.epoch == h.epoch
                && h.epoch & 1 == 1
                && !m.free_pending
                && (m.owner == owner || (m.shared && m.owner.scope == owner.scope))
            {
                return Ok(());
            }
        }
        self.check_live_slow(h, owner)
    }

    /// [`Pool::check_read`] for writes: the owner's own private pages only;
    /// a cached page is read-only (K11), a write to it refused and counted.
    #[inline]
    fn check_write(&self, h: PageRef, owner: Owner) -> Result<(), KvError> {
        if let Some(m) = self.meta.get(h.index as usize) {
            if m.epoch == h.epoch && h.epoch & 1 == 1 && m.owner == owner && !m.free_pending {
                return Ok(());
            }
        }
        self.check_live_slow(h, owner)?;
        if self.meta[h.index as usize].shared && !fault!(self, skip_shared_write_check) {
            bump(&self.counters.refused_shared_write);
            return Err(KvError::SharedPage { index: h.index });
        }
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn check_live_slow(&self, h: PageRef, owner: Owner) -> Result<(), KvError> {
        let meta = self.check_handle(h, owner)?;
        if meta.free_pending {
            bump(&self.counters.refused_release_pending);
            return Err(KvError::ReleasePending { index: h.index });
        }
        Ok(())
    }

    fn check_layer(&self, layer: usize) -> Result<(), KvError> {
        if layer >= self.shape.layers {
            bump(&self.counters.refused_out_of_range);
            return Err(KvError::LayerOutOfRange {
                layer,
                layers: self.shape.layers,
            });
        }
        Ok(())
    }
}

fn store_row(dtype: DType, dst: &mut [u8], src: &[f32]) {
    match dtype {
        DType::F32 => {
            for (d, s) in dst.chunks_exact_mut(4).zip(src) {
                d.copy_from_slice(&s.to_le_bytes());
            }
        }
        DType::F16 => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&f16::from_f32(*s).to_le_bytes());
            }
        }
        DType::Q8_0 => {
            for (d, s) in dst
                .chunks_exact_mut(Q8_BLOCK_BYTES)
                .zip(src.chunks_exact(Q8_BLOCK))
            {
                quantize_q8_0(s, d);
            }
        }
    }
}

/// One `q8_0` block as GGML's reference quantiser writes it: scale =
/// max |x| / 127 (stored as f16), q = round(x / scale) away from zero. A
/// non-finite input makes the scale NaN, so the block reads as NaN rather
/// than as plausible numbers.
pub fn quantize_q8_0(src: &[f32], dst: &mut [u8]) {
    assert_eq!((src.len(), dst.len()), (Q8_BLOCK, Q8_BLOCK_BYTES));
    let amax = src.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let amax = if src.iter().all(|x| x.is_finite()) {
        amax
    } else {
        f32::NAN
    };
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    dst[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (q, x) in dst[2..].iter_mut().zip(src) {
        // NaN × anything saturates to 0 in `as i8`: the NaN scale carries it.
        *q = ((x * id).round() as i8) as u8;
    }
}

/// Dequantises one `q8_0` block (`Q8_BLOCK_BYTES` in, `Q8_BLOCK` out).
pub fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    assert_eq!((src.len(), dst.len()), (Q8_BLOCK_BYTES, Q8_BLOCK));
    let d = f16::from_le_bytes([src[0], src[1]]).to_f32();
    for (x, &q) in dst.iter_mut().zip(&src[2..]) {
        *x = d * (q as i8) as f32;
    }
}
