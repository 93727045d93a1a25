//! The front door (K13): no single client can hold every connection, and
//! `/health` answers even when the server holds all it may.
//!
//! * **Per client.** At most [`ServerConfig::max_connections_per_client`]
//!   connections per client address; one more is answered 429
//!   (`too_many_connections`, OpenAI's error shape) and closed.
//! * **In all.** At most [`ServerConfig::max_connections`]; beyond it a
//!   connection is answered 503 (`server_busy`) and closed — except
//!   `GET /health`, which is answered as usual. These answers run in an
//!   *overflow lane* of [`OVERFLOW_MAX`] connections, each with
//!   [`OVERFLOW_TIMEOUT`] to send its request head, at most
//!   [`OVERFLOW_PER_CLIENT`] of them from one address; beyond that a
//!   connection is closed at once. Nothing in the lane reaches the backend.
//! * **Silence.** A connection must send its first request byte within
//!   [`ServerConfig::first_byte_timeout`] (a connection that never speaks
//!   holds a slot that long at most); hyper's header timeout bounds the
//!   rest of the head and the idle time between keep-alive requests.
//!
//! [`ServerConfig::max_connections_per_client`]: crate::ServerConfig::max_connections_per_client
//! [`ServerConfig::max_connections`]: crate::ServerConfig::max_connections
//! [`ServerConfig::first_byte_timeout`]: crate::ServerConfig::first_byte_timeout

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Connections answered at once in the overflow lane.
pub const OVERFLOW_MAX: usize = 64;
/// Time an overflow connection has to send its request head.
pub const OVERFLOW_TIMEOUT: Duration = Duration::from_secs(2);
/// Overflow-lane connections of one client address at once: one address
/// cannot fill the lane and keep `/health` from others.
pub const OVERFLOW_PER_CLIENT: usize = 8;

/// Connections held per client address.
#[derive(Debug)]
pub(crate) struct Door {
    per_client: Mutex<HashMap<IpAddr, usize>>,
    max_per_client: usize,
}

/// A client's hold on one of its connections; released on drop.
pub(crate) struct ClientSlot {
    door: Arc<Door>,
    ip: IpAddr,
}

impl Door {
    pub fn new(max_per_client: usize) -> Arc<Door> {
        Arc::new(Door {
            per_client: Mutex::new(HashMap::new()),
            max_per_client: max_per_client.max(1),
        })
    }

    /// A slot for one more connection of `ip`, unless it holds its limit.
    pub fn enter(self: &Arc<Door>, ip: IpAddr) -> Option<ClientSlot> {
        let mut m = self.per_client.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(ip).or_insert(0);
        if *n >= self.max_per_client {
            return None;
        }
        *n += 1;
        Some(ClientSlot {
            door: self.clone(),
            ip,
        })
    }

    /// Connections `ip` holds now.
    #[cfg(test)]
    pub fn held(&self, ip: IpAddr) -> usize {
        let m = self.per_client.lock().unwrap_or_else(|e| e.into_inner());
        m.get(&ip).copied().unwrap_or(0)
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut m = self
            .door
            .per_client
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                // The map holds only clients with a connection (bounded by
                // `max_connections`).
                m.remove(&self.ip);
            }
        }
    }
}

/// Why a connection is in the overflow lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Overflow {
    /// Its address holds its limit of connections.
    Client { limit: usize },
    /// The server holds its limit of connections.
    Server { limit: usize },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_holds_at_most_its_limit_and_slots_come_back() {
        let d = Door::new(2);
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let b: IpAddr = "127.0.0.3".parse().unwrap();
        let s1 = d.enter(a).unwrap();
        let _s2 = d.enter(a).unwrap();
        assert!(d.enter(a).is_none());
        // Another address is not affected.
        let _t = d.enter(b).unwrap();
        drop(s1);
        assert_eq!(d.held(a), 1);
        assert!(d.enter(a).is_some());
    }
}

/// What the front door makes of a connection's first request head.
#[derive(Debug, PartialEq)]
pub(crate) enum Head {
    /// Well formed (as far as the door checks): hyper takes it from here.
    Fine,
    /// Malformed: answer this error and close.
    Refuse(crate::ApiError),
    /// The connection ended or stalled before a whole head arrived.
    Gone,
}

/// Reads (without consuming) the first request head on `tcp` and checks
/// what hyper would refuse with a bare status line: too many headers, a
/// head over `limit` bytes, a malformed request line or header, and a
/// `Content-Length` that is not one decimal number (or several that
/// disagree). Bounded by `limit` bytes and `timeout`.
pub(crate) async fn first_head(
    tcp: &tokio::net::TcpStream,
    limit: usize,
    max_headers: usize,
    timeout: Duration,
) -> Head {
    use crate::ApiError;
    let deadline = tokio::time::Instant::now() + timeout;
    let mut buf = vec![0u8; limit + 1];
    let mut seen = 0;
    let mut pause = Duration::from_millis(2);
    loop {
        let n = match tokio::time::timeout_at(deadline, tcp.peek(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => n,
            _ => return Head::Gone,
        };
        if n > seen {
            // Parse only what is new to us (peek returns at once while
            // bytes wait unread, so a stalled head must not be re-parsed
            // in a loop).
            seen = n;
            pause = Duration::from_millis(2);
            let mut headers = vec![httparse::EMPTY_HEADER; max_headers];
            let mut req = httparse::Request::new(&mut headers);
            match req.parse(&buf[..n]) {
                Ok(httparse::Status::Complete(_)) => return check_lengths(req.headers),
                Ok(httparse::Status::Partial) if n > limit => {
                    return Head::Refuse(ApiError::head_too_large(limit))
                }
                Ok(httparse::Status::Partial) => {}
                Err(httparse::Error::TooManyHeaders) => {
                    return Head::Refuse(ApiError::too_many_headers(max_headers))
                }
                Err(e) => return Head::Refuse(ApiError::malformed_request(&e.to_string())),
            }
        }
        // More of the head is on its way (or never comes): look again
        // after a pause that doubles while nothing arrives (at most 4
        // looks a second for a stalled head; bounded by `timeout`).
        if tokio::time::Instant::now() + pause >= deadline {
            return Head::Gone;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(250));
    }
}

fn check_lengths(headers: &[httparse::Header<'_>]) -> Head {
    use crate::ApiError;
    let mut length: Option<u64> = None;
    for h in headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("content-length"))
    {
        let v = std::str::from_utf8(h.value).unwrap_or("").trim();
        let parsed = match v.bytes().all(|b| b.is_ascii_digit()) && !v.is_empty() {
            true => v.parse::<u64>().ok(),
            false => None,
        };
        let Some(n) = parsed else {
            let shown: String = v.chars().take(32).collect();
            return Head::Refuse(ApiError::bad_content_length(&format!(
                "`{shown}` is not a length in bytes"
            )));
        };
        if length.is_some_and(|l| l != n) {
            return Head::Refuse(ApiError::bad_content_length(
                "two Content-Length headers disagree",
            ));
        }
        length = Some(n);
    }
    Head::Fine
}

/// Writes `e` as a whole HTTP/1.1 response (OpenAI's JSON error, then
/// `Connection: close`) and closes the connection; bounded by a second.
pub(crate) async fn answer_and_close(mut tcp: tokio::net::TcpStream, e: &crate::ApiError) {
    use tokio::io::AsyncWriteExt;
    let body = serde_json::to_vec(&e.body()).unwrap_or_default();
    let head = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        e.status.as_u16(),
        e.status.canonical_reason().unwrap_or(""),
        body.len()
    );
    let write = async {
        tcp.write_all(head.as_bytes()).await?;
        tcp.write_all(&body).await?;
        tcp.shutdown().await?;
        // Read what the client sent (the head was only peeked): closing
        // with unread bytes would reset the connection and could lose the
        // answer. Bounded: 1 MiB, and the timeout below.
        let mut sink = [0u8; 16 << 10];
        let mut drained = 0;
        use tokio::io::AsyncReadExt;
        while drained < (1 << 20) {
            match tcp.read(&mut sink).await? {
                0 => break,
                n => drained += n,
            }
        }
        std::io::Result::Ok(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}
