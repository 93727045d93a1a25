//! Prefix-cache keys (K11): a key names a whole page-aligned prefix in one
//! scope, so two requests share a cached page only when everything before
//! it and the page itself are the same tokens in the same scope.

use std::hash::{BuildHasher, Hasher};

use request::Scope;

/// The keyed hash chain over full pages. The key of page `i` hashes the key
/// of page `i − 1` (the scope for page 0) and page `i`'s tokens, under a
/// per-process secret: nobody outside the process can craft two prefixes
/// with one key. Plain data (`Eq + Hash`), so state machines that hold it
/// stay model-checkable; tests use a fixed secret.
///
/// ```
/// use kv::{PrefixKeys, Scope};
/// let k = PrefixKeys::with_secret([1, 2]);
/// let mut a = Vec::new();
/// k.extend(4, Scope(7), &[1, 2, 3, 4, 5, 6, 7, 8, 9], &mut a);
/// assert_eq!(a.len(), 2); // full pages only
/// let mut b = Vec::new();
/// k.extend(4, Scope(7), &[1, 2, 3, 4, 0, 6, 7, 8], &mut b);
/// assert_eq!(a[0], b[0]);
/// assert_ne!(a[1], b[1]); // the second page differs
/// let mut c = Vec::new();
/// k.extend(4, Scope(8), &[1, 2, 3, 4], &mut c);
/// assert_ne!(a[0], c[0]); // same tokens, another scope
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrefixKeys {
    secret: [u64; 2],
}

impl std::fmt::Debug for PrefixKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The secret stays out of logs.
        f.write_str("PrefixKeys(..)")
    }
}

impl PrefixKeys {
    /// A fresh per-process secret (from the standard library's per-process
    /// random hash keys).
    pub fn random() -> PrefixKeys {
        let mut secret = [0u64; 2];
        for (i, s) in secret.iter_mut().enumerate() {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_usize(i);
            *s = h.finish();
        }
        PrefixKeys { secret }
    }

    /// A fixed secret (tests and simulations).
    pub fn with_secret(secret: [u64; 2]) -> PrefixKeys {
        PrefixKeys { secret }
    }

    /// Extends `keys` to cover every full page of `tokens` (pages of `ps`
    /// tokens); keys already there are kept.
    pub fn extend(&self, ps: usize, scope: Scope, tokens: &[u32], keys: &mut Vec<u64>) {
        for i in keys.len()..tokens.len() / ps.max(1) {
            // SipHash-1-3 whose state first absorbs the secret: the
            // attacker knows neither the state nor, therefore, the output.
            let mut h = std::hash::DefaultHasher::new();
            h.write_u64(self.secret[0]);
            h.write_u64(self.secret[1]);
            match i {
                0 => {
                    h.write_u8(0);
                    h.write_u64(scope.0);
                }
                _ => {
                    h.write_u8(1);
                    h.write_u64(keys[i - 1]);
                }
            }
            for &t in &tokens[i * ps..(i + 1) * ps] {
                h.write_u32(t);
            }
            keys.push(h.finish());
        }
    }
}
