//! The state every handler shares ([`AppState`]), and the in-flight count
//! that shutdown waits on.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use request::Backend;
use tokenizer::{ChatTemplate, Tokenizer};
use tokio::sync::futures::Notified;
use tokio::sync::Notify;

use crate::config::ServerConfig;
use crate::metrics::Metrics;
use crate::reqlog::RequestLog;
use crate::tenants::Tenants;

/// Shared state of every handler.
pub(crate) struct AppState {
    pub engine: Arc<dyn Backend>,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// How the model calls tools: `--tool-format`, else what the template
    /// speaks ([`tools::Format::detect`]).
    pub tool_format: tools::Format,
    /// The format's markers that are one special token in the vocabulary.
    pub tool_markers: tools::Markers,
    /// How the model marks its reasoning: `--reasoning-parser`, else what
    /// the template writes ([`tools::ReasoningFormat::detect`]).
    pub reasoning: tools::ReasoningFormat,
    pub tenants: Tenants,
    pub metrics: Metrics,
    pub reqlog: Option<RequestLog>,
    pub cfg: ServerConfig,
    pub vocab: usize,
    pub started: u64,
    pub console: crate::console::ConsoleState,
    /// The grammar compiler (structured outputs): the unified engine's own
    /// ([`crate::Server::with_grammar`]), else made from the tokenizer on
    /// first use (a PD gateway checks grammars before it sends them on).
    grammar: std::sync::OnceLock<Result<Arc<grammar::Compiler>, String>>,
    shutting_down: AtomicBool,
    inflight: AtomicUsize,
    inflight_changed: Notify,
}

impl AppState {
    pub fn new(
        engine: Arc<dyn Backend>,
        tokenizer: Tokenizer,
        template: Option<ChatTemplate>,
        tenants: Tenants,
        reqlog: Option<RequestLog>,
        cfg: ServerConfig,
    ) -> AppState {
        let vocab = tokenizer.vocab_size();
        let tool_format = cfg
            .tool_format
            .unwrap_or_else(|| tools::Format::detect(template.as_ref().map_or("", |t| t.source())));
        let tool_markers = tools::Markers {
            special: tools::Markers::texts()
                .iter()
                .filter_map(|&text| {
                    let id = tokenizer.special_id(text)?;
                    (tokenizer.token_type(id) == Some(tokenizer::TokenType::Control))
                        .then(|| (text.to_string(), id))
                })
                .collect(),
        };
        let reasoning = cfg.reasoning.unwrap_or_else(|| {
            tools::ReasoningFormat::detect(template.as_ref().map_or("", |t| t.source()))
        });
        AppState {
            engine,
            tokenizer,
            template,
            reasoning,
            tool_format,
            tool_markers,
            tenants,
            metrics: Metrics::new(),
            reqlog,
            cfg,
            vocab,
            started: unix_now(),
            console: crate::console::ConsoleState::default(),
            grammar: std::sync::OnceLock::new(),
            shutting_down: AtomicBool::new(false),
            inflight: AtomicUsize::new(0),
            inflight_changed: Notify::new(),
        }
    }

    /// Uses `c` as the grammar compiler (once, before serving).
    pub fn set_grammar(&self, c: Arc<grammar::Compiler>) {
        let _ = self.grammar.set(Ok(c));
    }

    /// The grammar compiler, made from the tokenizer the first time it is
    /// needed (blocking: call it off the async threads).
    pub fn grammar(&self) -> Result<Arc<grammar::Compiler>, String> {
        self.grammar
            .get_or_init(|| {
                grammar::Vocabulary::from_tokenizer(&self.tokenizer)
                    .and_then(|v| grammar::Compiler::new(v, grammar::Limits::default()))
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
    }

    /// The grammar engine's counters (zeros before its first use).
    pub fn grammar_stats(&self) -> grammar::StatsSnapshot {
        match self.grammar.get() {
            Some(Ok(c)) => c.stats(),
            _ => grammar::StatsSnapshot::default(),
        }
    }

    /// From now on, new requests get 503 and `/health` says so.
    pub fn begin_shutdown(&self) {
        let was = self.shutting_down.swap(true, Ordering::SeqCst);
        // One shutdown per server: the drain runs once.
        assert!(!was, "shutdown begun twice");
    }

    /// Resolves when the in-flight count next changes (create it before
    /// reading the count, so no change is missed).
    pub fn inflight_changed(&self) -> Notified<'_> {
        self.inflight_changed.notified()
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::SeqCst)
    }

    /// The advertised limit now (K8).
    pub fn max_request(&self) -> usize {
        self.engine.max_request_tokens()
    }
}

/// An admitted request's place in the in-flight count (what shutdown waits
/// for); released on drop.
pub(crate) struct InflightGuard(Arc<AppState>);

impl InflightGuard {
    pub fn new(st: &Arc<AppState>) -> InflightGuard {
        st.inflight.fetch_add(1, Ordering::SeqCst);
        InflightGuard(st.clone())
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        let before = self.0.inflight.fetch_sub(1, Ordering::SeqCst);
        // Each guard added one: the count never goes below zero.
        assert!(before > 0, "in-flight count underflow");
        self.0.inflight_changed.notify_waiters();
    }
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
