//! `transfer` — the prefill→decode KV handoff.
//!
//! * [`wire`] — versioned, length-prefixed binary frames with a limit on
//!   every length, decoded without panics or unbounded allocation whatever
//!   the bytes.
//! * [`decode`], [`prefill`], [`gateway`] — the three sides of the protocol
//!   as sans-IO state machines: each method takes an event (a message on a
//!   connection, a connection's end, the engine's report) and the node's
//!   KV pool, changes state, and appends actions (messages to send,
//!   connections to close, work for the engine). No sockets, threads or
//!   clocks inside: a TCP transport drives them in production, a simulator
//!   and a model checker drive the very same code in tests.
//! * [`fair`] — which waiting request a node gives free pages to next:
//!   fewest pages held per tenant weight first (K13).
//!
//! The lifecycle (`docs/design.md` at the repository root): the gateway reserves pages on
//! decode (decode checks its own limit), then asks prefill to compute into
//! them (prefill checks its own limit); a refusal anywhere ends the request
//! everywhere with that node's original error (K9). Prefill sends pages in
//! bounded batches, each with a checksum bound to (request, destination
//! epoch, position) (K6) and a canary bound to the destination (K7), then
//! `Done`; decode starts only when every prompt page arrived exactly once
//! and every check passed (K10). Pages a transfer may still touch stay
//! leased on both sides until the transfer's end (K4).
//!
//! ```
//! use transfer::wire::{Message, WirePage};
//! use transfer::RequestId;
//!
//! let mut buf = Vec::new();
//! Message::Reserved { req: RequestId(7), pages: vec![WirePage { index: 3, epoch: 5 }] }.encode(&mut buf);
//! let (msg, used) = Message::decode(&buf)?.expect("a whole frame");
//! assert_eq!(used, buf.len());
//! assert!(matches!(msg, Message::Reserved { req: RequestId(7), .. }));
//! // Half a frame is not an error, just not yet a message.
//! assert!(Message::decode(&buf[..buf.len() - 1])?.is_none());
//! # Ok::<(), transfer::wire::WireError>(())
//! ```

#![forbid(unsafe_code)]

/// Whether a test-only mutation is on (always false without the
/// `mutations` feature or `cfg(test)`).
macro_rules! mutated {
    ($s:expr, $f:ident) => {{
        #[cfg(any(test, feature = "mutations"))]
        {
            $s.mutations.$f
        }
        #[cfg(not(any(test, feature = "mutations")))]
        {
            false
        }
    }};
}

mod common;
pub mod convert;
pub mod decode;
pub mod fair;
pub mod gateway;
pub mod node;
pub mod prefill;
pub mod wire;

pub use common::{
    check_peer, check_request, pages_for, refusal, request_owner, role_name, short_hex, slots_at,
    transfer_digest, ConnId, Identity, PeerHello,
};
/// The identities every message names, typed (they are `u64` only inside
/// [`wire`]'s encode and decode): the pool's, so one type end to end.
pub use kv::{RequestId, Scope, TenantId};
