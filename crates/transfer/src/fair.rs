//! Which waiting request a node gives its free pages to next (K13).
//!
//! Prefill and decode nodes hand out pages, not steps: a request waits
//! until its pages are free. Giving them in arrival order would let one
//! tenant's burst hold every page and make every other tenant wait behind
//! it. Instead the next request is chosen from the tenant that holds the
//! fewest pages on this node per unit of weight (ties: the earlier
//! arrival); within a tenant, by priority (lower first), then arrival. If
//! the chosen request does not fit, the node waits for pages rather than
//! letting a smaller request pass it, so none starves. A tenant alone gets
//! every page (work-conserving). The engine's step scheduling on the node
//! then shares compute by the same weights ([`crate::wire::GenSpec`]).
//!
//! ```
//! use std::collections::BTreeMap;
//! use transfer::fair::{next, Waiting};
//! use transfer::TenantId;
//!
//! // Tenant 1 holds 40 pages and has two requests waiting; tenant 2, who
//! // holds none, arrived last and goes first.
//! let waiting = [
//!     Waiting { tenant: TenantId(1), weight: 1, priority: 0 },
//!     Waiting { tenant: TenantId(1), weight: 1, priority: 0 },
//!     Waiting { tenant: TenantId(2), weight: 1, priority: 0 },
//! ];
//! let held = BTreeMap::from([(TenantId(1), 40)]);
//! assert_eq!(next(&waiting, &held), Some(2));
//! ```

use std::cmp::Ordering;
use std::collections::BTreeMap;

use kv::{RequestId, TenantId};

/// A waiting request as the choice sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waiting {
    pub tenant: TenantId,
    /// The tenant's weight (at least 1).
    pub weight: u32,
    pub priority: i32,
}

/// The index in `waiting` (arrival order) of the request to admit next;
/// `held`: pages each tenant holds on the node now (absent: none).
pub fn next(waiting: &[Waiting], held: &BTreeMap<TenantId, u64>) -> Option<usize> {
    // Each tenant's first request by (priority, arrival).
    let mut best: BTreeMap<TenantId, usize> = BTreeMap::new();
    for (i, w) in waiting.iter().enumerate() {
        best.entry(w.tenant)
            .and_modify(|b| {
                if w.priority < waiting[*b].priority {
                    *b = i;
                }
            })
            .or_insert(i);
    }
    // Pages per weight, compared without division: a·wb against b·wa.
    let load = |i: usize| {
        let w = waiting[i];
        (held.get(&w.tenant).copied().unwrap_or(0), w.weight.max(1))
    };
    best.into_values().min_by(|&x, &y| {
        let ((hx, wx), (hy, wy)) = (load(x), load(y));
        let by_share = (u128::from(hx) * u128::from(wy)).cmp(&(u128::from(hy) * u128::from(wx)));
        match by_share {
            Ordering::Equal => x.cmp(&y),
            other => other,
        }
    })
}

/// Admits from `queue` (request ids in arrival order; `waiting[i]`
/// describes `queue[i]`; `held`: pages per tenant now) in [`next`]'s
/// order: `start(req)` starts the chosen request and returns the pages its
/// tenant gained, or `None` when it does not fit — then admission stops
/// (nobody passes it).
pub fn admit(
    queue: &mut std::collections::VecDeque<RequestId>,
    mut waiting: Vec<Waiting>,
    mut held: BTreeMap<TenantId, u64>,
    mut start: impl FnMut(RequestId) -> Option<u64>,
) {
    debug_assert_eq!(queue.len(), waiting.len());
    while let Some(i) = next(&waiting, &held) {
        let Some(pages) = start(queue[i]) else {
            break;
        };
        queue.remove(i);
        let w = waiting.remove(i);
        *held.entry(w.tenant).or_default() += pages;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(tenant: TenantId, weight: u32, priority: i32) -> Waiting {
        Waiting {
            tenant,
            weight,
            priority,
        }
    }

    #[test]
    fn nothing_waits_nothing_chosen() {
        assert_eq!(next(&[], &BTreeMap::new()), None);
    }

    #[test]
    fn a_tenant_alone_is_served_in_priority_then_arrival_order() {
        let q = [
            w(TenantId(1), 1, 0),
            w(TenantId(1), 1, -3),
            w(TenantId(1), 1, -3),
            w(TenantId(1), 1, 5),
        ];
        assert_eq!(next(&q, &BTreeMap::from([(TenantId(1), 1000)])), Some(1));
    }

    #[test]
    fn the_tenant_holding_fewest_pages_per_weight_goes_first() {
        let q = [
            w(TenantId(1), 1, 0),
            w(TenantId(2), 4, 0),
            w(TenantId(3), 1, 0),
        ];
        // Per weight: 1 → 10, 2 → 30/4 = 7.5, 3 → 8.
        let held = BTreeMap::from([(TenantId(1), 10), (TenantId(2), 30), (TenantId(3), 8)]);
        assert_eq!(next(&q, &held), Some(1));
        // Equal shares: the earlier arrival.
        let held = BTreeMap::from([(TenantId(1), 8), (TenantId(2), 32), (TenantId(3), 8)]);
        assert_eq!(next(&q, &held), Some(0));
    }

    #[test]
    fn priority_never_reaches_past_the_tenants_share() {
        // Tenant 1 asks for the best priority but holds more per weight.
        let q = [w(TenantId(1), 1, i32::MIN), w(TenantId(2), 1, i32::MAX)];
        assert_eq!(
            next(&q, &BTreeMap::from([(TenantId(1), 2), (TenantId(2), 1)])),
            Some(1)
        );
    }

    #[test]
    fn huge_counts_and_weights_compare_without_overflow() {
        let q = [w(TenantId(1), 1000, 0), w(TenantId(2), 1, 0)];
        let held = BTreeMap::from([(TenantId(1), u64::MAX), (TenantId(2), u64::MAX / 999)]);
        // 1: MAX/1000 per weight < 2: MAX/999.
        assert_eq!(next(&q, &held), Some(0));
    }
}
