//! Prefix-aware routing (issue 19): a tenant's requests go to the prefill
//! node its last request went to — where its prefix cache is — while that
//! node carries at most `AFFINITY_SLACK_REQUESTS` more than the
//! least-loaded choice; past that, load wins. The gateway machine alone,
//! two prefill and two decode nodes.
//!
//! Mutation: without the affinity, ties rotate between the prefill nodes
//! and `a_tenant_returns_to_its_prefill_node` fails.

mod common;

use common::{gateway, identity};
use transfer::gateway::{Gateway, GatewayAction};
use transfer::wire::{GenSpec, Message, WirePage, ROLE_DECODE, ROLE_PREFILL};
use transfer::{RequestId, TenantId};

/// Submits `req` for `tenant`, lets decode reserve, and returns the
/// prefill connection its Prefill went to.
fn place(gw: &mut Gateway, req: u64, tenant: u64) -> u64 {
    let mut out = Vec::new();
    gw.submit(
        RequestId(req),
        TenantId(tenant),
        vec![1, 2, 3],
        4,
        GenSpec::default(),
        &mut out,
    )
    .unwrap();
    let dconn = out
        .iter()
        .find_map(|a| match a {
            GatewayAction::Send {
                conn,
                msg: Message::Reserve { .. },
            } => Some(*conn),
            _ => None,
        })
        .expect("a Reserve");
    let mut out = Vec::new();
    gw.message(
        dconn,
        Message::Reserved {
            req: RequestId(req),
            pages: vec![WirePage {
                index: req as u32,
                epoch: 1,
            }],
        },
        &mut out,
    );
    out.iter()
        .find_map(|a| match a {
            GatewayAction::Send {
                conn,
                msg: Message::Prefill { .. },
            } => Some(*conn),
            _ => None,
        })
        .expect("a Prefill")
}

#[test]
fn a_tenant_returns_to_its_prefill_node() {
    let mut gw = gateway();
    let home = place(&mut gw, 1, 42);
    gw.cancel(RequestId(1), &mut Vec::new());
    for req in 2..10 {
        // Another tenant in between moves the rotation.
        place(&mut gw, 100 + req, 7);
        gw.cancel(RequestId(100 + req), &mut Vec::new());
        assert_eq!(place(&mut gw, req, 42), home, "request {req}");
        gw.cancel(RequestId(req), &mut Vec::new());
    }
    assert!(gw.stats().affinity_routed_total >= 1);
    assert_eq!(gw.requests(), 0);
}

#[test]
fn load_wins_past_the_slack() {
    let mut gw = gateway();
    let home = place(&mut gw, 1, 42);
    // The next request of the tenant stays home although the other prefill
    // node is idle (within the slack)...
    assert_eq!(place(&mut gw, 2, 42), home);
    assert_eq!(gw.stats().affinity_routed_total, 1);
    // ...but with its requests kept in flight the load moves some away
    // (and the tenant's home follows its latest request).
    let mut used = std::collections::BTreeSet::new();
    for req in 3..12 {
        used.insert(place(&mut gw, req, 42));
    }
    assert_eq!(used.len(), 2, "load never won");
    let (p0, p1) = (gw.nodes()[0].inflight, gw.nodes()[1].inflight);
    assert!(
        p0.abs_diff(p1) <= 1 + transfer::gateway::AFFINITY_SLACK_REQUESTS,
        "{p0} vs {p1}"
    );
}

/// Discovery (`dns:`): a node found later joins, one gone from discovery
/// gets nothing new while its requests finish, and its slot is reused once
/// it is closed and idle.
#[test]
fn nodes_join_and_leave_at_run_time() {
    let mut gw = gateway();
    let mut out = Vec::new();
    // p2 joins.
    let p2 = gw.add_node(ROLE_PREFILL, "p2:1").unwrap();
    assert_eq!(
        gw.add_node(ROLE_PREFILL, "p2:1"),
        Some(p2),
        "known: same slot"
    );
    gw.connected(p2, 12, &mut out);
    gw.message(12, identity("p2").hello(ROLE_PREFILL), &mut out);
    // p0 and p1 leave discovery; a request already on p0 keeps running.
    let on_p0 = {
        let mut req = 1;
        loop {
            let conn = place(&mut gw, req, 1000 + req);
            if conn == 10 {
                break req;
            }
            gw.cancel(RequestId(req), &mut Vec::new());
            req += 1;
            assert!(req < 20, "p0 never chosen");
        }
    };
    gw.retire_node(0);
    gw.retire_node(1);
    for req in 100..106 {
        assert_eq!(place(&mut gw, req, req), 12, "only p2 takes new requests");
        gw.cancel(RequestId(req), &mut Vec::new());
    }
    assert!(
        gw.phase_of(RequestId(on_p0)).is_some(),
        "the running request was not touched"
    );
    // p0's slot cannot be reused while it holds a request and a connection.
    let p3 = gw.add_node(ROLE_PREFILL, "p3:1").unwrap();
    assert!(p3 != 0 && p3 != 1, "a busy retired slot was reused");
    // p1 is idle; once its connection closes its slot is free again.
    gw.closed(11, &mut out);
    assert_eq!(gw.add_node(ROLE_DECODE, "d9:1"), Some(1));
    // Back in discovery: p0 is usable again, in its own slot.
    assert_eq!(gw.add_node(ROLE_PREFILL, "p0:1"), Some(0));
    assert!(!gw.nodes()[0].retired);
    // Bounded.
    let mut last = None;
    for i in 0..transfer::gateway::NODES_MAX {
        last = gw.add_node(ROLE_DECODE, &format!("x{i}:1"));
    }
    assert_eq!(last, None);
    assert!(gw.nodes().len() <= transfer::gateway::NODES_MAX);
}

/// What a node tells the gateway of its load (`Message::Load`).
fn report(gw: &mut Gateway, conn: u64, queued: u32, running: u32, pages_free: u32) {
    gw.message(
        conn,
        Message::Load {
            queued,
            running,
            pages_free,
            pages_total: 100,
        },
        &mut Vec::new(),
    );
}

/// The decode node each of `reqs` went to (conn 20 or 21).
fn decode_of(gw: &mut Gateway, reqs: std::ops::Range<u64>) -> Vec<u64> {
    reqs.map(|req| {
        let mut out = Vec::new();
        gw.submit(
            RequestId(req),
            TenantId(1000 + req),
            vec![1, 2, 3],
            4,
            GenSpec::default(),
            &mut out,
        )
        .unwrap();
        out.iter()
            .find_map(|a| match a {
                GatewayAction::Send {
                    conn,
                    msg: Message::Reserve { .. },
                } => Some(*conn),
                _ => None,
            })
            .expect("a Reserve")
    })
    .collect()
}

/// Another gateway's requests fill d0: this gateway sees none of them in
/// its own counts, only in d0's report, and sends its requests to d1 until
/// its own count there reaches what d0 reported.
///
/// Mutation: `ignore_load_reports` — the gateway alternates d0/d1 and the
/// test fails.
#[test]
fn requests_go_where_the_nodes_report_room() {
    for ignore in [false, true] {
        let mut gw = gateway();
        gw.set_mutations(transfer::gateway::GatewayMutations {
            ignore_load_reports: ignore,
            ..Default::default()
        });
        report(&mut gw, 20, 3, 4, 90);
        report(&mut gw, 21, 0, 0, 100);
        let to = decode_of(&mut gw, 0..6);
        if ignore {
            assert!(to.contains(&20), "{to:?}");
            assert_eq!(gw.stats().load_routed_total, 0);
            continue;
        }
        assert_eq!(to, vec![21; 6], "d0 reported 7 requests");
        assert_eq!(gw.stats().load_reports_total, 2);
        assert_eq!(gw.stats().load_routed_total, 6);
        // Past d0's reported load the two are even again: both are used.
        let more = decode_of(&mut gw, 6..12);
        assert!(more.contains(&20) && more.contains(&21), "{more:?}");
    }
}

/// A decode node that reported too few free pages for a request is passed
/// over while another has them, even if that one carries more requests;
/// when none has room the least-loaded still takes it (and queues there).
#[test]
fn a_decode_node_short_of_pages_is_passed_over() {
    let mut gw = gateway();
    // 3 + 4 tokens = 1 page of 16; d1 has none free, d0 some but is busier.
    report(&mut gw, 20, 0, 5, 10);
    report(&mut gw, 21, 0, 0, 0);
    assert_eq!(decode_of(&mut gw, 0..3), vec![20; 3]);
    report(&mut gw, 20, 0, 5, 0);
    let to = decode_of(&mut gw, 3..5);
    assert_eq!(to, vec![21; 2], "no room anywhere: the least loaded");
}

/// A report lives as long as its connection: a node that reconnects (a
/// restarted process) starts from nothing, and a report from a connection
/// the gateway has not paired is a protocol error, not load.
#[test]
fn a_load_report_ends_with_its_connection() {
    let mut gw = gateway();
    report(&mut gw, 20, 50, 50, 0);
    assert!(gw.nodes()[2].load.is_some());
    let mut out = Vec::new();
    gw.closed(20, &mut out);
    assert_eq!(gw.nodes()[2].load, None);
    gw.connected(2, 30, &mut out);
    report(&mut gw, 30, 50, 50, 0);
    assert_eq!(gw.nodes()[2].load, None, "a report before the Hello");
    assert_eq!(gw.stats().protocol_errors_total, 1);
    // The closed link's requests and counts are the gateway's own again.
    gw.message(30, identity("d0").hello(ROLE_DECODE), &mut out);
    assert_eq!(decode_of(&mut gw, 0..2).len(), 2);
}
