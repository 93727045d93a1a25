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

// ------------------------------------------------------------- the model

/// Shape of the stand-in model's KV: layers × (1 head of `WIDTH`).
pub const LAYERS: usize = 2;
pub const WIDTH: usize = 4;
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

/// Hash of the rows of one (position, layer).
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

/// Prefill (or a decode step) of the stand-in: writes the rows of `token`
/// at `pos` through the pool.
pub fn write_kv(
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
pub fn next_from_pool(
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
                LayerView::F16 { .. } | LayerView::Q8_0 { .. } => {
                    unreachable!("the stand-in's pools are f32")
                }
            }
        }
    }
    Ok(token_of(sum))
}

/// The KV shape of the stand-in model with `page_size` slots per page.
pub fn shape(page_size: u32) -> kv::KvShape {
    kv::KvShape::new(LAYERS, 1, WIDTH, page_size as usize, kv::DType::F32)
        .expect("stand-in shape is valid")
}

/// A node identity for the stand-in model (every node shares the model
/// fingerprint and KV layout).
pub fn identity(node: &str, ps: u32, limit: u32) -> transfer::Identity {
    transfer::Identity {
        node: node.into(),
        fingerprint: [7; 32],
        layout: transfer::wire::KvLayout {
            page_size: ps,
            dtype: 0,
            layers: LAYERS as u32,
            kv_heads: 1,
            head_dim: WIDTH as u32,
        },
        max_request_tokens: limit,
    }
}

// ------------------------------------------------- the stand-in engines

/// Prefill's engine over the stand-in model: a job waits until the driver
/// runs it ([`World::compute`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StandInPrefill {
    pub pool: Pool,
    page_size: usize,
    pub jobs: BTreeMap<RequestId, ComputeJob>,
    reports: Vec<PrefillReport>,
}

impl StandInPrefill {
    pub fn new(pool: Pool, page_size: u32) -> StandInPrefill {
        StandInPrefill {
            pool,
            page_size: page_size as usize,
            jobs: BTreeMap::new(),
            reports: Vec::new(),
        }
    }

    /// Runs one job: writes the prompt's KV past its cached prefix, reads
    /// all of it back (cached pages included) for the first token.
    pub fn run(&mut self, req: RequestId) {
        let Some(job) = self.jobs.remove(&req) else {
            return;
        };
        let ps = self.page_size;
        let mut result = Ok(());
        let from = job.cached_tokens as usize;
        for (pos, &t) in job.tokens.iter().enumerate().skip(from) {
            result =
                result.and_then(|()| write_kv(&mut self.pool, &job.pages, job.owner, ps, pos, t));
        }
        let first = result
            .and_then(|()| next_from_pool(&self.pool, &job.pages, job.owner, ps, job.tokens.len()));
        self.reports.push(match first {
            Ok(t) => PrefillReport::Computed {
                req,
                first: t,
                logprobs: None,
                sampler_state: 0,
            },
            Err(e) => PrefillReport::Failed {
                req,
                error: transfer::refusal::internal(e.to_string()),
            },
        });
    }
}

/// The stand-in's parameter checks (the real engine checks far more; a
/// refusal here takes the same path through the glue).
fn stand_in_check(tokens: &[u32], max_tokens: u32) -> Result<(), Refusal> {
    if tokens.is_empty() || max_tokens == 0 {
        return Err(transfer::refusal::bad_request(
            "invalid_parameter",
            "the prompt and max_tokens must not be empty",
        ));
    }
    Ok(())
}

impl NodeEngine for StandInPrefill {
    fn pool(&mut self) -> &mut Pool {
        &mut self.pool
    }
    fn check(
        &mut self,
        _: TenantId,
        tokens: &[u32],
        max_tokens: u32,
        _: &GenSpec,
    ) -> Result<(), Refusal> {
        stand_in_check(tokens, max_tokens)
    }
    fn stop(&mut self, req: RequestId) {
        self.jobs.remove(&req);
    }
    fn running(&mut self) -> usize {
        self.jobs.len()
    }
}

impl PrefillEngine for StandInPrefill {
    fn compute(&mut self, job: ComputeJob) {
        self.jobs.insert(job.req, job);
    }
    fn take_reports(&mut self, out: &mut Vec<PrefillReport>) {
        out.append(&mut self.reports);
    }
}

/// What decode's stand-in engine saw when it started a request: the
/// world checks it against the client's prompt (K3/K10) and canaries (K7).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Start {
    pub req: RequestId,
    pub tokens: Vec<u32>,
    /// The next token read from the pages through the pool.
    pub read: Result<u32, String>,
    /// A page whose canary failed, if any.
    pub canary_failed: Option<u32>,
}

/// Decode's engine over the stand-in model: a request decodes one token
/// each time the driver steps it ([`World::decode_step`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StandInDecode {
    pub pool: Pool,
    page_size: usize,
    pub decoding: BTreeMap<RequestId, Decoding>,
    reports: Vec<DecodeReport>,
    /// Starts since the world last looked.
    pub starts: Vec<Start>,
}

impl StandInDecode {
    pub fn new(pool: Pool, page_size: u32) -> StandInDecode {
        StandInDecode {
            pool,
            page_size: page_size as usize,
            decoding: BTreeMap::new(),
            reports: Vec::new(),
            starts: Vec::new(),
        }
    }

    /// One decode step of one request.
    pub fn step(&mut self, req: RequestId) {
        let ps = self.page_size;
        let Some(d) = self.decoding.get_mut(&req) else {
            return;
        };
        let n = d.seq.len();
        let last = *d.seq.last().expect("non-empty");
        let next = write_kv(&mut self.pool, &d.pages, d.owner, ps, n - 1, last)
            .and_then(|()| next_from_pool(&self.pool, &d.pages, d.owner, ps, n));
        match next {
            Ok(t) => {
                d.seq.push(t);
                d.generated += 1;
                let conn = d.conn;
                let done = d.generated >= d.max_tokens;
                let generated = d.generated;
                self.reports.push(DecodeReport::Token {
                    req,
                    conn,
                    id: t,
                    text: String::new(),
                    logprobs: None,
                });
                if done {
                    self.decoding.remove(&req);
                    self.reports.push(DecodeReport::Finished {
                        req,
                        finish: 1,
                        completion_tokens: generated,
                        tail_text: String::new(),
                    });
                }
            }
            Err(e) => {
                self.decoding.remove(&req);
                self.reports.push(DecodeReport::Failed {
                    req,
                    error: transfer::refusal::internal(e.to_string()),
                });
            }
        }
    }
}

impl NodeEngine for StandInDecode {
    fn pool(&mut self) -> &mut Pool {
        &mut self.pool
    }
    fn check(
        &mut self,
        _: TenantId,
        tokens: &[u32],
        max_tokens: u32,
        _: &GenSpec,
    ) -> Result<(), Refusal> {
        stand_in_check(tokens, max_tokens)
    }
    fn stop(&mut self, req: RequestId) {
        self.decoding.remove(&req);
    }
    fn running(&mut self) -> usize {
        self.decoding.len()
    }
}

impl DecodeEngine for StandInDecode {
    fn start_decode(&mut self, s: DecodeStart) -> Result<(), Refusal> {
        let ps = self.page_size;
        self.starts.push(Start {
            req: s.req,
            tokens: s.tokens.clone(),
            read: next_from_pool(&self.pool, &s.pages, s.owner, ps, s.tokens.len())
                .map_err(|e| e.to_string()),
            canary_failed: s
                .pages
                .iter()
                .find(|&&h| self.pool.check_canary(h, s.owner).is_err())
                .map(|h| h.index),
        });
        let mut seq = s.tokens.clone();
        seq.push(s.first_token);
        self.reports.push(DecodeReport::Token {
            req: s.req,
            conn: s.conn,
            id: s.first_token,
            text: String::new(),
            logprobs: None,
        });
        if s.max_tokens <= 1 {
            self.reports.push(DecodeReport::Finished {
                req: s.req,
                finish: 1,
                completion_tokens: 1,
                tail_text: String::new(),
            });
        } else {
            self.decoding.insert(
                s.req,
                Decoding {
                    owner: s.owner,
                    conn: s.conn,
                    pages: s.pages,
                    seq,
                    generated: 1,
                    max_tokens: s.max_tokens,
                },
            );
        }
        Ok(())
    }
    fn take_reports(&mut self, out: &mut Vec<DecodeReport>) {
        out.append(&mut self.reports);
    }
}

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

    // ---------------------------------------------------------- checks

    /// After every event: what an event saw go wrong, the pools' own
    /// invariants (K1, K2, K4, K5 as state: the free list is a set, no
    /// double free), ownership across requests (K1), K9 for requests that
    /// ended, and K4 across nodes.
    pub fn check_step(&self) -> Result<(), String> {
        if let Some(v) = self.violations.first() {
            return Err(v.clone());
        }
        self.check_pools()?;
        self.check_ownership()?;
        self.check_refusals()?;
        self.check_k4_across()?;
        self.check_engines()
    }

    /// No engine runs a request that the machines have ended: every
    /// request in decode's batch is one decode's machine still holds, and
    /// every prompt prefill's engine computes is one prefill's machine
    /// still holds. (A machine that ends a request frees its pages; an
    /// engine still running it would read and write pages that are no
    /// longer its own.)
    pub fn check_engines(&self) -> Result<(), String> {
        if self.decode_up {
            if let Some(req) = self
                .decode
                .engine
                .decoding
                .keys()
                .find(|&&r| self.decode.machine.phase_of(r).is_none())
            {
                return Err(format!(
                    "engines: decode's engine runs request {req}, which decode's machine has ended"
                ));
            }
        }
        if self.prefill_up {
            if let Some(req) = self
                .prefill
                .engine
                .jobs
                .keys()
                .find(|&&r| self.prefill.machine.phase_of(r).is_none())
            {
                return Err(format!(
                    "engines: prefill's engine computes request {req}, which prefill's machine \
                     has ended"
                ));
            }
        }
        Ok(())
    }

    /// Each live node's pool is consistent (the free list is a set of
    /// exactly the unallocated pages; lease counts match) and refused no
    /// double free (K5).
    pub fn check_pools(&self) -> Result<(), String> {
        for (pool, name, up) in [
            (&self.prefill.engine.pool, "prefill", self.prefill_up),
            (&self.decode.engine.pool, "decode", self.decode_up),
        ] {
            if !up {
                continue;
            }
            pool.check_invariants()
                .map_err(|e| format!("{name} pool: {e}"))?;
            let s = pool.stats();
            if s.refused_double_free > 0 {
                return Err(format!(
                    "K5: {name} pool refused {} double frees",
                    s.refused_double_free
                ));
            }
            // K11: the machines never write, free or over-release a cached
            // page, read one outside its scope, or publish an unwritten one.
            for (what, n) in [
                ("writes or frees of a cached page", s.refused_shared_write),
                (
                    "reads of a cached page outside its scope",
                    s.refused_foreign_scope,
                ),
                (
                    "releases of an unreferenced cached page",
                    s.refused_ref_underflow,
                ),
                (
                    "publishes of an unpublishable page",
                    s.refused_unpublishable,
                ),
            ] {
                if n > 0 {
                    return Err(format!("K11: {name} pool refused {n} {what}"));
                }
            }
        }
        Ok(())
    }

    /// K1: every page a request holds is allocated to that request (same
    /// epoch, same owner), and no private page is held by two requests;
    /// K11: a cached page a request holds is cached in its tenant's scope
    /// (these clients carry no cache salt).
    pub fn check_ownership(&self) -> Result<(), String> {
        use transfer::decode::DecodePhase;
        type Holding = (RequestId, Owner, Vec<PageRef>, Vec<bool>);
        let check = |pool: &Pool, name: &str, holdings: Vec<Holding>| {
            let mut seen = BTreeSet::new();
            for (req, owner, pages, shared) in holdings {
                let tenant = self
                    .clients
                    .get(&req)
                    .map_or(owner.tenant, |c| c.spec.tenant);
                for (i, h) in pages.into_iter().enumerate() {
                    let cached = shared.get(i).copied().unwrap_or(false);
                    let expected = match cached {
                        true => Owner::cached(Scope::tenant(tenant)),
                        false => owner,
                    };
                    if !cached && !seen.insert(h.index) {
                        return Err(format!(
                            "K1: {name} page {} is held by two requests",
                            h.index
                        ));
                    }
                    if cached
                        && pool.epoch_of(h.index) == Some(h.epoch)
                        && pool.owner_of(h.index) != Some(expected)
                    {
                        return Err(format!(
                            "K11: {name} request {req} (tenant {}) holds cached page {} of {:?}, \
                             not of its tenant's scope",
                            tenant.0,
                            h.index,
                            pool.owner_of(h.index).map(|o| o.scope)
                        ));
                    }
                    if pool.epoch_of(h.index) != Some(h.epoch)
                        || pool.owner_of(h.index) != Some(expected)
                    {
                        return Err(format!(
                            "K1: {name} request {req} holds page {} epoch {}, which is at epoch {:?} \
                             owned by {:?}",
                            h.index,
                            h.epoch,
                            pool.epoch_of(h.index),
                            pool.owner_of(h.index)
                        ));
                    }
                }
            }
            Ok(())
        };
        if self.decode_up {
            let holdings = self
                .decode
                .machine
                .request_phases()
                .filter(|(_, p)| matches!(p, DecodePhase::Receiving | DecodePhase::Decoding))
                .filter_map(|(req, _)| {
                    Some((
                        req,
                        self.decode.machine.owner_of(req)?,
                        self.decode.machine.pages_of(req)?.to_vec(),
                        Vec::new(),
                    ))
                })
                .collect();
            check(&self.decode.engine.pool, "decode", holdings)?;
        }
        if self.prefill_up {
            let holdings = self
                .prefill
                .machine
                .holdings()
                .map(|(req, owner, pages, shared)| (req, owner, pages.to_vec(), shared.to_vec()))
                .collect();
            check(&self.prefill.engine.pool, "prefill", holdings)?;
        }
        Ok(())
    }

    /// K9: a request over a node's limit ends with that refusal and no
    /// tokens (or with the loss of a node that had not refused it yet); a
    /// request within every limit is never refused as too long.
    pub fn check_refusals(&self) -> Result<(), String> {
        for (&req, c) in &self.clients {
            if !c.oversize {
                if matches!(&c.end, Some(Err(code)) if code == "context_length_exceeded") {
                    return Err(format!(
                        "K9: request {req} fits every limit ({} + {} tokens) but was refused as \
                         too long",
                        c.spec.prompt.len(),
                        c.spec.max_tokens
                    ));
                }
                continue;
            }
            let fine = match &c.end {
                None => c.tokens.is_empty(),
                Some(Ok(_)) => false,
                Some(Err(code)) => {
                    c.tokens.is_empty() && CODES_OF_AN_OVERSIZE_REQUEST.contains(&code.as_str())
                }
            };
            if !fine {
                return Err(format!(
                    "K9: request {req} exceeds a node's limit ({} + {} tokens) but ended with {:?} \
                     after {} tokens, not `context_length_exceeded`",
                    c.spec.prompt.len(),
                    c.spec.max_tokens,
                    c.end,
                    c.tokens.len()
                ));
            }
        }
        Ok(())
    }

    /// K4 across nodes: while prefill may still write a transfer's pages
    /// over a live link that decode has bound the request to, decode's own
    /// reservation for the prompt is intact (same epoch: never freed, never
    /// reallocated). A transfer on a link decode has not bound (it forgot
    /// the request: cancelled before it knew the link) can only reach pages
    /// through handles decode no longer honours, and a page naming any
    /// other handle (a stale writer) is fenced: the K2 event check and the
    /// content check cover those.
    pub fn check_k4_across(&self) -> Result<(), String> {
        if !self.check_k4 || !self.decode_up || !self.prefill_up {
            return Ok(());
        }
        for (req, conn, dst) in self.prefill.machine.sending() {
            let alive = conn
                .and_then(|c| self.conns.get(&c))
                .is_some_and(|c| c.closed == [false, false]);
            if !alive || self.decode.machine.link_of(req) != conn {
                continue;
            }
            let Some(pages) = self.decode.machine.pages_of(req) else {
                continue;
            };
            for h in pages.iter().take(dst.len()) {
                let epoch = self.decode.engine.pool.epoch_of(h.index);
                if epoch != Some(h.epoch) {
                    return Err(format!(
                        "K4: prefill may still write request {req}'s prompt, but decode's page {} \
                         of it went from epoch {} to {epoch:?} (freed or reallocated)",
                        h.index, h.epoch
                    ));
                }
            }
        }
        Ok(())
    }

    /// Nothing left to do: every request ended, no frame in flight, no
    /// work queued, both nodes up and holding nothing.
    pub fn quiescent(&self) -> bool {
        self.clients_done()
            && self.frames().is_empty()
            && self.prefill.engine.jobs.is_empty()
            && self.decode.engine.decoding.is_empty()
            && self.dials.is_empty()
            && self.prefill_up
            && self.decode_up
            && self.decode.machine.requests() == 0
            && self.prefill.machine.requests() == 0
            && self.gateway.requests() == 0
    }

    /// No page of a live node is held: every page free or cached with no
    /// reference (evictable), none leased.
    pub fn pools_free(&self) -> Result<(), String> {
        for (pool, name, up) in [
            (&self.prefill.engine.pool, "prefill", self.prefill_up),
            (&self.decode.engine.pool, "decode", self.decode_up),
        ] {
            let s = pool.stats();
            if up
                && (s.pages_free + s.pages_evictable != s.pages_total
                    || s.pages_evictable != s.pages_cached
                    || s.pages_leased != 0)
            {
                return Err(format!(
                    "{name} pool: {} of {} pages free, {} of {} cached ones evictable, {} leased, \
                     with every request ended (leaked)",
                    s.pages_free, s.pages_total, s.pages_evictable, s.pages_cached, s.pages_leased
                ));
            }
        }
        Ok(())
    }

    /// At the end: pools free, and every request's content and ending
    /// right. Returns the outcomes.
    pub fn check_end(&self) -> Result<Vec<Outcome>, String> {
        self.check_step()?;
        self.pools_free()?;
        let mut out = Vec::new();
        for (&req, c) in &self.clients {
            if c.tokens.len() > c.expected.len() || c.tokens[..] != c.expected[..c.tokens.len()] {
                return Err(format!(
                    "request {req}: tokens {:?} are not a prefix of the reference {:?}",
                    c.tokens, c.expected
                ));
            }
            match &c.end {
                Some(Ok(n)) => {
                    if *n as usize != c.tokens.len() || c.tokens != c.expected {
                        return Err(format!(
                            "request {req}: finished with {n} tokens {:?}, reference {:?}",
                            c.tokens, c.expected
                        ));
                    }
                }
                Some(Err(code)) => {
                    // Tokens before an error only when decode itself was lost
                    // (or the link to it) after decoding began — or on an
                    // adversarial network, where a duplicated or reordered
                    // frame can end a streaming request (the gateway detects
                    // a skipped or repeated token): the tokens delivered are
                    // still a prefix of the reference (checked above).
                    let beyond_tcp =
                        self.counters.reorders + self.counters.drops + self.counters.duplicates > 0;
                    let may_follow_tokens = code == "decode_lost" || beyond_tcp;
                    if !c.tokens.is_empty() && !may_follow_tokens {
                        return Err(format!(
                            "request {req}: error `{code}` after {} tokens",
                            c.tokens.len()
                        ));
                    }
                }
                None if c.cancelled => {}
                None => return Err(format!("request {req} never ended")),
            }
            // Without any fault, every request within the limits completes.
            if self.fault_free() && !c.oversize && !matches!(c.end, Some(Ok(_))) {
                return Err(format!(
                    "request {req}: ended with {:?} although nothing went wrong",
                    c.end
                ));
            }
            out.push(Outcome {
                req,
                tenant: c.spec.tenant,
                prompt: c.spec.prompt.clone(),
                tokens: c.tokens.clone(),
                expected: c.expected.clone(),
                end: c.end.clone(),
                status: c.status,
                cancelled: c.cancelled,
            });
        }
        Ok(out)
    }

    /// No fault of any kind happened (no cancel either).
    pub fn fault_free(&self) -> bool {
        let c = &self.counters;
        c.cancels
            + c.kills
            + c.crashes
            + c.corruptions
            + c.drops
            + c.duplicates
            + c.reorders
            + c.stale_writes
            + c.tampered
            == 0
    }

    /// One line per request, for traces.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        for (&req, c) in &self.clients {
            let state = if req >= self.next_req {
                "not sent".to_string()
            } else if c.cancelled {
                "cancelled".to_string()
            } else {
                match &c.end {
                    None => "running".to_string(),
                    Some(Ok(n)) => format!("finished ({n} tokens)"),
                    Some(Err(code)) => format!("error `{code}`"),
                }
            };
            s += &format!(
                "req {req} (tenant {}): {state}, tokens {:?}; gateway {:?}, prefill {:?}, decode {:?}\n",
                c.spec.tenant,
                c.tokens,
                self.gateway.phase_of(req),
                self.prefill.machine.phase_of(req).filter(|_| self.prefill_up),
                self.decode.machine.phase_of(req).filter(|_| self.decode_up),
            );
        }
        let p = self.prefill.engine.pool.stats();
        let d = self.decode.engine.pool.stats();
        s += &format!(
            "prefill {} pool {}/{} free {} leased; decode {} pool {}/{} free {} leased; {} frames in flight",
            if self.prefill_up { "up" } else { "DOWN" },
            p.pages_free,
            p.pages_total,
            p.pages_leased,
            if self.decode_up { "up" } else { "DOWN" },
            d.pages_free,
            d.pages_total,
            d.pages_leased,
            self.frames().iter().map(|f| f.2).sum::<usize>()
        );
        s
    }
}
