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
//! [`ServerConfig::max_connections_per_client`]: crate::config::ServerConfig::max_connections_per_client
//! [`ServerConfig::max_connections`]: crate::config::ServerConfig::max_connections
//! [`ServerConfig::first_byte_timeout`]: crate::config::ServerConfig::first_byte_timeout

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
    Refuse(crate::error::ApiError),
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
    use crate::error::ApiError;
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
    use crate::error::ApiError;
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
pub(crate) async fn answer_and_close(mut tcp: tokio::net::TcpStream, e: &crate::error::ApiError) {
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

/// A connection whose later malformed request heads are answered in
/// OpenAI's JSON shape too. [`first_head`] checks a connection's first head
/// before hyper sees it; a later head on a keep-alive connection (a bad
/// `Content-Length`, too many or too large headers, a bad request line)
/// is refused by hyper itself, which writes a bare status line (400, 414
/// or 431, no body, no `Content-Type`) and closes. This wrapper recognises
/// that response as hyper writes it — a whole head at the start of a
/// write, with one of those statuses and no `Content-Type` (every response
/// of ours has one) — and writes the JSON error in its place.
///
/// Vectored writes are off so that hyper hands each response head over in
/// one buffer. A pipelined client whose malformed head hyper parses while
/// the previous response is still unflushed gets hyper's bare status.
pub(crate) struct JsonErrors<S> {
    inner: S,
    /// The replacement still to write, and how much of it was written.
    pending: Vec<u8>,
    written: usize,
    header_limit: usize,
    on_refuse: Option<Box<dyn FnOnce(crate::error::Reason) + Send>>,
}

impl<S> JsonErrors<S> {
    pub(crate) fn new(
        inner: S,
        header_limit: usize,
        on_refuse: impl FnOnce(crate::error::Reason) + Send + 'static,
    ) -> JsonErrors<S> {
        JsonErrors {
            inner,
            pending: Vec::new(),
            written: 0,
            header_limit,
            on_refuse: Some(Box::new(on_refuse)),
        }
    }
}

/// The error hyper's bare response at the start of `buf` stands for, if
/// `buf` is exactly such a response.
fn bare_error(buf: &[u8], header_limit: usize) -> Option<crate::error::ApiError> {
    use crate::error::ApiError;
    let rest = buf.strip_prefix(b"HTTP/1.1 ")?;
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    if end != buf.len() {
        return None;
    }
    let head = std::str::from_utf8(&buf[..end]).ok()?.to_ascii_lowercase();
    if head.contains("\r\ncontent-type:") || !head.contains("\r\ncontent-length: 0\r\n") {
        return None;
    }
    Some(match rest.get(..4)? {
        b"400 " => ApiError::malformed_request(
            "a request line or header on this connection could not be parsed \
             (a bad method, URI, version, header or Content-Length)",
        ),
        b"414 " => ApiError::malformed_request("the request URI is too long"),
        b"431 " => ApiError::head_too_large(header_limit),
        _ => return None,
    })
}

/// `e` as a whole HTTP/1.1 response that closes the connection.
fn response_bytes(e: &crate::error::ApiError) -> Vec<u8> {
    let body = serde_json::to_vec(&e.body()).unwrap_or_default();
    let mut out = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        e.status.as_u16(),
        e.status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    out
}

impl<S: tokio::io::AsyncWrite + Unpin> JsonErrors<S> {
    /// Writes what is left of a replacement.
    fn poll_pending(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        while self.written < self.pending.len() {
            let n = match std::pin::Pin::new(&mut self.inner)
                .poll_write(cx, &self.pending[self.written..])
            {
                Poll::Ready(Ok(n)) => n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            };
            if n == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for JsonErrors<S> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for JsonErrors<S> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        use std::task::Poll;
        let me = self.get_mut();
        match me.poll_pending(cx) {
            Poll::Ready(Ok(())) => {}
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => return Poll::Pending,
        }
        if me.pending.is_empty() {
            if let Some(e) = bare_error(buf, me.header_limit) {
                if let Some(f) = me.on_refuse.take() {
                    f(e.reason);
                }
                me.pending = response_bytes(&e);
                // Taken whole; the replacement goes out here or at the
                // flush hyper does next.
                if let Poll::Ready(Err(e)) = me.poll_pending(cx) {
                    return Poll::Ready(Err(e));
                }
                return Poll::Ready(Ok(buf.len()));
            }
        } else {
            // Hyper closes after its error response: nothing more is
            // expected, and nothing more goes out.
            return Poll::Ready(Ok(buf.len()));
        }
        std::pin::Pin::new(&mut me.inner).poll_write(cx, buf)
    }

    fn is_write_vectored(&self) -> bool {
        false
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let me = self.get_mut();
        match me.poll_pending(cx) {
            Poll::Ready(Ok(())) => std::pin::Pin::new(&mut me.inner).poll_flush(cx),
            other => other,
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let me = self.get_mut();
        match me.poll_pending(cx) {
            Poll::Ready(Ok(())) => std::pin::Pin::new(&mut me.inner).poll_shutdown(cx),
            other => other,
        }
    }
}

#[cfg(test)]
mod json_errors_tests {
    use super::*;

    #[test]
    fn hypers_bare_statuses_become_json_and_ours_pass() {
        let bare = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: Sat, 05 Dec 2026 13:00:00 GMT\r\n\r\n";
        let e = bare_error(bare, 8192).expect("hyper's 431");
        assert_eq!(e.status.as_u16(), 431);
        let e = bare_error(
            b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
            8192,
        )
        .expect("hyper's 400");
        assert_eq!(e.status.as_u16(), 400);
        let text = String::from_utf8(response_bytes(&e)).unwrap();
        assert!(text.starts_with("HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"));
        assert!(text.contains("\"code\":\"malformed_request\""), "{text}");
        // Ours: a Content-Type, a body, another status, a head split
        // from the rest of the write.
        for ours in [
            &b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n"[..],
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}",
            b"HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n",
            b"data: HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n",
        ] {
            assert!(bare_error(ours, 8192).is_none(), "{}", String::from_utf8_lossy(ours));
        }
    }
}
