//! Property test: random sequences of alloc / write / read / lease / release
//! / free / cancel / export / import over many requests and tenants, every
//! result checked against a small reference model, and K1–K5 asserted on the
//! pool after every step. Handles used include stale ones (kept forever after
//! a free) and other requests' ones, so every refusal path is exercised.

use std::collections::HashMap;

use kv::{
    DType, FreeOutcome, KvError, KvShape, LayerView, LeaseOutcome, Owner, PageRef, Pool,
    PoolOptions, RequestId, TenantId,
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
        1 => (any::<usize>(), req).prop_map(|(pick, as_req)| Op::Canary { pick, as_req }),
    ]
}

/// Reference model of one page.
#[derive(Clone, Debug, Default)]
struct RefPage {
    epoch: u64,
    owner: Option<u64>,
    watermark: [usize; LAYERS],
    leases: u32,
    pending: bool,
}

#[derive(Default)]
struct Model {
    pages: Vec<RefPage>,
    /// Every handle ever issued, with the request it was issued to.
    issued: Vec<(PageRef, u64)>,
    /// Live handles per request (what a cancel frees).
    live: HashMap<u64, Vec<PageRef>>,
    stale_refusals: u64,
    foreign_refusals: u64,
    unwritten_refusals: u64,
    double_frees: u64,
}

#[derive(Debug, PartialEq)]
enum Kind {
    Ok,
    Stale,
    Foreign,
    Unwritten,
    DoubleFree,
    Pending,
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
        Err(_) => Kind::Other,
    }
}

impl Model {
    /// Expected outcome of the common gate (index, epoch, owner).
    fn gate(&mut self, h: PageRef, req: u64) -> Kind {
        let p = &self.pages[h.index as usize];
        if p.epoch != h.epoch || p.owner.is_none() {
            self.stale_refusals += 1;
            return Kind::Stale;
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

    fn release(&mut self, index: u32) {
        let p = &mut self.pages[index as usize];
        p.epoch += 1;
        p.owner = None;
        p.watermark = [0; LAYERS];
        p.pending = false;
        p.leases = 0;
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
                let free = m.pages.iter().filter(|p| p.owner.is_none()).count();
                prop_assert_eq!(r.is_ok(), n <= free);
                for h in out {
                    let p = &mut m.pages[h.index as usize];
                    prop_assert!(p.owner.is_none(), "allocated an owned page (K1)");
                    p.epoch += 1;
                    prop_assert_eq!(h.epoch, p.epoch, "epoch must bump on alloc (K2)");
                    p.owner = Some(req);
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
                let mut want = m.live_gate(h, as_req);
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
                    // Every value read is this request's own, at this epoch (no leak).
                    for slot in 0..n {
                        let expect = value(as_req, h.epoch, layer, slot);
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
                    m.pages[h.index as usize].leases += 1;
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
                        if freed {
                            m.release(h.index);
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
                    if p.epoch == h.epoch && !p.pending {
                        free_and_check(&mut pool, &mut m, h, req)?;
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
                let mut want = m.live_gate(h, req);
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
        }
        // K1–K5 as state, after every step.
        pool.check_invariants().map_err(TestCaseError::fail)?;
        let s = pool.stats();
        for (i, p) in m.pages.iter().enumerate() {
            prop_assert_eq!(
                pool.owner_of(i as u32),
                p.owner.map(owner),
                "owner of page {}",
                i
            );
            prop_assert_eq!(
                pool.epoch_of(i as u32),
                Some(p.epoch),
                "epoch of page {}",
                i
            );
            prop_assert_eq!(p.epoch % 2 == 1, p.owner.is_some());
        }
        let free = m.pages.iter().filter(|p| p.owner.is_none()).count() as u64;
        prop_assert_eq!(s.pages_free, free);
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
        if p.epoch == h.epoch + 1 && p.owner.is_none() {
            m.double_frees += 1;
            Kind::DoubleFree
        } else {
            m.stale_refusals += 1;
            Kind::Stale
        }
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
