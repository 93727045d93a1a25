//! Drain (issue 19): a node that refuses a request because it is draining
//! is routed around, and the request — no token delivered yet — is placed
//! on another pair, at most `PLACEMENTS_MAX` times; a reconnect clears the
//! mark. The gateway machine alone, with two prefill and two decode nodes.
//!
//! Mutation: `a_request_refused_by_a_draining_node_fails_without_replacement`
//! pins what a gateway that ends such a request (the pre-drain behaviour)
//! would answer — and the first test fails if re-placement is removed.

mod common;

use common::{gateway, identity};
use transfer::gateway::{ClientEvent, Gateway, GatewayAction, PLACEMENTS_MAX};
use transfer::refusal;
use transfer::wire::{GenSpec, Message, ROLE_DECODE};

fn submit(gw: &mut Gateway, req: u64) -> Vec<GatewayAction> {
    let mut out = Vec::new();
    gw.submit(req, 1, vec![1, 2, 3], 4, GenSpec::default(), &mut out)
        .unwrap();
    out
}

/// The decode connection a Reserve for `req` went to.
fn reserved_on(out: &[GatewayAction], req: u64) -> Option<u64> {
    out.iter().find_map(|a| match a {
        GatewayAction::Send {
            conn,
            msg: Message::Reserve { req: r, .. },
        } if *r == req => Some(*conn),
        _ => None,
    })
}

fn draining_reject(gw: &mut Gateway, conn: u64, req: u64, node: &str) -> Vec<GatewayAction> {
    let mut out = Vec::new();
    gw.message(
        conn,
        Message::Rejected {
            req,
            error: refusal::draining(node),
        },
        &mut out,
    );
    out
}

#[test]
fn a_request_refused_by_a_draining_decode_goes_to_the_other_one() {
    let mut gw = gateway();
    let out = submit(&mut gw, 1);
    let first = reserved_on(&out, 1).expect("a Reserve");
    let (other, name) = if first == 20 { (21, "d0") } else { (20, "d1") };
    let out = draining_reject(&mut gw, first, 1, name);
    assert_eq!(reserved_on(&out, 1), Some(other), "{out:?}");
    assert!(
        !out.iter()
            .any(|a| matches!(a, GatewayAction::Deliver { .. })),
        "the client heard nothing: {out:?}"
    );
    assert_eq!(gw.stats().replaced_draining_total, 1);
    assert_eq!(gw.requests(), 1);
    // From now on nothing goes to the draining node.
    for req in 2..8 {
        assert_eq!(reserved_on(&submit(&mut gw, req), req), Some(other));
    }
    let drained = gw.nodes().iter().filter(|n| n.draining).count();
    assert_eq!(drained, 1);
}

#[test]
fn a_draining_prefill_hands_the_request_to_the_other_prefill_and_frees_decode() {
    let mut gw = gateway();
    let out = submit(&mut gw, 1);
    let dconn = reserved_on(&out, 1).unwrap();
    let mut out = Vec::new();
    gw.message(
        dconn,
        Message::Reserved {
            req: 1,
            pages: vec![transfer::wire::WirePage { index: 3, epoch: 1 }],
        },
        &mut out,
    );
    let pconn = out
        .iter()
        .find_map(|a| match a {
            GatewayAction::Send {
                conn,
                msg: Message::Prefill { .. },
            } => Some(*conn),
            _ => None,
        })
        .expect("a Prefill");
    let name = if pconn == 10 { "p0" } else { "p1" };
    let out = draining_reject(&mut gw, pconn, 1, name);
    // Decode's reservation is cancelled, and the request reserved again.
    assert!(out.iter().any(|a| matches!(
        a,
        GatewayAction::Send { conn, msg: Message::Cancel { req: 1 } } if *conn == dconn
    )));
    assert!(reserved_on(&out, 1).is_some(), "{out:?}");
    // The next prefill for it goes to the other prefill node.
    let d2 = reserved_on(&out, 1).unwrap();
    let mut out = Vec::new();
    gw.message(
        d2,
        Message::Reserved {
            req: 1,
            pages: vec![transfer::wire::WirePage { index: 4, epoch: 1 }],
        },
        &mut out,
    );
    let p2 = out.iter().find_map(|a| match a {
        GatewayAction::Send {
            conn,
            msg: Message::Prefill { .. },
        } => Some(*conn),
        _ => None,
    });
    assert_eq!(p2, Some(if pconn == 10 { 11 } else { 10 }));
}

#[test]
fn when_every_node_drains_the_request_fails_with_503_and_nothing_leaks() {
    let mut gw = gateway();
    let mut out = submit(&mut gw, 1);
    let mut delivered = None;
    for round in 0..=PLACEMENTS_MAX {
        let Some(conn) = reserved_on(&out, 1) else {
            break;
        };
        // Whichever decode got it claims to be draining; a reconnect (a
        // restarted node) clears the mark so placement can go on.
        out = draining_reject(&mut gw, conn, 1, "dx");
        delivered = out.iter().find_map(|a| match a {
            GatewayAction::Deliver {
                event: ClientEvent::Error(e),
                ..
            } => Some(e.clone()),
            _ => None,
        });
        if delivered.is_some() {
            assert!(round >= 1, "both decodes were tried first (round {round})");
            break;
        }
    }
    let e = delivered.expect("the request fails in the end");
    assert_eq!(e.status, 503);
    assert_eq!(gw.requests(), 0);
    assert!(gw.nodes().iter().all(|n| n.inflight == 0));
    // Both decodes are marked; a reconnect of one clears its mark.
    let mut o = Vec::new();
    gw.closed(20, &mut o);
    gw.connected(2, 30, &mut o);
    gw.message(30, identity("d0").hello(ROLE_DECODE), &mut o);
    assert_eq!(reserved_on(&submit(&mut gw, 9), 9), Some(30));
}

#[test]
fn a_request_refused_by_a_draining_node_fails_without_replacement() {
    // Once a token reached the client the request is never placed again:
    // only the pre-token phases move.
    let mut gw = gateway();
    let out = submit(&mut gw, 1);
    let dconn = reserved_on(&out, 1).unwrap();
    let mut out = Vec::new();
    gw.message(
        dconn,
        Message::Reserved {
            req: 1,
            pages: vec![transfer::wire::WirePage { index: 3, epoch: 1 }],
        },
        &mut out,
    );
    gw.message(
        dconn,
        Message::Token {
            req: 1,
            index: 0,
            id: 5,
            text: "x".into(),
            logprobs: None,
        },
        &mut out,
    );
    let out = draining_reject(&mut gw, dconn, 1, "d");
    assert!(reserved_on(&out, 1).is_none());
    assert!(out.iter().any(|a| matches!(
        a,
        GatewayAction::Deliver { event: ClientEvent::Error(e), .. } if e.code == "draining"
    )));
}
