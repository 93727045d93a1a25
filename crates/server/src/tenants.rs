//! Tenants: API keys (stored as SHA-256 hashes), per-tenant concurrency and
//! tokens-per-minute limits.
//!
//! The file (`--tenants FILE`) is TOML:
//!
//! ```toml
//! [[tenant]]
//! name = "a"
//! api_key_sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
//! max_concurrent = 8            # optional; default 64
//! max_tokens_per_minute = 100000  # optional; default unlimited
//! cache_group = "acme"          # optional; see below
//! weight = 2                    # optional; default 1 (share of the engine)
//! max_priority = -10            # optional; the most precedence it may ask
//!
//! [operator]                    # optional: the key that reads /metrics
//! api_key_sha256 = "…"
//! ```
//!
//! With a tenants file, `/metrics` on the API port answers only the operator's
//! key (a 403 without an `[operator]` section); `--metrics-port` serves it on a
//! listener of its own, without a key.
//!
//! Fair share (K13): while several tenants have work, the engine serves each
//! in proportion to its `weight` (1 to 1000); a tenant alone may use all of
//! it. A request's `priority` (vLLM's meaning: lower runs earlier, default
//! 0) orders only that tenant's own requests; `max_priority` bounds how low
//! a value it may send (a lower one is refused with a 400).
//!
//! Prefix cache (K11): by default each tenant's cached KV is its own. Tenants
//! with the same `cache_group` share one cache scope — the only way a scope
//! ever widens, and only the operator can do it. A request's `cache_salt` /
//! `prompt_cache_key` narrows the scope inside it ([`Tenants::cache_scope`]).
//!
//! A key is hashed and compared with *every* tenant's hash in constant time
//! (no early exit, no data-dependent branch), so neither the match nor its
//! position leaks through timing. Tenant `i` (0-based, in file order) gets
//! the pool owner id `request::TenantId(i + 1)`; the anonymous tenant of a server
//! without a tenants file is `TenantId(0)`.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Deserialize;
use sha2::{Digest, Sha256};

pub use crate::error::TenantsError;
use crate::error::{ApiError, ServerError};

/// Default concurrency limit of a tenant that does not set one.
pub const MAX_CONCURRENT_DEFAULT: usize = 64;
/// Upper bound on tenants in one file.
pub const TENANTS_MAX: usize = 10_000;
/// Upper bound on the length of an API key we hash.
pub const API_KEY_BYTES_MAX: usize = 1024;
/// The tokens-per-minute window.
pub const WINDOW: Duration = Duration::from_secs(60);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantsFile {
    #[serde(default)]
    tenant: Vec<TenantSpec>,
    operator: Option<OperatorSpec>,
}

/// The `[operator]` section: the key that reads `/metrics` on the API port.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperatorSpec {
    pub api_key_sha256: String,
}

/// One `[[tenant]]` entry of the tenants file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    pub name: String,
    pub api_key_sha256: String,
    pub max_concurrent: Option<usize>,
    pub max_tokens_per_minute: Option<u64>,
    /// Tenants naming the same group share cached KV (K11).
    pub cache_group: Option<String>,
    /// Share of the engine against other busy tenants (K13).
    pub weight: Option<u32>,
    /// The lowest `priority` value its requests may carry.
    pub max_priority: Option<i32>,
}

pub use request::WEIGHT_MAX;

/// A tenant and its live usage.
#[derive(Debug)]
pub struct Tenant {
    pub id: request::TenantId,
    pub name: String,
    key_hash: [u8; 32],
    pub max_concurrent: usize,
    pub max_tokens_per_minute: Option<u64>,
    pub cache_group: Option<String>,
    /// Share of the engine (K13), 1 to [`WEIGHT_MAX`].
    pub weight: u32,
    /// The lowest `priority` value its requests may carry (`None`: any).
    pub max_priority: Option<i32>,
    usage: Mutex<Usage>,
    /// What the operator console shows of it (counts only).
    pub activity: Activity,
}

/// A tenant's totals since start that `/metrics` does not keep per
/// tenant, for the operator console: counts only, updated as its requests
/// stream and are refused (finished requests: `Metrics::tenant_totals`).
#[derive(Debug, Default)]
pub struct Activity {
    /// Tokens streamed to its clients (as they stream: `/metrics` counts
    /// a request's tokens when it finishes).
    pub tokens_generated: std::sync::atomic::AtomicU64,
    /// Its requests refused (limits, bad parameters, a full queue, …).
    pub refused: std::sync::atomic::AtomicU64,
}

#[derive(Debug, Default)]
struct Usage {
    running: usize,
    /// Tokens admitted per whole second since `epoch`, oldest first; at most
    /// 61 entries (a sliding 60 s window at one-second resolution).
    window: VecDeque<(u64, u64)>,
    window_sum: u64,
}

/// The set of tenants, or the one anonymous tenant.
#[derive(Debug)]
pub struct Tenants {
    list: Vec<Arc<Tenant>>,
    anonymous: bool,
    epoch: Instant,
    /// A per-process secret in every derived cache scope, so no one can
    /// compute another's scope offline.
    scope_secret: [u8; 16],
    /// The operator's key hash (`[operator]`): reads `/metrics`.
    operator_key_hash: Option<[u8; 32]>,
}

/// Upper bound on a request's cache salt.
pub const CACHE_SALT_BYTES_MAX: usize = 256;

fn scope_secret() -> [u8; 16] {
    use std::hash::{BuildHasher, Hasher};
    let mut out = [0u8; 16];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_usize(i);
        chunk.copy_from_slice(&h.finish().to_le_bytes());
    }
    out
}

/// Why a tenant's request was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum LimitError {
    #[error("tenant `{tenant}` already has {limit} requests running (max_concurrent = {limit}); retry later")]
    Concurrency { tenant: String, limit: usize },
    #[error("tenant `{tenant}` would exceed its limit of {limit} tokens per minute ({used} used in the last 60 s, this request needs {need}); retry in {retry_after} s")]
    TokensPerMinute {
        tenant: String,
        limit: u64,
        used: u64,
        need: u64,
        retry_after: u64,
    },
    #[error("this request needs {need} tokens (prompt + max_tokens), more than tenant `{tenant}`'s limit of {limit} tokens per minute; lower max_tokens")]
    RequestTooLarge {
        tenant: String,
        limit: u64,
        need: u64,
    },
}

impl LimitError {
    pub fn retry_after(&self) -> u64 {
        match self {
            LimitError::Concurrency { .. } => 1,
            LimitError::TokensPerMinute { retry_after, .. } => *retry_after,
            LimitError::RequestTooLarge { .. } => WINDOW.as_secs(),
        }
    }
}

/// Where the circle between the tenants and the API's errors breaks: the
/// error module knows nothing of tenants.
impl From<AuthError> for ApiError {
    fn from(why: AuthError) -> ApiError {
        ApiError::unauthorized(match why {
            AuthError::Missing => "You didn't provide an API key. You need to provide your API key \
                 in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
                .to_string(),
            AuthError::TooLong => format!(
                "The API key provided is longer than {API_KEY_BYTES_MAX} bytes, the most accepted."
            ),
            AuthError::Wrong => "Incorrect API key provided.".to_string(),
        })
    }
}

impl From<LimitError> for ApiError {
    fn from(e: LimitError) -> ApiError {
        if let LimitError::RequestTooLarge { .. } = e {
            // Never fits, however long the client waits: not a 429 with a
            // Retry-After, a 400 that says so.
            return ApiError::never_fits(format!("{e}: it can never fit, whenever it is sent"));
        }
        let retry = e.retry_after();
        ApiError::tenant_limit(e.to_string(), retry)
    }
}

/// A running request's hold on its tenant's concurrency slot; released on
/// drop.
#[derive(Debug)]
pub struct TenantPermit {
    tenant: Arc<Tenant>,
    /// (second, tokens) charged to the window, for a refund.
    charged: Option<(u64, u64)>,
}

impl TenantPermit {
    pub fn tenant(&self) -> &Arc<Tenant> {
        &self.tenant
    }

    /// Gives back the tokens charged at admission (the request never ran).
    pub fn refund(&mut self) {
        if let Some((sec, tokens)) = self.charged.take() {
            let mut u = self.tenant.lock();
            if let Some(e) = u.window.iter_mut().find(|e| e.0 == sec) {
                let back = e.1.min(tokens);
                e.1 -= back;
                u.window_sum -= back;
            }
        }
    }
}

impl Drop for TenantPermit {
    fn drop(&mut self) {
        let mut u = self.tenant.lock();
        u.running = u.running.saturating_sub(1);
    }
}

/// SHA-256 of `data`.
pub fn sha256(data: &[u8]) -> [u8; 32] {
    Sha256::digest(data).into()
}

/// Constant-time equality of two hashes: 1 if equal, else 0. Every byte is
/// looked at whatever the inputs.
pub fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> u8 {
    let mut diff: u8 = 0;
    for i in 0..32 {
        diff |= a[i] ^ b[i];
    }
    let diff = std::hint::black_box(diff);
    // 1 when diff == 0, without a branch: (diff - 1) borrows into bit 8
    // only when diff is 0.
    (((diff as u16).wrapping_sub(1) >> 8) & 1) as u8
}

fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    let s = s.trim();
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, chunk) in s.as_bytes().chunks(2).enumerate() {
        let hi = (chunk[0] as char).to_digit(16)?;
        let lo = (chunk[1] as char).to_digit(16)?;
        out[i] = (hi * 16 + lo) as u8;
    }
    Some(out)
}

impl Tenant {
    fn lock(&self) -> std::sync::MutexGuard<'_, Usage> {
        self.usage.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Requests of this tenant running now.
    pub fn running(&self) -> usize {
        self.lock().running
    }
}

impl Tenants {
    /// One anonymous tenant (no tenants file): any key, or none, is accepted.
    pub fn anonymous() -> Tenants {
        Tenants {
            list: vec![Arc::new(Tenant {
                id: request::TenantId(0),
                name: "anonymous".to_string(),
                key_hash: [0; 32],
                max_concurrent: usize::MAX,
                max_tokens_per_minute: None,
                cache_group: None,
                weight: 1,
                max_priority: None,
                usage: Mutex::new(Usage::default()),
                activity: Activity::default(),
            })],
            anonymous: true,
            epoch: Instant::now(),
            scope_secret: scope_secret(),
            operator_key_hash: None,
        }
    }

    /// Tenants from specs (validated: names and hashes unique and well
    /// formed, limits positive).
    pub fn from_specs(specs: Vec<TenantSpec>) -> Result<Tenants, TenantsError> {
        if specs.is_empty() {
            return Err(TenantsError::NoTenants);
        }
        if specs.len() > TENANTS_MAX {
            return Err(TenantsError::TooMany { max: TENANTS_MAX });
        }
        let mut list: Vec<Arc<Tenant>> = Vec::with_capacity(specs.len());
        for (i, s) in specs.into_iter().enumerate() {
            if s.name.is_empty() || s.name.len() > 128 {
                return Err(TenantsError::BadName { index: i + 1 });
            }
            let key_hash =
                parse_hex32(&s.api_key_sha256).ok_or_else(|| TenantsError::BadKeyHash {
                    tenant: s.name.clone(),
                })?;
            if s.max_concurrent == Some(0) {
                return Err(TenantsError::NotPositive {
                    tenant: s.name,
                    field: "max_concurrent",
                });
            }
            if s.max_tokens_per_minute == Some(0) {
                return Err(TenantsError::NotPositive {
                    tenant: s.name,
                    field: "max_tokens_per_minute",
                });
            }
            if let Some(g) = &s.cache_group {
                if g.is_empty() || g.len() > 128 {
                    return Err(TenantsError::BadCacheGroup { tenant: s.name });
                }
            }
            let weight = s.weight.unwrap_or(1);
            if !(1..=WEIGHT_MAX).contains(&weight) {
                return Err(TenantsError::BadWeight {
                    tenant: s.name,
                    max: WEIGHT_MAX,
                });
            }
            if list.iter().any(|t| t.name == s.name) {
                return Err(TenantsError::DuplicateName { tenant: s.name });
            }
            if list.iter().any(|t| t.key_hash == key_hash) {
                return Err(TenantsError::DuplicateKey { tenant: s.name });
            }
            list.push(Arc::new(Tenant {
                id: request::TenantId(i as u64 + 1),
                name: s.name,
                key_hash,
                max_concurrent: s.max_concurrent.unwrap_or(MAX_CONCURRENT_DEFAULT),
                max_tokens_per_minute: s.max_tokens_per_minute,
                cache_group: s.cache_group,
                weight,
                max_priority: s.max_priority,
                usage: Mutex::new(Usage::default()),
                activity: Activity::default(),
            }));
        }
        Ok(Tenants {
            list,
            anonymous: false,
            epoch: Instant::now(),
            scope_secret: scope_secret(),
            operator_key_hash: None,
        })
    }

    /// The prefix-cache scope of a request of `t` with `salt` (K11).
    /// `None`: the tenant's own scope (`request::Scope::tenant`). A group
    /// (set by the operator) widens it to the group's tenants; a salt only
    /// narrows: it is hashed inside the tenant's or group's scope, with a
    /// per-process secret, so no salt names another tenant's scope.
    pub fn cache_scope(&self, t: &Tenant, salt: Option<&str>) -> Option<request::Scope> {
        if t.cache_group.is_none() && salt.is_none() {
            return None;
        }
        let mut h = Sha256::new();
        h.update(b"isoserve-cache-scope-v1");
        h.update(self.scope_secret);
        let part = |h: &mut Sha256, bytes: &[u8]| {
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        match &t.cache_group {
            Some(g) => {
                part(&mut h, b"group");
                part(&mut h, g.as_bytes());
            }
            None => {
                part(&mut h, b"tenant");
                part(&mut h, &t.id.0.to_le_bytes());
            }
        }
        match salt {
            Some(s) => {
                part(&mut h, b"salt");
                part(&mut h, s.as_bytes());
            }
            None => part(&mut h, b"unsalted"),
        }
        let d: [u8; 32] = h.finalize().into();
        let v = u64::from_le_bytes(d[..8].try_into().expect("8 bytes"));
        Some(request::Scope::derived(v))
    }

    /// Parses the TOML text of a tenants file.
    pub fn from_toml(text: &str) -> Result<Tenants, TenantsError> {
        let f: TenantsFile = toml::from_str(text).map_err(|e| TenantsError::Toml(e.to_string()))?;
        let mut t = Tenants::from_specs(f.tenant)?;
        if let Some(op) = f.operator {
            t.set_operator(&op.api_key_sha256)?;
        }
        Ok(t)
    }

    /// Reads a tenants file.
    pub fn load(path: &Path) -> Result<Tenants, ServerError> {
        let text = std::fs::read_to_string(path).map_err(|source| ServerError::TenantsIo {
            path: path.display().to_string(),
            source,
        })?;
        Tenants::from_toml(&text).map_err(|why| ServerError::TenantsInvalid {
            path: path.display().to_string(),
            why,
        })
    }

    pub fn is_anonymous(&self) -> bool {
        self.anonymous
    }

    pub fn len(&self) -> usize {
        self.list.len()
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Tenant>> {
        self.list.iter()
    }

    /// The tenant of an `Authorization` header value (`Bearer KEY`).
    /// `Err(true)`: no key given; `Err(false)`: a wrong key.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Arc<Tenant>, AuthError> {
        if self.anonymous {
            return Ok(self.list[0].clone());
        }
        let key = bearer_key(authorization.ok_or(AuthError::Missing)?)?;
        self.tenant_of_key(key)
    }

    /// The tenant whose key a `Bearer` or `Basic` credential carries (the
    /// console tells a tenant's key from a wrong one by it).
    pub fn tenant_of_credentials(
        &self,
        authorization: Option<&[u8]>,
    ) -> Result<Arc<Tenant>, AuthError> {
        if self.anonymous {
            return Ok(self.list[0].clone());
        }
        let key = operator_key(authorization.ok_or(AuthError::Missing)?)?;
        self.tenant_of_key(&key)
    }

    fn tenant_of_key(&self, key: &[u8]) -> Result<Arc<Tenant>, AuthError> {
        let h = sha256(key);
        // Compare with every tenant; select the match without branching on
        // secret data.
        let mut hit: u8 = 0;
        let mut index: usize = 0;
        for (i, t) in self.list.iter().enumerate() {
            let eq = ct_eq(&h, &t.key_hash);
            let mask = (eq as usize).wrapping_neg();
            index |= i & mask;
            hit |= eq;
        }
        if std::hint::black_box(hit) == 1 {
            Ok(self.list[index].clone())
        } else {
            Err(AuthError::Wrong)
        }
    }

    /// The name of the tenant with pool owner id `id`.
    pub fn name_of(&self, id: request::TenantId) -> Option<&str> {
        self.list
            .iter()
            .find(|t| t.id == id)
            .map(|t| t.name.as_str())
    }

    /// Sets the operator's key (its SHA-256, hex), which reads `/metrics`.
    pub fn set_operator(&mut self, api_key_sha256: &str) -> Result<(), TenantsError> {
        let h = parse_hex32(api_key_sha256).ok_or(TenantsError::OperatorKeyHash)?;
        if self.list.iter().any(|t| t.key_hash == h) {
            return Err(TenantsError::OperatorIsTenant);
        }
        self.operator_key_hash = Some(h);
        Ok(())
    }

    /// Who may read `/metrics` on the API port: anyone without a tenants
    /// file; with one, the operator's key only (`Ok(false)`: no operator
    /// key is set, so nobody).
    pub fn operator(&self, authorization: Option<&[u8]>) -> Result<bool, AuthError> {
        if self.anonymous {
            return Ok(true);
        }
        let Some(op) = self.operator_key_hash else {
            return Ok(false);
        };
        let key = operator_key(authorization.ok_or(AuthError::Missing)?)?;
        match ct_eq(&sha256(&key), &op) {
            1 => Ok(true),
            _ => Err(AuthError::Wrong),
        }
    }

    fn second(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_secs()
    }

    /// Admits a request of `tokens` (prompt + max_tokens) for `tenant` at
    /// `now`: checks the concurrency and tokens-per-minute limits and, if
    /// both pass, takes a concurrency slot and charges the tokens.
    pub fn admit(
        &self,
        tenant: &Arc<Tenant>,
        tokens: u64,
        now: Instant,
    ) -> Result<TenantPermit, LimitError> {
        let mut p = self.admit_all(tenant, &[tokens], now)?;
        Ok(p.pop().expect("one permit for one request"))
    }

    /// Admits the sequences of one request (`n` choices, a batch of
    /// prompts), `tokens[i]` each, all or none, under one lock: the limits
    /// see their sum, so a request that could never fit is told so (not
    /// 429 forever), and two requests cannot each take half the slots and
    /// both fail. One permit per sequence, each charged its own tokens.
    pub fn admit_all(
        &self,
        tenant: &Arc<Tenant>,
        tokens_each: &[u64],
        now: Instant,
    ) -> Result<Vec<TenantPermit>, LimitError> {
        let sec = self.second(now);
        let k = tokens_each.len();
        let tokens: u64 = tokens_each.iter().fold(0u64, |a, &t| a.saturating_add(t));
        let mut u = tenant.lock();
        if u.running.saturating_add(k) > tenant.max_concurrent {
            return Err(LimitError::Concurrency {
                tenant: tenant.name.clone(),
                limit: tenant.max_concurrent,
            });
        }
        let mut charged = false;
        if let Some(limit) = tenant.max_tokens_per_minute {
            if tokens > limit {
                return Err(LimitError::RequestTooLarge {
                    tenant: tenant.name.clone(),
                    limit,
                    need: tokens,
                });
            }
            // Drop seconds that left the window [sec - 59, sec].
            while let Some(&(s, t)) = u.window.front() {
                if s + WINDOW.as_secs() <= sec {
                    u.window.pop_front();
                    u.window_sum -= t;
                } else {
                    break;
                }
            }
            if u.window_sum + tokens > limit {
                // The earliest second at which enough old tokens expire.
                let mut freed = 0;
                let mut retry_after = WINDOW.as_secs();
                for &(s, t) in &u.window {
                    freed += t;
                    if u.window_sum - freed + tokens <= limit {
                        retry_after = (s + WINDOW.as_secs()).saturating_sub(sec).max(1);
                        break;
                    }
                }
                return Err(LimitError::TokensPerMinute {
                    tenant: tenant.name.clone(),
                    limit,
                    used: u.window_sum,
                    need: tokens,
                    retry_after,
                });
            }
            match u.window.back_mut() {
                Some(last) if last.0 == sec => last.1 += tokens,
                _ => u.window.push_back((sec, tokens)),
            }
            u.window_sum += tokens;
            charged = true;
        }
        u.running += k;
        drop(u);
        Ok(tokens_each
            .iter()
            .map(|&t| TenantPermit {
                tenant: tenant.clone(),
                charged: charged.then_some((sec, t)),
            })
            .collect())
    }
}

/// The key of `Bearer KEY` (scheme case-insensitive), bounded in length.
/// Why a request's key was not accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthError {
    /// No `Authorization: Bearer KEY` header (or an empty key).
    Missing,
    /// A key longer than [`API_KEY_BYTES_MAX`] (never hashed).
    TooLong,
    /// A key no tenant has.
    Wrong,
}

fn bearer_key(value: &[u8]) -> Result<&[u8], AuthError> {
    if value.len() < 7 || !value[..7].eq_ignore_ascii_case(b"bearer ") {
        return Err(AuthError::Missing);
    }
    let key = value[7..].trim_ascii();
    if key.is_empty() {
        return Err(AuthError::Missing);
    }
    if key.len() > API_KEY_BYTES_MAX {
        return Err(AuthError::TooLong);
    }
    Ok(key)
}

/// The key of `Authorization: Bearer KEY`, or of `Basic` credentials
/// (any user name, the key as password): a browser opens the operator
/// console with its own credentials prompt, which speaks only Basic.
fn operator_key(value: &[u8]) -> Result<Vec<u8>, AuthError> {
    use base64::Engine as _;
    if value.len() < 6 || !value[..6].eq_ignore_ascii_case(b"basic ") {
        return bearer_key(value).map(<[u8]>::to_vec);
    }
    let encoded = value[6..].trim_ascii();
    // Base64 of `user:key`: 4/3 of the key's limit and room for a user.
    if encoded.len() > (API_KEY_BYTES_MAX + 256) * 4 / 3 + 4 {
        return Err(AuthError::TooLong);
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|_| AuthError::Missing)?;
    let at = decoded
        .iter()
        .position(|&b| b == b':')
        .ok_or(AuthError::Missing)?;
    let key = decoded[at + 1..].trim_ascii();
    if key.is_empty() {
        return Err(AuthError::Missing);
    }
    if key.len() > API_KEY_BYTES_MAX {
        return Err(AuthError::TooLong);
    }
    Ok(key.to_vec())
}

/// Hex SHA-256 of a key, as the tenants file wants it.
pub fn key_sha256_hex(key: &str) -> String {
    sha256(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests;
