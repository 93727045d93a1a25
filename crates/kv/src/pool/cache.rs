//! The prefix cache (K11): publishing a fully written private page under
//! a key in its owner's scope, looking it up, acquiring and releasing
//! references, and evicting idle pages.

use super::*;

impl Pool {
    // ------------------------------------------------------ the cache (K11)

    /// Caches a private page under `key` in its owner's scope: the page
    /// becomes read-only and shared, its epoch moves on (the private handle
    /// goes stale), and the caller holds its first reference through the
    /// returned handle. Only a page every slot of every layer of which was
    /// written in this epoch (K3), not leased and not being released, can
    /// be cached. `Ok(None)`: the scope already caches that key (the page
    /// stays private to the caller).
    pub fn publish(
        &mut self,
        h: PageRef,
        owner: Owner,
        key: u64,
    ) -> Result<Option<PageRef>, KvError> {
        self.check_write(h, owner)?;
        let i = h.index as usize;
        if self.meta[i].leases > 0 {
            bump(&self.counters.refused_unpublishable);
            return Err(KvError::NotPublishable {
                index: h.index,
                why: "it is leased to a transfer",
            });
        }
        let layers = self.shape.layers;
        let full = self.watermarks[i * layers..(i + 1) * layers]
            .iter()
            .all(|&w| w as usize == self.shape.page_size);
        if !full && !fault!(self, skip_publish_check) {
            bump(&self.counters.refused_unpublishable);
            return Err(KvError::NotPublishable {
                index: h.index,
                why: "not every slot was written in this epoch",
            });
        }
        if self.cache_index.contains_key(&(owner.scope, key)) {
            return Ok(None);
        }
        let m = &mut self.meta[i];
        m.epoch += 2;
        m.owner = Owner::cached(owner.scope);
        m.shared = true;
        m.refs = 1;
        m.key = key;
        let (cached, epoch) = (m.owner, m.epoch);
        self.write_canary(h.index, canary_value(cached, epoch, h.index));
        self.cache_index.insert((owner.scope, key), h.index);
        bump(&self.counters.cache_publishes);
        Ok(Some(PageRef {
            index: h.index,
            epoch,
        }))
    }

    /// Whether `scope` caches any page: the engine drops the scope's other
    /// cached state (speculation's suffix cache) with its last page.
    pub fn caches_scope(&self, scope: Scope) -> bool {
        self.cache_index
            .range((scope, 0)..=(scope, u64::MAX))
            .next()
            .is_some()
    }

    /// The cached page of `scope` under `key`, if any (not acquired).
    pub fn lookup(&self, scope: Scope, key: u64) -> Option<PageRef> {
        let &index = self.cache_index.get(&(scope, key))?;
        let epoch = self.meta[index as usize].epoch;
        Some(PageRef { index, epoch })
    }

    /// The cached pages of the longest prefix of `keys` that `scope` caches
    /// (page `i` under `keys[i]`), appended to `out` (not acquired).
    pub fn cached_prefix(&self, scope: Scope, keys: &[u64], out: &mut Vec<PageRef>) {
        for &k in keys {
            match self.lookup(scope, k) {
                Some(h) => out.push(h),
                None => break,
            }
        }
    }

    /// Takes a reference to a cached page of the owner's scope: it stays
    /// cached (not evictable) until released.
    pub fn acquire(&mut self, h: PageRef, owner: Owner) -> Result<(), KvError> {
        self.check_read(h, owner)?;
        let m = &mut self.meta[h.index as usize];
        if !m.shared {
            return Err(KvError::NotPublishable {
                index: h.index,
                why: "only cached pages are acquired",
            });
        }
        if m.refs >= REFS_PER_PAGE_MAX {
            bump(&self.counters.refused_lease_limit);
            return Err(KvError::RefLimit { index: h.index });
        }
        if m.refs == 0 && m.leases == 0 {
            let idle = m.idle_since;
            self.evictable.remove(&idle);
        }
        let m = &mut self.meta[h.index as usize];
        m.refs += 1;
        Ok(())
    }

    /// Drops a reference to a cached page. At no reference and no lease
    /// the page becomes evictable (it stays cached until an allocation
    /// needs it). A release without a reference is refused and counted:
    /// reference counts never go negative (K5).
    pub fn release(&mut self, h: PageRef, owner: Owner) -> Result<(), KvError> {
        self.check_handle(h, owner)?;
        let m = &mut self.meta[h.index as usize];
        if !m.shared {
            return Err(KvError::NotPublishable {
                index: h.index,
                why: "only cached pages are released; private pages are freed",
            });
        }
        if m.refs == 0 {
            if !fault!(self, skip_refcount_check) {
                bump(&self.counters.refused_ref_underflow);
                return Err(KvError::RefUnderflow { index: h.index });
            }
            // Fault test: the count wraps — the page is held forever.
            m.refs = u32::MAX;
            return Ok(());
        }
        m.refs -= 1;
        if m.refs == 0 && m.leases == 0 {
            self.make_idle(h.index);
        }
        Ok(())
    }

    /// Caches the private pages among the first `n` of a request's
    /// `pages` (every slot written, `keys[i]` the key of page `i`): each
    /// becomes shared and read-only, its handle in `pages` replaced and
    /// `shared[i]` set. A page whose key the scope already caches stays
    /// private. Returns the pages the pool refused (each refusal counted;
    /// for a caller that wrote every slot, a bug).
    pub fn publish_pages(
        &mut self,
        owner: Owner,
        pages: &mut [PageRef],
        shared: &mut [bool],
        keys: &[u64],
        n: usize,
    ) -> usize {
        let mut refused = 0;
        for p in 0..n.min(keys.len()).min(pages.len()).min(shared.len()) {
            if shared[p] {
                continue;
            }
            match self.publish(pages[p], owner, keys[p]) {
                Ok(Some(h)) => {
                    pages[p] = h;
                    shared[p] = true;
                }
                Ok(None) => {}
                Err(_) => refused += 1,
            }
        }
        refused
    }

    /// Gives back pages a request took, last first: the first `acquired`
    /// are cached pages it referenced (released), the rest its own
    /// (freed). Returns how many the pool refused (each counted).
    pub fn give_back(&mut self, owner: Owner, pages: &[PageRef], acquired: usize) -> usize {
        let mut refused = 0;
        for (i, &h) in pages.iter().enumerate().rev() {
            let r = match i < acquired {
                true => self.release(h, owner),
                false => self.free(h, owner).map(|_| ()),
            };
            refused += usize::from(r.is_err());
        }
        refused
    }

    /// How many of `pages` (current handles) giving back would make
    /// available: private pages, and cached pages whose only reference is
    /// the one given back (and no lease holds).
    pub fn freed_by_giving_back(&self, pages: &[PageRef]) -> usize {
        pages
            .iter()
            .filter(|h| {
                self.meta.get(h.index as usize).is_some_and(|m| {
                    m.epoch == h.epoch && m.leases == 0 && (!m.shared || m.refs == 1)
                })
            })
            .count()
    }

    /// How many of `pages` (current handles) are idle cached pages: what
    /// acquiring them takes out of [`Pool::pages_available`].
    pub fn idle_among(&self, pages: &[PageRef]) -> usize {
        pages
            .iter()
            .filter(|h| {
                self.meta
                    .get(h.index as usize)
                    .is_some_and(|m| m.epoch == h.epoch && m.shared && m.refs == 0 && m.leases == 0)
            })
            .count()
    }

    /// Evicts every idle cached page (tests, `--prefix-cache off` at run
    /// time); returns how many.
    pub fn evict_idle(&mut self) -> usize {
        let n = self.evictable.len();
        while let Some((_, index)) = self.evictable.pop_first() {
            self.evict(index);
        }
        n
    }

    pub(super) fn make_idle(&mut self, index: u32) {
        self.idle_clock += 1;
        let clock = self.idle_clock;
        self.meta[index as usize].idle_since = clock;
        self.evictable.insert(clock, index);
    }

    /// An idle cached page back to the free list: out of the index, epoch
    /// bumped (K2: every handle to it goes stale), poisoned.
    pub(super) fn evict(&mut self, index: u32) {
        let m = self.meta[index as usize];
        debug_assert!(m.shared && m.refs == 0 && m.leases == 0);
        self.release_page(index);
        bump(&self.counters.cache_evictions);
    }
}
