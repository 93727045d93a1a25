//! The gateway's coordination of a request across a (prefill, decode)
//! pair: reserve on decode first, then prefill; the first refusal anywhere
//! ends the request everywhere and is the client's answer (K9).
//!
//! ```text
//! submit ─(limit ok, pair up)─▶ Reserving ─(Reserved)─▶ Prefilling ─(first Token)─▶ Streaming ─(Finished)─▶ gone
//!           │ 400/503 at once        │ Rejected / node lost / client cancel: Cancel to the other side ─▶ gone
//! ```
//!
//! A client that goes away makes the gateway send `Cancel` to both nodes;
//! it never closes a node connection for it, so no transfer is torn down
//! midway. The advertised limit is the minimum over the model's window and
//! every node's last `Hello` (re-read whenever a node reconnects).

use std::collections::BTreeMap;

use kv::{RequestId, TenantId};

use crate::common::{check_peer, pages_for, refusal, ConnId, Identity, PeerHello};
use crate::wire::{
    GenSpec, Message, PredictionCounts, Refusal, WireLogprobs, ROLE_DECODE, ROLE_GATEWAY,
    ROLE_PREFILL,
};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GatewayConfig {
    /// The gateway's node name and its model's fingerprint (layout and
    /// limit fields are not used: the gateway holds no KV).
    pub identity: Identity,
    /// The model's context window (metadata).
    pub model_window_tokens: u32,
    /// Requests in flight at once.
    pub requests_max: usize,
    /// Addresses of the prefill nodes, then of the decode nodes.
    pub prefill: Vec<String>,
    pub decode: Vec<String>,
    /// Placements of one request at most, 1 to [`PLACEMENTS_MAX`]
    /// (production: the maximum; the model checker bounds its search with
    /// fewer — every re-placement is a whole request's life again).
    pub placements_max: u8,
}

/// What reaches the client of a request.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ClientEvent {
    Token {
        id: u32,
        text: String,
        logprobs: Option<WireLogprobs>,
    },
    Finished {
        finish: u8,
        prompt_tokens: u32,
        /// Of the prompt, tokens prefill took from its prefix cache.
        cached_tokens: u32,
        completion_tokens: u32,
        /// Of the prediction: kept and rejected tokens.
        prediction: PredictionCounts,
        tail_text: String,
    },
    /// The original error of the node that refused or failed it.
    Error(Refusal),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum GatewayAction {
    Send { conn: ConnId, msg: Message },
    Close { conn: ConnId },
    Deliver { req: RequestId, event: ClientEvent },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GatewayPhase {
    Reserving,
    Prefilling,
    Streaming,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GatewayStats {
    pub requests_total: u64,
    pub refused_limit_total: u64,
    pub refused_unavailable_total: u64,
    pub rejected_by_decode_total: u64,
    pub rejected_by_prefill_total: u64,
    pub finished_total: u64,
    pub cancels_reserving_total: u64,
    pub cancels_prefilling_total: u64,
    pub cancels_streaming_total: u64,
    pub failed_node_lost_total: u64,
    pub nodes_lost_total: u64,
    pub handshakes_refused_total: u64,
    pub protocol_errors_total: u64,
    /// Requests placed on another pair because a node refused them while
    /// draining (before any token reached the client).
    pub replaced_draining_total: u64,
    /// Requests sent to their tenant's previous prefill node (where its
    /// prefix cache is) rather than to the least-loaded one.
    pub affinity_routed_total: u64,
    /// Requests placed on another pair because a node holding them was
    /// lost (closed, killed, cut off) before any token reached the client.
    pub replaced_node_lost_total: u64,
    /// `Load` reports received from nodes.
    pub load_reports_total: u64,
    /// Requests placed on a pair the gateway's own count alone would not
    /// have picked: a node's report (other gateways' requests, or too few
    /// free pages for the request) moved it.
    pub load_routed_total: u64,
}

/// What a node last reported of its load ([`Message::Load`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NodeLoad {
    pub queued: u32,
    pub running: u32,
    pub pages_free: u32,
    pub pages_total: u32,
}

/// Placements of one request at most (the first and two more): a request
/// refused by draining nodes three times fails with the last refusal.
pub const PLACEMENTS_MAX: u8 = 3;

/// One configured node as the gateway sees it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NodeView {
    pub role: u8,
    pub addr: String,
    pub conn: Option<ConnId>,
    /// The node's Hello, while connected and paired.
    pub hello: Option<PeerHello>,
    /// The last limit the node advertised (kept across reconnects until
    /// the node says otherwise).
    pub last_limit: Option<u32>,
    /// Why the last pairing was refused.
    pub refused: Option<String>,
    pub inflight: usize,
    /// The node refused a request because it is draining (SIGTERM): no new
    /// request goes to it until it reconnects (a restarted node).
    pub draining: bool,
    /// Gone from discovery (`dns:` no longer lists it): nothing new goes to
    /// it; what runs there finishes; the slot is reused once it is closed
    /// and idle.
    pub retired: bool,
    /// The node's last load report on this connection (none before the
    /// first, and none after the connection closes).
    pub load: Option<NodeLoad>,
}

impl NodeView {
    fn new(role: u8, addr: String) -> NodeView {
        NodeView {
            role,
            addr,
            conn: None,
            hello: None,
            last_limit: None,
            refused: None,
            inflight: 0,
            draining: false,
            retired: false,
            load: None,
        }
    }

    /// Whether new requests may go to it.
    fn usable(&self) -> bool {
        self.up() && !self.draining && !self.retired
    }

    /// Requests on the node: what this gateway placed there, or what the
    /// node last reported (every gateway's), whichever is more. The report
    /// is up to one interval old; the gateway's own count is current.
    fn requests_on(&self, by_reports: bool) -> usize {
        let reported = match (by_reports, self.load) {
            (true, Some(l)) => l.queued as usize + l.running as usize,
            _ => 0,
        };
        self.inflight.max(reported)
    }

    /// Whether the node reported fewer free pages than `pages` (a request
    /// placed there would wait for pages).
    fn short_of(&self, pages: u32, by_reports: bool) -> bool {
        by_reports && self.load.is_some_and(|l| l.pages_free < pages)
    }
}

/// Node slots at most (static and discovered).
pub const NODES_MAX: usize = 256;

impl NodeView {
    pub fn up(&self) -> bool {
        self.conn.is_some() && self.hello.is_some()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Req {
    /// The client's id for it (what `submit` got and `Deliver` carries).
    /// The nodes know the request by its placement's wire id, the key of
    /// `Gateway::reqs`: the first placement's is the client id, a
    /// re-placement gets another ([`wire_id`]), so nothing a node still
    /// holds of an earlier placement (a reservation waiting for its
    /// prefill's last word, a cancel tombstone) is ever taken for it.
    client: RequestId,
    tenant: TenantId,
    prefill: usize,
    decode: usize,
    tokens: Vec<u32>,
    max_tokens: u32,
    gen: GenSpec,
    phase: GatewayPhase,
    /// Tokens delivered to the client so far.
    streamed: u32,
    /// Pairs this request was placed on (1 + re-placements).
    placements: u8,
}

/// Test-only mutations (see [`crate::decode::DecodeMutations`]).
#[cfg(any(test, feature = "mutations"))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GatewayMutations {
    /// Route over-long requests to the nodes instead of refusing them (to
    /// show the nodes' own checks, K8 "again on every node").
    pub skip_limit_check: bool,
    /// Route by the gateway's own request counts only, ignoring what the
    /// nodes report (to show the reports decide placements).
    pub ignore_load_reports: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Gateway {
    #[cfg(any(test, feature = "mutations"))]
    mutations: GatewayMutations,
    cfg: GatewayConfig,
    nodes: Vec<NodeView>,
    conns: BTreeMap<ConnId, usize>,
    /// By wire id (see [`Req::client`]).
    reqs: BTreeMap<RequestId, Req>,
    /// Client id → wire id of its current placement.
    clients: BTreeMap<RequestId, RequestId>,
    rotate: usize,
    stats: GatewayStats,
    /// Tenant → the prefill node (by name) its last request went to: its
    /// prefix cache is there (K11 keeps it the tenant's). Bounded: the
    /// oldest entries go first.
    affinity: BTreeMap<TenantId, String>,
    affinity_order: std::collections::VecDeque<TenantId>,
}

/// Tenants whose prefill node the gateway remembers.
pub const AFFINITY_TENANTS_MAX: usize = 4096;
/// A tenant's request goes to its prefill node while that node carries at
/// most this many more requests than the least-loaded choice.
pub const AFFINITY_SLACK_REQUESTS: usize = 2;

/// The wire id of a request's `placement`-th placement (1-based): the
/// client id itself first, then the client id with its top bits flipped —
/// never another request's id on this gateway (a gateway's client ids
/// share their top 24 bits), and never an earlier placement's.
fn wire_id(client: RequestId, placement: u8) -> RequestId {
    debug_assert!((1..=PLACEMENTS_MAX).contains(&placement));
    RequestId(client.0 ^ (u64::from(placement - 1) << 62))
}

impl Gateway {
    pub fn new(cfg: GatewayConfig) -> Gateway {
        let nodes = cfg
            .prefill
            .iter()
            .map(|a| (ROLE_PREFILL, a))
            .chain(cfg.decode.iter().map(|a| (ROLE_DECODE, a)))
            .map(|(role, addr)| NodeView::new(role, addr.clone()))
            .collect();
        Gateway {
            #[cfg(any(test, feature = "mutations"))]
            mutations: GatewayMutations::default(),
            cfg,
            nodes,
            conns: BTreeMap::new(),
            reqs: BTreeMap::new(),
            clients: BTreeMap::new(),
            rotate: 0,
            stats: GatewayStats::default(),
            affinity: BTreeMap::new(),
            affinity_order: std::collections::VecDeque::new(),
        }
    }

    #[cfg(any(test, feature = "mutations"))]
    pub fn set_mutations(&mut self, m: GatewayMutations) {
        self.mutations = m;
    }

    pub fn nodes(&self) -> &[NodeView] {
        &self.nodes
    }

    pub fn stats(&self) -> GatewayStats {
        self.stats
    }

    /// Prefill and decode nodes that are both up but can never be paired:
    /// their KV layouts (page size, storage type, shape) differ, so decode
    /// could not read prefill's pages. One line per such pair, for the log;
    /// [`Self::pick_pair`] skips them.
    pub fn layout_mismatches(&self) -> Vec<String> {
        let up = |role: u8| {
            self.nodes
                .iter()
                .filter(move |n| n.role == role && n.up())
                .filter_map(|n| n.hello.as_ref())
        };
        let mut out = Vec::new();
        for p in up(ROLE_PREFILL) {
            for d in up(ROLE_DECODE) {
                if p.layout != d.layout {
                    out.push(format!(
                        "pairing refused: prefill node `{}` has KV layout {:?}, decode node `{}` has {:?} (pass both the same --page-size and --kv-dtype)",
                        p.node, p.layout, d.node, d.layout
                    ));
                }
            }
        }
        out
    }

    pub fn requests(&self) -> usize {
        self.reqs.len()
    }

    /// The client id of the request a node knows as `wire`.
    pub fn client_of(&self, wire: RequestId) -> Option<RequestId> {
        self.reqs.get(&wire).map(|r| r.client)
    }

    /// The phase of the request the client knows as `req`.
    pub fn phase_of(&self, req: RequestId) -> Option<GatewayPhase> {
        let wire = self.clients.get(&req)?;
        self.reqs.get(wire).map(|r| r.phase)
    }

    /// The advertised limit (K8): the model's window and every node's last
    /// advertised limit, whichever is smallest.
    pub fn max_request_tokens(&self) -> u32 {
        self.nodes
            .iter()
            .filter(|n| !n.retired)
            .filter_map(|n| n.last_limit)
            .fold(self.cfg.model_window_tokens, u32::min)
    }

    /// Whether at least one (prefill, decode) pair is up.
    pub fn ready(&self) -> bool {
        self.pick_pair().is_some()
    }

    // ------------------------------------------------------------ links

    /// The driver connected to node `node` (an index into [`Self::nodes`]).
    /// A node found by discovery: its slot (a retired one that is closed
    /// and idle is reused), or `None` when [`NODES_MAX`] slots are in use.
    /// The driver then dials it and reports [`Self::connected`].
    pub fn add_node(&mut self, role: u8, addr: &str) -> Option<usize> {
        // Known (also one retired but back in discovery): the same slot.
        if let Some(i) = self
            .nodes
            .iter()
            .position(|n| n.role == role && n.addr == addr)
        {
            self.nodes[i].retired = false;
            return Some(i);
        }
        let free = self
            .nodes
            .iter()
            .position(|n| n.retired && n.conn.is_none() && n.inflight == 0);
        let view = NodeView::new(role, addr.to_string());
        match free {
            Some(i) => {
                self.nodes[i] = view;
                Some(i)
            }
            None if self.nodes.len() < NODES_MAX => {
                self.nodes.push(view);
                Some(self.nodes.len() - 1)
            }
            None => None,
        }
    }

    /// A node gone from discovery: no new request goes to it; requests
    /// running there finish (or fail when its connection ends).
    pub fn retire_node(&mut self, node: usize) {
        if let Some(n) = self.nodes.get_mut(node) {
            n.retired = true;
        }
    }

    pub fn connected(&mut self, node: usize, conn: ConnId, out: &mut Vec<GatewayAction>) {
        let n = &mut self.nodes[node];
        n.conn = Some(conn);
        n.hello = None;
        self.conns.insert(conn, node);
        out.push(GatewayAction::Send {
            conn,
            msg: self.cfg.identity.hello(ROLE_GATEWAY),
        });
    }

    pub fn closed(&mut self, conn: ConnId, out: &mut Vec<GatewayAction>) {
        let Some(node) = self.conns.remove(&conn) else {
            return;
        };
        let was_up = self.nodes[node].up();
        let n = &mut self.nodes[node];
        n.conn = None;
        n.hello = None;
        n.load = None;
        if was_up {
            self.stats.nodes_lost_total += 1;
        }
        let role = n.role;
        let addr = n.addr.clone();
        let reqs: Vec<RequestId> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.decode == node || r.prefill == node)
            .map(|(&k, _)| k)
            .collect();
        for req in reqs {
            let r = &self.reqs[&req];
            if role == ROLE_PREFILL && r.phase == GatewayPhase::Streaming {
                // The KV is on decode already: prefill is not needed any more.
                continue;
            }
            let what = if role == ROLE_DECODE {
                "decode"
            } else {
                "prefill"
            };
            let e = refusal::upstream(
                &format!("{what}_lost"),
                format!("the {what} node at {addr} was lost while serving the request"),
            );
            // Nothing reached the client yet: another pair can serve it
            // from the start (the old placement's id dies with it, so
            // nothing a surviving node still holds of it is taken for the
            // new one). A node that exits after a drain, or dies, costs
            // its pre-token requests nothing but time.
            if r.phase != GatewayPhase::Streaming
                && r.placements < self.cfg.placements_max.clamp(1, PLACEMENTS_MAX)
            {
                self.stats.replaced_node_lost_total += 1;
                self.replace(req, e, out);
                continue;
            }
            self.stats.failed_node_lost_total += 1;
            self.end(req, Some(e), out);
        }
    }

    pub fn message(&mut self, conn: ConnId, msg: Message, out: &mut Vec<GatewayAction>) {
        let Some(&node) = self.conns.get(&conn) else {
            return;
        };
        let up = self.nodes[node].up();
        match msg {
            Message::Heartbeat { .. } => {}
            Message::Load {
                queued,
                running,
                pages_free,
                pages_total,
            } if up => {
                self.stats.load_reports_total += 1;
                self.nodes[node].load = Some(NodeLoad {
                    queued,
                    running,
                    pages_free: pages_free.min(pages_total),
                    pages_total,
                });
            }
            msg @ Message::Hello { .. } if !up => {
                let peer = PeerHello::from_message(&msg).expect("a Hello");
                let role = self.nodes[node].role;
                match check_peer(&self.cfg.identity, &peer, &[role], false) {
                    Ok(()) => {
                        let n = &mut self.nodes[node];
                        n.last_limit = Some(peer.max_request_tokens);
                        n.hello = Some(peer);
                        n.refused = None;
                        n.draining = false;
                    }
                    Err(why) => {
                        self.stats.handshakes_refused_total += 1;
                        self.nodes[node].refused = Some(why.clone());
                        out.push(GatewayAction::Send {
                            conn,
                            msg: Message::Refuse { message: why },
                        });
                        out.push(GatewayAction::Close { conn });
                    }
                }
            }
            Message::Refuse { message } => {
                self.stats.handshakes_refused_total += 1;
                self.nodes[node].refused = Some(message);
                out.push(GatewayAction::Close { conn });
            }
            Message::Reserved { req, pages } if up => {
                let Some(r) = self.reqs.get(&req) else {
                    // We gave up on it (client cancel): undo the reservation.
                    out.push(GatewayAction::Send {
                        conn,
                        msg: Message::Cancel { req },
                    });
                    return;
                };
                if r.decode != node || r.phase != GatewayPhase::Reserving {
                    self.stats.protocol_errors_total += 1;
                    return;
                }
                let ps = self.nodes[node]
                    .hello
                    .as_ref()
                    .map(|h| h.layout.page_size)
                    .unwrap_or(1);
                let prompt_pages = pages_for(r.tokens.len(), ps);
                if pages.len() < prompt_pages {
                    self.stats.protocol_errors_total += 1;
                    let e = refusal::upstream(
                        "transfer_protocol",
                        format!(
                            "decode reserved {} pages for a prompt that needs {prompt_pages}",
                            pages.len()
                        ),
                    );
                    return self.end(req, Some(e), out);
                }
                let p = r.prefill;
                let Some(pconn) = self.nodes[p].conn.filter(|_| self.nodes[p].up()) else {
                    let e = refusal::upstream(
                        "prefill_lost",
                        format!(
                            "the prefill node at {} is not connected",
                            self.nodes[p].addr
                        ),
                    );
                    return self.end(req, Some(e), out);
                };
                let msg = Message::Prefill {
                    req,
                    tenant: r.tenant,
                    decode: self.nodes[node].addr.clone(),
                    tokens: r.tokens.clone(),
                    max_tokens: r.max_tokens,
                    gen: r.gen.clone(),
                    pages: pages[..prompt_pages].to_vec(),
                };
                self.reqs.get_mut(&req).expect("known").phase = GatewayPhase::Prefilling;
                out.push(GatewayAction::Send { conn: pconn, msg });
            }
            Message::Rejected { req, error } if up => {
                let Some(r) = self.reqs.get(&req) else {
                    return;
                };
                if r.decode != node && r.prefill != node {
                    self.stats.protocol_errors_total += 1;
                    return;
                }
                if self.nodes[node].role == ROLE_DECODE {
                    self.stats.rejected_by_decode_total += 1;
                } else {
                    self.stats.rejected_by_prefill_total += 1;
                }
                let pre_token = {
                    let r = &self.reqs[&req];
                    r.phase != GatewayPhase::Streaming
                        && r.placements < self.cfg.placements_max.clamp(1, PLACEMENTS_MAX)
                };
                if error.code == refusal::DRAINING_CODE {
                    // Route around it from now on; a request nobody has
                    // answered yet goes to another pair.
                    self.nodes[node].draining = true;
                    if pre_token {
                        self.stats.replaced_draining_total += 1;
                        return self.replace(req, error, out);
                    }
                }
                // A node lost its peer for this request (prefill its decode
                // link, decode its prefill link): as a node loss the gateway
                // sees itself, another pair can serve it from the start.
                if pre_token && (error.code == "decode_lost" || error.code == "prefill_lost") {
                    self.stats.replaced_node_lost_total += 1;
                    return self.replace(req, error, out);
                }
                self.end(req, Some(error), out);
            }
            Message::Token {
                req,
                index,
                id,
                text,
                logprobs,
            } if up => {
                let Some(r) = self.reqs.get_mut(&req) else {
                    return;
                };
                if r.decode != node || r.phase == GatewayPhase::Reserving {
                    self.stats.protocol_errors_total += 1;
                    return;
                }
                if index != r.streamed {
                    // TCP never reorders; a stream that skipped or repeated
                    // a token ends the request rather than answer wrongly.
                    self.stats.protocol_errors_total += 1;
                    let e = refusal::upstream(
                        "transfer_protocol",
                        format!(
                            "decode sent token {index} of request {req}, expected token {}",
                            r.streamed
                        ),
                    );
                    return self.end(req, Some(e), out);
                }
                r.streamed += 1;
                r.phase = GatewayPhase::Streaming;
                out.push(GatewayAction::Deliver {
                    req: r.client,
                    event: ClientEvent::Token { id, text, logprobs },
                });
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
            } if up => {
                let Some(r) = self.reqs.get(&req) else {
                    return;
                };
                if r.decode != node || r.phase == GatewayPhase::Reserving {
                    self.stats.protocol_errors_total += 1;
                    return;
                }
                if streamed != r.streamed {
                    // A token lost (or repeated) before the end.
                    self.stats.protocol_errors_total += 1;
                    let e = refusal::upstream(
                        "transfer_protocol",
                        format!(
                            "decode finished request {req} after streaming {streamed} tokens; \
                             {} arrived",
                            r.streamed
                        ),
                    );
                    return self.end(req, Some(e), out);
                }
                self.stats.finished_total += 1;
                out.push(GatewayAction::Deliver {
                    req: r.client,
                    event: ClientEvent::Finished {
                        finish,
                        prompt_tokens,
                        cached_tokens,
                        completion_tokens,
                        prediction,
                        tail_text,
                    },
                });
                self.remove(req);
            }
            _ => {
                self.stats.protocol_errors_total += 1;
                out.push(GatewayAction::Close { conn });
            }
        }
    }

    // --------------------------------------------------------- requests

    /// The least-loaded (prefill, decode) pair that is up, not draining,
    /// with equal KV layouts; ties rotate.
    fn pick_pair(&self) -> Option<(usize, usize)> {
        self.pick_pair_for(None, 0, true).map(|(p, d, _)| (p, d))
    }

    /// The pair a request of `tenant` needing `pages` decode pages goes to,
    /// ranked by:
    /// 1. the decode node has the pages free (by its last report; a node
    ///    short of them would make the request wait);
    /// 2. fewest requests on the two nodes ([`NodeView::requests_on`]: the
    ///    gateway's own count or the nodes' reports, whichever is more);
    /// 3. rotation among equals.
    ///
    /// A pair on `tenant`'s previous prefill node (its prefix cache) wins
    /// while it is not worse on 1 and carries at most
    /// [`AFFINITY_SLACK_REQUESTS`] more requests. The flag says the
    /// affinity decided. `by_reports: false` ranks by the gateway's own
    /// counts only (to tell whether the reports moved a placement).
    fn pick_pair_for(
        &self,
        tenant: Option<TenantId>,
        pages: u32,
        by_reports: bool,
    ) -> Option<(usize, usize, bool)> {
        let home = tenant.and_then(|t| self.affinity.get(&t));
        // (prefill, decode, short of pages, requests)
        let mut best: Option<(usize, usize, bool, usize)> = None;
        let mut best_home: Option<(usize, usize, bool, usize)> = None;
        let better = |a: (bool, usize), b: Option<(usize, usize, bool, usize)>| {
            b.is_none_or(|(_, _, short, load)| a < (short, load))
        };
        let n = self.nodes.len().max(1);
        for i in 0..self.nodes.len() {
            let d = (i + self.rotate) % n;
            let dn = &self.nodes[d];
            if dn.role != ROLE_DECODE || !dn.usable() {
                continue;
            }
            let short = dn.short_of(pages, by_reports);
            for j in 0..self.nodes.len() {
                let p = (j + self.rotate) % n;
                let pn = &self.nodes[p];
                if pn.role != ROLE_PREFILL || !pn.usable() {
                    continue;
                }
                let same_layout =
                    pn.hello.as_ref().map(|h| h.layout) == dn.hello.as_ref().map(|h| h.layout);
                if !same_layout {
                    continue;
                }
                let load = pn.requests_on(by_reports) + dn.requests_on(by_reports);
                if better((short, load), best) {
                    best = Some((p, d, short, load));
                }
                let at_home = home.is_some_and(|h| pn.hello.as_ref().is_some_and(|x| &x.node == h));
                if at_home && better((short, load), best_home) {
                    best_home = Some((p, d, short, load));
                }
            }
        }
        let (p, d, short, load) = best?;
        match best_home {
            Some((hp, hd, hshort, hl))
                if hshort <= short && hl <= load + AFFINITY_SLACK_REQUESTS =>
            {
                Some((hp, hd, hp != p))
            }
            _ => Some((p, d, false)),
        }
    }

    /// Decode pages a request of `tokens` (prompt and generation) needs on
    /// a node of `layout`.
    fn pages_for(&self, tokens: usize) -> u32 {
        // Page sizes are equal on paired nodes; take the first decode
        // node's that is up (a mismatch is never paired anyway).
        let page = self
            .nodes
            .iter()
            .filter(|n| n.role == ROLE_DECODE)
            .find_map(|n| n.hello.as_ref().map(|h| h.layout.page_size))
            .unwrap_or(1)
            .max(1) as usize;
        u32::try_from(tokens.div_ceil(page)).unwrap_or(u32::MAX)
    }

    /// Remembers `tenant`'s prefill node (bounded; the oldest go first).
    fn remember(&mut self, tenant: TenantId, prefill: &str) {
        if self.affinity.insert(tenant, prefill.to_string()).is_none() {
            self.affinity_order.push_back(tenant);
            while self.affinity_order.len() > AFFINITY_TENANTS_MAX {
                if let Some(old) = self.affinity_order.pop_front() {
                    self.affinity.remove(&old);
                }
            }
        }
        debug_assert_eq!(self.affinity.len(), self.affinity_order.len());
    }

    /// A new request. Refused at once (K8: over the advertised limit; no
    /// pair up; too many in flight) or started: later events arrive as
    /// [`GatewayAction::Deliver`].
    pub fn submit(
        &mut self,
        req: RequestId,
        tenant: TenantId,
        tokens: Vec<u32>,
        max_tokens: u32,
        gen: GenSpec,
        out: &mut Vec<GatewayAction>,
    ) -> Result<(), Refusal> {
        self.stats.requests_total += 1;
        let limit = self.max_request_tokens();
        let total = tokens.len().saturating_add(max_tokens as usize);
        #[cfg(any(test, feature = "mutations"))]
        let skip = self.mutations.skip_limit_check;
        #[cfg(not(any(test, feature = "mutations")))]
        let skip = false;
        if total > limit as usize && !skip {
            self.stats.refused_limit_total += 1;
            return Err(refusal::context_length_exceeded(
                tokens.len(),
                max_tokens as usize,
                limit as usize,
            ));
        }
        if self.clients.contains_key(&req) {
            return Err(refusal::internal(format!("request id {req} reused")));
        }
        if self.reqs.len() >= self.cfg.requests_max {
            self.stats.refused_unavailable_total += 1;
            return Err(refusal::busy(format!(
                "{} requests are in flight (the gateway's limit); retry later",
                self.reqs.len()
            )));
        }
        self.place(req, tenant, tokens, max_tokens, gen, 1, out)
    }

    /// Sends `Reserve` for a request to the least-loaded pair up and not
    /// draining, and files it; or the refusal when there is none.
    #[allow(clippy::too_many_arguments)]
    fn place(
        &mut self,
        req: RequestId,
        tenant: TenantId,
        tokens: Vec<u32>,
        max_tokens: u32,
        gen: GenSpec,
        placements: u8,
        out: &mut Vec<GatewayAction>,
    ) -> Result<(), Refusal> {
        let pages = self.pages_for(tokens.len().saturating_add(max_tokens as usize));
        #[cfg(any(test, feature = "mutations"))]
        let by_reports = !self.mutations.ignore_load_reports;
        #[cfg(not(any(test, feature = "mutations")))]
        let by_reports = true;
        let Some((p, d, by_affinity)) = self.pick_pair_for(Some(tenant), pages, by_reports) else {
            self.stats.refused_unavailable_total += 1;
            return Err(refusal::unavailable(
                "no prefill/decode pair is available (nodes down, draining or refused pairing)",
            ));
        };
        // Before the rotation moves: the same ranking without the reports.
        if by_reports
            && self
                .pick_pair_for(Some(tenant), pages, false)
                .is_some_and(|(p0, d0, _)| (p0, d0) != (p, d))
        {
            self.stats.load_routed_total += 1;
        }
        self.rotate = self.rotate.wrapping_add(1);
        let prefill = self.nodes[p]
            .hello
            .as_ref()
            .map(|h| h.node.clone())
            .unwrap_or_default();
        if by_affinity {
            self.stats.affinity_routed_total += 1;
        }

        self.remember(tenant, &prefill);
        let dconn = self.nodes[d].conn.expect("up implies connected");
        let client = req;
        let req = wire_id(client, placements);
        if self.reqs.contains_key(&req) {
            return Err(refusal::internal(format!("wire id {req} in use")));
        }
        out.push(GatewayAction::Send {
            conn: dconn,
            msg: Message::Reserve {
                req,
                tenant,
                prefill,
                tokens: tokens.clone(),
                max_tokens,
                gen: gen.clone(),
            },
        });
        self.nodes[p].inflight += 1;
        self.nodes[d].inflight += 1;
        self.clients.insert(client, req);
        self.reqs.insert(
            req,
            Req {
                client,
                tenant,
                prefill: p,
                decode: d,
                tokens,
                max_tokens,
                gen,
                phase: GatewayPhase::Reserving,
                streamed: 0,
                placements,
            },
        );
        Ok(())
    }

    /// A node refused `req` because it is draining, or was lost, before
    /// any token reached the client: release what the old pair holds
    /// (Cancel, as [`Self::end`]) and place it again under a new wire id;
    /// `error` is the client's answer if no other pair is up.
    fn replace(&mut self, req: RequestId, error: Refusal, out: &mut Vec<GatewayAction>) {
        let Some(r) = self.reqs.get(&req) else {
            return;
        };
        let (client, tenant, tokens, max_tokens, gen, placements) = (
            r.client,
            r.tenant,
            r.tokens.clone(),
            r.max_tokens,
            r.gen.clone(),
            r.placements,
        );
        self.end(req, None, out);
        if let Err(e) = self.place(client, tenant, tokens, max_tokens, gen, placements + 1, out) {
            // The original reason, and why it could not go elsewhere.
            let e = Refusal {
                message: format!("{} ({})", error.message, e.message),
                ..error
            };
            out.push(GatewayAction::Deliver {
                req: client,
                event: ClientEvent::Error(e),
            });
        }
    }

    /// The client went away (or asked to stop): cooperative cancel on both
    /// nodes. Nothing more is delivered for the request.
    pub fn cancel(&mut self, req: RequestId, out: &mut Vec<GatewayAction>) {
        let Some(&req) = self.clients.get(&req) else {
            return;
        };
        let Some(r) = self.reqs.get(&req) else {
            return;
        };
        match r.phase {
            GatewayPhase::Reserving => self.stats.cancels_reserving_total += 1,
            GatewayPhase::Prefilling => self.stats.cancels_prefilling_total += 1,
            GatewayPhase::Streaming => self.stats.cancels_streaming_total += 1,
        }
        self.end(req, None, out);
    }

    /// Ends a request: `Cancel` to every node that may hold state for it,
    /// the error (if any) to the client.
    fn end(&mut self, req: RequestId, error: Option<Refusal>, out: &mut Vec<GatewayAction>) {
        let Some(r) = self.reqs.get(&req) else {
            return;
        };
        let (p, d, phase) = (r.prefill, r.decode, r.phase);
        if let Some(conn) = self.nodes[d].conn {
            out.push(GatewayAction::Send {
                conn,
                msg: Message::Cancel { req },
            });
        }
        if phase != GatewayPhase::Reserving {
            if let Some(conn) = self.nodes[p].conn {
                out.push(GatewayAction::Send {
                    conn,
                    msg: Message::Cancel { req },
                });
            }
        }
        if let Some(e) = error {
            out.push(GatewayAction::Deliver {
                req: self.reqs[&req].client,
                event: ClientEvent::Error(e),
            });
        }
        self.remove(req);
    }

    fn remove(&mut self, req: RequestId) {
        if let Some(r) = self.reqs.remove(&req) {
            let gone = self.clients.remove(&r.client);
            debug_assert_eq!(gone, Some(req));
            self.nodes[r.prefill].inflight -= 1;
            self.nodes[r.decode].inflight -= 1;
        }
    }
}
