//! The whole PD protocol (gateway, prefill, decode state machines with real
//! pools) under a seeded simulation: clean runs, and many seeds of cancels,
//! corruption, connection kills and node crashes. Every failure names its
//! seed; `SIM_SEED=N cargo test -p transfer --test sim replay` replays one.

use transfer::sim::{Sim, SimConfig};

fn quiet() -> SimConfig {
    SimConfig {
        cancel_permille: 0,
        corrupt_permille: 0,
        kill_conn_permille: 0,
        crash_permille: 0,
        ..SimConfig::default()
    }
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

#[test]
fn seeded_faults_never_leak_a_page_double_free_or_deliver_a_wrong_token() {
    let mut totals = (0usize, 0usize, 0usize, 0u64, 0u64);
    for seed in 0..600 {
        let r = Sim::new(seed, SimConfig::default())
            .run()
            .unwrap_or_else(|e| panic!("seed {seed} (replay: SIM_SEED={seed}): {e}"));
        totals.0 += r.cancelled;
        totals.1 += r.finished;
        totals.2 += r.crashes;
        totals.3 += r.cancels_receiving;
        totals.4 += r.checksum_failures;
    }
    // The search reached the interesting states.
    assert!(totals.0 > 300, "cancels: {totals:?}");
    assert!(totals.1 > 1000, "finished: {totals:?}");
    assert!(totals.2 > 50, "crashes: {totals:?}");
    assert!(totals.3 > 10, "cancels mid-transfer: {totals:?}");
    assert!(totals.4 > 0, "checksum failures: {totals:?}");
}

#[test]
fn replay() {
    let Ok(seed) = std::env::var("SIM_SEED") else {
        return;
    };
    let seed: u64 = seed.parse().expect("SIM_SEED is a number");
    let cfg = SimConfig {
        trace: true,
        ..SimConfig::default()
    };
    let r = Sim::new(seed, cfg).run();
    println!("{r:?}");
    r.unwrap();
}
