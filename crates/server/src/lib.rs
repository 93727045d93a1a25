//! `server` — isoserve's OpenAI-compatible HTTP layer over any
//! [`request::Backend`]: the unified `engine::Engine` or the PD gateway.
//! It speaks the request vocabulary (`request`), the tokenizer and
//! `telemetry`'s metrics (the encoder and the family tables), and links no
//! model, kernel or pool.
//!
//! * **Endpoints.** `POST /v1/chat/completions`, `POST /v1/completions` and
//!   `POST /v1/responses` (OpenAI's Responses API, stateless) — streaming as
//!   server-sent events, or one JSON response; `n` choices of a prompt are
//!   `n` engine requests merged into one answer — `GET
//!   /v1/models`, `POST /tokenize`, `GET /health`, `GET /metrics`
//!   (Prometheus text), the operator's `/console`. Requests and responses
//!   follow OpenAI's JSON shapes, one module per endpoint ([`openai`]);
//!   every error is `{"error":{"message","type","param","code"}}`
//!   ([`error::ApiError`]).
//! * **Tenants.** `Authorization: Bearer KEY` is hashed (SHA-256) and
//!   compared in constant time with every tenant's hash ([`tenants`]); the
//!   tenant's id becomes the KV pool owner of its requests. Per-tenant
//!   concurrency and tokens-per-minute limits answer 429 with `Retry-After`.
//! * **Order of checks.** Shutting down (503) → authentication (401) → body
//!   size (413) → JSON, types and ranges (400, naming the field) → model
//!   (404) → tokenisation and the context window (400
//!   `context_length_exceeded`, before anything is queued or allocated) →
//!   tenant limits (429) → the engine's queue (429). Every refusal is
//!   counted in `/metrics` and written to the request log.
//! * **Cancellation.** The engine's [`request::RequestHandle`] lives inside
//!   the response future (non-streaming) or inside the SSE body stream
//!   (streaming). When the client goes away hyper drops either, the handle is
//!   dropped, and the engine frees the request's pages at its next step.
//! * **Limits.** Body size, body read time, header size and count, header
//!   read time, connections, stop strings, `top_logprobs`, `max_tokens`,
//!   messages and content parts are all bounded ([`ServerConfig`], [`openai`]).
//! * **Shutdown.** [`Server::run`] stops admitting when its shutdown future
//!   resolves (new requests get 503, `/health` 503), lets running requests
//!   finish for up to [`ServerConfig::shutdown_grace`], then cancels the rest
//!   and returns.
//!
//! ```no_run
//! use server::{Server, ServerConfig, tenants::Tenants};
//!
//! # async fn f(model: model::Model, tok: tokenizer::Tokenizer,
//! #            template: Option<tokenizer::ChatTemplate>) -> Result<(), Box<dyn std::error::Error>> {
//! let engine = engine::Engine::start(model, tok.clone(), engine::EngineConfig::default())?;
//! let cfg = ServerConfig::new("SmolLM2-135M-Instruct.Q4_1");
//! let server = Server::new(engine, tok, template, Tenants::anonymous(), None, cfg);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! // Serves until Ctrl-C, then drains and returns.
//! server
//!     .run(listener, async {
//!         let _ = tokio::signal::ctrl_c().await;
//!     })
//!     .await?;
//! # Ok(()) }
//! ```

//! ## Code map
//!
//! `serve` (the accept loop, shutdown) → `http` (the router, admission,
//! the streaming loop) → one module per endpoint: [`openai`]'s `chat`,
//! `completions`, `responses` and `models`; `tokenize`; `ops` (`/health`,
//! `/metrics`); `console`. Beside them: `state` (what handlers share),
//! [`config`], [`tenants`], [`error`], [`metrics`], [`reqlog`], [`door`].
//! Nothing imports back into this file.

#![forbid(unsafe_code)]

mod accounting;
pub mod anthropic;
pub mod config;
mod console;
pub mod door;
pub mod error;
mod http;
pub mod metrics;
pub mod openai;
mod ops;
pub mod reqlog;
mod serve;
mod state;
pub mod tenants;
mod tokenize;

pub use crate::config::{ServerConfig, MAX_BODY_BYTES_DEFAULT};
pub use crate::error::{ApiError, ServerError};
pub use crate::serve::Server;
