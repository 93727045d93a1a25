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
use transfer::{RequestId, TenantId};

fn submit(gw: &mut Gateway, req: RequestId) -> Vec<GatewayAction> {
    let mut out = Vec::new();
    gw.submit(
        req,
        TenantId(1),
        vec![1, 2, 3],
        4,
        GenSpec::default(),
        &mut out,
    )
    .unwrap();
    out
}

/// The decode connection a Reserve went to, and the request's id on the
/// wire (a re-placement's differs from the client's).
fn reserve_of(out: &[GatewayAction]) -> Option<(u64, RequestId)> {
    out.iter().find_map(|a| match a {
        GatewayAction::Send {
            conn,
            msg: Message::Reserve { req, .. },
        } => Some((*conn, *req)),
        _ => None,
    })
}

/// The decode connection a Reserve for the client's `req` went to (its
/// first placement: the wire id is the client id).
fn reserved_on(out: &[GatewayAction], req: RequestId) -> Option<u64> {
    reserve_of(out).filter(|&(_, w)| w == req).map(|(c, _)| c)
}

/// Decode's answer to a Reserve: one page reserved for `wire`.
fn reserved(gw: &mut Gateway, conn: u64, wire: RequestId, out: &mut Vec<GatewayAction>) {
    let page = transfer::wire::WirePage { index: 3, epoch: 1 };
    gw.message(
        conn,
        Message::Reserved {
            req: wire,
            pages: vec![page],
        },
        out,
    );
}

/// The prefill connection a Prefill went to.
fn prefill_of(out: &[GatewayAction]) -> Option<u64> {
    out.iter().find_map(|a| match a {
        GatewayAction::Send {
            conn,
            msg: Message::Prefill { .. },
        } => Some(*conn),
        _ => None,
    })
}

fn draining_reject(gw: &mut Gateway, conn: u64, req: RequestId, node: &str) -> Vec<GatewayAction> {
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
    let out = submit(&mut gw, RequestId(1));
    let first = reserved_on(&out, RequestId(1)).expect("a Reserve");
    let (other, name) = if first == 20 { (21, "d0") } else { (20, "d1") };
    let out = draining_reject(&mut gw, first, RequestId(1), name);
    assert_eq!(reserve_of(&out).map(|(c, _)| c), Some(other), "{out:?}");
    assert!(
        !out.iter()
            .any(|a| matches!(a, GatewayAction::Deliver { .. })),
        "the client heard nothing: {out:?}"
    );
    assert_eq!(gw.stats().replaced_draining_total, 1);
    assert_eq!(gw.requests(), 1);
    // From now on nothing goes to the draining node.
    for req in (2..8).map(RequestId) {
        assert_eq!(reserved_on(&submit(&mut gw, req), req), Some(other));
    }
    let drained = gw.nodes().iter().filter(|n| n.draining).count();
    assert_eq!(drained, 1);
}

#[test]
fn a_draining_prefill_hands_the_request_to_the_other_prefill_and_frees_decode() {
    let mut gw = gateway();
    let out = submit(&mut gw, RequestId(1));
    let dconn = reserved_on(&out, RequestId(1)).unwrap();
    let mut out = Vec::new();
    gw.message(
        dconn,
        Message::Reserved {
            req: RequestId(1),
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
    let out = draining_reject(&mut gw, pconn, RequestId(1), name);
    // Decode's reservation is cancelled, and the request reserved again.
    assert!(out.iter().any(|a| matches!(
        a,
        GatewayAction::Send { conn, msg: Message::Cancel { req: RequestId(1) } } if *conn == dconn
    )));
    // The next prefill for it goes to the other prefill node.
    let (d2, wire) = reserve_of(&out).expect("reserved again");
    let mut out = Vec::new();
    gw.message(
        d2,
        Message::Reserved {
            req: wire,
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
    let mut out = submit(&mut gw, RequestId(1));
    let mut delivered = None;
    for round in 0..=PLACEMENTS_MAX {
        let Some((conn, wire)) = reserve_of(&out) else {
            break;
        };
        // Whichever decode got it claims to be draining; a reconnect (a
        // restarted node) clears the mark so placement can go on.
        out = draining_reject(&mut gw, conn, wire, "dx");
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
    assert_eq!(
        reserved_on(&submit(&mut gw, RequestId(9)), RequestId(9)),
        Some(30)
    );
}

#[test]
fn a_request_refused_by_a_draining_node_fails_without_replacement() {
    // Once a token reached the client the request is never placed again:
    // only the pre-token phases move.
    let mut gw = gateway();
    let out = submit(&mut gw, RequestId(1));
    let dconn = reserved_on(&out, RequestId(1)).unwrap();
    let mut out = Vec::new();
    gw.message(
        dconn,
        Message::Reserved {
            req: RequestId(1),
            pages: vec![transfer::wire::WirePage { index: 3, epoch: 1 }],
        },
        &mut out,
    );
    gw.message(
        dconn,
        Message::Token {
            req: RequestId(1),
            index: 0,
            id: 5,
            text: "x".into(),
            logprobs: None,
        },
        &mut out,
    );
    let out = draining_reject(&mut gw, dconn, RequestId(1), "d");
    assert!(reserved_on(&out, RequestId(1)).is_none());
    assert!(out.iter().any(|a| matches!(
        a,
        GatewayAction::Deliver { event: ClientEvent::Error(e), .. } if e.code == "draining"
    )));
}

/// Found by the multi-host rolling restart: a prefill node drained while a
/// request's pages were reserved on decode; the gateway cancelled the
/// reservation and placed the request again under the same id — on the
/// same decode node, which still held the cancelled reservation (waiting
/// for the draining prefill's last word), and refused the new one as
/// `duplicate_request` (400 to the client). Every placement now has its
/// own wire id; the client's id never changes.
#[test]
fn incident_replaced_request_reused_its_wire_id() {
    let mut gw = gateway();
    let out = submit(&mut gw, RequestId(1));
    let (dconn, first) = reserve_of(&out).unwrap();
    assert_eq!(
        first,
        RequestId(1),
        "a first placement is known by the client's id"
    );
    let mut out = Vec::new();
    reserved(&mut gw, dconn, RequestId(1), &mut out);
    let pconn = prefill_of(&out).unwrap();
    let name = if pconn == 10 { "p0" } else { "p1" };
    let out = draining_reject(&mut gw, pconn, RequestId(1), name);
    let (d2, wire) = reserve_of(&out).expect("placed again");
    assert_ne!(
        wire, first,
        "the same id again: a node may still hold the old one"
    );
    // Late words about the old placement change nothing of the new one:
    // the old decode's reservation answer is cancelled, the old prefill's
    // refusal ignored.
    let mut late = Vec::new();
    reserved(&mut gw, dconn, RequestId(1), &mut late);
    assert!(
        late.iter().all(|a| matches!(
            a,
            GatewayAction::Send {
                msg: Message::Cancel { req: RequestId(1) },
                ..
            }
        )),
        "{late:?}"
    );
    gw.message(
        pconn,
        Message::Rejected {
            req: RequestId(1),
            error: refusal::draining(name),
        },
        &mut late,
    );
    assert!(
        !late
            .iter()
            .any(|a| matches!(a, GatewayAction::Deliver { .. })),
        "{late:?}"
    );
    assert_eq!(
        gw.phase_of(RequestId(1)),
        Some(transfer::gateway::GatewayPhase::Reserving)
    );
    // The new placement runs to its end under its wire id; the client
    // hears of it under its own.
    let mut out = Vec::new();
    reserved(&mut gw, d2, wire, &mut out);
    assert!(prefill_of(&out).is_some());
    gw.message(
        d2,
        Message::Token {
            req: wire,
            index: 0,
            id: 5,
            text: "x".into(),
            logprobs: None,
        },
        &mut out,
    );
    gw.message(
        d2,
        Message::Finished {
            req: wire,
            finish: 0,
            prompt_tokens: 3,
            cached_tokens: 0,
            completion_tokens: 1,
            streamed: 1,
            prediction: Default::default(),
            tail_text: String::new(),
        },
        &mut out,
    );
    let delivered: Vec<RequestId> = out
        .iter()
        .filter_map(|a| match a {
            GatewayAction::Deliver { req, .. } => Some(*req),
            _ => None,
        })
        .collect();
    assert_eq!(delivered, vec![RequestId(1), RequestId(1)]);
    assert_eq!(gw.requests(), 0);
    assert!(gw.nodes().iter().all(|n| n.inflight == 0));
    // A client cancel finds the request by the client's id too.
    let out = submit(&mut gw, RequestId(2));
    let (c2, _) = reserve_of(&out).unwrap();
    let out = draining_reject(&mut gw, c2, RequestId(2), "dx");
    let (_, w2) = reserve_of(&out).unwrap();
    let mut out = Vec::new();
    gw.cancel(RequestId(2), &mut out);
    assert!(out.iter().any(
        |a| matches!(a, GatewayAction::Send { msg: Message::Cancel { req }, .. } if *req == w2)
    ));
    assert_eq!(gw.requests(), 0);
}

/// A node lost (killed, cut off, or exited after a drain while a request it
/// never saw was on its way) before any token reached the client: the
/// request goes to another pair under a new wire id; the client hears
/// nothing of it. Once a token went out, the loss is the client's error.
///
/// Mutation: fail every request of a lost node (the pre-issue-19
/// behaviour) and the first half fails.
#[test]
fn a_node_lost_before_the_first_token_costs_the_request_nothing() {
    let mut gw = gateway();
    let out = submit(&mut gw, RequestId(1));
    let (dconn, _) = reserve_of(&out).unwrap();
    let mut out = Vec::new();
    reserved(&mut gw, dconn, RequestId(1), &mut out);
    assert!(prefill_of(&out).is_some());
    // The decode node holding the reservation is lost mid-prefill.
    let mut out = Vec::new();
    gw.closed(dconn, &mut out);
    let (d2, wire) = reserve_of(&out).expect("placed again");
    assert_ne!(d2, dconn);
    assert_ne!(wire, RequestId(1));
    assert!(
        !out.iter()
            .any(|a| matches!(a, GatewayAction::Deliver { .. })),
        "{out:?}"
    );
    assert_eq!(gw.stats().replaced_node_lost_total, 1);
    assert_eq!(gw.stats().failed_node_lost_total, 0);
    // Streaming from the new decode node; then it is lost too: now the
    // client has tokens, and the request fails with the loss.
    let mut out = Vec::new();
    reserved(&mut gw, d2, wire, &mut out);
    gw.message(
        d2,
        Message::Token {
            req: wire,
            index: 0,
            id: 5,
            text: "x".into(),
            logprobs: None,
        },
        &mut out,
    );
    let mut out = Vec::new();
    gw.closed(d2, &mut out);
    let err = out.iter().find_map(|a| match a {
        GatewayAction::Deliver {
            req: RequestId(1),
            event: ClientEvent::Error(e),
        } => Some(e.clone()),
        _ => None,
    });
    assert_eq!(err.map(|e| e.code), Some("decode_lost".to_string()));
    assert_eq!(gw.requests(), 0);
    assert!(gw.nodes().iter().all(|n| n.inflight == 0));
    // No decode node left: a new request is refused at once.
    let e = gw
        .submit(
            RequestId(2),
            TenantId(1),
            vec![1, 2, 3],
            4,
            GenSpec::default(),
            &mut Vec::new(),
        )
        .unwrap_err();
    assert_eq!(e.status, 503);
}

/// A prefill node that lost its link to the request's decode node says so
/// (`decode_lost`) before any token: the gateway places the request again,
/// as for a loss it saw itself. Found by the multi-host test's cable pulled
/// mid-transfer (the prefill's report arrived before the gateway's own
/// heartbeat timeout, and ended the request).
#[test]
fn a_peer_lost_report_before_the_first_token_places_the_request_again() {
    let mut gw = gateway();
    let out = submit(&mut gw, RequestId(1));
    let (dconn, _) = reserve_of(&out).unwrap();
    let mut out = Vec::new();
    reserved(&mut gw, dconn, RequestId(1), &mut out);
    let pconn = prefill_of(&out).unwrap();
    let mut out = Vec::new();
    gw.message(
        pconn,
        Message::Rejected {
            req: RequestId(1),
            error: refusal::upstream("decode_lost", "the link to decode was lost"),
        },
        &mut out,
    );
    assert!(reserve_of(&out).is_some(), "{out:?}");
    assert!(
        !out.iter()
            .any(|a| matches!(a, GatewayAction::Deliver { .. })),
        "{out:?}"
    );
    assert_eq!(gw.stats().replaced_node_lost_total, 1);
}
