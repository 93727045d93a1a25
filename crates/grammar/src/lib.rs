//! `grammar` — structured outputs. A request's [`GrammarSpec`] (a JSON
//! schema, `json_object`, a regex, a choice or a Lark grammar) is compiled
//! by llguidance over the model's own vocabulary ([`Vocabulary`]), and a
//! per-sequence [`Matcher`] gives each step's [`Mask`] of the tokens that
//! keep the output inside the grammar; the sampler applies it before
//! sampling, greedy included, so the output is valid by construction.
//!
//! Compiled grammars are cached **per cache scope** (K11), never across
//! them: a tenant whose schema compiles fast because another tenant sent
//! it first would learn what that tenant sent ([`Compiler`]). Every compile
//! and every mask is bounded ([`Limits`]), so a pathological grammar gets
//! an error in bounded time and never stalls the engine.
//!
//! ```
//! use grammar::{Compiler, Limits, Vocabulary};
//! use request::{GrammarSpec, Scope, TenantId};
//! // A toy vocabulary: one token per byte, and an end-of-sequence token.
//! let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
//! words.push(b"<eos>".to_vec());
//! let vocab = Vocabulary::from_words(words, &[256], &[256]).unwrap();
//! let compiler = Compiler::new(vocab, Limits::default()).unwrap();
//! let scope = Scope::tenant(TenantId(1));
//! let spec = GrammarSpec::Choice(vec!["yes".into(), "no".into()]);
//! let compiled = compiler.compile(scope, &spec).unwrap();
//! let mut m = compiled.matcher();
//! let mask = m.mask().unwrap();
//! assert!(mask.allows(b'y' as u32) && mask.allows(b'n' as u32));
//! assert!(!mask.allows(b'x' as u32) && !mask.allows(256));
//! for b in b"no" {
//!     m.consume(*b as u32).unwrap();
//! }
//! assert!(m.is_stopped());
//! ```

#![forbid(unsafe_code)]

mod cache;
pub mod stats;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::{Matcher as LlMatcher, ParserFactory, TokenParser};
use serde_json::{json, Map, Value};
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

pub use cache::{CacheStats, SCOPES_MAX, SCOPE_ENTRIES_MAX};
pub use request::{GrammarSpec, Scope};
pub use stats::{GrammarStats, StatsSnapshot};

/// Why a grammar was refused or could not be followed. The message names
/// the problem; the HTTP layer names the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    /// The source is not valid (bad JSON, an unsupported keyword, a regex
    /// or Lark grammar that does not parse, a choice list out of bounds).
    #[error("{0}")]
    Invalid(String),
    /// Compiling went past a bound of [`Limits`].
    #[error("{0}")]
    TooComplex(String),
    /// A step's mask failed (past a bound, or the matcher's own error).
    #[error("{0}")]
    Step(String),
}

/// Longest error message kept from llguidance (its messages can quote
/// the whole grammar).
const MESSAGE_BYTES_MAX: usize = 600;

fn clip(s: &str) -> String {
    if s.len() <= MESSAGE_BYTES_MAX {
        return s.to_string();
    }
    let mut end = MESSAGE_BYTES_MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// A bound llguidance reports is "too complex"; anything else is "invalid".
fn classify(msg: &str) -> GrammarError {
    // A caught panic's message is followed by its backtrace: keep the line.
    let first = msg.split("\n<backtrace>").next().unwrap_or(msg);
    let m = clip(first);
    let lower = msg.to_ascii_lowercase();
    let bound = [
        "fuel",
        "too many",
        "too large",
        "limit",
        "max_items",
        "grammar size",
        "lexer states",
    ];
    if bound.iter().any(|b| lower.contains(b)) {
        GrammarError::TooComplex(m)
    } else {
        GrammarError::Invalid(m)
    }
}

// ---- the vocabulary --------------------------------------------------------

/// The model's vocabulary as llguidance sees it: each token's bytes, control
/// and empty tokens marked special (no grammar text can produce them), and
/// the ids that end a sequence (allowed exactly when the grammar accepts).
#[derive(Clone)]
pub struct Vocabulary {
    env: TokEnv,
}

/// llguidance's view of the vocabulary: the trie, and greedy tokenisation
/// (non-canonical: llguidance then never forces tokens from text, and
/// isoserve never asks it to — every token is sampled under its mask).
struct Env {
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }
    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

impl Vocabulary {
    /// From a tokenizer: BPE (byte-level) and SentencePiece alike, through
    /// the bytes each id decodes to.
    pub fn from_tokenizer(tok: &tokenizer::Tokenizer) -> Result<Vocabulary, GrammarError> {
        use tokenizer::TokenType;
        let n = tok.vocab_size();
        let mut words = Vec::with_capacity(n);
        let mut special = Vec::new();
        for id in 0..n as u32 {
            let bytes = tok.token_bytes(id).unwrap_or(&[]);
            let kind = tok.token_type(id);
            let is_special = bytes.is_empty()
                || matches!(
                    kind,
                    Some(
                        TokenType::Control
                            | TokenType::Unknown
                            | TokenType::Unused
                            | TokenType::Undefined
                    )
                );
            if is_special {
                special.push(id);
            }
            words.push(bytes.to_vec());
        }
        Vocabulary::from_words(words, &special, tok.eos_ids())
    }

    /// From each token's bytes; `special` ids (and empty tokens) are kept
    /// out of text, `eos` ids end a sequence.
    pub fn from_words(
        mut words: Vec<Vec<u8>>,
        special: &[u32],
        eos: &[u32],
    ) -> Result<Vocabulary, GrammarError> {
        let n = words.len();
        if n == 0 || n > u32::MAX as usize / 2 {
            return Err(GrammarError::Invalid(format!("a vocabulary of {n} tokens")));
        }
        for (id, w) in words.iter_mut().enumerate() {
            if w.is_empty() || special.contains(&(id as u32)) {
                // Marked special: the trie keeps it apart from text. The
                // id makes the name unique.
                let name = format!("<[{id}]>");
                let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                marked.extend_from_slice(name.as_bytes());
                *w = marked;
            } else if w[0] == TokTrie::SPECIAL_TOKEN_MARKER {
                // A text token starting with byte 0xFF (invalid UTF-8 on
                // its own): llguidance reserves the byte as its marker.
                let name = format!("<[{id}]>");
                let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                marked.extend_from_slice(name.as_bytes());
                *w = marked;
            }
        }
        let eos: Vec<u32> = eos.iter().copied().filter(|&e| (e as usize) < n).collect();
        let info = TokRxInfo {
            vocab_size: n as u32,
            tok_eos: eos.first().copied().unwrap_or(toktrie::INVALID_TOKEN),
            tok_bos: None,
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let mut trie = TokTrie::from(&info, &words);
        if !eos.is_empty() {
            trie = trie.with_eos_tokens(&eos);
        }
        Ok(Vocabulary {
            env: Arc::new(Env { trie }),
        })
    }

    /// Tokens in the vocabulary.
    pub fn len(&self) -> usize {
        self.env.tok_trie().vocab_size()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// ---- bounds ----------------------------------------------------------------

/// The bounds on a grammar's compile and on each step's mask. Every figure
/// is llguidance's own unit; the comments give its measured speed.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Work building the lexer at compile (≈50k a millisecond).
    pub initial_lexer_fuel: u64,
    /// Lexer work for one step's mask (≈14k a millisecond).
    pub step_lexer_fuel: u64,
    /// Parser items for one step's mask (≈20k a millisecond).
    pub step_max_items: usize,
    /// Most lexer states a grammar may build (each ≈1–2 KB): bounds the
    /// memory one compiled grammar holds.
    pub max_lexer_states: usize,
    /// Most symbols in the compiled grammar.
    pub max_grammar_size: usize,
    /// Widest Earley row (the grammar's branching).
    pub max_items_in_row: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            initial_lexer_fuel: 1_000_000,
            step_lexer_fuel: 100_000,
            step_max_items: 30_000,
            max_lexer_states: 50_000,
            max_grammar_size: 200_000,
            // An object of ~2,000 optional properties still fits a row.
            max_items_in_row: 8_000,
        }
    }
}

impl Limits {
    fn parser_limits(&self) -> ParserLimits {
        ParserLimits {
            max_items_in_row: self.max_items_in_row,
            initial_lexer_fuel: self.initial_lexer_fuel,
            step_lexer_fuel: self.step_lexer_fuel,
            step_max_items: self.step_max_items,
            max_lexer_states: self.max_lexer_states,
            max_grammar_size: self.max_grammar_size,
            precompute_large_lexemes: true,
            // Errors go back to the request's own tenant, but need not
            // quote the whole grammar.
            verbose_errors: false,
        }
    }
}

// ---- compiling -------------------------------------------------------------

/// The JSON text layout isoserve's JSON grammars generate: OpenAI's
/// compact separators, and no free whitespace (a small model given free
/// whitespace can spend its whole budget on newlines).
fn json_options() -> Value {
    json!({
        "item_separator": ", ",
        "key_separator": ": ",
        "whitespace_flexible": false,
    })
}

/// Numbers a JSON grammar generates have at most this many digits before
/// the point (unless the schema's own bounds allow more)...
pub const NUMBER_BOUND: f64 = 1e15;
/// ...and at most 8 after it (unless the schema's `multipleOf` says
/// otherwise). As llama.cpp bounds them: a small model left an unbounded
/// number writes digits until its budget runs out. (llguidance's
/// `multipleOf` overflows from 1e-9 on.)
pub const NUMBER_STEP: f64 = 1e-8;

/// The longest value of each string `format`: no standard value is longer
/// (RFC 5321's 254 for an address, RFC 1035's 253 for a host name, RFC
/// 3339 times with nine fraction digits). A format left unbounded lets a
/// small model write fraction digits, or an address, without end.
const FORMAT_BYTES_MAX: [(&str, u64); 10] = [
    ("date", 10),
    ("time", 24),
    ("date-time", 35),
    ("duration", 64),
    ("email", 254),
    ("hostname", 253),
    ("ipv4", 15),
    ("ipv6", 45),
    ("uuid", 36),
    // What browsers and most servers accept.
    ("uri", 2048),
];

/// The keywords whose values are schemas (a map of them, or a list):
/// what [`narrow_schema`] walks. `enum`, `const`, `default` and
/// `examples` hold data, never walked.
const SCHEMA_MAPS: [&str; 5] = [
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
];
const SCHEMA_LISTS: [&str; 4] = ["anyOf", "oneOf", "allOf", "prefixItems"];
const SCHEMA_ONE: [&str; 8] = [
    "additionalProperties",
    "items",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
];

/// Narrows a schema to what a generator should write, never beyond what
/// the schema as sent accepts (every value generated stays valid under
/// it):
/// - every number and integer's digits where the schema leaves them
///   unbounded ([`NUMBER_BOUND`], [`NUMBER_STEP`]);
/// - every formatted string's length where the schema does not bound it
///   ([`FORMAT_BYTES_MAX`]);
/// - `strict` (OpenAI's strict mode, whose schemas must close every
///   object): an object with `properties` and no `additionalProperties`
///   is closed;
/// - `uniqueItems: false` (no constraint) is dropped: llguidance knows
///   only `true`, which it refuses.
fn narrow_schema(v: &mut Value, strict: bool) {
    let Value::Object(m) = v else {
        return;
    };
    if m.get("uniqueItems") == Some(&Value::Bool(false)) {
        m.remove("uniqueItems");
    }
    if strict
        && (m.contains_key("properties") || m.contains_key("patternProperties"))
        && !m.contains_key("additionalProperties")
    {
        m.insert("additionalProperties".into(), Value::Bool(false));
    }
    if let Some(max) = m
        .get("format")
        .and_then(Value::as_str)
        .and_then(|f| FORMAT_BYTES_MAX.iter().find(|(name, _)| *name == f))
        .map(|(_, max)| *max)
    {
        m.entry("maxLength").or_insert(json!(max));
    }
    let types: Vec<&str> = match m.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let number = types.contains(&"number");
    if number || types.contains(&"integer") {
        let num = |m: &Map<String, Value>, k: &str| m.get(k).and_then(Value::as_f64);
        let (lo, hi) = (
            num(m, "minimum").or(num(m, "exclusiveMinimum")),
            num(m, "maximum").or(num(m, "exclusiveMaximum")),
        );
        // A bound of the schema's own past NUMBER_BOUND: left as sent (the
        // engine's integer ranges stop near 1e18).
        let within = |b: Option<f64>| b.is_none_or(|x| x.abs() <= NUMBER_BOUND);
        if hi.is_none() && within(lo) {
            m.insert(
                "maximum".into(),
                json!(lo.unwrap_or(0.0).max(0.0) + NUMBER_BOUND),
            );
        }
        if lo.is_none() && within(hi) {
            m.insert(
                "minimum".into(),
                json!(hi.unwrap_or(0.0).min(0.0) - NUMBER_BOUND),
            );
        }
        if number && !m.contains_key("multipleOf") {
            m.insert("multipleOf".into(), json!(NUMBER_STEP));
        }
    }
    for k in SCHEMA_MAPS {
        if let Some(Value::Object(sub)) = m.get_mut(k) {
            sub.values_mut().for_each(narrow(strict));
        }
    }
    for k in SCHEMA_LISTS {
        if let Some(Value::Array(sub)) = m.get_mut(k) {
            sub.iter_mut().for_each(narrow(strict));
        }
    }
    for k in SCHEMA_ONE {
        match m.get_mut(k) {
            Some(Value::Array(sub)) => sub.iter_mut().for_each(narrow(strict)),
            Some(sub) => narrow_schema(sub, strict),
            None => {}
        }
    }
}

/// [`narrow_schema`] over each member of a list or map.
fn narrow(strict: bool) -> impl FnMut(&mut Value) {
    move |v| narrow_schema(v, strict)
}

/// The llguidance grammar for a spec (no compile yet: cheap).
fn top_level(spec: &GrammarSpec) -> Result<TopLevelGrammar, GrammarError> {
    spec.check_bounds().map_err(GrammarError::Invalid)?;
    Ok(match spec {
        GrammarSpec::JsonObject => {
            let mut s = json!({"type": "object"});
            s["x-guidance"] = json_options();
            TopLevelGrammar::from_json_schema(s)
        }
        GrammarSpec::JsonSchema { schema, strict } => {
            let mut v: Value = serde_json::from_str(schema)
                .map_err(|e| GrammarError::Invalid(format!("the schema is not JSON: {e}")))?;
            match &mut v {
                Value::Object(m) => {
                    if m.contains_key("x-guidance") {
                        return Err(GrammarError::Invalid(
                            "`x-guidance` is not accepted in a schema: the server sets the \
                             JSON layout"
                                .into(),
                        ));
                    }
                    m.insert("x-guidance".into(), json_options());
                    narrow_schema(&mut v, *strict);
                }
                Value::Bool(true) => {
                    v = json!({"x-guidance": json_options()});
                }
                Value::Bool(false) => {
                    return Err(GrammarError::Invalid(
                        "the schema `false` accepts nothing".into(),
                    ))
                }
                other => {
                    return Err(GrammarError::Invalid(format!(
                        "a schema is a JSON object (or `true`), got {}",
                        match other {
                            Value::Array(_) => "an array",
                            Value::String(_) => "a string",
                            Value::Number(_) => "a number",
                            _ => "null",
                        }
                    )))
                }
            }
            TopLevelGrammar::from_json_schema(v)
        }
        GrammarSpec::Regex(rx) => {
            check_regex(rx)?;
            TopLevelGrammar::from_regex(rx)
        }
        GrammarSpec::Choice(choices) => {
            let alts: Vec<String> = choices.iter().map(|c| regex_syntax::escape(c)).collect();
            TopLevelGrammar::from_regex(&format!("(?:{})", alts.join("|")))
        }
        GrammarSpec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
    })
}

/// A regex parsed by us first, for a clear message when it is bad.
fn check_regex(rx: &str) -> Result<(), GrammarError> {
    regex_syntax::ParserBuilder::new()
        .nest_limit(64)
        .build()
        .parse(rx)
        .map(|_| ())
        .map_err(|e| GrammarError::Invalid(format!("the regex does not parse: {e}")))
}

/// A JSON schema narrowed as a `json_schema` request's is
/// ([`GrammarSpec::JsonSchema`]: bounded numbers and formats, `strict`
/// closing objects), for a schema that is part of a larger one (a tool's
/// arguments inside a call).
pub fn narrowed_schema(schema: &Value, strict: bool) -> Result<Value, GrammarError> {
    let mut v = schema.clone();
    match &mut v {
        Value::Object(m) => {
            if m.contains_key("x-guidance") {
                return Err(GrammarError::Invalid(
                    "`x-guidance` is not accepted in a schema: the server sets the JSON layout"
                        .into(),
                ));
            }
            narrow_schema(&mut v, strict);
            Ok(v)
        }
        Value::Bool(true) => Ok(json!({})),
        _ => Err(GrammarError::Invalid(
            "a schema is a JSON object (or `true`)".into(),
        )),
    }
}

/// A (narrowed) schema as a Lark grammar inlines it, `%json { … }`, laid
/// out as a `json_schema` request's output is (`", "`, `": "`).
pub fn inline_schema(schema: &Value) -> String {
    let mut v = schema.clone();
    if let Value::Object(m) = &mut v {
        m.insert("x-guidance".into(), json_options());
    }
    format!("%json {v}")
}

/// A spec as a Lark grammar whose root is `start`, the same language laid
/// out the same way (so it can be wrapped: a thinking model's answer after
/// its thought). `None` for a Lark grammar, which is one already.
pub fn as_lark(spec: &GrammarSpec) -> Result<Option<String>, GrammarError> {
    spec.check_bounds().map_err(GrammarError::Invalid)?;
    Ok(Some(match spec {
        GrammarSpec::JsonObject => {
            format!("start: {}\n", inline_schema(&json!({"type": "object"})))
        }
        GrammarSpec::JsonSchema { schema, strict } => {
            let v: Value = serde_json::from_str(schema)
                .map_err(|e| GrammarError::Invalid(format!("the schema is not JSON: {e}")))?;
            if v == Value::Bool(false) {
                return Err(GrammarError::Invalid(
                    "the schema `false` accepts nothing".into(),
                ));
            }
            format!("start: {}\n", inline_schema(&narrowed_schema(&v, *strict)?))
        }
        GrammarSpec::Regex(rx) => {
            check_regex(rx)?;
            // Inside `/…/` only the delimiter needs escaping.
            let mut lit = String::with_capacity(rx.len());
            let mut escaped = false;
            for c in rx.chars() {
                if c == '/' && !escaped {
                    lit.push('\\');
                }
                escaped = c == '\\' && !escaped;
                lit.push(c);
            }
            format!("start: /{lit}/\n")
        }
        GrammarSpec::Choice(choices) => {
            let alts: Vec<String> = choices
                .iter()
                .map(|c| Value::String(c.clone()).to_string())
                .collect();
            format!("start: {}\n", alts.join(" | "))
        }
        GrammarSpec::Lark(_) => return Ok(None),
    }))
}

/// A grammar compiled over the vocabulary: a parser in its start state,
/// which every sequence clones. Clones share the lexer's lazily built
/// states, so the cache that holds it is what decides who shares them:
/// one scope only ([`Compiler`]).
pub struct Compiled {
    parser: TokenParser,
    stats: Arc<GrammarStats>,
    /// How long compiling took (cold), for the metrics.
    pub compile_time: Duration,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compiled")
            .field("compile_time", &self.compile_time)
            .finish()
    }
}

impl Compiled {
    /// A fresh matcher for one sequence: its state lives with the
    /// sequence and is dropped with it.
    pub fn matcher(&self) -> Matcher {
        Matcher {
            inner: LlMatcher::new(Ok(self.parser.clone())),
            steps: 0,
            stats: self.stats.clone(),
        }
    }
}

/// Compiles grammars over one vocabulary, and caches them per cache scope
/// (K11): a grammar compiled for one scope is never handed to another, so
/// how fast a compile answers says nothing about other tenants' schemas.
pub struct Compiler {
    factory: ParserFactory,
    stats: Arc<GrammarStats>,
    cache: Mutex<cache::ScopedCache<Arc<Compiled>>>,
    /// `fault-incident` builds with `ISOSERVE_FAULT_SHARED_GRAMMAR_CACHE=1`:
    /// one scope for everyone — the side channel `isoserve probe` must
    /// catch.
    #[cfg(feature = "fault-incident")]
    shared: bool,
}

impl Compiler {
    pub fn new(vocab: Vocabulary, limits: Limits) -> Result<Compiler, GrammarError> {
        let mut factory = ParserFactory::new_simple(&vocab.env)
            .map_err(|e| GrammarError::Invalid(format!("the vocabulary: {e}")))?;
        factory.quiet();
        *factory.limits_mut() = limits.parser_limits();
        Ok(Compiler {
            factory,
            stats: Arc::new(GrammarStats::default()),
            cache: Mutex::new(cache::ScopedCache::new()),
            #[cfg(feature = "fault-incident")]
            shared: {
                let on = std::env::var_os("ISOSERVE_FAULT_SHARED_GRAMMAR_CACHE")
                    .is_some_and(|v| v == "1");
                if on {
                    tracing::error!(
                        "FAULT-INCIDENT BUILD: one grammar cache for every scope \
                         (ISOSERVE_FAULT_SHARED_GRAMMAR_CACHE=1); for testing isoserve probe only"
                    );
                }
                on
            },
        })
    }

    /// The compiled grammar of `spec` in `scope`: from the scope's cache,
    /// or compiled now (its first mask included, so the lexer's start is
    /// built here and not in the engine's first step). Errors name the
    /// problem; the time taken is bounded by [`Limits`].
    pub fn compile(&self, scope: Scope, spec: &GrammarSpec) -> Result<Arc<Compiled>, GrammarError> {
        #[cfg(feature = "fault-incident")]
        let scope = if self.shared {
            Scope::derived(0)
        } else {
            scope
        };
        if let Some(hit) = self.lock().get(scope, spec) {
            self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(hit);
        }
        self.stats.cache_misses.fetch_add(1, Ordering::Relaxed);
        let compiled = Arc::new(self.compile_cold(spec)?);
        self.lock().insert(scope, spec.clone(), compiled.clone());
        Ok(compiled)
    }

    /// Compiles without looking at or filling any cache.
    pub fn compile_cold(&self, spec: &GrammarSpec) -> Result<Compiled, GrammarError> {
        let started = Instant::now();
        let top = top_level(spec)?;
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| classify(&e.to_string()))?;
        // The first mask builds the lexer's start states and surfaces the
        // errors llguidance finds only then; the matcher is thrown away,
        // the lexer states it built stay with the parser's clones.
        let mut probe = LlMatcher::new(Ok(parser.clone()));
        if let Err(e) = probe.compute_mask() {
            return Err(classify(&e.to_string()));
        }
        if let Some(e) = probe.get_error() {
            return Err(classify(&e));
        }
        let compile_time = started.elapsed();
        self.stats.compiles.record(compile_time);
        Ok(Compiled {
            parser,
            stats: self.stats.clone(),
            compile_time,
        })
    }

    /// Mask and compile times, cache hits and misses (every grammar this
    /// compiler made, and their matchers).
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// What the cache holds.
    pub fn cache_stats(&self) -> CacheStats {
        self.lock().stats()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, cache::ScopedCache<Arc<Compiled>>> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }
}

// ---- matching ----------------------------------------------------------------

/// One sequence's place in its grammar.
pub struct Matcher {
    inner: LlMatcher,
    /// Masks computed (for the metrics and tests).
    steps: u64,
    stats: Arc<GrammarStats>,
}

impl std::fmt::Debug for Matcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Matcher")
            .field("steps", &self.steps)
            .field("stopped", &self.inner.is_stopped())
            .finish()
    }
}

impl Matcher {
    /// The tokens allowed next: the grammar's continuations, and the
    /// end-of-sequence tokens where the grammar may end (only them once
    /// it has ended). An error when a bound of [`Limits`] was hit, or when
    /// no token at all is allowed.
    pub fn mask(&mut self) -> Result<Mask, GrammarError> {
        self.steps += 1;
        let started = Instant::now();
        let r = self.mask_inner();
        self.stats.masks.record(started.elapsed());
        if r.is_err() {
            self.stats.mask_failures.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    fn mask_inner(&mut self) -> Result<Mask, GrammarError> {
        let v = self
            .inner
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Step(clip(&e.to_string())))?;
        if let Some(e) = self.inner.get_error() {
            return Err(GrammarError::Step(clip(&e)));
        }
        if v.is_zero() {
            return Err(GrammarError::Step(
                "no token of the vocabulary continues the output here".into(),
            ));
        }
        Ok(Mask(v))
    }

    /// Moves past a sampled token (one the last mask allowed).
    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        self.inner
            .consume_token(token)
            .map_err(|e| GrammarError::Step(clip(&e.to_string())))
    }

    /// The grammar has ended: nothing but end-of-sequence may follow.
    pub fn is_stopped(&self) -> bool {
        self.inner.is_stopped()
    }

    /// Masks computed so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }
}

/// The tokens a step allows, one bit a token.
#[derive(Clone, Debug)]
pub struct Mask(SimpleVob);

impl Mask {
    /// Whether token `t` is allowed.
    pub fn allows(&self, t: u32) -> bool {
        (t as usize) < self.0.len() && self.0.is_allowed(t)
    }

    /// Sets every disallowed token's logit to −∞ (a model whose logits
    /// outnumber the vocabulary: the extra ones too).
    pub fn apply(&self, logits: &mut [f32]) {
        let words = self.0.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX && chunk.len() == 32 {
                continue;
            }
            for (i, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << i) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// Allowed tokens.
    pub fn count(&self) -> usize {
        self.0.num_set()
    }
}

#[cfg(test)]
mod tests;
