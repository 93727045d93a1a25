//! Looking at the pool without changing it: owners, epochs, counters, the
//! console's map, and the O(pages) consistency check.

use super::*;

impl Pool {
    // ----------------------------------------------------------- inspection

    /// Owner of a page, if allocated (for tests, audits and debugging).
    pub fn owner_of(&self, index: u32) -> Option<Owner> {
        self.meta
            .get(index as usize)
            .filter(|m| m.allocated())
            .map(|m| m.owner)
    }

    /// A hash of one page's bytes and write watermarks, or `None` out of
    /// range. For checkers that must see whether an event wrote a page;
    /// not a security checksum.
    pub fn page_fingerprint(&self, index: u32) -> Option<u64> {
        if index >= self.pages {
            return None;
        }
        let layers = self.shape.layers;
        let i = index as usize;
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(self.page(index));
        for w in &self.watermarks[i * layers..(i + 1) * layers] {
            h.update(&w.to_le_bytes());
        }
        Some(h.digest())
    }

    /// Test-only: a stray write past a page's data — one byte of its
    /// canary trailer flipped, as an out-of-bounds write from a neighbour
    /// would (for tests that a canary check is needed where it stands).
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn scribble_trailer(&mut self, index: u32) {
        let data = self.shape.data_bytes();
        if index < self.pages {
            self.page_mut(index)[data] ^= 0x5a;
        }
    }

    /// Current epoch of a page.
    pub fn epoch_of(&self, index: u32) -> Option<u64> {
        self.meta.get(index as usize).map(|m| m.epoch)
    }

    /// Occupancy and every refusal counter, as a plain struct.
    pub fn stats(&self) -> PoolStats {
        let c = &self.counters;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let free = self.free_list.len() as u64;
        PoolStats {
            pages_total: self.pages as u64,
            pages_free: free,
            pages_owned: self.pages as u64 - free,
            pages_leased: self.pages_leased as u64,
            pages_release_pending: self.pages_release_pending as u64,
            refused_stale_handle: r(&c.refused_stale_handle),
            refused_foreign_owner: r(&c.refused_foreign_owner),
            refused_unwritten_read: r(&c.refused_unwritten_read),
            refused_double_free: r(&c.refused_double_free),
            refused_release_pending: r(&c.refused_release_pending),
            refused_out_of_range: r(&c.refused_out_of_range),
            refused_write_gap: r(&c.refused_write_gap),
            refused_already_written: r(&c.refused_already_written),
            refused_out_of_pages: r(&c.refused_out_of_pages),
            refused_lease_limit: r(&c.refused_lease_limit),
            canary_mismatch: r(&c.canary_mismatch),
            checksum_mismatch: r(&c.checksum_mismatch),
            refused_shared_write: r(&c.refused_shared_write),
            refused_foreign_scope: r(&c.refused_foreign_scope),
            refused_ref_underflow: r(&c.refused_ref_underflow),
            refused_unpublishable: r(&c.refused_unpublishable),
            allocs: r(&c.allocs),
            frees: r(&c.frees),
            frees_deferred: r(&c.frees_deferred),
            pages_cached: self.cache_index.len() as u64,
            pages_evictable: self.evictable.len() as u64,
            cache_publishes: r(&c.cache_publishes),
            cache_evictions: r(&c.cache_evictions),
        }
    }

    /// Every page's state, epoch, owner and written slots, for the
    /// operator console ([`request::console::PoolMap`]), refilled in place
    /// (nothing allocated once `out` has grown to the pool). O(pages): one
    /// pass over the metadata, one watermark read per page (the last
    /// layer's: a forward pass writes a token's layers in order, so the last
    /// layer's count is the slots written in every layer). Reads only
    /// metadata, never page memory: no prompt's K/V can reach the map.
    pub fn map_into(&self, out: &mut request::console::PoolMap) {
        out.clear();
        out.reserve(self.meta.len());
        self.map_range_into(out, 0..self.meta.len());
    }

    /// [`Pool::map_into`] for the pages `range` (clamped to the pool),
    /// appended to `out`: a large pool's map can be taken a slice per
    /// engine step (`engine::console`), so no step waits for all of it.
    pub fn map_range_into(
        &self,
        out: &mut request::console::PoolMap,
        range: std::ops::Range<usize>,
    ) {
        use request::console::PageState;
        out.page_size_tokens = self.shape.page_size as u32;
        let layers = self.shape.layers;
        let poisons = self.options.poison != Poison::Off;
        let end = range.end.min(self.meta.len());
        let start = range.start.min(end);
        for (i, m) in self.meta[start..end].iter().enumerate() {
            let i = start + i;
            let (state, who, request) = if !m.allocated() {
                let state = if m.epoch > 0 && poisons {
                    PageState::Poisoned
                } else {
                    PageState::Free
                };
                (state, u64::MAX, u64::MAX)
            } else if m.shared {
                (PageState::Cached, m.owner.scope.0, u64::MAX)
            } else {
                let state = if m.free_pending {
                    PageState::ReleasePending
                } else if m.leases > 0 {
                    PageState::Leased
                } else {
                    PageState::Private
                };
                (state, m.owner.tenant.0, m.owner.request.0)
            };
            let written = if m.allocated() {
                self.watermarks[i * layers + layers - 1]
            } else {
                0
            };
            out.push(state, m.epoch, who, request, written);
        }
    }

    /// Checks the pool's internal consistency (K1, K2, K4, K5 as state):
    /// the free list is a set of exactly the unallocated pages, each without
    /// owner or leases; allocated pages have an owner; lease and pending
    /// counts match. O(pages); for tests and debug assertions.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut on_free_list = vec![false; self.pages as usize];
        for &i in &self.free_list {
            let slot = on_free_list
                .get_mut(i as usize)
                .ok_or(format!("free list holds out-of-range page {i}"))?;
            if *slot {
                return Err(format!("page {i} is on the free list twice"));
            }
            *slot = true;
        }
        let (mut leased, mut pending, mut shared) = (0u32, 0u32, 0u32);
        for (i, m) in self.meta.iter().enumerate() {
            if m.allocated() == on_free_list[i] {
                return Err(format!(
                    "page {i}: allocated={} but on free list={}",
                    m.allocated(),
                    on_free_list[i]
                ));
            }
            if m.allocated() && m.owner == Owner::NONE {
                return Err(format!("allocated page {i} has no owner"));
            }
            if !m.allocated() && (m.owner != Owner::NONE || m.leases > 0 || m.free_pending) {
                return Err(format!(
                    "free page {i} has an owner, a lease or a pending free"
                ));
            }
            if m.free_pending && m.leases == 0 {
                return Err(format!("page {i} pending release without a lease"));
            }
            if m.shared {
                if !m.allocated() || m.owner != Owner::cached(m.owner.scope) || m.free_pending {
                    return Err(format!(
                        "cached page {i} is free, privately owned or released"
                    ));
                }
                if self.cache_index.get(&(m.owner.scope, m.key)) != Some(&(i as u32)) {
                    return Err(format!("cached page {i} is not in the index under its key"));
                }
                let idle = m.refs == 0 && m.leases == 0;
                let listed = self.evictable.get(&m.idle_since) == Some(&(i as u32));
                if idle != listed {
                    return Err(format!(
                        "cached page {i}: {} references, {} leases, but evictable = {listed}",
                        m.refs, m.leases,
                    ));
                }
                if m.refs > REFS_PER_PAGE_MAX {
                    return Err(format!("cached page {i} holds {} references", m.refs));
                }
                shared += 1;
            } else if m.refs != 0 || (m.allocated() && !m.owner.is_request()) {
                return Err(format!("private page {i} has references or a cache owner"));
            }
            leased += (m.leases > 0) as u32;
            pending += m.free_pending as u32;
        }
        if self.cache_index.len() != shared as usize || self.evictable.len() > shared as usize {
            return Err(format!(
                "cache counts drifted: {shared} shared pages, index {}, evictable {}",
                self.cache_index.len(),
                self.evictable.len()
            ));
        }
        if leased != self.pages_leased || pending != self.pages_release_pending {
            return Err(format!(
                "lease counters drifted: counted {leased}/{pending}, kept {}/{}",
                self.pages_leased, self.pages_release_pending
            ));
        }
        Ok(())
    }
}
