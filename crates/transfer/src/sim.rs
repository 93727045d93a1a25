//! A deterministic simulation of the whole PD stack: the production
//! [`Gateway`], [`PrefillNode`] and [`DecodeNode`] state machines with real
//! [`kv::Pool`]s, a simulated network (ordered connections like TCP, with
//! interleaving across connections, byte corruption, connection kills) and
//! node crashes, all driven by one seeded random number generator. A seed
//! replays exactly.
//!
//! The "model" is a stand-in whose next token is a hash of every KV row the
//! sequence reads *through the pool*: if decode ever read a page it did not
//! receive from this request's prefill (another tenant's, a stale one, an
//! unwritten one), its tokens would differ from the reference, which is
//! computed from the tokens alone. So the simulation checks content, not
//! just states: every token delivered to a client must equal the
//! reference's token at that position.
//!
//! ```
//! use transfer::sim::{Sim, SimConfig};
//! let report = Sim::new(7, SimConfig::default()).run().expect("invariants hold");
//! assert!(report.finished > 0);
//! ```

use std::collections::{BTreeMap, VecDeque};

use kv::{DType, KvShape, LayerView, Owner, PageRef, Pool, PoolOptions};

use crate::common::{ConnId, Identity};
use crate::decode::{DecodeAction, DecodeConfig, DecodeNode, DecodeStart};
use crate::gateway::{ClientEvent, Gateway, GatewayAction, GatewayConfig};
use crate::prefill::{ComputeJob, PrefillAction, PrefillConfig, PrefillNode};
use crate::wire::{GenSpec, KvLayout, Message};

/// splitmix64: small, seedable, the same everywhere.
#[derive(Clone, Debug)]
pub struct SimRng(u64);

impl SimRng {
    pub fn new(seed: u64) -> SimRng {
        SimRng(seed ^ 0x5eed_5eed_5eed_5eed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    /// True with probability `p_permille / 1000`.
    pub fn chance(&mut self, p_permille: u32) -> bool {
        self.below(1000) < p_permille as u64
    }
}

/// What a run does; every count is a bound.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub requests: usize,
    pub tenants: u64,
    pub prompt_tokens_max: usize,
    pub max_tokens_max: u32,
    pub page_size: u32,
    pub prefill_pages: u64,
    pub decode_pages: u64,
    /// Limits the nodes advertise (K8); the gateway takes the minimum.
    pub prefill_limit: u32,
    pub decode_limit: u32,
    pub window_pages: u32,
    /// Faults (per-mille chance per step, and how many at most).
    pub cancel_permille: u32,
    pub cancels_max: usize,
    pub corrupt_permille: u32,
    pub corruptions_max: usize,
    pub kill_conn_permille: u32,
    pub kills_max: usize,
    pub crash_permille: u32,
    pub crashes_max: usize,
    /// Steps with faults, then a fault-free drain bounded by `drain_steps`.
    pub steps: usize,
    pub drain_steps: usize,
    /// Print every delivery, fault and client event to stderr (replays).
    pub trace: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            requests: 6,
            tenants: 3,
            prompt_tokens_max: 14,
            max_tokens_max: 5,
            page_size: 4,
            prefill_pages: 12,
            decode_pages: 16,
            prefill_limit: 32,
            decode_limit: 32,
            window_pages: 2,
            cancel_permille: 20,
            cancels_max: 2,
            corrupt_permille: 5,
            corruptions_max: 1,
            kill_conn_permille: 3,
            kills_max: 1,
            crash_permille: 2,
            crashes_max: 1,
            steps: 3000,
            drain_steps: 20_000,
            trace: false,
        }
    }
}

/// One client request at the end of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub req: u64,
    pub tenant: u64,
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

/// What a run saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SimReport {
    pub steps: usize,
    pub finished: usize,
    pub errors: usize,
    pub cancelled: usize,
    pub tokens_delivered: usize,
    pub corruptions: usize,
    pub kills: usize,
    pub crashes: usize,
    /// Checksum failures seen by decode (all instances).
    pub checksum_failures: u64,
    pub pages_fenced: u64,
    pub pages_late: u64,
    /// Cancels by the phase decode had the request in.
    pub cancels_receiving: u64,
    pub cancels_decoding: u64,
    /// Error codes clients got, in order.
    pub error_codes: Vec<String>,
    pub outcomes: Vec<Outcome>,
    /// Pool counters at the end (of the current node instances).
    pub prefill_pool: kv::PoolStats,
    pub decode_pool: kv::PoolStats,
    pub decode_stats: crate::decode::DecodeStats,
    pub prefill_stats: crate::prefill::PrefillStats,
}

// ------------------------------------------------------------- the model

const LAYERS: usize = 2;
const WIDTH: usize = 4;
pub const VOCAB: u32 = 1000;

/// K row of (token, position, layer); V is K + 0.5.
fn kv_row(token: u32, pos: usize, layer: usize) -> [f32; WIDTH] {
    [
        token as f32,
        pos as f32,
        layer as f32,
        ((token as usize * 31 + pos * 7 + layer) % 97) as f32,
    ]
}

fn mix(acc: u64, v: u64) -> u64 {
    let mut z = acc ^ v.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z ^ (z >> 32)
}

/// Hash of the rows of one (position, layer): order-free sum over rows.
fn row_hash(pos: usize, layer: usize, k: &[f32], v: &[f32]) -> u64 {
    let mut h = mix(pos as u64, layer as u64);
    for x in k.iter().chain(v) {
        h = mix(h, x.to_bits() as u64);
    }
    h
}

fn token_of(sum: u64) -> u32 {
    (mix(sum, 0x70c3) % VOCAB as u64) as u32
}

/// The reference: the next token after `seq`, from the tokens alone.
pub fn reference_next(seq: &[u32]) -> u32 {
    let mut sum = 0u64;
    for (pos, &t) in seq.iter().enumerate() {
        for layer in 0..LAYERS {
            let k = kv_row(t, pos, layer);
            let v = k.map(|x| x + 0.5);
            sum = sum.wrapping_add(row_hash(pos, layer, &k, &v));
        }
    }
    token_of(sum)
}

/// The reference generation of `max_tokens` tokens.
pub fn reference_tokens(prompt: &[u32], max_tokens: u32) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..max_tokens {
        let t = reference_next(&seq);
        out.push(t);
        seq.push(t);
    }
    out
}

fn write_kv(
    pool: &mut Pool,
    pages: &[PageRef],
    owner: Owner,
    ps: usize,
    pos: usize,
    token: u32,
) -> Result<(), kv::KvError> {
    for layer in 0..LAYERS {
        let k = kv_row(token, pos, layer);
        let v = k.map(|x| x + 0.5);
        pool.write_token(pages[pos / ps], owner, layer, pos % ps, &k, &v)?;
    }
    Ok(())
}

/// The next token after positions `0..n`, reading every row through the
/// pool (K1–K3 checked on every read).
fn next_from_pool(
    pool: &Pool,
    pages: &[PageRef],
    owner: Owner,
    ps: usize,
    n: usize,
) -> Result<u32, kv::KvError> {
    let mut sum = 0u64;
    for (pi, &h) in pages.iter().enumerate().take(n.div_ceil(ps)) {
        let slots = (n - pi * ps).min(ps);
        for layer in 0..LAYERS {
            match pool.read_layer(h, owner, layer, slots)? {
                LayerView::F32 { k, v } => {
                    for s in 0..slots {
                        let pos = pi * ps + s;
                        sum = sum.wrapping_add(row_hash(
                            pos,
                            layer,
                            &k[s * WIDTH..(s + 1) * WIDTH],
                            &v[s * WIDTH..(s + 1) * WIDTH],
                        ));
                    }
                }
                LayerView::F16 { .. } => unreachable!("the simulation's pools are f32"),
            }
        }
    }
    Ok(token_of(sum))
}

// --------------------------------------------------------------- network

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum NodeId {
    Gateway,
    Prefill,
    Decode,
}

const DECODE_ADDR: &str = "decode-0:7001";
const PREFILL_ADDR: &str = "prefill-0:7002";

struct Conn {
    /// (dialler, listener)
    ends: [NodeId; 2],
    /// queues[i]: frames travelling from ends[i] to the other end.
    queues: [VecDeque<Vec<u8>>; 2],
    /// An end that closed: the other end still receives what was queued
    /// towards it, then sees the close.
    closed: [bool; 2],
}

struct Decoding {
    owner: Owner,
    conn: ConnId,
    pages: Vec<PageRef>,
    seq: Vec<u32>,
    /// Tokens generated (the first came from prefill).
    generated: u32,
    max_tokens: u32,
}

struct Client {
    tenant: u64,
    prompt: Vec<u32>,
    max_tokens: u32,
    expected: Vec<u32>,
    tokens: Vec<u32>,
    end: Option<Result<u32, String>>,
    status: Option<u16>,
    cancelled: bool,
}

/// Rewrites a message in flight (tests of faulty senders and of corruption
/// the frame check does not cover); returns whether it changed it.
pub type Tamper = Box<dyn FnMut(&mut Message) -> bool>;

/// One simulation run.
pub struct Sim {
    cfg: SimConfig,
    rng: SimRng,
    gateway: Gateway,
    prefill: PrefillNode,
    decode: DecodeNode,
    prefill_pool: Pool,
    decode_pool: Pool,
    prefill_up: bool,
    decode_up: bool,
    conns: BTreeMap<ConnId, Conn>,
    next_conn: ConnId,
    /// Gateway's connections to (prefill, decode), if any.
    gw_links: [Option<ConnId>; 2],
    /// Dials prefill has asked for.
    dials: VecDeque<String>,
    jobs: BTreeMap<u64, ComputeJob>,
    decoding: BTreeMap<u64, Decoding>,
    clients: BTreeMap<u64, Client>,
    next_req: u64,
    report: SimReport,
    /// Counters of node instances that crashed (added at crash time).
    retired_checksum: u64,
    retired_fenced: u64,
    retired_late: u64,
    retired_cancels: (u64, u64),
    tamper: Option<Tamper>,
    /// Check the cross-node K4 invariant after every step.
    check_k4: bool,
}

fn identity(node: &str, ps: u32, limit: u32) -> Identity {
    Identity {
        node: node.into(),
        fingerprint: [7; 32],
        layout: KvLayout {
            page_size: ps,
            dtype: 0,
            layers: LAYERS as u32,
            kv_heads: 1,
            head_dim: WIDTH as u32,
        },
        max_request_tokens: limit,
    }
}

impl Sim {
    pub fn new(seed: u64, cfg: SimConfig) -> Sim {
        let mut rng = SimRng::new(seed);
        let mut clients = BTreeMap::new();
        for i in 0..cfg.requests as u64 {
            let tenant = 1 + rng.below(cfg.tenants);
            let len = 1 + rng.below(cfg.prompt_tokens_max as u64) as usize;
            let prompt: Vec<u32> = (0..len).map(|_| rng.below(VOCAB as u64) as u32).collect();
            let max_tokens = 1 + rng.below(cfg.max_tokens_max as u64) as u32;
            let expected = reference_tokens(&prompt, max_tokens);
            clients.insert(
                100 + i,
                Client {
                    tenant,
                    prompt,
                    max_tokens,
                    expected,
                    tokens: Vec::new(),
                    end: None,
                    status: None,
                    cancelled: false,
                },
            );
        }
        Self::build(rng, cfg, clients)
    }

    /// A run over the given requests `(tenant, prompt, max_tokens)`, in
    /// order, instead of random ones.
    pub fn scripted(seed: u64, cfg: SimConfig, requests: &[(u64, Vec<u32>, u32)]) -> Sim {
        let rng = SimRng::new(seed);
        let mut clients = BTreeMap::new();
        for (i, (tenant, prompt, max_tokens)) in requests.iter().enumerate() {
            clients.insert(
                100 + i as u64,
                Client {
                    tenant: *tenant,
                    prompt: prompt.clone(),
                    max_tokens: *max_tokens,
                    expected: reference_tokens(prompt, *max_tokens),
                    tokens: Vec::new(),
                    end: None,
                    status: None,
                    cancelled: false,
                },
            );
        }
        let cfg = SimConfig {
            requests: requests.len(),
            ..cfg
        };
        Self::build(rng, cfg, clients)
    }

    fn build(rng: SimRng, cfg: SimConfig, clients: BTreeMap<u64, Client>) -> Sim {
        let shape = KvShape::new(LAYERS, 1, WIDTH, cfg.page_size as usize, DType::F32)
            .expect("simulation shape is valid");
        let pool = |pages| Pool::new(shape, pages, PoolOptions::default()).expect("small pool");
        let mut sim = Sim {
            gateway: Gateway::new(GatewayConfig {
                identity: identity("gateway", cfg.page_size, 0),
                model_window_tokens: 64,
                requests_max: 64,
                prefill: vec![PREFILL_ADDR.into()],
                decode: vec![DECODE_ADDR.into()],
            }),
            prefill: Self::new_prefill(&cfg),
            decode: Self::new_decode(&cfg),
            prefill_pool: pool(cfg.prefill_pages),
            decode_pool: pool(cfg.decode_pages),
            prefill_up: true,
            decode_up: true,
            conns: BTreeMap::new(),
            next_conn: 1,
            gw_links: [None, None],
            dials: VecDeque::new(),
            jobs: BTreeMap::new(),
            decoding: BTreeMap::new(),
            clients,
            next_req: 100,
            report: SimReport::default(),
            retired_checksum: 0,
            retired_fenced: 0,
            retired_late: 0,
            retired_cancels: (0, 0),
            tamper: None,
            check_k4: true,
            rng,
            cfg,
        };
        sim.gateway_dial(0);
        sim.gateway_dial(1);
        sim
    }

    fn new_prefill(cfg: &SimConfig) -> PrefillNode {
        PrefillNode::new(PrefillConfig {
            identity: identity("prefill-0", cfg.page_size, cfg.prefill_limit),
            vocab: VOCAB,
            requests_max: 32,
            queue_max: 32,
            window_pages: cfg.window_pages,
            tombstones_max: 64,
        })
    }

    fn new_decode(cfg: &SimConfig) -> DecodeNode {
        DecodeNode::new(DecodeConfig {
            identity: identity("decode-0", cfg.page_size, cfg.decode_limit),
            vocab: VOCAB,
            requests_max: 32,
            waiting_max: 32,
            ack_every_pages: cfg.window_pages,
        })
    }

    /// Mutable access for tests that set mutations or inspect state.
    pub fn decode_mut(&mut self) -> &mut DecodeNode {
        &mut self.decode
    }
    pub fn gateway_mut(&mut self) -> &mut Gateway {
        &mut self.gateway
    }
    pub fn decode_pool_mut(&mut self) -> &mut Pool {
        &mut self.decode_pool
    }
    pub fn prefill_pool_mut(&mut self) -> &mut Pool {
        &mut self.prefill_pool
    }
    pub fn set_tamper(&mut self, t: Tamper) {
        self.tamper = Some(t);
    }
    /// Switch the cross-node K4 check off (to let a mutation run on and
    /// show its consequences further down).
    pub fn set_check_k4(&mut self, on: bool) {
        self.check_k4 = on;
    }
    pub fn prefill_mut(&mut self) -> &mut PrefillNode {
        &mut self.prefill
    }

    // ------------------------------------------------------ connections

    fn open(&mut self, from: NodeId, to: NodeId) -> ConnId {
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

    fn up(&self, n: NodeId) -> bool {
        match n {
            NodeId::Gateway => true,
            NodeId::Prefill => self.prefill_up,
            NodeId::Decode => self.decode_up,
        }
    }

    /// The gateway dials prefill (0) or decode (1) if it is up.
    fn gateway_dial(&mut self, which: usize) {
        let to = if which == 0 {
            NodeId::Prefill
        } else {
            NodeId::Decode
        };
        if !self.up(to) || self.gw_links[which].is_some() {
            return;
        }
        let conn = self.open(NodeId::Gateway, to);
        self.gw_links[which] = Some(conn);
        let mut ga = Vec::new();
        self.gateway.connected(which, conn, &mut ga);
        self.gateway_actions(ga);
        if to == NodeId::Prefill {
            let mut pa = Vec::new();
            self.prefill.accepted(conn, &mut pa);
            self.prefill_actions(pa);
        } else {
            let mut da = Vec::new();
            self.decode.connected(conn, &mut da);
            self.decode_actions(da);
        }
    }

    fn prefill_dial(&mut self) {
        let Some(addr) = self.dials.pop_front() else {
            return;
        };
        if !self.decode_up || addr != DECODE_ADDR {
            let mut pa = Vec::new();
            self.prefill.connect_failed(
                &mut self.prefill_pool,
                &addr,
                "connection refused",
                &mut pa,
            );
            self.prefill_actions(pa);
            return;
        }
        let conn = self.open(NodeId::Prefill, NodeId::Decode);
        let mut pa = Vec::new();
        self.prefill.connected(conn, &addr, &mut pa);
        self.prefill_actions(pa);
        let mut da = Vec::new();
        self.decode.connected(conn, &mut da);
        self.decode_actions(da);
    }

    fn send(&mut self, from: NodeId, conn: ConnId, msg: &Message) {
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

    /// `node` closes `conn`: it sees the close now; the peer after the
    /// frames queued towards it.
    fn close_by(&mut self, node: NodeId, conn: ConnId) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let side = if c.ends[0] == node { 0 } else { 1 };
        if c.closed[side] {
            return;
        }
        c.closed[side] = true;
        c.queues[1 - side].clear();
        self.notify_closed(node, conn);
        self.maybe_finish_close(conn);
    }

    fn maybe_finish_close(&mut self, conn: ConnId) {
        for side in 0..2 {
            let Some(c) = self.conns.get_mut(&conn) else {
                return;
            };
            if c.closed[side] && !c.closed[1 - side] && c.queues[side].is_empty() {
                let peer = c.ends[1 - side];
                c.closed[1 - side] = true;
                self.notify_closed(peer, conn);
            }
        }
        if self
            .conns
            .get(&conn)
            .is_some_and(|c| c.closed == [true, true])
        {
            self.conns.remove(&conn);
        }
    }

    /// The network drops a connection: both ends see it at once.
    fn kill(&mut self, conn: ConnId) {
        self.trace(|| format!("KILL conn {conn}"));
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        for side in 0..2 {
            if !c.closed[side] {
                self.notify_closed(c.ends[side], conn);
            }
        }
    }

    fn notify_closed(&mut self, node: NodeId, conn: ConnId) {
        self.trace(|| format!("{node:?} sees conn {conn} closed"));
        match node {
            NodeId::Gateway => {
                for l in self.gw_links.iter_mut() {
                    if *l == Some(conn) {
                        *l = None;
                    }
                }
                let mut ga = Vec::new();
                self.gateway.closed(conn, &mut ga);
                self.gateway_actions(ga);
            }
            NodeId::Prefill => {
                if self.prefill_up {
                    let mut pa = Vec::new();
                    self.prefill.closed(&mut self.prefill_pool, conn, &mut pa);
                    self.prefill_actions(pa);
                }
            }
            NodeId::Decode => {
                if self.decode_up {
                    let mut da = Vec::new();
                    self.decode.closed(&mut self.decode_pool, conn, &mut da);
                    self.decode_actions(da);
                }
            }
        }
    }

    /// Delivers the next frame of one direction of `conn` (maybe corrupted).
    fn deliver(&mut self, conn: ConnId, side: usize, corrupt: bool) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        let Some(mut frame) = c.queues[side].pop_front() else {
            return;
        };
        let to = c.ends[1 - side];
        if corrupt && frame.len() > 4 {
            // Any byte after the length prefix (a flipped length is a TCP
            // stream desync, which the heartbeat timeout ends).
            let i = 4 + self.rng.below(frame.len() as u64 - 4) as usize;
            frame[i] ^= 1 << self.rng.below(8);
            self.report.corruptions += 1;
            self.trace(|| format!("CORRUPT byte {i} of a frame on conn {conn}"));
        }
        match Message::decode(&frame) {
            Ok(Some((mut msg, _))) => {
                if let Some(t) = self.tamper.as_mut() {
                    if t(&mut msg) {
                        self.trace(|| format!("TAMPERED a {} on conn {conn}", msg.kind_name()));
                    }
                }
                self.receive(to, conn, msg)
            }
            // A frame that no longer parses: the receiver's transport
            // closes the connection (what the TCP driver does).
            _ => self.close_by(to, conn),
        }
        self.maybe_finish_close(conn);
    }

    fn trace(&self, what: impl FnOnce() -> String) {
        if self.cfg.trace {
            eprintln!("[{}] {}", self.report.steps, what());
        }
    }

    fn receive(&mut self, to: NodeId, conn: ConnId, msg: Message) {
        self.trace(|| {
            let mut m = format!("{msg:?}");
            m.truncate(160);
            format!("{to:?} <- conn {conn}: {m}")
        });
        match to {
            NodeId::Gateway => {
                let mut ga = Vec::new();
                self.gateway.message(conn, msg, &mut ga);
                self.gateway_actions(ga);
            }
            NodeId::Prefill => {
                let mut pa = Vec::new();
                self.prefill
                    .message(&mut self.prefill_pool, conn, msg, &mut pa);
                self.prefill_actions(pa);
            }
            NodeId::Decode => {
                let mut da = Vec::new();
                self.decode
                    .message(&mut self.decode_pool, conn, msg, &mut da);
                self.decode_actions(da);
            }
        }
    }

    // ---------------------------------------------------------- actions

    fn gateway_actions(&mut self, actions: Vec<GatewayAction>) {
        for a in actions {
            match a {
                GatewayAction::Send { conn, msg } => self.send(NodeId::Gateway, conn, &msg),
                GatewayAction::Close { conn } => self.close_by(NodeId::Gateway, conn),
                GatewayAction::Deliver { req, event } => self.client_event(req, event),
            }
        }
    }

    fn prefill_actions(&mut self, actions: Vec<PrefillAction>) {
        for a in actions {
            match a {
                PrefillAction::Send { conn, msg } => self.send(NodeId::Prefill, conn, &msg),
                PrefillAction::Close { conn } => self.close_by(NodeId::Prefill, conn),
                PrefillAction::Connect { addr } => self.dials.push_back(addr),
                PrefillAction::Compute(job) => {
                    self.jobs.insert(job.req, *job);
                }
                PrefillAction::StopCompute { req } => {
                    self.jobs.remove(&req);
                }
            }
        }
    }

    fn decode_actions(&mut self, actions: Vec<DecodeAction>) {
        for a in actions {
            match a {
                DecodeAction::Send { conn, msg } => self.send(NodeId::Decode, conn, &msg),
                DecodeAction::Close { conn } => self.close_by(NodeId::Decode, conn),
                DecodeAction::StartDecode(start) => self.start_decode(*start),
                DecodeAction::StopDecode { req } => {
                    self.decoding.remove(&req);
                }
            }
        }
    }

    fn client_event(&mut self, req: u64, event: ClientEvent) {
        self.trace(|| format!("client {req} <- {event:?}"));
        let Some(c) = self.clients.get_mut(&req) else {
            return;
        };
        assert!(
            c.end.is_none() && !c.cancelled,
            "request {req}: an event after its end or its cancel: {event:?}"
        );
        match event {
            ClientEvent::Token { id, .. } => {
                c.tokens.push(id);
                self.report.tokens_delivered += 1;
            }
            ClientEvent::Finished {
                completion_tokens, ..
            } => c.end = Some(Ok(completion_tokens)),
            ClientEvent::Error(e) => {
                self.report.error_codes.push(e.code.clone());
                c.status = Some(e.status);
                c.end = Some(Err(e.code));
            }
        }
    }

    // ---------------------------------------------------------- engines

    fn compute_one(&mut self) {
        let Some((&req, _)) = self
            .jobs
            .iter()
            .nth(self.rng.below(self.jobs.len() as u64) as usize)
        else {
            return;
        };
        let job = self.jobs.remove(&req).expect("picked");
        let ps = self.cfg.page_size as usize;
        let mut result = Ok(());
        for (pos, &t) in job.tokens.iter().enumerate() {
            result = result
                .and_then(|()| write_kv(&mut self.prefill_pool, &job.pages, job.owner, ps, pos, t));
        }
        let first = result.and_then(|()| {
            next_from_pool(
                &self.prefill_pool,
                &job.pages,
                job.owner,
                ps,
                job.tokens.len(),
            )
        });
        let mut pa = Vec::new();
        match first {
            Ok(t) => self
                .prefill
                .computed(&mut self.prefill_pool, req, t, None, 0, &mut pa),
            Err(e) => self.prefill.compute_failed(
                &mut self.prefill_pool,
                req,
                crate::refusal::internal(e.to_string()),
                &mut pa,
            ),
        }
        self.prefill_actions(pa);
    }

    fn start_decode(&mut self, s: DecodeStart) {
        let mut seq = s.tokens.clone();
        seq.push(s.first_token);
        self.send(
            NodeId::Decode,
            s.conn,
            &Message::Token {
                req: s.req,
                id: s.first_token,
                text: String::new(),
                logprobs: None,
            },
        );
        let d = Decoding {
            owner: s.owner,
            conn: s.conn,
            pages: s.pages,
            seq,
            generated: 1,
            max_tokens: s.max_tokens,
        };
        if d.generated >= d.max_tokens {
            let mut da = Vec::new();
            self.decode
                .decode_finished(&mut self.decode_pool, s.req, 1, 1, String::new(), &mut da);
            self.decode_actions(da);
        } else {
            self.decoding.insert(s.req, d);
        }
    }

    fn decode_one(&mut self) {
        let Some((&req, _)) = self
            .decoding
            .iter()
            .nth(self.rng.below(self.decoding.len() as u64) as usize)
        else {
            return;
        };
        let ps = self.cfg.page_size as usize;
        let d = self.decoding.get_mut(&req).expect("picked");
        let n = d.seq.len();
        let last = *d.seq.last().expect("non-empty");
        let next = write_kv(&mut self.decode_pool, &d.pages, d.owner, ps, n - 1, last)
            .and_then(|()| next_from_pool(&self.decode_pool, &d.pages, d.owner, ps, n));
        let mut da = Vec::new();
        match next {
            Ok(t) => {
                d.seq.push(t);
                d.generated += 1;
                let conn = d.conn;
                let done = d.generated >= d.max_tokens;
                let generated = d.generated;
                self.send(
                    NodeId::Decode,
                    conn,
                    &Message::Token {
                        req,
                        id: t,
                        text: String::new(),
                        logprobs: None,
                    },
                );
                if done {
                    self.decoding.remove(&req);
                    self.decode.decode_finished(
                        &mut self.decode_pool,
                        req,
                        1,
                        generated,
                        String::new(),
                        &mut da,
                    );
                }
            }
            Err(e) => {
                self.decoding.remove(&req);
                self.decode.decode_failed(
                    &mut self.decode_pool,
                    req,
                    crate::refusal::internal(e.to_string()),
                    &mut da,
                );
            }
        }
        self.decode_actions(da);
    }

    // ----------------------------------------------------------- faults

    fn crash(&mut self, node: NodeId) {
        self.trace(|| format!("CRASH {node:?}"));
        self.report.crashes += 1;
        let conns: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.ends.contains(&node))
            .map(|(&k, _)| k)
            .collect();
        match node {
            NodeId::Prefill => {
                self.prefill_up = false;
                self.jobs.clear();
                self.dials.clear();
            }
            NodeId::Decode => {
                let s = self.decode.stats();
                self.retired_checksum += s.checksum_failures_total;
                self.retired_fenced += s.pages_fenced_total;
                self.retired_late += s.pages_late_total;
                self.retired_cancels.0 += s.cancels_receiving_total;
                self.retired_cancels.1 += s.cancels_decoding_total;
                self.decode_up = false;
                self.decoding.clear();
            }
            NodeId::Gateway => unreachable!("the gateway does not crash in this simulation"),
        }
        // The peers see the connections drop; the crashed node sees nothing.
        for conn in conns {
            self.kill(conn);
        }
    }

    fn restart(&mut self, node: NodeId) {
        self.trace(|| format!("RESTART {node:?}"));
        let shape = *self.decode_pool.shape();
        match node {
            NodeId::Prefill => {
                self.prefill = Self::new_prefill(&self.cfg);
                self.prefill_pool =
                    Pool::new(shape, self.cfg.prefill_pages, PoolOptions::default()).expect("pool");
                self.prefill_up = true;
                self.gateway_dial(0);
            }
            NodeId::Decode => {
                self.decode = Self::new_decode(&self.cfg);
                self.decode_pool =
                    Pool::new(shape, self.cfg.decode_pages, PoolOptions::default()).expect("pool");
                self.decode_up = true;
                self.gateway_dial(1);
            }
            NodeId::Gateway => {}
        }
    }

    // -------------------------------------------------------- the loop

    fn submit_next(&mut self) {
        let req = self.next_req;
        let Some(c) = self.clients.get(&req) else {
            return;
        };
        self.next_req += 1;
        let (tenant, prompt, max_tokens) = (c.tenant, c.prompt.clone(), c.max_tokens);
        let mut ga = Vec::new();
        let r = self
            .gateway
            .submit(req, tenant, prompt, max_tokens, GenSpec::greedy(), &mut ga);
        self.gateway_actions(ga);
        if let Err(e) = r {
            self.client_event(req, ClientEvent::Error(e));
        }
    }

    fn in_flight(&self) -> Vec<u64> {
        self.clients
            .iter()
            .filter(|(&k, c)| k < self.next_req && c.end.is_none() && !c.cancelled)
            .map(|(&k, _)| k)
            .collect()
    }

    fn frames(&self) -> Vec<(ConnId, usize)> {
        let mut v = Vec::new();
        for (&id, c) in &self.conns {
            for side in 0..2 {
                if !c.queues[side].is_empty() {
                    v.push((id, side));
                }
            }
        }
        v
    }

    /// One step; `faults`: whether faults, submits and cancels may happen.
    fn step(&mut self, faults: bool) -> bool {
        let mut progressed = false;
        let cfg = self.cfg.clone();
        if faults {
            if self.next_req < 100 + cfg.requests as u64
                && self.gateway.ready()
                && self.rng.chance(150)
            {
                self.submit_next();
                progressed = true;
            }
            if self.report.cancelled < cfg.cancels_max && self.rng.chance(cfg.cancel_permille) {
                let live = self.in_flight();
                if !live.is_empty() {
                    let req = live[self.rng.below(live.len() as u64) as usize];
                    self.clients.get_mut(&req).expect("live").cancelled = true;
                    self.trace(|| format!("client {req} CANCELS"));
                    self.report.cancelled += 1;
                    let mut ga = Vec::new();
                    self.gateway.cancel(req, &mut ga);
                    self.gateway_actions(ga);
                    progressed = true;
                }
            }
            if self.report.kills < cfg.kills_max && self.rng.chance(cfg.kill_conn_permille) {
                let ids: Vec<ConnId> = self.conns.keys().copied().collect();
                if !ids.is_empty() {
                    let id = ids[self.rng.below(ids.len() as u64) as usize];
                    self.report.kills += 1;
                    self.kill(id);
                    progressed = true;
                }
            }
            if self.report.crashes < cfg.crashes_max && self.rng.chance(cfg.crash_permille) {
                let node = if self.rng.below(2) == 0 {
                    NodeId::Prefill
                } else {
                    NodeId::Decode
                };
                if self.up(node) {
                    self.crash(node);
                    progressed = true;
                }
            }
        }
        // Restarts and reconnects happen at a random later step.
        if !self.prefill_up && self.rng.chance(50) {
            self.restart(NodeId::Prefill);
            progressed = true;
        }
        if !self.decode_up && self.rng.chance(50) {
            self.restart(NodeId::Decode);
            progressed = true;
        }
        for which in 0..2 {
            if self.gw_links[which].is_none() && self.rng.chance(100) {
                self.gateway_dial(which);
                progressed = true;
            }
        }
        // The work: one of deliver / dial / compute / decode.
        let frames = self.frames();
        let choices = frames.len()
            + usize::from(!self.dials.is_empty())
            + usize::from(!self.jobs.is_empty())
            + usize::from(!self.decoding.is_empty());
        if choices == 0 {
            return progressed;
        }
        let mut pick = self.rng.below(choices as u64) as usize;
        if pick < frames.len() {
            let (conn, side) = frames[pick];
            let corrupt = faults
                && self.report.corruptions < cfg.corruptions_max
                && self.rng.chance(cfg.corrupt_permille);
            self.deliver(conn, side, corrupt);
            return true;
        }
        pick -= frames.len();
        if !self.dials.is_empty() {
            if pick == 0 {
                self.prefill_dial();
                return true;
            }
            pick -= 1;
        }
        if !self.jobs.is_empty() {
            if pick == 0 {
                self.compute_one();
                return true;
            }
            pick -= 1;
        }
        debug_assert_eq!(pick, 0);
        self.decode_one();
        true
    }

    /// Pool invariants on both nodes, and K4 across them (after every
    /// step): while prefill may still write a transfer's pages over a live
    /// link that decode has bound the request to, decode's pages for it are
    /// still that reservation (same epoch: never freed, never reallocated).
    /// A transfer on a link decode has not bound (it forgot the request:
    /// cancelled before it knew the link) can only reach pages through
    /// handles decode no longer honours: those pages are fenced (K2), which
    /// the content check covers.
    fn check_pools(&self) -> Result<(), String> {
        self.prefill_pool
            .check_invariants()
            .map_err(|e| format!("prefill pool: {e}"))?;
        self.decode_pool
            .check_invariants()
            .map_err(|e| format!("decode pool: {e}"))?;
        if !self.check_k4 || !self.decode_up || !self.prefill_up {
            return Ok(());
        }
        for (req, conn, dst) in self.prefill.sending() {
            let alive = conn
                .and_then(|c| self.conns.get(&c))
                .is_some_and(|c| c.closed == [false, false]);
            if !alive || self.decode.link_of(req) != conn {
                continue;
            }
            for p in dst {
                let epoch = self.decode_pool.epoch_of(p.index);
                if epoch != Some(p.epoch) {
                    return Err(format!(
                        "K4: prefill may still write page {} epoch {} of request {req}, but decode's \
                         page is at epoch {epoch:?} (freed or reallocated)",
                        p.index, p.epoch
                    ));
                }
            }
        }
        Ok(())
    }

    fn quiescent(&self) -> bool {
        self.next_req >= 100 + self.cfg.requests as u64
            && self.in_flight().is_empty()
            && self.frames().is_empty()
            && self.jobs.is_empty()
            && self.decoding.is_empty()
            && self.dials.is_empty()
            && self.prefill_up
            && self.decode_up
            && self.decode.requests() == 0
            && self.prefill.requests() == 0
            && self.gateway.requests() == 0
    }

    /// Runs to the end and checks everything; `Err` says what broke.
    pub fn run(mut self) -> Result<SimReport, String> {
        for i in 0..self.cfg.steps {
            self.step(true);
            self.check_pools().map_err(|e| format!("step {i}: {e}"))?;
            self.report.steps += 1;
        }
        // Submit whatever the fault phase did not, once a pair is up.
        let mut i = 0;
        while self.next_req < 100 + self.cfg.requests as u64 && i < self.cfg.drain_steps {
            if self.gateway.ready() {
                self.submit_next();
            } else {
                self.step(false);
                self.check_pools()
                    .map_err(|e| format!("drain step {i}: {e}"))?;
                i += 1;
            }
        }
        while !self.quiescent() {
            if i >= self.cfg.drain_steps {
                return Err(format!(
                    "not quiescent after {} drain steps: gateway {} requests, prefill {:?}, decode {:?}, \
                     frames {}, jobs {}, decoding {}, in flight {:?}",
                    i,
                    self.gateway.requests(),
                    self.prefill.request_phases().collect::<Vec<_>>(),
                    self.decode.request_phases().collect::<Vec<_>>(),
                    self.frames().len(),
                    self.jobs.len(),
                    self.decoding.len(),
                    self.in_flight()
                ));
            }
            self.step(false);
            self.check_pools()
                .map_err(|e| format!("drain step {i}: {e}"))?;
            self.report.steps += 1;
            i += 1;
        }
        self.finish_checks()
    }

    fn finish_checks(mut self) -> Result<SimReport, String> {
        for (pool, name) in [
            (&self.prefill_pool, "prefill"),
            (&self.decode_pool, "decode"),
        ] {
            let s = pool.stats();
            if s.pages_free != s.pages_total {
                return Err(format!(
                    "{name} pool: {} of {} pages free at the end (leaked)",
                    s.pages_free, s.pages_total
                ));
            }
            if s.refused_double_free > 0 {
                return Err(format!(
                    "{name} pool: {} double frees",
                    s.refused_double_free
                ));
            }
        }
        for (&req, c) in &self.clients {
            // Content: every delivered token is the reference's token at
            // that position (nothing another request wrote was read).
            if c.tokens.len() > c.expected.len() || c.tokens[..] != c.expected[..c.tokens.len()] {
                return Err(format!(
                    "request {req}: tokens {:?} are not a prefix of the reference {:?}",
                    c.tokens, c.expected
                ));
            }
            match &c.end {
                Some(Ok(n)) => {
                    self.report.finished += 1;
                    if *n as usize != c.tokens.len() || c.tokens != c.expected {
                        return Err(format!(
                            "request {req}: finished with {n} tokens {:?}, reference {:?}",
                            c.tokens, c.expected
                        ));
                    }
                }
                Some(Err(code)) => {
                    self.report.errors += 1;
                    // Tokens before an error only when decode itself was lost
                    // (or the link to it) after decoding began.
                    if !c.tokens.is_empty() && !matches!(code.as_str(), "decode_lost") {
                        return Err(format!(
                            "request {req}: error `{code}` after {} tokens",
                            c.tokens.len()
                        ));
                    }
                }
                None if c.cancelled => {}
                None => return Err(format!("request {req} never ended")),
            }
        }
        for (&req, c) in &self.clients {
            self.report.outcomes.push(Outcome {
                req,
                tenant: c.tenant,
                prompt: c.prompt.clone(),
                tokens: c.tokens.clone(),
                expected: c.expected.clone(),
                end: c.end.clone(),
                status: c.status,
                cancelled: c.cancelled,
            });
        }
        self.report.prefill_pool = self.prefill_pool.stats();
        self.report.decode_pool = self.decode_pool.stats();
        self.report.decode_stats = self.decode.stats();
        self.report.prefill_stats = self.prefill.stats();
        let s = self.decode.stats();
        self.report.checksum_failures = self.retired_checksum + s.checksum_failures_total;
        self.report.pages_fenced = self.retired_fenced + s.pages_fenced_total;
        self.report.pages_late = self.retired_late + s.pages_late_total;
        self.report.cancels_receiving = self.retired_cancels.0 + s.cancels_receiving_total;
        self.report.cancels_decoding = self.retired_cancels.1 + s.cancels_decoding_total;
        Ok(self.report)
    }
}
