//! `transfer` — the prefill→decode KV handoff.
//!
//! This crate holds the wire format ([`wire`]): versioned, length-prefixed
//! binary frames with a limit on every length, decoded without panics or
//! unbounded allocation whatever the bytes. The sans-IO state machines of
//! the prefill, decode and gateway sides (pure `step(state, event) ->
//! actions`, driven by a TCP transport in production and by a simulator and
//! a model checker in tests) build on it (see `../shared/DESIGN.md`, PD
//! request lifecycle).
//!
//! ```
//! use transfer::wire::{Message, WirePage};
//!
//! let mut buf = Vec::new();
//! Message::Reserved { req: 7, pages: vec![WirePage { index: 3, epoch: 5 }] }.encode(&mut buf);
//! let (msg, used) = Message::decode(&buf)?.expect("a whole frame");
//! assert_eq!(used, buf.len());
//! assert!(matches!(msg, Message::Reserved { req: 7, .. }));
//! // Half a frame is not an error, just not yet a message.
//! assert!(Message::decode(&buf[..buf.len() - 1])?.is_none());
//! # Ok::<(), transfer::wire::WireError>(())
//! ```

pub mod wire;
