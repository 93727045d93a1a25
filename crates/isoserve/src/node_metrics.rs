//! A PD node's metrics port, and the gateway's view of its nodes' metrics.
//!
//! A node serves `GET /metrics` (Prometheus text, encoded by the server's
//! Prometheus library from `pd::node::node_samples`), `GET /samples`
//! (the same samples as JSON), `GET /health` (liveness) and `GET /ready`
//! (readiness: 503 while draining). Under `serve --disaggregated` the gateway's
//! `/metrics` also shows every child's samples with a `node` label
//! ([`WithNodeMetrics`]), so one scrape sees the whole set. `GET /console`
//! is the node's view for the operator console (its pool map, safety
//! counters and transfers in flight: counts and states, no prompt, token
//! or key), which the gateway's console gathers from every node.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use pd::role::PdNode;
use request::console::NodeView;
use request::{Backend, EngineStats, GenRequest, MetricSample, RequestError, RequestHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use transport::Transport;

/// Metrics connections served at once (more wait in the listen backlog).
const CONNECTIONS_MAX: usize = 16;
/// A request head larger than this is refused.
const HEAD_BYTES_MAX: usize = 8192;
/// A peer that sends no whole head in this time is dropped.
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the gateway waits for one node's samples.
const FETCH_TIMEOUT: Duration = Duration::from_millis(500);
/// Largest samples document the gateway reads from a node.
const FETCH_BYTES_MAX: u64 = 1 << 20;
/// How long the gateway waits for one node's console view (the node
/// thread takes a fresh map within 300 ms).
const CONSOLE_FETCH_TIMEOUT: Duration = Duration::from_millis(1500);
/// Largest console view read from a node (a grid has at most
/// `GRID_CELLS_MAX` cells of ~60 bytes of JSON).
const CONSOLE_BYTES_MAX: u64 = 4 << 20;

/// Serves a node's metrics on `listener` until aborted: at most
/// [`CONNECTIONS_MAX`] connections at once, one request each.
pub async fn serve(listener: TcpListener, node: Arc<PdNode>, transport: Arc<Transport>) {
    let slots = Arc::new(Semaphore::new(CONNECTIONS_MAX));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let Ok((mut s, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let node = node.clone();
        let transport = transport.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            let read = tokio::time::timeout(HEAD_TIMEOUT, async {
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < HEAD_BYTES_MAX {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return false,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                true
            })
            .await;
            if read != Ok(true) {
                return;
            }
            let samples = || pd::node::node_samples(&node.stats(), &transport);
            let (status, ctype, body) = if head.starts_with(b"GET /console ") {
                // Blocks up to 300 ms for a fresh map: off the async threads.
                let n = node.clone();
                let view = tokio::task::spawn_blocking(move || n.console_view()).await;
                match view.map(|v| serde_json::to_string(&v)) {
                    Ok(Ok(body)) => ("200 OK", "application/json", body),
                    _ => (
                        "500 Internal Server Error",
                        "text/plain",
                        "console view unavailable\n".to_string(),
                    ),
                }
            } else if head.starts_with(b"GET /metrics ") {
                (
                    "200 OK",
                    server::metrics::CONTENT_TYPE,
                    server::metrics::encode_samples(samples()),
                )
            } else if head.starts_with(b"GET /health ") {
                // Liveness: the node thread answers (its stats are fresh).
                (
                    "200 OK",
                    "application/json",
                    "{\"status\":\"ok\"}".to_string(),
                )
            } else if head.starts_with(b"GET /ready ") {
                // Readiness: pool measured and allocated (the node listens
                // only after that), and not draining.
                if node.stats().draining {
                    (
                        "503 Service Unavailable",
                        "application/json",
                        "{\"status\":\"draining\"}".to_string(),
                    )
                } else {
                    (
                        "200 OK",
                        "application/json",
                        "{\"status\":\"ready\"}".to_string(),
                    )
                }
            } else if head.starts_with(b"GET /samples ") {
                (
                    "200 OK",
                    "application/json",
                    serde_json::to_string(&samples()).unwrap_or_else(|_| "[]".into()),
                )
            } else {
                (
                    "404 Not Found",
                    "text/plain",
                    "not found: GET /metrics, /samples, /console, /health or /ready\n".to_string(),
                )
            };
            let resp = format!(
                "HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(resp.as_bytes()).await;
            let _ = s.shutdown().await;
        });
    }
}

/// `GET path` on a node's metrics port: the body of a 200 (bounded in
/// time and size).
fn get(addr: SocketAddr, path: &str, timeout: Duration, max: u64) -> Result<Vec<u8>, String> {
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(timeout))
        .and_then(|()| s.set_write_timeout(Some(timeout)))
        .map_err(|e| e.to_string())?;
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.take(max)
        .read_to_end(&mut raw)
        .map_err(|e| e.to_string())?;
    let at = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no HTTP head")?;
    if !raw.starts_with(b"HTTP/1.0 200") {
        return Err("not 200".into());
    }
    raw.drain(..at + 4);
    Ok(raw)
}

/// A node's samples from its metrics port (bounded in time and size).
pub fn fetch(addr: SocketAddr) -> Result<Vec<MetricSample>, String> {
    let body = get(addr, "/samples", FETCH_TIMEOUT, FETCH_BYTES_MAX)?;
    serde_json::from_slice(&body).map_err(|e| e.to_string())
}

/// A node's console view from its metrics port (bounded in time and size).
pub fn fetch_console(addr: SocketAddr) -> Result<NodeView, String> {
    let body = get(addr, "/console", CONSOLE_FETCH_TIMEOUT, CONSOLE_BYTES_MAX)?;
    serde_json::from_slice(&body).map_err(|e| e.to_string())
}

/// A backend (the gateway) whose metrics also show its nodes' samples,
/// each with a `node` label, and whether each node answered
/// (`isoserve_node_scrape_ok`).
pub struct WithNodeMetrics<B> {
    pub inner: Arc<B>,
    /// (node name, metrics address).
    pub nodes: Vec<(String, SocketAddr)>,
}

impl<B: Backend> Backend for WithNodeMetrics<B> {
    fn submit(&self, req: GenRequest) -> Result<RequestHandle, RequestError> {
        self.inner.submit(req)
    }
    fn max_request_tokens(&self) -> usize {
        self.inner.max_request_tokens()
    }
    fn stats(&self) -> EngineStats {
        self.inner.stats()
    }
    fn kv_capacity_tokens(&self) -> Option<usize> {
        self.inner.kv_capacity_tokens()
    }
    fn shutdown(&self, drain: bool) {
        self.inner.shutdown(drain)
    }
    fn ready(&self) -> bool {
        self.inner.ready()
    }
    fn metric_samples(&self) -> Vec<MetricSample> {
        let mut out = self.inner.metric_samples();
        for (name, addr) in &self.nodes {
            let fetched = fetch(*addr);
            out.push(
                MetricSample::gauge(
                    "isoserve_node_scrape_ok",
                    "Whether the node's metrics answered this scrape",
                    f64::from(u8::from(fetched.is_ok())),
                )
                .label("node", name.clone()),
            );
            match fetched {
                Ok(samples) => {
                    out.extend(samples.into_iter().map(|s| s.label("node", name.clone())))
                }
                Err(e) => tracing::warn!(node = %name, "node metrics unavailable: {e}"),
            }
        }
        out
    }
    /// Every node's view, asked of all nodes at once (each bounded by
    /// [`CONSOLE_FETCH_TIMEOUT`]); a node that does not answer is listed
    /// as `unreachable` with an empty pool.
    fn console_nodes(&self) -> Vec<NodeView> {
        std::thread::scope(|sc| {
            let asks: Vec<_> = self
                .nodes
                .iter()
                .map(|(name, addr)| (name, sc.spawn(move || fetch_console(*addr))))
                .collect();
            asks.into_iter()
                .map(|(name, ask)| {
                    let fetched = ask
                        .join()
                        .unwrap_or_else(|_| Err("the fetch panicked".into()));
                    match fetched {
                        Ok(v) => NodeView {
                            name: name.clone(),
                            ..v
                        },
                        Err(e) => {
                            tracing::warn!(node = %name, "node console unavailable: {e}");
                            NodeView {
                                name: name.clone(),
                                role: "unreachable".into(),
                                ..NodeView::default()
                            }
                        }
                    }
                })
                .collect()
        })
    }
}
