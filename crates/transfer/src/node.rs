//! One PD node's glue, written once: transport events in, the role's state
//! machine, its actions carried out on the node's engine, outgoing
//! commands for the transport. Production (`pd`'s node loop over the real
//! model) and the tests (the simulator's and the model checker's
//! `testkit::world::World` over a stand-in model) run exactly this code;
//! only the [`NodeEngine`] behind it differs.
//!
//! * [`Prefill`] — a `Prefill` message's parameters are checked by the
//!   engine before the machine allocates anything (the window, K8, is the
//!   machine's own check); the machine's `Compute` becomes engine work,
//!   whose first token goes back to the machine, which sends the pages and
//!   `Done`.
//! * [`Decode`] — a `Reserve` is checked the same way; once the machine
//!   has checked a transfer (K6, K7, K10) its `StartDecode` starts the
//!   engine on the transferred KV; the engine's tokens, end or failure go
//!   back to the machine, which streams them and frees the pages.
//!
//! Nothing here opens a socket, reads a clock or spawns a thread.
//!
//! ```
//! use transfer::node::{NetCommand, NetEvent};
//! use transfer::wire::Message;
//! // A transport turns bytes into events for the glue, and carries out its
//! // commands; `testkit::world::World` drives the same glue in tests.
//! let ev = NetEvent::Message { conn: 3, msg: Message::Cancel { req: transfer::RequestId(7) } };
//! let cmd = NetCommand::Close { conn: 3 };
//! assert!(matches!((ev, cmd), (NetEvent::Message { .. }, NetCommand::Close { conn: 3 })));
//! ```

use kv::{Pool, RequestId, TenantId};

use crate::common::ConnId;
use crate::decode::{DecodeAction, DecodeNode, DecodeStart};
use crate::prefill::{ComputeJob, PrefillAction, PrefillNode};
use crate::wire::{GenSpec, Message, PredictionCounts, Refusal, WireLogprobs};

/// What the transport tells a node (production: TCP; tests: the world's
/// connections). The one transport event type of the project.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NetEvent {
    /// A peer dialled us (a gateway; on decode also a prefill node).
    Accepted {
        conn: ConnId,
    },
    /// Our dial to `addr` succeeded (prefill → decode, gateway → nodes).
    Dialled {
        conn: ConnId,
        addr: String,
    },
    DialFailed {
        addr: String,
        why: String,
    },
    Message {
        conn: ConnId,
        msg: Message,
    },
    /// The connection ended (peer closed, reset, heartbeat timeout, a frame
    /// that did not parse).
    Closed {
        conn: ConnId,
    },
}

/// What a node asks of the transport.
// `Send` carries a message by value, as `DecodeAction` does: a command is
// made and consumed once, and most are sends.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NetCommand {
    Send { conn: ConnId, msg: Message },
    Close { conn: ConnId },
    Dial { addr: String },
}

/// What a prefill node's engine reports back.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PrefillReport {
    /// The prompt's KV is in its pages; the first token is sampled.
    Computed {
        req: RequestId,
        first: u32,
        logprobs: Option<WireLogprobs>,
        sampler_state: u64,
    },
    /// The engine could not compute the prompt (a failed forward step).
    Failed { req: RequestId, error: Refusal },
}

/// What a decode node's engine reports back.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DecodeReport {
    Token {
        req: RequestId,
        conn: ConnId,
        id: u32,
        text: String,
        logprobs: Option<WireLogprobs>,
    },
    /// `finish`: 0 stop, 1 length (as `Message::Finished`).
    Finished {
        req: RequestId,
        finish: u8,
        completion_tokens: u32,
        prediction: PredictionCounts,
        tail_text: String,
    },
    Failed {
        req: RequestId,
        error: Refusal,
    },
}

/// The engine behind a node: the model, the pool and the batch. The glue
/// reaches the pool only through it (production's batch core owns it).
pub trait NodeEngine {
    fn pool(&mut self) -> &mut Pool;
    /// The engine's checks of a request's parameters (the same rules as
    /// the unified engine), before the machine allocates anything. The
    /// window (K8) is not checked here: it is the machine's. An `Err` is
    /// counted by the engine and sent back as the request's original error.
    fn check(
        &mut self,
        tenant: TenantId,
        tokens: &[u32],
        max_tokens: u32,
        gen: &GenSpec,
    ) -> Result<(), Refusal>;
    /// Takes a request out of the engine's batch without touching its
    /// pages (the machine stopped it and frees them).
    fn stop(&mut self, req: RequestId);
    /// Requests in the engine's batch (for [`Message::Load`]).
    fn running(&mut self) -> usize;
}

/// A node's [`Message::Load`]: `requests` the machine holds, `running` of
/// them in the engine's batch; pages an allocation can get (free and
/// evictable cached ones).
fn load_message(requests: usize, running: usize, pool: &Pool) -> Message {
    let sat = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    Message::Load {
        queued: sat(requests.saturating_sub(running)),
        running: sat(running),
        pages_free: pool.pages_available(),
        pages_total: pool.pages_total(),
    }
}

/// Appends one `Load` per gateway connection.
fn send_load(msg: Message, conns: impl Iterator<Item = ConnId>, cmds: &mut Vec<NetCommand>) {
    for conn in conns {
        cmds.push(NetCommand::Send {
            conn,
            msg: msg.clone(),
        });
    }
}

/// A prefill node's engine.
pub trait PrefillEngine: NodeEngine {
    /// Compute a prompt into its (allocated) pages; report
    /// [`PrefillReport::Computed`] or [`PrefillReport::Failed`] later.
    fn compute(&mut self, job: ComputeJob);
    /// Reports since the last call, in the order they happened.
    fn take_reports(&mut self, out: &mut Vec<PrefillReport>);
}

/// A decode node's engine.
pub trait DecodeEngine: NodeEngine {
    /// Start decoding from transferred KV and the first token; an `Err`
    /// fails the request with that error (nothing was generated).
    fn start_decode(&mut self, start: DecodeStart) -> Result<(), Refusal>;
    fn take_reports(&mut self, out: &mut Vec<DecodeReport>);
}

/// Test-only mutations of the glue itself, so tests show that the
/// simulator and the model checker see a bug here too.
#[cfg(any(test, feature = "mutations"))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct GlueMutations {
    /// Decode: start the engine on a request's reservation as soon as its
    /// `Done` arrives, before the machine's completeness verdict (K10) is
    /// acted on; the machine's later `StartDecode` finds it running.
    pub start_before_verdict: bool,
    /// Decode: `StopDecode` does nothing — the machine ends a request (a
    /// cancel while it decodes) and frees its pages, but the engine keeps
    /// running it.
    pub skip_stop_decode: bool,
}

/// The engine's parameter check of a request arriving at a node (`Prefill`
/// on prefill, `Reserve` on decode: `on_decode` says which), before the
/// machine allocates: false (and the original error sent back) when it
/// fails. Other messages pass.
fn checked(
    engine: &mut impl NodeEngine,
    on_decode: bool,
    conn: ConnId,
    msg: &Message,
    cmds: &mut Vec<NetCommand>,
) -> bool {
    let (req, tenant, tokens, max_tokens, gen) = match msg {
        Message::Prefill {
            req,
            tenant,
            tokens,
            max_tokens,
            gen,
            ..
        } if !on_decode => (req, tenant, tokens, max_tokens, gen),
        Message::Reserve {
            req,
            tenant,
            tokens,
            max_tokens,
            gen,
            ..
        } if on_decode => (req, tenant, tokens, max_tokens, gen),
        _ => return true,
    };
    match engine.check(*tenant, tokens, *max_tokens, gen) {
        Ok(()) => true,
        Err(error) => {
            cmds.push(NetCommand::Send {
                conn,
                msg: Message::Rejected { req: *req, error },
            });
            false
        }
    }
}

/// Reports drained per call before the glue returns (bounds the loop: each
/// report may make the engine report again, e.g. a first token that ends
/// a request).
const REPORT_ROUNDS_MAX: usize = 1 << 16;

/// A prefill node: its machine and its engine.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Prefill<E> {
    pub machine: PrefillNode,
    pub engine: E,
}

impl<E: PrefillEngine> Prefill<E> {
    pub fn new(machine: PrefillNode, engine: E) -> Prefill<E> {
        Prefill { machine, engine }
    }

    /// One transport event; commands for the transport are appended.
    pub fn event(&mut self, ev: NetEvent, cmds: &mut Vec<NetCommand>) {
        let mut out = Vec::new();
        match ev {
            NetEvent::Accepted { conn } => self.machine.accepted(conn, &mut out),
            NetEvent::Dialled { conn, addr } => self.machine.connected(conn, &addr, &mut out),
            NetEvent::DialFailed { addr, why } => {
                self.machine
                    .connect_failed(self.engine.pool(), &addr, &why, &mut out)
            }
            NetEvent::Message { conn, msg } => {
                if !checked(&mut self.engine, false, conn, &msg, cmds) {
                    return;
                }
                self.machine
                    .message(self.engine.pool(), conn, msg, &mut out)
            }
            NetEvent::Closed { conn } => self.machine.closed(self.engine.pool(), conn, &mut out),
        }
        self.act(out, cmds);
        self.reports(cmds);
    }

    /// Tells every paired gateway this node's load. The node loop calls it
    /// periodically (the glue has no clock); tests call it when they want.
    pub fn report_load(&mut self, cmds: &mut Vec<NetCommand>) {
        let running = self.engine.running();
        let msg = load_message(self.machine.requests(), running, self.engine.pool());
        send_load(msg, self.machine.gateway_conns(), cmds);
    }

    /// Takes the engine's reports (after a step) into the machine.
    pub fn reports(&mut self, cmds: &mut Vec<NetCommand>) {
        let mut reports = Vec::new();
        for _ in 0..REPORT_ROUNDS_MAX {
            self.engine.take_reports(&mut reports);
            if reports.is_empty() {
                return;
            }
            for r in reports.drain(..) {
                let mut out = Vec::new();
                let pool = self.engine.pool();
                match r {
                    PrefillReport::Computed {
                        req,
                        first,
                        logprobs,
                        sampler_state,
                    } => self
                        .machine
                        .computed(pool, req, first, logprobs, sampler_state, &mut out),
                    PrefillReport::Failed { req, error } => {
                        self.machine.compute_failed(pool, req, error, &mut out)
                    }
                }
                self.act(out, cmds);
            }
        }
        debug_assert!(false, "prefill engine kept reporting");
    }

    fn act(&mut self, actions: Vec<PrefillAction>, cmds: &mut Vec<NetCommand>) {
        for a in actions {
            match a {
                PrefillAction::Send { conn, msg } => cmds.push(NetCommand::Send { conn, msg }),
                PrefillAction::Close { conn } => cmds.push(NetCommand::Close { conn }),
                PrefillAction::Connect { addr } => cmds.push(NetCommand::Dial { addr }),
                PrefillAction::Compute(job) => self.engine.compute(*job),
                PrefillAction::StopCompute { req } => self.engine.stop(req),
            }
        }
    }
}

/// A decode node: its machine and its engine.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Decode<E> {
    pub machine: DecodeNode,
    pub engine: E,
    #[cfg(any(test, feature = "mutations"))]
    mutations: GlueMutations,
    /// `start_before_verdict` only: requests started on `Done`.
    #[cfg(any(test, feature = "mutations"))]
    started_early: std::collections::BTreeSet<RequestId>,
}

impl<E: DecodeEngine> Decode<E> {
    pub fn new(machine: DecodeNode, engine: E) -> Decode<E> {
        Decode {
            machine,
            engine,
            #[cfg(any(test, feature = "mutations"))]
            mutations: GlueMutations::default(),
            #[cfg(any(test, feature = "mutations"))]
            started_early: Default::default(),
        }
    }

    #[cfg(any(test, feature = "mutations"))]
    pub fn set_mutations(&mut self, m: GlueMutations) {
        self.mutations = m;
    }

    /// One transport event; commands for the transport are appended.
    pub fn event(&mut self, ev: NetEvent, cmds: &mut Vec<NetCommand>) {
        let mut out = Vec::new();
        match ev {
            NetEvent::Accepted { conn } | NetEvent::Dialled { conn, .. } => {
                self.machine.connected(conn, &mut out)
            }
            NetEvent::DialFailed { .. } => {}
            NetEvent::Message { conn, msg } => {
                if !checked(&mut self.engine, true, conn, &msg, cmds) {
                    return;
                }
                #[cfg(any(test, feature = "mutations"))]
                self.start_before_verdict(&msg);
                self.machine
                    .message(self.engine.pool(), conn, msg, &mut out)
            }
            NetEvent::Closed { conn } => self.machine.closed(self.engine.pool(), conn, &mut out),
        }
        self.act(out, cmds);
        self.reports(cmds);
    }

    /// Tells every paired gateway this node's load (as
    /// [`Prefill::report_load`]).
    pub fn report_load(&mut self, cmds: &mut Vec<NetCommand>) {
        let running = self.engine.running();
        let msg = load_message(self.machine.requests(), running, self.engine.pool());
        send_load(msg, self.machine.gateway_conns(), cmds);
    }

    /// The mutation: decode on the reservation as soon as `Done` arrives.
    #[cfg(any(test, feature = "mutations"))]
    fn start_before_verdict(&mut self, msg: &Message) {
        let Message::Done {
            req,
            first_token,
            first_logprobs,
            sampler_state,
            ..
        } = msg
        else {
            return;
        };
        if !self.mutations.start_before_verdict
            || self.machine.phase_of(*req) != Some(crate::decode::DecodePhase::Receiving)
        {
            return;
        }
        let m = &self.machine;
        let (Some(pages), Some(owner), Some((conn, tokens, max_tokens, gen))) =
            (m.pages_of(*req), m.owner_of(*req), m.request_of(*req))
        else {
            return;
        };
        let start = DecodeStart {
            req: *req,
            owner,
            conn,
            tokens: tokens.to_vec(),
            max_tokens,
            gen: gen.clone(),
            pages: pages.to_vec(),
            first_token: *first_token,
            first_logprobs: first_logprobs.clone(),
            sampler_state: *sampler_state,
        };
        if self.engine.start_decode(start).is_ok() {
            self.started_early.insert(*req);
        }
    }

    /// Takes the engine's reports (after a step) into the machine.
    pub fn reports(&mut self, cmds: &mut Vec<NetCommand>) {
        let mut reports = Vec::new();
        for _ in 0..REPORT_ROUNDS_MAX {
            self.engine.take_reports(&mut reports);
            if reports.is_empty() {
                return;
            }
            for r in reports.drain(..) {
                let mut out = Vec::new();
                match r {
                    DecodeReport::Token {
                        req,
                        conn,
                        id,
                        text,
                        logprobs,
                    } => self
                        .machine
                        .stream_token(req, conn, id, text, logprobs, &mut out),
                    DecodeReport::Finished {
                        req,
                        finish,
                        completion_tokens,
                        prediction,
                        tail_text,
                    } => self.machine.decode_finished(
                        self.engine.pool(),
                        req,
                        finish,
                        completion_tokens,
                        prediction,
                        tail_text,
                        &mut out,
                    ),
                    DecodeReport::Failed { req, error } => {
                        self.machine
                            .decode_failed(self.engine.pool(), req, error, &mut out)
                    }
                }
                self.act(out, cmds);
            }
        }
        debug_assert!(false, "decode engine kept reporting");
    }

    fn act(&mut self, actions: Vec<DecodeAction>, cmds: &mut Vec<NetCommand>) {
        for a in actions {
            match a {
                DecodeAction::Send { conn, msg } => cmds.push(NetCommand::Send { conn, msg }),
                DecodeAction::Close { conn } => cmds.push(NetCommand::Close { conn }),
                DecodeAction::StartDecode(start) => {
                    let req = start.req;
                    #[cfg(any(test, feature = "mutations"))]
                    if self.started_early.remove(&req) {
                        continue;
                    }
                    if let Err(error) = self.engine.start_decode(*start) {
                        let mut out = Vec::new();
                        self.machine
                            .decode_failed(self.engine.pool(), req, error, &mut out);
                        self.act(out, cmds);
                    }
                }
                DecodeAction::StopDecode { req } => {
                    #[cfg(any(test, feature = "mutations"))]
                    {
                        self.started_early.remove(&req);
                        if self.mutations.skip_stop_decode {
                            continue;
                        }
                    }
                    self.engine.stop(req)
                }
            }
        }
    }
}
