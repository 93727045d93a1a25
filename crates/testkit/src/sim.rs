//! Deterministic simulation of the whole PD stack: a [`World`] (the
//! production state machines, real pools, the stand-in model) driven by
//! one seeded random number generator and a simulated clock. Each step
//! picks one event — a frame delivered, an engine step, a dial — and, while
//! faults are on, maybe a client's submit or cancel, a corrupted frame, a
//! killed connection, a node crash, a network partition. Links have
//! latency jitter; a partition holds frames until it heals, or past the
//! heartbeat timeout ends the connections across it, as the TCP transport
//! does: one end gives up first, the other at a random later step unless
//! the close reaches it before (each end runs its own timer). Every invariant of [`World::check_step`] is asserted after every
//! step; at the end, pools must be free and every token must be the
//! reference's. A seed replays exactly (`SimConfig::trace` prints it).
//!
//! ```
//! use testkit::sim::{Sim, SimConfig};
//! let report = Sim::new(7, SimConfig::default()).run().expect("invariants hold");
//! assert!(report.finished > 0);
//! ```

use std::collections::BTreeMap;

use kv::TenantId;

pub use crate::world::{reference_next, reference_tokens, Outcome, VOCAB};
use crate::world::{ClientSpec, Node, World, WorldParams};
use transfer::decode::DecodeNode;
use transfer::gateway::Gateway;
use transfer::prefill::PrefillNode;
use transfer::wire::Message;
use transfer::ConnId;

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
    /// Sizes and limits of the nodes.
    pub world: WorldParams,
    /// Faults (per-mille chance per step, and how many at most).
    pub cancel_permille: u32,
    pub cancels_max: usize,
    pub corrupt_permille: u32,
    pub corruptions_max: usize,
    pub kill_conn_permille: u32,
    pub kills_max: usize,
    pub crash_permille: u32,
    pub crashes_max: usize,
    /// Latency jitter: after a frame is delivered, the next one in that
    /// direction waits up to this many steps (order within a connection
    /// is kept, as TCP keeps it).
    pub delay_steps_max: u64,
    /// Partitions between two nodes: frames across are held until it
    /// heals; one lasting `heartbeat_timeout_steps` ends the connections
    /// across it (the transport's heartbeat timeout).
    pub partition_permille: u32,
    pub partitions_max: usize,
    pub partition_steps_max: u64,
    pub heartbeat_timeout_steps: u64,
    /// Beyond TCP (an adversarial network): deliver a frame out of order,
    /// lose one on a live connection, deliver one twice. With any of them
    /// on, requests may hang forever, so a run checks safety (every
    /// invariant after every step, content, no double free) but not that
    /// it drains.
    pub reorder_permille: u32,
    pub drop_permille: u32,
    pub duplicate_permille: u32,
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
            world: WorldParams::default(),
            cancel_permille: 20,
            cancels_max: 2,
            corrupt_permille: 5,
            corruptions_max: 1,
            kill_conn_permille: 3,
            kills_max: 1,
            crash_permille: 2,
            crashes_max: 1,
            delay_steps_max: 3,
            partition_permille: 2,
            partitions_max: 1,
            partition_steps_max: 60,
            heartbeat_timeout_steps: 40,
            reorder_permille: 0,
            drop_permille: 0,
            duplicate_permille: 0,
            steps: 3000,
            drain_steps: 20_000,
            trace: false,
        }
    }
}

impl SimConfig {
    /// The default sizes without any fault (latency jitter stays).
    pub fn quiet() -> SimConfig {
        SimConfig {
            cancel_permille: 0,
            corrupt_permille: 0,
            kill_conn_permille: 0,
            crash_permille: 0,
            partition_permille: 0,
            ..SimConfig::default()
        }
    }

    /// The network is one TCP could be (no reordering, loss or
    /// duplication within a live connection).
    pub fn tcp_like(&self) -> bool {
        self.reorder_permille == 0 && self.drop_permille == 0 && self.duplicate_permille == 0
    }

    /// The fault knobs of an adversarial network on top of these.
    pub fn adversarial(self) -> SimConfig {
        SimConfig {
            reorder_permille: 30,
            drop_permille: 5,
            duplicate_permille: 5,
            ..self
        }
    }
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
    pub partitions: usize,
    /// Connections the heartbeat timeout ended during partitions.
    pub partition_timeouts: usize,
    pub reorders: usize,
    pub drops: usize,
    pub duplicates: usize,
    /// The run drained (always true on a TCP-like network).
    pub drained: bool,
    /// Checksum failures seen by decode (all instances).
    pub checksum_failures: u64,
    pub pages_fenced: u64,
    pub pages_late: u64,
    /// Cancels by the phase decode had the request in.
    pub cancels_receiving: u64,
    pub cancels_decoding: u64,
    /// Error codes clients got, in request order.
    pub error_codes: Vec<String>,
    pub outcomes: Vec<Outcome>,
    /// Pool counters at the end (of the current node instances).
    pub prefill_pool: kv::PoolStats,
    pub decode_pool: kv::PoolStats,
    /// Prompt pages prefill took from its prefix cache (current instance).
    pub cache_hit_pages: u64,
    pub decode_stats: transfer::decode::DecodeStats,
    pub prefill_stats: transfer::prefill::PrefillStats,
}

/// Rewrites a message in flight (tests of faulty senders and of corruption
/// the frame check does not cover); returns whether it changed it.
pub type Tamper = Box<dyn FnMut(&mut Message) -> bool>;

/// A partition between two nodes.
#[derive(Clone, Copy, Debug)]
struct Partition {
    between: [Node; 2],
    since: u64,
    until: u64,
}

/// One simulation run.
pub struct Sim {
    cfg: SimConfig,
    rng: SimRng,
    world: World,
    tamper: Option<Tamper>,
    /// The simulated clock, in steps.
    now: u64,
    /// When the next frame of (connection, direction) may be delivered.
    ready_at: BTreeMap<(ConnId, usize), u64>,
    partition: Option<Partition>,
    /// Connections one end has timed out: (conn, the other end, the step
    /// its own timer gives up).
    late_timeouts: Vec<(ConnId, Node, u64)>,
    report: SimReport,
}

/// Prompt openings several simulated clients share (a page and a half at
/// the default 4 slots a page).
const SHARED_PREFIXES: [&[u32]; 2] = [
    &[901, 902, 903, 904, 905, 906],
    &[911, 912, 913, 914, 915, 916],
];

impl Sim {
    pub fn new(seed: u64, cfg: SimConfig) -> Sim {
        let mut rng = SimRng::new(seed);
        let clients = (0..cfg.requests)
            .map(|_| {
                let tenant = TenantId(1 + rng.below(cfg.tenants));
                let len = 1 + rng.below(cfg.prompt_tokens_max as u64) as usize;
                // Half the prompts open with one of two shared "system
                // prompts" (any tenant may send either), so the prefix
                // cache is hit within a tenant and must not be across.
                let shared = match rng.below(4) {
                    0 => SHARED_PREFIXES[0],
                    1 => SHARED_PREFIXES[1],
                    _ => &[],
                };
                let mut prompt: Vec<u32> = shared.iter().copied().take(len).collect();
                while prompt.len() < len {
                    prompt.push(rng.below(VOCAB as u64) as u32);
                }
                let max_tokens = 1 + rng.below(cfg.max_tokens_max as u64) as u32;
                ClientSpec::new(tenant, prompt, max_tokens)
            })
            .collect();
        Self::build(rng, cfg, clients)
    }

    /// A run over the given requests `(tenant, prompt, max_tokens)`, in
    /// order, instead of random ones.
    pub fn scripted(seed: u64, cfg: SimConfig, requests: &[(TenantId, Vec<u32>, u32)]) -> Sim {
        let clients = requests
            .iter()
            .map(|(t, p, m)| ClientSpec::new(*t, p.clone(), *m))
            .collect();
        let cfg = SimConfig {
            requests: requests.len(),
            ..cfg
        };
        Self::build(SimRng::new(seed), cfg, clients)
    }

    fn build(rng: SimRng, cfg: SimConfig, clients: Vec<ClientSpec>) -> Sim {
        let mut world = World::new(cfg.world.clone(), clients);
        world.set_trace(cfg.trace);
        Sim {
            cfg,
            rng,
            world,
            tamper: None,
            now: 0,
            ready_at: BTreeMap::new(),
            partition: None,
            late_timeouts: Vec::new(),
            report: SimReport::default(),
        }
    }

    /// Mutable access for tests that set mutations or inspect state.
    pub fn decode_mut(&mut self) -> &mut DecodeNode {
        &mut self.world.decode.machine
    }
    /// The decode node's glue (for its test-only mutations).
    pub fn decode_glue_mut(&mut self) -> &mut transfer::node::Decode<crate::world::StandInDecode> {
        &mut self.world.decode
    }
    pub fn gateway_mut(&mut self) -> &mut Gateway {
        &mut self.world.gateway
    }
    pub fn prefill_mut(&mut self) -> &mut PrefillNode {
        &mut self.world.prefill.machine
    }
    pub fn decode_pool_mut(&mut self) -> &mut kv::Pool {
        &mut self.world.decode.engine.pool
    }
    pub fn prefill_pool_mut(&mut self) -> &mut kv::Pool {
        &mut self.world.prefill.engine.pool
    }
    pub fn set_tamper(&mut self, t: Tamper) {
        self.tamper = Some(t);
    }
    /// Switch the cross-node K4 check off (to let a mutation run on and
    /// show its consequences further down).
    pub fn set_check_k4(&mut self, on: bool) {
        self.world.set_check_k4(on);
    }

    fn trace(&self, what: impl FnOnce() -> String) {
        if self.cfg.trace {
            eprintln!("[t={}] {}", self.now, what());
        }
    }

    /// Whether a partition holds frames of `conn` now.
    fn held(&self, conn: ConnId) -> bool {
        let (Some(p), Some(ends)) = (self.partition, self.world.conn_ends(conn)) else {
            return false;
        };
        p.between.contains(&ends[0]) && p.between.contains(&ends[1])
    }

    fn deliverable(&self) -> Vec<(ConnId, usize, usize)> {
        self.world
            .frames()
            .into_iter()
            .filter(|&(conn, side, _)| {
                !self.held(conn)
                    && self
                        .ready_at
                        .get(&(conn, side))
                        .is_none_or(|&t| t <= self.now)
            })
            .collect()
    }

    fn faults(&mut self) -> bool {
        let cfg = self.cfg.clone();
        let mut progressed = false;
        if self.world.next_client().is_some() && self.world.gateway.ready() && self.rng.chance(150)
        {
            self.world.submit_next();
            progressed = true;
        }
        if self.report.cancelled < cfg.cancels_max && self.rng.chance(cfg.cancel_permille) {
            let live = self.world.in_flight();
            if !live.is_empty() {
                let req = live[self.rng.below(live.len() as u64) as usize];
                self.report.cancelled += 1;
                self.world.cancel(req);
                progressed = true;
            }
        }
        if self.report.kills < cfg.kills_max && self.rng.chance(cfg.kill_conn_permille) {
            let ids = self.world.conn_ids();
            if !ids.is_empty() {
                let id = ids[self.rng.below(ids.len() as u64) as usize];
                self.report.kills += 1;
                self.world.kill(id);
                progressed = true;
            }
        }
        if self.report.crashes < cfg.crashes_max && self.rng.chance(cfg.crash_permille) {
            let node = if self.rng.below(2) == 0 {
                Node::Prefill
            } else {
                Node::Decode
            };
            if self.world.up(node) {
                self.report.crashes += 1;
                self.world.crash(node);
                progressed = true;
            }
        }
        if self.partition.is_none()
            && self.report.partitions < cfg.partitions_max
            && self.rng.chance(cfg.partition_permille)
        {
            let pairs = [
                [Node::Gateway, Node::Prefill],
                [Node::Gateway, Node::Decode],
                [Node::Prefill, Node::Decode],
            ];
            let between = pairs[self.rng.below(3) as usize];
            let until = self.now + 1 + self.rng.below(cfg.partition_steps_max.max(1));
            self.trace(|| format!("PARTITION {between:?} until t={until}"));
            self.partition = Some(Partition {
                between,
                since: self.now,
                until,
            });
            self.report.partitions += 1;
            progressed = true;
        }
        // Beyond TCP.
        let frames = self.world.frames();
        if !frames.is_empty() && self.rng.chance(cfg.drop_permille) {
            let (conn, side, n) = frames[self.rng.below(frames.len() as u64) as usize];
            self.world
                .drop_frame(conn, side, self.rng.below(n as u64) as usize);
            self.report.drops += 1;
            progressed = true;
        }
        if !frames.is_empty() && self.rng.chance(cfg.duplicate_permille) {
            let (conn, side, n) = frames[self.rng.below(frames.len() as u64) as usize];
            self.world
                .duplicate_frame(conn, side, self.rng.below(n as u64) as usize);
            self.report.duplicates += 1;
            progressed = true;
        }
        progressed
    }

    /// Partitions heal, or end their connections at the heartbeat timeout.
    fn partitions(&mut self) {
        let now = self.now;
        let due: Vec<(ConnId, Node)> = self
            .late_timeouts
            .iter()
            .filter(|l| l.2 <= now)
            .map(|l| (l.0, l.1))
            .collect();
        self.late_timeouts.retain(|l| l.2 > now);
        for (conn, node) in due {
            // A no-op if the close reached `node` first.
            self.world.time_out(node, conn);
        }
        let Some(p) = self.partition else {
            return;
        };
        if self.now >= p.since + self.cfg.heartbeat_timeout_steps {
            for conn in self.world.conn_ids() {
                if self.held(conn) && !self.late_timeouts.iter().any(|l| l.0 == conn) {
                    let Some(ends) = self.world.conn_ends(conn) else {
                        continue;
                    };
                    let first = self.rng.below(2) as usize;
                    let at = self.now + 1 + self.rng.below(self.cfg.heartbeat_timeout_steps);
                    self.trace(|| format!("heartbeat timeout: {:?} ends conn {conn}", ends[first]));
                    self.report.partition_timeouts += 1;
                    self.world.time_out(ends[first], conn);
                    self.late_timeouts.push((conn, ends[1 - first], at));
                }
            }
        }
        if self.now >= p.until {
            self.trace(|| format!("partition {:?} heals", p.between));
            self.partition = None;
        }
    }

    /// One step; `faults`: whether faults, submits and cancels may happen.
    fn step(&mut self, faults: bool) -> bool {
        self.now += 1;
        let mut progressed = faults && self.faults();
        self.partitions();
        // Restarts and reconnects happen at a random later step.
        for node in [Node::Prefill, Node::Decode] {
            if !self.world.up(node) && self.rng.chance(50) {
                self.world.restart(node);
                progressed = true;
            }
        }
        for which in 0..2 {
            if self.world.gateway_link_missing(which) && self.rng.chance(100) {
                self.world.gateway_dial(which);
                progressed = true;
            }
        }
        // The work: one of deliver / dial / compute / decode.
        let frames = self.deliverable();
        let jobs = self.world.jobs();
        let decoding = self.world.decoding();
        let dials = usize::from(self.world.has_dials());
        let choices = frames.len() + dials + jobs.len().min(1) + decoding.len().min(1);
        if choices == 0 {
            // Waiting for a delay or a partition to pass is progress too.
            return progressed || self.partition.is_some() || !self.world.frames().is_empty();
        }
        let pick = self.rng.below(choices as u64) as usize;
        if pick < frames.len() {
            let (conn, side, n) = frames[pick];
            let corrupt = (faults
                && self.report.corruptions < self.cfg.corruptions_max
                && self.rng.chance(self.cfg.corrupt_permille))
            .then(|| (self.rng.next_u64(), self.rng.next_u64()));
            self.report.corruptions += usize::from(corrupt.is_some());
            let index = if faults && n > 1 && self.rng.chance(self.cfg.reorder_permille) {
                self.report.reorders += 1;
                1 + self.rng.below(n as u64 - 1) as usize
            } else {
                0
            };
            let delay = self.rng.below(self.cfg.delay_steps_max + 1);
            self.ready_at.insert((conn, side), self.now + delay);
            let tamper = self
                .tamper
                .as_mut()
                .map(|t| &mut **t as &mut dyn FnMut(&mut Message) -> bool);
            self.world.deliver(conn, side, index, corrupt, tamper);
        } else if pick < frames.len() + dials {
            self.world.prefill_dial();
        } else if pick < frames.len() + dials + jobs.len().min(1) {
            let req = jobs[self.rng.below(jobs.len() as u64) as usize];
            self.world.compute(req);
        } else {
            let req = decoding[self.rng.below(decoding.len() as u64) as usize];
            self.world.decode_step(req);
        }
        true
    }

    /// Runs to the end and checks everything; `Err` says what broke.
    pub fn run(mut self) -> Result<SimReport, String> {
        for i in 0..self.cfg.steps {
            self.step(true);
            self.world
                .check_step()
                .map_err(|e| format!("step {i}: {e}"))?;
            self.report.steps += 1;
        }
        // Submit whatever the fault phase did not, once a pair is up, then
        // drain without faults.
        let mut i = 0;
        while !self.world.quiescent() && i < self.cfg.drain_steps {
            if self.world.next_client().is_some() && self.world.gateway.ready() {
                self.world.submit_next();
            } else {
                self.step(false);
            }
            self.world
                .check_step()
                .map_err(|e| format!("drain step {i}: {e}"))?;
            self.report.steps += 1;
            i += 1;
        }
        self.report.drained = self.world.quiescent();
        if !self.report.drained {
            if self.cfg.tcp_like() {
                return Err(format!(
                    "not quiescent after {i} drain steps: {}",
                    self.world.summary()
                ));
            }
            // An adversarial network may hang requests forever: safety
            // only (every step was checked).
            return Ok(self.finish(Vec::new()));
        }
        let outcomes = self.world.check_end()?;
        Ok(self.finish(outcomes))
    }

    fn finish(mut self, outcomes: Vec<Outcome>) -> SimReport {
        let w = &self.world;
        for o in &outcomes {
            match &o.end {
                Some(Ok(_)) => self.report.finished += 1,
                Some(Err(code)) => {
                    self.report.errors += 1;
                    self.report.error_codes.push(code.clone());
                }
                None => {}
            }
        }
        self.report.outcomes = outcomes;
        self.report.tokens_delivered = w.counters.tokens_delivered;
        self.report.prefill_pool = w.prefill.engine.pool.stats();
        self.report.cache_hit_pages = w.prefill.machine.stats().cache_hit_pages_total;
        self.report.decode_pool = w.decode.engine.pool.stats();
        self.report.decode_stats = w.decode.machine.stats();
        self.report.prefill_stats = w.prefill.machine.stats();
        let s = w.decode.machine.stats();
        let c = &w.counters;
        self.report.checksum_failures = c.retired_checksum + s.checksum_failures_total;
        self.report.pages_fenced = c.retired_fenced + s.pages_fenced_total;
        self.report.pages_late = c.retired_late + s.pages_late_total;
        self.report.cancels_receiving = c.retired_cancels.0 + s.cancels_receiving_total;
        self.report.cancels_decoding = c.retired_cancels.1 + s.cancels_decoding_total;
        self.report
    }
}
