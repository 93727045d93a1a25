//! `pd` — the prefill and decode nodes of disaggregated serving.
//!
//! * [`role`] — the engine in a PD role: [`role::PdNode`] runs the batch
//!   core ([`engine::Core`]: model, pool, batch) and the role's sans-IO
//!   transfer state machine on one thread, joined by [`transfer::node`]'s
//!   glue — the code the simulator and the model checker run.
//! * [`node`] — a [`role::PdNode`] behind the TCP transport (the
//!   `transport` crate), and its metric families ([`node::NODE_METRICS`]).
//! * [`ops`] — the node's operations listener (metrics, samples, console,
//!   health, ready) on the server's hyper/axum stack.
//!
//! The gateway is its own crate (`gateway`), which links no model.
//!
//! The state machines are the ones the simulator and the model checker
//! run (`testkit::sim`); this crate only moves their messages.
//!
//! ```no_run
//! # async fn f(model: model::Model, tok: tokenizer::Tokenizer, fp: [u8; 32]) -> Result<(), Box<dyn std::error::Error>> {
//! use pd::role::{PdConfig, PdRole};
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let pd = PdConfig { node: "decode-0".into(), fingerprint: fp, ..PdConfig::default() };
//! let node = pd::node::start_node(PdRole::Decode, model, tok, engine::EngineConfig::default(),
//!                                 pd, listener, transport::TransportConfig::default())?;
//! println!("decode node on {}", node.addr);
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

pub mod node;
pub mod ops;
pub mod role;
mod spans;
