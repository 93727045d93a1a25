//! The compiled-grammar cache: a line per cache scope (K11), each line a
//! small LRU of its own. A lookup reads only its own scope's line, and an
//! insert evicts only from it, so one scope's traffic neither fills nor
//! empties another's line. The one cross-scope bound is the number of
//! lines: past [`SCOPES_MAX`] scopes the least recently used scope's line
//! goes whole (what that can tell a tenant is that more than
//! [`SCOPES_MAX`] scopes compiled grammars since it last did — not what
//! anyone sent).

use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use request::{GrammarSpec, Scope};

/// Compiled grammars one scope keeps.
pub const SCOPE_ENTRIES_MAX: usize = 32;
/// Scopes with a line at once.
pub const SCOPES_MAX: usize = 256;

/// What the cache holds now.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub scopes: usize,
    pub entries: usize,
    pub hits_total: u64,
    pub misses_total: u64,
}

struct Entry<V> {
    hash: u64,
    spec: GrammarSpec,
    value: V,
    used: u64,
}

struct Line<V> {
    entries: Vec<Entry<V>>,
    used: u64,
}

pub(crate) struct ScopedCache<V> {
    lines: HashMap<Scope, Line<V>>,
    /// A logical clock for the LRU orders.
    clock: u64,
    hits_total: u64,
    misses_total: u64,
}

fn hash_of(spec: &GrammarSpec) -> u64 {
    let mut h = DefaultHasher::new();
    spec.hash(&mut h);
    h.finish()
}

impl<V: Clone> ScopedCache<V> {
    pub fn new() -> Self {
        ScopedCache {
            lines: HashMap::new(),
            clock: 0,
            hits_total: 0,
            misses_total: 0,
        }
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The scope's compiled `spec`, if its line holds it.
    pub fn get(&mut self, scope: Scope, spec: &GrammarSpec) -> Option<V> {
        let now = self.tick();
        let h = hash_of(spec);
        let found = self.lines.get_mut(&scope).and_then(|line| {
            line.used = now;
            line.entries
                .iter_mut()
                .find(|e| e.hash == h && e.spec == *spec)
                .map(|e| {
                    e.used = now;
                    e.value.clone()
                })
        });
        match found {
            Some(_) => self.hits_total += 1,
            None => self.misses_total += 1,
        }
        found
    }

    /// Keeps `value` in the scope's line (evicting the line's least
    /// recently used entry when full).
    pub fn insert(&mut self, scope: Scope, spec: GrammarSpec, value: V) {
        let now = self.tick();
        if !self.lines.contains_key(&scope) && self.lines.len() >= SCOPES_MAX {
            if let Some(oldest) = self
                .lines
                .iter()
                .min_by_key(|(_, l)| l.used)
                .map(|(s, _)| *s)
            {
                self.lines.remove(&oldest);
            }
        }
        let line = self.lines.entry(scope).or_insert_with(|| Line {
            entries: Vec::new(),
            used: now,
        });
        line.used = now;
        let h = hash_of(&spec);
        if let Some(e) = line
            .entries
            .iter_mut()
            .find(|e| e.hash == h && e.spec == spec)
        {
            // Two requests compiled it at once: keep the one stored.
            e.used = now;
            return;
        }
        if line.entries.len() >= SCOPE_ENTRIES_MAX {
            if let Some(i) = (0..line.entries.len()).min_by_key(|&i| line.entries[i].used) {
                line.entries.swap_remove(i);
            }
        }
        line.entries.push(Entry {
            hash: h,
            spec,
            value,
            used: now,
        });
        debug_assert!(self.lines.len() <= SCOPES_MAX);
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            scopes: self.lines.len(),
            entries: self.lines.values().map(|l| l.entries.len()).sum(),
            hits_total: self.hits_total,
            misses_total: self.misses_total,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use request::TenantId;

    fn rx(s: &str) -> GrammarSpec {
        GrammarSpec::Regex(s.into())
    }

    #[test]
    fn a_scope_never_reads_another_scopes_entry() {
        let (a, b) = (Scope::tenant(TenantId(1)), Scope::tenant(TenantId(2)));
        let mut c = ScopedCache::new();
        c.insert(a, rx("x+"), 1);
        assert_eq!(c.get(a, &rx("x+")), Some(1));
        assert_eq!(c.get(b, &rx("x+")), None);
        assert_eq!(c.get(a, &rx("y+")), None);
        let s = c.stats();
        assert_eq!((s.hits_total, s.misses_total, s.entries), (1, 2, 1));
    }

    #[test]
    fn a_full_line_evicts_its_own_least_recent_entry_only() {
        let (a, b) = (Scope::tenant(TenantId(1)), Scope::tenant(TenantId(2)));
        let mut c = ScopedCache::new();
        c.insert(b, rx("b"), 0);
        for i in 0..SCOPE_ENTRIES_MAX {
            c.insert(a, rx(&format!("a{i}")), i);
        }
        // Touch a0 so a1 is the least recent.
        assert_eq!(c.get(a, &rx("a0")), Some(0));
        c.insert(a, rx("new"), 99);
        assert_eq!(c.get(a, &rx("a1")), None);
        assert_eq!(c.get(a, &rx("a0")), Some(0));
        assert_eq!(c.get(a, &rx("new")), Some(99));
        // The other scope's line is untouched by a's churn.
        assert_eq!(c.get(b, &rx("b")), Some(0));
        assert_eq!(c.stats().entries, SCOPE_ENTRIES_MAX + 1);
    }

    #[test]
    fn lines_are_bounded() {
        let mut c = ScopedCache::new();
        for t in 0..(SCOPES_MAX as u64 + 10) {
            c.insert(Scope::tenant(TenantId(t)), rx("x"), t);
        }
        assert_eq!(c.stats().scopes, SCOPES_MAX);
        // The oldest lines went.
        assert_eq!(c.get(Scope::tenant(TenantId(0)), &rx("x")), None);
        let last = SCOPES_MAX as u64 + 9;
        assert_eq!(c.get(Scope::tenant(TenantId(last)), &rx("x")), Some(last));
    }
}
