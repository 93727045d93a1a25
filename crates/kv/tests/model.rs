//! Property test: random sequences of alloc / write / read / rewind / lease /
//! release / free / cancel / export / import, and of the prefix cache's publish /
//! lookup / acquire / release and eviction (K11), over many requests and
//! tenants, every result checked against a small reference model, and
//! K1–K5 asserted on the pool after every step. Handles used include stale
//! ones (kept forever after a free) and other requests' ones, so every
//! refusal path is exercised. Requests 0 and 3 share a tenant, hence a cache
//! scope; the others are alone in theirs.

use std::collections::HashMap;

use kv::{
    DType, FreeOutcome, KvError, KvShape, LayerView, LeaseOutcome, Owner, PageRef, Pool,
    PoolOptions, RequestId, Scope, TenantId,
};
use proptest::prelude::*;

const PAGES: u64 = 6;
const REQUESTS: u64 = 5;
const LAYERS: usize = 2;
const SLOTS: usize = 3;
const WIDTH: usize = 16; // 1 kv head × 16: 3 slots × 16 × 4 bytes = 192 bytes (64-aligned)

fn shape() -> KvShape {
    KvShape::new(LAYERS, 1, WIDTH, SLOTS, DType::F32).unwrap()
}

fn owner(req: u64) -> Owner {
    // Three tenants; requests 0 and 3 share tenant 0.
    Owner::new(RequestId(req), TenantId(req % 3))
}

/// The value request `req` writes at (epoch, layer, slot): unique per writer
/// and epoch, exact in f32, so any read returning something else is a leak.
fn value(req: u64, epoch: u64, layer: usize, slot: usize) -> f32 {
    (((epoch % 97) * 8 + req) * 1024 + layer as u64 * 64 + slot as u64) as f32
}

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        req: u64,
        n: usize,
    },
    Write {
        pick: usize,
        as_req: u64,
        layer: usize,
        slot: usize,
    },
    Read {
        pick: usize,
        as_req: u64,
        layer: usize,
        n: usize,
    },
    Lease {
        pick: usize,
    },
    Release {
        pick: usize,
    },
    Free {
        pick: usize,
        as_req: u64,
    },
    Cancel {
        req: u64,
    },
    Export {
        pick: usize,
    },
    Import {
        pick: usize,
        slots: usize,
    },
    Canary {
        pick: usize,
        as_req: u64,
    },
    /// Speculation's rollback: every layer's watermark down to `slots`.
    Rewind {
        pick: usize,
        as_req: u64,
        slots: usize,
    },
    /// Cache the page under `key` in its owner's scope.
    Publish {
        pick: usize,
        key: u64,
    },
    /// Look `key` up in the request's scope and take a reference if found.
    Acquire {
        req: u64,
        key: u64,
    },
    /// Take a reference through any handle (other scopes, stale ones).
    AcquireHandle {
        pick: usize,
        as_req: u64,
    },
    /// Drop a reference through any handle.
    ReleaseRef {
        pick: usize,
        as_req: u64,
    },
}

const KEYS: u64 = 3;

fn scope(req: u64) -> Scope {
    owner(req).scope
}

fn op() -> impl Strategy<Value = Op> {
    let req = 0..REQUESTS;
    prop_oneof![
        3 => (req.clone(), 1..4usize).prop_map(|(req, n)| Op::Alloc { req, n }),
        6 => (any::<usize>(), req.clone(), 0..LAYERS + 1, 0..SLOTS + 1)
            .prop_map(|(pick, as_req, layer, slot)| Op::Write { pick, as_req, layer, slot }),
        6 => (any::<usize>(), req.clone(), 0..LAYERS, 0..SLOTS + 1)
            .prop_map(|(pick, as_req, layer, n)| Op::Read { pick, as_req, layer, n }),
        2 => any::<usize>().prop_map(|pick| Op::Lease { pick }),
        2 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        3 => (any::<usize>(), req.clone()).prop_map(|(pick, as_req)| Op::Free { pick, as_req }),
        1 => req.clone().prop_map(|req| Op::Cancel { req }),
        1 => any::<usize>().prop_map(|pick| Op::Export { pick }),
        1 => (any::<usize>(), 0..SLOTS + 1).prop_map(|(pick, slots)| Op::Import { pick, slots }),
        1 => (any::<usize>(), req.clone()).prop_map(|(pick, as_req)| Op::Canary { pick, as_req }),
        2 => (any::<usize>(), req.clone(), 0..SLOTS + 1)
            .prop_map(|(pick, as_req, slots)| Op::Rewind { pick, as_req, slots }),
        3 => (any::<usize>(), 0..KEYS).prop_map(|(pick, key)| Op::Publish { pick, key }),
        3 => (req.clone(), 0..KEYS).prop_map(|(req, key)| Op::Acquire { req, key }),
        1 => (any::<usize>(), req.clone())
            .prop_map(|(pick, as_req)| Op::AcquireHandle { pick, as_req }),
        3 => (any::<usize>(), req).prop_map(|(pick, as_req)| Op::ReleaseRef { pick, as_req }),
    ]
}

/// Reference model of one page.
#[derive(Clone, Debug, Default)]
struct RefPage {
    epoch: u64,
    /// The owning request (private pages).
    owner: Option<u64>,
    /// (scope, key) of a cached page; it has no owning request.
    cached: Option<(Scope, u64)>,
    refs: u32,
    /// When it last became idle (cached, no reference, no lease).
    idle_since: Option<u64>,
    /// Who wrote its contents, at which epoch (what a read must return).
    content: (u64, u64),
    watermark: [usize; LAYERS],
    leases: u32,
    pending: bool,
}

impl RefPage {
    fn allocated(&self) -> bool {
        self.owner.is_some() || self.cached.is_some()
    }
}

#[derive(Default)]
struct Model {
    pages: Vec<RefPage>,
    /// Every handle ever issued, with the request it was issued to.
    issued: Vec<(PageRef, u64)>,
    /// Live handles per request (what a cancel frees).
    live: HashMap<u64, Vec<PageRef>>,
    /// References taken per request (what a cancel releases).
    held: HashMap<u64, Vec<PageRef>>,
    idle_clock: u64,
    stale_refusals: u64,
    foreign_refusals: u64,
    unwritten_refusals: u64,
    double_frees: u64,
    scope_refusals: u64,
    shared_writes: u64,
    underflows: u64,
    unpublishable: u64,
}

#[derive(Debug, PartialEq)]
enum Kind {
    Ok,
    Stale,
    Foreign,
    Unwritten,
    DoubleFree,
    Pending,
    ForeignScope,
    Shared,
    Underflow,
    Unpublishable,
    Other,
}

fn kind<T>(r: &Result<T, KvError>) -> Kind {
    match r {
        Ok(_) => Kind::Ok,
        Err(KvError::StaleHandle { .. }) => Kind::Stale,
        Err(KvError::ForeignOwner { .. }) => Kind::Foreign,
        Err(KvError::UnwrittenRead { .. }) => Kind::Unwritten,
        Err(KvError::DoubleFree { .. }) => Kind::DoubleFree,
        Err(KvError::ReleasePending { .. }) => Kind::Pending,
        Err(KvError::ForeignScope { .. }) => Kind::ForeignScope,
        Err(KvError::SharedPage { .. }) => Kind::Shared,
        Err(KvError::RefUnderflow { .. }) => Kind::Underflow,
        Err(KvError::NotPublishable { .. }) => Kind::Unpublishable,
        Err(_) => Kind::Other,
    }
}

impl Model {
    /// Expected outcome of the common gate (index, epoch, owner).
    fn gate(&mut self, h: PageRef, req: u64) -> Kind {
        let p = &self.pages[h.index as usize];
        if p.epoch != h.epoch || !p.allocated() {
            self.stale_refusals += 1;
            return Kind::Stale;
        }
        if let Some((s, _)) = p.cached {
            if s != scope(req) {
                self.scope_refusals += 1;
                return Kind::ForeignScope;
            }
            return Kind::Ok;
        }
        if p.owner != Some(req) {
            self.foreign_refusals += 1;
            return Kind::Foreign;
        }
        Kind::Ok
    }

    fn live_gate(&mut self, h: PageRef, req: u64) -> Kind {
        match self.gate(h, req) {
            Kind::Ok if self.pages[h.index as usize].pending => Kind::Pending,
            k => k,
        }
    }

    /// The gate of writes: private pages of `req` only.
    fn write_gate(&mut self, h: PageRef, req: u64) -> Kind {
        match self.live_gate(h, req) {
            Kind::Ok if self.pages[h.index as usize].cached.is_some() => {
                self.shared_writes += 1;
                Kind::Shared
            }
            k => k,
        }
    }

    fn make_idle(&mut self, index: u32) {
        self.idle_clock += 1;
        self.pages[index as usize].idle_since = Some(self.idle_clock);
    }

    fn evictable(&self) -> usize {
        self.pages.iter().filter(|p| p.idle_since.is_some()).count()
    }

    fn release(&mut self, index: u32) {
        let p = &mut self.pages[index as usize];
        p.epoch += 1;
        p.owner = None;
        p.cached = None;
        p.refs = 0;
        p.idle_since = None;
        p.watermark = [0; LAYERS];
        p.pending = false;
        p.leases = 0;
    }

    /// Evicts the idle cached page that became idle first.
    fn evict_oldest(&mut self) {
        let i = (0..self.pages.len())
            .filter(|&i| self.pages[i].idle_since.is_some())
            .min_by_key(|&i| self.pages[i].idle_since)
            .expect("an evictable page");
        self.release(i as u32);
    }

    fn lookup(&self, s: Scope, key: u64) -> Option<PageRef> {
        self.pages
            .iter()
            .enumerate()
            .find(|(_, p)| p.cached == Some((s, key)))
            .map(|(i, p)| PageRef {
                index: i as u32,
                epoch: p.epoch,
            })
    }

    /// Takes a reference on a cached page (`h` checked by the caller).
    fn acquire(&mut self, h: PageRef, req: u64) {
        let p = &mut self.pages[h.index as usize];
        p.refs += 1;
        p.idle_since = None;
        self.held.entry(req).or_default().push(h);
    }
}

fn run(ops: Vec<Op>, faults: Faults) -> Result<(), TestCaseError> {
    let mut pool = Pool::new(shape(), PAGES, PoolOptions::default()).unwrap();
    set_faults(&mut pool, faults);
    let mut m = Model {
        pages: vec![RefPage::default(); PAGES as usize],
        ..Model::default()
    };
    let mut buf = vec![0u8; shape().data_bytes()];
    for op in ops {
        match op {
            Op::Alloc { req, n } => {
                let mut out = Vec::new();
                let r = pool.alloc(owner(req), n, &mut out);
                let free = m.pages.iter().filter(|p| !p.allocated()).count();
                prop_assert_eq!(r.is_ok(), n <= free + m.evictable());
                if r.is_ok() {
                    // Idle cached pages go first when the free list is short,
                    // oldest first.
                    for _ in free..n {
                        m.evict_oldest();
                    }
                }
                for h in out {
                    let p = &mut m.pages[h.index as usize];
                    prop_assert!(!p.allocated(), "allocated an owned or cached page (K1)");
                    p.epoch += 1;
                    prop_assert_eq!(h.epoch, p.epoch, "epoch must bump on alloc (K2)");
                    p.owner = Some(req);
                    p.content = (req, h.epoch);
                    m.issued.push((h, req));
                    m.live.entry(req).or_default().push(h);
                }
            }
            Op::Write {
                pick,
                as_req,
                layer,
                slot,
            } => {
                if m.issued.is_empty() {
                    continue;
                }
                let (h, _) = m.issued[pick % m.issued.len()];
                let epoch = h.epoch;
                let row = vec![value(as_req, epoch, layer, slot); WIDTH];
                let r = pool.write_token(h, owner(as_req), layer, slot, &row, &row);
                let mut want = m.write_gate(h, as_req);
                if want == Kind::Ok {
                    let p = &mut m.pages[h.index as usize];
                    if layer >= LAYERS || slot >= SLOTS || slot > p.watermark[layer] {
                        want = Kind::Other;
                    } else {
                        p.watermark[layer] = p.watermark[layer].max(slot + 1);
                    }
                }
                prop_assert_eq!(kind(&r), want);
            }
            Op::Rewind {
                pick,
                as_req,
                slots,
            } => {
                if m.issued.is_empty() {
                    continue;
                }
                let (h, _) = m.issued[pick % m.issued.len()];
                let r = pool.rewind(h, owner(as_req), slots);
                let mut want = m.write_gate(h, as_req);
                if want == Kind::Ok {
                    let p = &mut m.pages[h.index as usize];
                    if p.leases > 0 {
                        want = Kind::Other;
                    } else {
                        for wm in p.watermark.iter_mut() {
                            *wm = (*wm).min(slots);
                        }
                    }
                }
                prop_assert_eq!(kind(&r), want);
            }
            Op::Read {
                pick,
                as_req,
                layer,
                n,
            } => {
                if m.issued.is_empty() {
                    continue;
                }
                let (h, _) = m.issued[pick % m.issued.len()];
                let r = pool.read_layer(h, owner(as_req), layer, n);
                let mut want = m.live_gate(h, as_req);
                if want == Kind::Ok && n > m.pages[h.index as usize].watermark[layer] {
                    m.unwritten_refusals += 1;
                    want = Kind::Unwritten;
                }
                prop_assert_eq!(kind(&r), want);
                if let Ok(LayerView::F32 { k, v }) = r {
                    // Every value read is what the page's writer wrote in
                    // its epoch — the reader's own, or its scope's cached
                    // page (no leak).
                    let (writer, epoch) = m.pages[h.index as usize].content;
                    for slot in 0..n {
                        let expect = value(writer, epoch, layer, slot);
                        prop_assert_eq!(k[slot * WIDTH], expect, "K leak at slot {}", slot);
                        prop_assert_eq!(v[slot * WIDTH + WIDTH - 1], expect);
                    }
                }
            }
            Op::Lease { pick } => {
                if m.issued.is_empty() {
                    continue;
                }
                let (h, req) = m.issued[pick % m.issued.len()];
                let r = pool.lease(h, owner(req));
                let want = m.live_gate(h, req);
                if want == Kind::Ok {
                    let p = &mut m.pages[h.index as usize];
                    p.leases += 1;
                    p.idle_since = None;
                }
                prop_assert_eq!(kind(&r), want);
            }
            Op::Release { pick } => {
                if m.issued.is_empty() {
                    continue;
                }
                let (h, req) = m.issued[pick % m.issued.len()];
                let r = pool.release_lease(h, owner(req));
                let mut want = m.gate(h, req);
                if want == Kind::Ok {
                    let p = &mut m.pages[h.index as usize];
                    if p.leases == 0 {
                        want = Kind::Other;
                    } else {
                        p.leases -= 1;
                        let freed = p.leases == 0 && p.pending;
                        let idle = p.leases == 0 && p.cached.is_some() && p.refs == 0;
                        if freed {
                            m.release(h.index);
                        } else if idle {
                            m.make_idle(h.index);
                        }
                        prop_assert_eq!(
                            r.clone().ok(),
                            Some(if freed {
                                LeaseOutcome::ReleasedAndFreed
                            } else {
                                LeaseOutcome::Released
                            })
                        );
                    }
                }
                prop_assert_eq!(kind(&r), want);
            }
            Op::Free { pick, as_req } => {
                if m.issued.is_empty() {
                    continue;
                }
                let (h, _) = m.issued[pick % m.issued.len()];
                free_and_check(&mut pool, &mut m, h, as_req)?;
            }
            Op::Cancel { req } => {
                // Cancel frees every live page of the request, leased or not.
                for h in m.live.remove(&req).unwrap_or_default() {
                    let p = &m.pages[h.index as usize];
                    if p.epoch == h.epoch && !p.pending && p.cached.is_none() {
                        free_and_check(&mut pool, &mut m, h, req)?;
                    }
                }
                // ... and drops every reference it holds, deepest first.
                for h in m.held.remove(&req).unwrap_or_default().into_iter().rev() {
                    let p = &m.pages[h.index as usize];
                    if p.epoch == h.epoch && p.refs > 0 {
                        release_and_check(&mut pool, &mut m, h, req)?;
                    }
                }
            }
            Op::Export { pick } => {
                if m.issued.is_empty() {
                    continue;
                }
                let (h, req) = m.issued[pick % m.issued.len()];
                let r = pool.export_page(h, owner(req), &mut buf);
                let want = m.gate(h, req);
                prop_assert_eq!(kind(&r), want);
                if let Ok(slots) = r {
                    let p = &m.pages[h.index as usize];
                    prop_assert_eq!(slots, *p.watermark.iter().min().unwrap());
                }
            }
            Op::Import { pick, slots } => {
                if m.issued.is_empty() {
                    continue;
                }
                let (h, req) = m.issued[pick % m.issued.len()];
                let bytes: Vec<u8> = (0..LAYERS)
                    .flat_map(|layer| {
                        (0..2 * SLOTS).flat_map(move |i| {
                            let slot = i % SLOTS;
                            std::iter::repeat_n(value(req, h.epoch, layer, slot), WIDTH)
                        })
                    })
                    .flat_map(|x| x.to_le_bytes())
                    .collect();
                let r = pool.import_page(h, owner(req), &bytes, slots);
                let mut want = m.write_gate(h, req);
                if want == Kind::Ok {
                    let p = &mut m.pages[h.index as usize];
                    if slots == 0 || p.watermark.iter().any(|&w| w != 0) {
                        want = Kind::Other;
                    } else {
                        p.watermark = [slots; LAYERS];
                    }
                }
                prop_assert_eq!(kind(&r), want);
            }
            Op::Canary { pick, as_req } => {
                if m.issued.is_empty() {
                    continue;
                }
                let (h, _) = m.issued[pick % m.issued.len()];
                let r = pool.check_canary(h, owner(as_req));
                prop_assert_eq!(kind(&r), m.gate(h, as_req));
            }
            Op::Publish { pick, key } => {
                if m.issued.is_empty() {
                    continue;
                }
                let (h, req) = m.issued[pick % m.issued.len()];
                let r = pool.publish(h, owner(req), key);
                let mut want = m.write_gate(h, req);
                if want == Kind::Ok {
                    let p = &m.pages[h.index as usize];
                    if p.leases > 0 || p.watermark.iter().any(|&w| w != SLOTS) {
                        m.unpublishable += 1;
                        want = Kind::Unpublishable;
                    } else if m.lookup(scope(req), key).is_some() {
                        prop_assert_eq!(r.clone().ok(), Some(None), "a key is cached once");
                    } else {
                        let p = &mut m.pages[h.index as usize];
                        p.epoch += 2;
                        p.owner = None;
                        p.cached = Some((scope(req), key));
                        p.refs = 1;
                        let c = PageRef {
                            index: h.index,
                            epoch: p.epoch,
                        };
                        prop_assert_eq!(r.clone().ok(), Some(Some(c)));
                        m.issued.push((c, req));
                        m.held.entry(req).or_default().push(c);
                    }
                }
                prop_assert_eq!(kind(&r), want);
            }
            Op::Acquire { req, key } => {
                let found = pool.lookup(scope(req), key);
                prop_assert_eq!(found, m.lookup(scope(req), key));
                if let Some(h) = found {
                    let r = pool.acquire(h, owner(req));
                    prop_assert_eq!(kind(&r), Kind::Ok);
                    m.acquire(h, req);
                    m.issued.push((h, req));
                }
            }
            Op::AcquireHandle { pick, as_req } => {
                if m.issued.is_empty() {
                    continue;
                }
                let (h, _) = m.issued[pick % m.issued.len()];
                let r = pool.acquire(h, owner(as_req));
                let mut want = m.live_gate(h, as_req);
                if want == Kind::Ok {
                    if m.pages[h.index as usize].cached.is_some() {
                        m.acquire(h, as_req);
                    } else {
                        want = Kind::Unpublishable;
                    }
                }
                prop_assert_eq!(kind(&r), want);
            }
            Op::ReleaseRef { pick, as_req } => {
                if m.issued.is_empty() {
                    continue;
                }
                let (h, _) = m.issued[pick % m.issued.len()];
                release_and_check(&mut pool, &mut m, h, as_req)?;
            }
        }
        // K1–K5 as state, after every step.
        pool.check_invariants().map_err(TestCaseError::fail)?;
        let s = pool.stats();
        for (i, p) in m.pages.iter().enumerate() {
            prop_assert_eq!(
                pool.owner_of(i as u32),
                match p.cached {
                    Some((s, _)) => Some(Owner::cached(s)),
                    None => p.owner.map(owner),
                },
                "owner of page {}",
                i
            );
            prop_assert_eq!(
                pool.epoch_of(i as u32),
                Some(p.epoch),
                "epoch of page {}",
                i
            );
            prop_assert_eq!(p.epoch % 2 == 1, p.allocated());
        }
        let free = m.pages.iter().filter(|p| !p.allocated()).count() as u64;
        prop_assert_eq!(s.pages_free, free);
        prop_assert_eq!(
            s.pages_cached,
            m.pages.iter().filter(|p| p.cached.is_some()).count() as u64
        );
        prop_assert_eq!(s.pages_evictable, m.evictable() as u64);
        prop_assert_eq!(s.refused_foreign_scope, m.scope_refusals);
        prop_assert_eq!(s.refused_shared_write, m.shared_writes);
        prop_assert_eq!(s.refused_ref_underflow, m.underflows);
        prop_assert_eq!(s.refused_unpublishable, m.unpublishable);
        prop_assert_eq!(
            s.pages_leased,
            m.pages.iter().filter(|p| p.leases > 0).count() as u64
        );
        prop_assert_eq!(
            s.pages_release_pending,
            m.pages.iter().filter(|p| p.pending).count() as u64
        );
        prop_assert_eq!(s.refused_stale_handle, m.stale_refusals);
        prop_assert_eq!(s.refused_foreign_owner, m.foreign_refusals);
        prop_assert_eq!(s.refused_unwritten_read, m.unwritten_refusals);
        prop_assert_eq!(s.refused_double_free, m.double_frees);
        prop_assert_eq!(s.canary_mismatch, 0, "no stray writes happen here");
    }
    Ok(())
}

fn free_and_check(
    pool: &mut Pool,
    m: &mut Model,
    h: PageRef,
    as_req: u64,
) -> Result<(), TestCaseError> {
    let r = pool.free(h, owner(as_req));
    let p = m.pages[h.index as usize].clone();
    let want = if p.epoch != h.epoch {
        if p.epoch == h.epoch + 1 && !p.allocated() {
            m.double_frees += 1;
            Kind::DoubleFree
        } else {
            m.stale_refusals += 1;
            Kind::Stale
        }
    } else if p.cached.is_some() {
        m.shared_writes += 1;
        Kind::Shared
    } else if p.owner != Some(as_req) {
        m.foreign_refusals += 1;
        Kind::Foreign
    } else if p.pending {
        m.double_frees += 1;
        Kind::DoubleFree
    } else if p.leases > 0 {
        m.pages[h.index as usize].pending = true;
        prop_assert_eq!(r.clone().ok(), Some(FreeOutcome::Deferred));
        Kind::Ok
    } else {
        m.release(h.index);
        prop_assert_eq!(r.clone().ok(), Some(FreeOutcome::Freed));
        Kind::Ok
    };
    prop_assert_eq!(kind(&r), want);
    Ok(())
}

fn release_and_check(
    pool: &mut Pool,
    m: &mut Model,
    h: PageRef,
    as_req: u64,
) -> Result<(), TestCaseError> {
    let r = pool.release(h, owner(as_req));
    let mut want = m.gate(h, as_req);
    if want == Kind::Ok {
        let p = &mut m.pages[h.index as usize];
        if p.cached.is_none() {
            want = Kind::Unpublishable;
        } else if p.refs == 0 {
            m.underflows += 1;
            want = Kind::Underflow;
        } else {
            p.refs -= 1;
            if p.refs == 0 && p.leases == 0 {
                m.make_idle(h.index);
            }
            if let Some(v) = m.held.get_mut(&as_req) {
                if let Some(at) = v.iter().position(|&x| x == h) {
                    v.remove(at);
                }
            }
        }
    }
    prop_assert_eq!(kind(&r), want);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, max_shrink_iters: 2000, ..ProptestConfig::default() })]

    #[test]
    fn pool_matches_reference_model(ops in proptest::collection::vec(op(), 1..200)) {
        run(ops, no_faults())?;
    }
}

#[cfg(feature = "fault-injection")]
type Faults = kv::Faults;
#[cfg(feature = "fault-injection")]
fn set_faults(pool: &mut Pool, faults: Faults) {
    pool.set_faults(faults);
}
#[cfg(not(feature = "fault-injection"))]
#[derive(Default)]
struct Faults;
#[cfg(not(feature = "fault-injection"))]
fn set_faults(_: &mut Pool, _: Faults) {}

/// The property test has teeth: with any one check switched off, it finds a
/// failing sequence. (`cargo test -p kv --features fault-injection`, which
/// scripts/test runs.)
#[cfg(feature = "fault-injection")]
#[test]
fn property_test_finds_each_removed_check() {
    let all = [
        Faults {
            skip_epoch_check: true,
            ..Faults::default()
        },
        Faults {
            skip_owner_check: true,
            ..Faults::default()
        },
        Faults {
            skip_watermark_check: true,
            ..Faults::default()
        },
        Faults {
            skip_lease_deferral: true,
            ..Faults::default()
        },
        Faults {
            skip_double_free_check: true,
            ..Faults::default()
        },
        Faults {
            skip_scope_check: true,
            ..Faults::default()
        },
        Faults {
            skip_shared_write_check: true,
            ..Faults::default()
        },
        Faults {
            skip_publish_check: true,
            ..Faults::default()
        },
        Faults {
            skip_refcount_check: true,
            ..Faults::default()
        },
        Faults {
            skip_rewind: true,
            ..Faults::default()
        },
    ];
    for faults in all {
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: 2048,
            failure_persistence: None,
            ..ProptestConfig::default()
        });
        let result = runner.run(&proptest::collection::vec(op(), 1..200), |ops| {
            run(ops, faults)
        });
        assert!(result.is_err(), "property test missed {faults:?}");
    }
}

/// All pages free when every request ended, whatever happened before.
#[test]
fn everything_free_after_all_requests_end() {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 128,
        ..ProptestConfig::default()
    });
    runner
        .run(&proptest::collection::vec(op(), 1..150), |ops| {
            let mut pool = Pool::new(shape(), PAGES, PoolOptions::default()).unwrap();
            let mut live: Vec<(PageRef, u64)> = Vec::new();
            // References taken (publish, acquire), per request.
            let mut refs: Vec<(PageRef, u64)> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc { req, n } => {
                        let mut out = Vec::new();
                        if pool.alloc(owner(req), n, &mut out).is_ok() {
                            live.extend(out.into_iter().map(|h| (h, req)));
                        }
                    }
                    Op::Lease { pick } if !live.is_empty() => {
                        let (h, req) = live[pick % live.len()];
                        let _ = pool.lease(h, owner(req));
                    }
                    Op::Write { pick, layer, .. } if !live.is_empty() => {
                        // Fill a whole layer of a page (so some can be cached).
                        let (h, req) = live[pick % live.len()];
                        let row = [1.0f32; WIDTH];
                        for slot in 0..SLOTS {
                            let _ =
                                pool.write_token(h, owner(req), layer % LAYERS, slot, &row, &row);
                        }
                    }
                    Op::Publish { pick, key } if !live.is_empty() => {
                        let (h, req) = live[pick % live.len()];
                        if let Ok(Some(c)) = pool.publish(h, owner(req), key) {
                            refs.push((c, req));
                        }
                    }
                    Op::Acquire { req, key } => {
                        if let Some(c) = pool.lookup(scope(req), key) {
                            if pool.acquire(c, owner(req)).is_ok() {
                                refs.push((c, req));
                            }
                        }
                    }
                    _ => {}
                }
            }
            // End: every request frees its pages, every transfer drops its leases.
            for &(h, req) in &live {
                let _ = pool.free(h, owner(req));
            }
            for &(h, req) in &live {
                while pool.release_lease(h, owner(req)).is_ok() {}
            }
            for &(h, req) in refs.iter().rev() {
                pool.release(h, owner(req))
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            // Cached pages stay, idle: all of them available, none held.
            prop_assert_eq!(pool.pages_available() as u64, PAGES);
            prop_assert_eq!(pool.pages_evictable(), pool.pages_cached());
            pool.check_invariants().map_err(TestCaseError::fail)?;
            pool.evict_idle();
            prop_assert_eq!(pool.pages_free() as u64, PAGES);
            prop_assert_eq!(pool.stats().pages_leased, 0);
            pool.check_invariants().map_err(TestCaseError::fail)?;
            Ok(())
        })
        .unwrap();
}

/// Every check on (the build without fault injection has no switches).
fn no_faults() -> Faults {
    #[cfg(feature = "fault-injection")]
    {
        Faults::default()
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        Faults
    }
}
