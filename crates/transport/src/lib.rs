//! `transport` — TCP for the PD protocol: one reader and one writer task per
//! connection, length-prefixed frames ([`transfer::wire`]), heartbeats, and
//! a limit on everything (frame size from the wire format, outgoing frames
//! queued per connection, dial and heartbeat timeouts).
//!
//! The transport knows nothing of the protocol: it turns bytes into
//! [`Message`]s and connection ends into [`NetEvent`]s for whoever
//! owns the state machine, and carries out sends, closes and dials.
//!
//! With [`TransportConfig::tls`] every connection, accepted or dialled, is
//! mutually authenticated TLS 1.3 against the operator's CA ([`tls`]): a
//! peer without a certificate from it, or speaking plaintext, is refused in
//! the handshake, before any frame is read, and counted
//! (`tls_handshakes_refused_total`). Handshakes in progress count against
//! the connection limits and have their own timeout.
//!
//! ```no_run
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! use transport::{TlsSettings, Transport, TransportConfig, TransportTls};
//! let tls = TransportTls::load(&TlsSettings {
//!     cert: "node.pem".into(),
//!     key: "node.key".into(),
//!     ca: "ca.pem".into(),
//!     server_name: transport::tls::DEFAULT_SERVER_NAME.into(),
//! })?;
//! let (tx, _rx) = tokio::sync::mpsc::channel(64);
//! let cfg = TransportConfig { tls: Some(tls), ..TransportConfig::default() };
//! let t = Transport::new(cfg, tokio::runtime::Handle::current(), tx);
//! t.dial("10.0.0.7:7100".into()); // Dialled or DialFailed follows, as an event
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

pub mod tls;
pub use tls::{TlsError, TlsSettings, TransportTls};

/// Why a dial failed (its text is what `NetEvent::DialFailed` carries).
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    #[error("{0}")]
    Connect(std::io::Error),
    #[error("connect timed out")]
    ConnectTimedOut,
    #[error("TLS handshake with {addr} failed: {source}")]
    Handshake {
        addr: String,
        source: std::io::Error,
    },
    #[error("TLS handshake with {addr} timed out")]
    HandshakeTimedOut { addr: String },
}

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
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
    /// Mutual TLS for every connection; `None`: plaintext (loopback, or an
    /// operator's explicit `--insecure-transfer`).
    pub tls: Option<TransportTls>,
    /// A TLS handshake not done within this is refused.
    pub handshake_timeout: Duration,
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
            tls: None,
            handshake_timeout: Duration::from_secs(5),
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
    /// TLS handshakes that failed, accepted or dialled: a peer with no
    /// certificate, one from another CA, the wrong name, plaintext, or too
    /// slow. No frame of such a connection is ever read.
    pub tls_handshakes_refused_total: AtomicU64,
}

type ReadBox = Box<dyn AsyncRead + Unpin + Send>;
type WriteBox = Box<dyn AsyncWrite + Unpin + Send>;

fn tcp_halves(s: TcpStream) -> (ReadBox, WriteBox) {
    let (r, w) = s.into_split();
    (Box::new(r), Box::new(w))
}

fn halves<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(s: S) -> (ReadBox, WriteBox) {
    let (r, w) = tokio::io::split(s);
    (Box::new(r), Box::new(w))
}

/// The transport of one node.
pub struct Transport {
    cfg: TransportConfig,
    rt: Handle,
    next_conn: AtomicU64,
    conns: Mutex<HashMap<u64, ConnEntry>>,
    /// Accepted connections still in their TLS handshake, by peer: they
    /// count against the limits like live ones.
    handshaking: Mutex<HashMap<Option<std::net::IpAddr>, usize>>,
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
            handshaking: Mutex::new(HashMap::new()),
            events,
            stats: TransportStats::default(),
        })
    }

    /// An accepted stream: `Accepted` is reported before any of its
    /// messages. Beyond `connections_max` live connections (or
    /// `connections_per_peer_max` from its address) the stream is dropped
    /// unread and `false` returned. With TLS the handshake runs in a task
    /// of its own (a slow peer never holds up the accept loop), and the
    /// connection is reported only once it completed.
    pub async fn accepted(self: &Arc<Self>, stream: TcpStream) -> bool {
        let peer = stream.peer_addr().ok().map(|a| a.ip());
        let (live, from_peer) = {
            let conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
            let hs = self.handshaking.lock().unwrap_or_else(|e| e.into_inner());
            let from_peer = conns
                .values()
                .filter(|c| c.peer.is_some() && c.peer == peer)
                .count()
                + peer.map_or(0, |_| hs.get(&peer).copied().unwrap_or(0));
            (conns.len() + hs.values().sum::<usize>(), from_peer)
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
            return false;
        }
        let _ = stream.set_nodelay(true);
        let Some(tls) = &self.cfg.tls else {
            let (r, w) = tcp_halves(stream);
            self.register_gated(r, w, peer, |conn| NetEvent::Accepted { conn })
                .await;
            return true;
        };
        let acceptor = tls.acceptor.clone();
        *self
            .handshaking
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(peer)
            .or_insert(0) += 1;
        let t = self.clone();
        self.rt.spawn(async move {
            let done = tokio::time::timeout(t.cfg.handshake_timeout, acceptor.accept(stream)).await;
            {
                let mut hs = t.handshaking.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(n) = hs.get_mut(&peer) {
                    *n -= 1;
                    if *n == 0 {
                        hs.remove(&peer);
                    }
                }
            }
            match done {
                Ok(Ok(s)) => {
                    let (r, w) = halves(s);
                    t.register_gated(r, w, peer, |conn| NetEvent::Accepted { conn })
                        .await;
                }
                Ok(Err(e)) => t.tls_refused(peer, &e.to_string()),
                Err(_) => t.tls_refused(peer, "handshake timed out"),
            }
        });
        true
    }

    fn tls_refused(&self, peer: Option<std::net::IpAddr>, why: &str) {
        self.stats
            .tls_handshakes_refused_total
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            ?peer,
            "TLS handshake refused, connection closed unread: {why}"
        );
    }

    /// Registers a stream's halves, reports `first(conn)`, then starts its
    /// reader and writer (so the first event precedes every message).
    async fn register_gated(
        self: &Arc<Self>,
        read: ReadBox,
        write: WriteBox,
        peer: Option<std::net::IpAddr>,
        first: impl FnOnce(u64) -> NetEvent,
    ) -> u64 {
        let conn = self.next_conn.fetch_add(1, Ordering::Relaxed);
        self.stats.connections_total.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(self.cfg.queue_frames_max);
        let before = self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(conn, ConnEntry { tx, peer });
        // Connection ids come from one counter: never two live at once.
        assert!(before.is_none(), "connection {conn} registered twice");
        let _ = self.events.send(first(conn)).await;
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

    /// Connects to `addr` (and with TLS, completes the handshake, checking
    /// the server's certificate and name): the stream's halves, or why not.
    async fn connect(self: &Arc<Self>, addr: &str) -> Result<(ReadBox, WriteBox), DialError> {
        let stream =
            match tokio::time::timeout(self.cfg.dial_timeout, TcpStream::connect(addr)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return Err(DialError::Connect(e)),
                Err(_) => return Err(DialError::ConnectTimedOut),
            };
        let _ = stream.set_nodelay(true);
        let Some(tls) = &self.cfg.tls else {
            return Ok(tcp_halves(stream));
        };
        let hs = tls.connector.connect(tls.server_name.clone(), stream);
        match tokio::time::timeout(self.cfg.handshake_timeout, hs).await {
            Ok(Ok(s)) => Ok(halves(s)),
            Ok(Err(e)) => {
                self.tls_refused(None, &format!("{addr}: {e}"));
                Err(DialError::Handshake {
                    addr: addr.to_string(),
                    source: e,
                })
            }
            Err(_) => {
                self.tls_refused(None, &format!("{addr}: handshake timed out"));
                Err(DialError::HandshakeTimedOut {
                    addr: addr.to_string(),
                })
            }
        }
    }

    /// Dials `addr` in the background: `Dialled` or `DialFailed` follows.
    pub fn dial(self: &Arc<Self>, addr: String) {
        let t = self.clone();
        self.rt.spawn(async move {
            match t.connect(&addr).await {
                Ok((r, w)) => {
                    let a = addr.clone();
                    t.register_gated(r, w, None, move |conn| NetEvent::Dialled { conn, addr: a })
                        .await;
                }
                Err(e) => {
                    let why = e.to_string();
                    let _ = t.events.send(NetEvent::DialFailed { addr, why }).await;
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
    ) -> Result<u64, DialError> {
        let (r, w) = self.connect(addr).await?;
        Ok(self.register_gated(r, w, None, first).await)
    }

    /// Frames queued for `conn` and not yet written (0 for a closed one).
    pub fn queued(&self, conn: u64) -> usize {
        let conns = self.conns.lock().unwrap_or_else(|e| e.into_inner());
        conns
            .get(&conn)
            .map_or(0, |c| c.tx.max_capacity() - c.tx.capacity())
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
        mut w: WriteBox,
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
            // Flush (TLS buffers records) once nothing more is queued, so a
            // burst of frames goes out in few records and syscalls.
            if rx.is_empty() && w.flush().await.is_err() {
                break;
            }
        }
        let _ = w.shutdown().await;
        self.report_closed(conn, &closed);
    }

    async fn reader(self: Arc<Self>, conn: u64, mut r: ReadBox, closed: Arc<AtomicBool>) {
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
