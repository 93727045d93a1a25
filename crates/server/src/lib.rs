//! `server` — isoserve's OpenAI-compatible HTTP layer over any
//! [`request::Backend`]: the unified `engine::Engine` or the PD gateway.
//! It speaks the request vocabulary (`request`) and the tokenizer, and
//! links no model, kernel or pool.
//!
//! * **Endpoints.** `POST /v1/chat/completions`, `POST /v1/completions` and
//!   `POST /v1/responses` (OpenAI's Responses API, stateless) — streaming as
//!   server-sent events, or one JSON response; `n` choices of a prompt are
//!   `n` engine requests merged into one answer — `GET
//!   /v1/models`, `GET /health`, `GET /metrics` (Prometheus text). Requests
//!   and responses follow OpenAI's JSON shapes ([`api`]); every error is
//!   `{"error":{"message","type","param","code"}}` ([`error::ApiError`]).
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
//!   messages and content parts are all bounded ([`ServerConfig`], [`api`]).
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

pub mod api;
mod console;
pub mod door;
pub mod error;
mod http;
pub mod metrics;
pub mod reqlog;
pub mod tenants;

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use request::Backend;
use tokenizer::{ChatTemplate, Tokenizer};
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore};

pub use crate::error::{ApiError, ServerError};
use crate::metrics::Metrics;
use crate::reqlog::RequestLog;
use crate::tenants::Tenants;

/// Limits and settings of the HTTP layer.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The served model's id (the GGUF file stem); `default` is an alias.
    pub model_id: String,
    /// Other names clients may send as `model` (a known model's short
    /// name); `/v1/models` lists the id alone.
    pub model_aliases: Vec<String>,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Time to receive a request body.
    pub body_timeout: Duration,
    /// Largest request head (request line and headers).
    pub header_limit: usize,
    /// Most request headers.
    pub max_headers: usize,
    /// Time to receive a request head.
    pub header_timeout: Duration,
    /// Most open connections; beyond it a connection gets 503 (`/health`
    /// is still answered: [`door`]).
    pub max_connections: usize,
    /// Most open connections from one client address; beyond it 429.
    pub max_connections_per_client: usize,
    /// Time a new connection has to send its first request byte.
    pub first_byte_timeout: Duration,
    /// `max_tokens` of a request that sets none: the rest of the window,
    /// capped at this (every request reserves pages for its whole
    /// `prompt + max_tokens` up front).
    pub default_max_tokens: usize,
    /// How long running requests may take to finish after a shutdown signal.
    pub shutdown_grace: Duration,
    /// Write prompt text to the request log.
    pub log_prompts: bool,
}

/// Default body limit: 4 MiB.
pub const MAX_BODY_BYTES_DEFAULT: usize = 4 << 20;

impl ServerConfig {
    pub fn new(model_id: impl Into<String>) -> ServerConfig {
        ServerConfig {
            model_id: model_id.into(),
            model_aliases: Vec::new(),
            max_body_bytes: MAX_BODY_BYTES_DEFAULT,
            body_timeout: Duration::from_secs(30),
            header_limit: 64 << 10,
            max_headers: 100,
            header_timeout: Duration::from_secs(30),
            max_connections: 1024,
            max_connections_per_client: 256,
            first_byte_timeout: Duration::from_secs(5),
            default_max_tokens: 1024,
            shutdown_grace: Duration::from_secs(30),
            log_prompts: false,
        }
    }

    /// Whether a request's `model` names the served model.
    pub fn serves_model(&self, name: &str) -> bool {
        name == self.model_id || name == "default" || self.model_aliases.iter().any(|a| a == name)
    }

    fn validate(&self) -> Result<(), ServerError> {
        let bad = |w: &str| Err(ServerError::Config(w.to_string()));
        if self.model_id.is_empty() {
            return bad("the model id is empty");
        }
        if self.max_body_bytes == 0 {
            return bad("the body limit must be positive");
        }
        if self.header_limit < 1024 {
            return bad("the header limit must be at least 1024 bytes");
        }
        if self.max_headers == 0
            || self.max_connections == 0
            || self.max_connections_per_client == 0
            || self.default_max_tokens == 0
        {
            return bad(
                "header count, connections (in all and per client) and default max_tokens must \
                 be positive",
            );
        }
        if self.first_byte_timeout.is_zero() {
            return bad("the first-byte timeout must be positive");
        }
        Ok(())
    }
}

/// Shared state of every handler.
pub(crate) struct AppState {
    pub engine: Arc<dyn Backend>,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    pub tenants: Tenants,
    pub metrics: Metrics,
    pub reqlog: Option<RequestLog>,
    pub cfg: ServerConfig,
    pub vocab: usize,
    pub started: u64,
    pub console: console::ConsoleState,
    shutting_down: AtomicBool,
    inflight: AtomicUsize,
    inflight_changed: Notify,
}

impl AppState {
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::SeqCst)
    }

    /// The advertised limit now (K8).
    pub fn max_request(&self) -> usize {
        self.engine.max_request_tokens()
    }
}

/// An admitted request's place in the in-flight count (what shutdown waits
/// for); released on drop.
pub(crate) struct InflightGuard(Arc<AppState>);

impl InflightGuard {
    pub fn new(st: &Arc<AppState>) -> InflightGuard {
        st.inflight.fetch_add(1, Ordering::SeqCst);
        InflightGuard(st.clone())
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
        self.0.inflight_changed.notify_waiters();
    }
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The HTTP server.
pub struct Server {
    state: Arc<AppState>,
}

impl Server {
    /// A server over a started backend (the unified `engine::Engine`, or
    /// the PD gateway). `tokenizer` and `template` must be its model's.
    pub fn new(
        engine: impl Backend + 'static,
        tokenizer: Tokenizer,
        template: Option<ChatTemplate>,
        tenants: Tenants,
        reqlog: Option<RequestLog>,
        cfg: ServerConfig,
    ) -> Server {
        Server::with_backend(Arc::new(engine), tokenizer, template, tenants, reqlog, cfg)
    }

    /// A server over any backend (the PD gateway).
    pub fn with_backend(
        engine: Arc<dyn Backend>,
        tokenizer: Tokenizer,
        template: Option<ChatTemplate>,
        tenants: Tenants,
        reqlog: Option<RequestLog>,
        cfg: ServerConfig,
    ) -> Server {
        let vocab = tokenizer.vocab_size();
        Server {
            state: Arc::new(AppState {
                engine,
                tokenizer,
                template,
                tenants,
                metrics: Metrics::new(),
                reqlog,
                cfg,
                vocab,
                started: unix_now(),
                console: console::ConsoleState::default(),
                shutting_down: AtomicBool::new(false),
                inflight: AtomicUsize::new(0),
                inflight_changed: Notify::new(),
            }),
        }
    }

    /// The operations routes (`/metrics` and `/health`, no key), for a
    /// listener of their own (`--metrics-port`).
    pub fn ops_router(&self) -> axum::Router {
        http::ops_router(self.state.clone())
    }

    /// Serves the operations routes on `listener` in a task of its own
    /// (it runs as long as the runtime does).
    pub fn spawn_ops(&self, listener: TcpListener) {
        let ops = self.ops_router();
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, ops).await {
                tracing::error!("the metrics listener stopped: {e}");
            }
        });
    }

    /// The routes, for serving with any hyper/axum setup (tests use it
    /// directly).
    pub fn router(&self) -> axum::Router {
        http::router(self.state.clone())
    }

    /// Serves `listener` until `shutdown` resolves, then drains: no new
    /// requests (503), running ones get up to `shutdown_grace` to finish,
    /// the rest are cancelled; idle connections are closed and the engine
    /// is stopped. Returns when all of that is done.
    pub async fn run<F>(self, listener: TcpListener, shutdown: F) -> Result<(), ServerError>
    where
        F: Future<Output = ()> + Send,
    {
        let st = self.state.clone();
        st.cfg.validate()?;
        let app = self.router();
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(st.cfg.header_timeout)
            .max_header_size(st.cfg.header_limit)
            .max_headers(st.cfg.max_headers)
            .keep_alive(true);
        let graceful = GracefulShutdown::new();
        let conns = Arc::new(Semaphore::new(st.cfg.max_connections));
        let door = door::Door::new(st.cfg.max_connections_per_client);
        let overflow = Arc::new(Semaphore::new(door::OVERFLOW_MAX));
        let lane_door = door::Door::new(door::OVERFLOW_PER_CLIENT);
        let over_client = http::overflow_router(
            st.clone(),
            door::Overflow::Client {
                limit: st.cfg.max_connections_per_client,
            },
        );
        let over_server = http::overflow_router(
            st.clone(),
            door::Overflow::Server {
                limit: st.cfg.max_connections,
            },
        );
        let mut lane = hyper::server::conn::http1::Builder::new();
        lane.timer(TokioTimer::new())
            .header_read_timeout(door::OVERFLOW_TIMEOUT)
            .max_header_size(st.cfg.header_limit)
            .max_headers(st.cfg.max_headers)
            .keep_alive(false);
        let first_byte = st.cfg.first_byte_timeout;

        let drain = {
            let st = st.clone();
            async move {
                shutdown.await;
                st.shutting_down.store(true, Ordering::SeqCst);
                let grace = st.cfg.shutdown_grace;
                tracing::info!(
                    inflight = st.inflight(),
                    "shutting down: new requests get 503; running requests have {} s to finish",
                    grace.as_secs_f64()
                );
                let deadline = Instant::now() + grace;
                loop {
                    let notified = st.inflight_changed.notified();
                    let now = Instant::now();
                    if st.inflight() == 0 || now >= deadline {
                        break;
                    }
                    let step = (deadline - now).min(Duration::from_millis(100));
                    tokio::select! {
                        _ = notified => {}
                        _ = tokio::time::sleep(step) => {}
                    }
                }
                let left = st.inflight();
                if left > 0 {
                    tracing::warn!("shutdown grace over: cancelling {left} running requests");
                    let engine = st.engine.clone();
                    let _ = tokio::task::spawn_blocking(move || engine.shutdown(false)).await;
                }
            }
        };
        tokio::pin!(drain);

        loop {
            // Always accept: a full server still answers (the overflow
            // lane), so no client waits unseen in the listen backlog.
            let (tcp, peer) = tokio::select! {
                biased;
                _ = &mut drain => break,
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) => {
                        // E.g. out of file descriptors: back off, keep serving.
                        tracing::warn!("accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = tcp.set_nodelay(true);
            let slot = door.enter(peer.ip());
            let permit = match &slot {
                Some(_) => conns.clone().try_acquire_owned().ok(),
                None => None,
            };
            let client_full = slot.is_none();
            let (Some(slot), Some(permit)) = (slot, permit) else {
                // The overflow lane: `/health`, or the limit's error.
                let Some(lane_slot) = lane_door.enter(peer.ip()) else {
                    drop(tcp);
                    continue;
                };
                let Ok(lane_permit) = overflow.clone().try_acquire_owned() else {
                    drop(tcp);
                    continue;
                };
                let app = match client_full {
                    true => over_client.clone(),
                    false => over_server.clone(),
                };
                let svc = hyper_util::service::TowerToHyperService::new(app);
                let io = door::JsonErrors::new(tcp, st.cfg.header_limit, |_| {});
                let conn = lane.serve_connection(TokioIo::new(io), svc);
                tokio::spawn(async move {
                    let _ = tokio::time::timeout(door::OVERFLOW_TIMEOUT * 2, conn).await;
                    drop(lane_permit);
                    drop(lane_slot);
                });
                continue;
            };
            let svc = hyper_util::service::TowerToHyperService::new(app.clone());
            let http = http.clone();
            let watcher = graceful.watcher();
            let st2 = st.clone();
            let limits = (
                st.cfg.header_limit,
                st.cfg.max_headers,
                st.cfg.header_timeout,
            );
            tokio::spawn(async move {
                // A connection that never speaks gives its slot back soon.
                let mut byte = [0u8; 1];
                match tokio::time::timeout(first_byte, tcp.peek(&mut byte)).await {
                    Ok(Ok(n)) if n > 0 => {}
                    _ => {
                        tracing::debug!(%peer, "connection closed: silent or gone");
                        return;
                    }
                }
                // A malformed first head is answered in OpenAI's shape
                // (hyper would answer a bare status line).
                match door::first_head(&tcp, limits.0, limits.1, limits.2).await {
                    door::Head::Fine => {
                        // Later heads: hyper's bare refusals rewritten.
                        let st3 = st2.clone();
                        let io = door::JsonErrors::new(tcp, limits.0, move |reason| {
                            st3.metrics.rejection(reason)
                        });
                        let conn = http.serve_connection(TokioIo::new(io), svc);
                        if let Err(e) = watcher.watch(conn).await {
                            tracing::debug!(%peer, "connection ended: {e}");
                        }
                    }
                    door::Head::Refuse(e) => {
                        st2.metrics.rejection(e.reason);
                        door::answer_and_close(tcp, &e).await;
                    }
                    door::Head::Gone => {}
                }
                drop(permit);
                drop(slot);
            });
        }
        drop(listener);
        // Idle keep-alive connections close now; busy ones finish their
        // response (the engine has ended every request by now).
        if tokio::time::timeout(Duration::from_secs(5), graceful.shutdown())
            .await
            .is_err()
        {
            tracing::warn!("some connections were still open 5 s after shutdown; leaving them");
        }
        // Anything still in the engine now (a request admitted in the last
        // moments of the grace period) is cancelled, not waited for.
        let engine = st.engine.clone();
        let _ = tokio::task::spawn_blocking(move || engine.shutdown(false)).await;
        tracing::info!("shut down");
        Ok(())
    }
}
