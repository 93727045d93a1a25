//! `pd` — disaggregated prefill/decode over TCP.
//!
//! * [`transport`] — length-prefixed frames over TCP with heartbeats and a
//!   limit on every queue; it turns bytes into messages and connection ends
//!   into events, and knows nothing of the protocol.
//! * [`role`] — the engine in a PD role: [`role::PdNode`] runs the batch
//!   core ([`engine::Core`]: model, pool, batch) and the role's sans-IO
//!   transfer state machine on one thread, joined by [`transfer::node`]'s
//!   glue — the code the simulator and the model checker run.
//! * [`node`] — a [`role::PdNode`] behind a transport.
//! * [`gateway`] — the gateway as an [`engine::Backend`] for the HTTP layer:
//!   the [`transfer::gateway::Gateway`] state machine over connections that
//!   a manager keeps up (reconnect with backoff re-reads each node's limit).
//!
//! The state machines are the ones the simulator and the model checker
//! run (`transfer::sim`); this crate only moves their messages.
//!
//! ```no_run
//! # async fn f(model: model::Model, tok: tokenizer::Tokenizer, fp: [u8; 32]) -> Result<(), Box<dyn std::error::Error>> {
//! use pd::role::{PdConfig, PdRole};
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let pd = PdConfig { node: "decode-0".into(), fingerprint: fp, ..PdConfig::default() };
//! let node = pd::node::start_node(PdRole::Decode, model, tok, engine::EngineConfig::default(),
//!                                 pd, listener, pd::transport::TransportConfig::default())?;
//! println!("decode node on {}", node.addr);
//! # Ok(()) }
//! ```

pub mod gateway;
pub mod node;
pub mod role;
pub mod transport;
