//! The model checker over the production machines: CI's bounds hold every
//! property and reach every `sometimes`; each test-only mutation of a
//! safety mechanism named here makes the search find a counterexample,
//! printed step by step (the other mutations are caught in the simulator:
//! `testkit/tests/scenarios.rs`). Which mutation each test catches:
//!
//! | mutation | property broken | test |
//! |---|---|---|
//! | (a) prefill placeholder (incident) | K9 | `the_placeholder_path_loses_the_original_error` |
//! | (b) decode frees on cancel without draining | K4 | `freeing_without_draining_frees_pages_a_transfer_writes` |
//! | (c) decode believes the epoch a late write names | K2 | `without_the_epoch_check_a_stale_writer_lands` |
//! | (d) the node glue starts decode on `Done`, before the machine's verdict | K3/K10 | `glue_that_starts_decode_before_the_verdict_reads_unwritten_pages` |
//! | (e) the node glue ignores `StopDecode` | engines | `glue_that_ignores_stop_decode_leaves_an_ended_request_running` |
//! | (f) decode's engine verifies a draft but does not roll its rejected row back | engines (K3) | `a_rejected_draft_left_written_is_caught` |

use verify::{check, Bounds, Network, Report};

fn run(b: &Bounds) -> Report {
    let r = check(b, 2);
    // Shown with --nocapture, and with any failure.
    eprintln!("{r}");
    r
}

#[test]
fn ci_bounds_hold_every_property_and_reach_every_sometimes() {
    for b in Bounds::ci() {
        let r = run(&b);
        assert!(!r.timed_out, "{r}");
        assert!(r.violations.is_empty(), "{r}");
        assert!(r.unreached.is_empty(), "{r}");
        // The searches are as big as measured (README, "Verification"):
        // a shrunken one would hide behind a green run.
        let floor = match b.name {
            "two-tenants" => 250_000,
            "oversize" => 30_000,
            "stale-writer" => 4_000,
            "adversarial" => 300_000,
            "prefix-cache" => 300_000,
            "speculation" => 10_000,
            other => panic!("no floor for {other}"),
        };
        assert!(r.unique_states >= floor, "{r}");
    }
}

fn violated<'a>(r: &'a Report, prefix: &str) -> &'a str {
    r.violations
        .iter()
        .find(|(p, _)| p.starts_with(prefix))
        .map(|(_, t)| t.as_str())
        .unwrap_or_else(|| panic!("no `{prefix}` counterexample:\n{r}"))
}

#[test]
fn the_placeholder_path_loses_the_original_error() {
    let mut b = Bounds::oversize();
    b.mutations.prefill.placeholder = true;
    let r = run(&b);
    let trace = violated(&r, "K9");
    assert!(trace.contains("  1. deliver"), "{trace}");
    assert!(trace.contains("=> K9: request 101"), "{trace}");
    assert!(trace.contains("transfer_incomplete"), "{trace}");
}

#[test]
fn freeing_without_draining_frees_pages_a_transfer_writes() {
    let mut b = Bounds::two_tenants();
    b.mutations.decode.free_without_drain = true;
    let r = run(&b);
    let trace = violated(&r, "K4");
    assert!(trace.contains("CANCELS"), "{trace}");
    assert!(trace.contains("=> K4: prefill may still write"), "{trace}");
}

#[test]
fn without_the_epoch_check_a_stale_writer_lands() {
    let mut b = Bounds::stale_writer();
    b.mutations.decode.skip_epoch_check = true;
    let r = run(&b);
    let trace = violated(&r, "K2");
    assert!(trace.contains("STALE WRITER"), "{trace}");
    assert!(trace.contains("=> K2: a page of request"), "{trace}");
    // With the check, the same stale writer is fenced (the CI test above
    // runs this bound set clean).
}

/// The glue between a node's machine and its engine is production code
/// too (`transfer::node`), and the model runs it: a bug placed there — the
/// engine started on a request's reservation as soon as `Done` arrives,
/// before the completeness check's verdict is acted on — is found.
#[test]
fn glue_that_starts_decode_before_the_verdict_reads_unwritten_pages() {
    // Frames in any order (nothing lost or duplicated): `Done` may
    // overtake the pages it follows.
    let mut b = Bounds::adversarial();
    b.cancels = 0;
    b.network = Network::Adversarial {
        drops: 0,
        duplicates: 0,
    };
    b.mutations.glue.start_before_verdict = true;
    let r = run(&b);
    let trace = violated(&r, "K3/K10");
    assert!(trace.contains("Done"), "{trace}");
    assert!(
        trace.contains("=> K3/K10: decode started request"),
        "{trace}"
    );
}

/// Decode's machine ends a request it is decoding (a cancel) and frees its
/// pages with `StopDecode` to the engine; glue that drops that action
/// leaves the engine running a request nobody holds any more. Before the
/// property "no engine runs a request that the machines have ended", every
/// other check of the search stayed green with this bug.
#[test]
fn glue_that_ignores_stop_decode_leaves_an_ended_request_running() {
    let mut b = Bounds::two_tenants();
    b.requests.truncate(1);
    // Tokens past prefill's first, so the request is decoding when the
    // cancel may land.
    b.requests[0].max_tokens = 3;
    b.cancels = 1;
    b.crashes = 0;
    b.kills = 0;
    b.mutations.glue.skip_stop_decode = true;
    let r = run(&b);
    let trace = violated(&r, "engines");
    assert!(trace.contains("cancel"), "{trace}");
    assert!(
        trace.contains("=> engines: decode's engine runs request 100"),
        "{trace}"
    );
}

/// Speculation's rollback (issue 37): decode's engine verifies a draft row
/// beside each step's; one that leaves a rejected draft's row written makes
/// a page claim a row the sequence never had, and the world's K3 check on
/// the engines catches it in the first state after the rejection.
#[test]
fn a_rejected_draft_left_written_is_caught() {
    let mut b = Bounds::speculation();
    b.cancels = 0;
    b.kills = 0;
    b.mutations.skip_rewind = true;
    let r = run(&b);
    let trace = violated(&r, "engines");
    assert!(trace.contains("decode engine runs a step"), "{trace}");
    assert!(
        trace.contains(
            "=> K3: decode's request 100 page 1 holds Ok(3) written rows, its sequence 2"
        ),
        "{trace}"
    );
}

/// The liveness properties can fail: on a network that loses a frame of a
/// live connection (TCP cannot), a request hangs with its pages held —
/// which is why they are checked on the TCP network only.
#[test]
fn liveness_fails_where_a_live_connection_can_lose_a_frame() {
    let mut b = Bounds::adversarial();
    b.cancels = 0;
    b.liveness_everywhere = true;
    let r = run(&b);
    let trace = violated(&r, "liveness");
    assert!(trace.contains("network LOSES"), "{trace}");
}

#[test]
fn one_cache_scope_for_every_tenant_lets_a_tenant_hold_anothers_cached_page() {
    let mut b = Bounds::two_tenants();
    b.requests[1].prompt = b.requests[0].prompt.clone();
    b.mutations.prefill.one_cache_scope = true;
    let r = run(&b);
    let trace = violated(&r, "K1/K11");
    assert!(trace.contains("=> K11: prefill request"), "{trace}");
}

#[test]
fn a_cache_reference_never_released_leaks_the_page() {
    let mut b = Bounds::prefix_cache();
    b.mutations.prefill.keep_cache_refs = true;
    let r = run(&b);
    let trace = violated(&r, "liveness");
    assert!(trace.contains("leaked"), "{trace}");
}
