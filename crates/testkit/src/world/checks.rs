//! The checks: after every event (`check_step`) and at the end
//! (`check_end`), on the world's state — pools, ownership, refusals, K4
//! across nodes, the engines — never on what a driver believes.

use super::*;

impl World {
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
            // K3 under speculation: a decoding request's pages hold exactly
            // the rows of its sequence but the last token (sampled, not yet
            // run) — a rejected draft's row was rolled back.
            let ps = self.params.page_size as usize;
            // (A request the machine ended is the check below's.)
            for (req, d) in &self.decode.engine.decoding {
                if self.decode.machine.phase_of(*req).is_none() {
                    continue;
                }
                let computed = d.seq.len() - 1;
                for (p, &page) in d.pages.iter().enumerate() {
                    let want = computed.saturating_sub(p * ps).min(ps);
                    match self.decode.engine.pool.written_slots(page, d.owner) {
                        Ok(got) if got == want => {}
                        got => {
                            return Err(format!(
                                "K3: decode's request {req} page {p} holds {got:?} written rows, \
                                 its sequence {want}"
                            ))
                        }
                    }
                }
            }
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
