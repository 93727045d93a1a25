//! A prefill or decode node serving the PD protocol on a TCP listener: the
//! engine's [`PdNode`] (model, pool, batch, transfer state machine on one
//! thread) behind a [`Transport`].

use std::net::SocketAddr;
use std::sync::Arc;

use engine::{EngineConfig, StartError};
use model::Model;
use tokenizer::Tokenizer;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use std::sync::atomic::Ordering;

use crate::role::{NetCommand, PdConfig, PdNode, PdRole, PdStats};
use request::MetricSample;
use transport::{Transport, TransportConfig};

/// A node that serves until [`RunningNode::shutdown`].
pub struct RunningNode {
    pub node: Arc<PdNode>,
    pub transport: Arc<Transport>,
    pub addr: SocketAddr,
    accept: tokio::task::JoinHandle<()>,
}

/// Starts a node on `listener` (call inside a tokio runtime).
pub fn start_node(
    role: PdRole,
    model: Model,
    tokenizer: Tokenizer,
    cfg: EngineConfig,
    pd: PdConfig,
    listener: TcpListener,
    tcfg: TransportConfig,
) -> Result<RunningNode, StartError> {
    let addr = listener
        .local_addr()
        .map_err(|e| StartError::Config(format!("listener address: {e}")))?;
    let (tx, mut rx) = mpsc::channel(pd.events_max);
    let transport = Transport::new(tcfg, tokio::runtime::Handle::current(), tx);
    let t = transport.clone();
    let commands = Box::new(move |cmd: NetCommand| match cmd {
        NetCommand::Send { conn, msg } => t.send(conn, &msg),
        NetCommand::Close { conn } => t.close(conn),
        NetCommand::Dial { addr } => t.dial(addr),
    });
    let node = Arc::new(PdNode::start(role, model, tokenizer, cfg, pd, commands)?);
    // Transport events into the node thread; a blocking send there pushes
    // back on the readers (bounded channel), and through TCP on the peers.
    let n = node.clone();
    std::thread::Builder::new()
        .name("isoserve-pd-events".into())
        .spawn(move || {
            while let Some(ev) = rx.blocking_recv() {
                if !n.event(ev) {
                    break;
                }
            }
        })
        .map_err(|e| StartError::Config(format!("cannot start the event thread: {e}")))?;
    let t = transport.clone();
    let accept = tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((stream, _peer)) => {
                    t.accepted(stream).await;
                }
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    });
    Ok(RunningNode {
        node,
        transport,
        addr,
        accept,
    })
}

impl RunningNode {
    /// Stops accepting, closes every connection (peers release their side)
    /// and stops the node thread.
    pub fn shutdown(&self) {
        self.accept.abort();
        self.transport.close_all();
        self.node.shutdown();
    }
}

/// A PD node's counters, as samples for a Prometheus encoder (the
/// binary serves them on the node's metrics port, and as JSON for the
/// supervising gateway).
pub fn node_samples(s: &PdStats, t: &Transport) -> Vec<MetricSample> {
    let mut o = Vec::new();
    let mut metric = |kind: &str, name: &str, help: &str, v: u64| {
        let name = format!("isoserve_node_{name}");
        o.push(if kind == "counter" {
            MetricSample::counter(name, help, v as f64)
        } else {
            MetricSample::gauge(name, help, v as f64)
        });
    };
    let p = s.engine.pool;
    metric(
        "gauge",
        "kv_pages_total",
        "KV pages in the pool",
        p.pages_total,
    );
    metric(
        "gauge",
        "kv_pages_free",
        "KV pages no request or transfer holds (free, or cached and idle)",
        p.pages_unheld(),
    );
    metric(
        "gauge",
        "kv_pages_cached",
        "KV pages in the prefix cache (held or idle)",
        p.pages_cached,
    );
    metric(
        "gauge",
        "kv_pages_leased",
        "KV pages leased to a transfer (K4)",
        p.pages_leased,
    );
    metric(
        "gauge",
        "kv_pages_release_pending",
        "KV pages freed while leased, waiting for the transfer's end",
        p.pages_release_pending,
    );
    metric(
        "counter",
        "kv_safety_refusals_total",
        "Every refused KV access (K1-K7)",
        p.safety_refusals(),
    );
    metric(
        "gauge",
        "requests",
        "Requests the node knows",
        s.requests as u64,
    );
    metric(
        "gauge",
        "draining",
        "1 while the node drains (SIGTERM): no new request, in-flight ones finish",
        u64::from(s.draining),
    );
    metric(
        "counter",
        "generated_tokens_total",
        "Tokens sampled",
        s.engine.generated_tokens_total,
    );
    if let Some(d) = &s.decode {
        for (name, help, v) in [
            (
                "reservations_total",
                "Reservations asked for",
                d.reservations_total,
            ),
            (
                "reservations_refused_total",
                "Reservations refused",
                d.reservations_refused_total,
            ),
            (
                "pages_received_total",
                "KV pages received",
                d.pages_received_total,
            ),
            (
                "page_bytes_received_total",
                "KV page bytes received",
                d.page_bytes_received_total,
            ),
            (
                "transfers_completed_total",
                "Transfers that passed every check",
                d.transfers_completed_total,
            ),
            (
                "checksum_failures_total",
                "Pages that failed their checksum (K6)",
                d.checksum_failures_total,
            ),
            (
                "canary_failures_total",
                "Pages that failed their canary (K7)",
                d.canary_failures_total,
            ),
            (
                "pages_fenced_total",
                "Pages refused for a stale, foreign or unknown handle (K2)",
                d.pages_fenced_total,
            ),
            (
                "pages_late_total",
                "Pages that arrived for a draining request",
                d.pages_late_total,
            ),
            (
                "incomplete_transfers_total",
                "Transfers refused as incomplete (K10)",
                d.incomplete_transfers_total,
            ),
            (
                "cancels_waiting_total",
                "Cancels of waiting reservations",
                d.cancels_waiting_total,
            ),
            (
                "cancels_receiving_total",
                "Cancels mid-transfer",
                d.cancels_receiving_total,
            ),
            (
                "cancels_decoding_total",
                "Cancels while decoding",
                d.cancels_decoding_total,
            ),
            (
                "prefill_links_lost_total",
                "Prefill links lost with transfers on them",
                d.prefill_links_lost_total,
            ),
            (
                "protocol_errors_total",
                "Messages a peer may not send",
                d.protocol_errors_total,
            ),
            (
                "handshakes_refused_total",
                "Pairings refused",
                d.handshakes_refused_total,
            ),
        ] {
            metric("counter", &format!("decode_{name}"), help, v);
        }
    }
    if let Some(pf) = &s.prefill {
        for (name, help, v) in [
            ("prefills_total", "Prefills asked for", pf.prefills_total),
            (
                "prefills_refused_total",
                "Prefills refused (the original error went to the client)",
                pf.prefills_refused_total,
            ),
            ("pages_sent_total", "KV pages sent", pf.pages_sent_total),
            (
                "page_bytes_sent_total",
                "KV page bytes sent",
                pf.page_bytes_sent_total,
            ),
            (
                "transfers_done_total",
                "Transfers sent whole",
                pf.transfers_done_total,
            ),
            (
                "transfers_aborted_total",
                "Transfers aborted",
                pf.transfers_aborted_total,
            ),
            (
                "cancels_queued_total",
                "Cancels before computing",
                pf.cancels_queued_total,
            ),
            (
                "cancels_computing_total",
                "Cancels while computing",
                pf.cancels_computing_total,
            ),
            (
                "cancels_sending_total",
                "Cancels mid-transfer",
                pf.cancels_sending_total,
            ),
            (
                "decode_links_lost_total",
                "Decode links lost",
                pf.decode_links_lost_total,
            ),
            (
                "connect_failures_total",
                "Dials to decode that failed",
                pf.connect_failures_total,
            ),
            (
                "handshakes_refused_total",
                "Pairings refused",
                pf.handshakes_refused_total,
            ),
            (
                "prefix_cache_queries_total",
                "Prompts looked up in the prefix cache (K11)",
                pf.cache_queries_total,
            ),
            (
                "prefix_cache_query_tokens_total",
                "Prompt tokens looked up in the prefix cache",
                pf.cache_query_tokens_total,
            ),
            (
                "prefix_cache_hit_pages_total",
                "Prompt pages taken from the prefix cache",
                pf.cache_hit_pages_total,
            ),
            (
                "prefix_cache_hit_tokens_total",
                "Prompt tokens taken from the prefix cache (not computed)",
                pf.cache_hit_tokens_total,
            ),
        ] {
            metric("counter", &format!("prefill_{name}"), help, v);
        }
    }
    metric(
        "counter",
        "transport_bytes_sent_total",
        "Bytes sent",
        t.stats.bytes_sent_total.load(Ordering::Relaxed),
    );
    metric(
        "counter",
        "transport_bytes_received_total",
        "Bytes received",
        t.stats.bytes_received_total.load(Ordering::Relaxed),
    );
    metric(
        "counter",
        "transport_bad_frames_total",
        "Frames that failed to parse or their frame check",
        t.stats.bad_frames_total.load(Ordering::Relaxed),
    );
    metric(
        "counter",
        "transport_heartbeat_timeouts_total",
        "Connections ended by heartbeat timeout",
        t.stats.heartbeat_timeouts_total.load(Ordering::Relaxed),
    );
    metric(
        "counter",
        "transport_connections_refused_total",
        "Connections closed unread: the node had connections_max open",
        t.stats.connections_refused_total.load(Ordering::Relaxed),
    );
    metric(
        "counter",
        "transport_tls_handshakes_refused_total",
        "TLS handshakes refused (no certificate, another CA, wrong name, plaintext, too slow); no frame of them read",
        t.stats.tls_handshakes_refused_total.load(Ordering::Relaxed),
    );
    metric(
        "counter",
        "transfers_timed_total",
        "Transfers timed (decode: first page to checked Done)",
        s.transfers_timed_total,
    );
    o.push(MetricSample::counter(
        "isoserve_node_transfer_seconds_total",
        "Wall time from a transfer's first page to its checked end (decode), summed",
        s.transfer_seconds_total,
    ));
    o
}
