//! The world both test drivers run: the production [`Gateway`],
//! [`PrefillNode`] and [`DecodeNode`] state machines with real
//! [`kv::Pool`]s, connections carrying encoded frames, the engines of the
//! stand-in model, clients — and every invariant, checked after each event.
//!
//! A `World` makes no choices. Each public method is one atomic event (a
//! frame delivered, a connection killed, a node crashed, an engine step, a
//! client's cancel); a driver picks which. [`crate::sim`] picks with a
//! seeded random number generator (deterministic simulation, thousands of
//! seeds); the `verify` crate's model checker tries *every* choice within
//! bounds (the world is `Clone + Eq + Hash`, so it is a checker state).
//!
//! The stand-in model's next token is a hash of every KV row the sequence
//! reads *through the pool*: if decode ever read a page it did not receive
//! from this request's prefill (another tenant's, a stale one, an unwritten
//! one), its tokens would differ from the reference, computed from the
//! tokens alone. So the world checks content, not just states.
//!
//! ```
//! use testkit::world::{ClientSpec, Node, World, WorldParams};
//! let mut w = World::new(WorldParams::default(), vec![ClientSpec::new(kv::TenantId(1), vec![5, 6, 7], 2)]);
//! // Take the first possible event until nothing is left to do.
//! for _ in 0..200 {
//!     if !w.step_first() {
//!         break;
//!     }
//!     w.check_step().expect("invariants hold after every event");
//! }
//! assert!(w.quiescent());
//! let outcomes = w.check_end().expect("content and pools check out");
//! assert_eq!(outcomes[0].end, Some(Ok(2)));
//! # let _ = Node::Decode;
//! ```

mod checks;
mod stand_ins;

pub use stand_ins::*;

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use kv::{LayerView, Owner, PageRef, Pool, PoolOptions, PrefixKeys, RequestId, Scope, TenantId};

use transfer::decode::{DecodeConfig, DecodeNode, DecodeStart};
use transfer::gateway::{ClientEvent, Gateway, GatewayAction, GatewayConfig};
use transfer::node::{
    self, DecodeEngine, DecodeReport, NetCommand, NetEvent, NodeEngine, PrefillEngine,
    PrefillReport,
};
use transfer::prefill::{ComputeJob, PrefillConfig, PrefillNode};
use transfer::wire::{GenSpec, Message, Refusal};
use transfer::ConnId;

// ----------------------------------------------------------- parameters

/// Sizes and limits of the nodes; every count is a bound.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WorldParams {
    pub page_size: u32,
    pub prefill_pages: u64,
    pub decode_pages: u64,
    /// Limits the nodes advertise (K8); the gateway takes the minimum.
    pub prefill_limit: u32,
    pub decode_limit: u32,
    pub window_pages: u32,
    /// Prefill runs its prefix cache (production's default).
    pub prefix_cache: bool,
    /// Placements of one request at most (`GatewayConfig::placements_max`):
    /// 2 lets a request be placed again once (after a drain refusal, a node
    /// loss or a peer-lost report) — each is a whole request's life again,
    /// so the model checker's search grows with it.
    pub placements_max: u8,
}

impl Default for WorldParams {
    fn default() -> Self {
        WorldParams {
            page_size: 4,
            prefill_pages: 12,
            decode_pages: 16,
            prefill_limit: 32,
            decode_limit: 32,
            window_pages: 2,
            prefix_cache: true,
            placements_max: 2,
        }
    }
}

/// A client's request: `(tenant, prompt, max_tokens)`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ClientSpec {
    pub tenant: TenantId,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
}

impl ClientSpec {
    pub fn new(tenant: TenantId, prompt: Vec<u32>, max_tokens: u32) -> ClientSpec {
        ClientSpec {
            tenant,
            prompt,
            max_tokens,
        }
    }
}

/// The nodes of the world.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Node {
    Gateway,
    Prefill,
    Decode,
}

const DECODE_ADDR: &str = "decode-0:7001";
const PREFILL_ADDR: &str = "prefill-0:7002";

/// Codes a request over a node's limit may end with: the limit's own
/// refusal (K9), or the loss of a node before anyone refused it.
const CODES_OF_AN_OVERSIZE_REQUEST: [&str; 4] = [
    "context_length_exceeded",
    "prefill_lost",
    "decode_lost",
    "unavailable",
];

// ------------------------------------------------------------ the state

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Conn {
    /// (dialler, listener)
    ends: [Node; 2],
    /// queues[i]: frames travelling from ends[i] to the other end. An empty
    /// frame is a close (FIN): it travels like data, after what was queued
    /// before it, so the peer sees the close as late as the network makes
    /// it, while other connections deliver meanwhile (a node that times a
    /// link out is seen to do so only later).
    queues: [VecDeque<Vec<u8>>; 2],
    /// An end that has closed, or seen the other end's close.
    closed: [bool; 2],
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Decoding {
    owner: Owner,
    conn: ConnId,
    pages: Vec<PageRef>,
    seq: Vec<u32>,
    /// Tokens generated (the first came from prefill).
    generated: u32,
    max_tokens: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Client {
    spec: ClientSpec,
    expected: Vec<u32>,
    /// Over a node's limit: must end with `context_length_exceeded` (K9).
    oversize: bool,
    tokens: Vec<u32>,
    end: Option<Result<u32, String>>,
    status: Option<u16>,
    cancelled: bool,
}

/// One client request at the end of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub req: RequestId,
    pub tenant: TenantId,
    pub prompt: Vec<u32>,
    /// Tokens the client received.
    pub tokens: Vec<u32>,
    /// The reference generation.
    pub expected: Vec<u32>,
    /// `Ok(completion_tokens)` or `Err(error code)`; `None` if cancelled.
    pub end: Option<Result<u32, String>>,
    /// Status of the error, if any.
    pub status: Option<u16>,
    pub cancelled: bool,
}

/// What happened so far (part of the state: two worlds that differ only
/// here are different states).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct WorldCounters {
    pub tokens_delivered: usize,
    pub corruptions: usize,
    pub kills: usize,
    pub crashes: usize,
    pub cancels: usize,
    /// Frames the network delivered out of order, dropped or duplicated
    /// (adversarial networks).
    pub reorders: usize,
    pub drops: usize,
    pub duplicates: usize,
    /// Prefill frames rewritten to name a page's previous epoch.
    pub stale_writes: usize,
    /// Messages a driver's tamper rewrote in flight.
    pub tampered: usize,
    /// Counters of decode instances that crashed (added at crash time).
    pub retired_checksum: u64,
    pub retired_fenced: u64,
    pub retired_late: u64,
    pub retired_cancels: (u64, u64),
    /// Cancels that reached decode while it was receiving the transfer.
    pub cancels_mid_transfer: u64,
}

/// Rewrites a message in flight (tests of faulty senders and of corruption
/// the frame check does not cover); returns whether it changed it.
pub type Tamper<'a> = &'a mut dyn FnMut(&mut Message) -> bool;

/// The whole PD stack as one value. See the module documentation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct World {
    params: WorldParams,
    pub gateway: Gateway,
    /// Prefill and decode run the production glue ([`transfer::node`]) over
    /// the stand-in engines.
    pub prefill: node::Prefill<StandInPrefill>,
    pub decode: node::Decode<StandInDecode>,
    prefill_up: bool,
    decode_up: bool,
    conns: BTreeMap<ConnId, Conn>,
    next_conn: ConnId,
    /// Gateway's connections to (prefill, decode), if any.
    gw_links: [Option<ConnId>; 2],
    /// Dials prefill has asked for.
    dials: VecDeque<String>,
    clients: BTreeMap<RequestId, Client>,
    next_req: RequestId,
    pub counters: WorldCounters,
    /// Everything an event saw go wrong (an invariant broken mid-event: a
    /// write through a stale handle, a wrong token, an event after a
    /// request's end). Empty in a correct world.
    violations: Vec<String>,
    /// Check the cross-node K4 invariant in `check_step`.
    check_k4: bool,
    /// Print every event to stderr (replays).
    trace: bool,
}

/// The gateway's model window in this world.
const GATEWAY_WINDOW_TOKENS: u32 = 64;

/// The first request's id; requests are numbered in submission order.
pub const FIRST_REQUEST: RequestId = RequestId(100);

impl World {
    pub fn new(params: WorldParams, clients: Vec<ClientSpec>) -> World {
        // The gateway's own window (64, below) is a limit too.
        let limit = params
            .prefill_limit
            .min(params.decode_limit)
            .min(GATEWAY_WINDOW_TOKENS) as usize;
        let clients = clients
            .into_iter()
            .enumerate()
            .map(|(i, spec)| {
                let c = Client {
                    expected: reference_tokens(&spec.prompt, spec.max_tokens),
                    oversize: spec.prompt.len() + spec.max_tokens as usize > limit,
                    spec,
                    tokens: Vec::new(),
                    end: None,
                    status: None,
                    cancelled: false,
                };
                (RequestId(FIRST_REQUEST.0 + i as u64), c)
            })
            .collect();
        let pool = |pages| {
            Pool::new(shape(params.page_size), pages, PoolOptions::default()).expect("small pool")
        };
        let mut w = World {
            gateway: Gateway::new(GatewayConfig {
                identity: identity("gateway", params.page_size, 0),
                model_window_tokens: GATEWAY_WINDOW_TOKENS,
                requests_max: 64,
                prefill: vec![PREFILL_ADDR.into()],
                decode: vec![DECODE_ADDR.into()],
                placements_max: params.placements_max,
            }),
            prefill: Self::new_prefill(&params, pool(params.prefill_pages)),
            decode: Self::new_decode(&params, pool(params.decode_pages)),
            prefill_up: true,
            decode_up: true,
            conns: BTreeMap::new(),
            next_conn: 1,
            gw_links: [None, None],
            dials: VecDeque::new(),
            clients,
            next_req: FIRST_REQUEST,
            counters: WorldCounters::default(),
            violations: Vec::new(),
            check_k4: true,
            trace: false,
            params,
        };
        w.gateway_dial(0);
        w.gateway_dial(1);
        w
    }

    fn new_prefill(p: &WorldParams, pool: Pool) -> node::Prefill<StandInPrefill> {
        let machine = PrefillNode::new(PrefillConfig {
            identity: identity("prefill-0", p.page_size, p.prefill_limit),
            vocab: VOCAB,
            requests_max: 32,
            queue_max: 32,
            window_pages: p.window_pages,
            tombstones_max: 64,
            prefix_keys: p
                .prefix_cache
                .then(|| PrefixKeys::with_secret([0x150, 0x5e7])),
        });
        node::Prefill::new(machine, StandInPrefill::new(pool, p.page_size))
    }

    fn new_decode(p: &WorldParams, pool: Pool) -> node::Decode<StandInDecode> {
        let machine = DecodeNode::new(DecodeConfig {
            identity: identity("decode-0", p.page_size, p.decode_limit),
            vocab: VOCAB,
            requests_max: 32,
            waiting_max: 32,
            ack_every_pages: p.window_pages,
        });
        node::Decode::new(machine, StandInDecode::new(pool, p.page_size))
    }

    pub fn params(&self) -> &WorldParams {
        &self.params
    }
    pub fn set_trace(&mut self, on: bool) {
        self.trace = on;
    }
    /// Switch the cross-node K4 check off (to let a mutation run on and
    /// show its consequences further down).
    pub fn set_check_k4(&mut self, on: bool) {
        self.check_k4 = on;
    }
    pub fn violations(&self) -> &[String] {
        &self.violations
    }

    fn trace(&self, what: impl FnOnce() -> String) {
        if self.trace {
            eprintln!("  {}", what());
        }
    }

    // -------------------------------------------------- what can happen

    pub fn up(&self, n: Node) -> bool {
        match n {
            Node::Gateway => true,
            Node::Prefill => self.prefill_up,
            Node::Decode => self.decode_up,
        }
    }

    /// Every direction of a connection with frames queued: `(conn, side,
    /// frames queued)`.
    pub fn frames(&self) -> Vec<(ConnId, usize, usize)> {
        let mut v = Vec::new();
        for (&id, c) in &self.conns {
            for side in 0..2 {
                if !c.queues[side].is_empty() {
                    v.push((id, side, c.queues[side].len()));
                }
            }
        }
        v
    }

    /// The frame `index` of one direction of `conn`, decoded (for drivers
    /// that rewrite a particular kind).
    pub fn peek(&self, conn: ConnId, side: usize, index: usize) -> Option<Message> {
        let frame = self.conns.get(&conn)?.queues[side].get(index)?;
        Message::decode(frame).ok().flatten().map(|(m, _)| m)
    }

    /// The (dialler, listener) of a connection.
    pub fn conn_ends(&self, conn: ConnId) -> Option<[Node; 2]> {
        self.conns.get(&conn).map(|c| c.ends)
    }

    pub fn conn_ids(&self) -> Vec<ConnId> {
        self.conns.keys().copied().collect()
    }
    pub fn has_dials(&self) -> bool {
        !self.dials.is_empty()
    }
    pub fn jobs(&self) -> Vec<RequestId> {
        self.prefill.engine.jobs.keys().copied().collect()
    }
    pub fn decoding(&self) -> Vec<RequestId> {
        self.decode.engine.decoding.keys().copied().collect()
    }
    /// Whether the gateway has no link to prefill (0) or decode (1) while
    /// that node is up (its connection manager would dial).
    pub fn gateway_link_missing(&self, which: usize) -> bool {
        let node = if which == 0 {
            Node::Prefill
        } else {
            Node::Decode
        };
        self.gw_links[which].is_none() && self.up(node)
    }
    /// The next request to submit, if any.
    pub fn next_client(&self) -> Option<RequestId> {
        self.clients
            .contains_key(&self.next_req)
            .then_some(self.next_req)
    }
    /// Submitted requests that have not ended and were not cancelled.
    pub fn in_flight(&self) -> Vec<RequestId> {
        self.clients
            .iter()
            .filter(|(&k, c)| k < self.next_req && c.end.is_none() && !c.cancelled)
            .map(|(&k, _)| k)
            .collect()
    }
    /// Every request was submitted and has ended (or was cancelled).
    pub fn clients_done(&self) -> bool {
        self.next_client().is_none() && self.in_flight().is_empty()
    }
    /// A request completed with the reference's tokens.
    pub fn some_completed(&self) -> bool {
        self.clients
            .values()
            .any(|c| c.end == Some(Ok(c.expected.len() as u32)) && c.tokens == c.expected)
    }

    /// The first possible event, in a fixed order (submit, deliver, dial,
    /// compute, decode): a deterministic driver for scripted tests.
    /// Returns false when nothing can happen.
    pub fn step_first(&mut self) -> bool {
        if self.gateway.ready() && self.next_client().is_some() {
            self.submit_next();
        } else if let Some(&(conn, side, _)) = self.frames().first() {
            self.deliver(conn, side, 0, None, None);
        } else if self.has_dials() {
            self.prefill_dial();
        } else if let Some(&req) = self.prefill.engine.jobs.keys().next() {
            self.compute(req);
        } else if let Some(&req) = self.decode.engine.decoding.keys().next() {
            self.decode_step(req);
        } else {
            return false;
        }
        true
    }

    // ------------------------------------------------------ connections

    fn open(&mut self, from: Node, to: Node) -> ConnId {
        let id = self.next_conn;
        self.next_conn += 1;
        self.conns.insert(
            id,
            Conn {
                ends: [from, to],
                queues: [VecDeque::new(), VecDeque::new()],
                closed: [false, false],
            },
        );
        id
    }

    /// The gateway's connection manager dials prefill (0) or decode (1) if
    /// it is up and not linked.
    pub fn gateway_dial(&mut self, which: usize) {
        let to = if which == 0 {
            Node::Prefill
        } else {
            Node::Decode
        };
        if !self.up(to) || self.gw_links[which].is_some() {
            return;
        }
        let conn = self.open(Node::Gateway, to);
        self.trace(|| format!("gateway dials {to:?}: conn {conn}"));
        self.gw_links[which] = Some(conn);
        let mut ga = Vec::new();
        self.gateway.connected(which, conn, &mut ga);
        self.gateway_actions(ga);
        self.node_event(to, NetEvent::Accepted { conn });
    }

    /// Prefill's oldest dial completes (or fails if decode is down).
    pub fn prefill_dial(&mut self) {
        let Some(addr) = self.dials.pop_front() else {
            return;
        };
        if !self.decode_up || addr != DECODE_ADDR {
            self.trace(|| format!("prefill's dial to {addr} fails"));
            self.node_event(
                Node::Prefill,
                NetEvent::DialFailed {
                    addr,
                    why: "connection refused".into(),
                },
            );
            return;
        }
        let conn = self.open(Node::Prefill, Node::Decode);
        self.trace(|| format!("prefill dials decode: conn {conn}"));
        self.node_event(Node::Prefill, NetEvent::Dialled { conn, addr });
        self.node_event(Node::Decode, NetEvent::Accepted { conn });
    }

    fn send(&mut self, from: Node, conn: ConnId, msg: &Message) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let side = if c.ends[0] == from { 0 } else { 1 };
        if c.closed[side] || c.closed[1 - side] {
            return;
        }
        let mut buf = Vec::new();
        msg.encode(&mut buf);
        c.queues[side].push_back(buf);
    }

    /// `node` closes `conn`: it sees the close now; the peer when the close
    /// frame queued behind what `node` sent arrives.
    fn close_by(&mut self, node: Node, conn: ConnId) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let side = if c.ends[0] == node { 0 } else { 1 };
        if c.closed[side] {
            return;
        }
        c.closed[side] = true;
        // What was on its way to `node` is never read.
        c.queues[1 - side].clear();
        if !c.closed[1 - side] {
            c.queues[side].push_back(Vec::new());
        }
        self.notify_closed(node, conn);
        self.reap(conn);
    }

    /// A connection both ends have closed, with nothing in flight, is gone.
    fn reap(&mut self, conn: ConnId) {
        if self
            .conns
            .get(&conn)
            .is_some_and(|c| c.closed == [true, true] && c.queues.iter().all(|q| q.is_empty()))
        {
            self.conns.remove(&conn);
        }
    }

    /// Whether frame `index` of one direction is a close.
    fn is_fin(&self, conn: ConnId, side: usize, index: usize) -> bool {
        self.conns
            .get(&conn)
            .and_then(|c| c.queues[side].get(index))
            .is_some_and(|f| f.is_empty())
    }

    /// `node`'s heartbeat timer gives up on `conn` (the peer is stopped or
    /// partitioned, and the connection itself still open): `node` closes
    /// it; the peer sees that when the close arrives.
    pub fn time_out(&mut self, node: Node, conn: ConnId) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        let Some(side) = c.ends.iter().position(|&e| e == node) else {
            return;
        };
        if c.closed[side] || !self.up(node) {
            return;
        }
        self.trace(|| format!("{node:?} times out conn {conn}"));
        self.counters.kills += 1;
        self.close_by(node, conn);
    }

    /// The network drops a connection: both ends see it at once, and every
    /// frame in flight on it is lost (the only loss TCP has).
    pub fn kill(&mut self, conn: ConnId) {
        self.trace(|| format!("KILL conn {conn}"));
        self.counters.kills += 1;
        self.drop_conn(conn);
    }

    fn drop_conn(&mut self, conn: ConnId) {
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        for side in 0..2 {
            if !c.closed[side] {
                self.notify_closed(c.ends[side], conn);
            }
        }
    }

    fn notify_closed(&mut self, node: Node, conn: ConnId) {
        self.trace(|| format!("{node:?} sees conn {conn} closed"));
        match node {
            Node::Gateway => {
                for l in self.gw_links.iter_mut() {
                    if *l == Some(conn) {
                        *l = None;
                    }
                }
                let mut ga = Vec::new();
                self.gateway.closed(conn, &mut ga);
                self.gateway_actions(ga);
            }
            Node::Prefill | Node::Decode => {
                if self.up(node) {
                    self.node_event(node, NetEvent::Closed { conn });
                }
            }
        }
    }

    /// Delivers frame `index` (0: the next one, as TCP does; others model a
    /// reordering network) of one direction of `conn`. `corrupt`: flip bit
    /// `.1 % 8` of byte `4 + .0 % (len - 4)` first. `tamper` may rewrite the
    /// decoded message.
    pub fn deliver(
        &mut self,
        conn: ConnId,
        side: usize,
        index: usize,
        corrupt: Option<(u64, u64)>,
        tamper: Option<Tamper<'_>>,
    ) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        // A close is the last frame of its direction; it cannot overtake
        // data (the peer would drop what is queued before it).
        if c.queues[side].get(index).is_some_and(|f| f.is_empty()) && index > 0 {
            return;
        }
        let Some(mut frame) = c.queues[side].remove(index) else {
            return;
        };
        let to = c.ends[1 - side];
        if frame.is_empty() {
            c.closed[1 - side] = true;
            c.queues = [VecDeque::new(), VecDeque::new()];
            self.notify_closed(to, conn);
            self.reap(conn);
            return;
        }
        self.counters.reorders += usize::from(index > 0);
        if let Some((byte, bit)) = corrupt.filter(|_| frame.len() > 4) {
            // Any byte after the length prefix (a flipped length is a TCP
            // stream desync, which the heartbeat timeout ends).
            let i = 4 + (byte % (frame.len() as u64 - 4)) as usize;
            frame[i] ^= 1 << (bit % 8);
            self.counters.corruptions += 1;
            self.trace(|| format!("CORRUPT byte {i} of a frame on conn {conn}"));
        }
        match Message::decode(&frame) {
            Ok(Some((mut msg, _))) => {
                if let Some(t) = tamper {
                    if t(&mut msg) {
                        self.counters.tampered += 1;
                        self.trace(|| format!("TAMPERED a {} on conn {conn}", msg.kind_name()));
                    }
                }
                self.receive(to, conn, msg)
            }
            // A frame that no longer parses: the receiver's transport
            // closes the connection (what the TCP driver does).
            _ => self.close_by(to, conn),
        }
        self.reap(conn);
    }

    /// An adversarial network loses frame `index` of a live connection
    /// (TCP cannot: see the `verify` crate for when drivers use this).
    /// A close is never lost (the heartbeat timeout would see it anyway).
    pub fn drop_frame(&mut self, conn: ConnId, side: usize, index: usize) {
        if self.is_fin(conn, side, index) {
            return;
        }
        if let Some(c) = self.conns.get_mut(&conn) {
            if c.queues[side].remove(index).is_some() {
                self.counters.drops += 1;
                self.trace(|| format!("DROP frame {index} on conn {conn}"));
            }
        }
        self.reap(conn);
    }

    /// An adversarial network delivers frame `index` twice (TCP cannot).
    pub fn duplicate_frame(&mut self, conn: ConnId, side: usize, index: usize) {
        if self.is_fin(conn, side, index) {
            return;
        }
        if let Some(c) = self.conns.get_mut(&conn) {
            if let Some(f) = c.queues[side].get(index).cloned() {
                // Before a trailing close: nothing follows a FIN.
                let at = c.queues[side].len()
                    - usize::from(c.queues[side].back().is_some_and(|l| l.is_empty()));
                c.queues[side].insert(at, f);
                self.counters.duplicates += 1;
                self.trace(|| format!("DUPLICATE frame {index} on conn {conn}"));
            }
        }
    }

    fn receive(&mut self, to: Node, conn: ConnId, msg: Message) {
        self.trace(|| {
            let mut m = format!("{msg:?}");
            m.truncate(160);
            format!("{to:?} <- conn {conn}: {m}")
        });
        match to {
            Node::Gateway => {
                let mut ga = Vec::new();
                self.gateway.message(conn, msg, &mut ga);
                self.gateway_actions(ga);
            }
            Node::Prefill => self.node_event(Node::Prefill, NetEvent::Message { conn, msg }),
            Node::Decode => {
                // K2 as an event: a page may change decode's memory only
                // through the live reservation it names.
                let page = match &msg {
                    Message::Page {
                        req, position, dst, ..
                    } => {
                        let reserved = self
                            .decode
                            .machine
                            .pages_of(*req)
                            .and_then(|p| p.get(*position as usize).copied());
                        let pool = &self.decode.engine.pool;
                        let before = (pool.epoch_of(dst.index), pool.page_fingerprint(dst.index));
                        Some((*req, *dst, reserved, before))
                    }
                    _ => None,
                };
                if let Message::Cancel { req } = &msg {
                    if self.decode.machine.phase_of(*req)
                        == Some(transfer::decode::DecodePhase::Receiving)
                    {
                        self.counters.cancels_mid_transfer += 1;
                    }
                }
                let mut cmds = Vec::new();
                self.decode
                    .event(NetEvent::Message { conn, msg }, &mut cmds);
                if let Some((req, dst, reserved, (epoch, before))) = page {
                    // A page freed or reallocated by the event (a failed
                    // transfer's pages are poisoned, a waiting request's get
                    // canaries) changed for other reasons: K1/K4 judge those.
                    let pool = &self.decode.engine.pool;
                    let same_epoch = pool.epoch_of(dst.index) == epoch;
                    let written = before != pool.page_fingerprint(dst.index);
                    let named_live = reserved
                        == Some(PageRef {
                            index: dst.index,
                            epoch: dst.epoch,
                        })
                        && epoch == Some(dst.epoch);
                    if same_epoch && written && !named_live {
                        self.violations.push(format!(
                            "K2: a page of request {req} naming page {} epoch {} was written into \
                             decode's page {} at epoch {:?} (the request's reservation there: \
                             {reserved:?})",
                            dst.index, dst.epoch, dst.index, epoch
                        ));
                    }
                }
                self.commands(Node::Decode, cmds);
            }
        }
    }

    // ---------------------------------------------------------- actions

    /// A transport event at a node, through the production glue
    /// ([`transfer::node`]); its commands go onto the world's connections.
    fn node_event(&mut self, node: Node, ev: NetEvent) {
        let mut cmds = Vec::new();
        match node {
            Node::Prefill => self.prefill.event(ev, &mut cmds),
            Node::Decode => self.decode.event(ev, &mut cmds),
            Node::Gateway => unreachable!("the gateway is not a node with an engine"),
        }
        self.commands(node, cmds);
    }

    /// Carries out a node's commands, then checks what its engine started.
    fn commands(&mut self, node: Node, cmds: Vec<NetCommand>) {
        for c in cmds {
            match c {
                NetCommand::Send { conn, msg } => self.send(node, conn, &msg),
                NetCommand::Close { conn } => self.close_by(node, conn),
                NetCommand::Dial { addr } => self.dials.push_back(addr),
            }
        }
        self.check_starts();
    }

    /// K3/K10 and K7 as events: decode started only on pages that hold
    /// exactly this request's prompt, written in their current epoch, with
    /// every canary intact (the stand-in engine read them when it started).
    fn check_starts(&mut self) {
        for st in std::mem::take(&mut self.decode.engine.starts) {
            // Nodes know a request by its placement's wire id: the client's
            // id, with its top two bits flipped for a re-placement
            // (`transfer::gateway`'s `wire_id`); the world's client ids are
            // small, so masking those bits gives the client back.
            let client = RequestId(st.req.0 & !(3u64 << 62));
            let prompt = self.clients.get(&client).map(|c| c.spec.prompt.clone());
            match (&prompt, &st.read) {
                (Some(p), Ok(t)) if *p == st.tokens && *t == reference_next(p) => {}
                _ => self.violations.push(format!(
                    "K3/K10: decode started request {} on pages that do not hold its prompt \
                     (decode has {} tokens, the client sent {:?}; reading them: {:?})",
                    st.req,
                    st.tokens.len(),
                    prompt.as_ref().map(Vec::len),
                    st.read
                )),
            }
            if let Some(index) = st.canary_failed {
                self.violations.push(format!(
                    "K7: decode started request {} although page {index} failed its canary",
                    st.req
                ));
            }
        }
    }

    fn gateway_actions(&mut self, actions: Vec<GatewayAction>) {
        for a in actions {
            match a {
                GatewayAction::Send { conn, msg } => self.send(Node::Gateway, conn, &msg),
                GatewayAction::Close { conn } => self.close_by(Node::Gateway, conn),
                GatewayAction::Deliver { req, event } => self.client_event(req, event),
            }
        }
    }

    fn client_event(&mut self, req: RequestId, event: ClientEvent) {
        self.trace(|| format!("client {req} <- {event:?}"));
        let Some(c) = self.clients.get_mut(&req) else {
            return;
        };
        if c.end.is_some() || c.cancelled {
            self.violations.push(format!(
                "request {req}: an event after its end or its cancel: {event:?}"
            ));
            return;
        }
        match event {
            ClientEvent::Token { id, .. } => {
                let at = c.tokens.len();
                if c.expected.get(at) != Some(&id) {
                    // Content: a token another request's KV (or a stale or
                    // unwritten page) produced.
                    self.violations.push(format!(
                        "request {req}: token {at} is {id}, the reference's is {:?}",
                        c.expected.get(at)
                    ));
                }
                c.tokens.push(id);
                self.counters.tokens_delivered += 1;
            }
            ClientEvent::Finished {
                completion_tokens, ..
            } => c.end = Some(Ok(completion_tokens)),
            ClientEvent::Error(e) => {
                c.status = Some(e.status);
                c.end = Some(Err(e.code));
            }
        }
    }

    // ---------------------------------------------------------- engines

    /// Prefill's engine runs one job: writes the prompt's KV, reads it
    /// back for the first token.
    pub fn compute(&mut self, req: RequestId) {
        if !self.prefill.engine.jobs.contains_key(&req) {
            return;
        }
        self.trace(|| format!("prefill computes request {req}"));
        self.prefill.engine.run(req);
        let mut cmds = Vec::new();
        self.prefill.reports(&mut cmds);
        self.commands(Node::Prefill, cmds);
    }

    /// Decode's engine runs one step of one request.
    pub fn decode_step(&mut self, req: RequestId) {
        self.decode.engine.step(req);
        let mut cmds = Vec::new();
        self.decode.reports(&mut cmds);
        self.commands(Node::Decode, cmds);
    }

    // ----------------------------------------------------------- faults

    /// A node crashes: its memory is gone, its peers see its connections
    /// drop; it sees nothing.
    pub fn crash(&mut self, node: Node) {
        self.trace(|| format!("CRASH {node:?}"));
        self.counters.crashes += 1;
        let conns: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.ends.contains(&node))
            .map(|(&k, _)| k)
            .collect();
        match node {
            Node::Prefill => {
                self.prefill_up = false;
                self.prefill.engine.jobs.clear();
                self.dials.clear();
            }
            Node::Decode => {
                let s = self.decode.machine.stats();
                self.counters.retired_checksum += s.checksum_failures_total;
                self.counters.retired_fenced += s.pages_fenced_total;
                self.counters.retired_late += s.pages_late_total;
                self.counters.retired_cancels.0 += s.cancels_receiving_total;
                self.counters.retired_cancels.1 += s.cancels_decoding_total;
                self.decode_up = false;
                self.decode.engine.decoding.clear();
            }
            Node::Gateway => unreachable!("the gateway does not crash in this world"),
        }
        for conn in conns {
            self.drop_conn(conn);
        }
    }

    /// A crashed node comes back empty (new state machine, new pool).
    pub fn restart(&mut self, node: Node) {
        self.trace(|| format!("RESTART {node:?}"));
        let shape = *self.decode.engine.pool.shape();
        match node {
            Node::Prefill => {
                let pool = Pool::new(shape, self.params.prefill_pages, PoolOptions::default())
                    .expect("pool");
                self.prefill = Self::new_prefill(&self.params, pool);
                self.prefill_up = true;
                self.gateway_dial(0);
            }
            Node::Decode => {
                let pool = Pool::new(shape, self.params.decode_pages, PoolOptions::default())
                    .expect("pool");
                self.decode = Self::new_decode(&self.params, pool);
                self.decode_up = true;
                self.gateway_dial(1);
            }
            Node::Gateway => {}
        }
    }

    // --------------------------------------------------------- clients

    /// The next client submits its request.
    pub fn submit_next(&mut self) {
        let req = self.next_req;
        let Some(c) = self.clients.get(&req) else {
            return;
        };
        self.next_req = RequestId(self.next_req.0 + 1);
        let (tenant, prompt, max_tokens) =
            (c.spec.tenant, c.spec.prompt.clone(), c.spec.max_tokens);
        self.trace(|| format!("client {req} submits {} tokens", prompt.len()));
        let mut ga = Vec::new();
        let r = self
            .gateway
            .submit(req, tenant, prompt, max_tokens, GenSpec::greedy(), &mut ga);
        self.gateway_actions(ga);
        if let Err(e) = r {
            self.client_event(req, ClientEvent::Error(e));
        }
    }

    /// A client cancels its request (hangs up).
    pub fn cancel(&mut self, req: RequestId) {
        let Some(c) = self.clients.get_mut(&req) else {
            return;
        };
        if c.end.is_some() || c.cancelled || req >= self.next_req {
            return;
        }
        c.cancelled = true;
        self.counters.cancels += 1;
        self.trace(|| format!("client {req} CANCELS"));
        let mut ga = Vec::new();
        self.gateway.cancel(req, &mut ga);
        self.gateway_actions(ga);
    }
}
