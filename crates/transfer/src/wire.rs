//! The wire format: versioned, length-prefixed binary frames.
//!
//! ```text
//! frame   = len:u32le  version:u8  kind:u8  payload  check:u64le
//! ```
//!
//! `len` counts the bytes after itself. `check` is xxh3-64 over version,
//! kind and payload, except a `Page`'s raw KV bytes: those are covered by
//! the page checksum bound to (request, epoch, position) (K6), checked by
//! decode against its reservation, so a flipped KV byte fails that request
//! with a checksum error while a flip anywhere else (a token id, a handle,
//! a length) fails the frame and the connection — never a different message. Integers are little endian; strings
//! are `u32 length + UTF-8`; byte blobs `u32 length + bytes`; vectors
//! `u32 count + items`. Every length is checked against a limit *before* any
//! allocation, so a corrupt or hostile peer gets an error, never a panic or
//! a huge allocation. Page bytes travel as raw bytes (no JSON, no base64).

use kv::{RequestId, Scope, TenantId};
use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

/// Version of this format. A peer speaking another version is refused at
/// the handshake. 7: `Finished`'s finish byte names the stop string that
/// matched (`request::finish_code`), which a v6 peer would read as
/// `length`. 8: a request's prediction travels in `GenSpec`, and
/// `Finished` counts what was kept of it.
pub const WIRE_VERSION: u8 = 8;
/// Largest frame (a page of a large model plus headers). Bigger frames are
/// refused before their body is read.
pub const FRAME_BYTES_MAX: usize = 64 << 20;
/// Largest string (error messages, node names).
pub const STRING_BYTES_MAX: usize = 4096;
/// Largest vector of page handles or tokens in one message.
pub const ITEMS_MAX: usize = 1 << 20;

/// A page handle on the wire: the destination's `(index, epoch)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
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

/// Most stop strings of one request on the wire: the request's own limit
/// (one constant for the API, the engine and the wire).
pub const STOPS_MAX: usize = request::STOP_STRINGS_MAX;
/// Most alternatives in a token's `top_logprobs`: the request's own limit.
pub const TOP_LOGPROBS_MAX: usize = request::TOP_LOGPROBS_MAX;
/// Most `logit_bias` entries of one request: the request's own limit.
pub const LOGIT_BIAS_MAX: usize = request::LOGIT_BIAS_MAX;
/// Most bytes of a grammar's source, and most choices: the request's own
/// limits.
pub const GRAMMAR_BYTES_MAX: usize = request::constraint::GRAMMAR_BYTES_MAX;
pub const GRAMMAR_CHOICES_MAX: usize = request::constraint::GRAMMAR_CHOICES_MAX;
/// Most tokens of a request's prediction.
pub const PREDICTION_TOKENS_MAX: usize = request::PREDICTION_TOKENS_MAX;

/// Of a request's prediction, the draft tokens decode's verification kept
/// and those it rejected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PredictionCounts {
    pub accepted: u32,
    pub rejected: u32,
}
pub use request::GrammarSpec;

/// How a request samples: everything decode needs to continue what prefill
/// started, and prefill needs to pick the first token. Floats travel as
/// their IEEE bits so that messages are `Eq + Hash` (the model checker
/// hashes states); the accessors give the values back.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct GenSpec {
    pub temperature_bits: u32,
    pub top_k: u32,
    pub top_p_bits: u32,
    pub min_p_bits: u32,
    pub repetition_penalty_bits: u32,
    pub presence_penalty_bits: u32,
    pub frequency_penalty_bits: u32,
    pub seed: u64,
    pub ignore_eos: bool,
    /// `top_logprobs` asked for; `None`: no logprobs.
    pub logprobs: Option<u8>,
    pub stop: Vec<String>,
    /// `logit_bias`: (token id, the bias's IEEE bits), as the request's
    /// (sorted, distinct; the receiver validates it like any request).
    pub logit_bias: Vec<(u32, u32)>,
    /// The prefix-cache scope the gateway derived for the request (its
    /// tenant's, a sharing group's, or one narrowed by a cache salt);
    /// `None`: the tenant's own. A prefill node shares cached pages only
    /// within it (K11).
    pub cache_scope: Option<Scope>,
    /// Order among the tenant's own requests (lower first, K13); the
    /// gateway already capped it at the tenant's `max_priority`.
    pub priority: i32,
    /// The tenant's fair-share weight, 1 to [`request::WEIGHT_MAX`]: nodes
    /// hand out pages and compute in proportion to it (K13).
    pub weight: u32,
    /// The request's W3C trace context, its parent span the gateway's
    /// request span: nodes record their spans (queue, prefill, transfer,
    /// decode) under it. Never read by sampling.
    /// Boxed: most requests' messages stay as small as before.
    pub trace: Option<Box<request::trace::TraceContext>>,
    /// The grammar the output must follow (structured outputs): prefill
    /// samples the first token under it, decode continues from its state
    /// after that token. Its source is bounded by
    /// [`request::constraint::GRAMMAR_BYTES_MAX`].
    pub grammar: Option<Box<GrammarSpec>>,
    /// The request's prediction (OpenAI's Predicted Outputs) as tokens:
    /// the decode node drafts from it. At most
    /// [`request::PREDICTION_TOKENS_MAX`]. Boxed, and `None` when empty:
    /// most requests' messages stay as small as before.
    pub prediction: Option<Box<[u32]>>,
}

impl GenSpec {
    pub fn temperature(&self) -> f32 {
        f32::from_bits(self.temperature_bits)
    }
    pub fn top_p(&self) -> f32 {
        f32::from_bits(self.top_p_bits)
    }
    pub fn min_p(&self) -> f32 {
        f32::from_bits(self.min_p_bits)
    }
    pub fn repetition_penalty(&self) -> f32 {
        f32::from_bits(self.repetition_penalty_bits)
    }
    pub fn presence_penalty(&self) -> f32 {
        f32::from_bits(self.presence_penalty_bits)
    }
    pub fn frequency_penalty(&self) -> f32 {
        f32::from_bits(self.frequency_penalty_bits)
    }
    /// Greedy with no penalties (the defaults of an OpenAI request at
    /// temperature 0).
    pub fn greedy() -> GenSpec {
        GenSpec {
            temperature_bits: 0f32.to_bits(),
            top_k: 0,
            top_p_bits: 1f32.to_bits(),
            min_p_bits: 0f32.to_bits(),
            repetition_penalty_bits: 1f32.to_bits(),
            presence_penalty_bits: 0f32.to_bits(),
            frequency_penalty_bits: 0f32.to_bits(),
            seed: 0,
            ignore_eos: false,
            logprobs: None,
            stop: Vec::new(),
            logit_bias: Vec::new(),
            cache_scope: None,
            priority: 0,
            weight: 1,
            trace: None,
            grammar: None,
            prediction: None,
        }
    }
}

/// A log-probability (IEEE bits) and the most likely alternatives.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct WireLogprobs {
    pub logprob_bits: u32,
    /// `(token id, logprob bits)`.
    pub top: Vec<(u32, u32)>,
}

/// A refusal or failure as the node that made it said it (K9): an HTTP-like
/// status, OpenAI's error code and the message. It travels unchanged from
/// that node to the client.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Refusal {
    pub status: u16,
    pub code: String,
    pub message: String,
}

/// Roles in `Hello`.
pub const ROLE_GATEWAY: u8 = 1;
pub const ROLE_PREFILL: u8 = 2;
pub const ROLE_DECODE: u8 = 3;

/// Every message of the protocol. Links: gateway↔decode, gateway↔prefill,
/// prefill→decode (prefill connects; pages flow on it, acks come back).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
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
    /// Answer to a `Hello` the node will not pair with (fingerprint or
    /// layout mismatch, wrong role); the connection closes after it.
    Refuse { message: String },
    /// Gateway → decode: reserve pages for a whole request. Carries the
    /// request so decode can check it (K8) and later continue sampling.
    Reserve {
        req: RequestId,
        tenant: TenantId,
        /// Node name of the prefill node that will fill the pages.
        prefill: String,
        tokens: Vec<u32>,
        max_tokens: u32,
        gen: GenSpec,
    },
    /// Decode → gateway: the reservation, page handles in sequence order.
    Reserved {
        req: RequestId,
        pages: Vec<WirePage>,
    },
    /// Any node → gateway, decode → gateway on prefill's behalf: the request
    /// is refused or failed; the original error travels unchanged (K9).
    Rejected { req: RequestId, error: Refusal },
    /// Gateway → prefill: compute the prompt's KV into the reserved pages.
    Prefill {
        req: RequestId,
        tenant: TenantId,
        /// Address (`host:port`) of the decode node holding the pages.
        decode: String,
        tokens: Vec<u32>,
        max_tokens: u32,
        gen: GenSpec,
        /// Decode's handles for the prompt's pages, in sequence order.
        pages: Vec<WirePage>,
    },
    /// Prefill → decode: one page of KV.
    Page {
        req: RequestId,
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
        req: RequestId,
        first_token: u32,
        /// The first token's logprobs, when the request asked for them.
        first_logprobs: Option<WireLogprobs>,
        /// The sampler's rng state after the first token, so decode
        /// continues the same random stream.
        sampler_state: u64,
        page_count: u32,
        token_count: u32,
        /// Prompt tokens whose KV prefill took from its prefix cache
        /// (reported to the client as `cached_tokens`).
        cached_tokens: u32,
        /// Digest over all page checksums in order.
        digest: u64,
    },
    /// Prefill → decode: no more pages will come for `req` (cancelled,
    /// refused or failed); `error` is the original reason.
    Abort { req: RequestId, error: Refusal },
    /// Decode → prefill: pages received so far (flow control).
    Ack { req: RequestId, pages: u32 },
    /// Decode → prefill: decode reads nothing more of this transfer (after
    /// Done or Abort): prefill may free its pages (K4).
    Closed { req: RequestId },
    /// Gateway → any, decode → prefill: cooperative cancel.
    Cancel { req: RequestId },
    /// Decode → gateway: a generated token, the `index`-th of the request
    /// (0 is the one prefill sampled), so a stream that skipped or repeated
    /// a token is an error, never a wrong answer.
    Token {
        req: RequestId,
        index: u32,
        id: u32,
        text: String,
        logprobs: Option<WireLogprobs>,
    },
    /// Decode → gateway: the end of generation.
    Finished {
        req: RequestId,
        /// 0 = stop, 1 = length, 2 + k = stop string k (`request::finish_code`).
        finish: u8,
        prompt_tokens: u32,
        /// Of the prompt, tokens prefill took from its prefix cache.
        cached_tokens: u32,
        completion_tokens: u32,
        /// `Token` messages sent before this one (a stop token counts in
        /// `completion_tokens` but is not streamed).
        streamed: u32,
        /// Of the request's prediction, tokens decode's verification kept
        /// and rejected (usage's `completion_tokens_details`).
        prediction: PredictionCounts,
        /// Text held back at the end (a stop-string prefix that never
        /// completed).
        tail_text: String,
    },
    /// Liveness.
    Heartbeat { nonce: u64 },
    /// Node → gateway, periodically: the node's load, counted over every
    /// gateway it serves (a gateway sees only its own requests). The
    /// gateway weighs it when it picks a pair.
    Load {
        /// Requests admitted but not in the engine's batch (waiting for
        /// pages, a transfer, or their turn).
        queued: u32,
        /// Requests in the engine's batch.
        running: u32,
        /// Pages no request or transfer holds (idle cached ones count).
        pages_free: u32,
        pages_total: u32,
    },
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
    #[error("invalid {what}")]
    Invalid { what: &'static str },
    #[error("{extra} trailing bytes after a {kind} message")]
    Trailing { kind: &'static str, extra: usize },
    #[error("frame check failed: the {kind} frame was corrupted in transit")]
    FrameCheck { kind: &'static str },
}

/// Bytes of the frame check after the payload.
pub const FRAME_CHECK_BYTES: usize = 8;

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
const K_REFUSE: u8 = 13;
const K_ABORT: u8 = 14;
const K_CLOSED: u8 = 15;
const K_LOAD: u8 = 16;

impl Message {
    pub fn kind_name(&self) -> &'static str {
        match self {
            Message::Hello { .. } => "Hello",
            Message::Refuse { .. } => "Refuse",
            Message::Reserve { .. } => "Reserve",
            Message::Reserved { .. } => "Reserved",
            Message::Rejected { .. } => "Rejected",
            Message::Prefill { .. } => "Prefill",
            Message::Page { .. } => "Page",
            Message::Done { .. } => "Done",
            Message::Abort { .. } => "Abort",
            Message::Ack { .. } => "Ack",
            Message::Closed { .. } => "Closed",
            Message::Cancel { .. } => "Cancel",
            Message::Token { .. } => "Token",
            Message::Finished { .. } => "Finished",
            Message::Heartbeat { .. } => "Heartbeat",
            Message::Load { .. } => "Load",
        }
    }

    /// The request a message is about, if any.
    pub fn req(&self) -> Option<RequestId> {
        match self {
            Message::Hello { .. }
            | Message::Refuse { .. }
            | Message::Heartbeat { .. }
            | Message::Load { .. } => None,
            Message::Reserve { req, .. }
            | Message::Reserved { req, .. }
            | Message::Rejected { req, .. }
            | Message::Prefill { req, .. }
            | Message::Page { req, .. }
            | Message::Done { req, .. }
            | Message::Abort { req, .. }
            | Message::Ack { req, .. }
            | Message::Closed { req }
            | Message::Cancel { req }
            | Message::Token { req, .. }
            | Message::Finished { req, .. } => Some(*req),
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
            Message::Refuse { message } => {
                w.u8(K_REFUSE);
                w.str(message);
            }
            Message::Reserve {
                req,
                tenant,
                prefill,
                tokens,
                max_tokens,
                gen,
            } => {
                w.u8(K_RESERVE);
                w.u64(req.0);
                w.u64(tenant.0);
                w.str(prefill);
                w.tokens(tokens);
                w.u32(*max_tokens);
                w.gen(gen);
            }
            Message::Reserved { req, pages } => {
                w.u8(K_RESERVED);
                w.u64(req.0);
                w.pages(pages);
            }
            Message::Rejected { req, error } => {
                w.u8(K_REJECTED);
                w.u64(req.0);
                w.error(error);
            }
            Message::Prefill {
                req,
                tenant,
                decode,
                tokens,
                max_tokens,
                gen,
                pages,
            } => {
                w.u8(K_PREFILL);
                w.u64(req.0);
                w.u64(tenant.0);
                w.str(decode);
                w.tokens(tokens);
                w.u32(*max_tokens);
                w.gen(gen);
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
                w.u64(req.0);
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
                first_logprobs,
                sampler_state,
                page_count,
                token_count,
                cached_tokens,
                digest,
            } => {
                w.u8(K_DONE);
                w.u64(req.0);
                w.u32(*first_token);
                w.logprobs(first_logprobs.as_ref());
                w.u64(*sampler_state);
                w.u32(*page_count);
                w.u32(*token_count);
                w.u32(*cached_tokens);
                w.u64(*digest);
            }
            Message::Abort { req, error } => {
                w.u8(K_ABORT);
                w.u64(req.0);
                w.error(error);
            }
            Message::Ack { req, pages } => {
                w.u8(K_ACK);
                w.u64(req.0);
                w.u32(*pages);
            }
            Message::Closed { req } => {
                w.u8(K_CLOSED);
                w.u64(req.0);
            }
            Message::Cancel { req } => {
                w.u8(K_CANCEL);
                w.u64(req.0);
            }
            Message::Token {
                req,
                index,
                id,
                text,
                logprobs,
            } => {
                w.u8(K_TOKEN);
                w.u64(req.0);
                w.u32(*index);
                w.u32(*id);
                w.str(text);
                w.logprobs(logprobs.as_ref());
            }
            Message::Finished {
                req,
                finish,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
                streamed,
                prediction,
                tail_text,
            } => {
                w.u8(K_FINISHED);
                w.u64(req.0);
                w.u8(*finish);
                w.u32(*prompt_tokens);
                w.u32(*cached_tokens);
                w.u32(*completion_tokens);
                w.u32(*streamed);
                w.u32(prediction.accepted);
                w.u32(prediction.rejected);
                w.str(tail_text);
            }
            Message::Heartbeat { nonce } => {
                w.u8(K_HEARTBEAT);
                w.u64(*nonce);
            }
            Message::Load {
                queued,
                running,
                pages_free,
                pages_total,
            } => {
                w.u8(K_LOAD);
                w.u32(*queued);
                w.u32(*running);
                w.u32(*pages_free);
                w.u32(*pages_total);
            }
        }
        let covered_end = match self {
            Message::Page { bytes, .. } => out.len() - bytes.len(),
            _ => out.len(),
        };
        let check = xxh3_64(&out[start + 4..covered_end]);
        out.extend_from_slice(&check.to_le_bytes());
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
        if len < 2 + FRAME_CHECK_BYTES {
            return Err(WireError::FrameTooShort { len });
        }
        if buf.len() < 4 + len {
            return Ok(None);
        }
        let frame = &buf[4..4 + len];
        let (body, check) = frame.split_at(len - FRAME_CHECK_BYTES);
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
            K_REFUSE => Message::Refuse {
                message: r.str("message")?,
            },
            K_RESERVE => Message::Reserve {
                req: RequestId(r.u64("req")?),
                tenant: TenantId(r.u64("tenant")?),
                prefill: r.str("prefill")?,
                tokens: r.tokens()?,
                max_tokens: r.u32("max_tokens")?,
                gen: r.gen()?,
            },
            K_RESERVED => Message::Reserved {
                req: RequestId(r.u64("req")?),
                pages: r.pages()?,
            },
            K_REJECTED => Message::Rejected {
                req: RequestId(r.u64("req")?),
                error: r.error()?,
            },
            K_PREFILL => Message::Prefill {
                req: RequestId(r.u64("req")?),
                tenant: TenantId(r.u64("tenant")?),
                decode: r.str("decode")?,
                tokens: r.tokens()?,
                max_tokens: r.u32("max_tokens")?,
                gen: r.gen()?,
                pages: r.pages()?,
            },
            K_PAGE => Message::Page {
                req: RequestId(r.u64("req")?),
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
                req: RequestId(r.u64("req")?),
                first_token: r.u32("first_token")?,
                first_logprobs: r.logprobs()?,
                sampler_state: r.u64("sampler_state")?,
                page_count: r.u32("page_count")?,
                token_count: r.u32("token_count")?,
                cached_tokens: r.u32("cached_tokens")?,
                digest: r.u64("digest")?,
            },
            K_ABORT => Message::Abort {
                req: RequestId(r.u64("req")?),
                error: r.error()?,
            },
            K_ACK => Message::Ack {
                req: RequestId(r.u64("req")?),
                pages: r.u32("pages")?,
            },
            K_CLOSED => Message::Closed {
                req: RequestId(r.u64("req")?),
            },
            K_CANCEL => Message::Cancel {
                req: RequestId(r.u64("req")?),
            },
            K_TOKEN => Message::Token {
                req: RequestId(r.u64("req")?),
                index: r.u32("index")?,
                id: r.u32("id")?,
                text: r.str("text")?,
                logprobs: r.logprobs()?,
            },
            K_FINISHED => Message::Finished {
                req: RequestId(r.u64("req")?),
                finish: r.u8("finish")?,
                prompt_tokens: r.u32("prompt_tokens")?,
                cached_tokens: r.u32("cached_tokens")?,
                completion_tokens: r.u32("completion_tokens")?,
                streamed: r.u32("streamed")?,
                prediction: PredictionCounts {
                    accepted: r.u32("accepted_prediction_tokens")?,
                    rejected: r.u32("rejected_prediction_tokens")?,
                },
                tail_text: r.str("tail_text")?,
            },
            K_HEARTBEAT => Message::Heartbeat {
                nonce: r.u64("nonce")?,
            },
            K_LOAD => Message::Load {
                queued: r.u32("queued")?,
                running: r.u32("running")?,
                pages_free: r.u32("pages_free")?,
                pages_total: r.u32("pages_total")?,
            },
            other => return Err(WireError::UnknownKind(other)),
        };
        if !r.0.is_empty() {
            return Err(WireError::Trailing {
                kind: msg.kind_name(),
                extra: r.0.len(),
            });
        }
        let covered_end = match &msg {
            Message::Page { bytes, .. } => body.len() - bytes.len(),
            _ => body.len(),
        };
        let want = u64::from_le_bytes(check.try_into().expect("8 check bytes"));
        if xxh3_64(&body[..covered_end]) != want {
            return Err(WireError::FrameCheck {
                kind: msg.kind_name(),
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
    fn tokens(&mut self, tokens: &[u32]) {
        self.u32(tokens.len() as u32);
        for t in tokens {
            self.u32(*t);
        }
    }
    fn error(&mut self, e: &Refusal) {
        self.u16(e.status);
        self.str(&e.code);
        self.str(&e.message);
    }
    fn gen(&mut self, g: &GenSpec) {
        self.u32(g.temperature_bits);
        self.u32(g.top_k);
        self.u32(g.top_p_bits);
        self.u32(g.min_p_bits);
        self.u32(g.repetition_penalty_bits);
        self.u32(g.presence_penalty_bits);
        self.u32(g.frequency_penalty_bits);
        self.u64(g.seed);
        self.u8(g.ignore_eos as u8);
        match g.logprobs {
            None => self.u8(0),
            Some(n) => {
                self.u8(1);
                self.u8(n);
            }
        }
        // More stop strings than the limit would be refused whole by the
        // receiver; senders validate first, this only keeps frames decodable.
        let n = g.stop.len().min(STOPS_MAX);
        self.u32(n as u32);
        for s in &g.stop[..n] {
            self.str(s);
        }
        let n = g.logit_bias.len().min(LOGIT_BIAS_MAX);
        self.u32(n as u32);
        for &(t, b) in &g.logit_bias[..n] {
            self.u32(t);
            self.u32(b);
        }
        match g.cache_scope {
            None => self.u8(0),
            Some(s) => {
                self.u8(1);
                self.u64(s.0);
            }
        }
        self.u32(g.priority as u32);
        self.u32(g.weight);
        match &g.trace {
            None => self.u8(0),
            Some(t) => {
                self.u8(1);
                self.raw(&t.trace_id);
                self.raw(&t.span_id);
                self.u8(t.flags);
            }
        }
        match g.grammar.as_deref() {
            None => self.u8(0),
            Some(GrammarSpec::JsonObject) => self.u8(1),
            Some(GrammarSpec::JsonSchema { schema, strict }) => {
                self.u8(2);
                self.u8(*strict as u8);
                self.source(schema);
            }
            Some(GrammarSpec::Regex(r)) => {
                self.u8(3);
                self.source(r);
            }
            Some(GrammarSpec::Choice(c)) => {
                self.u8(4);
                let n = c.len().min(GRAMMAR_CHOICES_MAX);
                self.u32(n as u32);
                for s in &c[..n] {
                    self.source(s);
                }
            }
            Some(GrammarSpec::Lark(l)) => {
                self.u8(5);
                self.source(l);
            }
        }
        let prediction = g.prediction.as_deref().unwrap_or_default();
        let n = prediction.len().min(PREDICTION_TOKENS_MAX);
        self.u32(n as u32);
        for &t in &prediction[..n] {
            self.u32(t);
        }
    }
    /// A grammar's source text (senders validated its bound; a longer
    /// one is cut, and the receiver refuses it whole).
    fn source(&mut self, s: &str) {
        let n = s.len().min(GRAMMAR_BYTES_MAX);
        self.u32(n as u32);
        self.raw(&s.as_bytes()[..n]);
    }
    fn logprobs(&mut self, l: Option<&WireLogprobs>) {
        match l {
            None => self.u8(0),
            Some(l) => {
                self.u8(1);
                self.u32(l.logprob_bits);
                let n = l.top.len().min(TOP_LOGPROBS_MAX);
                self.u32(n as u32);
                for &(id, bits) in &l.top[..n] {
                    self.u32(id);
                    self.u32(bits);
                }
            }
        }
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
    fn bool(&mut self, what: &'static str) -> Result<bool, WireError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(WireError::Invalid { what }),
        }
    }
    fn tokens(&mut self) -> Result<Vec<u32>, WireError> {
        let n = self.count("tokens", 4)?;
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.u32("token")?);
        }
        Ok(v)
    }
    fn error(&mut self) -> Result<Refusal, WireError> {
        Ok(Refusal {
            status: self.u16("status")?,
            code: self.str("error code")?,
            message: self.str("error message")?,
        })
    }
    fn gen(&mut self) -> Result<GenSpec, WireError> {
        let mut g = GenSpec {
            temperature_bits: self.u32("temperature")?,
            top_k: self.u32("top_k")?,
            top_p_bits: self.u32("top_p")?,
            min_p_bits: self.u32("min_p")?,
            repetition_penalty_bits: self.u32("repetition_penalty")?,
            presence_penalty_bits: self.u32("presence_penalty")?,
            frequency_penalty_bits: self.u32("frequency_penalty")?,
            seed: self.u64("seed")?,
            ignore_eos: self.bool("ignore_eos")?,
            logprobs: if self.bool("logprobs")? {
                Some(self.u8("top_logprobs")?)
            } else {
                None
            },
            stop: Vec::new(),
            logit_bias: Vec::new(),
            cache_scope: None,
            priority: 0,
            weight: 1,
            trace: None,
            grammar: None,
            prediction: None,
        };
        let n = self.u32("stop")? as usize;
        if n > STOPS_MAX {
            return Err(WireError::TooLong {
                what: "stop",
                len: n,
                max: STOPS_MAX,
            });
        }
        for _ in 0..n {
            g.stop.push(self.str("stop string")?);
        }
        let n = self.u32("logit_bias")? as usize;
        if n > LOGIT_BIAS_MAX {
            return Err(WireError::TooLong {
                what: "logit_bias",
                len: n,
                max: LOGIT_BIAS_MAX,
            });
        }
        g.logit_bias.reserve(n);
        for _ in 0..n {
            g.logit_bias
                .push((self.u32("logit_bias token")?, self.u32("logit_bias value")?));
        }
        if self.bool("cache_scope")? {
            g.cache_scope = Some(Scope(self.u64("cache_scope")?));
        }
        g.priority = self.u32("priority")? as i32;
        g.weight = self.u32("weight")?;
        if !(1..=request::WEIGHT_MAX).contains(&g.weight) {
            return Err(WireError::Invalid { what: "weight" });
        }
        if self.bool("trace")? {
            let mut t = request::trace::TraceContext {
                trace_id: [0; 16],
                span_id: [0; 8],
                flags: 0,
            };
            for b in t.trace_id.iter_mut() {
                *b = self.u8("trace id")?;
            }
            for b in t.span_id.iter_mut() {
                *b = self.u8("span id")?;
            }
            t.flags = self.u8("trace flags")?;
            g.trace = Some(Box::new(t));
        }
        g.grammar = match self.u8("grammar")? {
            0 => None,
            1 => Some(GrammarSpec::JsonObject),
            2 => {
                let strict = self.bool("grammar strict")?;
                Some(GrammarSpec::JsonSchema {
                    strict,
                    schema: self.source("grammar schema")?,
                })
            }
            3 => Some(GrammarSpec::Regex(self.source("grammar regex")?)),
            4 => {
                let n = self.u32("grammar choices")? as usize;
                if n > GRAMMAR_CHOICES_MAX {
                    return Err(WireError::TooLong {
                        what: "grammar choices",
                        len: n,
                        max: GRAMMAR_CHOICES_MAX,
                    });
                }
                let mut c = Vec::with_capacity(n);
                for _ in 0..n {
                    c.push(self.source("grammar choice")?);
                }
                Some(GrammarSpec::Choice(c))
            }
            5 => Some(GrammarSpec::Lark(self.source("grammar lark")?)),
            _ => {
                return Err(WireError::Invalid {
                    what: "grammar kind",
                })
            }
        }
        .map(Box::new);
        if let Some(spec) = &g.grammar {
            if spec.source_bytes() > GRAMMAR_BYTES_MAX {
                return Err(WireError::TooLong {
                    what: "grammar",
                    len: spec.source_bytes(),
                    max: GRAMMAR_BYTES_MAX,
                });
            }
        }
        let n = self.u32("prediction")? as usize;
        if n > PREDICTION_TOKENS_MAX {
            return Err(WireError::TooLong {
                what: "prediction",
                len: n,
                max: PREDICTION_TOKENS_MAX,
            });
        }
        if n > 0 {
            let mut p = Vec::with_capacity(n);
            for _ in 0..n {
                p.push(self.u32("prediction token")?);
            }
            g.prediction = Some(p.into_boxed_slice());
        }
        Ok(g)
    }
    fn source(&mut self, what: &'static str) -> Result<String, WireError> {
        let n = self.u32(what)? as usize;
        if n > GRAMMAR_BYTES_MAX {
            return Err(WireError::TooLong {
                what,
                len: n,
                max: GRAMMAR_BYTES_MAX,
            });
        }
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| WireError::Utf8 { what })
    }
    fn logprobs(&mut self) -> Result<Option<WireLogprobs>, WireError> {
        if !self.bool("logprobs")? {
            return Ok(None);
        }
        let logprob_bits = self.u32("logprob")?;
        let n = self.u32("top_logprobs")? as usize;
        if n > TOP_LOGPROBS_MAX {
            return Err(WireError::TooLong {
                what: "top_logprobs",
                len: n,
                max: TOP_LOGPROBS_MAX,
            });
        }
        let mut top = Vec::with_capacity(n);
        for _ in 0..n {
            top.push((self.u32("top id")?, self.u32("top logprob")?));
        }
        Ok(Some(WireLogprobs { logprob_bits, top }))
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
