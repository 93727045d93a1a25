//! What the operator console shows of a node: its pool page by page (a
//! [`PoolMap`], taken by the thread that owns the pool), reduced to a
//! bounded [`PoolGrid`], with the node's safety counters and the transfers
//! it has in flight ([`NodeView`]).
//!
//! Nothing here carries a prompt, a token id or a key: a page is described
//! by its state, epoch, owner (tenant and request ids, or a cache scope) and
//! how many of its slots are written. The HTTP layer turns tenant ids and
//! scopes into names before anything leaves for a browser.
//!
//! ```
//! use request::console::{PageState, PoolMap};
//! let mut map = PoolMap::new(16);
//! map.push(PageState::Free, 0, u64::MAX, u64::MAX, 0);
//! map.push(PageState::Private, 3, 7, 42, 5);
//! map.push(PageState::Poisoned, 4, u64::MAX, u64::MAX, 0);
//! // Two pages a cell: the busier page of each pair stands for it.
//! let grid = map.grid(2);
//! assert_eq!(grid.pages_per_cell, 2);
//! assert_eq!(grid.state, "op");
//! assert_eq!(grid.who, vec![7, u64::MAX]);
//! assert_eq!(map.counts().private, 1);
//! ```

use serde::{Deserialize, Serialize};

/// Cells a grid shows at most: a pool with more pages shows groups of
/// pages, each cell standing for its most notable page (bounded payload).
pub const GRID_CELLS_MAX: usize = 16_384;

/// A page's state as the console colours it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PageState {
    /// Never allocated (all zero).
    Free,
    /// Free again: freed and overwritten with the poison (or, with
    /// `--kv-poison off`, free after use).
    Poisoned,
    /// Cached in a scope (K11): read-only, shared by reference.
    Cached,
    /// Allocated to one request.
    Private,
    /// Leased to a transfer (K4).
    Leased,
    /// Freed by its owner while leased: released when the lease ends (K4).
    ReleasePending,
}

impl PageState {
    /// Every state, in the grid's order of precedence (lowest first).
    pub const ALL: [PageState; 6] = [
        PageState::Free,
        PageState::Poisoned,
        PageState::Cached,
        PageState::Private,
        PageState::Leased,
        PageState::ReleasePending,
    ];

    /// The one-letter code of the grid's `state` string.
    pub const fn code(self) -> char {
        match self {
            PageState::Free => '.',
            PageState::Poisoned => 'p',
            PageState::Cached => 'c',
            PageState::Private => 'o',
            PageState::Leased => 'l',
            PageState::ReleasePending => 'r',
        }
    }

    /// The state of a grid letter ([`PageState::code`]), if it is one.
    pub fn from_code(c: char) -> Option<PageState> {
        PageState::ALL.into_iter().find(|s| s.code() == c)
    }

    /// Held by a request or a transfer (a tenant's pages): private,
    /// leased or pending release.
    pub const fn is_held(self) -> bool {
        matches!(
            self,
            PageState::Private | PageState::Leased | PageState::ReleasePending
        )
    }
}

/// Every page of a pool, in columns (index = page index). `who` is the
/// owning request's tenant id for private, leased and release-pending
/// pages, the cache scope for cached ones, `u64::MAX` for free ones;
/// `request` the owning request's id (`u64::MAX` when none).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolMap {
    pub page_size_tokens: u32,
    pub state: Vec<PageState>,
    pub epoch: Vec<u64>,
    pub who: Vec<u64>,
    pub request: Vec<u64>,
    /// Slots written in every layer in the current epoch (a page being
    /// written fills up to `page_size_tokens`).
    pub written: Vec<u16>,
}

/// Pages in each state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateCounts {
    pub free: u64,
    pub poisoned: u64,
    pub cached: u64,
    pub private: u64,
    pub leased: u64,
    pub release_pending: u64,
}

impl PoolMap {
    pub fn new(page_size_tokens: u32) -> PoolMap {
        PoolMap {
            page_size_tokens,
            ..PoolMap::default()
        }
    }

    /// Empties the columns, keeping their capacity (a refill allocates
    /// nothing).
    pub fn clear(&mut self) {
        self.state.clear();
        self.epoch.clear();
        self.who.clear();
        self.request.clear();
        self.written.clear();
    }

    /// Room for `pages` pages in every column (one allocation each).
    pub fn reserve(&mut self, pages: usize) {
        self.state.reserve(pages);
        self.epoch.reserve(pages);
        self.who.reserve(pages);
        self.request.reserve(pages);
        self.written.reserve(pages);
    }

    pub fn push(&mut self, state: PageState, epoch: u64, who: u64, request: u64, written: u16) {
        self.state.push(state);
        self.epoch.push(epoch);
        self.who.push(who);
        self.request.push(request);
        self.written.push(written);
    }

    pub fn len(&self) -> usize {
        self.state.len()
    }

    pub fn is_empty(&self) -> bool {
        self.state.is_empty()
    }

    pub fn counts(&self) -> StateCounts {
        let mut c = StateCounts::default();
        for s in &self.state {
            *match s {
                PageState::Free => &mut c.free,
                PageState::Poisoned => &mut c.poisoned,
                PageState::Cached => &mut c.cached,
                PageState::Private => &mut c.private,
                PageState::Leased => &mut c.leased,
                PageState::ReleasePending => &mut c.release_pending,
            } += 1;
        }
        c
    }

    /// Pages each tenant holds ([`PageState::is_held`]), by tenant id in
    /// ascending order: exact, where a grid of grouped pages is not.
    pub fn held_by_tenant(&self) -> Vec<TenantPages> {
        let mut by: std::collections::BTreeMap<u64, u64> = std::collections::BTreeMap::new();
        for (s, &w) in self.state.iter().zip(&self.who) {
            if s.is_held() {
                *by.entry(w).or_default() += 1;
            }
        }
        by.into_iter()
            .map(|(tenant, pages)| TenantPages { tenant, pages })
            .collect()
    }

    /// The map in at most `cells_max` cells (at least one page a cell):
    /// each cell shows the page of highest [`PageState`] precedence in its
    /// group (the first such), so a leased or pending page is never hidden
    /// behind free ones. O(pages).
    pub fn grid(&self, cells_max: usize) -> PoolGrid {
        let pages = self.len();
        let per = pages.div_ceil(cells_max.max(1)).max(1);
        let cells = pages.div_ceil(per);
        let mut g = PoolGrid {
            pages_total: pages as u64,
            pages_per_cell: per as u32,
            page_size_tokens: self.page_size_tokens,
            state: String::with_capacity(cells),
            epoch: Vec::with_capacity(cells),
            who: Vec::with_capacity(cells),
            request: Vec::with_capacity(cells),
            written: Vec::with_capacity(cells),
        };
        for start in (0..pages).step_by(per) {
            let end = (start + per).min(pages);
            let mut best = start;
            for i in start + 1..end {
                if self.state[i] > self.state[best] {
                    best = i;
                }
            }
            g.state.push(self.state[best].code());
            g.epoch.push(self.epoch[best]);
            g.who.push(self.who[best]);
            g.request.push(self.request[best]);
            g.written.push(self.written[best]);
        }
        g
    }
}

/// A pool as the console draws it: one letter per cell in `state`
/// ([`PageState::code`]) and, per cell, the representative page's epoch,
/// owner and written slots (columns as in [`PoolMap`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolGrid {
    pub pages_total: u64,
    pub pages_per_cell: u32,
    pub page_size_tokens: u32,
    pub state: String,
    pub epoch: Vec<u64>,
    pub who: Vec<u64>,
    pub request: Vec<u64>,
    pub written: Vec<u16>,
}

/// Pages a tenant holds on a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantPages {
    pub tenant: u64,
    pub pages: u64,
}

/// One transfer a node has in flight.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferView {
    /// The request's id on the transfer protocol.
    pub request: u64,
    pub tenant: u64,
    /// The sending and the receiving node's names.
    pub from: String,
    pub to: String,
    /// Prompt pages checked in so far, of the transfer's total.
    pub pages_done: u32,
    pub pages_total: u32,
    /// The receiving machine's phase (`reserved`, `receiving`, …).
    pub phase: String,
}

/// A counter of a check that refused something unsafe.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SafetyCounter {
    pub name: String,
    pub value: u64,
}

/// What the console shows of one node (the unified engine, or a PD node).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeView {
    pub name: String,
    /// `unified`, `prefill` or `decode`.
    pub role: String,
    pub grid: PoolGrid,
    pub counts: StateCounts,
    /// Pages each tenant holds (counted over every page, not the grid).
    #[serde(default)]
    pub held: Vec<TenantPages>,
    pub safety: Vec<SafetyCounter>,
    pub transfers: Vec<TransferView>,
    /// How long the pool's owner spent taking the last map, and the
    /// longest since start (microseconds): what a snapshot cost an engine
    /// step.
    pub snapshot_us_last: f64,
    pub snapshot_us_max: f64,
    /// Age of the map when served (milliseconds).
    pub map_age_ms: f64,
}

/// The pool's safety counters by name (every refusal of something unsafe;
/// not out-of-pages, which is back-pressure).
pub fn pool_safety(p: &crate::PoolStats) -> Vec<SafetyCounter> {
    p.refusals()
        .into_iter()
        .filter(|&(name, _)| name != "out_of_pages")
        .map(|(name, value)| SafetyCounter {
            name: name.into(),
            value,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(states: &[PageState]) -> PoolMap {
        let mut m = PoolMap::new(16);
        for (i, &s) in states.iter().enumerate() {
            m.push(s, i as u64, i as u64, i as u64, 0);
        }
        m
    }

    #[test]
    fn grid_of_a_small_pool_is_the_pool() {
        use PageState::*;
        let m = map(&[Free, Private, Cached, Leased, ReleasePending, Poisoned]);
        let g = m.grid(GRID_CELLS_MAX);
        assert_eq!(g.pages_per_cell, 1);
        assert_eq!(g.state, ".oclrp");
        assert_eq!(g.who, vec![0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn grid_cell_never_hides_a_leased_page_behind_free_ones() {
        use PageState::*;
        let mut states = vec![Free; 1000];
        states[517] = Leased;
        states[998] = Private;
        let g = map(&states).grid(10);
        assert_eq!(g.pages_per_cell, 100);
        assert_eq!(g.state.len(), 10);
        assert_eq!(&g.state[5..6], "l");
        assert_eq!(g.epoch[5], 517);
        assert_eq!(&g.state[9..10], "o");
        assert_eq!(g.state.matches('.').count(), 8);
    }

    #[test]
    fn grid_is_bounded_for_any_pool() {
        let m = map(&vec![PageState::Free; 40_001]);
        let g = m.grid(GRID_CELLS_MAX);
        assert!(g.state.len() <= GRID_CELLS_MAX);
        assert_eq!(g.pages_per_cell, 3);
        assert_eq!(g.state.len(), 13_334);
        assert_eq!(g.pages_total, 40_001);
    }

    #[test]
    fn held_pages_are_counted_per_tenant_over_every_page() {
        use PageState::*;
        let mut m = PoolMap::new(16);
        for (s, w) in [
            (Private, 7),
            (Leased, 7),
            (ReleasePending, 9),
            (Cached, 7),
            (Free, 7),
        ] {
            m.push(s, 1, w, 1, 0);
        }
        let held = m.held_by_tenant();
        assert_eq!(
            held,
            vec![
                TenantPages {
                    tenant: 7,
                    pages: 2
                },
                TenantPages {
                    tenant: 9,
                    pages: 1
                }
            ]
        );
        // A grid of two pages a cell would have shown tenant 7 twice over.
        assert_eq!(m.grid(3).pages_per_cell, 2);
        assert_eq!(PageState::from_code('l'), Some(Leased));
        assert_eq!(PageState::from_code('x'), None);
        assert!(PageState::ALL
            .iter()
            .all(|&s| PageState::from_code(s.code()) == Some(s)));
    }

    #[test]
    fn counts_add_up() {
        use PageState::*;
        let c = map(&[Free, Free, Private, Cached, Poisoned]).counts();
        assert_eq!((c.free, c.private, c.cached, c.poisoned), (2, 1, 1, 1));
        assert_eq!(c.leased + c.release_pending, 0);
    }
}
