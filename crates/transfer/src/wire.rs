//! The wire format: versioned, length-prefixed binary frames.
//!
//! ```text
//! frame   = len:u32le  version:u8  kind:u8  payload[len - 2]
//! ```
//!
//! `len` counts the bytes after itself. Integers are little endian; strings
//! are `u32 length + UTF-8`; byte blobs `u32 length + bytes`; vectors
//! `u32 count + items`. Every length is checked against a limit *before* any
//! allocation, so a corrupt or hostile peer gets an error, never a panic or
//! a huge allocation. Page bytes travel as raw bytes (no JSON, no base64).

use thiserror::Error;

/// Version of this format. A peer speaking another version is refused at
/// the handshake.
pub const WIRE_VERSION: u8 = 1;
/// Largest frame (a page of a large model plus headers). Bigger frames are
/// refused before their body is read.
pub const FRAME_BYTES_MAX: usize = 64 << 20;
/// Largest string (error messages, node names).
pub const STRING_BYTES_MAX: usize = 4096;
/// Largest vector of page handles or tokens in one message.
pub const ITEMS_MAX: usize = 1 << 20;

/// A page handle on the wire: the destination's `(index, epoch)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WirePage {
    pub index: u32,
    pub epoch: u64,
}

/// KV layout of a node; must match exactly between paired nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvLayout {
    pub page_size: u32,
    /// 0 = f32, 1 = f16.
    pub dtype: u8,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
}

/// Every message of the protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// First frame on every connection, both directions.
    Hello {
        role: u8,
        node: String,
        /// Hash of weights, quantisation, dims and rope of the model.
        model_fingerprint: [u8; 32],
        layout: KvLayout,
        /// The largest request (prompt + max_tokens) the node accepts (K8).
        max_request_tokens: u32,
    },
    /// Gateway → decode: reserve pages for a request.
    Reserve {
        req: u64,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
    },
    /// Decode → gateway: the reservation, page handles in sequence order.
    Reserved { req: u64, pages: Vec<WirePage> },
    /// Any node → gateway: the request is refused or failed; the original
    /// error travels unchanged to the client (K9).
    Rejected {
        req: u64,
        code: u16,
        message: String,
    },
    /// Gateway → prefill: compute the prompt's KV into the reserved pages.
    Prefill {
        req: u64,
        tenant: u64,
        tokens: Vec<u32>,
        max_tokens: u32,
        pages: Vec<WirePage>,
    },
    /// Prefill → decode: one page of KV.
    Page {
        req: u64,
        /// Page position in the sequence.
        position: u32,
        dst: WirePage,
        /// Token slots written in every layer.
        slots: u32,
        /// Checksum over (req, dst epoch, position, bytes) (K6).
        checksum: u64,
        /// Sender's canary, bound to the destination (K7).
        canary: u64,
        bytes: Vec<u8>,
    },
    /// Prefill → decode: the transfer is complete.
    Done {
        req: u64,
        first_token: u32,
        page_count: u32,
        token_count: u32,
        /// Digest over all page checksums in order.
        digest: u64,
    },
    /// Decode → prefill: pages received up to `pages` (flow control and the
    /// end of prefill's deferred release, K4).
    Ack { req: u64, pages: u32 },
    /// Gateway → any: cooperative cancel.
    Cancel { req: u64 },
    /// Decode → gateway: a generated token.
    Token { req: u64, id: u32, text: String },
    /// Decode → gateway: the end of generation.
    Finished {
        req: u64,
        finish: u8,
        prompt_tokens: u32,
        completion_tokens: u32,
    },
    /// Liveness.
    Heartbeat { nonce: u64 },
}

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    FrameTooLarge { len: usize, max: usize },
    #[error("frame of {len} bytes is too short")]
    FrameTooShort { len: usize },
    #[error("wire version {got}, this node speaks {WIRE_VERSION}")]
    Version { got: u8 },
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    #[error("truncated {what}")]
    Truncated { what: &'static str },
    #[error("{what} of {len} exceeds the limit of {max}")]
    TooLong {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error("invalid UTF-8 in {what}")]
    Utf8 { what: &'static str },
    #[error("{extra} trailing bytes after a {kind} message")]
    Trailing { kind: &'static str, extra: usize },
}

const K_HELLO: u8 = 1;
const K_RESERVE: u8 = 2;
const K_RESERVED: u8 = 3;
const K_REJECTED: u8 = 4;
const K_PREFILL: u8 = 5;
const K_PAGE: u8 = 6;
const K_DONE: u8 = 7;
const K_ACK: u8 = 8;
const K_CANCEL: u8 = 9;
const K_TOKEN: u8 = 10;
const K_FINISHED: u8 = 11;
const K_HEARTBEAT: u8 = 12;

impl Message {
    pub fn kind_name(&self) -> &'static str {
        match self {
            Message::Hello { .. } => "Hello",
            Message::Reserve { .. } => "Reserve",
            Message::Reserved { .. } => "Reserved",
            Message::Rejected { .. } => "Rejected",
            Message::Prefill { .. } => "Prefill",
            Message::Page { .. } => "Page",
            Message::Done { .. } => "Done",
            Message::Ack { .. } => "Ack",
            Message::Cancel { .. } => "Cancel",
            Message::Token { .. } => "Token",
            Message::Finished { .. } => "Finished",
            Message::Heartbeat { .. } => "Heartbeat",
        }
    }

    /// Appends this message as one frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.extend_from_slice(&[0; 4]);
        out.push(WIRE_VERSION);
        let mut w = Writer(out);
        match self {
            Message::Hello {
                role,
                node,
                model_fingerprint,
                layout,
                max_request_tokens,
            } => {
                w.u8(K_HELLO);
                w.u8(*role);
                w.str(node);
                w.raw(model_fingerprint);
                w.u32(layout.page_size);
                w.u8(layout.dtype);
                w.u32(layout.layers);
                w.u32(layout.kv_heads);
                w.u32(layout.head_dim);
                w.u32(*max_request_tokens);
            }
            Message::Reserve {
                req,
                tenant,
                prompt_tokens,
                max_tokens,
            } => {
                w.u8(K_RESERVE);
                w.u64(*req);
                w.u64(*tenant);
                w.u32(*prompt_tokens);
                w.u32(*max_tokens);
            }
            Message::Reserved { req, pages } => {
                w.u8(K_RESERVED);
                w.u64(*req);
                w.pages(pages);
            }
            Message::Rejected { req, code, message } => {
                w.u8(K_REJECTED);
                w.u64(*req);
                w.u16(*code);
                w.str(message);
            }
            Message::Prefill {
                req,
                tenant,
                tokens,
                max_tokens,
                pages,
            } => {
                w.u8(K_PREFILL);
                w.u64(*req);
                w.u64(*tenant);
                w.u32(tokens.len() as u32);
                for t in tokens {
                    w.u32(*t);
                }
                w.u32(*max_tokens);
                w.pages(pages);
            }
            Message::Page {
                req,
                position,
                dst,
                slots,
                checksum,
                canary,
                bytes,
            } => {
                w.u8(K_PAGE);
                w.u64(*req);
                w.u32(*position);
                w.u32(dst.index);
                w.u64(dst.epoch);
                w.u32(*slots);
                w.u64(*checksum);
                w.u64(*canary);
                w.u32(bytes.len() as u32);
                w.raw(bytes);
            }
            Message::Done {
                req,
                first_token,
                page_count,
                token_count,
                digest,
            } => {
                w.u8(K_DONE);
                w.u64(*req);
                w.u32(*first_token);
                w.u32(*page_count);
                w.u32(*token_count);
                w.u64(*digest);
            }
            Message::Ack { req, pages } => {
                w.u8(K_ACK);
                w.u64(*req);
                w.u32(*pages);
            }
            Message::Cancel { req } => {
                w.u8(K_CANCEL);
                w.u64(*req);
            }
            Message::Token { req, id, text } => {
                w.u8(K_TOKEN);
                w.u64(*req);
                w.u32(*id);
                w.str(text);
            }
            Message::Finished {
                req,
                finish,
                prompt_tokens,
                completion_tokens,
            } => {
                w.u8(K_FINISHED);
                w.u64(*req);
                w.u8(*finish);
                w.u32(*prompt_tokens);
                w.u32(*completion_tokens);
            }
            Message::Heartbeat { nonce } => {
                w.u8(K_HEARTBEAT);
                w.u64(*nonce);
            }
        }
        let len = (out.len() - start - 4) as u32;
        out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    }

    /// Decodes one frame from the front of `buf`. `Ok(None)`: more bytes
    /// are needed. `Ok(Some((msg, consumed)))`: a whole frame. A frame that
    /// announces more than [`FRAME_BYTES_MAX`] is refused from its header.
    pub fn decode(buf: &[u8]) -> Result<Option<(Message, usize)>, WireError> {
        if buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        if len > FRAME_BYTES_MAX {
            return Err(WireError::FrameTooLarge {
                len,
                max: FRAME_BYTES_MAX,
            });
        }
        if len < 2 {
            return Err(WireError::FrameTooShort { len });
        }
        if buf.len() < 4 + len {
            return Ok(None);
        }
        let body = &buf[4..4 + len];
        if body[0] != WIRE_VERSION {
            return Err(WireError::Version { got: body[0] });
        }
        let mut r = Reader(&body[2..]);
        let msg = match body[1] {
            K_HELLO => Message::Hello {
                role: r.u8("role")?,
                node: r.str("node")?,
                model_fingerprint: r.array32("fingerprint")?,
                layout: KvLayout {
                    page_size: r.u32("page_size")?,
                    dtype: r.u8("dtype")?,
                    layers: r.u32("layers")?,
                    kv_heads: r.u32("kv_heads")?,
                    head_dim: r.u32("head_dim")?,
                },
                max_request_tokens: r.u32("max_request_tokens")?,
            },
            K_RESERVE => Message::Reserve {
                req: r.u64("req")?,
                tenant: r.u64("tenant")?,
                prompt_tokens: r.u32("prompt_tokens")?,
                max_tokens: r.u32("max_tokens")?,
            },
            K_RESERVED => Message::Reserved {
                req: r.u64("req")?,
                pages: r.pages()?,
            },
            K_REJECTED => Message::Rejected {
                req: r.u64("req")?,
                code: r.u16("code")?,
                message: r.str("message")?,
            },
            K_PREFILL => {
                let req = r.u64("req")?;
                let tenant = r.u64("tenant")?;
                let n = r.count("tokens", 4)?;
                let mut tokens = Vec::with_capacity(n);
                for _ in 0..n {
                    tokens.push(r.u32("token")?);
                }
                Message::Prefill {
                    req,
                    tenant,
                    tokens,
                    max_tokens: r.u32("max_tokens")?,
                    pages: r.pages()?,
                }
            }
            K_PAGE => Message::Page {
                req: r.u64("req")?,
                position: r.u32("position")?,
                dst: WirePage {
                    index: r.u32("dst index")?,
                    epoch: r.u64("dst epoch")?,
                },
                slots: r.u32("slots")?,
                checksum: r.u64("checksum")?,
                canary: r.u64("canary")?,
                bytes: {
                    let n = r.count("page bytes", 1)?;
                    r.take(n, "page bytes")?.to_vec()
                },
            },
            K_DONE => Message::Done {
                req: r.u64("req")?,
                first_token: r.u32("first_token")?,
                page_count: r.u32("page_count")?,
                token_count: r.u32("token_count")?,
                digest: r.u64("digest")?,
            },
            K_ACK => Message::Ack {
                req: r.u64("req")?,
                pages: r.u32("pages")?,
            },
            K_CANCEL => Message::Cancel { req: r.u64("req")? },
            K_TOKEN => Message::Token {
                req: r.u64("req")?,
                id: r.u32("id")?,
                text: r.str("text")?,
            },
            K_FINISHED => Message::Finished {
                req: r.u64("req")?,
                finish: r.u8("finish")?,
                prompt_tokens: r.u32("prompt_tokens")?,
                completion_tokens: r.u32("completion_tokens")?,
            },
            K_HEARTBEAT => Message::Heartbeat {
                nonce: r.u64("nonce")?,
            },
            other => return Err(WireError::UnknownKind(other)),
        };
        if !r.0.is_empty() {
            return Err(WireError::Trailing {
                kind: msg.kind_name(),
                extra: r.0.len(),
            });
        }
        Ok(Some((msg, 4 + len)))
    }
}

struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn raw(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    fn str(&mut self, s: &str) {
        // Strings longer than the limit are cut at a char boundary: the
        // receiver would refuse them whole.
        let mut end = s.len().min(STRING_BYTES_MAX);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u32(end as u32);
        self.raw(&s.as_bytes()[..end]);
    }
    fn pages(&mut self, pages: &[WirePage]) {
        self.u32(pages.len() as u32);
        for p in pages {
            self.u32(p.index);
            self.u64(p.epoch);
        }
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Truncated { what });
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, WireError> {
        let b = self.take(2, what)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn array32(&mut self, what: &'static str) -> Result<[u8; 32], WireError> {
        let b = self.take(32, what)?;
        let mut a = [0u8; 32];
        a.copy_from_slice(b);
        Ok(a)
    }
    /// A count of items of `item_bytes` each, checked against the limit and
    /// the bytes left before anything is allocated.
    fn count(&mut self, what: &'static str, item_bytes: usize) -> Result<usize, WireError> {
        let n = self.u32(what)? as usize;
        let max = if item_bytes == 1 {
            FRAME_BYTES_MAX
        } else {
            ITEMS_MAX
        };
        if n > max {
            return Err(WireError::TooLong { what, len: n, max });
        }
        if n.saturating_mul(item_bytes) > self.0.len() {
            return Err(WireError::Truncated { what });
        }
        Ok(n)
    }
    fn str(&mut self, what: &'static str) -> Result<String, WireError> {
        let n = self.u32(what)? as usize;
        if n > STRING_BYTES_MAX {
            return Err(WireError::TooLong {
                what,
                len: n,
                max: STRING_BYTES_MAX,
            });
        }
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| WireError::Utf8 { what })
    }
    fn pages(&mut self) -> Result<Vec<WirePage>, WireError> {
        let n = self.count("pages", 12)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(WirePage {
                index: self.u32("page index")?,
                epoch: self.u64("page epoch")?,
            });
        }
        Ok(v)
    }
}
