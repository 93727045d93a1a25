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

use crate::role::{NetCommand, PdConfig, PdNode, PdRole};
use crate::transport::{Transport, TransportConfig};

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

/// Serves `GET /metrics` (Prometheus text of the node's pool, transfer
/// checks and transport) on `listener` until aborted. A deliberately small
/// HTTP/1.0 responder: one request per connection, bounded head and time.
pub async fn serve_metrics(listener: TcpListener, node: Arc<PdNode>, transport: Arc<Transport>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const HEAD_BYTES_MAX: usize = 8192;
    loop {
        let Ok((mut s, _)) = listener.accept().await else {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        };
        let node = node.clone();
        let transport = transport.clone();
        tokio::spawn(async move {
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            let read = tokio::time::timeout(std::time::Duration::from_secs(5), async {
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
            let (status, body) = if head.starts_with(b"GET /metrics ") {
                (
                    "200 OK",
                    crate::gateway::node_metrics(&node.stats(), &transport),
                )
            } else {
                ("404 Not Found", "not found: GET /metrics\n".to_string())
            };
            let resp = format!(
                "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(resp.as_bytes()).await;
            let _ = s.shutdown().await;
        });
    }
}
