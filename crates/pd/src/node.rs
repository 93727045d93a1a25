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
use telemetry::metrics::Family;
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

/// How a node reads one of its metrics: `None` when its role has no such
/// counter (a prefill node's decode counters).
type Read = fn(&PdStats, &Transport) -> Option<f64>;

/// A PD node's metric families, each declared once with how it is read:
/// what its `/metrics` and `/samples` export, and what a gateway that
/// scrapes it adds under a `node` label.
pub static NODE_METRICS: &[(Family, Read)] = &[
    (
        Family::gauge(
            "isoserve_node_kv_pages_total",
            "KV pages in the pool",
        ),
        |s, _| Some(s.engine.pool.pages_total as f64),
    ),
    (
        Family::gauge(
            "isoserve_node_kv_pages_free",
            "KV pages no request or transfer holds (free, or cached and idle)",
        ),
        |s, _| Some(s.engine.pool.pages_unheld() as f64),
    ),
    (
        Family::gauge(
            "isoserve_node_kv_pages_cached",
            "KV pages in the prefix cache (held or idle)",
        ),
        |s, _| Some(s.engine.pool.pages_cached as f64),
    ),
    (
        Family::gauge(
            "isoserve_node_kv_pages_leased",
            "KV pages leased to a transfer (K4)",
        ),
        |s, _| Some(s.engine.pool.pages_leased as f64),
    ),
    (
        Family::gauge(
            "isoserve_node_kv_pages_release_pending",
            "KV pages freed while leased, waiting for the transfer's end",
        ),
        |s, _| Some(s.engine.pool.pages_release_pending as f64),
    ),
    (
        Family::counter(
            "isoserve_node_kv_safety_refusals_total",
            "Every refused KV access (K1-K7)",
        ),
        |s, _| Some(s.engine.pool.safety_refusals() as f64),
    ),
    (
        Family::gauge(
            "isoserve_node_requests",
            "Requests the node knows",
        ),
        |s, _| Some(s.requests as u64 as f64),
    ),
    (
        Family::gauge(
            "isoserve_node_draining",
            "1 while the node drains (SIGTERM): no new request, in-flight ones finish",
        ),
        |s, _| Some(u64::from(s.draining) as f64),
    ),
    (
        Family::counter(
            "isoserve_node_generated_tokens_total",
            "Tokens sampled",
        ),
        |s, _| Some(s.engine.generated_tokens_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_spec_drafts_total",
            "Speculative decoding: verification steps that carried a draft",
        ),
        |s, _| s.decode.as_ref().map(|_| s.engine.spec_drafts_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_spec_draft_tokens_total",
            "Draft tokens verified",
        ),
        |s, _| s.decode.as_ref().map(|_| s.engine.spec_draft_tokens_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_spec_accepted_tokens_total",
            "Draft tokens the model's own sampling kept",
        ),
        |s, _| s.decode.as_ref().map(|_| s.engine.spec_accepted_tokens_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_spec_draft_model_passes_total",
            "Forward passes of the draft model (--draft-model)",
        ),
        |s, _| s.decode.as_ref().map(|_| s.engine.spec_draft_passes_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_spec_draft_pool_safety_refusals_total",
            "Every refused access to the draft model's KV pool (K1-K7); only with --draft-model",
        ),
        |s, _| s.engine.draft_pool.map(|d| d.safety_refusals() as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_reservations_total",
            "Reservations asked for",
        ),
        |s, _| s.decode.as_ref().map(|d| d.reservations_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_reservations_refused_total",
            "Reservations refused",
        ),
        |s, _| s.decode.as_ref().map(|d| d.reservations_refused_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_pages_received_total",
            "KV pages received",
        ),
        |s, _| s.decode.as_ref().map(|d| d.pages_received_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_page_bytes_received_total",
            "KV page bytes received",
        ),
        |s, _| s.decode.as_ref().map(|d| d.page_bytes_received_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_transfers_completed_total",
            "Transfers that passed every check",
        ),
        |s, _| s.decode.as_ref().map(|d| d.transfers_completed_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_checksum_failures_total",
            "Pages that failed their checksum (K6)",
        ),
        |s, _| s.decode.as_ref().map(|d| d.checksum_failures_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_canary_failures_total",
            "Pages that failed their canary (K7)",
        ),
        |s, _| s.decode.as_ref().map(|d| d.canary_failures_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_pages_fenced_total",
            "Pages refused for a stale, foreign or unknown handle (K2)",
        ),
        |s, _| s.decode.as_ref().map(|d| d.pages_fenced_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_pages_late_total",
            "Pages that arrived for a draining request",
        ),
        |s, _| s.decode.as_ref().map(|d| d.pages_late_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_incomplete_transfers_total",
            "Transfers refused as incomplete (K10)",
        ),
        |s, _| s.decode.as_ref().map(|d| d.incomplete_transfers_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_cancels_waiting_total",
            "Cancels of waiting reservations",
        ),
        |s, _| s.decode.as_ref().map(|d| d.cancels_waiting_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_cancels_receiving_total",
            "Cancels mid-transfer",
        ),
        |s, _| s.decode.as_ref().map(|d| d.cancels_receiving_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_cancels_decoding_total",
            "Cancels while decoding",
        ),
        |s, _| s.decode.as_ref().map(|d| d.cancels_decoding_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_prefill_links_lost_total",
            "Prefill links lost with transfers on them",
        ),
        |s, _| s.decode.as_ref().map(|d| d.prefill_links_lost_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_protocol_errors_total",
            "Messages a peer may not send",
        ),
        |s, _| s.decode.as_ref().map(|d| d.protocol_errors_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_decode_handshakes_refused_total",
            "Pairings refused",
        ),
        |s, _| s.decode.as_ref().map(|d| d.handshakes_refused_total as f64),
    ),
    (
        Family::counter("isoserve_node_prefill_prefills_total", "Prefills asked for"),
        |s, _| s.prefill.as_ref().map(|pf| pf.prefills_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_prefill_prefills_refused_total",
            "Prefills refused (the original error went to the client)",
        ),
        |s, _| s.prefill.as_ref().map(|pf| pf.prefills_refused_total as f64),
    ),
    (
        Family::counter("isoserve_node_prefill_pages_sent_total", "KV pages sent"),
        |s, _| s.prefill.as_ref().map(|pf| pf.pages_sent_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_prefill_page_bytes_sent_total",
            "KV page bytes sent",
        ),
        |s, _| s.prefill.as_ref().map(|pf| pf.page_bytes_sent_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_prefill_transfers_done_total",
            "Transfers sent whole",
        ),
        |s, _| s.prefill.as_ref().map(|pf| pf.transfers_done_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_prefill_transfers_aborted_total",
            "Transfers aborted",
        ),
        |s, _| s.prefill.as_ref().map(|pf| pf.transfers_aborted_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_prefill_cancels_queued_total",
            "Cancels before computing",
        ),
        |s, _| s.prefill.as_ref().map(|pf| pf.cancels_queued_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_prefill_cancels_computing_total",
            "Cancels while computing",
        ),
        |s, _| s.prefill.as_ref().map(|pf| pf.cancels_computing_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_prefill_cancels_sending_total",
            "Cancels mid-transfer",
        ),
        |s, _| s.prefill.as_ref().map(|pf| pf.cancels_sending_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_prefill_decode_links_lost_total",
            "Decode links lost",
        ),
        |s, _| s.prefill.as_ref().map(|pf| pf.decode_links_lost_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_prefill_connect_failures_total",
            "Dials to decode that failed",
        ),
        |s, _| s.prefill.as_ref().map(|pf| pf.connect_failures_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_prefill_handshakes_refused_total",
            "Pairings refused",
        ),
        |s, _| s.prefill.as_ref().map(|pf| pf.handshakes_refused_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_prefill_prefix_cache_queries_total",
            "Prompts looked up in the prefix cache (K11)",
        ),
        |s, _| s.prefill.as_ref().map(|pf| pf.cache_queries_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_prefill_prefix_cache_query_tokens_total",
            "Prompt tokens looked up in the prefix cache",
        ),
        |s, _| s.prefill.as_ref().map(|pf| pf.cache_query_tokens_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_prefill_prefix_cache_hit_pages_total",
            "Prompt pages taken from the prefix cache",
        ),
        |s, _| s.prefill.as_ref().map(|pf| pf.cache_hit_pages_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_prefill_prefix_cache_hit_tokens_total",
            "Prompt tokens taken from the prefix cache (not computed)",
        ),
        |s, _| s.prefill.as_ref().map(|pf| pf.cache_hit_tokens_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_transport_bytes_sent_total",
            "Bytes sent",
        ),
        |_, t| Some(t.stats.bytes_sent_total.load(Ordering::Relaxed) as f64),
    ),
    (
        Family::counter(
            "isoserve_node_transport_bytes_received_total",
            "Bytes received",
        ),
        |_, t| Some(t.stats.bytes_received_total.load(Ordering::Relaxed) as f64),
    ),
    (
        Family::counter(
            "isoserve_node_transport_bad_frames_total",
            "Frames that failed to parse or their frame check",
        ),
        |_, t| Some(t.stats.bad_frames_total.load(Ordering::Relaxed) as f64),
    ),
    (
        Family::counter(
            "isoserve_node_transport_heartbeat_timeouts_total",
            "Connections ended by heartbeat timeout",
        ),
        |_, t| Some(t.stats.heartbeat_timeouts_total.load(Ordering::Relaxed) as f64),
    ),
    (
        Family::counter(
            "isoserve_node_transport_connections_refused_total",
            "Connections closed unread: the node had connections_max open",
        ),
        |_, t| Some(t.stats.connections_refused_total.load(Ordering::Relaxed) as f64),
    ),
    (
        Family::counter(
            "isoserve_node_transport_tls_handshakes_refused_total",
            "TLS handshakes refused (no certificate, another CA, wrong name, plaintext, too slow); no frame of them read",
        ),
        |_, t| Some(t.stats.tls_handshakes_refused_total.load(Ordering::Relaxed) as f64),
    ),
    (
        Family::counter(
            "isoserve_node_transfers_timed_total",
            "Transfers timed (decode: first page to checked Done)",
        ),
        |s, _| Some(s.transfers_timed_total as f64),
    ),
    (
        Family::counter(
            "isoserve_node_transfer_seconds_total",
            "Wall time from a transfer's first page to its checked end (decode), summed",
        ),
        |s, _| Some(s.transfer_seconds_total),
    ),
];

/// The families of [`NODE_METRICS`].
pub fn node_families() -> Vec<Family> {
    NODE_METRICS.iter().map(|(f, _)| *f).collect()
}

/// A PD node's counters, as samples for a Prometheus encoder (the node's
/// ops listener serves them, and as JSON for the supervising gateway).
pub fn node_samples(s: &PdStats, t: &Transport) -> Vec<MetricSample> {
    NODE_METRICS
        .iter()
        .filter_map(|(f, read)| read(s, t).map(|v| f.sample(v)))
        .collect()
}
