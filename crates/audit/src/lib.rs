//! The incident's signature in a request log.
//!
//! After the incident, users were told to audit their logs. This crate is
//! that audit as a pure function of the log's lines: each request is
//! matched against four rules, and the matches are counted per tenant and
//! per time window.
//!
//! | rule | a request that… | needs |
//! |---|---|---|
//! | `over_capacity` | was answered with a prompt longer than the KV pool (or the window) held at the time | `prompt_tokens`, `kv_capacity_tokens` or `context_window_tokens` |
//! | `too_fast` | was answered faster than the server's prefill rate allows for its prompt | `prompt_tokens` (less `cached_tokens`, if logged: a prefix cache's tokens are not prefilled), `ttft_ms`, `prefill_tokens_per_s` (or `--prefill-tokens-per-s`) |
//! | `rejected_after_allocation` | was refused or failed while KV pages were allocated to it | `outcome`, `pages` |
//! | `kv_safety_event` | tripped a checksum, canary or fence check | `error_code` or `kv_event` |
//!
//! The reader ([`read`]) maps any server's JSONL or CSV log onto these
//! fields ([`Mapping`]); the matcher ([`Auditor`]) cannot fail and holds
//! a bounded amount of state whatever the log's size.
//!
//! ```
//! use audit::{Auditor, Mapping, Signature, read};
//! let log = r#"{"id":"a","tenant":"acme","ts":"2026-12-04T02:00:00Z","outcome":"finished","prompt_tokens":5000,"ttft_ms":12.0,"kv_capacity_tokens":4096,"prefill_tokens_per_s":1000.0,"pages":0}
//! {"id":"b","tenant":"zeta","ts":"2026-12-04T02:00:01Z","outcome":"finished","prompt_tokens":500,"ttft_ms":900.0,"kv_capacity_tokens":4096,"prefill_tokens_per_s":1000.0,"pages":32}"#;
//! let mut a = Auditor::new(Signature::default());
//! read::read_jsonl(log.as_bytes(), &Mapping::ours(), |r| a.push(r)).unwrap();
//! let report = a.finish();
//! assert_eq!(report.matches_total, 2); // request a: over capacity, and too fast
//! assert_eq!(report.by_tenant["acme"].len(), 2);
//! assert!(!report.by_tenant.contains_key("zeta"));
//! ```

#![forbid(unsafe_code)]

pub mod read;

use std::collections::BTreeMap;

use serde::Serialize;

pub use read::{Field, Format, Mapping, Outcome, Record, Unreadable};

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("cannot read the log: {0}")]
    Io(String),
    #[error("bad mapping `{spec}`: {why}")]
    Mapping { spec: String, why: String },
}

/// One rule of the signature.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    OverCapacity,
    TooFast,
    RejectedAfterAllocation,
    KvSafetyEvent,
}

impl Rule {
    pub const ALL: [Rule; 4] = [
        Rule::OverCapacity,
        Rule::TooFast,
        Rule::RejectedAfterAllocation,
        Rule::KvSafetyEvent,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Rule::OverCapacity => "over_capacity",
            Rule::TooFast => "too_fast",
            Rule::RejectedAfterAllocation => "rejected_after_allocation",
            Rule::KvSafetyEvent => "kv_safety_event",
        }
    }
}

/// Error codes that name a KV safety check firing: ours (checksum, canary,
/// fence, incomplete or refused transfer, protocol breach) and the pool's
/// refusals as `/metrics` names them.
pub const SAFETY_CODES: &[&str] = &[
    "checksum_mismatch",
    "canary_mismatch",
    "transfer_fenced",
    "transfer_incomplete",
    "transfer_refused",
    "transfer_protocol",
    "stale_handle",
    "not_owner",
    "double_free",
];

/// The thresholds of the rules.
#[derive(Clone, Debug, PartialEq)]
pub struct Signature {
    /// The prefill rate for records that do not carry their own.
    pub prefill_tokens_per_s: Option<f64>,
    /// `too_fast` when TTFT is below this fraction of the time the prefill
    /// rate needs for the prompt (the rate is a measurement, and a request
    /// batched alone may beat the average: a margin of 2x by default).
    pub ttft_fraction: f64,
    /// `too_fast` only for prompts at least this long (a short prompt's
    /// TTFT is dominated by everything but prefill).
    pub too_fast_prompt_tokens_min: u64,
    /// Width of the time windows matches are counted in.
    pub window_s: u64,
    /// Matches listed one by one (all are counted).
    pub matches_listed_max: usize,
    /// Unreadable lines listed one by one (all are counted).
    pub unreadable_listed_max: usize,
    /// Distinct tenants and windows counted separately; beyond, into
    /// `(other)`.
    pub groups_max: usize,
}

impl Default for Signature {
    fn default() -> Self {
        Signature {
            prefill_tokens_per_s: None,
            ttft_fraction: 0.5,
            too_fast_prompt_tokens_min: 256,
            window_s: 3600,
            matches_listed_max: 1000,
            unreadable_listed_max: 20,
            groups_max: 10_000,
        }
    }
}

/// One request matching one rule.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Match {
    pub rule: Rule,
    pub line: usize,
    pub id: Option<String>,
    pub tenant: Option<String>,
    pub ts: Option<String>,
    pub detail: String,
}

/// Which rules a record matches, and which it carried the inputs for.
/// Pure: the whole signature in one place.
pub fn check(r: &Record, sig: &Signature) -> (Vec<(Rule, String)>, Vec<Rule>) {
    let mut found = Vec::new();
    let mut checked = Vec::new();
    let answered = r.outcome == Outcome::Finished || r.output_tokens.is_some_and(|n| n > 0);
    let refused = matches!(r.outcome, Outcome::Rejected | Outcome::Error);

    let limit = match (r.kv_capacity_tokens, r.context_window_tokens) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    if let (Some(p), Some(limit)) = (r.prompt_tokens, limit) {
        checked.push(Rule::OverCapacity);
        if answered && p > limit {
            found.push((
                Rule::OverCapacity,
                format!(
                    "a prompt of {p} tokens was answered ({}); the server could hold {limit} \
                     (KV pool {}, window {})",
                    r.outcome.as_str(),
                    r.kv_capacity_tokens
                        .map_or("unknown".into(), |n| n.to_string()),
                    r.context_window_tokens
                        .map_or("unknown".into(), |n| n.to_string()),
                ),
            ));
        }
    }

    let rate = r
        .prefill_tokens_per_s
        .or(sig.prefill_tokens_per_s)
        .filter(|&x| x > 0.0);
    // Tokens a prefix cache served were not prefilled: only the rest is
    // timed.
    let prefilled = r
        .prompt_tokens
        .map(|p| p.saturating_sub(r.cached_tokens.unwrap_or(0)));
    if let (Some(p), Some(ttft), Some(rate)) = (prefilled, r.ttft_ms, rate) {
        checked.push(Rule::TooFast);
        let need_ms = p as f64 / rate * 1000.0;
        if answered && p >= sig.too_fast_prompt_tokens_min && ttft < need_ms * sig.ttft_fraction {
            found.push((
                Rule::TooFast,
                format!(
                    "first token after {ttft:.1} ms for a prompt of {p} tokens; prefill at \
                     {rate:.0} tokens/s needs {need_ms:.0} ms"
                ),
            ));
        }
    }

    if let (true, Some(pages)) = (r.outcome != Outcome::Unknown, r.pages) {
        checked.push(Rule::RejectedAfterAllocation);
        if refused && pages > 0 {
            found.push((
                Rule::RejectedAfterAllocation,
                format!(
                    "{} ({}) while {pages} KV pages were allocated to it",
                    r.outcome.as_str(),
                    r.error_code.as_deref().unwrap_or("no error code")
                ),
            ));
        }
    }

    if r.outcome != Outcome::Unknown || r.error_code.is_some() || r.kv_event.is_some() {
        checked.push(Rule::KvSafetyEvent);
        let code = r.error_code.as_deref().filter(|c| SAFETY_CODES.contains(c));
        let event = r.kv_event.as_deref().filter(|e| !e.is_empty());
        if let Some(what) = event.or(code) {
            found.push((
                Rule::KvSafetyEvent,
                format!("KV safety check fired: {what}"),
            ));
        }
    }
    (found, checked)
}

/// Per-rule counts.
pub type Counts = BTreeMap<Rule, u64>;

/// What an audit found.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Report {
    /// Records read (readable lines).
    pub records: u64,
    pub unreadable_total: u64,
    pub unreadable: Vec<UnreadableLine>,
    /// Per rule: the records that carried its inputs.
    pub checked: Counts,
    pub matches_total: u64,
    /// The first `matches_listed_max` matches, in log order.
    pub matches: Vec<Match>,
    /// Per rule: matches.
    pub by_rule: Counts,
    /// Per tenant (`(none)` when the log names none): matches per rule.
    pub by_tenant: BTreeMap<String, Counts>,
    /// Per window start (RFC 3339; `(untimed)` without a timestamp).
    pub by_window: BTreeMap<String, Counts>,
    pub window_s: u64,
    /// Rules no record carried the inputs for.
    pub unchecked: Vec<Rule>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct UnreadableLine {
    pub line: usize,
    pub why: String,
}

impl Report {
    /// 0: read, checked, no match; 1: matches; 2: could not audit (nothing
    /// readable, or no rule had its inputs on any record).
    pub fn exit_code(&self) -> i32 {
        if self.records == 0 || self.checked.values().all(|&n| n == 0) {
            2
        } else if self.matches_total > 0 {
            1
        } else {
            0
        }
    }

    /// The human summary.
    pub fn render(&self, source: &str) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "isoserve audit of {source}: {} records ({} unreadable lines); {} match the incident's signature",
            self.records, self.unreadable_total, self.matches_total
        );
        for rule in Rule::ALL {
            let checked = self.checked.get(&rule).copied().unwrap_or(0);
            let n = self.by_rule.get(&rule).copied().unwrap_or(0);
            let note = if checked == 0 {
                " (not checked: no record carries its fields)"
            } else {
                ""
            };
            let _ = writeln!(
                s,
                "  {:<26} {n:>6} of {checked} records checked{note}",
                rule.as_str()
            );
        }
        let counts = |c: &Counts| {
            c.iter()
                .map(|(r, n)| format!("{} {n}", r.as_str()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if !self.by_tenant.is_empty() {
            let _ = writeln!(s, "by tenant:");
            for (t, c) in &self.by_tenant {
                let _ = writeln!(s, "  {t:<24} {}", counts(c));
            }
            let _ = writeln!(s, "by window ({} s):", self.window_s);
            for (w, c) in &self.by_window {
                let _ = writeln!(s, "  {w:<24} {}", counts(c));
            }
            let _ = writeln!(s, "matches:");
            for m in &self.matches {
                let _ = writeln!(
                    s,
                    "  line {} {} tenant {} id {}: [{}] {}",
                    m.line,
                    m.ts.as_deref().unwrap_or("(untimed)"),
                    m.tenant.as_deref().unwrap_or("(none)"),
                    m.id.as_deref().unwrap_or("(none)"),
                    m.rule.as_str(),
                    m.detail
                );
            }
            if (self.matches.len() as u64) < self.matches_total {
                let _ = writeln!(
                    s,
                    "  … {} more (all are counted above)",
                    self.matches_total - self.matches.len() as u64
                );
            }
        }
        for u in &self.unreadable {
            let _ = writeln!(s, "unreadable line {}: {}", u.line, u.why);
        }
        if (self.unreadable.len() as u64) < self.unreadable_total {
            let _ = writeln!(
                s,
                "… {} more unreadable lines",
                self.unreadable_total - self.unreadable.len() as u64
            );
        }
        s
    }
}

/// Consumes records one at a time; [`Auditor::finish`] gives the report.
pub struct Auditor {
    sig: Signature,
    report: Report,
}

impl Auditor {
    pub fn new(sig: Signature) -> Auditor {
        let report = Report {
            window_s: sig.window_s.max(1),
            checked: Rule::ALL.iter().map(|&r| (r, 0)).collect(),
            ..Report::default()
        };
        Auditor { sig, report }
    }

    pub fn push(&mut self, r: Result<Record, Unreadable>) {
        let rec = match r {
            Ok(rec) => rec,
            Err(u) => {
                self.report.unreadable_total += 1;
                if self.report.unreadable.len() < self.sig.unreadable_listed_max {
                    self.report.unreadable.push(UnreadableLine {
                        line: u.line,
                        why: u.why,
                    });
                }
                return;
            }
        };
        self.report.records += 1;
        let (found, checked) = check(&rec, &self.sig);
        for rule in checked {
            *self.report.checked.entry(rule).or_default() += 1;
        }
        if found.is_empty() {
            return;
        }
        let window_ms = self.report.window_s as i64 * 1000;
        let window = rec.ts_ms.map_or_else(
            || "(untimed)".to_string(),
            |ms| read::format_rfc3339(ms.div_euclid(window_ms) * window_ms),
        );
        let tenant = rec.tenant.clone().unwrap_or_else(|| "(none)".to_string());
        for (rule, detail) in found {
            self.report.matches_total += 1;
            *self.report.by_rule.entry(rule).or_default() += 1;
            let groups_max = self.sig.groups_max;
            let bump = |m: &mut BTreeMap<String, Counts>, key: &str| {
                let key = if m.contains_key(key) || m.len() < groups_max {
                    key
                } else {
                    "(other)"
                };
                *m.entry(key.to_string())
                    .or_default()
                    .entry(rule)
                    .or_default() += 1;
            };
            bump(&mut self.report.by_tenant, &tenant);
            bump(&mut self.report.by_window, &window);
            if self.report.matches.len() < self.sig.matches_listed_max {
                self.report.matches.push(Match {
                    rule,
                    line: rec.line,
                    id: rec.id.clone(),
                    tenant: rec.tenant.clone(),
                    ts: rec.ts_ms.map(read::format_rfc3339),
                    detail,
                });
            }
        }
    }

    pub fn finish(mut self) -> Report {
        self.report.unchecked = Rule::ALL
            .into_iter()
            .filter(|r| self.report.checked.get(r).copied().unwrap_or(0) == 0)
            .collect();
        self.report
    }
}

#[cfg(test)]
mod tests;
