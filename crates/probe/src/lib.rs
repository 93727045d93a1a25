//! `probe` — test the output, not the pipes: a black-box isolation tester
//! for any OpenAI-compatible endpoint.
//!
//! It knows nothing about the server it tests beyond the OpenAI API
//! (`GET /v1/models`, `POST /v1/completions`): every check is a statement
//! about answers. The checks:
//!
//! 1. **markers** — every probe prompt carries its own random secret; under
//!    concurrent load with long prompts, no output may contain a piece of
//!    another request's secret (another tenant's: `marker_cross_tenant`;
//!    the same tenant's other request: `marker_cross_request`). A piece is
//!    matched on the output's normalised text (case, spaces and punctuation
//!    ignored) and on the tokens the server reports it was made of
//!    (`logprobs.tokens`, asked for when the server offers them), so neither
//!    a token split nor a server's rendering of its text hides one. Right
//!    before the window checks, the first tenant floods the server with
//!    prompts stating one secret every few words, and the last tenant
//!    sends three over-long prompts asking for an access code, each right
//!    after one more flood prompt sent alone: a server that answers them
//!    from KV it never wrote (the incident) recites that secret.
//! 2. **determinism** — each prompt's greedy output under load against its
//!    output on the idle server: for a server claiming determinism every
//!    difference is a finding; otherwise the agreement rate is reported.
//! 3. **over-length** — requests just under, exactly at and over the
//!    advertised context window: the first two must succeed, the last must
//!    fail with a 4xx. A 200 for an over-long prompt is the incident.
//! 4. **timing** — the server's prefill rate on mid-size prompts bounds how
//!    fast a long prompt can be answered; one answered much faster was not
//!    prefilled.
//! 5. **token accounting** — `usage.prompt_tokens` must grow with the
//!    prompt and stay within what its words and characters allow.
//! 6. **caches across tenants** — the prefix cache (another tenant's prompt
//!    answered faster, or reported as cached), the compiled-grammar cache
//!    (another tenant's schema compiled faster) and speculation's drafts
//!    (another tenant's copy of an answer decoded at the speed of a
//!    repeat): timing side channels, each over several trials.
//!
//! The pure part ([`secrets`], [`checks`], [`Report`]) makes no I/O; the
//! [`Endpoint`] trait is the only door to the server ([`http::HttpEndpoint`]
//! in production, a fake in tests).
//!
//! ```
//! use probe::secrets::Secret;
//! let s = Secret::generate(&mut probe::rng(7), 2, 0);
//! let leak = format!("... the code is {} ...", s.pieces[1].to_uppercase());
//! assert_eq!(s.found_in(&leak), Some(s.pieces[1].clone()));
//! assert_eq!(s.found_in("nothing to see"), None);
//! ```

#![forbid(unsafe_code)]

pub mod checks;
pub mod http;
pub mod run;
pub mod secrets;

use serde::Serialize;

/// A deterministic RNG for secrets and prompt order (`--seed`).
pub fn rng(seed: u64) -> rand::rngs::StdRng {
    use rand::SeedableRng;
    rand::rngs::StdRng::seed_from_u64(seed)
}

/// What the server says about its model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelInfo {
    pub id: String,
    /// `max_model_len` or `context_length`, if advertised.
    pub context_window: Option<u64>,
}

/// One completion request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub prompt: String,
    pub max_tokens: u32,
    /// A JSON schema the output must follow (`response_format`
    /// `json_schema`), as JSON text; `None`: free text.
    pub schema: Option<String>,
}

/// One answer (success or an HTTP error).
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub status: u16,
    pub text: String,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// The tokens of `text` as the server reports them
    /// (`choices[0].logprobs.tokens`), if it does.
    pub tokens: Option<Vec<String>>,
    /// `error.code` (or `error.type`) of an error answer.
    pub error_code: Option<String>,
    pub latency_s: f64,
    /// `usage.prompt_tokens_details.cached_tokens`, if reported.
    pub cached_tokens: Option<u64>,
}

impl Completion {
    pub fn ok(&self) -> bool {
        self.status == 200
    }
}

/// Why the probe could not run (exit code 2).
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("cannot reach {url}: {why}")]
    Unreachable { url: String, why: String },
    #[error("{url} answered something that is not the OpenAI API: {why}")]
    NotOpenAi { url: String, why: String },
    #[error("tenant key #{index} was refused ({status}): {why}")]
    KeyRefused {
        index: usize,
        status: u16,
        why: String,
    },
    #[error("{0}")]
    Config(String),
    #[error("the probe did not finish within its time budget of {0} s")]
    OutOfTime(u64),
    #[error(
        "a request to {url} got no answer within {after_s:.1} s (--request-timeout-s): {what}; \
         the server is slower than that limit allows (raise --request-timeout-s, or lower \
         --concurrency)"
    )]
    TimedOut {
        url: String,
        what: String,
        after_s: f64,
    },
}

/// The only door to the server under test.
pub trait Endpoint: Sync {
    /// `GET /v1/models` with tenant key `key` (many servers want a key
    /// on every route).
    fn model(&self, key: &str) -> Result<ModelInfo, ProbeError>;
    /// A greedy completion with tenant key `key`. `Err` only when no HTTP
    /// answer came at all (an HTTP error status is a `Completion`).
    fn complete(&self, key: &str, req: &Request) -> Result<Completion, ProbeError>;
}

/// One finding: a check saw the server do something it must not.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Finding {
    /// e.g. `marker_cross_tenant`, `over_length_accepted`.
    pub kind: String,
    pub check: String,
    pub detail: String,
    /// How sure the probe is.
    pub evidence: Evidence,
}

/// How sure a finding is (docs/probe.md lists every kind's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Evidence {
    /// The server's own answer shows it: another tenant's secret in an
    /// output, cached tokens it reports for another tenant's prompt, a
    /// status or a count that breaks the API's contract.
    Exact,
    /// A timing signal, over several trials: the detail gives the trials
    /// and their spread.
    Statistical,
    /// A bound that assumes something of the server's tokenizer (stated
    /// in docs/probe.md); true of every tokenizer the probe was run on.
    Heuristic,
}

impl Evidence {
    pub fn as_str(self) -> &'static str {
        match self {
            Evidence::Exact => "exact",
            Evidence::Statistical => "statistical",
            Evidence::Heuristic => "heuristic",
        }
    }
}

/// Outcome of one check.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CheckResult {
    pub check: String,
    /// `passed`, `findings` or `skipped`.
    pub status: String,
    pub summary: String,
}

/// The JSON report (`--json`) and the human summary.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    pub url: String,
    pub model: String,
    pub context_window: Option<u64>,
    pub tenants: usize,
    pub requests_sent: u64,
    pub seconds: f64,
    pub checks: Vec<CheckResult>,
    pub findings: Vec<Finding>,
    /// Determinism: outputs under load equal to the idle outputs.
    pub determinism_agreement: Option<f64>,
    /// Prefill rate measured on mid-size prompts (tokens per second).
    pub prefill_tokens_per_s: Option<f64>,
}

impl Report {
    /// 0 clean, 1 findings.
    pub fn exit_code(&self) -> u8 {
        u8::from(!self.findings.is_empty())
    }

    pub fn human(&self) -> String {
        let mut s = format!(
            "isoserve probe of {} (model {}, context window {}, {} tenants): {} requests in {:.0} s\n",
            self.url,
            self.model,
            self.context_window
                .map_or("not advertised".into(), |w| w.to_string()),
            self.tenants,
            self.requests_sent,
            self.seconds
        );
        for c in &self.checks {
            s += &format!("  {:<12} {:<9} {}\n", c.check, c.status, c.summary);
        }
        if self.findings.is_empty() {
            s += "no findings\n";
        } else {
            s += &format!("{} FINDINGS:\n", self.findings.len());
            for f in &self.findings {
                s += &format!(
                    "  [{}] {} ({}): {}\n",
                    f.check,
                    f.kind,
                    f.evidence.as_str(),
                    f.detail
                );
            }
        }
        s
    }
}
