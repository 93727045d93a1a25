//! The gateway's view of its nodes' operations listeners (`pd::ops`): a
//! node's metric samples and console view fetched over HTTP, bounded in
//! time and size, and [`WithNodeMetrics`], a backend whose `/metrics` and
//! console also show every node's (each sample under a `node` label, and
//! whether each node answered: `isoserve_node_scrape_ok`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use request::console::NodeView;
use request::{Backend, EngineStats, GenRequest, MetricSample, RequestError, RequestHandle};
use telemetry::metrics::Family;

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

/// What the gateway adds of its nodes, declared once.
pub const SCRAPE_OK: Family = Family::gauge(
    "isoserve_node_scrape_ok",
    "Whether the node's metrics answered this scrape",
)
.with_labels(&["node"]);

/// The families [`WithNodeMetrics`] adds itself (the nodes' own samples
/// are declared by the nodes: `pd::node::NODE_METRICS`).
pub const NODE_SCRAPE_FAMILIES: &[Family] = &[SCRAPE_OK];

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
    // An HTTP/1.0 request gets an HTTP/1.0 answer; any 1.x is read.
    if !(raw.starts_with(b"HTTP/1.") && raw.get(8..13) == Some(b" 200 ")) {
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
                SCRAPE_OK
                    .sample(f64::from(u8::from(fetched.is_ok())))
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
