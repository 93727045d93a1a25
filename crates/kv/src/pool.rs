//! The pool: fixed page memory plus per-page metadata, and every check.

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

    // ------------------------------------------------------------ allocation

    /// Allocates `n` pages for `owner`, all or nothing, appending their
    /// handles to `out`. Each page's epoch is bumped, its watermarks are zero
    /// and its canary is written.
    /// Evicts idle cached pages (oldest first) when the free list is short.
    pub fn alloc(&mut self, owner: Owner, n: usize, out: &mut Vec<PageRef>) -> Result<(), KvError> {
        if n > self.pages_available() as usize {
            bump(&self.counters.refused_out_of_pages);
            return Err(KvError::OutOfPages {
                requested: n,
                free: self.pages_available() as usize,
            });
        }
        if !owner.is_request() {
            return Err(KvError::InvalidOwner);
        }
        while self.free_list.len() < n {
            let (_, index) = self
                .evictable
                .pop_first()
                .expect("pages_available counted enough evictable pages");
            self.evict(index);
        }
        out.reserve(n);
        for _ in 0..n {
            let index = self.free_list.pop().expect("length checked above");
            let meta = &mut self.meta[index as usize];
            assert!(!meta.allocated(), "free list held allocated page {index}");
            assert_eq!(meta.leases, 0);
            meta.epoch += 1;
            meta.owner = owner;
            meta.free_pending = false;
            let epoch = meta.epoch;
            let layers = self.shape.layers;
            self.watermarks[index as usize * layers..(index as usize + 1) * layers].fill(0);
            self.write_canary(index, canary_value(owner, epoch, index));
            bump(&self.counters.allocs);
            out.push(PageRef { index, epoch });
        }
        Ok(())
    }

    /// Frees a page. Deferred while the page is leased (K4). A stale, foreign
    /// or repeated free is a detected, counted error (K5).
    pub fn free(&mut self, h: PageRef, owner: Owner) -> Result<FreeOutcome, KvError> {
        let Some(meta) = self.meta.get(h.index as usize).copied() else {
            bump(&self.counters.refused_out_of_range);
            return Err(KvError::OutOfRange {
                index: h.index,
                pages: self.pages,
            });
        };
        let double_free_check = !fault!(self, skip_double_free_check);
        if meta.epoch != h.epoch && double_free_check {
            if meta.epoch == h.epoch.wrapping_add(1) && !meta.allocated() {
                bump(&self.counters.refused_double_free);
                return Err(KvError::DoubleFree { index: h.index });
            }
            bump(&self.counters.refused_stale_handle);
            return Err(KvError::StaleHandle {
                index: h.index,
                handle_epoch: h.epoch,
                page_epoch: meta.epoch,
            });
        }
        if !meta.allocated() && double_free_check {
            bump(&self.counters.refused_double_free);
            return Err(KvError::DoubleFree { index: h.index });
        }
        if meta.shared && !fault!(self, skip_shared_write_check) {
            // A cached page leaves by release and eviction only (K11).
            bump(&self.counters.refused_shared_write);
            return Err(KvError::SharedPage { index: h.index });
        }
        if meta.owner != owner && !meta.shared && !fault!(self, skip_owner_check) {
            bump(&self.counters.refused_foreign_owner);
            return Err(KvError::ForeignOwner { index: h.index });
        }
        if meta.free_pending && double_free_check {
            bump(&self.counters.refused_double_free);
            return Err(KvError::DoubleFree { index: h.index });
        }
        if meta.leases > 0 && !fault!(self, skip_lease_deferral) {
            let m = &mut self.meta[h.index as usize];
            m.free_pending = true;
            self.pages_release_pending += 1;
            bump(&self.counters.frees_deferred);
            return Ok(FreeOutcome::Deferred);
        }
        self.release_page(h.index);
        Ok(FreeOutcome::Freed)
    }

    /// Returns a page to the free list: bump the epoch (K2), clear the owner
    /// (K1), poison the memory.
    fn release_page(&mut self, index: u32) {
        let m = &mut self.meta[index as usize];
        if !m.allocated() {
            // Only reachable with the double-free check switched off in a
            // fault test: keep the free list a set so the test can observe
            // the consequence (two owners of one page) rather than a crash.
            return;
        }
        if m.leases > 0 {
            // Only with lease deferral switched off (fault tests).
            self.pages_leased -= 1;
            m.leases = 0;
        }
        if m.free_pending {
            self.pages_release_pending -= 1;
        }
        if m.shared {
            // Only an eviction (or a fault test's free) gets here.
            let (scope, key, idle) = (m.owner.scope, m.key, m.idle_since);
            m.shared = false;
            m.refs = 0;
            self.cache_index.remove(&(scope, key));
            if self.evictable.get(&idle) == Some(&index) {
                self.evictable.remove(&idle);
            }
        }
        let m = &mut self.meta[index as usize];
        m.epoch += 1;
        m.owner = Owner::NONE;
        m.free_pending = false;
        let layers = self.shape.layers;
        self.watermarks[index as usize * layers..(index as usize + 1) * layers].fill(0);
        let poison = match self.options.poison {
            _ if fault!(self, skip_poison) => None,
            Poison::Nan => Some(POISON_NAN_BYTE),
            Poison::Zero => Some(0),
            Poison::Off => None,
        };
        if let Some(byte) = poison {
            self.page_mut(index).fill(byte);
        }
        self.free_list.push(index);
        bump(&self.counters.frees);
    }

    // ---------------------------------------------------------------- leases

    /// Leases a page to an in-flight transfer (K4): until the lease is
    /// released, a free of the page is deferred.
    pub fn lease(&mut self, h: PageRef, owner: Owner) -> Result<(), KvError> {
        self.check_read(h, owner)?;
        let m = &mut self.meta[h.index as usize];
        if m.leases >= LEASES_PER_PAGE_MAX {
            bump(&self.counters.refused_lease_limit);
            return Err(KvError::LeaseLimit { index: h.index });
        }
        if m.shared && m.refs == 0 && m.leases == 0 {
            // Leased, so no longer evictable.
            let idle = m.idle_since;
            self.evictable.remove(&idle);
        }
        let m = &mut self.meta[h.index as usize];
        m.leases += 1;
        if m.leases == 1 {
            self.pages_leased += 1;
        }
        Ok(())
    }

    /// Releases one lease; frees the page if its free was deferred and this
    /// was the last lease.
    pub fn release_lease(&mut self, h: PageRef, owner: Owner) -> Result<LeaseOutcome, KvError> {
        self.check_handle(h, owner)?;
        let m = &mut self.meta[h.index as usize];
        if m.leases == 0 {
            return Err(KvError::NotLeased { index: h.index });
        }
        m.leases -= 1;
        if m.leases > 0 {
            return Ok(LeaseOutcome::Released);
        }
        self.pages_leased -= 1;
        if m.free_pending {
            self.release_page(h.index);
            return Ok(LeaseOutcome::ReleasedAndFreed);
        }
        if m.shared && m.refs == 0 {
            self.make_idle(h.index);
        }
        Ok(LeaseOutcome::Released)
    }

    // ------------------------------------------------------ the cache (K11)

    /// Caches a private page under `key` in its owner's scope: the page
    /// becomes read-only and shared, its epoch moves on (the private handle
    /// goes stale), and the caller holds its first reference through the
    /// returned handle. Only a page every slot of every layer of which was
    /// written in this epoch (K3), not leased and not being released, can
    /// be cached. `Ok(None)`: the scope already caches that key (the page
    /// stays private to the caller).
    pub fn publish(
        &mut self,
        h: PageRef,
        owner: Owner,
        key: u64,
    ) -> Result<Option<PageRef>, KvError> {
        self.check_write(h, owner)?;
        let i = h.index as usize;
        if self.meta[i].leases > 0 {
            bump(&self.counters.refused_unpublishable);
            return Err(KvError::NotPublishable {
                index: h.index,
                why: "it is leased to a transfer",
            });
        }
        let layers = self.shape.layers;
        let full = self.watermarks[i * layers..(i + 1) * layers]
            .iter()
            .all(|&w| w as usize == self.shape.page_size);
        if !full && !fault!(self, skip_publish_check) {
            bump(&self.counters.refused_unpublishable);
            return Err(KvError::NotPublishable {
                index: h.index,
                why: "not every slot was written in this epoch",
            });
        }
        if self.cache_index.contains_key(&(owner.scope, key)) {
            return Ok(None);
        }
        let m = &mut self.meta[i];
        m.epoch += 2;
        m.owner = Owner::cached(owner.scope);
        m.shared = true;
        m.refs = 1;
        m.key = key;
        let (cached, epoch) = (m.owner, m.epoch);
        self.write_canary(h.index, canary_value(cached, epoch, h.index));
        self.cache_index.insert((owner.scope, key), h.index);
        bump(&self.counters.cache_publishes);
        Ok(Some(PageRef {
            index: h.index,
            epoch,
        }))
    }

    /// The cached page of `scope` under `key`, if any (not acquired).
    pub fn lookup(&self, scope: Scope, key: u64) -> Option<PageRef> {
        let &index = self.cache_index.get(&(scope, key))?;
        let epoch = self.meta[index as usize].epoch;
        Some(PageRef { index, epoch })
    }

    /// The cached pages of the longest prefix of `keys` that `scope` caches
    /// (page `i` under `keys[i]`), appended to `out` (not acquired).
    pub fn cached_prefix(&self, scope: Scope, keys: &[u64], out: &mut Vec<PageRef>) {
        for &k in keys {
            match self.lookup(scope, k) {
                Some(h) => out.push(h),
                None => break,
            }
        }
    }

    /// Takes a reference to a cached page of the owner's scope: it stays
    /// cached (not evictable) until released.
    pub fn acquire(&mut self, h: PageRef, owner: Owner) -> Result<(), KvError> {
        self.check_read(h, owner)?;
        let m = &mut self.meta[h.index as usize];
        if !m.shared {
            return Err(KvError::NotPublishable {
                index: h.index,
                why: "only cached pages are acquired",
            });
        }
        if m.refs >= REFS_PER_PAGE_MAX {
            bump(&self.counters.refused_lease_limit);
            return Err(KvError::RefLimit { index: h.index });
        }
        if m.refs == 0 && m.leases == 0 {
            let idle = m.idle_since;
            self.evictable.remove(&idle);
        }
        let m = &mut self.meta[h.index as usize];
        m.refs += 1;
        Ok(())
    }

    /// Drops a reference to a cached page. At no reference and no lease
    /// the page becomes evictable (it stays cached until an allocation
    /// needs it). A release without a reference is refused and counted:
    /// reference counts never go negative (K5).
    pub fn release(&mut self, h: PageRef, owner: Owner) -> Result<(), KvError> {
        self.check_handle(h, owner)?;
        let m = &mut self.meta[h.index as usize];
        if !m.shared {
            return Err(KvError::NotPublishable {
                index: h.index,
                why: "only cached pages are released; private pages are freed",
            });
        }
        if m.refs == 0 {
            if !fault!(self, skip_refcount_check) {
                bump(&self.counters.refused_ref_underflow);
                return Err(KvError::RefUnderflow { index: h.index });
            }
            // Fault test: the count wraps — the page is held forever.
            m.refs = u32::MAX;
            return Ok(());
        }
        m.refs -= 1;
        if m.refs == 0 && m.leases == 0 {
            self.make_idle(h.index);
        }
        Ok(())
    }

    /// Caches the private pages among the first `n` of a request's
    /// `pages` (every slot written, `keys[i]` the key of page `i`): each
    /// becomes shared and read-only, its handle in `pages` replaced and
    /// `shared[i]` set. A page whose key the scope already caches stays
    /// private. Returns the pages the pool refused (each refusal counted;
    /// for a caller that wrote every slot, a bug).
    pub fn publish_pages(
        &mut self,
        owner: Owner,
        pages: &mut [PageRef],
        shared: &mut [bool],
        keys: &[u64],
        n: usize,
    ) -> usize {
        let mut refused = 0;
        for p in 0..n.min(keys.len()).min(pages.len()).min(shared.len()) {
            if shared[p] {
                continue;
            }
            match self.publish(pages[p], owner, keys[p]) {
                Ok(Some(h)) => {
                    pages[p] = h;
                    shared[p] = true;
                }
                Ok(None) => {}
                Err(_) => refused += 1,
            }
        }
        refused
    }

    /// Gives back pages a request took, last first: the first `acquired`
    /// are cached pages it referenced (released), the rest its own
    /// (freed). Returns how many the pool refused (each counted).
    pub fn give_back(&mut self, owner: Owner, pages: &[PageRef], acquired: usize) -> usize {
        let mut refused = 0;
        for (i, &h) in pages.iter().enumerate().rev() {
            let r = match i < acquired {
                true => self.release(h, owner),
                false => self.free(h, owner).map(|_| ()),
            };
            refused += usize::from(r.is_err());
        }
        refused
    }

    /// How many of `pages` (current handles) giving back would make
    /// available: private pages, and cached pages whose only reference is
    /// the one given back (and no lease holds).
    pub fn freed_by_giving_back(&self, pages: &[PageRef]) -> usize {
        pages
            .iter()
            .filter(|h| {
                self.meta.get(h.index as usize).is_some_and(|m| {
                    m.epoch == h.epoch && m.leases == 0 && (!m.shared || m.refs == 1)
                })
            })
            .count()
    }

    /// How many of `pages` (current handles) are idle cached pages: what
    /// acquiring them takes out of [`Pool::pages_available`].
    pub fn idle_among(&self, pages: &[PageRef]) -> usize {
        pages
            .iter()
            .filter(|h| {
                self.meta
                    .get(h.index as usize)
                    .is_some_and(|m| m.epoch == h.epoch && m.shared && m.refs == 0 && m.leases == 0)
            })
            .count()
    }

    /// Evicts every idle cached page (tests, `--prefix-cache off` at run
    /// time); returns how many.
    pub fn evict_idle(&mut self) -> usize {
        let n = self.evictable.len();
        while let Some((_, index)) = self.evictable.pop_first() {
            self.evict(index);
        }
        n
    }

    fn make_idle(&mut self, index: u32) {
        self.idle_clock += 1;
        let clock = self.idle_clock;
        self.meta[index as usize].idle_since = clock;
        self.evictable.insert(clock, index);
    }

    /// An idle cached page back to the free list: out of the index, epoch
    /// bumped (K2: every handle to it goes stale), poisoned.
    fn evict(&mut self, index: u32) {
        let m = self.meta[index as usize];
        debug_assert!(m.shared && m.refs == 0 && m.leases == 0);
        self.release_page(index);
        bump(&self.counters.cache_evictions);
    }

    // ---------------------------------------------------------- reads/writes

    fn page_offset(&self, index: u32) -> usize {
        index as usize * self.shape.page_bytes()
    }

    pub(crate) fn page_mut(&mut self, index: u32) -> &mut [u8] {
        let off = self.page_offset(index);
        let len = self.shape.page_bytes();
        // SAFETY: index < pages (callers hold a checked index), so
        // [off, off+len) is inside the allocation; `&mut self` makes it unique.
        unsafe { std::slice::from_raw_parts_mut(self.memory.ptr.as_ptr().add(off), len) }
    }

    pub(crate) fn page(&self, index: u32) -> &[u8] {
        let off = self.page_offset(index);
        let len = self.shape.page_bytes();
        // SAFETY: as in `page_mut`; shared borrow of the pool, shared slice.
        unsafe { std::slice::from_raw_parts(self.memory.ptr.as_ptr().add(off), len) }
    }

    fn write_canary(&mut self, index: u32, value: u64) {
        let data = self.shape.data_bytes();
        let trailer = &mut self.page_mut(index)[data..data + TRAILER_BYTES];
        for chunk in trailer.chunks_exact_mut(8) {
            chunk.copy_from_slice(&value.to_le_bytes());
        }
    }

    /// Writes K and V of one token at `slot` of `layer`. Slots are written in
    /// order: `slot` may rewrite a written slot or append at the watermark,
    /// never leave a gap (a gap would make the watermark lie).
    pub fn write_token(
        &mut self,
        h: PageRef,
        owner: Owner,
        layer: usize,
        slot: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), KvError> {
        self.check_write(h, owner)?;
        self.check_layer(layer)?;
        let width = self.shape.token_width();
        if k.len() != width || v.len() != width {
            return Err(KvError::RowWidth {
                expected: width,
                got: k.len().min(v.len()),
            });
        }
        let wm_index = h.index as usize * self.shape.layers + layer;
        let wm = self.watermarks[wm_index] as usize;
        // With the watermark check off (fault tests, the fault-incident
        // build) a write may leave a gap: the slots below stay whatever the
        // page held before.
        if slot >= self.shape.page_size || (slot > wm && !fault!(self, skip_watermark_check)) {
            bump(&self.counters.refused_write_gap);
            return Err(KvError::WriteGap {
                index: h.index,
                layer,
                slot,
                watermark: wm,
            });
        }
        let shape = self.shape;
        let layer_off = layer * shape.layer_bytes();
        let rb = shape.row_bytes();
        let k_off = layer_off + slot * rb;
        let v_off = layer_off + shape.half_bytes() + slot * rb;
        let page = self.page_mut(h.index);
        store_row(shape.dtype, &mut page[k_off..k_off + rb], k);
        store_row(shape.dtype, &mut page[v_off..v_off + rb], v);
        if slot >= wm {
            self.watermarks[wm_index] = (slot + 1) as u16;
        }
        Ok(())
    }

    /// The first `n` written K/V slots of `layer` in page `h`. Refused if any
    /// of them was not written by `owner` in the page's current epoch (K3).
    // Always inlined: it runs once per (page, layer) of every attention
    // step, and returned through memory its view costs a store-forwarding
    // stall (measured: 4.8 → 13 ns a call when it stopped being inlined).
    #[inline(always)]
    pub fn read_layer(
        &self,
        h: PageRef,
        owner: Owner,
        layer: usize,
        n: usize,
    ) -> Result<LayerView<'_>, KvError> {
        self.check_read(h, owner)?;
        self.check_layer(layer)?;
        let wm = self.watermarks[h.index as usize * self.shape.layers + layer] as usize;
        if n > wm && !fault!(self, skip_watermark_check) {
            bump(&self.counters.refused_unwritten_read);
            return Err(KvError::UnwrittenRead {
                index: h.index,
                layer,
                slots: n,
                watermark: wm,
            });
        }
        let n = n.min(self.shape.page_size);
        let shape = self.shape;
        let count = n * shape.token_width();
        let off = h.index as usize * shape.page_bytes() + layer * shape.layer_bytes();
        // SAFETY: index < pages (check_live) and layer < layers (check_layer),
        // so [off, off + layer_bytes) lies inside the allocation. Every
        // (page, layer) half starts 64-byte aligned (KvShape::validate) and
        // holds page_size × width ≥ count elements (page_size × row_bytes ≥
        // n × row_bytes bytes); f32, f16 and bytes have no invalid bit
        // patterns; `&self` forbids concurrent writes.
        unsafe {
            let k = self.memory.ptr.as_ptr().add(off);
            let v = k.add(shape.half_bytes());
            Ok(match shape.dtype {
                DType::F32 => LayerView::F32 {
                    k: std::slice::from_raw_parts(k.cast::<f32>(), count),
                    v: std::slice::from_raw_parts(v.cast::<f32>(), count),
                },
                DType::F16 => LayerView::F16 {
                    k: std::slice::from_raw_parts(k.cast::<f16>(), count),
                    v: std::slice::from_raw_parts(v.cast::<f16>(), count),
                },
                DType::Q8_0 => LayerView::Q8_0 {
                    k: std::slice::from_raw_parts(k, n * shape.row_bytes()),
                    v: std::slice::from_raw_parts(v, n * shape.row_bytes()),
                },
            })
        }
    }

    /// Written slots of (page, layer) in the current epoch.
    pub fn watermark(&self, h: PageRef, owner: Owner, layer: usize) -> Result<usize, KvError> {
        self.check_handle(h, owner)?;
        self.check_layer(layer)?;
        Ok(self.watermarks[h.index as usize * self.shape.layers + layer] as usize)
    }

    /// Slots written in every layer (the page's usable length).
    pub fn written_slots(&self, h: PageRef, owner: Owner) -> Result<usize, KvError> {
        self.check_handle(h, owner)?;
        let layers = self.shape.layers;
        let wms = &self.watermarks[h.index as usize * layers..(h.index as usize + 1) * layers];
        Ok(wms.iter().copied().min().unwrap_or(0) as usize)
    }

    // -------------------------------------------------------------- transfer

    /// Copies a page's KV data out for transfer (`out.len()` must be
    /// `shape.data_bytes()`), zeroing every slot not written in the current
    /// epoch so no byte of an earlier owner ever leaves the node. Allowed
    /// while the page is leased even if its free is pending (the transfer
    /// that holds the lease is still reading it). Returns the number of
    /// slots written in every layer.
    pub fn export_page(&self, h: PageRef, owner: Owner, out: &mut [u8]) -> Result<usize, KvError> {
        let meta = self.check_handle(h, owner)?;
        if meta.free_pending && meta.leases == 0 {
            bump(&self.counters.refused_release_pending);
            return Err(KvError::ReleasePending { index: h.index });
        }
        let shape = self.shape;
        if out.len() != shape.data_bytes() {
            return Err(KvError::PageBytes {
                expected: shape.data_bytes(),
                got: out.len(),
            });
        }
        let page = self.page(h.index);
        let row_bytes = shape.row_bytes();
        let mut slots = shape.page_size;
        for layer in 0..shape.layers {
            let wm = self.watermarks[h.index as usize * shape.layers + layer] as usize;
            slots = slots.min(wm);
            for half in 0..2 {
                let off = layer * shape.layer_bytes() + half * shape.half_bytes();
                let written = wm * row_bytes;
                out[off..off + written].copy_from_slice(&page[off..off + written]);
                out[off + written..off + shape.half_bytes()].fill(0);
            }
        }
        Ok(slots)
    }

    /// Writes a transferred page: `bytes` (`shape.data_bytes()` long) with
    /// `slots` written slots in every layer. Refused unless the page was not
    /// written in this epoch: a page is filled by one transfer exactly once
    /// (K10).
    pub fn import_page(
        &mut self,
        h: PageRef,
        owner: Owner,
        bytes: &[u8],
        slots: usize,
    ) -> Result<(), KvError> {
        self.check_write(h, owner)?;
        let shape = self.shape;
        if bytes.len() != shape.data_bytes() {
            return Err(KvError::PageBytes {
                expected: shape.data_bytes(),
                got: bytes.len(),
            });
        }
        if slots == 0 || slots > shape.page_size {
            return Err(KvError::WriteGap {
                index: h.index,
                layer: 0,
                slot: slots,
                watermark: 0,
            });
        }
        let layers = shape.layers;
        let wms = &self.watermarks[h.index as usize * layers..(h.index as usize + 1) * layers];
        if wms.iter().any(|&w| w != 0) {
            bump(&self.counters.refused_already_written);
            return Err(KvError::AlreadyWritten { index: h.index });
        }
        let data = shape.data_bytes();
        self.page_mut(h.index)[..data].copy_from_slice(bytes);
        self.watermarks[h.index as usize * layers..(h.index as usize + 1) * layers]
            .fill(slots as u16);
        Ok(())
    }

    // ------------------------------------------------------ canary, checksum

    /// Checks the page's canary (K7): the trailer must hold the value derived
    /// from (owner, epoch, index) in all eight words.
    pub fn check_canary(&self, h: PageRef, owner: Owner) -> Result<(), KvError> {
        let meta = self.check_handle(h, owner)?;
        if fault!(self, skip_canary_check) {
            return Ok(());
        }
        // A cached page carries its scope's cache owner.
        let expected_owner = if meta.shared { meta.owner } else { owner };
        let expected = canary_value(expected_owner, h.epoch, h.index);
        let data = self.shape.data_bytes();
        let trailer = &self.page(h.index)[data..data + TRAILER_BYTES];
        let intact = trailer
            .chunks_exact(8)
            .all(|c| u64::from_le_bytes(c.try_into().expect("8-byte chunk")) == expected);
        if !intact {
            bump(&self.counters.canary_mismatch);
            return Err(KvError::CanaryMismatch { index: h.index });
        }
        Ok(())
    }

    /// Checks a received page's bytes against the checksum its sender
    /// computed, bound to (request, epoch, position) (K6). Counts a mismatch.
    pub fn verify_checksum(
        &self,
        request: crate::RequestId,
        epoch: u64,
        position: u32,
        bytes: &[u8],
        expected: u64,
    ) -> Result<(), KvError> {
        if fault!(self, skip_checksum_check) {
            return Ok(());
        }
        if page_checksum(request, epoch, position, bytes) != expected {
            bump(&self.counters.checksum_mismatch);
            return Err(KvError::ChecksumMismatch { position });
        }
        Ok(())
    }

    // ----------------------------------------------------------- inspection

    /// Owner of a page, if allocated (for tests, audits and debugging).
    pub fn owner_of(&self, index: u32) -> Option<Owner> {
        self.meta
            .get(index as usize)
            .filter(|m| m.allocated())
            .map(|m| m.owner)
    }

    /// A hash of one page's bytes and write watermarks, or `None` out of
    /// range. For checkers that must see whether an event wrote a page;
    /// not a security checksum.
    pub fn page_fingerprint(&self, index: u32) -> Option<u64> {
        if index >= self.pages {
            return None;
        }
        let layers = self.shape.layers;
        let i = index as usize;
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(self.page(index));
        for w in &self.watermarks[i * layers..(i + 1) * layers] {
            h.update(&w.to_le_bytes());
        }
        Some(h.digest())
    }

    /// Test-only: a stray write past a page's data — one byte of its
    /// canary trailer flipped, as an out-of-bounds write from a neighbour
    /// would (for tests that a canary check is needed where it stands).
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn scribble_trailer(&mut self, index: u32) {
        let data = self.shape.data_bytes();
        if index < self.pages {
            self.page_mut(index)[data] ^= 0x5a;
        }
    }

    /// Current epoch of a page.
    pub fn epoch_of(&self, index: u32) -> Option<u64> {
        self.meta.get(index as usize).map(|m| m.epoch)
    }

    /// Occupancy and every refusal counter, as a plain struct.
    pub fn stats(&self) -> PoolStats {
        let c = &self.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let free = self.free_list.len() as u64;
        PoolStats {
            pages_total: self.pages as u64,
            pages_free: free,
            pages_owned: self.pages as u64 - free,
            pages_leased: self.pages_leased as u64,
            pages_release_pending: self.pages_release_pending as u64,
            refused_stale_handle: r(&c.refused_stale_handle),
            refused_foreign_owner: r(&c.refused_foreign_owner),
            refused_unwritten_read: r(&c.refused_unwritten_read),
            refused_double_free: r(&c.refused_double_free),
            refused_release_pending: r(&c.refused_release_pending),
            refused_out_of_range: r(&c.refused_out_of_range),
            refused_write_gap: r(&c.refused_write_gap),
            refused_already_written: r(&c.refused_already_written),
            refused_out_of_pages: r(&c.refused_out_of_pages),
            refused_lease_limit: r(&c.refused_lease_limit),
            canary_mismatch: r(&c.canary_mismatch),
            checksum_mismatch: r(&c.checksum_mismatch),
            refused_shared_write: r(&c.refused_shared_write),
            refused_foreign_scope: r(&c.refused_foreign_scope),
            refused_ref_underflow: r(&c.refused_ref_underflow),
            refused_unpublishable: r(&c.refused_unpublishable),
            allocs: r(&c.allocs),
            frees: r(&c.frees),
            frees_deferred: r(&c.frees_deferred),
            pages_cached: self.cache_index.len() as u64,
            pages_evictable: self.evictable.len() as u64,
            cache_publishes: r(&c.cache_publishes),
            cache_evictions: r(&c.cache_evictions),
        }
    }

    /// Every page's state, epoch, owner and written slots, for the
    /// operator console ([`request::console::PoolMap`]), refilled in place
    /// (nothing allocated once `out` has grown to the pool). O(pages): one
    /// pass over the metadata, one watermark read per page (the last
    /// layer's: a forward pass writes a token's layers in order, so the last
    /// layer's count is the slots written in every layer). Reads only
    /// metadata, never page memory: no prompt's K/V can reach the map.
    pub fn map_into(&self, out: &mut request::console::PoolMap) {
        out.clear();
        out.reserve(self.meta.len());
        self.map_range_into(out, 0..self.meta.len());
    }

    /// [`Pool::map_into`] for the pages `range` (clamped to the pool),
    /// appended to `out`: a large pool's map can be taken a slice per
    /// engine step (`engine::console`), so no step waits for all of it.
    pub fn map_range_into(
        &self,
        out: &mut request::console::PoolMap,
        range: std::ops::Range<usize>,
    ) {
        use request::console::PageState;
        out.page_size_tokens = self.shape.page_size as u32;
        let layers = self.shape.layers;
        let poisons = self.options.poison != Poison::Off;
        let end = range.end.min(self.meta.len());
        let start = range.start.min(end);
        for (i, m) in self.meta[start..end].iter().enumerate() {
            let i = start + i;
            let (state, who, request) = if !m.allocated() {
                let state = if m.epoch > 0 && poisons {
                    PageState::Poisoned
                } else {
                    PageState::Free
                };
                (state, u64::MAX, u64::MAX)
            } else if m.shared {
                (PageState::Cached, m.owner.scope.0, u64::MAX)
            } else {
                let state = if m.free_pending {
                    PageState::ReleasePending
                } else if m.leases > 0 {
                    PageState::Leased
                } else {
                    PageState::Private
                };
                (state, m.owner.tenant.0, m.owner.request.0)
            };
            let written = if m.allocated() {
                self.watermarks[i * layers + layers - 1]
            } else {
                0
            };
            out.push(state, m.epoch, who, request, written);
        }
    }

    /// Checks the pool's internal consistency (K1, K2, K4, K5 as state):
    /// the free list is a set of exactly the unallocated pages, each without
    /// owner or leases; allocated pages have an owner; lease and pending
    /// counts match. O(pages); for tests and debug assertions.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut on_free_list = vec![false; self.pages as usize];
        for &i in &self.free_list {
            let slot = on_free_list
                .get_mut(i as usize)
                .ok_or(format!("free list holds out-of-range page {i}"))?;
            if *slot {
                return Err(format!("page {i} is on the free list twice"));
            }
            *slot = true;
        }
        let (mut leased, mut pending, mut shared) = (0u32, 0u32, 0u32);
        for (i, m) in self.meta.iter().enumerate() {
            if m.allocated() == on_free_list[i] {
                return Err(format!(
                    "page {i}: allocated={} but on free list={}",
                    m.allocated(),
                    on_free_list[i]
                ));
            }
            if m.allocated() && m.owner == Owner::NONE {
                return Err(format!("allocated page {i} has no owner"));
            }
            if !m.allocated() && (m.owner != Owner::NONE || m.leases > 0 || m.free_pending) {
                return Err(format!(
                    "free page {i} has an owner, a lease or a pending free"
                ));
            }
            if m.free_pending && m.leases == 0 {
                return Err(format!("page {i} pending release without a lease"));
            }
            if m.shared {
                if !m.allocated() || m.owner != Owner::cached(m.owner.scope) || m.free_pending {
                    return Err(format!(
                        "cached page {i} is free, privately owned or released"
                    ));
                }
                if self.cache_index.get(&(m.owner.scope, m.key)) != Some(&(i as u32)) {
                    return Err(format!("cached page {i} is not in the index under its key"));
                }
                let idle = m.refs == 0 && m.leases == 0;
                let listed = self.evictable.get(&m.idle_since) == Some(&(i as u32));
                if idle != listed {
                    return Err(format!(
                        "cached page {i}: {} references, {} leases, but evictable = {listed}",
                        m.refs, m.leases,
                    ));
                }
                if m.refs > REFS_PER_PAGE_MAX {
                    return Err(format!("cached page {i} holds {} references", m.refs));
                }
                shared += 1;
            } else if m.refs != 0 || (m.allocated() && !m.owner.is_request()) {
                return Err(format!("private page {i} has references or a cache owner"));
            }
            leased += (m.leases > 0) as u32;
            pending += m.free_pending as u32;
        }
        if self.cache_index.len() != shared as usize || self.evictable.len() > shared as usize {
            return Err(format!(
                "cache counts drifted: {shared} shared pages, index {}, evictable {}",
                self.cache_index.len(),
                self.evictable.len()
            ));
        }
        if leased != self.pages_leased || pending != self.pages_release_pending {
            return Err(format!(
                "lease counters drifted: counted {leased}/{pending}, kept {}/{}",
                self.pages_leased, self.pages_release_pending
            ));
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
