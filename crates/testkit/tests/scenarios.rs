//! Targeted PD scenarios over the production state machines (in the
//! simulator, with real pools): the incident, corruption, stale handles,
//! and for each safety check a mutation that removes it and a test that
//! then fails. Which mutation each test catches:
//!
//! | mutation | caught by |
//! |---|---|
//! | prefill placeholder (incident) | `incident_placeholder_is_caught_by_decode_completeness_but_loses_the_original_error` (K9) |
//! | decode completeness check off + placeholder | `without_completeness_the_placeholder_answers_wrongly` |
//! | pool checksum check off (K6) | `without_the_checksum_corrupted_kv_reaches_the_client` |
//! | decode handle check off (K2 fence) | `a_page_for_a_stale_handle_is_fenced` (the canary still refuses it) |
//! | decode frees without draining (K4) | `freeing_without_draining_breaks_k4` |
//! | decode skips its own canary check (K7) | `without_decodes_own_canary_check_it_decodes_on_a_scribbled_page` |

use testkit::sim::{Outcome, Sim, SimConfig, SimReport};
use testkit::world::WorldParams;
use transfer::decode::DecodeMutations;
use transfer::gateway::GatewayMutations;
use transfer::prefill::PrefillMutations;
use transfer::wire::Message;
use transfer::{RequestId, TenantId};

fn quiet() -> SimConfig {
    SimConfig::quiet()
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed * 131 + i * 17) % 1000)
        .collect()
}

fn outcome(r: &SimReport, req: u64) -> &Outcome {
    r.outcomes
        .iter()
        .find(|o| o.req == RequestId(req))
        .expect("request ran")
}

fn assert_pools_free(r: &SimReport) {
    for (name, p) in [("prefill", r.prefill_pool), ("decode", r.decode_pool)] {
        assert_eq!(p.pages_unheld(), p.pages_total, "{name} pool leaked: {p:?}");
        assert_eq!(p.pages_leased, 0, "{name} pool: {p:?}");
        assert_eq!(p.refused_double_free, 0, "{name} pool: {p:?}");
    }
}

/// Prefill's pool is smaller than decode's and than the window; tenant 1's
/// secret-bearing request runs first; tenant 2 sends a request that fits
/// decode but not prefill, and the gateway is made to pass it on.
fn incident() -> (SimConfig, Vec<(TenantId, Vec<u32>, u32)>) {
    let cfg = SimConfig {
        world: WorldParams {
            prefill_limit: 16,
            decode_limit: 32,
            ..WorldParams::default()
        },
        ..quiet()
    };
    let reqs = vec![
        (TenantId(1), prompt(1, 12), 4),
        (TenantId(2), prompt(2, 22), 4),
    ];
    (cfg, reqs)
}

#[test]
fn incident_placeholder_request_never_decodes() {
    let (cfg, reqs) = incident();
    let mut sim = Sim::scripted(1, cfg, &reqs);
    sim.gateway_mut().set_mutations(GatewayMutations {
        skip_limit_check: true,
        ..GatewayMutations::default()
    });
    let r = sim.run().expect("invariants hold");
    let secret = outcome(&r, 100);
    assert_eq!(secret.end, Some(Ok(4)));
    assert_eq!(secret.tokens, secret.expected);
    let over = outcome(&r, 101);
    // The client gets prefill's original error, with its numbers.
    assert_eq!(over.end, Some(Err("context_length_exceeded".into())));
    assert_eq!(over.status, Some(400));
    assert!(over.tokens.is_empty(), "decode generated {:?}", over.tokens);
    assert_eq!(r.decode_stats.reservations_total, 2);
    assert_eq!(r.decode_stats.transfers_completed_total, 1);
    assert_eq!(r.decode_stats.decodes_finished_total, 1);
    assert_eq!(r.prefill_stats.prefills_refused_total, 1);
    assert_pools_free(&r);
    assert_eq!(r.decode_pool.safety_refusals(), 0);
}

#[test]
fn the_gateway_refuses_over_long_requests_before_any_node() {
    let (cfg, reqs) = incident();
    let r = Sim::scripted(1, cfg, &reqs).run().expect("invariants hold");
    let over = outcome(&r, 101);
    assert_eq!(over.end, Some(Err("context_length_exceeded".into())));
    // Only the first request reached decode.
    assert_eq!(r.decode_stats.reservations_total, 1);
    assert_eq!(r.prefill_stats.prefills_total, 1);
    assert_pools_free(&r);
}

#[test]
fn incident_placeholder_is_caught_by_decode_completeness_but_loses_the_original_error() {
    let (cfg, reqs) = incident();
    let mut sim = Sim::scripted(1, cfg, &reqs);
    sim.gateway_mut().set_mutations(GatewayMutations {
        skip_limit_check: true,
        ..GatewayMutations::default()
    });
    sim.prefill_mut().set_mutations(PrefillMutations {
        placeholder: true,
        ..Default::default()
    });
    // Decode's completeness check refuses the one-token placeholder (no
    // token is generated), but the client gets `transfer_incomplete`
    // instead of the refusal prefill swallowed: K9 is broken.
    let err = sim.run().expect_err("the placeholder breaks K9");
    assert!(err.contains("K9: request 101"), "{err}");
    assert!(
        err.contains("transfer_incomplete") && err.contains("after 0 tokens"),
        "{err}"
    );
}

#[test]
fn without_completeness_the_placeholder_answers_wrongly() {
    let (cfg, reqs) = incident();
    let mut sim = Sim::scripted(1, cfg, &reqs);
    sim.gateway_mut().set_mutations(GatewayMutations {
        skip_limit_check: true,
        ..GatewayMutations::default()
    });
    sim.prefill_mut().set_mutations(PrefillMutations {
        placeholder: true,
        ..Default::default()
    });
    sim.decode_mut().set_mutations(DecodeMutations {
        skip_completeness_check: true,
        ..DecodeMutations::default()
    });
    // The incident's answer: a token computed from a one-token placeholder
    // reaches the client (then decode's read of unwritten slots is refused
    // by the pool, K3). The run's content check reports it.
    let err = sim.run().expect_err("a wrong token must be delivered");
    assert!(err.contains("request 101"), "{err}");
}

fn tamper_first_page(req: u64) -> testkit::sim::Tamper {
    let mut done = false;
    Box::new(move |m: &mut Message| {
        if let Message::Page { req: r, bytes, .. } = m {
            if *r == RequestId(req) && !done {
                done = true;
                bytes[0] ^= 0x40;
                return true;
            }
        }
        false
    })
}

#[test]
fn corrupted_page_bytes_fail_the_checksum_with_zero_tokens() {
    let reqs = vec![
        (TenantId(1), prompt(3, 10), 3),
        (TenantId(2), prompt(4, 9), 3),
    ];
    let mut sim = Sim::scripted(2, quiet(), &reqs);
    sim.set_tamper(tamper_first_page(100));
    let r = sim.run().expect("invariants hold");
    let bad = outcome(&r, 100);
    assert_eq!(bad.end, Some(Err("checksum_mismatch".into())));
    assert!(bad.tokens.is_empty());
    assert_eq!(r.decode_stats.checksum_failures_total, 1);
    assert_eq!(r.decode_pool.checksum_mismatch, 1);
    // The other request is unaffected.
    let good = outcome(&r, 101);
    assert_eq!(good.end, Some(Ok(3)));
    assert_eq!(good.tokens, good.expected);
    assert_pools_free(&r);
}

#[test]
fn without_the_checksum_corrupted_kv_reaches_the_client() {
    let reqs = vec![(TenantId(1), prompt(3, 10), 3)];
    let mut sim = Sim::scripted(2, quiet(), &reqs);
    sim.set_tamper(tamper_first_page(100));
    sim.decode_pool_mut().set_faults(kv::Faults {
        skip_checksum_check: true,
        ..kv::Faults::default()
    });
    // Decode starts on pages that do not hold the prompt (K10 as content).
    let err = sim.run().expect_err("corrupted KV must change the answer");
    assert!(err.contains("K3/K10: decode started request 100"), "{err}");
}

/// A faulty gateway (or a stale reservation) hands prefill an old epoch of
/// a reserved page: prefill binds its checksum and canary to it.
fn stale_reservation(req: u64) -> testkit::sim::Tamper {
    Box::new(move |m: &mut Message| {
        if let Message::Prefill { req: r, pages, .. } = m {
            if *r == RequestId(req) {
                pages[0].epoch = pages[0].epoch.wrapping_sub(2);
                return true;
            }
        }
        false
    })
}

#[test]
fn a_page_for_a_stale_handle_is_fenced() {
    let reqs = vec![
        (TenantId(1), prompt(5, 8), 2),
        (TenantId(2), prompt(6, 8), 2),
    ];
    let mut sim = Sim::scripted(3, quiet(), &reqs);
    sim.set_tamper(stale_reservation(101));
    let r = sim.run().expect("invariants hold");
    let bad = outcome(&r, 101);
    assert_eq!(bad.end, Some(Err("transfer_fenced".into())));
    assert!(bad.tokens.is_empty());
    assert!(r.decode_stats.pages_fenced_total >= 1);
    assert_pools_free(&r);

    // Without the handle check, the canary (bound to the epoch) refuses it.
    let mut sim = Sim::scripted(3, quiet(), &reqs);
    sim.set_tamper(stale_reservation(101));
    sim.decode_mut().set_mutations(DecodeMutations {
        skip_handle_check: true,
        ..DecodeMutations::default()
    });
    let r = sim.run().expect("invariants hold");
    assert_eq!(outcome(&r, 101).end, Some(Err("canary_mismatch".into())));
    assert_eq!(r.decode_stats.pages_fenced_total, 0);
}

#[test]
fn freeing_without_draining_breaks_k4() {
    let cfg = SimConfig {
        cancel_permille: 60,
        cancels_max: 4,
        ..quiet()
    };
    for seed in 0..600 {
        let mut sim = Sim::new(seed, cfg.clone());
        sim.decode_mut().set_mutations(DecodeMutations {
            free_without_drain: true,
            ..DecodeMutations::default()
        });
        if let Err(e) = sim.run() {
            assert!(e.contains("K4"), "seed {seed}: {e}");
            return;
        }
    }
    panic!("600 seeds never caught decode freeing pages a transfer may still write");
}

#[test]
fn cancels_land_in_every_decode_phase() {
    let cfg = SimConfig {
        cancel_permille: 60,
        cancels_max: 4,
        ..quiet()
    };
    let (mut receiving, mut decoding, mut waiting) = (0, 0, 0);
    for seed in 0..300 {
        let r = Sim::new(seed, cfg.clone())
            .run()
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        receiving += r.decode_stats.cancels_receiving_total;
        decoding += r.decode_stats.cancels_decoding_total;
        waiting += r.decode_stats.cancels_waiting_total;
        assert_pools_free(&r);
    }
    assert!(
        receiving > 0 && decoding > 0,
        "receiving {receiving}, decoding {decoding}, waiting {waiting}"
    );
}

#[test]
fn replay_scenario_seed() {
    let Ok(seed) = std::env::var("SIM_SEED") else {
        return;
    };
    let cfg = SimConfig {
        cancel_permille: 60,
        cancels_max: 4,
        trace: true,
        ..quiet()
    };
    Sim::new(seed.parse().unwrap(), cfg).run().unwrap();
}

/// Drives a world by always taking the first possible event, and flips a
/// canary byte of request 100's first decode page once it is reserved (a
/// stray write from a neighbour).
fn run_with_a_stray_write(m: DecodeMutations) -> Result<Vec<testkit::world::Outcome>, String> {
    use testkit::world::{ClientSpec, World};
    let mut w = World::new(
        WorldParams::default(),
        vec![ClientSpec::new(TenantId(1), prompt(7, 6), 2)],
    );
    w.decode.machine.set_mutations(m);
    let mut scribbled = false;
    for _ in 0..500 {
        if !scribbled {
            if let Some(&h) = w
                .decode
                .machine
                .pages_of(RequestId(100))
                .and_then(|p| p.first())
            {
                w.decode.engine.pool.scribble_trailer(h.index);
                w.counters.corruptions += 1;
                scribbled = true;
            }
        }
        if !w.step_first() {
            break;
        }
        w.check_step()?;
    }
    assert!(scribbled && w.quiescent(), "{}", w.summary());
    w.check_end()
}

#[test]
fn a_stray_write_into_a_decode_page_fails_its_canary_before_decode() {
    let out = run_with_a_stray_write(DecodeMutations::default()).expect("invariants hold");
    assert_eq!(out[0].end, Some(Err("canary_mismatch".into())));
    assert!(out[0].tokens.is_empty());
}

#[test]
fn without_decodes_own_canary_check_it_decodes_on_a_scribbled_page() {
    let err = run_with_a_stray_write(DecodeMutations {
        skip_own_canary_check: true,
        ..DecodeMutations::default()
    })
    .expect_err("the world's K7 check sees the start");
    assert!(err.contains("K7: decode started request 100"), "{err}");
}

/// The first possible event but a submit, leaving the frames of `skip`
/// queued.
fn step_without_submit(w: &mut testkit::world::World, skip: Option<u64>) -> bool {
    if let Some(&(conn, side, _)) = w.frames().iter().find(|f| Some(f.0) != skip) {
        w.deliver(conn, side, 0, None, None);
    } else if w.has_dials() {
        w.prefill_dial();
    } else if let Some(&req) = w.jobs().first() {
        w.compute(req);
    } else if let Some(&req) = w.decoding().first() {
        w.decode_step(req);
    } else {
        return false;
    }
    true
}

/// CI's heartbeat test: prefill timed its link to a stopped decode node
/// out; the gateway paired again and sent a new request, which decode
/// reserved before it read the old link's close. Decode used to fail every
/// request of that prefill node not yet bound to a link ("prefill lost
/// mid-transfer") — including the new one, which prefill would send on a
/// new link. Prefill reports the requests it fails itself.
#[test]
fn a_prefill_link_seen_closed_late_spares_requests_reserved_since() {
    use testkit::world::{ClientSpec, Node, World};
    let mut w = World::new(
        WorldParams::default(),
        vec![
            ClientSpec::new(TenantId(1), prompt(3, 6), 2),
            ClientSpec::new(TenantId(2), prompt(4, 6), 2),
        ],
    );
    // Request 100 runs to its end over prefill's link to decode.
    for _ in 0..50 {
        if w.gateway.ready() {
            break;
        }
        assert!(step_without_submit(&mut w, None), "{}", w.summary());
    }
    w.submit_next();
    for _ in 0..500 {
        if w.in_flight().is_empty() {
            break;
        }
        assert!(step_without_submit(&mut w, None), "{}", w.summary());
        w.check_step().expect("invariants hold");
    }
    assert!(w.in_flight().is_empty(), "{}", w.summary());
    let link = w
        .conn_ids()
        .into_iter()
        .find(|&c| w.conn_ends(c) == Some([Node::Prefill, Node::Decode]))
        .expect("prefill's link to decode is up");
    w.time_out(Node::Prefill, link);
    // Request 101 is reserved on decode while the close is still in
    // flight.
    w.submit_next();
    let prefill_sent = |w: &World| {
        w.frames().iter().any(|&(c, side, n)| {
            (0..n).any(|i| {
                matches!(
                    w.peek(c, side, i),
                    Some(Message::Prefill {
                        req: RequestId(101),
                        ..
                    })
                )
            })
        })
    };
    for _ in 0..500 {
        if prefill_sent(&w) {
            break;
        }
        assert!(step_without_submit(&mut w, Some(link)), "{}", w.summary());
        w.check_step().expect("invariants hold");
    }
    assert!(prefill_sent(&w), "{}", w.summary());
    w.deliver(link, 0, 0, None, None);
    for _ in 0..500 {
        if !step_without_submit(&mut w, None) {
            break;
        }
        w.check_step().expect("invariants hold");
    }
    let out = w.check_end().expect("invariants hold at the end");
    let late = out
        .iter()
        .find(|o| o.req == RequestId(101))
        .expect("request 101 ran");
    assert_eq!(late.end, Some(Ok(2)), "{}", w.summary());
    assert_eq!(late.tokens, late.expected);
}
