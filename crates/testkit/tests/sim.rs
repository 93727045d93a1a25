//! The whole PD protocol (gateway, prefill, decode state machines with real
//! pools) under a seeded simulation: clean runs, and thousands of seeds of
//! cancels, corruption, connection kills, node crashes, latency jitter and
//! partitions (TCP-like network), plus an adversarial network that also
//! reorders, loses and duplicates frames. Every failure names its seed;
//! `SIM_SEED=N cargo test -p testkit --test sim replay -- --nocapture`
//! replays one with a trace (`SIM_ADVERSARIAL=1` for the adversarial
//! network). A million seeds: `cargo run --release -p verify --bin pd-sim`.

use testkit::sim::{Sim, SimConfig};

fn quiet() -> SimConfig {
    SimConfig::quiet()
}

#[test]
fn clean_runs_finish_every_request_with_the_reference_tokens() {
    for seed in 0..50 {
        let cfg = SimConfig {
            requests: 8,
            ..quiet()
        };
        let r = Sim::new(seed, cfg)
            .run()
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(r.finished, 8, "seed {seed}: {r:?}");
        assert_eq!(r.errors, 0, "seed {seed}: {r:?}");
        assert!(r.tokens_delivered >= 8);
        assert_eq!(r.pages_fenced, 0);
    }
}

#[derive(Debug, Default)]
struct Totals {
    cancelled: usize,
    finished: usize,
    crashes: usize,
    cancels_receiving: u64,
    checksum_failures: u64,
    partitions: usize,
    partition_timeouts: usize,
    kills: usize,
    cache_hit_pages: u64,
}

#[test]
fn three_thousand_seeds_of_faults_never_leak_double_free_or_deliver_a_wrong_token() {
    let mut t = Totals::default();
    for seed in 0..3000 {
        let r = Sim::new(seed, SimConfig::default())
            .run()
            .unwrap_or_else(|e| panic!("seed {seed} (replay: SIM_SEED={seed}): {e}"));
        assert!(r.drained);
        t.cancelled += r.cancelled;
        t.finished += r.finished;
        t.crashes += r.crashes;
        t.cancels_receiving += r.cancels_receiving;
        t.checksum_failures += r.checksum_failures;
        t.partitions += r.partitions;
        t.partition_timeouts += r.partition_timeouts;
        t.kills += r.kills;
        t.cache_hit_pages += r.cache_hit_pages;
    }
    // The search reached the interesting states.
    assert!(t.cancelled > 1500, "{t:?}");
    assert!(t.finished > 5000, "{t:?}");
    assert!(t.crashes > 250, "{t:?}");
    assert!(t.cancels_receiving > 50, "{t:?}");
    assert!(t.checksum_failures > 0, "{t:?}");
    assert!(t.partitions > 250, "{t:?}");
    assert!(t.partition_timeouts > 0, "{t:?}");
    assert!(t.kills > 250, "{t:?}");
    assert!(t.cache_hit_pages > 250, "{t:?}");
}

#[test]
fn an_adversarial_network_never_breaks_safety() {
    let (mut reorders, mut drops, mut duplicates, mut hung) = (0, 0, 0, 0);
    for seed in 0..1000 {
        let r = Sim::new(seed, SimConfig::default().adversarial())
            .run()
            .unwrap_or_else(|e| {
                panic!("seed {seed} (replay: SIM_ADVERSARIAL=1 SIM_SEED={seed}): {e}")
            });
        reorders += r.reorders;
        drops += r.drops;
        duplicates += r.duplicates;
        hung += usize::from(!r.drained);
    }
    assert!(
        reorders > 500 && drops > 100 && duplicates > 100,
        "reorders {reorders}, drops {drops}, duplicates {duplicates}"
    );
    // Losing a frame on a live connection can hang a request (TCP never
    // does that); most runs still drain.
    assert!(hung < 900, "{hung} of 1000 runs hung");
}

/// The node glue (`transfer::node`) is the production code the simulator
/// runs: with its test-only mutation that starts decode as soon as `Done`
/// arrives (before the completeness verdict), a network that reorders
/// frames lets `Done` overtake pages, and the world sees decode start on
/// pages that do not hold the prompt.
#[test]
fn glue_that_starts_decode_before_the_verdict_is_caught() {
    let mut caught = 0;
    for seed in 0..300 {
        let mut sim = Sim::new(seed, SimConfig::default().adversarial());
        sim.decode_glue_mut()
            .set_mutations(transfer::node::GlueMutations {
                start_before_verdict: true,
                ..Default::default()
            });
        if let Err(e) = sim.run() {
            assert!(e.contains("K3/K10"), "seed {seed}: {e}");
            caught += 1;
        }
    }
    assert!(caught > 0, "no seed of 300 caught the mutation");
    eprintln!("{caught} of 300 seeds caught it");
}

/// The glue's `StopDecode` (a cancel while decoding) is what takes the
/// request out of decode's engine: glue that ignores it leaves the engine
/// running a request its machine ended and whose pages it freed, and the
/// world's engine check catches it (without that check every other
/// invariant stayed green).
#[test]
fn glue_that_ignores_stop_decode_is_caught() {
    let mut caught = 0;
    for seed in 0..300 {
        let mut sim = Sim::new(seed, SimConfig::default());
        sim.decode_glue_mut()
            .set_mutations(transfer::node::GlueMutations {
                skip_stop_decode: true,
                ..Default::default()
            });
        if let Err(e) = sim.run() {
            assert!(
                e.contains("engines: decode's engine runs request"),
                "seed {seed}: {e}"
            );
            caught += 1;
        }
    }
    assert!(caught > 0, "no seed of 300 caught the mutation");
    eprintln!("{caught} of 300 seeds caught it");
}

/// The prefix cache's two machine-level rules, each shown to have teeth:
/// with the mutation, fault-free runs over shared prompt openings fail the
/// world's checks (and pass without it, in the test above).
fn caught_with(m: transfer::prefill::PrefillMutations, expect: &[&str]) -> usize {
    let mut caught = 0;
    for seed in 0..100 {
        let mut sim = Sim::new(seed, quiet());
        sim.prefill_mut().set_mutations(m);
        if let Err(e) = sim.run() {
            assert!(expect.iter().any(|x| e.contains(x)), "seed {seed}: {e}");
            caught += 1;
        }
    }
    caught
}

#[test]
fn prefill_sharing_cached_pages_across_tenants_is_caught() {
    let m = transfer::prefill::PrefillMutations {
        one_cache_scope: true,
        ..Default::default()
    };
    let caught = caught_with(m, &["K11"]);
    assert!(
        caught > 50,
        "{caught} of 100 seeds caught one cache scope for all tenants"
    );
}

#[test]
fn prefill_keeping_cache_references_is_caught() {
    let m = transfer::prefill::PrefillMutations {
        keep_cache_refs: true,
        ..Default::default()
    };
    // Held pages are never evictable: the run leaks them or, short of
    // pages, never drains.
    let caught = caught_with(m, &["leaked", "not quiescent"]);
    assert!(
        caught > 50,
        "{caught} of 100 seeds caught a cache reference leak"
    );
}

#[test]
fn replay() {
    let Ok(seed) = std::env::var("SIM_SEED") else {
        return;
    };
    let seed: u64 = seed.parse().expect("SIM_SEED is a number");
    let mut cfg = SimConfig {
        trace: true,
        ..SimConfig::default()
    };
    if std::env::var("SIM_ADVERSARIAL").is_ok() {
        cfg = cfg.adversarial();
    }
    let r = Sim::new(seed, cfg).run();
    println!("{r:?}");
    r.unwrap();
}
