//! `transport` — TCP for the PD protocol: one reader and one writer task per
//! connection, length-prefixed frames ([`transfer::wire`]), heartbeats, and
//! a limit on everything (frame size from the wire format, outgoing frames
//! queued per connection, dial and heartbeat timeouts).
//!
//! The transport knows nothing of the protocol: it turns bytes into
//! [`Message`]s and connection ends into [`NetEvent`]s for whoever
//! owns the state machine, and carries out sends, closes and dials.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::runtime::Handle;
use tokio::sync::mpsc;
use transfer::node::NetEvent;
use transfer::wire::{Message, FRAME_BYTES_MAX};

/// Limits and timings of the transport.
#[derive(Clone, Debug)]
pub struct TransportConfig {
    /// A heartbeat goes out after this long without a frame sent.
    pub heartbeat_interval: Duration,
    /// A connection with nothing received for this long is dead.
    pub heartbeat_timeout: Duration,
    /// Frames queued for one connection; a peer that lets more pile up is
    /// not reading and is disconnected.
    pub queue_frames_max: usize,
    pub dial_timeout: Duration,
    /// Live connections at most; an accepted connection beyond it is
    /// closed at once, before any byte is read, and counted
    /// (`connections_refused_total`).
    pub connections_max: usize,
    /// Live connections accepted from one peer address at most (K13: one
    /// host cannot take every slot of a node); beyond it a connection is
    /// closed unread and counted like the global limit's.
    pub connections_per_peer_max: usize,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            heartbeat_interval: Duration::from_millis(500),
            heartbeat_timeout: Duration::from_secs(5),
            queue_frames_max: 16_384,
            dial_timeout: Duration::from_secs(5),
            connections_max: 1024,
            connections_per_peer_max: 64,
        }
    }
}

enum Outgoing {
    Frame(Vec<u8>),
    Close,
}

struct ConnEntry {
    tx: mpsc::Sender<Outgoing>,
    /// The peer's address, for connections it opened to us.
    peer: Option<std::net::IpAddr>,
}

/// Counters of the transport (bytes and frames both ways, per kind of end).
#[derive(Debug, Default)]
pub struct TransportStats {
    pub bytes_sent_total: AtomicU64,
    pub bytes_received_total: AtomicU64,
    pub frames_sent_total: AtomicU64,
    pub frames_received_total: AtomicU64,
    pub bad_frames_total: AtomicU64,
    pub heartbeat_timeouts_total: AtomicU64,
    pub slow_peer_disconnects_total: AtomicU64,
    pub connections_total: AtomicU64,
    pub connections_refused_total: AtomicU64,
}

/// The transport of one node.
pub struct Transport {
    cfg: TransportConfig,
    rt: Handle,
    next_conn: AtomicU64,
    conns: Mutex<HashMap<u64, ConnEntry>>,
    events: mpsc::Sender<NetEvent>,
    pub stats: TransportStats,
}

impl Transport {
    /// A transport whose events go to `events` (bounded: readers wait when
    /// the owner falls behind, and TCP pushes back on the peer).
    pub fn new(cfg: TransportConfig, rt: Handle, events: mpsc::Sender<NetEvent>) -> Arc<Transport> {
        Arc::new(Transport {
            cfg,
            rt,
            next_conn: AtomicU64::new(1),
            conns: Mutex::new(HashMap::new()),
            events,
            stats: TransportStats::default(),
        })
    }

    /// An accepted stream: `Accepted` is reported before any of its
    /// messages. Beyond `connections_max` live connections the stream is
    /// dropped unread (`None`).
    pub async fn accepted(self: &Arc<Self>, stream: TcpStream) -> Option<u64> {
        let peer = stream.peer_addr().ok().map(|a| a.ip());
        let (live, from_peer) = {
            let conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
            let from_peer = conns
                .values()
                .filter(|c| c.peer.is_some() && c.peer == peer)
                .count();
            (conns.len(), from_peer)
        };
        if live >= self.cfg.connections_max || from_peer >= self.cfg.connections_per_peer_max {
            self.stats
                .connections_refused_total
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                ?peer,
                "{live} connections open, {from_peer} from this peer (limits {} and {} per \
                 peer): refusing one",
                self.cfg.connections_max,
                self.cfg.connections_per_peer_max
            );
            return None;
        }
        Some(
            self.register_gated(stream, peer, |conn| NetEvent::Accepted { conn })
                .await,
        )
    }

    /// Registers a stream, reports `first(conn)`, then starts its reader
    /// and writer (so the first event precedes every message).
    async fn register_gated(
        self: &Arc<Self>,
        stream: TcpStream,
        peer: Option<std::net::IpAddr>,
        first: impl FnOnce(u64) -> NetEvent,
    ) -> u64 {
        let _ = stream.set_nodelay(true);
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        self.stats.connections_total.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(self.cfg.queue_frames_max);
        self.conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(conn, ConnEntry { tx, peer });
        let _ = self.events.send(first(conn)).await;
        let (read, write) = stream.into_split();
        let closed = Arc::new(AtomicBool::new(false));
        let t = self.clone();
        let c = closed.clone();
        self.rt
            .spawn(async move { t.writer(conn, write, rx, c).await });
        let t = self.clone();
        self.rt
            .spawn(async move { t.reader(conn, read, closed).await });
        conn
    }

    /// Dials `addr` in the background: `Dialled` or `DialFailed` follows.
    pub fn dial(self: &Arc<Self>, addr: String) {
        let t = self.clone();
        self.rt.spawn(async move {
            match tokio::time::timeout(t.cfg.dial_timeout, TcpStream::connect(&addr)).await {
                Ok(Ok(stream)) => {
                    let a = addr.clone();
                    t.register_gated(stream, None, move |conn| NetEvent::Dialled {
                        conn,
                        addr: a,
                    })
                    .await;
                }
                Ok(Err(e)) => {
                    let _ = t
                        .events
                        .send(NetEvent::DialFailed {
                            addr,
                            why: e.to_string(),
                        })
                        .await;
                }
                Err(_) => {
                    let _ = t
                        .events
                        .send(NetEvent::DialFailed {
                            addr,
                            why: "connect timed out".into(),
                        })
                        .await;
                }
            }
        });
    }

    /// Dials `addr` and waits: the connection id, or why it failed. The
    /// caller is told of the connection's messages and end as events.
    pub async fn dial_wait(
        self: &Arc<Self>,
        addr: &str,
        first: impl FnOnce(u64) -> NetEvent,
    ) -> Result<u64, String> {
        match tokio::time::timeout(self.cfg.dial_timeout, TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => Ok(self.register_gated(stream, None, first).await),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("connect timed out".into()),
        }
    }

    /// Queues a message; never blocks. A connection whose queue is full is
    /// closed (its peer stopped reading).
    pub fn send(&self, conn: u64, msg: &Message) {
        let mut frame = Vec::new();
        msg.encode(&mut frame);
        let conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        let Some(c) = conns.get(&conn) else {
            return;
        };
        match c.tx.try_send(Outgoing::Frame(frame)) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.stats
                    .slow_peer_disconnects_total
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    conn,
                    "peer is not reading ({} frames queued): closing",
                    self.cfg.queue_frames_max
                );
                // The writer sees the channel close and ends the connection.
                drop(conns);
                self.conns
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&conn);
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    /// Closes a connection after the frames already queued.
    pub fn close(&self, conn: u64) {
        let entry = self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&conn);
        if let Some(c) = entry {
            let _ = c.tx.try_send(Outgoing::Close);
        }
    }

    /// Closes every connection (shutdown).
    pub fn close_all(&self) {
        let all: Vec<u64> = self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .copied()
            .collect();
        for c in all {
            self.close(c);
        }
    }

    fn report_closed(&self, conn: u64, closed: &AtomicBool) {
        if !closed.swap(true, Ordering::AcqRel) {
            self.conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&conn);
            let ev = self.events.clone();
            self.rt.spawn(async move {
                let _ = ev.send(NetEvent::Closed { conn }).await;
            });
        }
    }

    async fn writer(
        self: Arc<Self>,
        conn: u64,
        mut w: tokio::net::tcp::OwnedWriteHalf,
        mut rx: mpsc::Receiver<Outgoing>,
        closed: Arc<AtomicBool>,
    ) {
        let mut hb = Vec::new();
        let mut nonce = 0u64;
        loop {
            let next = tokio::time::timeout(self.cfg.heartbeat_interval, rx.recv()).await;
            if closed.load(Ordering::Acquire) {
                break;
            }
            let frame = match next {
                Ok(Some(Outgoing::Frame(f))) => f,
                Ok(Some(Outgoing::Close)) | Ok(None) => break,
                Err(_) => {
                    nonce += 1;
                    hb.clear();
                    Message::Heartbeat { nonce }.encode(&mut hb);
                    std::mem::take(&mut hb)
                }
            };
            if w.write_all(&frame).await.is_err() {
                break;
            }
            self.stats
                .bytes_sent_total
                .fetch_add(frame.len() as u64, Ordering::Relaxed);
            self.stats.frames_sent_total.fetch_add(1, Ordering::Relaxed);
        }
        let _ = w.shutdown().await;
        self.report_closed(conn, &closed);
    }

    async fn reader(
        self: Arc<Self>,
        conn: u64,
        mut r: tokio::net::tcp::OwnedReadHalf,
        closed: Arc<AtomicBool>,
    ) {
        let mut buf: Vec<u8> = Vec::with_capacity(1 << 16);
        let mut chunk = vec![0u8; 1 << 16];
        'outer: loop {
            // Deliver every whole frame in the buffer.
            let mut off = 0;
            loop {
                match Message::decode(&buf[off..]) {
                    Ok(Some((msg, used))) => {
                        off += used;
                        self.stats
                            .frames_received_total
                            .fetch_add(1, Ordering::Relaxed);
                        if matches!(msg, Message::Heartbeat { .. }) {
                            continue;
                        }
                        if self
                            .events
                            .send(NetEvent::Message { conn, msg })
                            .await
                            .is_err()
                        {
                            break 'outer;
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        self.stats.bad_frames_total.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(conn, "bad frame, closing the connection: {e}");
                        break 'outer;
                    }
                }
            }
            buf.drain(..off);
            if buf.len() > FRAME_BYTES_MAX + 4 {
                break;
            }
            if closed.load(Ordering::Acquire) {
                break;
            }
            match tokio::time::timeout(self.cfg.heartbeat_timeout, r.read(&mut chunk)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(n)) => {
                    self.stats
                        .bytes_received_total
                        .fetch_add(n as u64, Ordering::Relaxed);
                    buf.extend_from_slice(&chunk[..n]);
                }
                Err(_) => {
                    self.stats
                        .heartbeat_timeouts_total
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        conn,
                        "no frame for {:?}: the peer is gone",
                        self.cfg.heartbeat_timeout
                    );
                    break;
                }
            }
        }
        // Stop the writer too.
        let entry = self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&conn);
        if let Some(c) = entry {
            let _ = c.tx.try_send(Outgoing::Close);
        }
        self.report_closed(conn, &closed);
    }
}
