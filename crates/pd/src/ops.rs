//! A PD node's operations listener, on the same hyper/axum stack as the
//! HTTP server: `GET /metrics` (Prometheus text of [`node_samples`]),
//! `GET /samples` (the same samples as JSON, which a gateway scrapes),
//! `GET /console` (the node's view for the operator console: its pool
//! map, safety counters and transfers in flight — counts and states, no
//! prompt, token or key), `GET /health` (liveness) and `GET /ready`
//! (readiness: 503 while draining).
//!
//! At most [`CONNECTIONS_MAX`] connections are served at once (more wait
//! in the listen backlog), each must send its request head within
//! [`HEAD_TIMEOUT`], and a head is at most [`HEAD_BYTES_MAX`] bytes.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use transport::Transport;

use crate::node::node_samples;
use crate::role::PdNode;

/// Connections served at once.
pub const CONNECTIONS_MAX: usize = 16;
/// A request head larger than this is refused.
pub const HEAD_BYTES_MAX: usize = 8192;
/// A peer that sends no whole head in this time is dropped.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection is closed after this long, whatever it does (a scrape is
/// one request).
const CONNECTION_MAX_TIME: Duration = Duration::from_secs(30);

#[derive(Clone)]
struct Ops {
    node: Arc<PdNode>,
    transport: Arc<Transport>,
}

/// The node's operations routes.
pub fn router(node: Arc<PdNode>, transport: Arc<Transport>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/samples", get(samples))
        .route("/console", get(console))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .fallback(not_found)
        .with_state(Ops { node, transport })
}

/// Serves the routes on `listener` until the task is aborted.
pub async fn serve(listener: TcpListener, node: Arc<PdNode>, transport: Arc<Transport>) {
    let app = router(node, transport);
    let slots = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT)
        .max_buf_size(HEAD_BYTES_MAX)
        .keep_alive(false);
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let Ok((tcp, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        let conn = http.serve_connection(TokioIo::new(tcp), svc);
        tokio::spawn(async move {
            let _ = tokio::time::timeout(CONNECTION_MAX_TIME, conn).await;
            drop(permit);
        });
    }
}

async fn metrics(State(o): State<Ops>) -> Response {
    let text = telemetry::metrics::encode_samples(node_samples(&o.node.stats(), &o.transport));
    (
        [(header::CONTENT_TYPE, telemetry::metrics::CONTENT_TYPE)],
        text,
    )
        .into_response()
}

async fn samples(State(o): State<Ops>) -> Response {
    Json(node_samples(&o.node.stats(), &o.transport)).into_response()
}

async fn console(State(o): State<Ops>) -> Response {
    // Blocks up to 300 ms for a fresh map: off the async threads.
    let node = o.node.clone();
    match tokio::task::spawn_blocking(move || node.console_view()).await {
        Ok(view) => Json(view).into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "console view unavailable\n",
        )
            .into_response(),
    }
}

/// Liveness: the node thread answers (its stats are fresh).
async fn health() -> Response {
    Json(serde_json::json!({"status": "ok"})).into_response()
}

/// Readiness: pool measured and allocated (the node listens only after
/// that), and not draining.
async fn ready(State(o): State<Ops>) -> Response {
    if o.node.stats().draining {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "draining"})),
        )
            .into_response()
    } else {
        Json(serde_json::json!({"status": "ready"})).into_response()
    }
}

async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        "not found: GET /metrics, /samples, /console, /health or /ready\n",
    )
        .into_response()
}
