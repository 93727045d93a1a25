//! The checks as pure functions from what the server answered to findings.

use crate::secrets::Secret;
use crate::{Completion, Evidence, Finding};

fn finding(check: &str, kind: &str, detail: String) -> Finding {
    Finding {
        kind: kind.into(),
        check: check.into(),
        detail,
        evidence: evidence_of(kind),
    }
}

/// How sure each kind of finding is (docs/probe.md says why).
pub fn evidence_of(kind: &str) -> Evidence {
    match kind {
        "answered_faster_than_prefill"
        | "prefix_cache_shared_across_tenants"
        | "grammar_cache_shared_across_tenants"
        | "drafts_shared_across_tenants" => Evidence::Statistical,
        "prompt_tokens_implausible" | "prompt_tokens_not_monotone" => Evidence::Heuristic,
        _ => Evidence::Exact,
    }
}

/// One output the markers check looks at: the index of the secret its
/// prompt carried (if any), its text and the tokens the server said it
/// was made of.
#[derive(Clone, Debug)]
pub struct Output {
    pub secret: Option<usize>,
    /// Whose key asked.
    pub tenant: usize,
    pub text: String,
    pub tokens: Option<Vec<String>>,
}

impl Output {
    pub fn of(secret: Option<usize>, tenant: usize, c: &Completion) -> Output {
        Output {
            secret,
            tenant,
            text: c.text.clone(),
            tokens: c.tokens.clone(),
        }
    }
}

/// No output contains a piece of any secret but its own prompt's, in its
/// text or in its tokens.
pub fn markers(secrets: &[Secret], outputs: &[Output]) -> Vec<Finding> {
    let mut found = Vec::new();
    for o in outputs {
        let own = o.secret.map(|i| &secrets[i]);
        for (i, s) in secrets.iter().enumerate() {
            if Some(i) == o.secret {
                continue;
            }
            let in_text = s.found_in(&o.text).map(|p| (p, "text"));
            let hit = in_text.or_else(|| {
                o.tokens
                    .as_deref()
                    .and_then(|t| s.found_in_tokens(t))
                    .map(|p| (p, "tokens"))
            });
            if let Some((piece, seen_in)) = hit {
                let kind = if s.tenant == o.tenant {
                    "marker_cross_request"
                } else {
                    "marker_cross_tenant"
                };
                let whose = format!(
                    "tenant {}'s answer{}",
                    o.tenant + 1,
                    if own.is_none() {
                        " to a secret-free prompt"
                    } else {
                        ""
                    }
                );
                found.push(finding(
                    "markers",
                    kind,
                    format!(
                        "{whose} contains `{piece}` (in its {seen_in}) from tenant {}'s prompt \
                         {}: {:?}",
                        s.tenant + 1,
                        s.prompt + 1,
                        clip(&o.text)
                    ),
                ));
            }
        }
    }
    found
}

fn clip(s: &str) -> String {
    let mut c: String = s.chars().take(120).collect();
    if c.len() < s.len() {
        c += "…";
    }
    c
}

/// Loaded outputs against idle ones (by prompt index). Returns the
/// agreement rate and, when the server claims determinism, a finding per
/// difference.
pub fn determinism(
    idle: &[String],
    loaded: &[(usize, String)],
    claims_determinism: bool,
) -> (f64, Vec<Finding>) {
    let mut same = 0usize;
    let mut found = Vec::new();
    for (i, text) in loaded {
        if idle[*i] == *text {
            same += 1;
        } else if claims_determinism {
            found.push(finding(
                "determinism",
                "output_changed_under_load",
                format!(
                    "prompt {}: idle {:?}, under load {:?}",
                    i + 1,
                    clip(&idle[*i]),
                    clip(text)
                ),
            ));
        }
    }
    let rate = if loaded.is_empty() {
        1.0
    } else {
        same as f64 / loaded.len() as f64
    };
    (rate, found)
}

/// A request near the window and what it must get.
#[derive(Clone, Debug)]
pub struct Boundary {
    /// `under`, `at`, `over` or `over-recall` (over, asking for a code).
    pub name: &'static str,
    /// Prompt plus `max_tokens`, as the probe computed it.
    pub total_tokens: u64,
    /// Whose key sent it.
    pub tenant: usize,
    /// The prompt's token count as the server reported it for this very
    /// text before (`at`: its sizing send), if known.
    pub prompt_tokens_before: Option<u64>,
    pub answer: Completion,
}

/// Under and at the window must succeed; over it must be refused with a
/// 4xx (a 200 is the incident: the server answered a prompt it could not
/// hold). A prompt answered while counting fewer tokens than the same
/// text counted before was cut to fit (`prompt_truncated`): the answer is
/// to a prompt the client did not send.
pub fn over_length(window: u64, cases: &[Boundary]) -> Vec<Finding> {
    let mut found = Vec::new();
    for c in cases {
        let a = &c.answer;
        match c.name {
            "over" | "over-recall" if a.ok() => found.push(finding(
                "over-length",
                "over_length_accepted",
                format!(
                    "a {}-token request over the {window}-token window was answered 200 \
                     (usage.prompt_tokens {:?}): {:?}",
                    c.total_tokens,
                    a.prompt_tokens,
                    clip(&a.text)
                ),
            )),
            "over" | "over-recall" if !(400..500).contains(&a.status) => found.push(finding(
                "over-length",
                "over_length_not_4xx",
                format!(
                    "a {}-token request over the {window}-token window got {} (want a 4xx)",
                    c.total_tokens, a.status
                ),
            )),
            "under" | "at"
                if a.ok()
                    && c.prompt_tokens_before
                        .zip(a.prompt_tokens)
                        .is_some_and(|(before, now)| now < before) =>
            {
                found.push(finding(
                    "over-length",
                    "prompt_truncated",
                    format!(
                        "a prompt that counted {} tokens was answered counting {} (asked for {} \
                         tokens in all, the {window}-token window): part of it was silently \
                         dropped to fit",
                        c.prompt_tokens_before.unwrap_or(0),
                        a.prompt_tokens.unwrap_or(0),
                        c.total_tokens
                    ),
                ))
            }
            "under" | "at" if !a.ok() => found.push(finding(
                "over-length",
                "within_window_refused",
                format!(
                    "a {}-token request ({} the {window}-token window) got {} {:?}",
                    c.total_tokens, c.name, a.status, a.error_code
                ),
            )),
            _ => {}
        }
    }
    found
}

/// How much faster than the measured prefill rate a long prompt may be
/// answered before it is implausible. Generous: a long prompt prefills at
/// most as fast per token as a mid-size one, and batching does not make a
/// single prompt faster.
pub const TIMING_SLACK: f64 = 4.0;

/// One timed answer: prompt tokens (as the server counted them or as the
/// probe estimated them) and seconds to the full answer.
#[derive(Clone, Copy, Debug)]
pub struct Timed {
    pub prompt_tokens: u64,
    pub latency_s: f64,
}

/// The prefill rate: the fastest of the mid-size samples (tokens/s).
pub fn prefill_rate(mid: &[Timed]) -> Option<f64> {
    mid.iter()
        .filter(|t| t.latency_s > 0.0)
        .map(|t| t.prompt_tokens as f64 / t.latency_s)
        .fold(None, |m: Option<f64>, r| Some(m.map_or(r, |m| m.max(r))))
}

/// Long prompts answered faster than `rate × TIMING_SLACK` allows.
pub fn timing(rate: f64, long: &[Timed]) -> Vec<Finding> {
    long.iter()
        .filter(|t| t.latency_s < t.prompt_tokens as f64 / (rate * TIMING_SLACK))
        .map(|t| {
            finding(
                "timing",
                "answered_faster_than_prefill",
                format!(
                    "a {}-token prompt was answered in {:.3} s; prefilling it takes at least {:.3} s \
                     at {:.0} tokens/s (÷{TIMING_SLACK} slack)",
                    t.prompt_tokens,
                    t.latency_s,
                    t.prompt_tokens as f64 / rate,
                    rate
                ),
            )
        })
        .collect()
}

/// One trial of the prefix-cache check: the second tenant's time to answer
/// (one token) a prompt the first tenant had just sent, and a fresh prompt
/// of the same size; and the `cached_tokens` it was told for the first.
#[derive(Clone, Debug)]
pub struct CacheTrial {
    pub prompt_tokens: u64,
    pub shared_s: f64,
    pub cold_s: f64,
    pub shared_cached_tokens: Option<u64>,
    /// What the cold twin was told: whatever the second tenant's own cache
    /// gives it (a common opening) it gives both.
    pub cold_cached_tokens: Option<u64>,
}

/// A tenant's prompt is served faster than this share of its cold twin's
/// time, in every trial, only from another tenant's cache.
pub const CACHE_SPEEDUP_MAX: f64 = 0.5;

/// Trials the cache check needs before it may conclude.
pub const CACHE_TRIALS_MIN: usize = 2;

/// K11 across tenants: another tenant's prefix must not make a prompt
/// faster (a timing side channel: Early Bird, InputSnatch), nor be
/// reported as cached.
pub fn cache_scope(trials: &[CacheTrial]) -> Vec<Finding> {
    let mut found = Vec::new();
    if trials.len() >= CACHE_TRIALS_MIN
        && trials
            .iter()
            .all(|t| t.shared_s < t.cold_s * CACHE_SPEEDUP_MAX)
    {
        let times: Vec<String> = trials
            .iter()
            .map(|t| format!("{:.3} s vs {:.3} s", t.shared_s, t.cold_s))
            .collect();
        found.push(finding(
            "prefix-cache",
            "prefix_cache_shared_across_tenants",
            format!(
                "a prompt another tenant had just sent was answered faster than a fresh one of \
                 the same size ({} tokens) in every trial: {} — one tenant can learn another's \
                 prompts from time to first token",
                trials[0].prompt_tokens,
                times.join(", ")
            ),
        ));
    }
    for t in trials {
        let own = t.cold_cached_tokens.unwrap_or(0);
        if let Some(n) = t.shared_cached_tokens.filter(|&n| n > own) {
            found.push(finding(
                "prefix-cache",
                "cached_tokens_across_tenants",
                format!(
                    "usage reported {n} cached tokens for a {}-token prompt only another \
                     tenant had sent before ({own} for a fresh prompt of the same size)",
                    t.prompt_tokens
                ),
            ));
        }
    }
    found
}

/// One trial of the grammar-cache check: the second tenant's time for a
/// schema the first tenant had just sent, and for a fresh schema of the
/// same size (one token each, the same short prompt).
#[derive(Clone, Debug)]
pub struct GrammarTrial {
    pub schema_bytes: usize,
    pub shared_s: f64,
    pub cold_s: f64,
}

/// A compiled-grammar cache shared across tenants is a timing side
/// channel on their schemas: another tenant's schema answered faster than
/// this share of a fresh one's time, in every trial, is a finding.
pub const GRAMMAR_SPEEDUP_MAX: f64 = 0.5;

/// Trials the grammar-cache check needs before it may conclude.
pub const GRAMMAR_TRIALS_MIN: usize = 2;

/// K11 for compiled grammars: whether a schema compiles fast must not
/// depend on what another tenant sent.
pub fn grammar_cache(trials: &[GrammarTrial]) -> Vec<Finding> {
    if trials.len() < GRAMMAR_TRIALS_MIN
        || !trials
            .iter()
            .all(|t| t.shared_s < t.cold_s * GRAMMAR_SPEEDUP_MAX)
    {
        return Vec::new();
    }
    let times: Vec<String> = trials
        .iter()
        .map(|t| format!("{:.3} s vs {:.3} s", t.shared_s, t.cold_s))
        .collect();
    vec![finding(
        "grammar-cache",
        "grammar_cache_shared_across_tenants",
        format!(
            "a JSON schema another tenant had just sent was answered faster than a fresh one \
             of the same size ({} bytes) in every trial: {} — one tenant can learn another's \
             schemas from how fast its own compile",
            trials[0].schema_bytes,
            times.join(", ")
        ),
    )]
}

/// One trial of the drafts check, in seconds per output token: the first
/// tenant's answer to a fresh prompt (`first_s`), the second tenant's
/// answer to that very prompt (`other_s`), then the first tenant's again
/// (`again_s`) — the same greedy text three times.
#[derive(Clone, Debug)]
pub struct DraftTrial {
    pub tokens: u64,
    pub first_s: f64,
    pub other_s: f64,
    pub again_s: f64,
}

/// A repeat at most this share of the first answer's time per token shows
/// the server drafts from earlier requests (speculative decoding with a
/// cross-request cache): the trial can tell whose text it drafts from.
pub const DRAFT_REPEAT_MAX: f64 = 0.8;

/// Trials the drafts check needs before it may conclude.
pub const DRAFT_TRIALS_MIN: usize = 2;

/// The trials where the server's repeat was fast enough to compare against.
pub fn draft_trials_usable(trials: &[DraftTrial]) -> Vec<&DraftTrial> {
    trials
        .iter()
        .filter(|t| t.again_s < t.first_s * DRAFT_REPEAT_MAX)
        .collect()
}

/// K11 for speculation's drafts: a server that drafts from earlier
/// requests (a suffix cache, an n-gram pool) must draft only from the
/// asking tenant's scope. The same answer is timed three times: new to the
/// server, then for a second tenant, then for the first again. A first
/// tenant's repeat much faster than its first answer shows the drafting;
/// the second tenant answered nearer the repeat's speed than the first's,
/// in every such trial, was drafted from the first tenant's text — and its
/// speed tells it what the first tenant wrote.
pub fn draft_pool(trials: &[DraftTrial]) -> Vec<Finding> {
    let usable = draft_trials_usable(trials);
    if usable.len() < DRAFT_TRIALS_MIN
        || !usable
            .iter()
            .all(|t| t.other_s < (t.first_s + t.again_s) / 2.0)
    {
        return Vec::new();
    }
    let ms = |x: f64| x * 1e3;
    let times: Vec<String> = usable
        .iter()
        .map(|t| {
            format!(
                "{:.2}/{:.2}/{:.2} ms",
                ms(t.first_s),
                ms(t.other_s),
                ms(t.again_s)
            )
        })
        .collect();
    vec![finding(
        "drafts",
        "drafts_shared_across_tenants",
        format!(
            "another tenant's answer (the same {} tokens) came at the speed of a repeat, not of              a new answer, in every trial (per token: new / other tenant / repeat: {}) — the              server drafts one tenant's request from another's text, and the speed tells              what that text was",
            usable[0].tokens,
            times.join(", ")
        ),
    )]
}

/// A prompt the probe sent and the server's count of its tokens.
#[derive(Clone, Debug)]
pub struct Counted {
    /// Which generator made the prompt.
    pub make: Make,
    pub words: usize,
    pub chars: usize,
    pub prompt_tokens: Option<u64>,
}

/// Which of the probe's generators made a prompt. Characters per token
/// differ between them (a secret-dense flood prompt costs about 2.2
/// characters a token on SmolLM2's tokenizer, a unit prompt of " hello"s
/// about 5.8), so prompt lengths are compared only within one make.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Make {
    /// `unit_prompt`: " hello" × n (calibration, the window's edges).
    Unit,
    /// `prompt_with_secret`: prose with a secret every 40 words.
    Marker,
    /// `flood_prompt`: a secret every 4 words.
    Flood,
    /// The recall prompt after a flood.
    Recall,
}

/// `usage.prompt_tokens` must be reported, and lie between half a token
/// per word (no tokenizer merges two English words into one token on
/// average) and one token per character (plus a margin for a chat
/// template or BOS); and a prompt twice as long must not count fewer tokens.
/// A prompt sent more than once is reported once.
pub fn accounting(samples: &[Counted]) -> Vec<Finding> {
    let mut found = Vec::new();
    for s in samples {
        match s.prompt_tokens {
            None => found.push(finding(
                "tokens",
                "usage_missing",
                format!("no usage.prompt_tokens for a {}-word prompt", s.words),
            )),
            Some(p) if (p as usize) < s.words / 2 || p as usize > s.chars + 16 => {
                found.push(finding(
                    "tokens",
                    "prompt_tokens_implausible",
                    format!(
                        "usage.prompt_tokens {p} for a prompt of {} words, {} characters",
                        s.words, s.chars
                    ),
                ))
            }
            Some(_) => {}
        }
    }
    // Within one make, against the largest count of any prompt at most
    // half as long. Not across makes: a flood prompt of 1,430 characters
    // counts more tokens than a unit prompt of 2,986 (seen against
    // llama-server: 638 and 511, both right). Not against any shorter
    // prompt either: tokens per character differ with content (a run of
    // digits costs more tokens than words do), so two prompts a few
    // characters apart may count in either order (CI saw 2,463 characters
    // count 514 tokens and 2,529 count 511). Twice the characters of one
    // generator's prompts always counts more tokens.
    let mut by_len: Vec<(Make, usize, u64)> = samples
        .iter()
        .filter_map(|s| Some((s.make, s.chars, s.prompt_tokens?)))
        .collect();
    by_len.sort_unstable();
    by_len.dedup();
    for group in by_len.chunk_by(|a, b| a.0 == b.0) {
        let mut best: Option<(usize, u64)> = None;
        let mut j = 0;
        for &(_, chars, p) in group {
            while j < group.len() && group[j].1 * 2 <= chars {
                if best.is_none_or(|b| group[j].2 > b.1) {
                    best = Some((group[j].1, group[j].2));
                }
                j += 1;
            }
            if let Some((c0, p0)) = best.filter(|b| p < b.1) {
                found.push(finding(
                    "tokens",
                    "prompt_tokens_not_monotone",
                    format!(
                        "a {c0}-character prompt counted {p0} tokens, a {chars}-character one \
                         of the same make {p}"
                    ),
                ));
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    found.retain(|f| seen.insert((f.kind.clone(), f.detail.clone())));
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(tenant: usize, prompt: usize, piece: &str) -> Secret {
        Secret {
            tenant,
            prompt,
            pieces: vec![piece.into()],
        }
    }

    fn answer(status: u16, prompt_tokens: Option<u64>) -> Completion {
        Completion {
            status,
            text: "x".into(),
            prompt_tokens,
            completion_tokens: Some(1),
            tokens: None,
            error_code: None,
            latency_s: 0.1,
            cached_tokens: None,
        }
    }

    #[test]
    fn a_foreign_piece_is_a_finding_and_its_own_is_not() {
        let secrets = vec![
            secret(0, 0, "lemur4821"),
            secret(1, 0, "topaz0007"),
            secret(0, 1, "raven1234"),
        ];
        let out = |secret: Option<usize>, text: &str| Output {
            secret,
            tenant: secret.map_or(1, |i| secrets[i].tenant),
            text: text.into(),
            tokens: None,
        };
        let outs = vec![
            out(Some(0), "lemur4821"),
            out(Some(0), "the code is TOPAZ-0007"),
            out(Some(2), "lemur 4821"),
            out(None, "raven-1234"),
        ];
        let f = markers(&secrets, &outs);
        assert_eq!(f.len(), 3, "{f:?}");
        assert_eq!(f[0].kind, "marker_cross_tenant");
        assert_eq!(f[1].kind, "marker_cross_request");
        assert_eq!(f[2].kind, "marker_cross_tenant");
        assert!(
            f[0].detail.contains("`topaz0007` (in its text)"),
            "{}",
            f[0].detail
        );
    }

    #[test]
    fn a_piece_only_the_tokens_show_is_a_finding() {
        // The server's text dropped it (or rendered it otherwise); the
        // tokens it reports still spell it.
        let secrets = vec![secret(0, 0, "lemur4821"), secret(1, 0, "topaz0007")];
        let toks = ["Ġthe", "Ġcode", "Ġis", "Ġtop", "az", "0", "0", "0", "7"];
        let leak = Output {
            secret: Some(0),
            tenant: 0,
            text: "the code is".into(),
            tokens: Some(toks.iter().map(|t| t.to_string()).collect()),
        };
        let f = markers(&secrets, std::slice::from_ref(&leak));
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].kind, "marker_cross_tenant");
        assert!(
            f[0].detail.contains("`topaz0007` (in its tokens)"),
            "{}",
            f[0].detail
        );
        // Without the tokens the text alone shows nothing.
        let blind = Output {
            tokens: None,
            ..leak
        };
        assert!(markers(&secrets, &[blind]).is_empty());
    }

    #[test]
    fn determinism_counts_and_flags_only_when_claimed() {
        let idle = vec!["a".to_string(), "b".to_string()];
        let loaded = vec![(0, "a".to_string()), (1, "c".to_string())];
        let (rate, f) = determinism(&idle, &loaded, false);
        assert_eq!(rate, 0.5);
        assert!(f.is_empty());
        let (_, f) = determinism(&idle, &loaded, true);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].kind, "output_changed_under_load");
    }

    #[test]
    fn over_length_wants_success_within_and_a_4xx_beyond() {
        let b = |name, status| Boundary {
            name,
            tenant: 0,
            total_tokens: 10,
            prompt_tokens_before: None,
            answer: answer(status, Some(9)),
        };
        assert!(over_length(10, &[b("under", 200), b("at", 200), b("over", 400)]).is_empty());
        let f = over_length(10, &[b("under", 200), b("at", 400), b("over", 200)]);
        let kinds: Vec<_> = f.iter().map(|f| f.kind.as_str()).collect();
        assert_eq!(kinds, ["within_window_refused", "over_length_accepted"]);
        assert_eq!(
            over_length(10, &[b("over", 500)])[0].kind,
            "over_length_not_4xx"
        ); // The same text counted 9 tokens before, 7 now: cut to fit.
        let cut = Boundary {
            prompt_tokens_before: Some(9),
            answer: answer(200, Some(7)),
            ..b("at", 200)
        };
        assert_eq!(over_length(10, &[cut])[0].kind, "prompt_truncated");
        let whole = Boundary {
            prompt_tokens_before: Some(9),
            ..b("at", 200)
        };
        assert!(over_length(10, &[whole]).is_empty());
    }

    #[test]
    fn a_long_prompt_answered_too_fast_is_flagged() {
        let rate = prefill_rate(&[
            Timed {
                prompt_tokens: 1000,
                latency_s: 2.0,
            },
            Timed {
                prompt_tokens: 1000,
                latency_s: 1.0,
            },
        ])
        .unwrap();
        assert_eq!(rate, 1000.0);
        let ok = Timed {
            prompt_tokens: 4000,
            latency_s: 1.5,
        };
        let fast = Timed {
            prompt_tokens: 4000,
            latency_s: 0.5,
        };
        assert!(timing(rate, &[ok]).is_empty());
        assert_eq!(
            timing(rate, &[fast])[0].kind,
            "answered_faster_than_prefill"
        );
    }

    #[test]
    fn prompt_tokens_must_fit_the_prompt() {
        let c = |words, chars, p| Counted {
            make: Make::Marker,
            words,
            chars,
            prompt_tokens: p,
        };
        assert!(accounting(&[c(100, 500, Some(120)), c(400, 2000, Some(480))]).is_empty());
        // The incident's placeholder: a long prompt counted as one token.
        let f = accounting(&[c(100, 500, Some(120)), c(400, 2000, Some(1))]);
        let kinds: Vec<_> = f.iter().map(|f| f.kind.as_str()).collect();
        assert_eq!(
            kinds,
            ["prompt_tokens_implausible", "prompt_tokens_not_monotone"]
        );
        assert_eq!(accounting(&[c(10, 50, None)])[0].kind, "usage_missing");
    }

    #[test]
    fn prompts_close_in_length_may_count_in_either_order() {
        let c = |chars, p| Counted {
            make: Make::Unit,
            words: chars / 6,
            chars,
            prompt_tokens: Some(p),
        };
        // The figures CI measured on two of the probe's own prompts, each
        // sent twice: no finding.
        let close = [c(2463, 514), c(2529, 511), c(2463, 514), c(2529, 511)];
        assert!(accounting(&close).is_empty());
        // Twice the characters and fewer tokens: one finding, not one per
        // repeat.
        let f = accounting(&[c(1000, 300), c(1000, 300), c(2000, 299), c(2000, 299)]);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].kind, "prompt_tokens_not_monotone");
    }

    /// The false finding against llama-server (issue 40): a flood prompt
    /// of 1,430 characters counted 638 tokens and a unit prompt of 2,986
    /// counted 511. Both counts were right; prompts of different makes are
    /// not compared. Within one make the same figures are still a finding.
    #[test]
    fn prompts_of_different_makes_are_not_compared() {
        let c = |make, chars, p| Counted {
            make,
            words: chars / 6,
            chars,
            prompt_tokens: Some(p),
        };
        let seen = [c(Make::Flood, 1430, 638), c(Make::Unit, 2986, 511)];
        assert!(accounting(&seen).is_empty(), "{:?}", accounting(&seen));
        let same = [c(Make::Unit, 1430, 638), c(Make::Unit, 2986, 511)];
        let f = accounting(&same);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].kind, "prompt_tokens_not_monotone");
        assert_eq!(f[0].evidence, Evidence::Heuristic);
    }

    #[test]
    fn a_shared_grammar_cache_is_a_finding_only_when_every_trial_is_fast() {
        let t = |shared_s: f64, cold_s: f64| GrammarTrial {
            schema_bytes: 70_000,
            shared_s,
            cold_s,
        };
        assert!(grammar_cache(&[t(0.08, 0.09), t(0.09, 0.08), t(0.07, 0.08)]).is_empty());
        // One fast trial is noise.
        assert!(grammar_cache(&[t(0.01, 0.08), t(0.08, 0.08), t(0.01, 0.08)]).is_empty());
        // One trial cannot conclude.
        assert!(grammar_cache(&[t(0.01, 0.08)]).is_empty());
        let f = grammar_cache(&[t(0.010, 0.080), t(0.009, 0.085), t(0.011, 0.09)]);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].kind, "grammar_cache_shared_across_tenants");
        assert_eq!(f[0].evidence, Evidence::Statistical);
    }

    #[test]
    fn drafts_from_another_tenant_are_a_finding_only_when_every_repeat_says_so() {
        let t = |first: f64, other: f64, again: f64| DraftTrial {
            tokens: 160,
            first_s: first,
            other_s: other,
            again_s: again,
        };
        // Honest: the other tenant answers at a new answer's speed.
        assert!(draft_pool(&[t(1.3, 1.25, 0.8), t(1.2, 1.3, 0.7)]).is_empty());
        // Shared: at the repeat's, every time.
        let f = draft_pool(&[t(1.3, 0.85, 0.8), t(1.2, 0.75, 0.7), t(1.5, 0.8, 0.7)]);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].kind, "drafts_shared_across_tenants");
        assert_eq!(f[0].evidence, Evidence::Statistical);
        // One trial that says otherwise clears it; so does a server whose
        // repeats are not faster (no cross-request drafts to compare).
        assert!(draft_pool(&[t(1.3, 0.85, 0.8), t(1.2, 1.1, 0.7)]).is_empty());
        assert!(draft_pool(&[t(1.3, 0.5, 1.2), t(1.2, 0.5, 1.1)]).is_empty());
        assert!(draft_pool(&[t(1.3, 0.85, 0.8)]).is_empty());
    }

    #[test]
    fn a_cross_tenant_cache_is_a_finding_only_when_every_trial_is_fast() {
        let t = |shared_s: f64, cold_s: f64, cached: Option<u64>| CacheTrial {
            prompt_tokens: 500,
            shared_s,
            cold_s,
            shared_cached_tokens: cached,
            cold_cached_tokens: Some(16),
        };
        let kinds = |f: Vec<Finding>| f.into_iter().map(|f| f.kind).collect::<Vec<_>>();
        // Isolated: the copy is as slow as a cold prompt (noise either way),
        // and told no more cached tokens than the cold twin.
        assert!(cache_scope(&[t(1.0, 1.1, Some(16)), t(1.2, 1.0, Some(0))]).is_empty());
        // One fast trial is noise, not a finding.
        assert!(cache_scope(&[t(0.1, 1.0, None), t(1.0, 1.0, None)]).is_empty());
        // One trial cannot conclude.
        assert!(cache_scope(&[t(0.01, 1.0, None)]).is_empty());
        // Fast every time: the side channel.
        assert_eq!(
            kinds(cache_scope(&[t(0.02, 1.0, None), t(0.03, 0.9, None)])),
            ["prefix_cache_shared_across_tenants"]
        );
        // Cached tokens reported for another tenant's prefix: its own finding.
        assert_eq!(
            kinds(cache_scope(&[t(1.0, 1.0, Some(480)), t(1.0, 1.0, Some(0))])),
            ["cached_tokens_across_tenants"]
        );
    }
}
