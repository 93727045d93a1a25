//! A page's life: allocation (evicting idle cached pages when the free
//! list runs short), free (deferred while leased, K4; stale and foreign
//! frees refused, K5), and the leases a transfer holds.

use super::*;

impl Pool {
    // ------------------------------------------------------------ allocation

    /// Allocates `n` pages for `owner`, all or nothing, appending their
    /// handles to `out`. Each page's epoch is bumped, its watermarks are zero
    /// and its canary is written.
    /// Evicts idle cached pages (oldest first) when the free list is short.
    pub fn alloc(&mut self, owner: Owner, n: usize, out: &mut Vec<PageRef>) -> Result<(), KvError> {
        if n > self.pages_available() as usize {
            bump(&self.counters.refused_out_of_pages);
            return Err(KvError::OutOfPages {
                requested: n,
                free: self.pages_available() as usize,
            });
        }
        if !owner.is_request() {
            return Err(KvError::InvalidOwner);
        }
        while self.free_list.len() < n {
            let (_, index) = self
                .evictable
                .pop_first()
                .expect("pages_available counted enough evictable pages");
            self.evict(index);
        }
        out.reserve(n);
        for _ in 0..n {
            let index = self.free_list.pop().expect("length checked above");
            let meta = &mut self.meta[index as usize];
            assert!(!meta.allocated(), "free list held allocated page {index}");
            assert_eq!(meta.leases, 0);
            meta.epoch += 1;
            meta.owner = owner;
            meta.free_pending = false;
            let epoch = meta.epoch;
            let layers = self.shape.layers;
            self.watermarks[index as usize * layers..(index as usize + 1) * layers].fill(0);
            self.write_canary(index, canary_value(owner, epoch, index));
            bump(&self.counters.allocs);
            out.push(PageRef { index, epoch });
        }
        Ok(())
    }

    /// Frees a page. Deferred while the page is leased (K4). A stale, foreign
    /// or repeated free is a detected, counted error (K5).
    pub fn free(&mut self, h: PageRef, owner: Owner) -> Result<FreeOutcome, KvError> {
        let Some(meta) = self.meta.get(h.index as usize).copied() else {
            bump(&self.counters.refused_out_of_range);
            return Err(KvError::OutOfRange {
                index: h.index,
                pages: self.pages,
            });
        };
        let double_free_check = !fault!(self, skip_double_free_check);
        if meta.epoch != h.epoch && double_free_check {
            if meta.epoch == h.epoch.wrapping_add(1) && !meta.allocated() {
                bump(&self.counters.refused_double_free);
                return Err(KvError::DoubleFree { index: h.index });
            }
            bump(&self.counters.refused_stale_handle);
            return Err(KvError::StaleHandle {
                index: h.index,
                handle_epoch: h.epoch,
                page_epoch: meta.epoch,
            });
        }
        if !meta.allocated() && double_free_check {
            bump(&self.counters.refused_double_free);
            return Err(KvError::DoubleFree { index: h.index });
        }
        if meta.shared && !fault!(self, skip_shared_write_check) {
            // A cached page leaves by release and eviction only (K11).
            bump(&self.counters.refused_shared_write);
            return Err(KvError::SharedPage { index: h.index });
        }
        if meta.owner != owner && !meta.shared && !fault!(self, skip_owner_check) {
            bump(&self.counters.refused_foreign_owner);
            return Err(KvError::ForeignOwner { index: h.index });
        }
        if meta.free_pending && double_free_check {
            bump(&self.counters.refused_double_free);
            return Err(KvError::DoubleFree { index: h.index });
        }
        if meta.leases > 0 && !fault!(self, skip_lease_deferral) {
            let m = &mut self.meta[h.index as usize];
            m.free_pending = true;
            self.pages_release_pending += 1;
            bump(&self.counters.frees_deferred);
            return Ok(FreeOutcome::Deferred);
        }
        self.release_page(h.index);
        Ok(FreeOutcome::Freed)
    }

    /// Returns a page to the free list: bump the epoch (K2), clear the owner
    /// (K1), poison the memory.
    pub(super) fn release_page(&mut self, index: u32) {
        let m = &mut self.meta[index as usize];
        if !m.allocated() {
            // Only reachable with the double-free check switched off in a
            // fault test: keep the free list a set so the test can observe
            // the consequence (two owners of one page) rather than a crash.
            return;
        }
        if m.leases > 0 {
            // Only with lease deferral switched off (fault tests).
            self.pages_leased -= 1;
            m.leases = 0;
        }
        if m.free_pending {
            self.pages_release_pending -= 1;
        }
        if m.shared {
            // Only an eviction (or a fault test's free) gets here.
            let (scope, key, idle) = (m.owner.scope, m.key, m.idle_since);
            m.shared = false;
            m.refs = 0;
            self.cache_index.remove(&(scope, key));
            if self.evictable.get(&idle) == Some(&index) {
                self.evictable.remove(&idle);
            }
        }
        let m = &mut self.meta[index as usize];
        m.epoch += 1;
        m.owner = Owner::NONE;
        m.free_pending = false;
        let layers = self.shape.layers;
        self.watermarks[index as usize * layers..(index as usize + 1) * layers].fill(0);
        let poison = match self.options.poison {
            _ if fault!(self, skip_poison) => None,
            Poison::Nan => Some(POISON_NAN_BYTE),
            Poison::Zero => Some(0),
            Poison::Off => None,
        };
        if let Some(byte) = poison {
            self.page_mut(index).fill(byte);
        }
        self.free_list.push(index);
        bump(&self.counters.frees);
    }

    // ---------------------------------------------------------------- leases

    /// Leases a page to an in-flight transfer (K4): until the lease is
    /// released, a free of the page is deferred.
    pub fn lease(&mut self, h: PageRef, owner: Owner) -> Result<(), KvError> {
        self.check_read(h, owner)?;
        let m = &mut self.meta[h.index as usize];
        if m.leases >= LEASES_PER_PAGE_MAX {
            bump(&self.counters.refused_lease_limit);
            return Err(KvError::LeaseLimit { index: h.index });
        }
        if m.shared && m.refs == 0 && m.leases == 0 {
            // Leased, so no longer evictable.
            let idle = m.idle_since;
            self.evictable.remove(&idle);
        }
        let m = &mut self.meta[h.index as usize];
        m.leases += 1;
        if m.leases == 1 {
            self.pages_leased += 1;
        }
        Ok(())
    }

    /// Releases one lease; frees the page if its free was deferred and this
    /// was the last lease.
    pub fn release_lease(&mut self, h: PageRef, owner: Owner) -> Result<LeaseOutcome, KvError> {
        self.check_handle(h, owner)?;
        let m = &mut self.meta[h.index as usize];
        if m.leases == 0 {
            return Err(KvError::NotLeased { index: h.index });
        }
        m.leases -= 1;
        if m.leases > 0 {
            return Ok(LeaseOutcome::Released);
        }
        self.pages_leased -= 1;
        if m.free_pending {
            self.release_page(h.index);
            return Ok(LeaseOutcome::ReleasedAndFreed);
        }
        if m.shared && m.refs == 0 {
            self.make_idle(h.index);
        }
        Ok(LeaseOutcome::Released)
    }
}
