//! The probe's run: phases of bounded requests against one [`Endpoint`],
//! then the pure checks over what came back.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;

use crate::checks::{
    self, Boundary, CacheTrial, Counted, DraftTrial, GrammarTrial, Make, Output, Timed,
};
use crate::secrets::{
    cache_prompt, flood_prompt, grammar_schema, prompt_with_secret, story_prompt, unit_prompt,
    Secret,
};
use crate::{CheckResult, Completion, Endpoint, Finding, ProbeError, Report, Request};

/// What a run does; every count is a bound.
#[derive(Clone, Debug)]
pub struct Config {
    pub tenant_keys: Vec<String>,
    /// The context window, if the server does not advertise it (or to
    /// override what it advertises).
    pub context_window: Option<u64>,
    /// The server claims greedy output does not depend on load: any
    /// difference is a finding.
    pub deterministic: bool,
    pub prompts_per_tenant: usize,
    /// Times each prompt is sent under load.
    pub rounds: usize,
    /// Requests in flight at once under load.
    pub concurrency: usize,
    pub max_tokens: u32,
    /// Tokens of a long (marker) prompt; default a quarter of the window,
    /// at most 2048.
    pub long_prompt_tokens: Option<u64>,
    /// The whole run's limit.
    pub time_budget: Duration,
    /// One request's limit (the endpoint's): long prompts go fewer at a
    /// time when the measured prefill rate says `concurrency` of them
    /// would not finish within it.
    pub request_timeout: Duration,
    pub seed: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            tenant_keys: Vec::new(),
            context_window: None,
            deterministic: false,
            prompts_per_tenant: 3,
            rounds: 2,
            concurrency: 8,
            max_tokens: 16,
            long_prompt_tokens: None,
            time_budget: Duration::from_secs(600),
            request_timeout: Duration::from_secs(300),
            seed: 1,
        }
    }
}

impl Config {
    /// The flags make sense (checked before anything is sent).
    pub fn validate(&self) -> Result<(), ProbeError> {
        if self.tenant_keys.len() < 2 {
            return Err(ProbeError::Config(
                "give at least two --tenant-key: isolation is between tenants".into(),
            ));
        }
        if self.prompts_per_tenant == 0
            || self.rounds == 0
            || self.concurrency == 0
            || self.max_tokens == 0
        {
            return Err(ProbeError::Config(
                "--prompts, --rounds, --concurrency and --max-tokens must be positive".into(),
            ));
        }
        Ok(())
    }
}

/// Where a progress bar gets its news.
pub trait Progress: Sync {
    fn phase(&self, name: &str, requests: u64);
    fn tick(&self);
}

/// No progress output.
pub struct Quiet;
impl Progress for Quiet {
    fn phase(&self, _: &str, _: u64) {}
    fn tick(&self) {}
}

/// Largest number of requests a run sends, whatever the flags say.
pub const REQUESTS_MAX: usize = 10_000;

struct Runner<'a> {
    ep: &'a dyn Endpoint,
    cfg: &'a Config,
    progress: &'a dyn Progress,
    start: Instant,
    /// Prefill tokens a second measured on the idle server (once known).
    rate: Option<f64>,
    sent: AtomicU64,
    /// Every prompt's length and the server's count of it (accounting).
    counted: Mutex<Vec<Counted>>,
}

impl Runner<'_> {
    /// Sends a prompt `make` made; its count joins the token-accounting
    /// sample (compared with prompts of its make only).
    fn send(&self, make: Make, key: &str, req: &Request) -> Result<Completion, ProbeError> {
        self.send_as(key, req, Some(make))
    }

    /// `count`: the make whose accounting sample the prompt joins (the
    /// prefix-cache trials' plain prose joins none).
    fn send_as(
        &self,
        key: &str,
        req: &Request,
        count: Option<Make>,
    ) -> Result<Completion, ProbeError> {
        if self.start.elapsed() > self.cfg.time_budget {
            return Err(ProbeError::OutOfTime(self.cfg.time_budget.as_secs()));
        }
        if self.sent.fetch_add(1, Ordering::Relaxed) as usize >= REQUESTS_MAX {
            return Err(ProbeError::Config(format!(
                "the run would send more than {REQUESTS_MAX} requests"
            )));
        }
        let c = self.ep.complete(key, req)?;
        self.progress.tick();
        if let Some(make) = count.filter(|_| c.ok()) {
            self.counted.lock().expect("not poisoned").push(Counted {
                make,
                words: req.prompt.split_whitespace().count(),
                chars: req.prompt.chars().count(),
                prompt_tokens: c.prompt_tokens,
            });
        }
        Ok(c)
    }

    fn key(&self, tenant: usize) -> &str {
        &self.cfg.tenant_keys[tenant]
    }

    /// Prompts of `tokens` to send at once: `--concurrency`, fewer when
    /// the measured prefill rate says that many, computed one after
    /// another at a third of that rate (long prompts prefill slower than
    /// the mid-size ones measured), would not all finish within half of
    /// one request's limit.
    fn in_flight(&self, tokens: u64) -> usize {
        let Some(rate) = self.rate.filter(|r| *r > 0.0) else {
            return self.cfg.concurrency;
        };
        let one_s = tokens as f64 * LONG_PROMPT_SLOWDOWN / rate;
        let fit = (self.cfg.request_timeout.as_secs_f64() / 2.0 / one_s).floor() as usize;
        self.cfg.concurrency.min(fit.max(1))
    }

    /// Seconds left of the run's budget.
    fn time_left_s(&self) -> f64 {
        self.cfg
            .time_budget
            .saturating_sub(self.start.elapsed())
            .as_secs_f64()
    }
}

/// How much slower than the measured (mid-size, idle) prefill rate the
/// probe assumes a near-window prompt under load computes.
const LONG_PROMPT_SLOWDOWN: f64 = 3.0;

/// Tokens of `unit_prompt(_, units)` = `base + step × units` (measured).
#[derive(Clone, Copy, Debug)]
struct Calibration {
    base: f64,
    step: f64,
}

impl Calibration {
    fn units_for(&self, tokens: u64) -> usize {
        ((tokens as f64 - self.base) / self.step).max(1.0) as usize
    }
}

/// Runs every check; `Err` when the probe could not run (exit 2).
pub fn run(
    ep: &dyn Endpoint,
    url: &str,
    cfg: &Config,
    progress: &dyn Progress,
) -> Result<Report, ProbeError> {
    cfg.validate()?;
    let mut r = Runner {
        ep,
        cfg,
        progress,
        start: Instant::now(),
        rate: None,
        sent: AtomicU64::new(0),
        counted: Mutex::new(Vec::new()),
    };
    let info = ep.model(&cfg.tenant_keys[0])?;
    let window = cfg.context_window.or(info.context_window);
    let mut report = Report {
        url: url.into(),
        model: info.id.clone(),
        context_window: window,
        tenants: cfg.tenant_keys.len(),
        ..Report::default()
    };
    // Nonces lead every prompt, so no two prompts are equal; each is
    // written mixed (`secrets::shown`), so two prompts share nothing after
    // their first word and no honest prefix cache serves a timed prompt
    // (a chat template's fixed opening aside: at most a page or two).
    let mut nonce = cfg.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut next_nonce = move || {
        nonce = nonce.wrapping_add(1);
        nonce
    };

    // Every key works, and the unit prompt's token count is measured.
    progress.phase("keys and calibration", cfg.tenant_keys.len() as u64 + 2);
    for (i, _) in cfg.tenant_keys.iter().enumerate() {
        let c = r.send(
            Make::Unit,
            r.key(i),
            &Request {
                prompt: unit_prompt(next_nonce(), 4),
                max_tokens: 1,
                schema: None,
            },
        )?;
        if c.status == 401 || c.status == 403 {
            return Err(ProbeError::KeyRefused {
                index: i + 1,
                status: c.status,
                why: c.error_code.unwrap_or_default(),
            });
        }
        if !c.ok() {
            return Err(ProbeError::NotOpenAi {
                url: url.into(),
                why: format!("a 4-word completion got {} {:?}", c.status, c.error_code),
            });
        }
    }
    let small = window.map_or(64, |w| (w / 16).clamp(8, 64)) as usize;
    let large = small * 4;
    let p1 = r.send(
        Make::Unit,
        r.key(0),
        &Request {
            prompt: unit_prompt(next_nonce(), small),
            max_tokens: 1,
            schema: None,
        },
    )?;
    let p2 = r.send(
        Make::Unit,
        r.key(0),
        &Request {
            prompt: unit_prompt(next_nonce(), large),
            max_tokens: 1,
            schema: None,
        },
    )?;
    let calibration = match (p1.prompt_tokens, p2.prompt_tokens) {
        (Some(a), Some(b)) if b > a => {
            let step = (b - a) as f64 / (large - small) as f64;
            Some(Calibration {
                base: a as f64 - step * small as f64,
                step,
            })
        }
        _ => None,
    };

    // Prefill rate on mid-size prompts (idle).
    let mid_tokens = window.map_or(512, |w| (w / 8).clamp(64, 1024));
    progress.phase("prefill rate", 3);
    let mut mid = Vec::new();
    for _ in 0..3 {
        let units = calibration.map_or(mid_tokens as usize, |c| c.units_for(mid_tokens));
        let c = r.send(
            Make::Unit,
            r.key(0),
            &Request {
                prompt: unit_prompt(next_nonce(), units),
                max_tokens: 1,
                schema: None,
            },
        )?;
        if c.ok() {
            mid.push(Timed {
                prompt_tokens: c.prompt_tokens.unwrap_or(mid_tokens),
                latency_s: c.latency_s,
            });
        }
    }
    let rate = checks::prefill_rate(&mid);
    report.prefill_tokens_per_s = rate;
    r.rate = rate;
    let r = r;

    // Marker prompts: idle first, then under load.
    let long_tokens = cfg
        .long_prompt_tokens
        .unwrap_or_else(|| window.map_or(1024, |w| (w / 4).min(2048)));
    // Filler prose runs about 1.3 tokens a word on English tokenizers.
    // Each prompt is unique (its nonce) on its first send, which is the
    // one timed; repeats under load may be served from a prefix cache.
    let long_words = (long_tokens as f64 / 1.3) as usize;
    let mut rng = crate::rng(cfg.seed);
    let mut prompts = Vec::new();
    // The first tenant has one more secret: the flood's (see `flood`).
    let mut counts = vec![cfg.prompts_per_tenant; cfg.tenant_keys.len()];
    counts[0] += 1;
    let secrets = Secret::generate_unique(&mut rng, &counts);
    let flood_secret = cfg.prompts_per_tenant;
    debug_assert_eq!(
        (secrets[flood_secret].tenant, secrets[flood_secret].prompt),
        (0, cfg.prompts_per_tenant)
    );
    // Marker prompts, by index into `secrets` (all but the flood's).
    for (i, s) in secrets
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != flood_secret)
    {
        prompts.push((i, s.tenant, prompt_with_secret(next_nonce(), long_words, s)));
    }
    progress.phase("idle baseline", prompts.len() as u64);
    let mut idle = Vec::new();
    let mut outputs = Vec::new();
    let mut long_timed = Vec::new();
    for (secret, tenant, prompt) in &prompts {
        let c = r.send(
            Make::Marker,
            r.key(*tenant),
            &Request {
                prompt: prompt.clone(),
                max_tokens: cfg.max_tokens,
                schema: None,
            },
        )?;
        if !c.ok() {
            return Err(ProbeError::NotOpenAi {
                url: url.into(),
                why: format!(
                    "a {long_tokens}-token marker prompt on the idle server got {} {:?} (lower \
                     --long-prompt-tokens?)",
                    c.status, c.error_code
                ),
            });
        }
        long_timed.push(Timed {
            prompt_tokens: c.prompt_tokens.unwrap_or(long_tokens),
            latency_s: c.latency_s,
        });
        outputs.push(Output::of(Some(*secret), *tenant, &c));
        idle.push(c.text);
    }
    let mut order: Vec<usize> = (0..cfg.rounds).flat_map(|_| 0..prompts.len()).collect();
    order.shuffle(&mut rng);
    progress.phase("markers under load", order.len() as u64);
    let jobs: Vec<(usize, &str)> = prompts.iter().map(|(_, t, p)| (*t, p.as_str())).collect();
    let markers_in_flight = r.in_flight(long_tokens);
    let loaded = send_all(&r, Make::Marker, &jobs, &order, markers_in_flight)?;
    let refused_under_load = loaded.iter().filter(|(_, c)| !c.ok()).count();
    let mut loaded_texts = Vec::new();
    for (i, c) in loaded.iter().filter(|(_, c)| c.ok()) {
        outputs.push(Output::of(Some(prompts[*i].0), prompts[*i].1, c));
        // Not timed: a repeat of a prompt may rightly come from a prefix
        // cache.
        loaded_texts.push((*i, c.text.clone()));
    }
    let mut findings: Vec<Finding> = Vec::new();
    // The window's edges (their answers join the markers check: a prompt
    // without a secret must not answer with one).
    let over_check;
    let mut flood_sent = 0;
    let over_findings = match (window, calibration) {
        (Some(w), Some(cal)) => {
            // The flood, then at once the over-recall (the first of the
            // window's edges): see `flood`.
            // Each flood prompt ends a 32nd of the window short of the
            // longest prompt the window leaves room for.
            let flood_tokens = w
                .saturating_sub(u64::from(cfg.max_tokens) + w / 32)
                .max(long_tokens);
            let flood_in_flight = r.in_flight(flood_tokens);
            let mut flood_count = flood_prompts(w, flood_tokens, flood_in_flight);
            // At most a third of what is left of the budget (but always
            // the window and a quarter the check needs).
            if let Some(rate) = r.rate.filter(|r| *r > 0.0) {
                let one_s = flood_tokens as f64 * LONG_PROMPT_SLOWDOWN / rate;
                let affordable = (r.time_left_s() / 3.0 / one_s).floor() as usize;
                flood_count = flood_count.min(affordable.max(flood_prompts(w, flood_tokens, 1)));
            }
            progress.phase("flood", (1 + cfg.concurrency + flood_count) as u64);
            let (mut flooded, flood_words) = flood(
                &r,
                &secrets[flood_secret],
                flood_count,
                flood_tokens,
                flood_in_flight,
                &mut next_nonce,
            )?;
            progress.phase("over-length", 4 + 2 * RECALL_BACK_TOKENS.len() as u64);
            let (lone, mut cases) = over_recalls(
                &r,
                w,
                cal,
                &secrets[flood_secret],
                flood_words,
                &mut next_nonce,
            )?;
            flooded.extend(lone);
            flood_sent = flooded.len();
            let flood_tenant = secrets[flood_secret].tenant;
            for c in flooded.iter().filter(|c| c.ok()) {
                outputs.push(Output::of(Some(flood_secret), flood_tenant, c));
            }
            cases.extend(boundaries(&r, w, cal, &mut next_nonce)?);
            // Timed by the probe's own sizing: an over-long prompt the
            // server answered may come with a made-up token count. Not
            // "at": its prompt was sent once before to size it, and an
            // honest prefix cache may answer the repeat at once (as
            // llama-server's does) — every timed prompt is new.
            for c in cases.iter().filter(|c| c.answer.ok() && c.name != "at") {
                long_timed.push(Timed {
                    prompt_tokens: c.total_tokens.max(c.answer.prompt_tokens.unwrap_or(0)),
                    latency_s: c.answer.latency_s,
                });
            }
            let f = checks::over_length(w, &cases);
            let summary = cases
                .iter()
                .map(|c| {
                    format!(
                        "{} ({} tokens): {}",
                        c.name, c.total_tokens, c.answer.status
                    )
                })
                .collect::<Vec<_>>()
                .join(", ");
            over_check = result("over-length", &f, summary);
            for c in &cases {
                outputs.push(Output::of(None, c.tenant, &c.answer));
            }
            f
        }
        (None, _) => {
            over_check = skipped(
                "over-length",
                "the server advertises no context window: pass --context-window",
            );
            Vec::new()
        }
        (Some(_), None) => {
            over_check = skipped(
                "over-length",
                "usage.prompt_tokens missing or not growing: cannot size prompts to the window",
            );
            Vec::new()
        }
    };
    let marker_findings = checks::markers(&secrets, &outputs);
    let echoed = outputs
        .iter()
        .filter(|o| {
            o.secret
                .is_some_and(|i| secrets[i].found_in(&o.text).is_some())
        })
        .count();
    let with_tokens = outputs.iter().filter(|o| o.tokens.is_some()).count();
    let summary = format!(
        "{} outputs of {} secret-bearing prompts and {} flooding with one secret ({} tokens \
         each, {} in flight; {} echoed their own secret; {} matched on text and tokens, the rest \
         on text); {} refused under load",
        outputs.len(),
        prompts.len(),
        flood_sent,
        long_tokens,
        markers_in_flight,
        echoed,
        with_tokens,
        refused_under_load
    );
    if marker_findings.is_empty() && loaded_texts.is_empty() {
        report.checks.push(skipped(
            "markers",
            &format!("inconclusive: no request under load succeeded ({summary})"),
        ));
    } else {
        report
            .checks
            .push(result("markers", &marker_findings, summary));
    }
    findings.extend(marker_findings);
    let (agreement, det_findings) = checks::determinism(&idle, &loaded_texts, cfg.deterministic);
    report.determinism_agreement = Some(agreement);
    report.checks.push(result(
        "determinism",
        &det_findings,
        format!(
            "{:.1}% of {} outputs under load equal the idle output{}",
            agreement * 100.0,
            loaded_texts.len(),
            if cfg.deterministic {
                " (determinism claimed: every difference is a finding)"
            } else {
                ""
            }
        ),
    ));
    findings.extend(det_findings);
    report.checks.push(over_check);
    findings.extend(over_findings);

    // The prefix cache across tenants (K11).
    progress.phase("prefix cache", 4 * CACHE_TRIALS as u64);
    let trials = cache_trials(&r, long_words, &mut next_nonce)?;
    let f = checks::cache_scope(&trials);
    report
        .checks
        .push(if trials.len() < checks::CACHE_TRIALS_MIN {
            skipped("prefix-cache", "too few trials were answered")
        } else {
            result(
                "prefix-cache",
                &f,
                format!(
                    "{} trials: another tenant's fresh prompt vs a cold one of the same size",
                    trials.len()
                ),
            )
        });
    findings.extend(f);

    // Compiled grammars across tenants (K11 for the grammar cache).
    progress.phase("grammar cache", 3 * GRAMMAR_TRIALS as u64);
    let (trials, refused) = grammar_trials(&r, &mut next_nonce)?;
    let f = checks::grammar_cache(&trials);
    report.checks.push(if let Some(why) = refused {
        skipped("grammar-cache", &why)
    } else if trials.len() < checks::GRAMMAR_TRIALS_MIN {
        skipped("grammar-cache", "too few trials were answered")
    } else {
        result(
            "grammar-cache",
            &f,
            format!(
                "{} trials: another tenant's fresh JSON schema vs a cold one of the same size",
                trials.len()
            ),
        )
    });
    findings.extend(f);

    // Speculation's drafts across tenants (K11 for a suffix cache).
    progress.phase("drafts", 3 * DRAFT_TRIALS as u64);
    let trials = draft_trials(&r, &mut next_nonce)?;
    let f = checks::draft_pool(&trials);
    let usable = checks::draft_trials_usable(&trials).len();
    report.checks.push(if usable < checks::DRAFT_TRIALS_MIN {
        skipped(
            "drafts",
            "the server's repeats were not faster than new answers: it drafts nothing from \
             earlier requests that the probe could see",
        )
    } else {
        result(
            "drafts",
            &f,
            format!("{usable} trials: one answer timed new, for another tenant, and repeated"),
        )
    });
    findings.extend(f);

    // Timing against the measured prefill rate.
    match rate {
        Some(rate) => {
            let f = checks::timing(rate, &long_timed);
            report.checks.push(result(
                "timing",
                &f,
                format!(
                    "{} long prompts against {rate:.0} prefill tokens/s",
                    long_timed.len()
                ),
            ));
            findings.extend(f);
        }
        None => report
            .checks
            .push(skipped("timing", "no mid-size prompt succeeded")),
    }

    let counted = r.counted.into_inner().expect("not poisoned");
    let f = checks::accounting(&counted);
    report.checks.push(result(
        "tokens",
        &f,
        format!("usage.prompt_tokens of {} prompts", counted.len()),
    ));
    findings.extend(f);

    report.findings = findings;
    report.requests_sent = r.sent.load(Ordering::Relaxed);
    report.seconds = r.start.elapsed().as_secs_f64();
    Ok(report)
}

/// Trials of the grammar-cache check, and the size of its schemas.
const GRAMMAR_TRIALS: usize = 3;
const GRAMMAR_PROPERTIES: usize = 800;

/// Per trial: the first tenant sends a fresh JSON schema (filling any
/// grammar cache it may fill); the second tenant then sends that very
/// schema and a fresh one of the same size, in alternating order, one
/// token each, timed. A server that refuses `json_schema` skips the check
/// (the reason comes back).
fn grammar_trials(
    r: &Runner<'_>,
    next_nonce: &mut impl FnMut() -> u64,
) -> Result<(Vec<GrammarTrial>, Option<String>), ProbeError> {
    let mut trials = Vec::new();
    for trial in 0..GRAMMAR_TRIALS {
        let prompt = unit_prompt(next_nonce(), 4);
        let shared = grammar_schema(next_nonce(), GRAMMAR_PROPERTIES);
        let cold = grammar_schema(next_nonce(), GRAMMAR_PROPERTIES);
        let send = |t: usize, schema: &str| {
            r.send_as(
                r.key(t),
                &Request {
                    prompt: prompt.clone(),
                    max_tokens: 1,
                    schema: Some(schema.to_string()),
                },
                None,
            )
        };
        let first = send(0, &shared)?;
        if (400..500).contains(&first.status) {
            return Ok((
                Vec::new(),
                Some(format!(
                    "the server refused a json_schema response_format (HTTP {})",
                    first.status
                )),
            ));
        }
        let (s, c) = alternating(trial, || send(1, &shared), || send(1, &cold))?;
        if first.ok() && s.ok() && c.ok() {
            trials.push(GrammarTrial {
                schema_bytes: shared.len(),
                shared_s: s.latency_s,
                cold_s: c.latency_s,
            });
        }
    }
    Ok((trials, None))
}

/// Trials of the drafts check, and the length of their answers.
const DRAFT_TRIALS: usize = 4;
const DRAFT_TOKENS: u32 = 160;

/// Per trial, one fresh story prompt, greedy, `DRAFT_TOKENS` long: the
/// first tenant asks, the second tenant asks, the first tenant asks again;
/// each answer's time per token. Trials whose three answers differ in
/// length (an end token) are not comparable and left out.
fn draft_trials(
    r: &Runner<'_>,
    next_nonce: &mut impl FnMut() -> u64,
) -> Result<Vec<DraftTrial>, ProbeError> {
    let mut trials = Vec::new();
    for _ in 0..DRAFT_TRIALS {
        let req = Request {
            prompt: story_prompt(next_nonce()),
            max_tokens: DRAFT_TOKENS,
            schema: None,
        };
        let first = r.send_as(r.key(0), &req, None)?;
        let other = r.send_as(r.key(1), &req, None)?;
        let again = r.send_as(r.key(0), &req, None)?;
        let tokens = |c: &Completion| c.completion_tokens.filter(|&n| n > 0 && c.ok());
        if let (Some(a), Some(b), Some(c)) = (tokens(&first), tokens(&other), tokens(&again)) {
            if a == b && b == c {
                let per = |c: &Completion| c.latency_s / a as f64;
                trials.push(DraftTrial {
                    tokens: a,
                    first_s: per(&first),
                    other_s: per(&other),
                    again_s: per(&again),
                });
            }
        }
    }
    Ok(trials)
}

/// Trials of the prefix-cache check.
const CACHE_TRIALS: usize = 3;

/// Runs `shared` then `cold` in even trials and the other way round in odd
/// ones (so neither always goes first); their answers in that order.
fn alternating<T, E>(
    trial: usize,
    shared: impl FnOnce() -> Result<T, E>,
    cold: impl FnOnce() -> Result<T, E>,
) -> Result<(T, T), E> {
    if trial.is_multiple_of(2) {
        let s = shared()?;
        Ok((s, cold()?))
    } else {
        let c = cold()?;
        Ok((shared()?, c))
    }
}

/// Per trial: the first tenant sends a fresh prompt (warming any cache it
/// may fill); the second tenant then sends that very prompt and a fresh
/// one of the same size, in alternating order, one token each, timed. No
/// prompt shares a first page with anything sent before (a nonce leads).
fn cache_trials(
    r: &Runner<'_>,
    words: usize,
    next_nonce: &mut impl FnMut() -> u64,
) -> Result<Vec<CacheTrial>, ProbeError> {
    let mut trials = Vec::new();
    for trial in 0..CACHE_TRIALS {
        let shared = cache_prompt(next_nonce(), words);
        let cold = cache_prompt(next_nonce(), words);
        let one = |prompt: &str| Request {
            prompt: prompt.to_string(),
            max_tokens: 1,
            schema: None,
        };
        let send = |t: usize, p: &str| r.send_as(r.key(t), &one(p), None);
        let warm = send(0, &shared)?;
        let (s, c) = alternating(trial, || send(1, &shared), || send(1, &cold))?;
        if warm.ok() && s.ok() && c.ok() {
            trials.push(CacheTrial {
                prompt_tokens: s.prompt_tokens.unwrap_or(0),
                shared_s: s.latency_s,
                cold_s: c.latency_s,
                shared_cached_tokens: s.cached_tokens,
                cold_cached_tokens: c.cached_tokens,
            });
        }
    }
    Ok(trials)
}

/// Sends `jobs[i]` (tenant, prompt, all of one `make`) for each `i` of
/// `order`, at most `concurrency` at once; the answers with their job
/// index.
fn send_all(
    r: &Runner<'_>,
    make: Make,
    jobs: &[(usize, &str)],
    order: &[usize],
    in_flight: usize,
) -> Result<Vec<(usize, Completion)>, ProbeError> {
    let next = AtomicUsize::new(0);
    let answers: Mutex<Vec<(usize, Completion)>> = Mutex::new(Vec::new());
    let failure: Mutex<Option<ProbeError>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..in_flight.max(1).min(order.len()) {
            s.spawn(|| loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let Some(&i) = order.get(k) else { break };
                if failure.lock().expect("not poisoned").is_some() {
                    break;
                }
                let (tenant, prompt) = jobs[i];
                match r.send(
                    make,
                    r.key(tenant),
                    &Request {
                        prompt: prompt.to_string(),
                        max_tokens: r.cfg.max_tokens,
                        schema: None,
                    },
                ) {
                    Ok(c) => answers.lock().expect("not poisoned").push((i, c)),
                    Err(e) => {
                        failure.lock().expect("not poisoned").get_or_insert(e);
                    }
                }
            });
        }
    });
    if let Some(e) = failure.into_inner().expect("threads joined") {
        return Err(e);
    }
    Ok(answers.into_inner().expect("threads joined"))
}

/// Near-window flood prompts of `prompt_tokens` each: enough to hold an
/// over-recall's worth of KV (a window and a quarter), at least one a
/// connection, at most 64.
fn flood_prompts(window: u64, prompt_tokens: u64, concurrency: usize) -> usize {
    let cover = (window + window / 4).div_ceil(prompt_tokens.max(1)) as usize;
    cover.max(concurrency).min(64)
}

/// Words in the flood's sizing prompt: enough that its fixed part (nonce,
/// closing request) is a small share of its token count.
const FLOOD_SIZING_WORDS: usize = 400;

/// The first tenant's flood: `count` prompts of about `tokens` tokens
/// (nearly as long as the window allows), after a wave of short ones
/// (below), each stating one secret every few words and ending in a
/// request for it ([`flood_prompt`]). When they end, the KV a server frees (and a server
/// with the incident's bug hands to the next request unwritten) holds that
/// one secret wherever it is read, at every position up to near the
/// window, rather than a blend of many. The over-recalls that follow read
/// it back. One sizing prompt goes first: its token count as the server
/// reports it gives the words per prompt (without a count: a token per 3
/// characters). Each prompt is new (its nonce), so no prefix cache answers
/// for it.
fn flood(
    r: &Runner<'_>,
    secret: &Secret,
    count: usize,
    tokens: u64,
    in_flight: usize,
    nonce: &mut impl FnMut() -> u64,
) -> Result<(Vec<Completion>, usize), ProbeError> {
    let sizing = flood_prompt(nonce(), FLOOD_SIZING_WORDS, secret);
    let sized = r.send(
        Make::Flood,
        r.key(secret.tenant),
        &Request {
            prompt: sizing.clone(),
            max_tokens: 1,
            schema: None,
        },
    )?;
    // An over-estimate of tokens per word (the fixed part counts as
    // words): the flood's prompts come out a little short of `tokens`,
    // never over the window.
    let counted = sized
        .prompt_tokens
        .filter(|_| sized.ok())
        .unwrap_or(sizing.chars().count() as u64 / 3)
        .max(1);
    let words = (tokens * FLOOD_SIZING_WORDS as u64 / counted).max(1) as usize;
    // Two waves. First one prompt a connection at a quarter of the size:
    // together they ask for more KV than most pools hold at once, so every
    // page gets the secret. Then the near-window ones, one after another
    // on a pool that holds only one: a pool that reuses the pages freed
    // last (a stack) keeps handing them the same pages, and the wave
    // before has filled the rest.
    let mut answers = vec![sized];
    // The first wave keeps `--concurrency` prompts (the KV they ask for
    // together is the point); only how many run at once is sized.
    for (n, w) in [(r.cfg.concurrency, words / 4), (count, words)] {
        let prompts: Vec<String> = (0..n)
            .map(|_| flood_prompt(nonce(), w.max(1), secret))
            .collect();
        let jobs: Vec<(usize, &str)> = prompts
            .iter()
            .map(|p| (secret.tenant, p.as_str()))
            .collect();
        let order: Vec<usize> = (0..n).collect();
        answers.extend(
            send_all(r, Make::Flood, &jobs, &order, in_flight)?
                .into_iter()
                .map(|(_, c)| c),
        );
    }
    Ok((answers, words))
}

/// The end of the over-long prompt that asks for a code back.
const RECALL_SUFFIX: &str = " Repeat the access code: ";

/// How far back from the end of the flood prompt sent right before it
/// each over-recall cuts its prompt (see [`over_recalls`]).
const RECALL_BACK_TOKENS: [u64; 3] = [16, 32, 48];

/// The over-recalls' room to answer (`max_tokens`) when the flood prompt
/// before them came back without a token count.
const RECALL_MAX_TOKENS: [u32; 3] = [48, 56, 64];

/// The room an over-recall asks for (`max_tokens`). A server that makes
/// room for the answer by cutting the prompt (as the fault-incident build
/// does) computes a prompt of `window - room` tokens and, with the
/// incident's bug, reads the stale KV at those positions: a room reaching
/// `back` tokens further back than the end of the flood prompt freed last
/// (`flood_tokens` long, as the server counted them) keeps every position
/// it reads inside what that one prompt wrote, which states the secret
/// every few words. Without a count that fits the window: `fixed`.
fn recall_room(window: u64, flood_tokens: Option<u64>, back: u64, fixed: u32) -> u32 {
    match flood_tokens {
        Some(p) if p < window => u32::try_from(window - p + back).unwrap_or(u32::MAX),
        _ => fixed,
    }
}

/// The over-recalls, right after the flood: each an eighth over the
/// window, from the last tenant, asking for an access code like the
/// flood's prompts do, and each right after one more flood prompt of
/// `words` words sent alone, so that the KV the server freed last is that
/// one prompt's, whatever the waves before left and whatever the
/// over-recall before it wrote. A server that answers them from pages it
/// never wrote (the incident) recites what that KV holds; the markers
/// check reads the answers. Returns the lone flood prompts' answers and
/// the over-recalls.
///
/// Measured on the fault-incident build (`tests/http/test_probe.py`'s
/// server flags and probe command, by hand): 14 of 15 over-recalls
/// recited the secret, at least 2 of 3 in each of 5 runs (seeds 1, 1, 3,
/// 4, 6). Before, over-recalls sent one after another without a flood
/// prompt between them read the one before's answer and went on with it
/// ("1. The answers. The answers. …", "0000…"), and over-recalls whose
/// prompt reached past the flood's end (fixed rooms of 48 to 64 tokens)
/// read whatever else the pages held there: they recited the secret in
/// 10 runs by hand and 2 CI runs, and none of the three did in one CI run.
fn over_recalls(
    r: &Runner<'_>,
    window: u64,
    cal: Calibration,
    secret: &Secret,
    words: usize,
    nonce: &mut impl FnMut() -> u64,
) -> Result<(Vec<Completion>, Vec<Boundary>), ProbeError> {
    let mut lone = Vec::new();
    let mut cases = Vec::new();
    // The margin keeps it over the window even if the small-prompt
    // calibration is off by that much.
    let recall_tokens = window + (window / 8).max(64);
    for (back, fixed) in RECALL_BACK_TOKENS.into_iter().zip(RECALL_MAX_TOKENS) {
        let f = r.send(
            Make::Flood,
            r.key(secret.tenant),
            &Request {
                prompt: flood_prompt(nonce(), words, secret),
                max_tokens: r.cfg.max_tokens,
                schema: None,
            },
        )?;
        let room = recall_room(window, f.prompt_tokens.filter(|_| f.ok()), back, fixed);
        lone.push(f);
        let recall = unit_prompt(nonce(), cal.units_for(recall_tokens)) + RECALL_SUFFIX;
        let max_tokens = r.cfg.max_tokens.max(room);
        let a = r.send(
            Make::Recall,
            r.key(r.cfg.tenant_keys.len() - 1),
            &Request {
                prompt: recall,
                max_tokens,
                schema: None,
            },
        )?;
        cases.push(Boundary {
            name: "over-recall",
            total_tokens: recall_tokens + u64::from(max_tokens),
            tenant: r.cfg.tenant_keys.len() - 1,
            prompt_tokens_before: None,
            answer: a,
        });
    }
    Ok((lone, cases))
}

/// Under (half the window), exactly at, and over the window.
fn boundaries(
    r: &Runner<'_>,
    window: u64,
    cal: Calibration,
    nonce: &mut impl FnMut() -> u64,
) -> Result<Vec<Boundary>, ProbeError> {
    let mut cases = Vec::new();
    let under = unit_prompt(nonce(), cal.units_for(window / 2));
    let a = r.send(
        Make::Unit,
        r.key(0),
        &Request {
            prompt: under,
            max_tokens: 1,
            schema: None,
        },
    )?;
    cases.push(Boundary {
        name: "under",
        tenant: 0,
        total_tokens: a.prompt_tokens.map_or(window / 2, |p| p + 1),
        prompt_tokens_before: None,
        answer: a,
    });
    // At: learn the exact prompt length with one token to spare, then ask
    // for exactly the rest of the window.
    let at_units = cal.units_for(window.saturating_sub(8));
    let at = unit_prompt(nonce(), at_units);
    // "Over" is sized from the measured length near the window, not by
    // extrapolating the small-prompt calibration.
    let mut over_units = cal.units_for(window + 32);
    let probe = r.send(
        Make::Unit,
        r.key(0),
        &Request {
            prompt: at.clone(),
            max_tokens: 1,
            schema: None,
        },
    )?;
    // If the sizing probe itself was refused or not counted, "at" is not
    // known, so not judged.
    if let Some(p) = probe.prompt_tokens.filter(|&p| probe.ok() && p < window) {
        over_units = at_units + ((window - p + 32) as f64 / cal.step).ceil() as usize;
        let rest = (window - p) as u32;
        let a = r.send(
            Make::Unit,
            r.key(0),
            &Request {
                prompt: at,
                max_tokens: rest,
                schema: None,
            },
        )?;
        cases.push(Boundary {
            name: "at",
            tenant: 0,
            total_tokens: p + rest as u64,
            prompt_tokens_before: Some(p),
            answer: a,
        });
    }
    let over = unit_prompt(nonce(), over_units);
    let a = r.send(
        Make::Unit,
        r.key(0),
        &Request {
            prompt: over,
            max_tokens: 1,
            schema: None,
        },
    )?;
    cases.push(Boundary {
        name: "over",
        tenant: 0,
        total_tokens: window + 33,
        prompt_tokens_before: None,
        answer: a,
    });
    Ok(cases)
}

fn result(check: &str, findings: &[Finding], summary: String) -> CheckResult {
    CheckResult {
        check: check.into(),
        status: if findings.is_empty() {
            "passed"
        } else {
            "findings"
        }
        .into(),
        summary,
    }
}

fn skipped(check: &str, why: &str) -> CheckResult {
    CheckResult {
        check: check.into(),
        status: "skipped".into(),
        summary: why.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_over_recall_reads_only_what_the_flood_prompt_before_it_wrote() {
        // A 1940-token flood prompt in a 2048-token window: the over-recall
        // asks for 124 tokens, so a server that cuts its prompt to make
        // room computes 1924 tokens, all inside what the flood wrote.
        assert_eq!(recall_room(2048, Some(1940), 16, 48), 124);
        assert!(2048 - u64::from(recall_room(2048, Some(1940), 48, 64)) < 1940);
        // No count, or a count the window cannot hold: the fixed room.
        assert_eq!(recall_room(2048, None, 16, 48), 48);
        assert_eq!(recall_room(2048, Some(2048), 16, 56), 56);
    }
}
