//! `request` — the vocabulary every layer speaks: a generation request
//! and its sampling parameters with their limits, the events a request
//! produces, how it finishes, why it fails, the tenant and request ids, and
//! the [`Backend`] trait the HTTP layer serves (the unified engine, or a PD
//! gateway) with its [`RequestHandle`].
//!
//! It depends on no model, kernel, pool or protocol: the HTTP server and
//! the PD gateway speak it without linking the model (a test over `cargo
//! metadata` in the `isoserve` crate pins the workspace's dependency edges).
//!
//! ```
//! use request::{validate, GenRequest, RequestError, TenantId};
//! let req = GenRequest::greedy(TenantId(1), vec![1, 2, 3], 8);
//! // The checks every node makes before anything is allocated (K8 and
//! // every parameter): here a window of 8 tokens is too small.
//! let err = validate(&req, 8, 1000).unwrap_err();
//! assert_eq!(err.kind(), "context_length_exceeded");
//! assert!(validate(&req, 11, 1000).is_ok());
//! ```

#![forbid(unsafe_code)]

pub mod console;
pub mod constraint;
pub mod trace;

pub use constraint::{Constraint, GrammarSpec};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc as tmpsc;

// ----------------------------------------------------------- ids

/// Request id, unique per node over the node's lifetime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// Shown as its number (messages name a request by it).
impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Tenant id (the API-key holder a request belongs to).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(pub u64);

/// Shown as its number.
impl std::fmt::Display for TenantId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// A prefix-cache scope (K11): the set of requests that may read each
/// other's cached pages. Opaque to the pool, which only compares it; the
/// serving layer derives it (a tenant, or an operator-named group, narrowed by a
/// request's salt — `docs/prefix-cache.md`). [`Scope::tenant`] values have
/// the top bit clear, [`Scope::derived`] ones set, so a derived scope never
/// equals a tenant's own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope(pub u64);

impl Scope {
    const DERIVED_BIT: u64 = 1 << 63;

    /// The tenant's own scope (the default).
    pub const fn tenant(t: TenantId) -> Scope {
        Scope(t.0 & !Scope::DERIVED_BIT)
    }

    /// A scope derived by hashing (a sharing group, a salt).
    pub const fn derived(hash: u64) -> Scope {
        Scope(hash | Scope::DERIVED_BIT)
    }

    /// The scope a request of `tenant` runs in: the one the serving layer
    /// derived for it (`cache_scope`), else the tenant's own. The rule is
    /// written here only; the engine and the transfer machines both reach
    /// it through `kv::Owner::request`.
    pub const fn of(tenant: TenantId, cache_scope: Option<Scope>) -> Scope {
        match cache_scope {
            Some(s) => s,
            None => Scope::tenant(tenant),
        }
    }
}

// ------------------------------------------------------ sampling

/// Limits: a request can ask for no more than this many candidates.
pub const TOP_K_MAX: usize = 1 << 16;
/// Most tokens one request may bias (`logit_bias` entries).
pub const LOGIT_BIAS_MAX: usize = 1024;
/// A bias is in [-LOGIT_BIAS_ABS_MAX, LOGIT_BIAS_ABS_MAX] (OpenAI's range:
/// -100 bans a token in practice, +100 all but forces it).
pub const LOGIT_BIAS_ABS_MAX: f32 = 100.0;

/// Sampling parameters of one request. Defaults are greedy.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means off.
    pub top_k: usize,
    /// 1 means off.
    pub top_p: f32,
    /// 0 means off.
    pub min_p: f32,
    /// 1 means off (HF/llama.cpp style: positive logits divided, negative multiplied).
    pub repetition_penalty: f32,
    /// OpenAI style: subtracted once from every token already present.
    pub presence_penalty: f32,
    /// OpenAI style: subtracted per occurrence.
    pub frequency_penalty: f32,
    pub seed: u64,
    /// OpenAI's `logit_bias`: (token id, bias) added to that token's logit
    /// before penalties and sampling, greedy included. Sorted by token id,
    /// each id once, at most [`LOGIT_BIAS_MAX`]; empty means off.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            logit_bias: Vec::new(),
        }
    }
}

/// A parameter out of its valid range; names the field.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid sampling parameter `{field}`: {why}")]
pub struct ParamError {
    pub field: &'static str,
    pub why: String,
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), ParamError> {
        let err = |field, why: &str| {
            Err(ParamError {
                field,
                why: why.to_string(),
            })
        };
        if !(0.0..=100.0).contains(&self.temperature) {
            return err("temperature", "must be between 0 and 100");
        }
        if self.top_k > TOP_K_MAX {
            return err("top_k", "too large");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return err("top_p", "must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return err("min_p", "must be in [0, 1]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 10.0) {
            return err("repetition_penalty", "must be in (0, 10]");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return err("presence_penalty", "must be between -2 and 2");
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return err("frequency_penalty", "must be between -2 and 2");
        }
        if self.logit_bias.len() > LOGIT_BIAS_MAX {
            return err("logit_bias", &format!("at most {LOGIT_BIAS_MAX} tokens"));
        }
        if !self.logit_bias.windows(2).all(|w| w[0].0 < w[1].0) {
            return err("logit_bias", "token ids must be sorted and distinct");
        }
        if let Some((t, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-LOGIT_BIAS_ABS_MAX..=LOGIT_BIAS_ABS_MAX).contains(b))
        {
            return err(
                "logit_bias",
                &format!("the bias of token {t} is {b}: must be between -100 and 100"),
            );
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Limits on stop strings, as OpenAI's API: at most 4, each non-empty.
pub const STOP_STRINGS_MAX: usize = 4;
pub const STOP_STRING_BYTES_MAX: usize = 256;

/// Checks a request's stop strings against [`STOP_STRINGS_MAX`] and
/// [`STOP_STRING_BYTES_MAX`].
pub fn validate_stops(stops: &[String]) -> Result<(), ParamError> {
    if stops.len() > STOP_STRINGS_MAX {
        return Err(ParamError {
            field: "stop",
            why: format!("at most {STOP_STRINGS_MAX} stop strings"),
        });
    }
    if stops
        .iter()
        .any(|s| s.is_empty() || s.len() > STOP_STRING_BYTES_MAX)
    {
        return Err(ParamError {
            field: "stop",
            why: format!("stop strings must be 1 to {STOP_STRING_BYTES_MAX} bytes"),
        });
    }
    Ok(())
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string ("stop" in OpenAI's API).
    Stop,
    /// max_tokens reached ("length").
    Length,
}

/// A finish as one byte on the PD wire: 0 `Stop` (an end-of-sequence token
/// or the grammar's end), 1 `Length`, 2 + k stop string k.
pub fn finish_code(finish: FinishReason, stop_index: Option<u16>) -> u8 {
    match (finish, stop_index) {
        (FinishReason::Length, _) => 1,
        (FinishReason::Stop, Some(k)) if k < 253 => 2 + k as u8,
        (FinishReason::Stop, _) => 0,
    }
}

/// [`finish_code`] read back.
pub fn finish_of(code: u8) -> (FinishReason, Option<u16>) {
    match code {
        0 => (FinishReason::Stop, None),
        1 => (FinishReason::Length, None),
        k => (FinishReason::Stop, Some(u16::from(k - 2))),
    }
}

impl FinishReason {
    pub fn as_openai(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

// ------------------------------------------------------- requests

/// Largest `top_logprobs` a request may ask for (as OpenAI's API).
pub const TOP_LOGPROBS_MAX: usize = 20;
/// Largest `max_tokens` any request may ask for (also bounded by the window).
pub const MAX_TOKENS_MAX: usize = 1 << 20;

/// Most tokens a request's prediction may hold (`prediction.content`): the
/// drafts are verified against at most a window of output, and the
/// drafter searches the prediction every step.
pub const PREDICTION_TOKENS_MAX: usize = 1 << 15;

/// Upper bound on a tenant's fair-share weight ([`GenRequest::weight`]).
pub const WEIGHT_MAX: u32 = 1000;

/// Why a request was refused or failed. `kind()` names it for logs and
/// metrics; the server maps each to an HTTP status.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    #[error(
        "This model's maximum context length is {limit} tokens. However, you requested {total} \
         tokens ({prompt} in the messages, {max_tokens} in the completion). Please reduce the \
         length of the messages or completion."
    )]
    ContextLengthExceeded {
        prompt: usize,
        max_tokens: usize,
        total: usize,
        limit: usize,
    },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("invalid parameter `{field}`: {why}")]
    InvalidParam { field: &'static str, why: String },
    #[error("the server is busy: {waiting} requests are waiting (limit {limit}); retry later")]
    QueueFull { waiting: usize, limit: usize },
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The client read its stream so slowly that `limit` events waited
    /// unread while the request could not be paused (PD).
    #[error("the client fell {limit} events behind its stream; the request was cancelled")]
    ClientTooSlow { limit: usize },
    /// The output's grammar could not be followed past a point (a step's
    /// mask over its bounds, or no token allowed): the request ends with
    /// this error rather than with output the grammar does not accept.
    #[error("the output's grammar could not be followed: {0}")]
    Grammar(String),
    #[error("internal error: {0}")]
    Internal(String),
    /// Refused or failed on a remote node (PD): that node's original error,
    /// unchanged (K9).
    #[error("{message}")]
    Remote {
        status: u16,
        code: String,
        message: String,
    },
}

impl RequestError {
    pub fn kind(&self) -> &'static str {
        match self {
            RequestError::ContextLengthExceeded { .. } => "context_length_exceeded",
            RequestError::EmptyPrompt => "empty_prompt",
            RequestError::InvalidParam { .. } => "invalid_parameter",
            RequestError::QueueFull { .. } => "queue_full",
            RequestError::ShuttingDown => "shutting_down",
            RequestError::ClientTooSlow { .. } => "client_too_slow",
            RequestError::Grammar(_) => "grammar_error",
            RequestError::Internal(_) => "internal_error",
            RequestError::Remote { .. } => "remote_error",
        }
    }
}

/// A generation request, tokenised.
#[derive(Clone, Debug)]
pub struct GenRequest {
    pub tenant: TenantId,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub params: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Return the chosen token's log-probability and this many alternatives
    /// (`None`: no logprobs).
    pub logprobs: Option<usize>,
    /// The prefix-cache scope (K11), set by the serving layer from the
    /// authenticated tenant, its sharing group and the request's salt —
    /// never taken from the caller. `None`: the tenant's own scope.
    pub cache_scope: Option<Scope>,
    /// Order among the tenant's own requests (vLLM's meaning: lower runs
    /// earlier; default 0). It never reaches past the tenant's share (K13).
    pub priority: i32,
    /// The tenant's weight in the fair share (K13), set by the serving
    /// layer from `tenants.toml`; at least 1.
    pub weight: u32,
    /// The caller's W3C `traceparent` (or one the serving layer started):
    /// nodes record their spans under it. Never affects the output.
    pub trace: Option<trace::TraceContext>,
    /// The grammar the output must follow (structured outputs); `None`:
    /// free text.
    pub grammar: Option<Constraint>,
    /// The output the caller expects, as tokens (OpenAI's Predicted
    /// Outputs): drafts for speculative decoding, verified by the model, so
    /// it changes the speed and never the tokens (K12). Empty: none. At
    /// most [`PREDICTION_TOKENS_MAX`].
    pub prediction: Vec<u32>,
}

impl GenRequest {
    /// The cache scope the request runs in.
    pub fn scope(&self) -> Scope {
        Scope::of(self.tenant, self.cache_scope)
    }

    pub fn greedy(tenant: TenantId, prompt: Vec<u32>, max_tokens: usize) -> GenRequest {
        GenRequest {
            tenant,
            prompt,
            max_tokens,
            params: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            cache_scope: None,
            priority: 0,
            weight: 1,
            trace: None,
            grammar: None,
            prediction: Vec::new(),
        }
    }
}

/// One generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenEvent {
    pub id: u32,
    /// Text that became final with this token (may be empty: held back for
    /// UTF-8 completion or a possible stop string).
    pub text: String,
    pub logprob: Option<f32>,
    /// (token id, logprob) of the most likely alternatives.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Token counts, as OpenAI reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache (OpenAI's
    /// `prompt_tokens_details.cached_tokens`).
    pub cached_tokens: usize,
    /// Tokens of the request's prediction the model verified and kept, and
    /// those it verified and rejected (OpenAI's
    /// `completion_tokens_details.accepted_prediction_tokens` and
    /// `rejected_prediction_tokens`; both 0 without a prediction).
    pub accepted_prediction_tokens: usize,
    pub rejected_prediction_tokens: usize,
}

/// The end of a request.
#[derive(Clone, Debug, PartialEq)]
pub struct DoneEvent {
    pub finish: FinishReason,
    pub usage: Usage,
    /// Text held back at the end (a partial stop-string prefix that never
    /// completed); already included in no earlier token event.
    pub tail_text: String,
    /// Which of the request's stop strings ended it (its index), when one
    /// did (`finish` is then `Stop`): Anthropic's API names it.
    pub stop_index: Option<u16>,
    pub queue_ms: f64,
    pub ttft_ms: f64,
    pub total_ms: f64,
    pub pages: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token(TokenEvent),
    Done(DoneEvent),
    Error(RequestError),
}

/// Events a request's channel holds. The unified engine does not step a
/// request whose reader has fallen this far behind (back-pressure: a slow
/// client slows only its own request, its pages stay reserved, nothing is
/// lost); the PD gateway, which cannot pause a remote decode, ends such a
/// request with [`RequestError::ClientTooSlow`].
pub const REQUEST_EVENTS_MAX: usize = 256;

/// What a metric sample is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum MetricKind {
    Counter,
    Gauge,
    /// Declared by a table only (a registry's histogram); no sample has
    /// this kind.
    Histogram,
}

/// One sample of a metric that a backend or a node reports, for an HTTP
/// layer to expose through its Prometheus encoder (nobody writes the
/// exposition by hand). Samples of one metric share `name`, `help` and
/// `kind` and differ in `labels`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MetricSample {
    /// The full name; a counter's ends in `_total`.
    pub name: String,
    pub help: String,
    pub kind: MetricKind,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl MetricSample {
    pub fn counter(name: impl Into<String>, help: impl Into<String>, value: f64) -> MetricSample {
        MetricSample {
            name: name.into(),
            help: help.into(),
            kind: MetricKind::Counter,
            labels: Vec::new(),
            value,
        }
    }

    pub fn gauge(name: impl Into<String>, help: impl Into<String>, value: f64) -> MetricSample {
        MetricSample {
            kind: MetricKind::Gauge,
            ..MetricSample::counter(name, help, value)
        }
    }

    pub fn label(mut self, key: &str, value: impl Into<String>) -> MetricSample {
        self.labels.push((key.to_string(), value.into()));
        self
    }
}

/// A request's event channel, bounded by [`REQUEST_EVENTS_MAX`].
pub fn event_channel() -> (tmpsc::Sender<Event>, tmpsc::Receiver<Event>) {
    tmpsc::channel(REQUEST_EVENTS_MAX)
}

/// The caller's side of a request: events, and cancellation on drop.
pub struct RequestHandle {
    pub id: RequestId,
    events: tmpsc::Receiver<Event>,
    cancel: Arc<AtomicBool>,
    /// Called once on the first cancel (a backend that must be told, e.g.
    /// the PD gateway, rather than poll the flag).
    on_cancel: Option<Box<dyn Fn() + Send + Sync>>,
    /// KV pages allocated to the request so far ([`PAGES_UNKNOWN`] until
    /// the backend says), for the request log: a request refused while it
    /// held pages is part of the incident's signature.
    pages: Arc<AtomicU64>,
}

/// [`RequestHandle::pages_cell`] before the backend has said.
pub const PAGES_UNKNOWN: u64 = u64::MAX;

/// Something that runs requests: the unified [`Engine`], or a PD gateway.
/// The HTTP layer serves any backend.
pub trait Backend: Send + Sync {
    /// Queues a request (validated against the backend's limit).
    fn submit(&self, req: GenRequest) -> Result<RequestHandle, RequestError>;
    /// The largest `prompt + max_tokens` accepted now (K8; a PD gateway's
    /// changes when a node restarts with another pool).
    fn max_request_tokens(&self) -> usize;
    /// Occupancy and counters.
    fn stats(&self) -> EngineStats;
    /// The KV pool's capacity in tokens, where one pool serves the
    /// requests (the unified engine; a PD gateway has none of its own).
    fn kv_capacity_tokens(&self) -> Option<usize> {
        None
    }
    /// Stops admitting; `drain`: let running requests finish.
    fn shutdown(&self, drain: bool);
    /// Whether requests can be served now (a PD gateway: a pair is up).
    fn ready(&self) -> bool {
        true
    }
    /// More metrics for `/metrics` (a PD gateway's counters and, under
    /// `serve --disaggregated`, its nodes'), encoded by the HTTP layer's
    /// Prometheus library. May block briefly (the HTTP layer calls it off
    /// its async threads).
    fn metric_samples(&self) -> Vec<MetricSample> {
        Vec::new()
    }
    /// What the operator console shows of each node serving the requests
    /// (the unified engine: one; a PD gateway: its nodes'): pool maps,
    /// safety counters, transfers in flight. Counts and states only. May
    /// block briefly (a fresh map is asked of the pool's owner; a gateway
    /// asks its nodes): the HTTP layer calls it off its async threads.
    fn console_nodes(&self) -> Vec<console::NodeView> {
        Vec::new()
    }
}

impl RequestHandle {
    /// The handle of a request the backend runs itself: `cancel` is the
    /// flag it polls, `pages` the page count it keeps.
    pub fn local(
        id: RequestId,
        events: tmpsc::Receiver<Event>,
        cancel: Arc<AtomicBool>,
        pages: Arc<AtomicU64>,
    ) -> RequestHandle {
        RequestHandle {
            id,
            events,
            cancel,
            on_cancel: None,
            pages,
        }
    }

    /// Next event (async); `None` after Done/Error.
    pub async fn next(&mut self) -> Option<Event> {
        self.events.recv().await
    }

    /// Next event, blocking the thread (not for async contexts).
    pub fn blocking_next(&mut self) -> Option<Event> {
        self.events.blocking_recv()
    }

    /// Cooperative cancel: the engine frees the request's pages at its next
    /// step. Dropping the handle does the same.
    pub fn cancel(&self) {
        if !self.cancel.swap(true, Ordering::AcqRel) {
            if let Some(f) = &self.on_cancel {
                f();
            }
        }
    }

    /// A handle over events produced elsewhere (a backend other than the
    /// engine); `on_cancel` runs once when the caller cancels or drops it.
    pub fn new(
        id: RequestId,
        events: tmpsc::Receiver<Event>,
        on_cancel: Box<dyn Fn() + Send + Sync>,
    ) -> RequestHandle {
        RequestHandle {
            id,
            events,
            cancel: Arc::new(AtomicBool::new(false)),
            on_cancel: Some(on_cancel),
            pages: Arc::new(AtomicU64::new(PAGES_UNKNOWN)),
        }
    }

    /// KV pages allocated to the request so far (`None`: the backend does
    /// not know, or has not said).
    pub fn pages_allocated(&self) -> Option<usize> {
        match self.pages.load(Ordering::Acquire) {
            PAGES_UNKNOWN => None,
            n => Some(n as usize),
        }
    }

    /// The page count, for a reader that outlives the handle (the request
    /// log writes after the handle is gone).
    pub fn pages_cell(&self) -> Arc<AtomicU64> {
        self.pages.clone()
    }

    /// A handle whose page count the backend keeps in `cell`.
    pub fn with_pages_cell(mut self, cell: Arc<AtomicU64>) -> RequestHandle {
        self.pages = cell;
        self
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        self.cancel();
    }
}

pub fn validate(req: &GenRequest, max_request: usize, vocab: usize) -> Result<(), RequestError> {
    if req.prompt.is_empty() {
        return Err(RequestError::EmptyPrompt);
    }
    if req.max_tokens == 0 || req.max_tokens > MAX_TOKENS_MAX {
        return Err(RequestError::InvalidParam {
            field: "max_tokens",
            why: format!("must be 1..={MAX_TOKENS_MAX}"),
        });
    }
    let total = req.prompt.len().saturating_add(req.max_tokens);
    if total > max_request {
        return Err(RequestError::ContextLengthExceeded {
            prompt: req.prompt.len(),
            max_tokens: req.max_tokens,
            total,
            limit: max_request,
        });
    }
    if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(RequestError::InvalidParam {
            field: "prompt",
            why: format!("token id {bad} is outside the vocabulary of {vocab}"),
        });
    }
    if let Some(&(bad, _)) = req
        .params
        .logit_bias
        .iter()
        .find(|(t, _)| *t as usize >= vocab)
    {
        return Err(RequestError::InvalidParam {
            field: "logit_bias",
            why: format!("token id {bad} is outside the vocabulary of {vocab}"),
        });
    }
    req.params
        .validate()
        .map_err(|e| RequestError::InvalidParam {
            field: e.field,
            why: e.why,
        })?;
    validate_stops(&req.stop).map_err(|e| RequestError::InvalidParam {
        field: e.field,
        why: e.why,
    })?;
    if req.logprobs.is_some_and(|n| n > TOP_LOGPROBS_MAX) {
        return Err(RequestError::InvalidParam {
            field: "top_logprobs",
            why: format!("must be 0..={TOP_LOGPROBS_MAX}"),
        });
    }
    if req.prediction.len() > PREDICTION_TOKENS_MAX {
        return Err(RequestError::InvalidParam {
            field: "prediction",
            why: format!(
                "{} tokens: at most {PREDICTION_TOKENS_MAX}",
                req.prediction.len()
            ),
        });
    }
    if let Some(&bad) = req.prediction.iter().find(|&&t| t as usize >= vocab) {
        return Err(RequestError::InvalidParam {
            field: "prediction",
            why: format!("token id {bad} is outside the vocabulary of {vocab}"),
        });
    }
    if let Some(g) = &req.grammar {
        g.spec
            .check_bounds()
            .map_err(|why| RequestError::InvalidParam {
                field: "response_format",
                why,
            })?;
    }
    Ok(())
}

// ---------------------------------------------------------- stats

/// Occupancy and counters, as plain numbers for export (Prometheus later).
/// Names carry units last; all counters are totals since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub pages_total: u64,
    pub pages_free: u64,
    /// Allocated pages (including leased and release-pending ones).
    pub pages_owned: u64,
    /// Pages with at least one lease.
    pub pages_leased: u64,
    /// Pages freed by their owner whose release waits for a lease (K4).
    pub pages_release_pending: u64,
    pub refused_stale_handle: u64,
    pub refused_foreign_owner: u64,
    pub refused_unwritten_read: u64,
    pub refused_double_free: u64,
    pub refused_release_pending: u64,
    pub refused_out_of_range: u64,
    pub refused_write_gap: u64,
    pub refused_already_written: u64,
    pub refused_out_of_pages: u64,
    pub refused_lease_limit: u64,
    pub canary_mismatch: u64,
    pub checksum_mismatch: u64,
    /// A write or free of a cached (shared, read-only) page (K11).
    pub refused_shared_write: u64,
    /// A read of a cached page from another scope (K11).
    pub refused_foreign_scope: u64,
    /// A release of a cached page without a reference (K5).
    pub refused_ref_underflow: u64,
    /// A page offered to the cache that was not wholly written (K3) or was
    /// leased.
    pub refused_unpublishable: u64,
    pub allocs: u64,
    pub frees: u64,
    pub frees_deferred: u64,
    /// Pages cached (shared), held or idle.
    pub pages_cached: u64,
    /// Cached pages no request holds and no transfer leases.
    pub pages_evictable: u64,
    pub cache_publishes: u64,
    pub cache_evictions: u64,
}

impl PoolStats {
    /// Pages no request and no transfer holds: free, or cached and idle
    /// (an allocation takes either). Equal to `pages_total` when nothing
    /// runs — "the pool is clean" with a prefix cache.
    pub fn pages_unheld(&self) -> u64 {
        self.pages_free + self.pages_evictable
    }

    /// Sum of every refusal that is a safety check firing (all but
    /// `out_of_pages`, which is back-pressure): must stay 0.
    pub fn safety_refusals(&self) -> u64 {
        POOL_COUNTERS
            .iter()
            .filter(|c| c.refusal.is_some_and(|r| r != OUT_OF_PAGES))
            .map(|c| (c.read)(self))
            .sum()
    }

    /// Every refusal by kind (`/metrics`' `kind` label and the console's
    /// names): each a safety check firing, but `out_of_pages`
    /// (back-pressure).
    pub fn refusals(&self) -> [(&'static str, u64); POOL_REFUSALS] {
        let mut refusals = POOL_COUNTERS
            .iter()
            .filter_map(|c| c.refusal.map(|r| (r, (c.read)(self))));
        std::array::from_fn(|_| refusals.next().expect("the table's refusals"))
    }

    /// `(name, value)` for every field, for exporters.
    pub fn fields(&self) -> [(&'static str, u64); 28] {
        std::array::from_fn(|i| (POOL_COUNTERS[i].name, (POOL_COUNTERS[i].read)(self)))
    }
}

/// How many of [`POOL_COUNTERS`] count a refusal (the length of
/// [`PoolStats::refusals`], counted from the table, so a row added there
/// is never cut off).
pub const POOL_REFUSALS: usize = {
    let mut n = 0;
    let mut i = 0;
    while i < POOL_COUNTERS.len() {
        if POOL_COUNTERS[i].refusal.is_some() {
            n += 1;
        }
        i += 1;
    }
    n
};

/// The refusal that is back-pressure, not a safety check.
const OUT_OF_PAGES: &str = "out_of_pages";

/// One of the pool's numbers as exporters read it.
pub struct PoolCounter {
    /// Its name among the fields.
    pub name: &'static str,
    /// Its kind when it counts a refusal (`/metrics`' `kind` label).
    pub refusal: Option<&'static str>,
    pub read: fn(&PoolStats) -> u64,
}

/// Every number of [`PoolStats`], once, in the order exporters show
/// them: `fields`, `refusals` and `safety_refusals` all read this table.
pub const POOL_COUNTERS: [PoolCounter; 28] = [
    PoolCounter {
        name: "pages_total",
        refusal: None,
        read: |p| p.pages_total,
    },
    PoolCounter {
        name: "pages_free",
        refusal: None,
        read: |p| p.pages_free,
    },
    PoolCounter {
        name: "pages_owned",
        refusal: None,
        read: |p| p.pages_owned,
    },
    PoolCounter {
        name: "pages_leased",
        refusal: None,
        read: |p| p.pages_leased,
    },
    PoolCounter {
        name: "pages_release_pending",
        refusal: None,
        read: |p| p.pages_release_pending,
    },
    PoolCounter {
        name: "refused_stale_handle",
        refusal: Some("stale_handle"),
        read: |p| p.refused_stale_handle,
    },
    PoolCounter {
        name: "refused_foreign_owner",
        refusal: Some("foreign_owner"),
        read: |p| p.refused_foreign_owner,
    },
    PoolCounter {
        name: "refused_unwritten_read",
        refusal: Some("unwritten_read"),
        read: |p| p.refused_unwritten_read,
    },
    PoolCounter {
        name: "refused_double_free",
        refusal: Some("double_free"),
        read: |p| p.refused_double_free,
    },
    PoolCounter {
        name: "refused_release_pending",
        refusal: Some("release_pending"),
        read: |p| p.refused_release_pending,
    },
    PoolCounter {
        name: "refused_out_of_range",
        refusal: Some("out_of_range"),
        read: |p| p.refused_out_of_range,
    },
    PoolCounter {
        name: "refused_write_gap",
        refusal: Some("write_gap"),
        read: |p| p.refused_write_gap,
    },
    PoolCounter {
        name: "refused_already_written",
        refusal: Some("already_written"),
        read: |p| p.refused_already_written,
    },
    PoolCounter {
        name: "refused_out_of_pages",
        refusal: Some("out_of_pages"),
        read: |p| p.refused_out_of_pages,
    },
    PoolCounter {
        name: "refused_lease_limit",
        refusal: Some("lease_limit"),
        read: |p| p.refused_lease_limit,
    },
    PoolCounter {
        name: "canary_mismatch",
        refusal: Some("canary_mismatch"),
        read: |p| p.canary_mismatch,
    },
    PoolCounter {
        name: "checksum_mismatch",
        refusal: Some("checksum_mismatch"),
        read: |p| p.checksum_mismatch,
    },
    PoolCounter {
        name: "allocs",
        refusal: None,
        read: |p| p.allocs,
    },
    PoolCounter {
        name: "frees",
        refusal: None,
        read: |p| p.frees,
    },
    PoolCounter {
        name: "frees_deferred",
        refusal: None,
        read: |p| p.frees_deferred,
    },
    PoolCounter {
        name: "refused_shared_write",
        refusal: Some("shared_write"),
        read: |p| p.refused_shared_write,
    },
    PoolCounter {
        name: "refused_foreign_scope",
        refusal: Some("foreign_scope"),
        read: |p| p.refused_foreign_scope,
    },
    PoolCounter {
        name: "refused_ref_underflow",
        refusal: Some("ref_underflow"),
        read: |p| p.refused_ref_underflow,
    },
    PoolCounter {
        name: "refused_unpublishable",
        refusal: Some("unpublishable"),
        read: |p| p.refused_unpublishable,
    },
    PoolCounter {
        name: "pages_cached",
        refusal: None,
        read: |p| p.pages_cached,
    },
    PoolCounter {
        name: "pages_evictable",
        refusal: None,
        read: |p| p.pages_evictable,
    },
    PoolCounter {
        name: "cache_publishes",
        refusal: None,
        read: |p| p.cache_publishes,
    },
    PoolCounter {
        name: "cache_evictions",
        refusal: None,
        read: |p| p.cache_evictions,
    },
];

/// Occupancy and counters, refreshed after every step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineStats {
    pub pool: PoolStats,
    pub running: usize,
    pub waiting: usize,
    pub prompt_tokens_total: u64,
    pub generated_tokens_total: u64,
    pub steps_total: u64,
    pub requests_finished_total: u64,
    pub requests_cancelled_total: u64,
    pub requests_failed_total: u64,
    /// Requests refused by the engine thread's own re-check (the submit-side
    /// check should have caught them first; non-zero means a bug upstream).
    pub requests_refused_total: u64,
    /// Forward rows per second over steps of at least
    /// 64 (`engine::PREFILL_RATE_ROWS_MIN`) rows (an average weighted to recent
    /// steps; 0 until one ran): what prefill achieves at best, so no prompt
    /// can be prefilled much faster (the audit's `too_fast` rule).
    pub prefill_tokens_per_s: f64,
    /// Requests that looked up the prefix cache, and their prompt tokens.
    pub prefix_cache_queries_total: u64,
    pub prefix_cache_query_tokens_total: u64,
    /// Prompt tokens and pages served from the prefix cache.
    pub prefix_cache_hit_tokens_total: u64,
    pub prefix_cache_hit_pages_total: u64,
    /// Running requests taken out of the batch to make room for a tenant
    /// under its fair share (or a better priority of the same tenant):
    /// their pages freed (full ones cached first), recomputed on resuming.
    pub requests_preempted_total: u64,
    /// Preempted requests waiting to resume.
    pub preempted: usize,
    /// Constrained rows whose grammar mask was not ready when the forward
    /// pass ended: the request sampled a step later, and the step did not
    /// wait for it.
    pub grammar_deferred_total: u64,
    /// Speculative decoding: verification steps that carried drafts, the
    /// draft tokens they verified and those the model kept (vLLM's
    /// `spec_decode_num_drafts`, `_num_draft_tokens`,
    /// `_num_accepted_tokens`).
    pub spec_drafts_total: u64,
    pub spec_draft_tokens_total: u64,
    pub spec_accepted_tokens_total: u64,
    /// The suffix cache (`--speculative suffix`): scopes with entries, and
    /// the tokens they hold.
    pub spec_suffix_scopes: usize,
    pub spec_suffix_tokens: usize,
    /// One more row's cost as a share of a one-row step, as the engine
    /// fitted it from its decode steps (what drafts are weighed against).
    pub spec_row_cost: f64,
    /// The draft model's pool (`--draft-model`), if there is one.
    pub draft_pool: Option<PoolStats>,
    /// Requests that decoded without the draft model because its pool had
    /// no room for them, and the draft model's passes and rows run.
    pub spec_draft_pool_full_total: u64,
    pub spec_draft_passes_total: u64,
    pub spec_draft_rows_total: u64,
    /// Each active tenant's requests in the engine (K13), by tenant id.
    pub tenants: Vec<TenantLoad>,
}

/// One active tenant's requests in the engine.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantLoad {
    pub tenant: TenantId,
    pub running: usize,
    pub waiting: usize,
    pub preempted: usize,
    /// Its fair-share weight.
    pub weight: u32,
    /// Rows computed for it per weight since it became active (the
    /// virtual token counter admission compares).
    pub service: f64,
}

impl EngineStats {
    pub fn new(pool: PoolStats) -> EngineStats {
        EngineStats {
            pool,
            ..EngineStats::default()
        }
    }
}

#[cfg(test)]
mod finish_tests {
    use super::*;

    #[test]
    fn a_finish_and_its_stop_string_cross_the_wire_in_one_byte() {
        for (f, k) in [
            (FinishReason::Stop, None),
            (FinishReason::Length, None),
            (FinishReason::Stop, Some(0)),
            (FinishReason::Stop, Some(3)),
        ] {
            assert_eq!(finish_of(finish_code(f, k)), (f, k));
        }
        // A length finish names no stop string.
        assert_eq!(
            finish_of(finish_code(FinishReason::Length, Some(2))),
            (FinishReason::Length, None)
        );
    }
}
