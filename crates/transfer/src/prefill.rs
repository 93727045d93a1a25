//! The prefill side: admission (K8 again, on this node), computing the
//! prompt's KV, sending it to decode in bounded batches with checksums and
//! canaries, and deferred release of its own pages (K4).
//!
//! Per request:
//!
//! ```text
//! Prefill ─▶ Queued ─(own pages free)─▶ Computing ─(first token)─▶ Ready ─(link up)─▶ Sending ─(last page)─▶ Closing ─(decode's Closed)─▶ gone
//!    │ refused: Rejected to the gateway with the original error (no placeholder exists)
//! ```
//!
//! A page is leased from the moment it is exported until decode's `Closed`
//! (or the link's end): a cancel frees the request's pages at once and the
//! pool defers the free of every page the transfer may still touch.
//!
//! **Prefix cache (K11).** With [`PrefillConfig::prefix_keys`] set, a
//! request starts from the longest prefix of whole pages its scope has
//! cached (acquired, read-only), the engine computes only the rest, and the
//! prompt's full pages are published when it is computed (before any is
//! leased to the transfer). Decode still receives every page: reuse saves
//! prefill's compute, never a transfer. At the request's end its cached
//! pages are released (deepest first), its private ones freed; a lease on
//! a cached page keeps it from eviction like it defers a free.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use kv::{
    canary_value, page_checksum, FreeOutcome, Owner, PageRef, Pool, PrefixKeys, RequestId, Scope,
    TenantId,
};

use crate::common::{
    check_peer, check_request, pages_for, refusal, request_owner, slots_at, transfer_digest,
    waiting_of, ConnId, Identity, PeerHello,
};
use crate::fair;
use crate::wire::{
    GenSpec, Message, Refusal, WireLogprobs, WirePage, ROLE_DECODE, ROLE_GATEWAY, ROLE_PREFILL,
};

/// Limits and identity of a prefill node.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PrefillConfig {
    pub identity: Identity,
    pub vocab: u32,
    /// Requests known at once.
    pub requests_max: usize,
    /// Requests waiting for free pages (chosen fairly between tenants,
    /// [`crate::fair`]); beyond it: 429.
    pub queue_max: usize,
    /// Pages sent and not yet acknowledged, per request (the bounded
    /// transfer batch).
    pub window_pages: u32,
    /// Cancelled request ids remembered so that a Prefill arriving after
    /// its Cancel is refused; older ones are forgotten (a forgotten one
    /// would be computed and its pages fenced at decode).
    pub tombstones_max: usize,
    /// The prefix cache's keys; `None`: no prefix cache.
    pub prefix_keys: Option<PrefixKeys>,
}

/// Test-only mutations (see [`crate::decode::DecodeMutations`]).
#[cfg(any(test, feature = "mutations"))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PrefillMutations {
    /// The incident: a request over this node's limit is not refused but
    /// replaced by a one-token placeholder, computed and reported complete.
    pub placeholder: bool,
    /// Every request in one cache scope, whatever its tenant: tenants share
    /// cached pages (the side channel K11 forbids).
    pub one_cache_scope: bool,
    /// Cached pages a request acquired are never released (a reference
    /// leak: they can never be evicted).
    pub keep_cache_refs: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PrefillPhase {
    Queued,
    Computing,
    Ready,
    Sending,
    Closing,
}

/// A prompt to compute: the engine fills `pages` with the KV of `tokens`
/// and samples the first token, then calls [`PrefillNode::computed`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ComputeJob {
    pub req: RequestId,
    pub owner: Owner,
    pub tokens: Vec<u32>,
    pub gen: GenSpec,
    pub pages: Vec<PageRef>,
    /// Leading prompt positions whose KV `pages` already hold (cached
    /// pages, read-only): compute from here.
    pub cached_tokens: u32,
}

// As `DecodeAction`: most actions are sends, moved once.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PrefillAction {
    Send {
        conn: ConnId,
        msg: Message,
    },
    Close {
        conn: ConnId,
    },
    /// Open a connection to a decode node (`host:port`); report
    /// [`PrefillNode::connected`] with the address, or
    /// [`PrefillNode::connect_failed`].
    Connect {
        addr: String,
    },
    Compute(Box<ComputeJob>),
    /// Stop computing a request now; the machine frees its pages.
    StopCompute {
        req: RequestId,
    },
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PrefillStats {
    pub prefills_total: u64,
    pub prefills_refused_total: u64,
    pub pages_sent_total: u64,
    pub page_bytes_sent_total: u64,
    pub transfers_done_total: u64,
    pub transfers_aborted_total: u64,
    pub cancels_queued_total: u64,
    pub cancels_computing_total: u64,
    pub cancels_sending_total: u64,
    pub cancels_closing_total: u64,
    pub cancels_unknown_total: u64,
    pub decode_links_lost_total: u64,
    pub connect_failures_total: u64,
    pub handshakes_refused_total: u64,
    pub protocol_errors_total: u64,
    /// Prefix cache: prompts looked up, their tokens, and what was reused.
    pub cache_queries_total: u64,
    pub cache_query_tokens_total: u64,
    pub cache_hit_pages_total: u64,
    pub cache_hit_tokens_total: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Link {
    /// A connection that dialled us, before its Hello.
    Incoming,
    Gateway,
    /// Our connection to a decode node at `addr`; `up` after its Hello.
    Decode {
        addr: String,
        up: bool,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct First {
    token: u32,
    logprobs: Option<WireLogprobs>,
    sampler_state: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Req {
    owner: Owner,
    gateway: ConnId,
    decode: String,
    tokens: Vec<u32>,
    gen: GenSpec,
    dst: Vec<WirePage>,
    own: Vec<PageRef>,
    /// Which of `own` are cached pages (released, not freed).
    shared: Vec<bool>,
    /// Prefix-cache keys of the prompt's full pages (empty: no cache).
    keys: Vec<u64>,
    /// Prompt tokens taken from the cache.
    cached_tokens: u32,
    /// Own pages already freed (their free may be deferred by leases).
    freed: bool,
    sent: u32,
    acked: u32,
    checksums: Vec<u64>,
    first: Option<First>,
    phase: PrefillPhase,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PrefillNode {
    cfg: PrefillConfig,
    links: BTreeMap<ConnId, Link>,
    /// Decode links by address: the connection, or `None` while dialling.
    decode_links: BTreeMap<String, Option<ConnId>>,
    reqs: BTreeMap<RequestId, Req>,
    queue: VecDeque<RequestId>,
    tombstones: VecDeque<RequestId>,
    tombstone_set: BTreeSet<RequestId>,
    /// Draining (SIGTERM): new requests are refused with
    /// [`refusal::draining`]; what is in flight finishes.
    draining: bool,
    stats: PrefillStats,
    #[cfg(any(test, feature = "mutations"))]
    mutations: PrefillMutations,
}

impl PrefillNode {
    pub fn new(cfg: PrefillConfig) -> PrefillNode {
        PrefillNode {
            cfg,
            links: BTreeMap::new(),
            decode_links: BTreeMap::new(),
            reqs: BTreeMap::new(),
            queue: VecDeque::new(),
            tombstones: VecDeque::new(),
            tombstone_set: BTreeSet::new(),
            draining: false,
            stats: PrefillStats::default(),
            #[cfg(any(test, feature = "mutations"))]
            mutations: PrefillMutations::default(),
        }
    }

    #[cfg(any(test, feature = "mutations"))]
    pub fn set_mutations(&mut self, m: PrefillMutations) {
        self.mutations = m;
    }

    pub fn config(&self) -> &PrefillConfig {
        &self.cfg
    }

    pub fn stats(&self) -> PrefillStats {
        self.stats
    }

    pub fn phase_of(&self, req: RequestId) -> Option<PrefillPhase> {
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

    /// Transfers in flight out of this node (computed, sending, or waiting
    /// for the last acknowledgement), for the operator console: pages
    /// acknowledged so far of the prompt's.
    pub fn transfers(&self, out: &mut Vec<request::console::TransferView>) {
        for (&req, r) in &self.reqs {
            let phase = match r.phase {
                PrefillPhase::Ready => "ready",
                PrefillPhase::Sending => "sending",
                PrefillPhase::Closing => "closing",
                PrefillPhase::Queued | PrefillPhase::Computing => continue,
            };
            out.push(request::console::TransferView {
                request: req.0,
                tenant: r.owner.tenant.0,
                from: self.cfg.identity.node.clone(),
                to: r.decode.clone(),
                pages_done: r.acked,
                pages_total: r.dst.len() as u32,
                phase: phase.into(),
            });
        }
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

    pub fn request_phases(&self) -> impl Iterator<Item = (RequestId, PrefillPhase)> + '_ {
        self.reqs.iter().map(|(&k, r)| (k, r.phase))
    }

    /// Transfers that may still write decode's pages: `(request, link,
    /// destination pages)` of every request sending (for invariant checks).
    pub fn sending(&self) -> impl Iterator<Item = (RequestId, Option<ConnId>, &[WirePage])> + '_ {
        self.reqs
            .iter()
            .filter(|(_, r)| r.phase == PrefillPhase::Sending)
            .map(|(&k, r)| {
                (
                    k,
                    self.decode_links.get(&r.decode).copied().flatten(),
                    r.dst.as_slice(),
                )
            })
    }

    /// The pages each request holds in this node's pool and has not freed
    /// yet: `(request, owner, pages, which are cached)` (for invariant
    /// checks).
    pub fn holdings(&self) -> impl Iterator<Item = (RequestId, Owner, &[PageRef], &[bool])> + '_ {
        self.reqs
            .iter()
            .filter(|(_, r)| !r.freed)
            .map(|(&k, r)| (k, r.owner, r.own.as_slice(), r.shared.as_slice()))
    }

    // ------------------------------------------------------------ links

    /// A gateway dialled us.
    pub fn accepted(&mut self, conn: ConnId, out: &mut Vec<PrefillAction>) {
        self.links.insert(conn, Link::Incoming);
        out.push(PrefillAction::Send {
            conn,
            msg: self.cfg.identity.hello(ROLE_PREFILL),
        });
    }

    /// Our dial to a decode node succeeded.
    pub fn connected(&mut self, conn: ConnId, addr: &str, out: &mut Vec<PrefillAction>) {
        if self.decode_links.get(addr) != Some(&None) {
            // Nobody is waiting for this connection any more.
            out.push(PrefillAction::Close { conn });
            return;
        }
        self.decode_links.insert(addr.to_string(), Some(conn));
        self.links.insert(
            conn,
            Link::Decode {
                addr: addr.to_string(),
                up: false,
            },
        );
        out.push(PrefillAction::Send {
            conn,
            msg: self.cfg.identity.hello(ROLE_PREFILL),
        });
    }

    /// Our dial to a decode node failed: its requests fail.
    pub fn connect_failed(
        &mut self,
        pool: &mut Pool,
        addr: &str,
        why: &str,
        out: &mut Vec<PrefillAction>,
    ) {
        if self.decode_links.get(addr) != Some(&None) {
            return;
        }
        self.stats.connect_failures_total += 1;
        self.decode_links.remove(addr);
        let e = refusal::upstream(
            "decode_unreachable",
            format!("the prefill node cannot reach the decode node at {addr}: {why}"),
        );
        self.fail_all_on(pool, addr, e, out);
    }

    pub fn closed(&mut self, pool: &mut Pool, conn: ConnId, out: &mut Vec<PrefillAction>) {
        let Some(link) = self.links.remove(&conn) else {
            return;
        };
        match link {
            Link::Incoming => {}
            Link::Gateway => {
                let reqs: Vec<RequestId> = self
                    .reqs
                    .iter()
                    .filter(|(_, r)| r.gateway == conn)
                    .map(|(&k, _)| k)
                    .collect();
                for req in reqs {
                    self.cancel(pool, req, None, out);
                }
            }
            Link::Decode { addr, .. } => {
                if self.decode_links.get(&addr) == Some(&Some(conn)) {
                    self.decode_links.remove(&addr);
                }
                self.stats.decode_links_lost_total += 1;
                let e = refusal::upstream(
                    "decode_lost",
                    format!("the link to the decode node at {addr} was lost"),
                );
                self.fail_all_on(pool, &addr, e, out);
            }
        }
        self.admit(pool, out);
    }

    /// Every request bound for `addr` fails (its link is gone); pages are
    /// released: nothing more is read for a transfer whose link is gone.
    fn fail_all_on(
        &mut self,
        pool: &mut Pool,
        addr: &str,
        error: Refusal,
        out: &mut Vec<PrefillAction>,
    ) {
        let reqs: Vec<RequestId> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.decode == addr)
            .map(|(&k, _)| k)
            .collect();
        for req in reqs {
            let r = &self.reqs[&req];
            if r.phase != PrefillPhase::Closing {
                // After Done the gateway hears from decode; before, from us.
                out.push(PrefillAction::Send {
                    conn: r.gateway,
                    msg: Message::Rejected {
                        req,
                        error: error.clone(),
                    },
                });
            }
            if r.phase == PrefillPhase::Computing {
                out.push(PrefillAction::StopCompute { req });
            }
            self.finish(pool, req);
        }
    }

    pub fn message(
        &mut self,
        pool: &mut Pool,
        conn: ConnId,
        msg: Message,
        out: &mut Vec<PrefillAction>,
    ) {
        let Some(link) = self.links.get(&conn).cloned() else {
            return;
        };
        match (link, msg) {
            (_, Message::Heartbeat { .. } | Message::Load { .. }) => {}
            (Link::Incoming, msg @ Message::Hello { .. }) => {
                let peer = PeerHello::from_message(&msg).expect("a Hello");
                match check_peer(&self.cfg.identity, &peer, &[ROLE_GATEWAY], false) {
                    Ok(()) => {
                        self.links.insert(conn, Link::Gateway);
                    }
                    Err(why) => self.refuse_link(conn, why, out),
                }
            }
            (Link::Decode { addr, up: false }, msg @ Message::Hello { .. }) => {
                let peer = PeerHello::from_message(&msg).expect("a Hello");
                match check_peer(&self.cfg.identity, &peer, &[ROLE_DECODE], true) {
                    Ok(()) => {
                        self.links.insert(
                            conn,
                            Link::Decode {
                                addr: addr.clone(),
                                up: true,
                            },
                        );
                        let ready: Vec<RequestId> = self
                            .reqs
                            .iter()
                            .filter(|(_, r)| r.decode == addr && r.phase == PrefillPhase::Ready)
                            .map(|(&k, _)| k)
                            .collect();
                        for req in ready {
                            self.start_sending(pool, req, conn, out);
                        }
                    }
                    Err(why) => {
                        self.refuse_link(conn, why.clone(), out);
                        self.decode_links.remove(&addr);
                        self.fail_all_on(
                            pool,
                            &addr,
                            refusal::upstream("pairing_refused", why),
                            out,
                        );
                    }
                }
            }
            (Link::Decode { addr, .. }, Message::Refuse { message }) => {
                self.stats.handshakes_refused_total += 1;
                self.links.remove(&conn);
                self.decode_links.remove(&addr);
                out.push(PrefillAction::Close { conn });
                self.fail_all_on(
                    pool,
                    &addr,
                    refusal::upstream("pairing_refused", message),
                    out,
                );
            }
            (
                Link::Gateway,
                Message::Prefill {
                    req,
                    tenant,
                    decode,
                    tokens,
                    max_tokens,
                    gen,
                    pages,
                },
            ) => self.prefill(
                pool, conn, req, tenant, decode, tokens, max_tokens, gen, pages, out,
            ),
            (Link::Gateway, Message::Cancel { req }) => {
                if self.reqs.get(&req).is_none_or(|r| r.gateway == conn) {
                    self.cancel(pool, req, None, out);
                }
            }
            (Link::Decode { up: true, .. }, Message::Cancel { req }) => {
                self.cancel(pool, req, Some(conn), out)
            }
            (Link::Decode { up: true, .. }, Message::Ack { req, pages }) => {
                if let Some(r) = self.reqs.get_mut(&req) {
                    r.acked = r.acked.max(pages.min(r.sent));
                    if r.phase == PrefillPhase::Sending {
                        self.pump(pool, req, conn, out);
                    }
                }
            }
            (Link::Decode { up: true, addr }, Message::Closed { req }) => {
                if self.reqs.get(&req).is_some_and(|r| r.decode == addr) {
                    let phase = self.reqs[&req].phase;
                    if phase == PrefillPhase::Sending || phase == PrefillPhase::Closing {
                        self.finish(pool, req);
                    }
                }
            }
            (_, _) => {
                self.stats.protocol_errors_total += 1;
                out.push(PrefillAction::Close { conn });
            }
        }
        self.admit(pool, out);
    }

    fn refuse_link(&mut self, conn: ConnId, why: String, out: &mut Vec<PrefillAction>) {
        self.stats.handshakes_refused_total += 1;
        self.links.remove(&conn);
        out.push(PrefillAction::Send {
            conn,
            msg: Message::Refuse { message: why },
        });
        out.push(PrefillAction::Close { conn });
    }

    fn decode_conn_up(&self, addr: &str) -> Option<ConnId> {
        let conn = (*self.decode_links.get(addr)?)?;
        match self.links.get(&conn) {
            Some(Link::Decode { up: true, .. }) => Some(conn),
            _ => None,
        }
    }

    // --------------------------------------------------------- requests

    #[allow(clippy::too_many_arguments)]
    fn prefill(
        &mut self,
        pool: &mut Pool,
        conn: ConnId,
        req: RequestId,
        tenant: TenantId,
        decode: String,
        mut tokens: Vec<u32>,
        max_tokens: u32,
        gen: GenSpec,
        pages: Vec<WirePage>,
        out: &mut Vec<PrefillAction>,
    ) {
        self.stats.prefills_total += 1;
        if self.draining {
            // Only the gateway hears of it: it cancels decode's reservation
            // and places the request again (an Abort to decode could reach
            // it after the request's next Reserve there).
            self.stats.prefills_refused_total += 1;
            out.push(PrefillAction::Send {
                conn,
                msg: Message::Rejected {
                    req,
                    error: refusal::draining(&self.cfg.identity.node),
                },
            });
            return;
        }
        let refuse = |s: &mut Self, out: &mut Vec<PrefillAction>, error: Refusal| {
            s.stats.prefills_refused_total += 1;
            // Decode learns from us too if we already have a link to it, so
            // it frees the reservation without waiting for the gateway.
            if let Some(dconn) = s.decode_conn_up(&decode) {
                out.push(PrefillAction::Send {
                    conn: dconn,
                    msg: Message::Abort {
                        req,
                        error: error.clone(),
                    },
                });
            }
            out.push(PrefillAction::Send {
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
        if self.tombstone_set.remove(&req) {
            self.tombstones.retain(|&t| t != req);
            return refuse(self, out, refusal::cancelled());
        }
        // K8 on this node, before anything is allocated; the refusal is the
        // client's answer (K9). There is no other path.
        if let Err(e) = check_request(
            &tokens,
            max_tokens,
            self.cfg.identity.max_request_tokens,
            self.cfg.vocab,
        ) {
            if mutated!(self, placeholder) && e.code == "context_length_exceeded" {
                // The incident's bug, for tests only: continue with a
                // one-token placeholder and tell nobody.
                tokens.truncate(1);
            } else {
                return refuse(self, out, e);
            }
        }
        let ps = self.cfg.identity.layout.page_size;
        let need = pages_for(tokens.len(), ps);
        if pages.len() != need && !mutated!(self, placeholder) {
            return refuse(
                self,
                out,
                refusal::bad_request(
                    "transfer_protocol",
                    format!(
                        "{} destination pages for a {}-token prompt, which needs {need}",
                        pages.len(),
                        tokens.len()
                    ),
                ),
            );
        }
        if self.reqs.len() >= self.cfg.requests_max {
            return refuse(
                self,
                out,
                refusal::busy(format!(
                    "the prefill node runs {} requests (its limit); retry later",
                    self.reqs.len()
                )),
            );
        }
        let mut owner = request_owner(req, tenant, &gen);
        if mutated!(self, one_cache_scope) {
            owner.scope = Scope(0);
        }
        let scope = owner.scope;
        let mut keys = Vec::new();
        if let Some(k) = &self.cfg.prefix_keys {
            k.extend(ps as usize, scope, &tokens, &mut keys);
        }
        let queue = !self.queue.is_empty() || !fits(pool, owner, &tokens, &keys, ps);
        if queue && self.queue.len() >= self.cfg.queue_max {
            return refuse(
                self,
                out,
                refusal::busy(format!(
                    "{} prompts are waiting for KV pages on the prefill node (limit {}); retry later",
                    self.queue.len(),
                    self.cfg.queue_max
                )),
            );
        }
        if need > pool.pages_total() as usize {
            return refuse(
                self,
                out,
                refusal::internal(format!(
                    "prompt needs {need} pages, the pool has {}",
                    pool.pages_total()
                )),
            );
        }
        if !self.decode_links.contains_key(&decode) {
            self.decode_links.insert(decode.clone(), None);
            out.push(PrefillAction::Connect {
                addr: decode.clone(),
            });
        }
        let mut dst = pages;
        dst.truncate(need);
        self.reqs.insert(
            req,
            Req {
                owner,
                gateway: conn,
                decode,
                tokens,
                gen,
                dst,
                own: Vec::new(),
                shared: Vec::new(),
                keys,
                cached_tokens: 0,
                freed: false,
                sent: 0,
                acked: 0,
                checksums: Vec::with_capacity(need),
                first: None,
                phase: PrefillPhase::Queued,
            },
        );
        if queue {
            self.queue.push_back(req);
            // The newcomer may be the fairest choice (K13).
            self.admit(pool, out);
        } else {
            self.start_compute(pool, req, out);
        }
    }

    fn start_compute(&mut self, pool: &mut Pool, req: RequestId, out: &mut Vec<PrefillAction>) {
        let ps = self.cfg.identity.layout.page_size;
        let r = self.reqs.get_mut(&req).expect("known");
        let need = pages_for(r.tokens.len(), ps);
        let mut own = Vec::with_capacity(need);
        let hits = cache_hits(pool, r.owner, &r.tokens, &r.keys, ps);
        let acquired = hits
            .iter()
            .try_for_each(|&h| pool.acquire(h, r.owner).map(|()| own.push(h)));
        let allocated = acquired.and_then(|()| pool.alloc(r.owner, need - hits.len(), &mut own));
        if let Err(e) = allocated {
            pool.give_back(r.owner, &own, hits.len());
            let gw = r.gateway;
            self.reqs.remove(&req);
            out.push(PrefillAction::Send {
                conn: gw,
                msg: Message::Rejected {
                    req,
                    error: refusal::internal(format!("KV allocation failed: {e}")),
                },
            });
            return;
        }
        if self.cfg.prefix_keys.is_some() {
            self.stats.cache_queries_total += 1;
            self.stats.cache_query_tokens_total += r.tokens.len() as u64;
            self.stats.cache_hit_pages_total += hits.len() as u64;
            self.stats.cache_hit_tokens_total += (hits.len() * ps as usize) as u64;
        }
        r.own = own;
        r.shared = vec![false; need];
        r.shared[..hits.len()].fill(true);
        r.cached_tokens = (hits.len() * ps as usize) as u32;
        r.phase = PrefillPhase::Computing;
        out.push(PrefillAction::Compute(Box::new(ComputeJob {
            req,
            owner: r.owner,
            tokens: r.tokens.clone(),
            gen: r.gen.clone(),
            pages: r.own.clone(),
            cached_tokens: r.cached_tokens,
        })));
    }

    /// Gives free pages to waiting requests, fairly between tenants
    /// ([`crate::fair`]); stops at the first chosen one that does not fit.
    fn admit(&mut self, pool: &mut Pool, out: &mut Vec<PrefillAction>) {
        let ps = self.cfg.identity.layout.page_size;
        let mut queue = std::mem::take(&mut self.queue);
        queue.retain(|q| self.reqs.contains_key(q));
        let mut held: BTreeMap<TenantId, u64> = BTreeMap::new();
        // Pages a request still holds (a freed one, waiting for decode's
        // last word, gave its private pages back).
        for r in self.reqs.values().filter(|r| !r.freed) {
            *held.entry(r.owner.tenant).or_default() += r.own.len() as u64;
        }
        let waiting = queue
            .iter()
            .map(|q| waiting_of(&self.reqs[q].owner, &self.reqs[q].gen))
            .collect();
        fair::admit(&mut queue, waiting, held, |req| {
            let r = &self.reqs[&req];
            if !fits(pool, r.owner, &r.tokens, &r.keys, ps) {
                return None;
            }
            self.start_compute(pool, req, out);
            Some(self.reqs.get(&req).map_or(0, |r| r.own.len() as u64))
        });
        self.queue = queue;
    }

    /// The engine computed a request's prompt KV and its first token.
    pub fn computed(
        &mut self,
        pool: &mut Pool,
        req: RequestId,
        first_token: u32,
        first_logprobs: Option<WireLogprobs>,
        sampler_state: u64,
        out: &mut Vec<PrefillAction>,
    ) {
        let Some(r) = self.reqs.get_mut(&req) else {
            return;
        };
        if r.phase != PrefillPhase::Computing {
            return;
        }
        r.first = Some(First {
            token: first_token,
            logprobs: first_logprobs,
            sampler_state,
        });
        // Every slot of the prompt's full pages is written now: offer them
        // to the cache, before any is leased (a leased page cannot enter
        // it). A page whose key another request cached first stays private.
        // A refusal is counted by the pool; the page stays private.
        let n = r.keys.len();
        pool.publish_pages(r.owner, &mut r.own, &mut r.shared, &r.keys, n);
        r.phase = PrefillPhase::Ready;
        let addr = r.decode.clone();
        if let Some(conn) = self.decode_conn_up(&addr) {
            self.start_sending(pool, req, conn, out);
        }
    }

    /// The engine could not compute a request.
    pub fn compute_failed(
        &mut self,
        pool: &mut Pool,
        req: RequestId,
        error: Refusal,
        out: &mut Vec<PrefillAction>,
    ) {
        let Some(r) = self.reqs.get(&req) else {
            return;
        };
        if r.phase != PrefillPhase::Computing {
            return;
        }
        out.push(PrefillAction::Send {
            conn: r.gateway,
            msg: Message::Rejected {
                req,
                error: error.clone(),
            },
        });
        if let Some(dconn) = self.decode_conn_up(&r.decode) {
            out.push(PrefillAction::Send {
                conn: dconn,
                msg: Message::Abort { req, error },
            });
        }
        self.finish(pool, req);
        self.admit(pool, out);
    }

    fn start_sending(
        &mut self,
        pool: &mut Pool,
        req: RequestId,
        conn: ConnId,
        out: &mut Vec<PrefillAction>,
    ) {
        self.reqs.get_mut(&req).expect("known").phase = PrefillPhase::Sending;
        self.pump(pool, req, conn, out);
    }

    /// Sends pages while the window allows; after the last one, `Done`.
    fn pump(
        &mut self,
        pool: &mut Pool,
        req: RequestId,
        conn: ConnId,
        out: &mut Vec<PrefillAction>,
    ) {
        let ps = self.cfg.identity.layout.page_size;
        let data_bytes = pool.shape().data_bytes();
        let window = self.cfg.window_pages.max(1);
        let r = self.reqs.get_mut(&req).expect("known");
        let total = r.dst.len() as u32;
        while r.sent < total && r.sent - r.acked < window {
            let pos = r.sent as usize;
            let h = r.own[pos];
            let dst = r.dst[pos];
            let mut bytes = vec![0u8; data_bytes];
            // The lease outlives the copy: a transport that reads page
            // memory directly (RDMA-class) may still be reading it.
            let exported = pool.lease(h, r.owner).and_then(|()| {
                let e = pool.export_page(h, r.owner, &mut bytes);
                if e.is_err() {
                    let _ = pool.release_lease(h, r.owner);
                }
                e
            });
            let expected = slots_at(r.tokens.len(), ps, pos);
            let slots = match exported {
                Ok(s) if s >= expected => expected,
                Ok(s) => {
                    let _ = pool.release_lease(h, r.owner);
                    let e = refusal::internal(format!(
                        "page {pos} of request {req} holds {s} computed slots, {expected} expected"
                    ));
                    return self.abort_sending(pool, req, conn, e, out);
                }
                Err(e) => {
                    let e = refusal::internal(format!("export of page {pos} failed: {e}"));
                    return self.abort_sending(pool, req, conn, e, out);
                }
            };
            let checksum = page_checksum(req, dst.epoch, pos as u32, &bytes);
            let canary = canary_value(r.owner, dst.epoch, dst.index);
            r.checksums.push(checksum);
            r.sent += 1;
            self.stats.pages_sent_total += 1;
            self.stats.page_bytes_sent_total += bytes.len() as u64;
            out.push(PrefillAction::Send {
                conn,
                msg: Message::Page {
                    req,
                    position: pos as u32,
                    dst,
                    slots: slots as u32,
                    checksum,
                    canary,
                    bytes,
                },
            });
        }
        if r.sent == total {
            let first = r.first.clone().expect("sending implies computed");
            let digest = transfer_digest(&r.checksums);
            r.phase = PrefillPhase::Closing;
            self.stats.transfers_done_total += 1;
            out.push(PrefillAction::Send {
                conn,
                msg: Message::Done {
                    req,
                    first_token: first.token,
                    first_logprobs: first.logprobs,
                    sampler_state: first.sampler_state,
                    page_count: total,
                    token_count: r.tokens.len() as u32,
                    cached_tokens: r.cached_tokens,
                    digest,
                },
            });
        }
    }

    fn abort_sending(
        &mut self,
        pool: &mut Pool,
        req: RequestId,
        conn: ConnId,
        error: Refusal,
        out: &mut Vec<PrefillAction>,
    ) {
        let r = self.reqs.get_mut(&req).expect("known");
        out.push(PrefillAction::Send {
            conn: r.gateway,
            msg: Message::Rejected {
                req,
                error: error.clone(),
            },
        });
        out.push(PrefillAction::Send {
            conn,
            msg: Message::Abort { req, error },
        });
        r.phase = PrefillPhase::Closing;
        self.stats.transfers_aborted_total += 1;
        self.free_own(pool, req);
    }

    /// Cancel from the gateway (`from_decode: None`) or from decode.
    fn cancel(
        &mut self,
        pool: &mut Pool,
        req: RequestId,
        from_decode: Option<ConnId>,
        out: &mut Vec<PrefillAction>,
    ) {
        let Some(r) = self.reqs.get(&req) else {
            self.stats.cancels_unknown_total += 1;
            // Not started (or long gone): a Prefill that comes later is
            // refused; decode, which waits for our last word, gets it.
            if self.tombstone_set.insert(req) {
                self.tombstones.push_back(req);
                while self.tombstones.len() > self.cfg.tombstones_max {
                    if let Some(old) = self.tombstones.pop_front() {
                        self.tombstone_set.remove(&old);
                    }
                }
            }
            if let Some(conn) = from_decode {
                out.push(PrefillAction::Send {
                    conn,
                    msg: Message::Abort {
                        req,
                        error: refusal::cancelled(),
                    },
                });
            }
            return;
        };
        let phase = r.phase;
        let dconn = self.decode_conn_up(&r.decode);
        match phase {
            PrefillPhase::Queued | PrefillPhase::Computing | PrefillPhase::Ready => {
                if phase == PrefillPhase::Queued {
                    self.stats.cancels_queued_total += 1;
                    self.queue.retain(|&q| q != req);
                } else {
                    self.stats.cancels_computing_total += 1;
                }
                if phase == PrefillPhase::Computing {
                    out.push(PrefillAction::StopCompute { req });
                }
                if let Some(conn) = from_decode.or(dconn) {
                    out.push(PrefillAction::Send {
                        conn,
                        msg: Message::Abort {
                            req,
                            error: refusal::cancelled(),
                        },
                    });
                }
                // Nothing was exported: the pages are free at once.
                self.finish(pool, req);
            }
            PrefillPhase::Sending => {
                self.stats.cancels_sending_total += 1;
                let conn = dconn.expect("sending implies a live decode link");
                out.push(PrefillAction::Send {
                    conn,
                    msg: Message::Abort {
                        req,
                        error: refusal::cancelled(),
                    },
                });
                self.stats.transfers_aborted_total += 1;
                self.reqs.get_mut(&req).expect("known").phase = PrefillPhase::Closing;
                // Unsent pages free now, sent ones when decode says Closed.
                self.free_own(pool, req);
            }
            PrefillPhase::Closing => {
                self.stats.cancels_closing_total += 1;
            }
        }
    }

    fn free_own(&mut self, pool: &mut Pool, req: RequestId) {
        let r = self.reqs.get_mut(&req).expect("known");
        if r.freed {
            return;
        }
        r.freed = true;
        // Deepest first, so the cache evicts a prefix's tail before its head.
        for (&h, &shared) in r.own.iter().zip(&r.shared).rev() {
            let outcome = match shared {
                true if mutated!(self, keep_cache_refs) => continue,
                true => pool.release(h, r.owner).map(|()| FreeOutcome::Freed),
                false => pool.free(h, r.owner),
            };
            match outcome {
                Ok(FreeOutcome::Freed | FreeOutcome::Deferred) => {}
                Err(e) => debug_assert!(false, "giving back own page failed: {e}"),
            }
        }
    }

    /// The request is over on this node: release the transfer's leases and
    /// free the pages (deferred frees complete).
    fn finish(&mut self, pool: &mut Pool, req: RequestId) {
        self.free_own(pool, req);
        let r = self.reqs.remove(&req).expect("known");
        for &h in &r.own[..r.sent as usize] {
            let _ = pool.release_lease(h, r.owner);
        }
        self.queue.retain(|&q| q != req);
    }
}

/// The cached pages a request may start from: the longest cached prefix of
/// its prompt's full pages in its scope, short of the last prompt token
/// (always computed: its logits give the first token).
fn cache_hits(pool: &Pool, owner: Owner, tokens: &[u32], keys: &[u64], ps: u32) -> Vec<PageRef> {
    let reusable = (tokens.len().saturating_sub(1) / ps as usize).min(keys.len());
    let mut hits = Vec::new();
    pool.cached_prefix(owner.scope, &keys[..reusable], &mut hits);
    hits
}

/// Whether the pool has room for a request now (K8): its pages less the
/// cached ones it would start from, against what is available once those
/// stop being evictable.
fn fits(pool: &Pool, owner: Owner, tokens: &[u32], keys: &[u64], ps: u32) -> bool {
    let hits = cache_hits(pool, owner, tokens, keys, ps);
    let available = pool.pages_available() as usize - pool.idle_among(&hits);
    pages_for(tokens.len(), ps) - hits.len() <= available
}
