//! [`Server`]: the accept loop and its front door (connection limits, the
//! overflow lane, the first-byte timeout, malformed heads), and graceful
//! shutdown. Routes are `http`'s.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use request::Backend;
use tokenizer::{ChatTemplate, Tokenizer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::config::ServerConfig;
use crate::error::ServerError;
use crate::reqlog::RequestLog;
use crate::state::AppState;
use crate::tenants::Tenants;
use crate::{door, http};

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
        Server {
            state: Arc::new(AppState::new(
                engine, tokenizer, template, tenants, reqlog, cfg,
            )),
        }
    }

    /// Compiles requests' grammars with `c` (the unified engine's: one
    /// per-scope cache for the HTTP layer and the engine).
    pub fn with_grammar(self, c: Arc<grammar::Compiler>) -> Server {
        self.state.set_grammar(c);
        self
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
                st.begin_shutdown();
                let grace = st.cfg.shutdown_grace;
                tracing::info!(
                    inflight = st.inflight(),
                    "shutting down: new requests get 503; running requests have {} s to finish",
                    grace.as_secs_f64()
                );
                let deadline = Instant::now() + grace;
                loop {
                    let notified = st.inflight_changed();
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
