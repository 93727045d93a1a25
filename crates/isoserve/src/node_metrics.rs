//! A PD node's metrics port, and the gateway's view of its nodes' metrics.
//!
//! A node serves `GET /metrics` (Prometheus text, encoded by the server's
//! Prometheus library from `pd::node::node_samples`), `GET /samples`
//! (the same samples as JSON), `GET /health` (liveness) and `GET /ready`
//! (readiness: 503 while draining). Under `serve --disaggregated` the gateway's
//! `/metrics` also shows every child's samples with a `node` label
//! ([`WithNodeMetrics`]), so one scrape sees the whole set.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use pd::role::PdNode;
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
            let (status, ctype, body) = if head.starts_with(b"GET /metrics ") {
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
                    "not found: GET /metrics, /samples, /health or /ready\n".to_string(),
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

/// A node's samples from its metrics port (bounded in time and size).
pub fn fetch(addr: SocketAddr) -> Result<Vec<MetricSample>, String> {
    let mut s = TcpStream::connect_timeout(&addr, FETCH_TIMEOUT).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(FETCH_TIMEOUT))
        .and_then(|()| s.set_write_timeout(Some(FETCH_TIMEOUT)))
        .map_err(|e| e.to_string())?;
    s.write_all(b"GET /samples HTTP/1.0\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    s.take(FETCH_BYTES_MAX)
        .read_to_end(&mut raw)
        .map_err(|e| e.to_string())?;
    let at = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no HTTP head")?;
    if !raw.starts_with(b"HTTP/1.0 200") {
        return Err("not 200".into());
    }
    serde_json::from_slice(&raw[at + 4..]).map_err(|e| e.to_string())
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
}
