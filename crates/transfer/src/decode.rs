//! The decode side: reservations, receiving pages, the checks before decode
//! starts (K6, K7, K10), deferred release (K4).
//!
//! Per request:
//!
//! ```text
//! Reserve ─▶ Waiting ─(pages free)─▶ Receiving ─(Done, all checks pass)─▶ Decoding ─▶ gone
//!                │                      │  cancel / failure / Abort             │ finish, cancel
//!                ▼                      ▼                                       ▼
//!              gone           Draining ─(prefill's Done/Abort, or its link closed)─▶ gone
//! ```
//!
//! The prompt's pages are leased to the transfer from the moment they are
//! reserved until the transfer ends (prefill's `Done` or `Abort`, or its
//! connection closed). A cancel or failure frees the request's pages at
//! once, but the pool defers the free of leased pages (K4), so no page a
//! late write could reach is ever on the free list. Pages arriving for a
//! request that is draining or gone are dropped and counted (fenced).

use std::collections::{BTreeMap, VecDeque};

use kv::{canary_value, FreeOutcome, KvError, Owner, PageRef, Pool, RequestId, TenantId};

use crate::common::waiting_of;
use crate::common::{
    check_peer, check_request, pages_for, refusal, request_owner, slots_at, transfer_digest,
    ConnId, Identity, PeerHello,
};
use crate::fair;
use crate::wire::{
    GenSpec, Message, PredictionCounts, Refusal, WireLogprobs, WirePage, ROLE_DECODE, ROLE_GATEWAY,
    ROLE_PREFILL,
};

/// Limits and identity of a decode node.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DecodeConfig {
    pub identity: Identity,
    /// Token ids must be below this.
    pub vocab: u32,
    /// Requests known at once (waiting, receiving, decoding, draining).
    pub requests_max: usize,
    /// Reservations waiting for free pages (chosen fairly between
    /// tenants, [`crate::fair`]); beyond it: 429.
    pub waiting_max: usize,
    /// Acknowledge every this many pages (prefill's flow-control window
    /// must be a multiple of it or larger).
    pub ack_every_pages: u32,
}

/// Test-only mutations that remove a safety mechanism, so tests (and the
/// model checker) can show that something notices.
#[cfg(any(test, feature = "mutations"))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DecodeMutations {
    /// On cancel, release the transfer's leases at once (the pages go
    /// back to the free list) instead of when prefill's last word arrives
    /// (K4 broken); the request still waits for that word.
    pub free_without_drain: bool,
    /// Accept a page whatever destination handle it names (K2 fence off):
    /// import it into the page of that index in its current epoch.
    pub skip_handle_check: bool,
    /// Start decoding on `Done` without checking that every page arrived
    /// (K10 off).
    pub skip_completeness_check: bool,
    /// No epoch check on late writes (K2 off): a page naming the reserved
    /// page's index at another epoch is believed — its canary and checksum
    /// are checked against the epoch it names — and written through the
    /// reservation's current handle.
    pub skip_epoch_check: bool,
    /// Start decoding without checking our own pages' canaries (K7 on
    /// decode's memory off).
    pub skip_own_canary_check: bool,
}

/// Where a request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DecodePhase {
    Waiting,
    Receiving,
    Decoding,
    Draining,
}

/// What the engine needs to start decoding a request whose KV arrived.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DecodeStart {
    pub req: RequestId,
    pub owner: Owner,
    /// The gateway connection tokens go to.
    pub conn: ConnId,
    pub tokens: Vec<u32>,
    pub max_tokens: u32,
    pub gen: GenSpec,
    /// Every reserved page; the first `pages_for(tokens)` hold the prompt.
    pub pages: Vec<PageRef>,
    pub first_token: u32,
    pub first_logprobs: Option<WireLogprobs>,
    pub sampler_state: u64,
}

/// What the driver must do.
// `Send` carries a whole `Message` (about 220 bytes since `GenSpec` gained
// `logit_bias`): actions live in a short Vec that the driver drains at once,
// so boxing every token's message would cost an allocation to save bytes
// nobody keeps.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DecodeAction {
    Send {
        conn: ConnId,
        msg: Message,
    },
    Close {
        conn: ConnId,
    },
    /// Hand a request to the decode loop (its pages stay the machine's to
    /// free: report the end with [`DecodeNode::decode_finished`] or
    /// [`DecodeNode::decode_failed`]).
    StartDecode(Box<DecodeStart>),
    /// Stop decoding a request now (cancelled); the machine frees its pages.
    StopDecode {
        req: RequestId,
    },
}

/// Counters of every check and outcome; names end in their unit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DecodeStats {
    pub reservations_total: u64,
    pub reservations_refused_total: u64,
    pub pages_received_total: u64,
    pub page_bytes_received_total: u64,
    pub transfers_completed_total: u64,
    pub checksum_failures_total: u64,
    pub canary_failures_total: u64,
    /// Pages refused for a stale, foreign or unknown destination (K2 fence).
    pub pages_fenced_total: u64,
    /// Pages that arrived for a request already draining (cancelled or
    /// failed): dropped.
    pub pages_late_total: u64,
    pub duplicate_pages_total: u64,
    pub incomplete_transfers_total: u64,
    pub aborts_received_total: u64,
    pub cancels_waiting_total: u64,
    pub cancels_receiving_total: u64,
    pub cancels_decoding_total: u64,
    pub cancels_draining_total: u64,
    pub prefill_links_lost_total: u64,
    pub protocol_errors_total: u64,
    pub handshakes_refused_total: u64,
    pub decodes_finished_total: u64,
    pub decodes_failed_total: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Link {
    Handshaking,
    Gateway,
    Prefill { node: String },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Req {
    owner: Owner,
    gateway: ConnId,
    prefill: String,
    /// The prefill link this transfer runs on, once known.
    link: Option<ConnId>,
    tokens: Vec<u32>,
    max_tokens: u32,
    gen: GenSpec,
    pages: Vec<PageRef>,
    /// Per prompt page: its checksum once received.
    received: Vec<Option<u64>>,
    received_count: u32,
    /// Tokens streamed to the gateway so far.
    streamed: u32,
    /// Prompt tokens prefill took from its prefix cache (from `Done`).
    cached_tokens: u32,
    /// Prompt pages still leased to the transfer.
    leased: bool,
    /// Draining with no known link, while some connection's handshake is
    /// in progress: that connection may be this request's prefill, which
    /// may already be sending. Wait for the handshakes to settle.
    awaiting_handshake: bool,
    phase: DecodePhase,
}

impl Req {
    fn prompt_pages(&self) -> usize {
        self.received.len()
    }
}

/// The decode node's protocol state. Pure: every method takes the pool and
/// an event, mutates state and appends actions; no I/O, no clock.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DecodeNode {
    cfg: DecodeConfig,
    links: BTreeMap<ConnId, Link>,
    /// Live prefill links by node name (the newest connection wins).
    prefill_links: BTreeMap<String, ConnId>,
    reqs: BTreeMap<RequestId, Req>,
    waiting: VecDeque<RequestId>,
    /// Draining (SIGTERM): new requests are refused with
    /// [`refusal::draining`]; what is in flight finishes.
    draining: bool,
    stats: DecodeStats,
    #[cfg(any(test, feature = "mutations"))]
    mutations: DecodeMutations,
}

impl DecodeNode {
    pub fn new(cfg: DecodeConfig) -> DecodeNode {
        DecodeNode {
            cfg,
            links: BTreeMap::new(),
            prefill_links: BTreeMap::new(),
            reqs: BTreeMap::new(),
            waiting: VecDeque::new(),
            draining: false,
            stats: DecodeStats::default(),
            #[cfg(any(test, feature = "mutations"))]
            mutations: DecodeMutations::default(),
        }
    }

    #[cfg(any(test, feature = "mutations"))]
    pub fn set_mutations(&mut self, m: DecodeMutations) {
        self.mutations = m;
    }

    pub fn config(&self) -> &DecodeConfig {
        &self.cfg
    }

    pub fn stats(&self) -> DecodeStats {
        self.stats
    }

    /// Requests known, by phase (for metrics and tests).
    pub fn phase_of(&self, req: RequestId) -> Option<DecodePhase> {
        self.reqs.get(&req).map(|r| r.phase)
    }

    /// Stops taking new requests (the gateway places them elsewhere);
    /// those in flight run to their end. Irreversible: a drained node is
    /// shut down and restarted.
    pub fn drain(&mut self) {
        self.draining = true;
    }

    pub fn draining(&self) -> bool {
        self.draining
    }

    pub fn requests(&self) -> usize {
        self.reqs.len()
    }

    /// Connections to paired gateways (where [`Message::Load`] goes).
    pub fn gateway_conns(&self) -> impl Iterator<Item = ConnId> + '_ {
        self.links
            .iter()
            .filter(|(_, l)| matches!(l, Link::Gateway))
            .map(|(&c, _)| c)
    }

    /// Every request this node knows, with its phase.
    pub fn request_phases(&self) -> impl Iterator<Item = (RequestId, DecodePhase)> + '_ {
        self.reqs.iter().map(|(&k, r)| (k, r.phase))
    }

    /// Transfers in flight into this node (reserved or receiving), for the
    /// operator console: pages checked in so far of the prompt's.
    pub fn transfers(&self, out: &mut Vec<request::console::TransferView>) {
        for (&req, r) in &self.reqs {
            let phase = match r.phase {
                DecodePhase::Waiting => "reserved",
                DecodePhase::Receiving => "receiving",
                DecodePhase::Decoding | DecodePhase::Draining => continue,
            };
            out.push(request::console::TransferView {
                request: req.0,
                tenant: r.owner.tenant.0,
                from: r.prefill.clone(),
                to: self.cfg.identity.node.clone(),
                pages_done: r.received_count,
                pages_total: r.received.len() as u32,
                phase: phase.into(),
            });
        }
    }

    /// The pages a request holds (reserved or being decoded into).
    pub fn pages_of(&self, req: RequestId) -> Option<&[PageRef]> {
        self.reqs.get(&req).map(|r| r.pages.as_slice())
    }

    /// The prefill link a request's transfer is bound to, once known.
    pub fn link_of(&self, req: RequestId) -> Option<ConnId> {
        self.reqs.get(&req).and_then(|r| r.link)
    }

    /// Owner of a request's pages.
    pub fn owner_of(&self, req: RequestId) -> Option<Owner> {
        self.reqs.get(&req).map(|r| r.owner)
    }

    /// A request as the gateway asked for it: (gateway connection, prompt,
    /// max_tokens, sampling).
    pub fn request_of(&self, req: RequestId) -> Option<(ConnId, &[u32], u32, &GenSpec)> {
        self.reqs
            .get(&req)
            .map(|r| (r.gateway, r.tokens.as_slice(), r.max_tokens, &r.gen))
    }

    // ------------------------------------------------------------ links

    /// A connection opened (either side dialled): say hello.
    pub fn connected(&mut self, conn: ConnId, out: &mut Vec<DecodeAction>) {
        self.links.insert(conn, Link::Handshaking);
        out.push(DecodeAction::Send {
            conn,
            msg: self.cfg.identity.hello(ROLE_DECODE),
        });
    }

    /// A connection closed (or its heartbeat timed out): requests of a lost
    /// gateway are cancelled; transfers of a lost prefill link end (no more
    /// writes can come on it), failing those still receiving.
    pub fn closed(&mut self, pool: &mut Pool, conn: ConnId, out: &mut Vec<DecodeAction>) {
        let Some(link) = self.links.remove(&conn) else {
            return;
        };
        match link {
            Link::Handshaking => self.settle_handshakes(pool),
            Link::Gateway => {
                let reqs: Vec<RequestId> = self
                    .reqs
                    .iter()
                    .filter(|(_, r)| r.gateway == conn)
                    .map(|(&k, _)| k)
                    .collect();
                for req in reqs {
                    self.cancel(pool, req, out);
                }
            }
            Link::Prefill { node } => {
                if self.prefill_links.get(&node) == Some(&conn) {
                    self.prefill_links.remove(&node);
                }
                // Only transfers bound to this link. A request from this node
                // that has not yet sent anything is not failed here: it may
                // have been reserved after prefill gave the link up (a
                // heartbeat timeout is seen on one side long before the
                // other) and then travel on the next link. If prefill did
                // lose it with this link, prefill fails it to the gateway,
                // whose Cancel ends it here; a lost gateway cancels it too.
                let reqs: Vec<RequestId> = self
                    .reqs
                    .iter()
                    .filter(|(_, r)| r.link == Some(conn))
                    .map(|(&k, _)| k)
                    .collect();
                if !reqs.is_empty() {
                    self.stats.prefill_links_lost_total += 1;
                }
                for req in reqs {
                    let phase = self.reqs[&req].phase;
                    if phase == DecodePhase::Receiving {
                        self.stats.incomplete_transfers_total += 1;
                        self.fail_ended(
                            pool,
                            req,
                            refusal::upstream(
                                "prefill_lost",
                                format!(
                                    "the prefill node `{node}` was lost mid-transfer; the request \
                                     produced no tokens"
                                ),
                            ),
                            out,
                        );
                    }
                    // The connection is gone: nothing more can be written.
                    self.end_transfer(pool, req);
                }
            }
        }
        self.admit(pool, out);
    }

    /// A message on a connection.
    pub fn message(
        &mut self,
        pool: &mut Pool,
        conn: ConnId,
        msg: Message,
        out: &mut Vec<DecodeAction>,
    ) {
        let Some(link) = self.links.get(&conn).cloned() else {
            // The driver reported a message on a closed connection: ignore.
            return;
        };
        match (link, msg) {
            (_, Message::Heartbeat { .. } | Message::Load { .. }) => {}
            (Link::Handshaking, msg @ Message::Hello { .. }) => {
                let peer = PeerHello::from_message(&msg).expect("a Hello");
                let layout = peer.role == ROLE_PREFILL;
                match check_peer(
                    &self.cfg.identity,
                    &peer,
                    &[ROLE_GATEWAY, ROLE_PREFILL],
                    layout,
                ) {
                    Ok(()) if peer.role == ROLE_GATEWAY => {
                        self.links.insert(conn, Link::Gateway);
                    }
                    Ok(()) => {
                        // Draining requests of this node that waited for the
                        // handshake: ask for prefill's last word on it.
                        for (&req, r) in self.reqs.iter_mut() {
                            if r.awaiting_handshake && r.prefill == peer.node {
                                r.awaiting_handshake = false;
                                r.link = Some(conn);
                                out.push(DecodeAction::Send {
                                    conn,
                                    msg: Message::Cancel { req },
                                });
                            }
                        }
                        self.prefill_links.insert(peer.node.clone(), conn);
                        self.links.insert(conn, Link::Prefill { node: peer.node });
                    }
                    Err(why) => {
                        self.stats.handshakes_refused_total += 1;
                        self.links.remove(&conn);
                        out.push(DecodeAction::Send {
                            conn,
                            msg: Message::Refuse { message: why },
                        });
                        out.push(DecodeAction::Close { conn });
                    }
                }
                self.settle_handshakes(pool);
            }
            (
                Link::Gateway,
                Message::Reserve {
                    req,
                    tenant,
                    prefill,
                    tokens,
                    max_tokens,
                    gen,
                },
            ) => self.reserve(
                pool, conn, req, tenant, prefill, tokens, max_tokens, gen, out,
            ),
            (Link::Gateway, Message::Cancel { req }) => {
                // Only the gateway that owns the request may cancel it.
                if self.reqs.get(&req).is_some_and(|r| r.gateway == conn) {
                    self.cancel(pool, req, out);
                }
            }
            (Link::Prefill { node }, msg @ Message::Page { .. }) => {
                self.page(pool, conn, &node, msg, out)
            }
            (
                Link::Prefill { node },
                Message::Done {
                    req,
                    first_token,
                    first_logprobs,
                    sampler_state,
                    page_count,
                    token_count,
                    cached_tokens,
                    digest,
                },
            ) => self.done(
                pool,
                conn,
                &node,
                req,
                first_token,
                first_logprobs,
                sampler_state,
                page_count,
                token_count,
                cached_tokens,
                digest,
                out,
            ),
            (Link::Prefill { node }, Message::Abort { req, error }) => {
                self.abort(pool, conn, &node, req, error, out)
            }
            (_, _) => {
                // A message this link may not send: the peer is broken or
                // hostile. Close it; `closed` then ends what ran on it.
                self.stats.protocol_errors_total += 1;
                out.push(DecodeAction::Close { conn });
            }
        }
        self.admit(pool, out);
    }

    /// When no handshake is in progress any more, requests that waited for
    /// one end their transfer: no connection can carry their pages.
    fn settle_handshakes(&mut self, pool: &mut Pool) {
        if self.links.values().any(|l| *l == Link::Handshaking) {
            return;
        }
        let waiting: Vec<RequestId> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.awaiting_handshake)
            .map(|(&k, _)| k)
            .collect();
        for req in waiting {
            self.reqs.get_mut(&req).expect("known").awaiting_handshake = false;
            self.end_transfer(pool, req);
        }
    }

    // ------------------------------------------------------ reservations

    #[allow(clippy::too_many_arguments)]
    fn reserve(
        &mut self,
        pool: &mut Pool,
        conn: ConnId,
        req: RequestId,
        tenant: TenantId,
        prefill: String,
        tokens: Vec<u32>,
        max_tokens: u32,
        gen: GenSpec,
        out: &mut Vec<DecodeAction>,
    ) {
        self.stats.reservations_total += 1;
        let refuse = |s: &mut Self, out: &mut Vec<DecodeAction>, error: Refusal| {
            s.stats.reservations_refused_total += 1;
            out.push(DecodeAction::Send {
                conn,
                msg: Message::Rejected { req, error },
            });
        };
        if self.reqs.contains_key(&req) {
            return refuse(
                self,
                out,
                refusal::bad_request(
                    "duplicate_request",
                    format!("request {req} is already known"),
                ),
            );
        }
        if self.draining {
            return refuse(self, out, refusal::draining(&self.cfg.identity.node));
        }
        // K8 on this node, before anything is allocated.
        if let Err(e) = check_request(
            &tokens,
            max_tokens,
            self.cfg.identity.max_request_tokens,
            self.cfg.vocab,
        ) {
            return refuse(self, out, e);
        }
        if self.reqs.len() >= self.cfg.requests_max {
            return refuse(
                self,
                out,
                refusal::busy(format!(
                    "the decode node runs {} requests (its limit); retry later",
                    self.reqs.len()
                )),
            );
        }
        let ps = self.cfg.identity.layout.page_size;
        let need = pages_for(tokens.len() + max_tokens as usize, ps);
        if need > pool.pages_total() as usize {
            // K8 makes this unreachable (the limit fits the pool); refuse
            // rather than wait forever.
            return refuse(
                self,
                out,
                refusal::internal(format!(
                    "request needs {need} pages, the pool has {}",
                    pool.pages_total()
                )),
            );
        }
        if !self.waiting.is_empty() || need > pool.pages_available() as usize {
            if self.waiting.len() >= self.cfg.waiting_max {
                return refuse(
                    self,
                    out,
                    refusal::busy(format!(
                        "{} reservations are waiting for KV pages on the decode node (limit {}); \
                         retry later",
                        self.waiting.len(),
                        self.cfg.waiting_max
                    )),
                );
            }
            self.waiting.push_back(req);
        }
        let prompt_pages = pages_for(tokens.len(), ps);
        let waiting = self.waiting.back() == Some(&req);
        self.reqs.insert(
            req,
            Req {
                owner: request_owner(req, tenant, &gen),
                gateway: conn,
                prefill,
                link: None,
                tokens,
                max_tokens,
                gen,
                pages: Vec::new(),
                received: vec![None; prompt_pages],
                received_count: 0,
                streamed: 0,
                cached_tokens: 0,
                leased: false,
                awaiting_handshake: false,
                phase: DecodePhase::Waiting,
            },
        );
        if waiting {
            // The newcomer may be the fairest choice (K13).
            self.admit(pool, out);
        } else {
            self.allocate(pool, req, out);
        }
    }

    /// Allocates a waiting request's pages (the caller checked they are
    /// free), leases the prompt's pages to the transfer, answers Reserved.
    fn allocate(&mut self, pool: &mut Pool, req: RequestId, out: &mut Vec<DecodeAction>) {
        let ps = self.cfg.identity.layout.page_size;
        let r = self.reqs.get_mut(&req).expect("allocate a known request");
        let need = pages_for(r.tokens.len() + r.max_tokens as usize, ps);
        let mut pages = Vec::with_capacity(need);
        if let Err(e) = pool.alloc(r.owner, need, &mut pages) {
            let conn = r.gateway;
            self.reqs.remove(&req);
            self.stats.reservations_refused_total += 1;
            out.push(DecodeAction::Send {
                conn,
                msg: Message::Rejected {
                    req,
                    error: refusal::internal(format!("KV allocation failed: {e}")),
                },
            });
            return;
        }
        for &h in &pages[..r.prompt_pages()] {
            pool.lease(h, r.owner)
                .expect("a page allocated this instant can be leased");
        }
        r.leased = true;
        r.pages = pages;
        r.phase = DecodePhase::Receiving;
        out.push(DecodeAction::Send {
            conn: r.gateway,
            msg: Message::Reserved {
                req,
                pages: r
                    .pages
                    .iter()
                    .map(|h| WirePage {
                        index: h.index,
                        epoch: h.epoch,
                    })
                    .collect(),
            },
        });
    }

    /// Gives free pages to waiting reservations, fairly between tenants
    /// ([`crate::fair`]); stops at the first chosen one that does not fit.
    fn admit(&mut self, pool: &mut Pool, out: &mut Vec<DecodeAction>) {
        let ps = self.cfg.identity.layout.page_size;
        let mut queue = std::mem::take(&mut self.waiting);
        queue.retain(|w| self.reqs.contains_key(w));
        let mut held: BTreeMap<TenantId, u64> = BTreeMap::new();
        for r in self.reqs.values() {
            *held.entry(r.owner.tenant).or_default() += r.pages.len() as u64;
        }
        let waiting = queue
            .iter()
            .map(|w| waiting_of(&self.reqs[w].owner, &self.reqs[w].gen))
            .collect();
        fair::admit(&mut queue, waiting, held, |req| {
            let r = &self.reqs[&req];
            let need = pages_for(r.tokens.len() + r.max_tokens as usize, ps);
            if need > pool.pages_available() as usize {
                return None;
            }
            self.allocate(pool, req, out);
            Some(self.reqs.get(&req).map_or(0, |r| r.pages.len() as u64))
        });
        self.waiting = queue;
    }

    // ------------------------------------------------------------ pages

    fn page(
        &mut self,
        pool: &mut Pool,
        conn: ConnId,
        node: &str,
        msg: Message,
        out: &mut Vec<DecodeAction>,
    ) {
        let Message::Page {
            req,
            position,
            dst,
            slots,
            checksum,
            canary,
            bytes,
        } = msg
        else {
            unreachable!("page() takes Page messages")
        };
        let Some(r) = self.reqs.get_mut(&req) else {
            // A request that ended here: its pages may be someone else's
            // now. Never written (K2 fence).
            self.stats.pages_fenced_total += 1;
            return;
        };
        if r.prefill != node {
            // Another prefill node writing this request's pages.
            self.stats.pages_fenced_total += 1;
            return;
        }
        match r.link {
            None => r.link = Some(conn),
            Some(l) if l != conn => {
                self.stats.pages_fenced_total += 1;
                return;
            }
            Some(_) => {}
        }
        match r.phase {
            DecodePhase::Receiving => {}
            DecodePhase::Draining => {
                self.stats.pages_late_total += 1;
                return;
            }
            DecodePhase::Waiting | DecodePhase::Decoding => {
                self.stats.protocol_errors_total += 1;
                self.stats.pages_fenced_total += 1;
                let e = refusal::upstream(
                    "transfer_protocol",
                    format!("prefill sent a page for request {req}, which is not receiving"),
                );
                return self.fail(pool, req, e, out);
            }
        }
        self.stats.pages_received_total += 1;
        self.stats.page_bytes_received_total += bytes.len() as u64;
        let pos = position as usize;
        let ps = self.cfg.identity.layout.page_size;
        if pos >= r.prompt_pages() {
            self.stats.protocol_errors_total += 1;
            let e = refusal::upstream(
                "transfer_protocol",
                format!(
                    "page position {pos} is outside the prompt's {} pages",
                    r.prompt_pages()
                ),
            );
            return self.fail(pool, req, e, out);
        }
        let mut h = r.pages[pos];
        // The epoch the sender bound its canary and checksum to: the
        // reservation's, unless a mutation believes the sender.
        let mut bound_epoch = h.epoch;
        if dst.index != h.index || dst.epoch != h.epoch {
            if mutated!(self, skip_epoch_check) && dst.index == h.index {
                bound_epoch = dst.epoch;
            } else if mutated!(self, skip_handle_check) {
                // The mutation: write wherever the page says, at the
                // page's current epoch.
                h = PageRef {
                    index: dst.index,
                    epoch: pool.epoch_of(dst.index).unwrap_or(dst.epoch),
                };
                bound_epoch = h.epoch;
            } else {
                self.stats.pages_fenced_total += 1;
                let e = refusal::upstream(
                    "transfer_fenced",
                    format!(
                        "a page for request {req} named page {} epoch {}, not the reserved page {} \
                         epoch {}: fenced",
                        dst.index, dst.epoch, h.index, h.epoch
                    ),
                );
                return self.fail(pool, req, e, out);
            }
        }
        let owner = r.owner;
        let mut expected_slots = slots_at(r.tokens.len(), ps, pos);
        if mutated!(self, skip_completeness_check) {
            expected_slots = slots as usize;
        }
        if slots as usize != expected_slots {
            self.stats.incomplete_transfers_total += 1;
            let e = refusal::upstream(
                "transfer_incomplete",
                format!(
                    "page {pos} of request {req} carries {slots} token slots, the prompt needs \
                     {expected_slots}"
                ),
            );
            return self.fail(pool, req, e, out);
        }
        // K7: the sender's canary must be the one derived from our owner,
        // epoch and index.
        if canary != canary_value(owner, bound_epoch, h.index) {
            self.stats.canary_failures_total += 1;
            let e = refusal::upstream(
                "canary_mismatch",
                format!("page {pos} of request {req} carries another page's canary"),
            );
            return self.fail(pool, req, e, out);
        }
        // K6: bytes bound to (request, destination epoch, position).
        if pool
            .verify_checksum(req, bound_epoch, position, &bytes, checksum)
            .is_err()
        {
            self.stats.checksum_failures_total += 1;
            let e = refusal::upstream(
                "checksum_mismatch",
                format!("page {pos} of request {req} failed its checksum: the KV was corrupted in transfer"),
            );
            return self.fail(pool, req, e, out);
        }
        let import_owner = if mutated!(self, skip_handle_check) {
            pool.owner_of(h.index).unwrap_or(owner)
        } else {
            owner
        };
        match pool.import_page(h, import_owner, &bytes, expected_slots) {
            Ok(()) => {}
            Err(e) => {
                if matches!(e, KvError::AlreadyWritten { .. }) {
                    self.stats.duplicate_pages_total += 1;
                }
                let e = refusal::upstream(
                    "transfer_refused",
                    format!("page {pos} of request {req} was refused: {e}"),
                );
                return self.fail(pool, req, e, out);
            }
        }
        let r = self.reqs.get_mut(&req).expect("still known");
        if r.received[pos].is_none() {
            r.received_count += 1;
        }
        r.received[pos] = Some(checksum);
        if r.received_count
            .is_multiple_of(self.cfg.ack_every_pages.max(1))
            || r.received_count as usize == r.prompt_pages()
        {
            out.push(DecodeAction::Send {
                conn,
                msg: Message::Ack {
                    req,
                    pages: r.received_count,
                },
            });
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn done(
        &mut self,
        pool: &mut Pool,
        conn: ConnId,
        node: &str,
        req: RequestId,
        first_token: u32,
        first_logprobs: Option<WireLogprobs>,
        sampler_state: u64,
        page_count: u32,
        token_count: u32,
        cached_tokens: u32,
        digest: u64,
        out: &mut Vec<DecodeAction>,
    ) {
        // Whatever happens, prefill may free its side now.
        out.push(DecodeAction::Send {
            conn,
            msg: Message::Closed { req },
        });
        let Some(r) = self.reqs.get_mut(&req) else {
            return;
        };
        if r.prefill != node || r.link.is_some_and(|l| l != conn) {
            self.stats.protocol_errors_total += 1;
            return;
        }
        r.link = Some(conn);
        match r.phase {
            DecodePhase::Receiving => {}
            DecodePhase::Draining => {
                self.end_transfer(pool, req);
                return;
            }
            DecodePhase::Waiting | DecodePhase::Decoding => {
                self.stats.protocol_errors_total += 1;
                let e = refusal::upstream(
                    "transfer_protocol",
                    format!("prefill finished request {req}, which is not receiving"),
                );
                self.fail(pool, req, e, out);
                return;
            }
        }
        // K10: every prompt page arrived, exactly once (import_page refused
        // any second write), and the sender agrees on what it sent.
        let prompt_pages = r.prompt_pages();
        let all = r.received.iter().all(Option::is_some);
        let complete = all
            && page_count as usize == prompt_pages
            && token_count as usize == r.tokens.len()
            && digest
                == transfer_digest(
                    &r.received
                        .iter()
                        .map(|c| c.unwrap_or(0))
                        .collect::<Vec<_>>(),
                );
        let missing = r.received.iter().filter(|c| c.is_none()).count();
        if !complete && !mutated!(self, skip_completeness_check) {
            self.stats.incomplete_transfers_total += 1;
            let e = refusal::upstream(
                "transfer_incomplete",
                format!(
                    "incomplete transfer for request {req}: {missing} of {prompt_pages} prompt \
                     pages missing; prefill reported {page_count} pages and {token_count} tokens \
                     for a {}-token prompt. No tokens were generated",
                    r.tokens.len()
                ),
            );
            self.fail_ended(pool, req, e, out);
            return;
        }
        // K7 on our own memory: every page still carries its canary.
        let r = &self.reqs[&req];
        let canaries_ok = mutated!(self, skip_own_canary_check)
            || r.pages
                .iter()
                .all(|&h| pool.check_canary(h, r.owner).is_ok());
        if !canaries_ok {
            self.stats.canary_failures_total += 1;
            let e = refusal::upstream(
                "canary_mismatch",
                format!("a KV page of request {req} failed its canary before decode"),
            );
            self.fail_ended(pool, req, e, out);
            return;
        }
        self.end_transfer(pool, req);
        self.stats.transfers_completed_total += 1;
        let r = self.reqs.get_mut(&req).expect("still known");
        r.phase = DecodePhase::Decoding;
        // Only reported to the client; never more than the prompt.
        r.cached_tokens = cached_tokens.min(r.tokens.len() as u32);
        out.push(DecodeAction::StartDecode(Box::new(DecodeStart {
            req,
            owner: r.owner,
            conn: r.gateway,
            tokens: r.tokens.clone(),
            max_tokens: r.max_tokens,
            gen: r.gen.clone(),
            pages: r.pages.clone(),
            first_token,
            first_logprobs,
            sampler_state,
        })));
    }

    fn abort(
        &mut self,
        pool: &mut Pool,
        conn: ConnId,
        node: &str,
        req: RequestId,
        error: Refusal,
        out: &mut Vec<DecodeAction>,
    ) {
        self.stats.aborts_received_total += 1;
        out.push(DecodeAction::Send {
            conn,
            msg: Message::Closed { req },
        });
        let Some(r) = self.reqs.get_mut(&req) else {
            return;
        };
        if r.prefill != node || r.link.is_some_and(|l| l != conn) {
            self.stats.protocol_errors_total += 1;
            return;
        }
        r.link = Some(conn);
        if r.phase == DecodePhase::Receiving {
            // Prefill's original error goes to the client (K9).
            self.fail_ended(pool, req, error, out);
        }
        self.end_transfer(pool, req);
    }

    // ---------------------------------------------- ends of a request

    /// Ends the transfer of a request: its prompt pages are no longer
    /// leased (frees that were deferred complete now). A draining request
    /// is then gone.
    fn end_transfer(&mut self, pool: &mut Pool, req: RequestId) {
        let Some(r) = self.reqs.get_mut(&req) else {
            return;
        };
        if r.leased {
            r.leased = false;
            for &h in &r.pages[..r.prompt_pages()] {
                let _ = pool.release_lease(h, r.owner);
            }
        }
        if r.phase == DecodePhase::Draining {
            self.reqs.remove(&req);
        }
    }

    fn free_pages(pool: &mut Pool, r: &Req) {
        for &h in &r.pages {
            match pool.free(h, r.owner) {
                Ok(FreeOutcome::Freed | FreeOutcome::Deferred) => {}
                Err(e) => debug_assert!(false, "freeing a request's own page failed: {e}"),
            }
        }
    }

    /// A request ends without tokens: the gateway gets `error`; pages are
    /// freed (leased ones when the transfer ends: prefill is asked to stop).
    fn fail(
        &mut self,
        pool: &mut Pool,
        req: RequestId,
        error: Refusal,
        out: &mut Vec<DecodeAction>,
    ) {
        let Some(r) = self.reqs.get(&req) else {
            return;
        };
        out.push(DecodeAction::Send {
            conn: r.gateway,
            msg: Message::Rejected { req, error },
        });
        self.drop_request(pool, req, true, out);
    }

    /// As [`Self::fail`], when the transfer is known to be over (prefill's
    /// Done or Abort arrived, or its link closed): nothing to wait for.
    fn fail_ended(
        &mut self,
        pool: &mut Pool,
        req: RequestId,
        error: Refusal,
        out: &mut Vec<DecodeAction>,
    ) {
        let Some(r) = self.reqs.get(&req) else {
            return;
        };
        out.push(DecodeAction::Send {
            conn: r.gateway,
            msg: Message::Rejected { req, error },
        });
        self.drop_request(pool, req, false, out);
        self.end_transfer(pool, req);
    }

    /// Cancel from the gateway (or its link closed).
    fn cancel(&mut self, pool: &mut Pool, req: RequestId, out: &mut Vec<DecodeAction>) {
        let Some(phase) = self.phase_of(req) else {
            return;
        };
        match phase {
            DecodePhase::Waiting => self.stats.cancels_waiting_total += 1,
            DecodePhase::Receiving => self.stats.cancels_receiving_total += 1,
            DecodePhase::Decoding => self.stats.cancels_decoding_total += 1,
            DecodePhase::Draining => self.stats.cancels_draining_total += 1,
        }
        self.drop_request(pool, req, true, out);
    }

    /// Takes a request out of service in whatever phase it is. With
    /// `ask_prefill`, a receiving request's prefill is asked to stop.
    fn drop_request(
        &mut self,
        pool: &mut Pool,
        req: RequestId,
        ask_prefill: bool,
        out: &mut Vec<DecodeAction>,
    ) {
        let Some(r) = self.reqs.get_mut(&req) else {
            return;
        };
        match r.phase {
            DecodePhase::Waiting => {
                self.waiting.retain(|&w| w != req);
                self.reqs.remove(&req);
            }
            DecodePhase::Decoding => {
                out.push(DecodeAction::StopDecode { req });
                let r = self.reqs.remove(&req).expect("known");
                Self::free_pages(pool, &r);
            }
            DecodePhase::Draining => {}
            DecodePhase::Receiving => {
                r.phase = DecodePhase::Draining;
                let r = &self.reqs[&req];
                Self::free_pages(pool, r);
                // Ask prefill to stop, and wait for its last word (Done or
                // Abort) or for the link to close: until then the pages stay
                // leased, so the deferred free keeps them off the free list.
                let link = r
                    .link
                    .or_else(|| self.prefill_links.get(&r.prefill).copied());
                let handshaking = self.links.values().any(|l| *l == Link::Handshaking);
                match link {
                    Some(_) if !ask_prefill => {}
                    Some(conn) => {
                        self.reqs.get_mut(&req).expect("known").link = Some(conn);
                        out.push(DecodeAction::Send {
                            conn,
                            msg: Message::Cancel { req },
                        });
                        if mutated!(self, free_without_drain) {
                            let r = self.reqs.get_mut(&req).expect("known");
                            r.leased = false;
                            for &h in &r.pages[..r.prompt_pages()] {
                                let _ = pool.release_lease(h, r.owner);
                            }
                        }
                    }
                    None if ask_prefill && handshaking => {
                        self.reqs.get_mut(&req).expect("known").awaiting_handshake = true;
                    }
                    _ => {
                        // No link to that prefill node: nothing can be in
                        // flight; a later connection's pages find no request
                        // and are fenced.
                        self.end_transfer(pool, req);
                    }
                }
            }
        }
    }

    /// Takes a decoding request out and frees its pages (`None` if it is
    /// not decoding: cancelled meanwhile, or unknown).
    fn end_decoding(&mut self, pool: &mut Pool, req: RequestId) -> Option<Req> {
        if self.reqs.get(&req)?.phase != DecodePhase::Decoding {
            return None;
        }
        let r = self.reqs.remove(&req)?;
        Self::free_pages(pool, &r);
        Some(r)
    }

    /// The engine generated a token of a decoding request: stream it to
    /// the gateway on `conn`, numbered (the first is prefill's).
    pub fn stream_token(
        &mut self,
        req: RequestId,
        conn: ConnId,
        id: u32,
        text: String,
        logprobs: Option<WireLogprobs>,
        out: &mut Vec<DecodeAction>,
    ) {
        let Some(r) = self.reqs.get_mut(&req) else {
            return;
        };
        let index = r.streamed;
        r.streamed += 1;
        out.push(DecodeAction::Send {
            conn,
            msg: Message::Token {
                req,
                index,
                id,
                text,
                logprobs,
            },
        });
    }

    /// The decode loop finished a request: free its pages, tell the gateway.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_finished(
        &mut self,
        pool: &mut Pool,
        req: RequestId,
        finish: u8,
        completion_tokens: u32,
        prediction: PredictionCounts,
        tail_text: String,
        out: &mut Vec<DecodeAction>,
    ) {
        let Some(r) = self.end_decoding(pool, req) else {
            return;
        };
        self.stats.decodes_finished_total += 1;
        out.push(DecodeAction::Send {
            conn: r.gateway,
            msg: Message::Finished {
                req,
                finish,
                prompt_tokens: r.tokens.len() as u32,
                cached_tokens: r.cached_tokens,
                completion_tokens,
                streamed: r.streamed,
                prediction,
                tail_text,
            },
        });
        self.admit(pool, out);
    }

    /// The decode loop failed a request (e.g. a refused KV access).
    pub fn decode_failed(
        &mut self,
        pool: &mut Pool,
        req: RequestId,
        error: Refusal,
        out: &mut Vec<DecodeAction>,
    ) {
        let Some(r) = self.end_decoding(pool, req) else {
            return;
        };
        self.stats.decodes_failed_total += 1;
        out.push(DecodeAction::Send {
            conn: r.gateway,
            msg: Message::Rejected { req, error },
        });
        self.admit(pool, out);
    }
}
