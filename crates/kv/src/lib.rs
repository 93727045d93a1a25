//! `kv` — the paged, tenant-isolated KV-cache pool.
//!
//! The incident isoserve answers happened because KV pages were shared
//! memory nobody checked: a decode node reserved 8 pages, a transfer wrote 1,
//! and decode read all 8 — seven of them other customers' KV. This crate
//! makes that an error by construction. It knows nothing about models,
//! sockets or threads: only pages, their owners and their epochs.
//!
//! ```
//! use kv::{DType, KvShape, Owner, Pool, PoolOptions, RequestId, TenantId, KvError};
//!
//! let shape = KvShape::new(2, 1, 16, 4, DType::F32)?; // 2 layers, 4 slots/page
//! let mut pool = Pool::new(shape, 8, PoolOptions::default())?;
//! let alice = Owner::new(RequestId(1), TenantId(1));
//! let mut pages = Vec::new();
//! pool.alloc(alice, 2, &mut pages)?;
//! let row = [1.0f32; 16];
//! pool.write_token(pages[0], alice, 0, 0, &row, &row)?;
//! // One slot written: reading one is fine, reading two is refused (K3).
//! assert!(pool.read_layer(pages[0], alice, 0, 1).is_ok());
//! assert!(matches!(pool.read_layer(pages[0], alice, 0, 2), Err(KvError::UnwrittenRead { .. })));
//! // Another tenant cannot touch Alice's page (K1).
//! let bob = Owner::new(RequestId(2), TenantId(2));
//! assert!(matches!(pool.read_layer(pages[0], bob, 0, 1), Err(KvError::ForeignOwner { .. })));
//! // After a free the handle is stale forever, even once the page is reused (K2).
//! pool.free(pages[0], alice)?;
//! let mut again = Vec::new();
//! pool.alloc(alice, 1, &mut again)?;
//! assert_eq!(again[0].index, pages[0].index);
//! assert!(matches!(pool.read_layer(pages[0], alice, 0, 0), Err(KvError::StaleHandle { .. })));
//! assert_eq!(pool.stats().refused_stale_handle, 1);
//! # Ok::<(), KvError>(())
//! ```
//!
//! # Invariants
//!
//! * **K1 ownership** — every allocated page records one [`Owner`] (request,
//!   tenant); every access names its owner and another owner is refused
//!   ([`KvError::ForeignOwner`]). A free page has no owner.
//! * **K2 generation** — a page's epoch is odd while allocated, even while
//!   free, and bumped on every allocation and every free (and by two when
//!   the page enters the prefix cache). A [`PageRef`] is
//!   `(index, epoch)`; any access whose epoch differs is refused
//!   ([`KvError::StaleHandle`]) and counted. Epochs are u64 and never wrap.
//! * **K3 written-before-read** — each (page, layer) has a watermark of slots
//!   written in the current epoch; reads of slots at or past it are refused
//!   ([`KvError::UnwrittenRead`]); writes cannot leave gaps.
//! * **K4 deferred release** — a page may be leased to an in-flight transfer;
//!   a free of a leased page is deferred ([`FreeOutcome::Deferred`]) until the
//!   last lease is released. Meanwhile the page stays owned, off the free
//!   list, and unreadable by its owner ([`KvError::ReleasePending`]).
//! * **K5 no double free** — freeing a page twice, or through a stale or
//!   foreign handle, is a detected, counted error.
//! * **K6 integrity** — [`page_checksum`] binds (request, epoch, position,
//!   bytes); [`Pool::verify_checksum`] counts mismatches.
//! * **K7 canary** — each page's 64-byte trailer, *in page memory*, holds
//!   eight copies of [`canary_value`]`(owner, epoch, index)`, written at
//!   allocation and checked by [`Pool::check_canary`]; a stray write over the
//!   end of the KV data, or a page that changed hands, fails it.
//! * **K10 once** — [`Pool::import_page`] accepts a transferred page only if
//!   no slot of it was written in this epoch.
//! * **K11 tenant-scoped reuse** — a page whose every slot was written in
//!   its epoch (K3) may be published to the prefix cache ([`Pool::publish`])
//!   under a key in its owner's [`Scope`]: its epoch moves on (the private
//!   handle goes stale), it becomes read-only (a write or free is refused,
//!   [`KvError::SharedPage`]), readable only by owners of that scope
//!   ([`KvError::ForeignScope`]), and reference-counted ([`Pool::acquire`],
//!   [`Pool::release`]; a release without a reference is refused). At zero
//!   references and no lease it is evictable; [`Pool::alloc`] evicts the
//!   oldest idle pages when the free list is short (epoch bumped, poisoned
//!   — a free by another name), so [`Pool::pages_available`] (free +
//!   evictable) is what admission may count on (K8). `docs/prefix-cache.md`
//!   has the design.
//! * Freed pages are poisoned with 0xFF bytes (NaN in f16 and f32) by
//!   default ([`Poison`]); [`Pool::export_page`] zeroes unwritten slots, so
//!   an earlier owner's bytes never leave the node.
//!
//! # Threads
//!
//! Single owner: one engine thread owns the `Pool`; allocation, free, leases
//! and writes take `&mut self`, reads take `&self`. Transfers never touch the
//! pool from their own threads: they hand bytes to the owning thread, which
//! calls [`Pool::import_page`] / [`Pool::export_page`]. This keeps every
//! check a plain load and compare (no locks or atomics on the read path), and
//! lets the attention kernels read one `&Pool` from several worker threads at
//! once (`Pool: Sync`; refusal counters are relaxed atomics). The borrow
//! checker, not a lock, guarantees no write races a read.
//!
//! # Which test catches which removed check
//!
//! Each check can be switched off in tests ([`Faults`], built only under
//! `cfg(test)` or the `fault-injection` feature). The tests in `src/tests.rs`
//! run each scenario twice, asserting the check catches the fault when on and
//! that the fault goes through (a leak, a corruption) when off:
//!
//! | check removed | test that fails |
//! |---|---|
//! | epoch (K2) | `stale_handle_after_reuse_is_refused` |
//! | owner (K1) | `foreign_tenant_cannot_read_or_write` |
//! | watermark (K3) | `incident_reserved_8_pages_wrote_1_read_8_is_refused` |
//! | lease deferral (K4) | `free_of_leased_page_is_deferred_until_lease_released` |
//! | double free (K5) | `double_free_and_stale_free_are_detected` |
//! | canary (K7) | `stray_write_into_trailer_fails_canary` |
//! | checksum (K6) | `corrupted_transfer_fails_checksum` |
//! | poison | `freed_page_is_poisoned` |
//! | scope (K11) | `cached_page_is_read_only_within_its_scope` |
//! | shared write/free (K11) | `cached_page_cannot_be_written_or_freed` |
//! | publish only written pages (K3) | `only_wholly_written_pages_enter_the_cache` |
//! | reference count (K5) | `references_never_go_negative_or_leak` |
//!
//! The property test `tests/model.rs` runs random alloc / write / read /
//! lease / free / cancel / publish / acquire / release sequences over many
//! requests and tenants against a small reference model (eviction order
//! included) and asserts K1–K5 and K11 after every step; with any one check
//! switched off it finds a failing sequence.

mod integrity;
mod pool;
mod prefix;
mod shape;
#[cfg(test)]
mod tests;

pub use integrity::{canary_value, page_checksum};
#[cfg(any(test, feature = "fault-injection"))]
pub use pool::Faults;
pub use pool::{dequantize_q8_0, quantize_q8_0};
pub use pool::{
    FreeOutcome, LayerView, LeaseOutcome, Poison, Pool, PoolOptions, LEASES_PER_PAGE_MAX,
    POISON_NAN_BYTE, POOL_BYTES_MAX, POOL_PAGES_MAX, REFS_PER_PAGE_MAX,
};
pub use prefix::PrefixKeys;
/// The ids and the pool's counters are part of the request vocabulary.
pub use request::{PoolStats, RequestId, Scope, TenantId};
pub use shape::{
    capacity_tokens, pages_for_budget, tokens_for_budget, DType, KvShape, PAGE_ALIGN_BYTES,
    PAGE_SIZE_MAX_TOKENS, Q8_BLOCK, Q8_BLOCK_BYTES, TRAILER_BYTES,
};

/// The owner of a page: one request of one tenant, in one cache scope.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Owner {
    pub request: RequestId,
    pub tenant: TenantId,
    /// Whose cached pages this request may read (K11); a request's owners
    /// always carry the same scope.
    pub scope: Scope,
}

impl Owner {
    /// The owner of free pages; never a valid owner of an allocation.
    pub const NONE: Owner = Owner {
        request: RequestId(u64::MAX),
        tenant: TenantId(u64::MAX),
        scope: Scope(u64::MAX),
    };

    /// The request id of cached pages' owner ([`Owner::cached`]); never a
    /// request's.
    pub const CACHE_REQUEST: RequestId = RequestId(u64::MAX - 1);

    /// The owner of request `request` of `tenant`, whose serving layer
    /// gave it `cache_scope` (`None`: the tenant's own, [`Scope::of`]).
    /// The one constructor of a request's owner: the engine and the
    /// transfer machines both build theirs here.
    ///
    /// The ids are types, so a tenant cannot be passed as a request:
    ///
    /// ```compile_fail
    /// use kv::{Owner, RequestId, TenantId};
    /// let (request, tenant) = (RequestId(7), TenantId(3));
    /// let _ = Owner::request(tenant, request, None);
    /// ```
    ///
    /// ```
    /// use kv::{Owner, RequestId, Scope, TenantId};
    /// let owner = Owner::request(RequestId(7), TenantId(3), None);
    /// assert_eq!(owner.scope, Scope::tenant(TenantId(3)));
    /// ```
    pub const fn request(
        request: RequestId,
        tenant: TenantId,
        cache_scope: Option<Scope>,
    ) -> Owner {
        Owner {
            request,
            tenant,
            scope: Scope::of(tenant, cache_scope),
        }
    }

    /// A request of `tenant` in the tenant's own cache scope (tests'
    /// shorthand for [`Owner::request`] with no scope).
    pub const fn new(request: RequestId, tenant: TenantId) -> Owner {
        Owner::request(request, tenant, None)
    }

    /// The owner the pool records for a cached page of `scope`: no request
    /// is it, so no request can write or free the page.
    pub const fn cached(scope: Scope) -> Owner {
        Owner {
            request: Owner::CACHE_REQUEST,
            tenant: TenantId(u64::MAX),
            scope,
        }
    }

    /// Whether this is a real request's owner (not free, not the cache).
    pub fn is_request(&self) -> bool {
        self.request != Owner::NONE.request && self.request != Owner::CACHE_REQUEST
    }
}

/// A handle to a page in one epoch. Valid only while the page's epoch
/// equals `epoch` (K2). Plain data: it may cross the wire (the decode node
/// sends its reserved handles to prefill); every use is checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageRef {
    pub index: u32,
    pub epoch: u64,
}

/// Every refusal of the pool. Each is counted in [`PoolStats`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("stale page handle: page {index} is at epoch {page_epoch}, handle has {handle_epoch}")]
    StaleHandle {
        index: u32,
        handle_epoch: u64,
        page_epoch: u64,
    },
    #[error("page {index} belongs to another owner")]
    ForeignOwner { index: u32 },
    #[error("read of {slots} slots of page {index} layer {layer}, only {watermark} written in this epoch")]
    UnwrittenRead {
        index: u32,
        layer: usize,
        slots: usize,
        watermark: usize,
    },
    #[error("double free of page {index}")]
    DoubleFree { index: u32 },
    #[error("page {index} is being released (freed while leased to a transfer)")]
    ReleasePending { index: u32 },
    #[error("page index {index} out of range (pool has {pages} pages)")]
    OutOfRange { index: u32, pages: u32 },
    #[error("layer {layer} out of range (model has {layers} layers)")]
    LayerOutOfRange { layer: usize, layers: usize },
    #[error("write of slot {slot} of page {index} layer {layer} would leave a gap (watermark {watermark})")]
    WriteGap {
        index: u32,
        layer: usize,
        slot: usize,
        watermark: usize,
    },
    #[error("page {index} was already written in this epoch")]
    AlreadyWritten { index: u32 },
    #[error("out of KV pages: {requested} requested, {free} free")]
    OutOfPages { requested: usize, free: usize },
    #[error("page {index} has too many leases")]
    LeaseLimit { index: u32 },
    #[error("page {index} is not leased")]
    NotLeased { index: u32 },
    #[error("canary mismatch on page {index}: page memory was overwritten or changed hands")]
    CanaryMismatch { index: u32 },
    #[error("checksum mismatch on the page at position {position} of the sequence")]
    ChecksumMismatch { position: u32 },
    #[error("row has {got} elements, the pool stores {expected} per token")]
    RowWidth { expected: usize, got: usize },
    #[error("page data has {got} bytes, expected {expected}")]
    PageBytes { expected: usize, got: usize },
    #[error("the reserved owner id cannot own pages")]
    InvalidOwner,
    #[error("page {index} is a cached, shared page: it can be read, acquired and released, never written or freed")]
    SharedPage { index: u32 },
    #[error("page {index} is leased to a transfer: its written slots cannot be rolled back")]
    Leased { index: u32 },
    #[error("page {index} cannot be cached: {why}")]
    NotPublishable { index: u32, why: &'static str },
    #[error("page {index} is cached in another scope")]
    ForeignScope { index: u32 },
    #[error("release of page {index} without a reference")]
    RefUnderflow { index: u32 },
    #[error("page {index} has too many references")]
    RefLimit { index: u32 },
    #[error("invalid KV shape: {why}")]
    InvalidShape { why: String },
    #[error("invalid pool size: {why}")]
    InvalidSize { why: String },
}
