//! The probe against fake servers: an honest one (no findings) and one
//! with the incident's bugs (each check finds its own).

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use probe::run::{run, Config, Quiet};
use probe::{Completion, Endpoint, ModelInfo, ProbeError, Request};

/// Tokens = words + 1; prefill at 2000 tokens/s plus 1 ms a token out;
/// answers with the access code its prompt carries.
struct Fake {
    window: u64,
    /// The incident: over-long prompts become a 1-token placeholder that
    /// reads the pages of the previous request.
    incident: bool,
    last_code: Mutex<String>,
    /// A prefix cache: whole prompts seen before answer at once.
    cache: Cache,
    /// (key or "" for a global cache, prompt) seen.
    seen: Mutex<HashSet<(String, String)>>,
    /// A compiled-grammar cache: a schema seen before compiles at once,
    /// a new one takes 80 ms; `None`: `json_schema` is refused (400).
    grammar: Option<Cache>,
    /// (key or "", schema) compiled.
    compiled: Mutex<HashSet<(String, String)>>,
    /// Speculation's cross-request drafts: an answer given before (in the
    /// scope) is drafted, and its tokens come three times as fast.
    drafts: Cache,
    /// (key or "", prompt) answered, for the drafts.
    answered: Mutex<HashSet<(String, String)>>,
    /// Keeps 4 tokens of the window spare by dropping the prompt's oldest
    /// tokens, silently (llama.cpp's `truncated`, reported only in its own
    /// fields).
    cuts: bool,
    /// Requests being answered now, and the most at once.
    busy: std::sync::atomic::AtomicUsize,
    busy_max: std::sync::atomic::AtomicUsize,
}

#[derive(Clone, Copy, PartialEq)]
enum Cache {
    Off,
    /// Per tenant (isolated, as isoserve's).
    PerKey,
    /// One cache for everyone (the side channel).
    Global,
}

fn code_of(prompt: &str) -> Option<String> {
    let i = prompt.find("exactly: ")? + "exactly: ".len();
    let rest = &prompt[i..];
    Some(rest[..rest.find('.')?].to_string())
}

/// The text as tokens of up to three characters.
fn chunks(text: &str) -> Vec<String> {
    let c: Vec<char> = text.chars().collect();
    c.chunks(3).map(|t| t.iter().collect()).collect()
}

impl Endpoint for Fake {
    fn model(&self, _key: &str) -> Result<ModelInfo, ProbeError> {
        Ok(ModelInfo {
            id: "fake".into(),
            context_window: Some(self.window),
        })
    }
    fn complete(&self, key: &str, req: &Request) -> Result<Completion, ProbeError> {
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.busy.fetch_add(1, SeqCst) + 1;
        self.busy_max.fetch_max(now, SeqCst);
        // Long enough for concurrent senders to overlap.
        std::thread::sleep(std::time::Duration::from_millis(2));
        let answer = self.answer(key, req);
        self.busy.fetch_sub(1, SeqCst);
        answer
    }
}

/// A 400 answer with `code`.
fn refused(code: &str) -> Completion {
    Completion {
        status: 400,
        text: String::new(),
        prompt_tokens: None,
        completion_tokens: None,
        tokens: None,
        error_code: Some(code.into()),
        latency_s: 0.001,
        cached_tokens: None,
    }
}

impl Fake {
    fn answer(&self, key: &str, req: &Request) -> Result<Completion, ProbeError> {
        if !key.starts_with("key-") {
            return Ok(Completion {
                status: 401,
                text: String::new(),
                prompt_tokens: None,
                completion_tokens: None,
                tokens: None,
                error_code: Some("invalid_api_key".into()),
                latency_s: 0.001,
                cached_tokens: None,
            });
        }
        let mut tokens = req.prompt.split_whitespace().count() as u64 + 1;
        let total = tokens + req.max_tokens as u64;
        let mut text = code_of(&req.prompt).unwrap_or_else(|| " hello".into());
        if total > self.window {
            if !self.incident {
                return Ok(refused("context_length_exceeded"));
            }
            tokens = 1;
            text = self.last_code.lock().unwrap().clone();
        } else if self.cuts && total > self.window - 4 {
            tokens -= total - (self.window - 4);
        }
        if let Some(c) = code_of(&req.prompt) {
            *self.last_code.lock().unwrap() = c;
        }
        let mut compile_s = 0.0;
        if let Some(schema) = &req.schema {
            let Some(grammar) = self.grammar else {
                return Ok(refused("invalid_value"));
            };
            let scope = match grammar {
                Cache::Global => String::new(),
                _ => key.to_string(),
            };
            let fresh = grammar == Cache::Off
                || self
                    .compiled
                    .lock()
                    .unwrap()
                    .insert((scope, schema.clone()));
            compile_s = if fresh { 0.080 } else { 0.0 };
        }
        let scope = match self.cache {
            Cache::Global => String::new(),
            _ => key.to_string(),
        };
        let hit = self.cache != Cache::Off
            && !self
                .seen
                .lock()
                .unwrap()
                .insert((scope, req.prompt.clone()));
        let scope = match self.drafts {
            Cache::Global => String::new(),
            _ => key.to_string(),
        };
        let drafted = self.drafts != Cache::Off
            && !self
                .answered
                .lock()
                .unwrap()
                .insert((scope, req.prompt.clone()));
        let per_token = if drafted { 0.001 / 3.0 } else { 0.001 };
        let tokens_out = chunks(&text);
        Ok(Completion {
            status: 200,
            text,
            prompt_tokens: Some(tokens),
            completion_tokens: Some(1),
            tokens: Some(tokens_out),
            error_code: None,
            latency_s: compile_s
                + match hit {
                    true => 0.002,
                    false => tokens as f64 / 2000.0,
                }
                + per_token * req.max_tokens as f64,
            cached_tokens: Some(if hit { tokens - 1 } else { 0 }),
        })
    }
}

fn cfg() -> Config {
    Config {
        tenant_keys: vec!["key-a".into(), "key-b".into()],
        deterministic: true,
        prompts_per_tenant: 2,
        rounds: 2,
        concurrency: 4,
        long_prompt_tokens: Some(300),
        time_budget: Duration::from_secs(60),
        ..Config::default()
    }
}

fn fake(incident: bool) -> Fake {
    with_cache(incident, Cache::Off)
}

fn with_cache(incident: bool, cache: Cache) -> Fake {
    Fake {
        window: 2048,
        incident,
        last_code: Mutex::new(String::new()),
        cache,
        seen: Mutex::new(HashSet::new()),
        grammar: Some(Cache::PerKey),
        compiled: Mutex::new(HashSet::new()),
        drafts: Cache::Off,
        answered: Mutex::new(HashSet::new()),
        cuts: false,
        busy: Default::default(),
        busy_max: Default::default(),
    }
}

/// Issue 18: against a server whose prefill is slow for the request
/// limit, the probe sends long prompts fewer at a time (sized from the
/// rate it measured) instead of queueing them past the limit.
#[test]
fn long_prompts_go_fewer_at_a_time_when_the_measured_rate_says_so() {
    let f = fake(false);
    let c = Config {
        // The fake prefills 2000 tokens/s: a near-window prompt (~1.9k
        // tokens) is assumed to take 3 × 0.95 s under load, a marker
        // prompt (300) 0.45 s; half of 2 s holds one of the first, two
        // of the second.
        request_timeout: Duration::from_secs(2),
        ..cfg()
    };
    let report = run(&f, "fake://", &c, &Quiet).expect("runs");
    assert_eq!(report.exit_code(), 0, "{}", report.human());
    let most = f.busy_max.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        (1..=2).contains(&most),
        "{most} requests at once (--concurrency 4)"
    );
    // With the default limit the same run uses its whole concurrency.
    let f = fake(false);
    run(&f, "fake://", &cfg(), &Quiet).expect("runs");
    assert_eq!(f.busy_max.load(std::sync::atomic::Ordering::SeqCst), 4);
}

#[test]
fn an_honest_server_has_no_findings() {
    let r = run(&fake(false), "fake://", &cfg(), &Quiet).expect("runs");
    assert!(r.findings.is_empty(), "{}", r.human());
    assert_eq!(r.exit_code(), 0);
    assert_eq!(r.determinism_agreement, Some(1.0));
    let statuses: Vec<_> = r
        .checks
        .iter()
        .map(|c| (c.check.as_str(), c.status.as_str()))
        .collect();
    assert_eq!(
        statuses,
        [
            ("markers", "passed"),
            ("determinism", "passed"),
            ("over-length", "passed"),
            ("prefix-cache", "passed"),
            ("grammar-cache", "passed"),
            ("drafts", "skipped"),
            ("timing", "passed"),
            ("tokens", "passed")
        ],
        "{}",
        r.human()
    );
    assert!(r.requests_sent > 20);
    let rate = r.prefill_tokens_per_s.unwrap();
    assert!((1000.0..2100.0).contains(&rate), "{rate}");
}

#[test]
fn the_incidents_server_is_caught_by_every_check_it_breaks() {
    let r = run(&fake(true), "fake://", &cfg(), &Quiet).expect("runs");
    assert_eq!(r.exit_code(), 1);
    let kinds: Vec<&str> = r.findings.iter().map(|f| f.kind.as_str()).collect();
    // The over-long request was answered with the previous request's
    // secret, as one token, too fast.
    for k in [
        "marker_cross_tenant",
        "over_length_accepted",
        "answered_faster_than_prefill",
        "prompt_tokens_implausible",
    ] {
        assert!(
            kinds.contains(&k),
            "{k} missing in {kinds:?}\n{}",
            r.human()
        );
    }
    let over = r
        .findings
        .iter()
        .find(|f| f.kind == "over_length_accepted")
        .unwrap();
    assert!(
        over.detail.contains("prompt_tokens Some(1)"),
        "{}",
        over.detail
    );
}

/// A server that answers a prompt after silently dropping part of it to
/// fit the window: the "at the window" prompt counts fewer tokens than the
/// same text did when sized.
#[test]
fn a_server_that_cuts_prompts_to_fit_is_caught() {
    let f = Fake {
        cuts: true,
        ..fake(false)
    };
    let r = run(&f, "fake://", &cfg(), &Quiet).expect("runs");
    let cut: Vec<_> = r
        .findings
        .iter()
        .filter(|f| f.kind == "prompt_truncated")
        .collect();
    assert_eq!(cut.len(), 1, "{}", r.human());
    assert!(
        cut[0].detail.contains("silently dropped"),
        "{}",
        cut[0].detail
    );
}

#[test]
fn a_refused_key_or_a_single_tenant_cannot_run() {
    let mut c = cfg();
    c.tenant_keys[1] = "wrong".into();
    let e = run(&fake(false), "fake://", &c, &Quiet).unwrap_err();
    assert!(
        matches!(
            e,
            ProbeError::KeyRefused {
                index: 2,
                status: 401,
                ..
            }
        ),
        "{e}"
    );
    c.tenant_keys.truncate(1);
    assert!(matches!(
        run(&fake(false), "fake://", &c, &Quiet).unwrap_err(),
        ProbeError::Config(_)
    ));
}

/// A server with a per-tenant prefix cache answers repeats at once: no
/// timing finding, since every prompt the probe times is new (its nonce
/// first), and no cache finding, since the second tenant's copy of the
/// first's prompt is cold for it.
#[test]
fn a_per_tenant_prefix_cache_is_no_finding() {
    let r = run(&with_cache(false, Cache::PerKey), "fake://", &cfg(), &Quiet).expect("runs");
    assert!(r.findings.is_empty(), "{}\n{:#?}", r.human(), r.findings);
}

/// One cache for every tenant: the second tenant's copy of the first's
/// prompt comes back at once and is reported cached.
#[test]
fn a_prefix_cache_shared_across_tenants_is_caught() {
    let r = run(&with_cache(false, Cache::Global), "fake://", &cfg(), &Quiet).expect("runs");
    let kinds: Vec<&str> = r.findings.iter().map(|f| f.kind.as_str()).collect();
    assert!(
        kinds.contains(&"prefix_cache_shared_across_tenants"),
        "{}",
        r.human()
    );
    assert!(
        kinds.contains(&"cached_tokens_across_tenants"),
        "{}",
        r.human()
    );
    assert_eq!(r.exit_code(), 1);
}

/// Issue 34: a compiled-grammar cache shared across tenants answers a
/// schema another tenant sent at once; the probe finds exactly that, and
/// nothing for a per-tenant cache, none at all, or a server that refuses
/// `json_schema` (the check is skipped).
#[test]
fn a_grammar_cache_shared_across_tenants_is_caught_and_nothing_else() {
    for (grammar, finds, status) in [
        (Some(Cache::Global), true, "findings"),
        (Some(Cache::PerKey), false, "passed"),
        (Some(Cache::Off), false, "passed"),
        (None, false, "skipped"),
    ] {
        let f = Fake {
            grammar,
            ..fake(false)
        };
        let r = run(&f, "fake://", &cfg(), &Quiet).expect("runs");
        let kinds: Vec<&str> = r.findings.iter().map(|f| f.kind.as_str()).collect();
        let want: &[&str] = if finds {
            &["grammar_cache_shared_across_tenants"]
        } else {
            &[]
        };
        assert_eq!(kinds, want, "{}", r.human());
        let check = r
            .checks
            .iter()
            .find(|c| c.check == "grammar-cache")
            .unwrap();
        assert_eq!(check.status, status, "{}", r.human());
    }
}

/// Issue 37: a server that drafts from earlier requests per tenant passes
/// the drafts check; one whose draft pool is shared is caught (and only by
/// it); one that drafts nothing across requests skips it.
#[test]
fn drafts_shared_across_tenants_are_caught_and_nothing_else() {
    for (drafts, finds, status) in [
        (Cache::Global, true, "findings"),
        (Cache::PerKey, false, "passed"),
        (Cache::Off, false, "skipped"),
    ] {
        let f = Fake {
            drafts,
            ..fake(false)
        };
        let r = run(&f, "fake://", &cfg(), &Quiet).expect("runs");
        let kinds: Vec<&str> = r.findings.iter().map(|f| f.kind.as_str()).collect();
        let want: &[&str] = if finds {
            &["drafts_shared_across_tenants"]
        } else {
            &[]
        };
        assert_eq!(kinds, want, "{}", r.human());
        let check = r.checks.iter().find(|c| c.check == "drafts").unwrap();
        assert_eq!(check.status, status, "{}", r.human());
    }
}
