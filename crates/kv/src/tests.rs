//! One test per safety check. Each scenario returns `Err(what went wrong)`
//! when the check failed to hold; the plain test asserts `Ok`, and its
//! `*_fails_without_the_check` twin switches the check off with [`Faults`]
//! and asserts the very same scenario reports the failure — so removing the
//! check is caught.

use crate::*;

const ALICE: Owner = Owner::new(RequestId(1), TenantId(10));
const BOB: Owner = Owner::new(RequestId(2), TenantId(20));

fn shape() -> KvShape {
    // 2 layers, 2 kv heads × 8 dims, 4 slots per page, f32.
    KvShape::new(2, 2, 8, 4, DType::F32).unwrap()
}

fn pool(faults: Faults) -> Pool {
    let mut p = Pool::new(shape(), 8, PoolOptions::default()).unwrap();
    p.set_faults(faults);
    p
}

fn row(v: f32) -> Vec<f32> {
    vec![v; shape().token_width()]
}

fn alloc(p: &mut Pool, o: Owner, n: usize) -> Vec<PageRef> {
    let mut v = Vec::new();
    p.alloc(o, n, &mut v).unwrap();
    v
}

fn fill_page(p: &mut Pool, h: PageRef, o: Owner, value: f32, slots: usize) {
    for layer in 0..shape().layers {
        for s in 0..slots {
            p.write_token(h, o, layer, s, &row(value), &row(value))
                .unwrap();
        }
    }
}

fn k_values(view: LayerView<'_>) -> Vec<f32> {
    match view {
        LayerView::F32 { k, .. } => k.to_vec(),
        LayerView::F16 { k, .. } => k.iter().map(|x| x.to_f32()).collect(),
        LayerView::Q8_0 { k, .. } => dequant(k),
    }
}

fn dequant(bytes: &[u8]) -> Vec<f32> {
    let mut out = vec![0.0; bytes.len() / Q8_BLOCK_BYTES * Q8_BLOCK];
    for (b, o) in bytes
        .chunks_exact(Q8_BLOCK_BYTES)
        .zip(out.chunks_exact_mut(Q8_BLOCK))
    {
        dequantize_q8_0(b, o);
    }
    out
}

fn check(ok: bool, what: &str) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(what.to_string())
    }
}

// --------------------------------------------------------------- K3 incident

/// The incident: decode reserved 8 pages, the transfer wrote 1, decode read
/// all 8 and got seven pages of earlier requests' KV.
fn scenario_incident(faults: Faults) -> Result<(), String> {
    let mut p = pool(faults);
    // Earlier tenant fills all 8 pages with its secret KV, then finishes.
    let old = alloc(&mut p, BOB, 8);
    for &h in &old {
        fill_page(&mut p, h, BOB, 42.0, 4);
    }
    for &h in &old {
        p.free(h, BOB).unwrap();
    }
    // Poison off in this scenario to model the incident's "never zeroed".
    let mut p2 = Pool::new(
        shape(),
        8,
        PoolOptions {
            poison: Poison::Off,
        },
    )
    .unwrap();
    p2.set_faults(faults);
    let old = alloc(&mut p2, BOB, 8);
    for &h in &old {
        fill_page(&mut p2, h, BOB, 42.0, 4);
        p2.free(h, BOB).unwrap();
    }
    for pool in [&mut p, &mut p2] {
        let pages = alloc(pool, ALICE, 8);
        fill_page(pool, pages[0], ALICE, 1.0, 4); // only page 0 written
        let mut leaked = false;
        for &h in &pages {
            match pool.read_layer(h, ALICE, 0, 4) {
                Ok(view) => leaked |= k_values(view).iter().any(|&x| x == 42.0 || x.is_nan()),
                Err(KvError::UnwrittenRead { .. }) => {}
                Err(e) => return Err(format!("unexpected error {e}")),
            }
        }
        check(!leaked, "decode read another tenant's (or poisoned) KV")?;
        check(
            pool.stats().refused_unwritten_read == 7,
            "seven unwritten pages not refused",
        )?;
    }
    Ok(())
}

#[test]
fn incident_reserved_8_pages_wrote_1_read_8_is_refused() {
    scenario_incident(Faults::default()).unwrap();
}

#[test]
fn incident_fails_without_the_check() {
    let f = Faults {
        skip_watermark_check: true,
        ..Faults::default()
    };
    assert!(scenario_incident(f).is_err());
}

// ------------------------------------------------------------------------ K2

fn scenario_stale(faults: Faults) -> Result<(), String> {
    let mut p = pool(faults);
    let old = alloc(&mut p, ALICE, 1)[0];
    fill_page(&mut p, old, ALICE, 1.0, 4);
    p.free(old, ALICE).unwrap();
    // Same request id reallocates (e.g. recompute after preemption): the
    // page comes back, with a new epoch. The old handle must stay dead.
    let new = alloc(&mut p, ALICE, 1)[0];
    check(new.index == old.index, "LIFO reuse expected")?;
    check(
        new.epoch == old.epoch + 2,
        "epoch must bump on free and alloc",
    )?;
    fill_page(&mut p, new, ALICE, 2.0, 4);
    let read = p.read_layer(old, ALICE, 0, 4);
    check(
        matches!(read, Err(KvError::StaleHandle { .. })),
        "stale read served",
    )?;
    let write = p.write_token(old, ALICE, 0, 0, &row(9.0), &row(9.0));
    check(
        matches!(write, Err(KvError::StaleHandle { .. })),
        "stale write accepted",
    )?;
    let now = k_values(p.read_layer(new, ALICE, 0, 4).unwrap());
    check(
        now.iter().all(|&x| x == 2.0),
        "late write through stale handle landed",
    )?;
    check(
        p.stats().refused_stale_handle == 2,
        "stale accesses not counted",
    )
}

#[test]
fn stale_handle_after_reuse_is_refused() {
    scenario_stale(Faults::default()).unwrap();
}

#[test]
fn stale_handle_fails_without_the_check() {
    let f = Faults {
        skip_epoch_check: true,
        ..Faults::default()
    };
    assert!(scenario_stale(f).is_err());
}

// ------------------------------------------------------------------------ K1

fn scenario_foreign(faults: Faults) -> Result<(), String> {
    let mut p = pool(faults);
    let a = alloc(&mut p, ALICE, 1)[0];
    fill_page(&mut p, a, ALICE, 7.0, 4);
    let read = p.read_layer(a, BOB, 0, 4);
    check(
        matches!(read, Err(KvError::ForeignOwner { .. })),
        "foreign read served",
    )?;
    let write = p.write_token(a, BOB, 0, 0, &row(9.0), &row(9.0));
    check(
        matches!(write, Err(KvError::ForeignOwner { .. })),
        "foreign write accepted",
    )?;
    // Same tenant, other request: still foreign (pages are per request).
    let sibling = Owner::new(RequestId(3), ALICE.tenant);
    check(
        p.read_layer(a, sibling, 0, 1).is_err(),
        "sibling request read served",
    )?;
    let free = p.free(a, BOB);
    check(
        matches!(free, Err(KvError::ForeignOwner { .. })),
        "foreign free accepted",
    )?;
    check(
        p.stats().refused_foreign_owner == 4,
        "foreign accesses not counted",
    )
}

#[test]
fn foreign_tenant_cannot_read_or_write() {
    scenario_foreign(Faults::default()).unwrap();
}

#[test]
fn foreign_owner_fails_without_the_check() {
    let f = Faults {
        skip_owner_check: true,
        ..Faults::default()
    };
    assert!(scenario_foreign(f).is_err());
}

// ------------------------------------------------------------------------ K4

fn scenario_lease(faults: Faults) -> Result<(), String> {
    let mut p = pool(faults);
    let h = alloc(&mut p, ALICE, 1)[0];
    fill_page(&mut p, h, ALICE, 3.0, 2);
    p.lease(h, ALICE).map_err(|e| e.to_string())?;
    // The request is cancelled while the transfer still holds the page.
    let outcome = p.free(h, ALICE).map_err(|e| e.to_string())?;
    check(
        outcome == FreeOutcome::Deferred,
        "free of a leased page not deferred",
    )?;
    check(
        p.pages_free() == 7,
        "leased page went back to the free list",
    )?;
    // Nobody else may get it meanwhile.
    let mut got = Vec::new();
    p.alloc(BOB, 7, &mut got).map_err(|e| e.to_string())?;
    check(
        !got.iter().any(|g| g.index == h.index),
        "leased page handed to Bob",
    )?;
    // The owner cannot read it any more; the transfer can still export it.
    check(
        matches!(
            p.read_layer(h, ALICE, 0, 1),
            Err(KvError::ReleasePending { .. })
        ),
        "owner read a page pending release",
    )?;
    let mut buf = vec![0u8; shape().data_bytes()];
    check(
        p.export_page(h, ALICE, &mut buf).is_ok(),
        "lease holder could not export",
    )?;
    let s = p.stats();
    check(
        s.pages_leased == 1 && s.pages_release_pending == 1,
        "occupancy wrong",
    )?;
    let done = p.release_lease(h, ALICE).map_err(|e| e.to_string())?;
    check(
        done == LeaseOutcome::ReleasedAndFreed,
        "last lease did not free",
    )?;
    check(p.pages_free() == 1, "page not freed after the last lease")?;
    p.check_invariants()
}

#[test]
fn free_of_leased_page_is_deferred_until_lease_released() {
    scenario_lease(Faults::default()).unwrap();
}

#[test]
fn lease_deferral_fails_without_the_check() {
    let f = Faults {
        skip_lease_deferral: true,
        ..Faults::default()
    };
    assert!(scenario_lease(f).is_err());
}

// ------------------------------------------------------------------------ K5

fn scenario_double_free(faults: Faults) -> Result<(), String> {
    let mut p = pool(faults);
    let h = alloc(&mut p, ALICE, 1)[0];
    p.free(h, ALICE).map_err(|e| e.to_string())?;
    check(
        matches!(p.free(h, ALICE), Err(KvError::DoubleFree { .. })),
        "double free not detected",
    )?;
    // Reallocated to the same request: the old handle must not free it.
    let again = alloc(&mut p, ALICE, 1)[0];
    check(again.index == h.index, "LIFO reuse expected")?;
    check(
        matches!(p.free(h, ALICE), Err(KvError::StaleHandle { .. })),
        "stale free not detected",
    )?;
    check(
        p.owner_of(h.index) == Some(ALICE),
        "stale free freed the new allocation",
    )?;
    // A free while a deferred free is pending is a double free too.
    p.lease(again, ALICE).map_err(|e| e.to_string())?;
    p.free(again, ALICE).map_err(|e| e.to_string())?;
    check(
        matches!(p.free(again, ALICE), Err(KvError::DoubleFree { .. })),
        "double deferred free not detected",
    )?;
    let s = p.stats();
    check(
        s.refused_double_free == 2 && s.refused_stale_handle == 1,
        "not counted",
    )
}

#[test]
fn double_free_and_stale_free_are_detected() {
    scenario_double_free(Faults::default()).unwrap();
}

#[test]
fn double_free_fails_without_the_check() {
    let f = Faults {
        skip_double_free_check: true,
        ..Faults::default()
    };
    assert!(scenario_double_free(f).is_err());
}

// ------------------------------------------------------------------------ K7

fn scenario_canary(faults: Faults) -> Result<(), String> {
    let mut p = pool(faults);
    let h = alloc(&mut p, ALICE, 2);
    check(p.check_canary(h[0], ALICE).is_ok(), "fresh canary bad")?;
    // A stray write one byte past the KV data of page 0 (an overrun).
    let data = shape().data_bytes();
    p.page_mut(h[0].index)[data + 13] ^= 0x01;
    check(
        matches!(
            p.check_canary(h[0], ALICE),
            Err(KvError::CanaryMismatch { .. })
        ),
        "stray write into the trailer not caught",
    )?;
    check(p.check_canary(h[1], ALICE).is_ok(), "neighbour canary bad")?;
    check(
        p.stats().canary_mismatch == 1,
        "canary mismatch not counted",
    )
}

#[test]
fn stray_write_into_trailer_fails_canary() {
    scenario_canary(Faults::default()).unwrap();
}

#[test]
fn canary_fails_without_the_check() {
    let f = Faults {
        skip_canary_check: true,
        ..Faults::default()
    };
    assert!(scenario_canary(f).is_err());
}

#[test]
fn canary_changes_with_owner_and_epoch() {
    let mut p = pool(Faults::default());
    let h = alloc(&mut p, ALICE, 1)[0];
    p.free(h, ALICE).unwrap();
    let h2 = alloc(&mut p, BOB, 1)[0];
    assert_eq!(h.index, h2.index);
    assert!(p.check_canary(h2, BOB).is_ok());
    // Bob's canary at the new epoch is not Alice's at the old one.
    assert_ne!(
        canary_value(ALICE, h.epoch, h.index),
        canary_value(BOB, h2.epoch, h2.index)
    );
}

// ------------------------------------------------------------------------ K6

fn scenario_checksum(faults: Faults) -> Result<(), String> {
    let mut src = pool(faults);
    let mut dst = pool(faults);
    let h = alloc(&mut src, ALICE, 1)[0];
    fill_page(&mut src, h, ALICE, 5.0, 3);
    let mut bytes = vec![0u8; shape().data_bytes()];
    let slots = src
        .export_page(h, ALICE, &mut bytes)
        .map_err(|e| e.to_string())?;
    check(slots == 3, "export slot count")?;
    let d = alloc(&mut dst, BOB, 1)[0];
    let sum = page_checksum(BOB.request, d.epoch, 0, &bytes);
    // Clean transfer verifies.
    check(
        dst.verify_checksum(BOB.request, d.epoch, 0, &bytes, sum)
            .is_ok(),
        "clean",
    )?;
    // One bit flipped on the wire.
    bytes[100] ^= 0x10;
    let bad = dst.verify_checksum(BOB.request, d.epoch, 0, &bytes, sum);
    check(
        matches!(bad, Err(KvError::ChecksumMismatch { .. })),
        "corruption missed",
    )?;
    bytes[100] ^= 0x10;
    // Right bytes, wrong position in the sequence (pages swapped).
    let swapped = dst.verify_checksum(BOB.request, d.epoch, 1, &bytes, sum);
    check(swapped.is_err(), "page at wrong position accepted")?;
    check(dst.stats().checksum_mismatch == 2, "mismatches not counted")
}

#[test]
fn corrupted_transfer_fails_checksum() {
    scenario_checksum(Faults::default()).unwrap();
}

#[test]
fn checksum_fails_without_the_check() {
    let f = Faults {
        skip_checksum_check: true,
        ..Faults::default()
    };
    assert!(scenario_checksum(f).is_err());
}

// -------------------------------------------------------------------- poison

fn scenario_poison(faults: Faults) -> Result<(), String> {
    let mut p = pool(faults);
    let h = alloc(&mut p, ALICE, 1)[0];
    fill_page(&mut p, h, ALICE, 42.0, 4);
    p.free(h, ALICE).map_err(|e| e.to_string())?;
    let page = p.page(h.index);
    check(
        page.iter().all(|&b| b == POISON_NAN_BYTE),
        "freed page still holds its bytes",
    )
}

#[test]
fn freed_page_is_poisoned() {
    scenario_poison(Faults::default()).unwrap();
}

#[test]
fn poison_fails_without_the_check() {
    let f = Faults {
        skip_poison: true,
        ..Faults::default()
    };
    assert!(scenario_poison(f).is_err());
}

// --------------------------------------------------------------- K10, misc

#[test]
fn import_writes_a_page_exactly_once() {
    let mut p = pool(Faults::default());
    let h = alloc(&mut p, ALICE, 1)[0];
    let bytes = vec![0u8; shape().data_bytes()];
    p.import_page(h, ALICE, &bytes, 4).unwrap();
    assert_eq!(p.written_slots(h, ALICE).unwrap(), 4);
    assert!(matches!(
        p.import_page(h, ALICE, &bytes, 4),
        Err(KvError::AlreadyWritten { .. })
    ));
    assert_eq!(p.stats().refused_already_written, 1);
    assert!(p.import_page(h, ALICE, &bytes[1..], 4).is_err());
}

#[test]
fn export_never_carries_an_earlier_owners_bytes() {
    let mut p = Pool::new(
        shape(),
        1,
        PoolOptions {
            poison: Poison::Off,
        },
    )
    .unwrap();
    let h = alloc(&mut p, BOB, 1)[0];
    fill_page(&mut p, h, BOB, 42.0, 4);
    p.free(h, BOB).unwrap();
    let h = alloc(&mut p, ALICE, 1)[0];
    fill_page(&mut p, h, ALICE, 1.0, 1);
    let mut out = vec![0xAAu8; shape().data_bytes()];
    assert_eq!(p.export_page(h, ALICE, &mut out).unwrap(), 1);
    let floats: Vec<f32> = out
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert!(floats.iter().all(|&x| x == 1.0 || x == 0.0));
    assert!(!floats.contains(&42.0));
}

#[test]
fn writes_cannot_leave_gaps_and_out_of_range_is_refused() {
    let mut p = pool(Faults::default());
    let h = alloc(&mut p, ALICE, 1)[0];
    assert!(matches!(
        p.write_token(h, ALICE, 0, 1, &row(1.0), &row(1.0)),
        Err(KvError::WriteGap { .. })
    ));
    assert!(matches!(
        p.write_token(h, ALICE, 9, 0, &row(1.0), &row(1.0)),
        Err(KvError::LayerOutOfRange { .. })
    ));
    assert!(matches!(
        p.write_token(h, ALICE, 0, 0, &row(1.0)[1..], &row(1.0)),
        Err(KvError::RowWidth { .. })
    ));
    let bogus = PageRef {
        index: 999,
        epoch: 1,
    };
    assert!(matches!(
        p.read_layer(bogus, ALICE, 0, 0),
        Err(KvError::OutOfRange { .. })
    ));
    // Rewriting a written slot is allowed (own data), appending too.
    p.write_token(h, ALICE, 0, 0, &row(1.0), &row(1.0)).unwrap();
    p.write_token(h, ALICE, 0, 0, &row(2.0), &row(2.0)).unwrap();
    p.write_token(h, ALICE, 0, 1, &row(3.0), &row(3.0)).unwrap();
    assert_eq!(p.watermark(h, ALICE, 0).unwrap(), 2);
    assert_eq!(p.watermark(h, ALICE, 1).unwrap(), 0);
    assert_eq!(k_values(p.read_layer(h, ALICE, 0, 2).unwrap())[..1], [2.0]);
}

#[test]
fn alloc_is_all_or_nothing() {
    let mut p = pool(Faults::default());
    let _a = alloc(&mut p, ALICE, 6);
    let mut out = Vec::new();
    assert!(matches!(
        p.alloc(BOB, 3, &mut out),
        Err(KvError::OutOfPages {
            requested: 3,
            free: 2
        })
    ));
    assert!(out.is_empty());
    assert_eq!(p.pages_free(), 2);
    assert!(matches!(
        p.alloc(Owner::NONE, 1, &mut out),
        Err(KvError::InvalidOwner)
    ));
    p.check_invariants().unwrap();
}

#[test]
fn f16_pool_round_trips_rows() {
    let shape = KvShape::new(1, 2, 16, 2, DType::F16).unwrap();
    let mut p = Pool::new(shape, 2, PoolOptions::default()).unwrap();
    let h = alloc(&mut p, ALICE, 1)[0];
    let k: Vec<f32> = (0..32).map(|i| i as f32 * 0.5).collect();
    let v: Vec<f32> = (0..32).map(|i| -(i as f32)).collect();
    p.write_token(h, ALICE, 0, 0, &k, &v).unwrap();
    match p.read_layer(h, ALICE, 0, 1).unwrap() {
        LayerView::F16 { k: gk, v: gv } => {
            assert_eq!(gk.iter().map(|x| x.to_f32()).collect::<Vec<_>>(), k);
            assert_eq!(gv.iter().map(|x| x.to_f32()).collect::<Vec<_>>(), v);
        }
        _ => panic!("wrong dtype"),
    }
}

/// `q8_0` as GGML writes it: scale max|x|/127 in f16, then round half away
/// from zero. Pinned on a block whose values are exact in the format.
#[test]
fn q8_0_blocks_are_ggml_blocks() {
    let mut x = [0.0f32; Q8_BLOCK];
    x[0] = 127.0;
    x[1] = -63.5; // half: rounds away from zero, to -64
    x[2] = 0.49;
    x[3] = -127.0;
    let mut b = [0u8; Q8_BLOCK_BYTES];
    quantize_q8_0(&x, &mut b);
    assert_eq!(&b[..2], &half::f16::from_f32(1.0).to_le_bytes());
    assert_eq!(&b[2..6], &[127, (-64i8) as u8, 0, (-127i8) as u8]);
    assert!(b[6..].iter().all(|&q| q == 0));
    let mut y = [1.0f32; Q8_BLOCK];
    quantize_q8_0(&[0.0; Q8_BLOCK], &mut b);
    dequantize_q8_0(&b, &mut y);
    assert!(
        y.iter().all(|&v| v == 0.0),
        "an all-zero block reads as zeros"
    );
    // A non-finite input poisons its block instead of reading as numbers.
    x[5] = f32::INFINITY;
    quantize_q8_0(&x, &mut b);
    dequantize_q8_0(&b, &mut y);
    assert!(y.iter().all(|v| v.is_nan()));
}

#[test]
fn q8_0_pool_round_trips_rows_within_half_a_step() {
    // 3 slots × 34 bytes = 102 bytes a half: padded to 128.
    let shape = KvShape::new(2, 2, 32, 3, DType::Q8_0).unwrap();
    let mut p = Pool::new(shape, 2, PoolOptions::default()).unwrap();
    let h = alloc(&mut p, ALICE, 1)[0];
    let k: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    let v: Vec<f32> = (0..64).map(|i| (i as f32 * 0.11).cos() - 0.5).collect();
    for slot in 0..3 {
        p.write_token(h, ALICE, 1, slot, &k, &v).unwrap();
    }
    let view = p.read_layer(h, ALICE, 1, 3).unwrap();
    assert_eq!(view.slots(shape.token_width()), 3);
    let LayerView::Q8_0 { k: gk, v: gv } = view else {
        panic!("wrong dtype")
    };
    for (got, want) in [(dequant(gk), &k), (dequant(gv), &v)] {
        assert_eq!(got.len(), 3 * 64);
        for (blk, w) in got.chunks(32).zip(want.chunks(32).cycle()) {
            let amax = w.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            for (a, b) in blk.iter().zip(w) {
                // Half a quantisation step, plus the scale's f16 rounding.
                assert!(
                    (a - b).abs() <= amax / 254.0 * 1.01 + amax * 1e-3,
                    "{a} vs {b}"
                );
            }
        }
    }
    // Freed and poisoned: every block's scale is NaN, so every value is.
    p.free(h, ALICE).unwrap();
    let bytes = p.page(h.index)[..shape.data_bytes()].to_vec();
    assert!(dequant(&bytes[..102]).iter().all(|x| x.is_nan()));
}

#[test]
fn q8_0_export_zeroes_the_padding_and_an_earlier_owners_slots() {
    let shape = KvShape::new(1, 1, 32, 3, DType::Q8_0).unwrap();
    let mut p = Pool::new(
        shape,
        1,
        PoolOptions {
            poison: Poison::Off,
        },
    )
    .unwrap();
    let h = alloc(&mut p, BOB, 1)[0];
    for slot in 0..3 {
        p.write_token(h, BOB, 0, slot, &[42.0; 32], &[42.0; 32])
            .unwrap();
    }
    p.free(h, BOB).unwrap();
    let h = alloc(&mut p, ALICE, 1)[0];
    // 127: exact in q8_0 (scale 1).
    p.write_token(h, ALICE, 0, 0, &[127.0; 32], &[127.0; 32])
        .unwrap();
    let mut out = vec![0xAAu8; shape.data_bytes()];
    assert_eq!(p.export_page(h, ALICE, &mut out).unwrap(), 1);
    for half in out.chunks(shape.half_bytes()) {
        assert_eq!(dequant(&half[..34]), vec![127.0; 32]);
        assert!(
            half[34..].iter().all(|&b| b == 0),
            "bytes past slot 0 leave the node"
        );
    }
}

#[test]
fn budget_sizing_and_limits() {
    let s = shape();
    let p = Pool::with_budget(s, 10 * s.page_bytes() as u64 + 5, PoolOptions::default()).unwrap();
    assert_eq!(p.pages_total(), 10);
    assert_eq!(p.capacity_tokens(), 40);
    assert!(Pool::with_budget(s, 10, PoolOptions::default()).is_err());
    assert!(Pool::new(s, 0, PoolOptions::default()).is_err());
    assert!(Pool::new(s, u64::MAX, PoolOptions::default()).is_err());
}

/// Model checkers branch whole node states: a clone must be a deep copy
/// (writes to one never show in the other) and equality/hash must see
/// memory, metadata and counters.
#[test]
fn a_cloned_pool_is_independent_and_compares_by_content() {
    use std::collections::hash_map::DefaultHasher;
    use std::hash::{Hash, Hasher};
    let hash = |p: &Pool| {
        let mut h = DefaultHasher::new();
        p.hash(&mut h);
        h.finish()
    };
    let mut a = pool(Faults::default());
    let pages = alloc(&mut a, ALICE, 2);
    fill_page(&mut a, pages[0], ALICE, 1.0, 2);
    let mut b = a.clone();
    assert!(a == b);
    assert_eq!(hash(&a), hash(&b));
    b.check_invariants().unwrap();

    // Same metadata, different bytes: not equal.
    let mut c = a.clone();
    fill_page(&mut c, pages[1], ALICE, 2.0, 1);
    let mut d = a.clone();
    fill_page(&mut d, pages[1], ALICE, 3.0, 1);
    assert!(c != d, "memory is part of equality");
    assert!(a != c);

    // Writes and frees on the clone leave the original as it was.
    fill_page(&mut b, pages[1], ALICE, 5.0, 1);
    b.free(pages[0], ALICE).unwrap();
    assert_eq!(a.written_slots(pages[1], ALICE).unwrap(), 0);
    assert_eq!(a.epoch_of(pages[0].index), Some(pages[0].epoch));
    assert!(a.read_layer(pages[0], ALICE, 0, 2).is_ok());

    // Counters count: a refused access makes the pools differ.
    let e = a.clone();
    assert!(a.read_layer(pages[1], BOB, 0, 1).is_err());
    assert!(a != e);
}

// ------------------------------------------------------------------ K11 cache

/// Alice's first page, wholly written and published in her scope.
fn cached_page(p: &mut Pool, value: f32) -> PageRef {
    let a = alloc(p, ALICE, 1)[0];
    fill_page(p, a, ALICE, value, 4);
    p.publish(a, ALICE, 0xabc)
        .unwrap()
        .expect("not cached before")
}

fn scenario_scope(faults: Faults) -> Result<(), String> {
    let mut p = pool(faults);
    let c = cached_page(&mut p, 7.0);
    // Another request of Alice's tenant: same scope, reads the page.
    let sibling = Owner::new(RequestId(3), ALICE.tenant);
    check(p.lookup(sibling.scope, 0xabc) == Some(c), "lookup in scope")?;
    p.acquire(c, sibling).map_err(|e| e.to_string())?;
    check(
        p.read_layer(c, sibling, 0, 4)
            .is_ok_and(|v| k_values(v) == row(7.0).repeat(4)),
        "in-scope read refused",
    )?;
    // Bob's scope neither finds nor reads it, even holding the handle.
    check(
        p.lookup(BOB.scope, 0xabc).is_none(),
        "found from another scope",
    )?;
    check(
        matches!(
            p.read_layer(c, BOB, 0, 4),
            Err(KvError::ForeignScope { .. })
        ),
        "out-of-scope read served",
    )?;
    check(
        matches!(p.acquire(c, BOB), Err(KvError::ForeignScope { .. })),
        "out-of-scope acquire accepted",
    )?;
    // A salt-narrowed scope of Alice's own tenant is another scope too.
    let salted = Owner::request(RequestId(4), ALICE.tenant, Some(Scope::derived(99)));
    check(
        p.read_layer(c, salted, 0, 1).is_err(),
        "salted scope read served",
    )?;
    check(
        p.stats().refused_foreign_scope == 3,
        "out-of-scope accesses not counted",
    )
}

#[test]
fn cached_page_is_read_only_within_its_scope() {
    scenario_scope(Faults::default()).unwrap();
}

#[test]
fn scope_check_fails_without_the_check() {
    let f = Faults {
        skip_scope_check: true,
        ..Faults::default()
    };
    assert!(scenario_scope(f).is_err());
}

fn scenario_shared_write(faults: Faults) -> Result<(), String> {
    let mut p = pool(faults);
    let a = alloc(&mut p, ALICE, 1)[0];
    fill_page(&mut p, a, ALICE, 7.0, 4);
    let c = p.publish(a, ALICE, 1).unwrap().unwrap();
    // The private handle went stale with publication.
    check(
        matches!(
            p.write_token(a, ALICE, 0, 0, &row(9.0), &row(9.0)),
            Err(KvError::StaleHandle { .. })
        ),
        "private handle still writes a cached page",
    )?;
    let sibling = Owner::new(RequestId(3), ALICE.tenant);
    p.acquire(c, sibling).unwrap();
    for o in [ALICE, sibling] {
        let w = p.write_token(c, o, 0, 0, &row(9.0), &row(9.0));
        check(
            matches!(w, Err(KvError::SharedPage { .. })),
            "write to a cached page accepted",
        )?;
    }
    check(
        matches!(p.free(c, sibling), Err(KvError::SharedPage { .. })),
        "free of a cached page accepted",
    )?;
    check(
        p.read_layer(c, sibling, 0, 4)
            .is_ok_and(|v| k_values(v) == row(7.0).repeat(4)),
        "cached page changed",
    )?;
    check(
        p.stats().refused_shared_write == 3,
        "shared writes not counted",
    )
}

#[test]
fn cached_page_cannot_be_written_or_freed() {
    scenario_shared_write(Faults::default()).unwrap();
}

#[test]
fn shared_write_fails_without_the_check() {
    let f = Faults {
        skip_shared_write_check: true,
        ..Faults::default()
    };
    assert!(scenario_shared_write(f).is_err());
}

fn scenario_publish_unwritten(faults: Faults) -> Result<(), String> {
    let mut p = pool(faults);
    let a = alloc(&mut p, ALICE, 1)[0];
    // Three of four slots written, in every layer: not cacheable (K3).
    fill_page(&mut p, a, ALICE, 7.0, 3);
    check(
        matches!(p.publish(a, ALICE, 5), Err(KvError::NotPublishable { .. })),
        "partly written page cached",
    )?;
    // Leased pages are not cacheable either.
    let b = alloc(&mut p, ALICE, 1)[0];
    fill_page(&mut p, b, ALICE, 7.0, 4);
    p.lease(b, ALICE).unwrap();
    check(p.publish(b, ALICE, 6).is_err(), "leased page cached")?;
    check(
        p.stats().refused_unpublishable == 2 && p.pages_cached() == 0,
        "refusals not counted",
    )
}

#[test]
fn only_wholly_written_pages_enter_the_cache() {
    scenario_publish_unwritten(Faults::default()).unwrap();
}

#[test]
fn publish_check_fails_without_the_check() {
    let f = Faults {
        skip_publish_check: true,
        ..Faults::default()
    };
    assert!(scenario_publish_unwritten(f).is_err());
}

fn scenario_refcount(faults: Faults) -> Result<(), String> {
    let mut p = pool(faults);
    let c = cached_page(&mut p, 7.0);
    p.release(c, ALICE).unwrap();
    check(p.pages_evictable() == 1, "idle page not evictable")?;
    // One release too many: refused, counted, the page still evictable.
    check(
        matches!(p.release(c, ALICE), Err(KvError::RefUnderflow { .. })),
        "release without a reference accepted",
    )?;
    check(
        p.stats().refused_ref_underflow == 1,
        "underflow not counted",
    )?;
    // Every page comes back: the whole pool can be allocated.
    let mut all = Vec::new();
    check(
        p.alloc(BOB, 8, &mut all).is_ok(),
        "cached page leaked: the pool cannot be allocated whole",
    )?;
    p.check_invariants()
}

#[test]
fn references_never_go_negative_or_leak() {
    scenario_refcount(Faults::default()).unwrap();
}

#[test]
fn refcount_check_fails_without_the_check() {
    let f = Faults {
        skip_refcount_check: true,
        ..Faults::default()
    };
    assert!(scenario_refcount(f).is_err());
}

#[test]
fn eviction_takes_idle_pages_oldest_first_and_stales_their_handles() {
    let mut p = pool(Faults::default());
    // Three cached pages; released in the order 2, 0, 1.
    let mut cached = Vec::new();
    for k in 0..3u64 {
        let a = alloc(&mut p, ALICE, 1)[0];
        fill_page(&mut p, a, ALICE, k as f32, 4);
        cached.push(p.publish(a, ALICE, k).unwrap().unwrap());
    }
    let held = Owner::new(RequestId(3), ALICE.tenant);
    for &i in &[2usize, 0, 1] {
        p.release(cached[i], ALICE).unwrap();
    }
    // A lease keeps page 0 cached though idle of references.
    p.lease(cached[0], held).unwrap();
    assert_eq!(p.pages_free(), 5);
    assert_eq!(p.pages_available(), 7);
    // Six pages: the free five and the oldest idle one (key 2).
    let got = alloc(&mut p, BOB, 6);
    assert_eq!(p.lookup(ALICE.scope, 2), None);
    assert!(got.iter().any(|g| g.index == cached[2].index));
    assert!(matches!(
        p.read_layer(cached[2], held, 0, 1),
        Err(KvError::StaleHandle { .. })
    ));
    assert_eq!(p.stats().cache_evictions, 1);
    // Key 1 is next; key 0 is leased and stays.
    alloc(&mut p, BOB, 1);
    assert_eq!(p.lookup(ALICE.scope, 1), None);
    assert_eq!(p.lookup(ALICE.scope, 0), Some(cached[0]));
    assert!(matches!(
        p.alloc(BOB, 1, &mut Vec::new()),
        Err(KvError::OutOfPages { .. })
    ));
    // The lease ends: the page becomes evictable, then evicted.
    p.release_lease(cached[0], held).unwrap();
    assert_eq!(p.pages_available(), 1);
    assert_eq!(p.evict_idle(), 1);
    assert_eq!(p.pages_cached(), 0);
    p.check_invariants().unwrap();
}

#[test]
fn a_second_publish_of_a_key_keeps_the_first_and_canaries_follow_the_cache() {
    let mut p = pool(Faults::default());
    let c = cached_page(&mut p, 7.0);
    let sibling = Owner::new(RequestId(3), ALICE.tenant);
    let b = alloc(&mut p, sibling, 1)[0];
    fill_page(&mut p, b, sibling, 7.0, 4);
    assert_eq!(p.publish(b, sibling, 0xabc).unwrap(), None);
    // `b` stays private to its owner; the cached page keeps its key.
    p.write_token(b, sibling, 0, 0, &row(1.0), &row(1.0))
        .unwrap();
    assert_eq!(p.lookup(ALICE.scope, 0xabc), Some(c));
    // The cached page's canary is its cache owner's, checked from the scope.
    p.check_canary(c, sibling).unwrap();
    p.scribble_trailer(c.index);
    assert!(p.check_canary(c, sibling).is_err());
    p.check_invariants().unwrap();
}

#[test]
fn giving_back_frees_private_pages_and_last_references_only() {
    let shape = KvShape::new(1, 1, 16, 4, DType::F32).unwrap();
    let mut pool = Pool::new(shape, 8, PoolOptions::default()).unwrap();
    let a = Owner::new(RequestId(1), TenantId(1));
    let b = Owner::new(RequestId(2), TenantId(1));
    let mut pages = Vec::new();
    pool.alloc(a, 2, &mut pages).unwrap();
    let row = [1.0f32; 16];
    for slot in 0..4 {
        pool.write_token(pages[0], a, 0, slot, &row, &row).unwrap();
    }
    let cached = pool.publish(pages[0], a, 7).unwrap().expect("published");
    // a holds the cached page (its only reference) and a private one.
    assert_eq!(pool.freed_by_giving_back(&[cached, pages[1]]), 2);
    // Once b references the cached page too, giving back a's frees only
    // the private one.
    pool.acquire(cached, b).unwrap();
    assert_eq!(pool.freed_by_giving_back(&[cached, pages[1]]), 1);
    // A lease keeps a page too.
    pool.lease(pages[1], a).unwrap();
    assert_eq!(pool.freed_by_giving_back(&[pages[1]]), 0);
}

#[test]
fn console_map_shows_each_page_state_owner_and_fill() {
    use request::console::PageState;
    let mut p = pool(Faults::default());
    let mut map = request::console::PoolMap::default();
    p.map_into(&mut map);
    assert_eq!(map.len(), 8);
    assert!(map.state.iter().all(|&s| s == PageState::Free));
    // Alice: one page half written, one published to her cache scope, one
    // leased and then freed (pending), one freed (poisoned). Bob: one page.
    let a = alloc(&mut p, ALICE, 4);
    let b = alloc(&mut p, BOB, 1);
    fill_page(&mut p, a[0], ALICE, 1.0, 2);
    fill_page(&mut p, a[1], ALICE, 1.0, 4);
    let cached = p.publish(a[1], ALICE, 99).unwrap().expect("published");
    p.lease(a[2], ALICE).unwrap();
    assert_eq!(p.free(a[2], ALICE).unwrap(), FreeOutcome::Deferred);
    p.free(a[3], ALICE).unwrap();
    p.map_into(&mut map);
    let at = |h: PageRef| h.index as usize;
    assert_eq!(map.state[at(a[0])], PageState::Private);
    assert_eq!(map.who[at(a[0])], ALICE.tenant.0);
    assert_eq!(map.request[at(a[0])], ALICE.request.0);
    assert_eq!(map.written[at(a[0])], 2);
    assert_eq!(map.epoch[at(a[0])], a[0].epoch);
    assert_eq!(map.state[at(cached)], PageState::Cached);
    assert_eq!(map.who[at(cached)], ALICE.scope.0);
    assert_eq!(map.request[at(cached)], u64::MAX);
    assert_eq!(map.written[at(cached)], 4);
    assert_eq!(map.state[at(a[2])], PageState::ReleasePending);
    assert_eq!(map.state[at(a[3])], PageState::Poisoned);
    assert_eq!(map.who[at(a[3])], u64::MAX);
    assert_eq!(map.written[at(a[3])], 0);
    assert_eq!(map.state[at(b[0])], PageState::Private);
    assert_eq!(map.who[at(b[0])], BOB.tenant.0);
    let c = map.counts();
    assert_eq!(
        (c.free, c.poisoned, c.private, c.cached, c.release_pending),
        (3, 1, 2, 1, 1)
    );
    // Pending release done: poisoned; a leased live page shows as leased.
    assert_eq!(
        p.release_lease(a[2], ALICE).unwrap(),
        LeaseOutcome::ReleasedAndFreed
    );
    p.lease(b[0], BOB).unwrap();
    p.map_into(&mut map);
    assert_eq!(map.state[at(a[2])], PageState::Poisoned);
    assert_eq!(map.state[at(b[0])], PageState::Leased);
    assert_eq!(map.counts().poisoned, 2);
}

#[test]
fn console_map_calls_free_pages_free_when_nothing_poisons_them() {
    let mut p = Pool::new(
        shape(),
        2,
        PoolOptions {
            poison: Poison::Off,
        },
    )
    .unwrap();
    let h = alloc(&mut p, ALICE, 1);
    p.free(h[0], ALICE).unwrap();
    let mut map = request::console::PoolMap::default();
    p.map_into(&mut map);
    assert_eq!(map.state, vec![request::console::PageState::Free; 2]);
}

#[test]
fn console_map_in_slices_is_the_whole_map() {
    let mut p = pool(Faults::default());
    let a = alloc(&mut p, ALICE, 3);
    fill_page(&mut p, a[1], ALICE, 1.0, 3);
    p.free(a[2], ALICE).unwrap();
    let mut whole = request::console::PoolMap::default();
    p.map_into(&mut whole);
    let mut sliced = request::console::PoolMap::default();
    for start in (0..8).step_by(3) {
        p.map_range_into(&mut sliced, start..start + 3);
    }
    assert_eq!(sliced, whole);
    // Out of range: clamped, nothing appended.
    p.map_range_into(&mut sliced, 8..100);
    assert_eq!(sliced.len(), 8);
}

/// Speculation's rollback (issue 37): rewound slots read as unwritten in
/// every layer until their owner writes them again (K3), in order; another
/// owner cannot rewind a page, nor anyone a page leased to a transfer.
#[test]
fn rewound_slots_read_as_unwritten_until_rewritten() {
    let mut p = pool(Faults::default());
    let w = shape().token_width();
    let h = alloc(&mut p, ALICE, 1)[0];
    fill_page(&mut p, h, ALICE, 1.0, 3);
    assert!(matches!(
        p.rewind(h, BOB, 1),
        Err(KvError::ForeignOwner { .. })
    ));
    p.rewind(h, ALICE, 1).unwrap();
    for layer in 0..shape().layers {
        assert_eq!(p.watermark(h, ALICE, layer).unwrap(), 1);
        assert!(matches!(
            p.read_layer(h, ALICE, layer, 2),
            Err(KvError::UnwrittenRead { .. })
        ));
        assert!(matches!(
            p.write_token(h, ALICE, layer, 2, &row(3.0), &row(3.0)),
            Err(KvError::WriteGap { .. })
        ));
        p.write_token(h, ALICE, layer, 1, &row(2.0), &row(2.0))
            .unwrap();
        let k = k_values(p.read_layer(h, ALICE, layer, 2).unwrap());
        assert_eq!(&k[..w], &row(1.0)[..]);
        assert_eq!(&k[w..2 * w], &row(2.0)[..]);
    }
    // Past the watermark: nothing changes.
    p.rewind(h, ALICE, 4).unwrap();
    assert_eq!(p.written_slots(h, ALICE).unwrap(), 2);
    p.lease(h, ALICE).unwrap();
    assert!(matches!(p.rewind(h, ALICE, 0), Err(KvError::Leased { .. })));
    assert_eq!(p.written_slots(h, ALICE).unwrap(), 2);
}
