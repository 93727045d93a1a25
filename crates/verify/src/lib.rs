//! `verify` — the KV transfer protocol, model-checked.
//!
//! A [`stateright`] model whose state is a [`testkit::world::World`]: the
//! *production* `Gateway`, `PrefillNode` and `DecodeNode` state machines,
//! real `kv::Pool`s with real epochs, encoded frames on connections, the
//! stand-in model's engines and the clients. Nothing is re-implemented: an
//! action is one call into the world (which calls the machines), so if the
//! production types change, this crate stops compiling.
//!
//! The checker explores *every* interleaving within [`Bounds`]: which frame
//! is delivered next, when an engine runs, and — within budgets — client
//! cancels, connection kills, node crashes and stale writers. Properties
//! are checked in every state reached (see [`PdModel`]'s `properties`).
//!
//! ```
//! use verify::{check, Bounds};
//! // A small search: one request, no faults.
//! let mut b = Bounds::two_tenants();
//! b.requests.truncate(1);
//! b.cancels = 0;
//! b.crashes = 0;
//! b.kills = 0;
//! let r = check(&b, 1);
//! assert!(r.violations.is_empty(), "{:?}", r.violations);
//! assert!(r.unique_states > 10);
//! assert!(r.reached.contains(&"sometimes: a request completes with the reference's tokens"));
//! ```
//!
//! # The network
//!
//! [`Network::Tcp`] is what production runs on: per-connection FIFO, no
//! duplication, and loss only as a whole connection dying (a kill, a crash,
//! a corrupted frame the frame check rejects, a heartbeat timeout) with
//! everything in flight on it. [`Network::Adversarial`] goes beyond TCP: any
//! frame in flight on a connection may be delivered next, and within
//! budgets a frame is lost on a live connection or delivered twice. No
//! layer of ours duplicates (the transport never retransmits a frame and
//! the gateway never retries a request), so duplication stands for a stale
//! or buggy peer replaying one. On it, a lost frame can hang a request
//! forever (TCP would have ended the connection), so the liveness
//! properties are checked on the TCP network only.
//!
//! # Faults
//!
//! Crashes take a node down for good (its memory is gone; peers see its
//! connections drop). Kills end one connection. A *stale write* rewrites a
//! `Prefill` order in flight to name a page's previous epoch — what a
//! prefill holding a handle past its reservation's life sends; it is the
//! incident's late writer, and the epoch check (K2) is what stops it.

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use stateright::{Checker, Model, Property};
use testkit::world::{ClientSpec, Node, World, WorldParams};
use transfer::decode::DecodeMutations;
use transfer::gateway::GatewayMutations;
use transfer::node::GlueMutations;
use transfer::prefill::PrefillMutations;
use transfer::wire::Message;
use transfer::ConnId;
use transfer::{RequestId, TenantId};

/// How the network may behave (see the crate documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Network {
    Tcp,
    Adversarial { drops: usize, duplicates: usize },
}

/// Test-only mutations of the production machines (all off by default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mutations {
    pub decode: DecodeMutations,
    pub prefill: PrefillMutations,
    pub gateway: GatewayMutations,
    /// Of the node glue both production and this model run.
    pub glue: GlueMutations,
    /// Of decode's stand-in engine, which verifies a draft row a step as
    /// the batch core does: leave a rejected draft's row written (no
    /// `Pool::rewind`).
    pub skip_rewind: bool,
}

/// How the state space is walked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Search {
    /// Breadth-first: the shortest counterexample; keeps a frontier of
    /// whole states in memory (CI's bounds need well under 1 GiB).
    Bfs,
    /// Depth-first: keeps only the current path and fingerprints of the
    /// states seen, so deeper bounds fit in memory; counterexamples may be
    /// longer than necessary.
    Dfs,
}

/// The bounds of a search: sizes, requests and fault budgets.
#[derive(Clone, Debug)]
pub struct Bounds {
    pub name: &'static str,
    pub params: WorldParams,
    pub requests: Vec<ClientSpec>,
    pub cancels: usize,
    pub crashes: usize,
    pub kills: usize,
    pub stale_writes: usize,
    pub network: Network,
    pub mutations: Mutations,
    /// Check liveness on an adversarial network too (it fails there: the
    /// test that shows the liveness properties can fail at all).
    pub liveness_everywhere: bool,
    pub search: Search,
    /// Give up after this long (the report says so).
    pub timeout: Duration,
}

impl Bounds {
    /// Two tenants' 5-token prompts (2 pages each at 4 slots a page) into a
    /// decode pool of 3 pages: the second request waits for the first's
    /// pages, so a page is freed and handed to another tenant while the
    /// search runs; 2 cancels, 1 crash, 1 connection kill.
    pub fn two_tenants() -> Bounds {
        Bounds {
            name: "two-tenants",
            params: WorldParams {
                page_size: 4,
                prefill_pages: 4,
                decode_pages: 3,
                prefill_limit: 16,
                decode_limit: 16,
                window_pages: 1,
                prefix_cache: true,
                placements_max: 2,
            },
            requests: vec![
                ClientSpec::new(TenantId(1), vec![11, 12, 13, 14, 15], 1),
                ClientSpec::new(TenantId(2), vec![21, 22, 23, 24, 25], 1),
            ],
            cancels: 2,
            crashes: 1,
            kills: 1,
            stale_writes: 0,
            network: Network::Tcp,
            mutations: Mutations::default(),
            liveness_everywhere: false,
            search: Search::Bfs,
            timeout: Duration::from_secs(600),
        }
    }

    /// The incident's request: tenant 2's prompt fits decode's limit but
    /// not prefill's, and the gateway does not check limits (so the nodes'
    /// own checks are what the search exercises); tenant 1's request runs
    /// beside it. 1 cancel, 1 crash.
    pub fn oversize() -> Bounds {
        Bounds {
            name: "oversize",
            params: WorldParams {
                prefill_limit: 8,
                decode_limit: 16,
                decode_pages: 5,
                ..Bounds::two_tenants().params
            },
            requests: vec![
                ClientSpec::new(TenantId(1), vec![11, 12, 13, 14, 15], 1),
                ClientSpec::new(TenantId(2), vec![21, 22, 23, 24, 25, 26, 27], 2),
            ],
            cancels: 1,
            crashes: 1,
            kills: 0,
            mutations: Mutations {
                gateway: GatewayMutations {
                    skip_limit_check: true,
                    ..GatewayMutations::default()
                },
                ..Mutations::default()
            },
            ..Bounds::two_tenants()
        }
    }

    /// A stale writer: one `Prefill` order in flight may name a page's
    /// previous epoch. 1 cancel.
    pub fn stale_writer() -> Bounds {
        Bounds {
            name: "stale-writer",
            cancels: 1,
            crashes: 0,
            kills: 0,
            stale_writes: 1,
            ..Bounds::two_tenants()
        }
    }

    /// Beyond TCP: frames delivered in any order, 1 lost, 1 duplicated;
    /// one request, 1 cancel. Safety properties only. (Two requests on
    /// this network pass 24 GiB of states: the deep run's business.)
    pub fn adversarial() -> Bounds {
        let mut requests = Bounds::two_tenants().requests;
        requests.truncate(1);
        Bounds {
            name: "adversarial",
            requests,
            cancels: 1,
            crashes: 0,
            kills: 0,
            network: Network::Adversarial {
                drops: 1,
                duplicates: 1,
            },
            // One placement: re-placement is searched on TCP (two-tenants,
            // prefix-cache: a kill or crash before the first token places
            // the request again); here every re-run of the request in any
            // frame order is more than 24 GiB of states.
            params: WorldParams {
                placements_max: 1,
                ..Bounds::two_tenants().params
            },
            ..Bounds::two_tenants()
        }
    }

    /// The prefix cache (K11): two 9-token prompts of one tenant share
    /// their first page; the second may start from it while the first
    /// still holds it, or after it went idle, in which case prefill's pool
    /// of 3 pages must evict the first's other cached page to fit the
    /// second; 2 cancels, 1 crash, 1 connection kill at any point.
    pub fn prefix_cache() -> Bounds {
        Bounds {
            name: "prefix-cache",
            params: WorldParams {
                prefill_pages: 3,
                decode_pages: 4,
                ..Bounds::two_tenants().params
            },
            requests: vec![
                ClientSpec::new(TenantId(1), vec![11, 12, 13, 14, 15, 16, 17, 18, 19], 1),
                ClientSpec::new(TenantId(1), vec![11, 12, 13, 14, 30, 31, 32, 33, 34], 1),
            ],
            ..Bounds::two_tenants()
        }
    }

    /// Speculative decoding on the decode node (issue 37): one request
    /// decodes five tokens, its engine verifying a draft row beside each
    /// step's (kept, then rolled back with `Pool::rewind`), with a cancel
    /// and a connection kill that may land between any two events.
    pub fn speculation() -> Bounds {
        Bounds {
            name: "speculation",
            requests: vec![ClientSpec::new(TenantId(1), vec![11, 12, 13], 5)],
            cancels: 1,
            crashes: 0,
            kills: 1,
            ..Bounds::two_tenants()
        }
    }

    /// Every bound set CI checks.
    pub fn ci() -> Vec<Bounds> {
        vec![
            Bounds::two_tenants(),
            Bounds::oversize(),
            Bounds::stale_writer(),
            Bounds::adversarial(),
            Bounds::prefix_cache(),
            Bounds::speculation(),
        ]
    }
}

/// One step of the search.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// The next client submits its request.
    Submit,
    Cancel(RequestId),
    /// Deliver frame `index` of direction `side` of `conn` (always 0 on TCP).
    Deliver {
        conn: ConnId,
        side: usize,
        index: usize,
    },
    /// Deliver a `Prefill` order rewritten to name its first page's
    /// previous epoch.
    StaleWrite {
        conn: ConnId,
        side: usize,
        index: usize,
    },
    Drop {
        conn: ConnId,
        side: usize,
        index: usize,
    },
    Duplicate {
        conn: ConnId,
        side: usize,
        index: usize,
    },
    Kill(ConnId),
    Crash(Node),
    PrefillDial,
    GatewayDial(usize),
    Compute(RequestId),
    DecodeStep(RequestId),
}

/// The model: bounds plus the world's transitions.
pub struct PdModel {
    pub bounds: Bounds,
}

fn rewrite_to_stale(msg: &mut Message) -> bool {
    if let Message::Prefill { pages, .. } = msg {
        if let Some(p) = pages.first_mut().filter(|p| p.epoch >= 3) {
            p.epoch -= 2;
            return true;
        }
    }
    false
}

impl PdModel {
    fn tcp(&self) -> bool {
        self.bounds.network == Network::Tcp
    }

    /// Indices of the frames a direction may deliver next.
    fn deliverable(&self, queued: usize) -> std::ops::Range<usize> {
        if self.tcp() {
            0..1
        } else {
            0..queued
        }
    }

    /// Properties that hold only on a TCP network.
    fn liveness_applies(&self) -> bool {
        self.tcp() || self.bounds.liveness_everywhere
    }

    /// A terminal state: no action is enabled.
    pub fn terminal(&self, w: &World) -> bool {
        let mut v = Vec::new();
        self.actions(w, &mut v);
        v.is_empty()
    }
}

fn violation_with(w: &World, prefix: &str) -> bool {
    w.violations().iter().any(|v| v.starts_with(prefix))
}

impl Model for PdModel {
    type State = World;
    type Action = Action;

    fn init_states(&self) -> Vec<World> {
        let mut w = World::new(self.bounds.params.clone(), self.bounds.requests.clone());
        w.gateway.set_mutations(self.bounds.mutations.gateway);
        w.prefill
            .machine
            .set_mutations(self.bounds.mutations.prefill);
        w.decode.machine.set_mutations(self.bounds.mutations.decode);
        w.decode.set_mutations(self.bounds.mutations.glue);
        w.decode.engine.skip_rewind = self.bounds.mutations.skip_rewind;
        vec![w]
    }

    fn actions(&self, w: &World, out: &mut Vec<Action>) {
        let b = &self.bounds;
        let c = &w.counters;
        let frames = w.frames();
        let live = !w.clients_done();
        // Submit once the gateway is ready, or once nothing in flight can
        // make it ready (a node is down: the gateway refuses at once).
        if w.next_client().is_some() && (w.gateway.ready() || frames.is_empty()) {
            out.push(Action::Submit);
        }
        for &(conn, side, queued) in &frames {
            for index in self.deliverable(queued) {
                out.push(Action::Deliver { conn, side, index });
                // Only where the rewrite changes something: the first
                // page must have had a previous allocation.
                let prefill = c.stale_writes < b.stale_writes
                    && matches!(
                        w.peek(conn, side, index),
                        Some(Message::Prefill { pages, .. }) if pages.first().is_some_and(|p| p.epoch >= 3)
                    );
                if prefill {
                    out.push(Action::StaleWrite { conn, side, index });
                }
            }
            if let Network::Adversarial { drops, duplicates } = b.network {
                for index in 0..queued {
                    if c.drops < drops {
                        out.push(Action::Drop { conn, side, index });
                    }
                    if c.duplicates < duplicates {
                        out.push(Action::Duplicate { conn, side, index });
                    }
                }
            }
        }
        if w.has_dials() {
            out.push(Action::PrefillDial);
        }
        for req in w.jobs() {
            out.push(Action::Compute(req));
        }
        for req in w.decoding() {
            out.push(Action::DecodeStep(req));
        }
        for which in 0..2 {
            if live && w.gateway_link_missing(which) {
                out.push(Action::GatewayDial(which));
            }
        }
        if !live {
            return;
        }
        if c.cancels < b.cancels {
            for req in w.in_flight() {
                out.push(Action::Cancel(req));
            }
        }
        if c.kills < b.kills {
            for conn in w.conn_ids() {
                out.push(Action::Kill(conn));
            }
        }
        if c.crashes < b.crashes {
            for node in [Node::Prefill, Node::Decode] {
                if w.up(node) {
                    out.push(Action::Crash(node));
                }
            }
        }
    }

    fn next_state(&self, w: &World, action: Action) -> Option<World> {
        let mut n = w.clone();
        match action {
            Action::Submit => n.submit_next(),
            Action::Cancel(req) => n.cancel(req),
            Action::Deliver { conn, side, index } => n.deliver(conn, side, index, None, None),
            Action::StaleWrite { conn, side, index } => {
                n.counters.stale_writes += 1;
                n.deliver(conn, side, index, None, Some(&mut rewrite_to_stale));
            }
            Action::Drop { conn, side, index } => n.drop_frame(conn, side, index),
            Action::Duplicate { conn, side, index } => n.duplicate_frame(conn, side, index),
            Action::Kill(conn) => n.kill(conn),
            Action::Crash(node) => n.crash(node),
            Action::PrefillDial => n.prefill_dial(),
            Action::GatewayDial(which) => n.gateway_dial(which),
            Action::Compute(req) => n.compute(req),
            Action::DecodeStep(req) => n.decode_step(req),
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "K1/K11: every private page a request holds is its own, every cached one is of \
                 its tenant's scope",
                |_: &PdModel, w: &World| w.check_ownership().is_ok(),
            ),
            Property::always(
                "K2: no page is written through a handle that is not its live reservation",
                |_: &PdModel, w: &World| !violation_with(w, "K2:"),
            ),
            Property::always(
                "K3/K10: decode starts only on pages fully written with its own prompt, and every \
                 token is the reference's",
                |_: &PdModel, w: &World| {
                    !violation_with(w, "K3/K10:") && !violation_with(w, "request ")
                },
            ),
            Property::always(
                "K4: no page is freed or reallocated while a transfer may write it",
                |_: &PdModel, w: &World| w.check_k4_across().is_ok(),
            ),
            Property::always(
                "K5: no double free; each pool's free list is exactly its free pages",
                |_: &PdModel, w: &World| w.check_pools().is_ok(),
            ),
            Property::always(
                "K7 and every other event check: no violation recorded",
                |_: &PdModel, w: &World| w.violations().is_empty(),
            ),
            Property::always(
                "K9: a refused request ends with its original error and no tokens",
                |_: &PdModel, w: &World| w.check_refusals().is_ok(),
            ),
            Property::always(
                "engines: no engine runs a request that the machines have ended",
                |_: &PdModel, w: &World| w.check_engines().is_ok(),
            ),
            Property::always(
                "liveness: in a state with nothing left to do, every request has ended and every \
                 page is free",
                |m: &PdModel, w: &World| {
                    !m.liveness_applies()
                        || !m.terminal(w)
                        || (w.clients_done() && w.pools_free().is_ok())
                },
            ),
            Property::eventually("liveness: every request ends", |m: &PdModel, w: &World| {
                !m.liveness_applies() || w.clients_done()
            }),
            Property::sometimes(
                "sometimes: a request completes with the reference's tokens",
                |_: &PdModel, w: &World| w.some_completed(),
            ),
            Property::sometimes(
                "sometimes: a cancel lands mid-transfer",
                |_: &PdModel, w: &World| w.counters.cancels_mid_transfer > 0,
            ),
            Property::sometimes(
                "sometimes: a request starts from cached pages",
                |m: &PdModel, w: &World| {
                    m.bounds.name != "prefix-cache"
                        || w.prefill.machine.stats().cache_hit_pages_total > 0
                },
            ),
            Property::sometimes(
                "sometimes: decode keeps a draft, and rolls another back",
                |m: &PdModel, w: &World| {
                    m.bounds.name != "speculation"
                        || (w.decode.engine.drafts_kept > 0
                            && w.decode.engine.drafts_rolled_back > 0)
                },
            ),
            Property::sometimes(
                "sometimes: a cached page is evicted for an allocation",
                |m: &PdModel, w: &World| {
                    m.bounds.name != "prefix-cache"
                        || w.prefill.engine.pool.stats().cache_evictions > 0
                },
            ),
        ]
    }
}

/// What a search found.
#[derive(Debug)]
pub struct Report {
    pub name: &'static str,
    pub unique_states: usize,
    pub states: usize,
    pub max_depth: usize,
    pub seconds: f64,
    pub timed_out: bool,
    /// Broken `always`/`eventually` properties, each with a readable trace.
    pub violations: Vec<(&'static str, String)>,
    /// `sometimes` properties the search reached.
    pub reached: Vec<&'static str>,
    /// `sometimes` properties it did not reach.
    pub unreached: Vec<&'static str>,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{}: {} unique states ({} generated), depth {}, {:.1} s{}",
            self.name,
            self.unique_states,
            self.states,
            self.max_depth,
            self.seconds,
            if self.timed_out { ", TIMED OUT" } else { "" }
        )?;
        for r in &self.reached {
            writeln!(f, "  reached: {r}")?;
        }
        for r in &self.unreached {
            writeln!(f, "  NOT reached: {r}")?;
        }
        for (p, trace) in &self.violations {
            writeln!(f, "  VIOLATED: {p}\n{trace}")?;
        }
        Ok(())
    }
}

/// Runs the search `bounds.search` names on `threads` threads.
pub fn check(bounds: &Bounds, threads: usize) -> Report {
    let model = PdModel {
        bounds: bounds.clone(),
    };
    let builder = model
        .checker()
        .threads(threads.max(1))
        .timeout(bounds.timeout);
    let start = Instant::now();
    match bounds.search {
        Search::Bfs => report(bounds, start, builder.spawn_bfs().join()),
        Search::Dfs => report(bounds, start, builder.spawn_dfs().join()),
    }
}

fn report(bounds: &Bounds, start: Instant, checker: impl Checker<PdModel>) -> Report {
    let properties = checker.model().properties();
    let seconds = start.elapsed().as_secs_f64();
    let discoveries: HashMap<_, _> = checker.discoveries();
    let mut report = Report {
        name: bounds.name,
        unique_states: checker.unique_state_count(),
        states: checker.state_count(),
        max_depth: checker.max_depth(),
        seconds,
        timed_out: seconds >= bounds.timeout.as_secs_f64(),
        violations: Vec::new(),
        reached: Vec::new(),
        unreached: Vec::new(),
    };
    for p in &properties {
        let found = discoveries.get(p.name);
        if p.name.starts_with("sometimes") {
            if found.is_some() {
                report.reached.push(p.name);
            } else {
                report.unreached.push(p.name);
            }
        } else if let Some(path) = found {
            report
                .violations
                .push((p.name, explain(checker.model(), path.clone().into_vec())));
        }
    }
    report
}

/// A counterexample, step by step: each action in words (with the frame it
/// delivers), then the state the last step left, and what broke.
pub fn explain(model: &PdModel, steps: Vec<(World, Option<Action>)>) -> String {
    let mut s = String::new();
    let mut last = None;
    for (i, (w, action)) in steps.into_iter().enumerate() {
        if let Some(a) = action {
            s += &format!("  {:>3}. {}\n", i + 1, describe(&w, &a));
        }
        last = Some(w);
    }
    if let Some(w) = last {
        // The path's last entry is the state its last action left.
        s += "  state after the last step:\n";
        for line in w.summary().lines() {
            s += &format!("       {line}\n");
        }
        let mut broken: Vec<String> = w.violations().to_vec();
        for r in [
            w.check_pools(),
            w.check_ownership(),
            w.check_refusals(),
            w.check_k4_across(),
            w.check_engines(),
        ] {
            if let Err(e) = r {
                broken.push(e);
            }
        }
        if model.terminal(&w) {
            if let Err(e) = w.check_end() {
                broken.push(format!("at the end: {e}"));
            }
        }
        for b in broken {
            s += &format!("  => {b}\n");
        }
    }
    s
}

/// One action in words.
pub fn describe(w: &World, a: &Action) -> String {
    let frame = |conn: ConnId, side: usize, index: usize| {
        let ends = w.conn_ends(conn).unwrap_or([Node::Gateway, Node::Gateway]);
        let (from, to) = (ends[side], ends[1 - side]);
        let msg = w
            .peek(conn, side, index)
            .map(|m| short(&m))
            .unwrap_or_else(|| "(unparsable frame)".into());
        format!("{from:?} -> {to:?} (conn {conn}): {msg}")
    };
    match a {
        Action::Submit => match w.next_client() {
            Some(req) => format!("client submits request {req}"),
            None => "client submits".into(),
        },
        Action::Cancel(req) => format!("client of request {req} CANCELS"),
        Action::Deliver { conn, side, index } => {
            let order = if *index > 0 {
                format!(" [frame {index} in queue: out of order]")
            } else {
                String::new()
            };
            format!("deliver {}{order}", frame(*conn, *side, *index))
        }
        Action::StaleWrite { conn, side, index } => format!(
            "STALE WRITER: deliver, naming the first page's previous epoch, {}",
            frame(*conn, *side, *index)
        ),
        Action::Drop { conn, side, index } => {
            format!("network LOSES {}", frame(*conn, *side, *index))
        }
        Action::Duplicate { conn, side, index } => {
            format!("network DUPLICATES {}", frame(*conn, *side, *index))
        }
        Action::Kill(conn) => format!("network KILLS conn {conn}"),
        Action::Crash(node) => format!("{node:?} CRASHES"),
        Action::PrefillDial => "prefill's dial to decode completes".into(),
        Action::GatewayDial(0) => "gateway redials prefill".into(),
        Action::GatewayDial(_) => "gateway redials decode".into(),
        Action::Compute(req) => format!("prefill engine computes request {req}'s KV"),
        Action::DecodeStep(req) => format!("decode engine runs a step of request {req}"),
    }
}

/// A message without its page bytes.
fn short(m: &Message) -> String {
    match m {
        Message::Page {
            req,
            position,
            dst,
            slots,
            ..
        } => format!(
            "Page {{ req {req}, position {position}, into page {} epoch {}, {slots} slots }}",
            dst.index, dst.epoch
        ),
        Message::Hello { .. } => "Hello".into(),
        other => {
            let mut s = format!("{other:?}");
            if s.len() > 140 {
                s.truncate(140);
                s += "…";
            }
            s
        }
    }
}
