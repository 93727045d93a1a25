//! What the three state machines share: connection ids, node identity and
//! the pairing check, refusals, the transfer digest.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use kv::{Owner, RequestId, TenantId};

use crate::wire::{GenSpec, KvLayout, Message, Refusal, ROLE_DECODE, ROLE_GATEWAY, ROLE_PREFILL};

/// A connection, numbered by the transport (unique over the node's life).
pub type ConnId = u64;

/// What a node says about itself in `Hello`, and checks of its peer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    /// Node name (unique in a deployment; decode and prefill nodes are
    /// named in requests).
    pub node: String,
    /// Hash of the model: weights, quantisation, dims, rope.
    pub fingerprint: [u8; 32],
    pub layout: KvLayout,
    /// The largest `prompt + max_tokens` this node accepts (K8).
    pub max_request_tokens: u32,
}

impl Identity {
    pub fn hello(&self, role: u8) -> Message {
        Message::Hello {
            role,
            node: self.node.clone(),
            model_fingerprint: self.fingerprint,
            layout: self.layout,
            max_request_tokens: self.max_request_tokens,
        }
    }
}

/// The peer's side of a handshake.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PeerHello {
    pub role: u8,
    pub node: String,
    pub fingerprint: [u8; 32],
    pub layout: KvLayout,
    pub max_request_tokens: u32,
}

impl PeerHello {
    pub fn from_message(msg: &Message) -> Option<PeerHello> {
        match msg {
            Message::Hello {
                role,
                node,
                model_fingerprint,
                layout,
                max_request_tokens,
            } => Some(PeerHello {
                role: *role,
                node: node.clone(),
                fingerprint: *model_fingerprint,
                layout: *layout,
                max_request_tokens: *max_request_tokens,
            }),
            _ => None,
        }
    }
}

pub fn role_name(role: u8) -> &'static str {
    match role {
        ROLE_GATEWAY => "gateway",
        ROLE_PREFILL => "prefill",
        ROLE_DECODE => "decode",
        _ => "unknown",
    }
}

/// Short hex of a fingerprint, for messages.
pub fn short_hex(fp: &[u8; 32]) -> String {
    fp[..6].iter().map(|b| format!("{b:02x}")).collect()
}

/// The pairing check: the peer must have the expected role and the same
/// model; with `layout` the same KV layout too (prefill and decode copy
/// pages byte for byte, so any difference would be garbage KV).
pub fn check_peer(
    me: &Identity,
    peer: &PeerHello,
    expect_roles: &[u8],
    layout: bool,
) -> Result<(), String> {
    if !expect_roles.contains(&peer.role) {
        return Err(format!(
            "pairing refused: node `{}` is a {} node, expected {}",
            peer.node,
            role_name(peer.role),
            expect_roles
                .iter()
                .map(|&r| role_name(r))
                .collect::<Vec<_>>()
                .join(" or ")
        ));
    }
    if peer.fingerprint != me.fingerprint {
        return Err(format!(
            "pairing refused: {} node `{}` serves another model (fingerprint {}…, this node `{}` has {}…)",
            role_name(peer.role),
            peer.node,
            short_hex(&peer.fingerprint),
            me.node,
            short_hex(&me.fingerprint)
        ));
    }
    if layout && peer.layout != me.layout {
        return Err(format!(
            "pairing refused: {} node `{}` has KV layout {:?}, this node `{}` has {:?}",
            role_name(peer.role),
            peer.node,
            peer.layout,
            me.node,
            me.layout
        ));
    }
    Ok(())
}

/// A request's owner on every node: request, tenant, and the cache scope
/// the gateway derived (the tenant's own when none: `kv::Owner::request`,
/// as the unified engine builds it). Prefill and decode must agree on it:
/// the canary binds it (K7).
///
/// ```
/// use transfer::{request_owner, wire::GenSpec, RequestId, TenantId};
/// let (req, tenant) = (RequestId(7), TenantId(3));
/// assert_eq!(request_owner(req, tenant, &GenSpec::greedy()).request, req);
/// ```
///
/// The same call with the two swapped no longer compiles:
///
/// ```compile_fail
/// use transfer::{request_owner, wire::GenSpec, RequestId, TenantId};
/// let (req, tenant) = (RequestId(7), TenantId(3));
/// let _ = request_owner(tenant, req, &GenSpec::greedy());
/// ```
pub fn request_owner(req: RequestId, tenant: TenantId, gen: &GenSpec) -> Owner {
    Owner::request(req, tenant, gen.cache_scope)
}

/// Pages a sequence of `tokens` needs with `page_size` slots a page.
pub fn pages_for(tokens: usize, page_size: u32) -> usize {
    tokens.div_ceil(page_size.max(1) as usize)
}

/// Slots of the page at `position` in a prompt of `tokens`.
pub fn slots_at(tokens: usize, page_size: u32, position: usize) -> usize {
    let ps = page_size as usize;
    tokens.saturating_sub(position * ps).min(ps)
}

/// Digest over a transfer's page checksums in order (sent in `Done`).
pub fn transfer_digest(checksums: &[u64]) -> u64 {
    checksums.iter().fold(0x6b76_2d64_6967_6573, |acc, c| {
        xxh3_64_with_seed(&c.to_le_bytes(), acc)
    })
}

/// The refusals every node makes, worded as OpenAI's API words them.
pub mod refusal {
    use crate::wire::Refusal;

    pub fn context_length_exceeded(prompt: usize, max_tokens: usize, limit: usize) -> Refusal {
        Refusal {
            status: 400,
            code: "context_length_exceeded".into(),
            message: format!(
                "This model's maximum context length is {limit} tokens. However, you requested {} \
                 tokens ({prompt} in the messages, {max_tokens} in the completion). Please reduce \
                 the length of the messages or completion.",
                prompt.saturating_add(max_tokens)
            ),
        }
    }

    pub fn bad_request(code: &str, message: impl Into<String>) -> Refusal {
        Refusal {
            status: 400,
            code: code.into(),
            message: message.into(),
        }
    }

    pub fn busy(message: impl Into<String>) -> Refusal {
        Refusal {
            status: 429,
            code: "queue_full".into(),
            message: message.into(),
        }
    }

    pub fn cancelled() -> Refusal {
        Refusal {
            status: 499,
            code: "cancelled".into(),
            message: "the request was cancelled".into(),
        }
    }

    /// A node or link failed under the request (HTTP 502: the gateway's
    /// upstream failed).
    pub fn upstream(code: &str, message: impl Into<String>) -> Refusal {
        Refusal {
            status: 502,
            code: code.into(),
            message: message.into(),
        }
    }

    /// The code of [`draining`]: the gateway places such a request again.
    pub const DRAINING_CODE: &str = "draining";

    /// The node is draining (SIGTERM): it finishes what it holds and takes
    /// nothing new; the gateway places the request on another pair.
    pub fn draining(node: &str) -> Refusal {
        Refusal {
            status: 503,
            code: DRAINING_CODE.into(),
            message: format!("node `{node}` is draining (shutting down)"),
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Refusal {
        Refusal {
            status: 503,
            code: "unavailable".into(),
            message: message.into(),
        }
    }

    pub fn internal(message: impl Into<String>) -> Refusal {
        Refusal {
            status: 500,
            code: "internal_error".into(),
            message: message.into(),
        }
    }
}

/// Validation every node repeats before it allocates anything (K8).
pub fn check_request(
    tokens: &[u32],
    max_tokens: u32,
    limit: u32,
    vocab: u32,
) -> Result<(), Refusal> {
    if tokens.is_empty() {
        return Err(refusal::bad_request("empty_prompt", "the prompt is empty"));
    }
    if max_tokens == 0 {
        return Err(refusal::bad_request(
            "invalid_parameter",
            "invalid parameter `max_tokens`: must be positive",
        ));
    }
    let total = tokens.len().saturating_add(max_tokens as usize);
    if total > limit as usize {
        return Err(refusal::context_length_exceeded(
            tokens.len(),
            max_tokens as usize,
            limit as usize,
        ));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t >= vocab) {
        return Err(refusal::bad_request(
            "invalid_parameter",
            format!(
                "invalid parameter `prompt`: token id {bad} is outside the vocabulary of {vocab}"
            ),
        ));
    }
    Ok(())
}

/// A queued request as fair admission sees it (K13).
pub(crate) fn waiting_of(owner: &Owner, gen: &GenSpec) -> crate::fair::Waiting {
    crate::fair::Waiting {
        tenant: owner.tenant,
        weight: gen.weight,
        priority: gen.priority,
    }
}
