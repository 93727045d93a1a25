//! The router, admission and the streaming loop. Each endpoint's parsing
//! and shaping is its own module's (`openai::*`, `tokenize`, `ops`,
//! `console`); here is what every generation request goes through:
//! authentication, the body, tokenisation, the window (K8), tenant limits,
//! the engine, then its events merged over choices and sent whole or as
//! server-sent events, with the accounting (`accounting::Tracker`).

use std::collections::hash_map::RandomState;
use std::convert::Infallible;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, Method, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::StreamExt;
use request::SamplingParams;
use request::{DoneEvent, Event, GenRequest, RequestHandle, TokenEvent};

use crate::accounting::Tracker;
use crate::error::ApiError;
use crate::openai::{self, Base, Choice, GenParams, Generate, Input, Shaper};
use crate::state::{unix_now, AppState, InflightGuard};
use crate::tenants::TenantPermit;
use crate::{anthropic, console, ops, tokenize as tokenize_route};

/// Bodies declared or found larger than the limit are still read (and
/// discarded) up to this size, so the client finishes sending and sees the
/// 413 instead of a connection reset.
const DRAIN_MAX: usize = 64 << 20;

/// The API's routes: one line per endpoint, whose module owns the rest.
pub(crate) fn router(st: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(openai::chat::handle))
        .route("/v1/completions", post(openai::completions::handle))
        .route("/v1/responses", post(openai::responses::handle))
        .route("/v1/messages", post(anthropic::messages::handle))
        .route(
            "/v1/messages/count_tokens",
            post(anthropic::count_tokens::handle),
        )
        .route("/v1/models", get(openai::models::list))
        .route("/v1/models/{*id}", get(openai::models::by_id))
        .route("/tokenize", post(tokenize_route::handle))
        .route("/health", get(ops::health))
        .route("/metrics", get(ops::metrics_api))
        .merge(console::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(st)
}

/// The operations listener's routes (`--metrics-port`): `/metrics` and
/// `/health`, no key (bind it where only operators reach).
pub(crate) fn ops_router(st: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(ops::health))
        .route("/metrics", get(ops::metrics))
        .merge(console::routes())
        .fallback(not_found)
        .with_state(st)
}

/// The overflow lane's routes (see [`crate::door`]): `/health` as usual,
/// anything else the connection limit's error.
pub(crate) fn overflow_router(st: Arc<AppState>, why: crate::door::Overflow) -> Router {
    use crate::door::Overflow;
    let refuse = move |State(st): State<Arc<AppState>>| async move {
        let e = match why {
            Overflow::Client { limit } => ApiError::client_connections(limit),
            Overflow::Server { limit } => ApiError::server_connections(limit),
        };
        st.metrics.rejection(e.reason);
        e.into_response()
    };
    Router::new()
        .route("/health", get(ops::health))
        .fallback(refuse)
        .with_state(st)
}

async fn not_found(State(st): State<Arc<AppState>>, method: Method, uri: Uri) -> Response {
    let e = ApiError::route_not_found(method.as_str(), uri.path());
    st.metrics.rejection(e.reason);
    e.into_response()
}

async fn method_not_allowed(State(st): State<Arc<AppState>>, method: Method, uri: Uri) -> Response {
    let e = ApiError::method_not_allowed(method.as_str(), uri.path());
    st.metrics.rejection(e.reason);
    e.into_response()
}

/// Under `--tenants`, `/v1/models` wants a valid key like every `/v1`
/// route (what is served is not public).
pub(crate) fn check_key(st: &AppState, headers: &HeaderMap) -> Result<(), Box<Response>> {
    let auth = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    st.tenants.authenticate(auth).map(|_| ()).map_err(|why| {
        let e = ApiError::from(why);
        st.metrics.rejection(e.reason);
        Box::new(e.into_response())
    })
}

// ---- ids, randomness -------------------------------------------------------

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh random 64-bit value (std's randomly keyed SipHash over a counter
/// and the clock; good enough for ids and default seeds, not for secrets).
pub(crate) fn random_u64() -> u64 {
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.write_u128(nanos);
    h.finish()
}

fn request_id(ep: &dyn Generate) -> String {
    format!(
        "{}{:016x}{:08x}",
        ep.id_prefix(),
        random_u64(),
        random_u64() as u32
    )
}

// ---- admission -------------------------------------------------------------

/// An admitted request: an engine handle per choice (`n`) and what it
/// holds (a tenant permit per choice).
struct Admitted {
    handles: Vec<RequestHandle>,
    params: GenParams,
    permits: Vec<TenantPermit>,
    inflight: InflightGuard,
}

/// Reads the body with a size limit and a deadline.
pub(crate) async fn read_body(
    body: Body,
    headers: &HeaderMap,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let expects_continue = headers
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    if let Some(n) = declared {
        // Refuse before reading when the client waits for our go-ahead or
        // the body is too large even to drain.
        if n > limit as u64 && (expects_continue || n > DRAIN_MAX as u64) {
            return Err(ApiError::body_too_large(limit));
        }
    }
    let read = async {
        let mut stream = body.into_data_stream();
        let mut buf: Vec<u8> = Vec::with_capacity(declared.unwrap_or(0).min(limit as u64) as usize);
        let mut seen: usize = 0;
        while let Some(chunk) = stream.next().await {
            let chunk =
                chunk.map_err(|e| ApiError::invalid_json(format!("reading the body: {e}")))?;
            seen = seen.saturating_add(chunk.len());
            if seen > DRAIN_MAX {
                break;
            }
            if seen <= limit {
                buf.extend_from_slice(&chunk);
            }
        }
        if seen > limit {
            return Err(ApiError::body_too_large(limit));
        }
        Ok(Bytes::from(buf))
    };
    match tokio::time::timeout(timeout, read).await {
        Ok(r) => r,
        Err(_) => Err(ApiError::body_timeout(timeout.as_secs())),
    }
}

/// Prompt token ids (and the prompt text, for the log) of a request,
/// through the project's one prompt encoder ([`tokenizer::encode_text`],
/// [`tokenizer::encode_chat`]: in chat messages only the template's text
/// may produce special tokens), shared with `isoserve generate` and
/// `isoserve tokenize`.
/// `chat_param` names the field of chat messages in errors (`messages`, or
/// the Responses API's `input`).
pub(crate) fn tokenize(
    st: &AppState,
    input: &Input,
    chat_param: &str,
    kwargs: &tokenizer::TemplateKwargs,
    tools: Option<&openai::tools::ToolRequest>,
) -> Result<(Vec<u32>, String), ApiError> {
    match input {
        Input::Tokens(ids) => Ok((ids.clone(), format!("{ids:?}"))),
        Input::Text(t) => {
            let ids = tokenizer::encode_text(&st.tokenizer, t)
                .map_err(|e| ApiError::bad_prompt("prompt", e))?;
            Ok((ids, t.clone()))
        }
        Input::Chat(msgs) => {
            let p = chat_prompt(st, msgs, chat_param, kwargs, tools)?;
            Ok((p.ids, p.text))
        }
    }
}

fn chat_prompt(
    st: &AppState,
    msgs: &[openai::Message],
    param: &str,
    kwargs: &tokenizer::TemplateKwargs,
    tools: Option<&openai::tools::ToolRequest>,
) -> Result<tokenizer::Prompt, ApiError> {
    let template = st
        .template
        .as_ref()
        .ok_or_else(|| ApiError::bad_prompt(param, "the model has no chat template"))?;
    let (ms, declared) = openai::tools::render(st.tool_format, msgs, tools);
    let mut vars;
    let kwargs = match declared {
        Some(d) => {
            vars = kwargs.clone();
            vars.insert("tools".into(), d);
            &vars
        }
        None => kwargs,
    };
    tokenizer::encode_chat_with(&st.tokenizer, template, &ms, kwargs).map_err(|e| match e {
        tokenizer::TokenizerError::ReservedTemplateVariable(ref k) => {
            ApiError::invalid_value(format!("chat_template_kwargs.{k}"), e.to_string())
        }
        tokenizer::TokenizerError::ControlTokenInTemplateInput { ref at, .. } => {
            // Name the request's field: a message's, a tool's or a
            // template variable's.
            let field = if let Some(rest) = at.strip_prefix("messages") {
                format!("{param}{rest}")
            } else if let Some(rest) = at.strip_prefix("tools") {
                match tools {
                    Some(t) if t.legacy => {
                        // `tools[i].function.x` is `functions[i].x`.
                        let rest = rest.replacen(".function", "", 1);
                        format!("functions{rest}")
                    }
                    _ => format!("tools{rest}"),
                }
            } else {
                format!("chat_template_kwargs.{at}")
            };
            ApiError::invalid_value(field, e.to_string())
        }
        e => ApiError::bad_prompt(param, e),
    })
}

/// An output format's grammar: as sent, or for a thinking model
/// (`--reasoning-parser`) after the thought, as vLLM applies it. The spec
/// as sent is compiled first, so its errors name the field as they always
/// do; a Lark grammar constrains the whole output, thought included.
fn compile_structured(
    st: &AppState,
    scope: request::Scope,
    s: &openai::structured::StructuredOutput,
    opened: bool,
) -> Result<request::Constraint, ApiError> {
    let plain = compile_grammar(st, scope, s)?;
    if st.reasoning == tools::ReasoningFormat::None {
        return Ok(plain);
    }
    let lark = grammar::as_lark(&s.spec)
        .map_err(|e| ApiError::invalid_value(s.param, format!("{}: {e}", s.spec.noun())))?;
    let Some(wrapped) = lark.and_then(|l| st.reasoning.after_thought(&l, opened)) else {
        return Ok(plain);
    };
    let after = openai::structured::StructuredOutput {
        spec: request::GrammarSpec::Lark(wrapped),
        param: s.param,
        format: None,
    };
    compile_grammar(st, scope, &after)
}

/// Compiles a request's grammar (cached in its scope); a grammar that is
/// invalid or past a bound is a 400 naming the field that sent it.
fn compile_grammar(
    st: &AppState,
    scope: request::Scope,
    s: &openai::structured::StructuredOutput,
) -> Result<request::Constraint, ApiError> {
    let compiler = st.grammar().map_err(ApiError::internal)?;
    let compiled = compiler
        .compile(scope, &s.spec)
        .map_err(|e| ApiError::invalid_value(s.param, format!("{}: {e}", s.spec.noun())))?;
    Ok(request::Constraint {
        spec: Arc::new(s.spec.clone()),
        compiled: Some(compiled as Arc<dyn std::any::Any + Send + Sync>),
    })
}

/// The request's credentials as an `Authorization` value: the header, or
/// Anthropic's `x-api-key` (its SDKs send that) as a bearer token.
pub(crate) fn auth_header(headers: &HeaderMap) -> Option<Vec<u8>> {
    if let Some(v) = headers.get(header::AUTHORIZATION) {
        return Some(v.as_bytes().to_vec());
    }
    headers.get("x-api-key").map(|k| {
        let mut v = b"Bearer ".to_vec();
        v.extend_from_slice(k.as_bytes());
        v
    })
}

async fn admit(
    st: &Arc<AppState>,
    ep: &'static dyn Generate,
    headers: &HeaderMap,
    body: Body,
    tr: &mut Tracker,
) -> Result<Admitted, ApiError> {
    if st.is_shutting_down() {
        return Err(ApiError::shutting_down());
    }
    let tenant = st.tenants.authenticate(auth_header(headers).as_deref())?;
    tr.rec.tenant = Some(tenant.name.clone());
    tr.tenant = Some(tenant.clone());
    let bytes = read_body(body, headers, st.cfg.max_body_bytes, st.cfg.body_timeout).await?;
    let params = ep.parse(&bytes)?;
    drop(bytes);
    if let Some(m) = &params.model {
        if !st.cfg.serves_model(m) {
            return Err(ApiError::model_not_found(m));
        }
    }
    let scope = request::Scope::of(
        tenant.id,
        st.tenants
            .cache_scope(&tenant, params.cache_salt.as_deref()),
    );
    // Tokenising a multi-megabyte prompt and compiling a grammar are CPU
    // work: off the async workers. A batch's prompts one after another
    // (`more_inputs`). The grammar is compiled in the request's cache scope
    // (K11) and within its bounds, so the engine never compiles.
    let (prompts, params, grammar, prediction) = {
        let st2 = st.clone();
        tokio::task::spawn_blocking(move || {
            let prompts = std::iter::once(&params.input)
                .chain(&params.more_inputs)
                .map(|input| {
                    tokenize(
                        &st2,
                        input,
                        ep.prompt_param(),
                        &params.template_kwargs,
                        params.tools.as_ref(),
                    )
                })
                .collect::<Result<Vec<_>, _>>()?;
            // A thinking model's grammar applies after its thought: the
            // prompt says whether the thought is already open.
            let opened = st2.reasoning.opened_by(&prompts[0].1);
            // One grammar a request: the tools' (when active; the parser
            // refuses an output format beside them) or the output format's.
            let grammar = match &params.tools {
                Some(t) if t.set.active() => openai::tools::compile(&st2, scope, t, opened)?,
                _ => params
                    .structured
                    .as_ref()
                    .map(|s| compile_structured(&st2, scope, s, opened))
                    .transpose()?,
            };
            // A prediction is plain text: no special tokens.
            let prediction = params
                .prediction
                .as_deref()
                .map(|t| st2.tokenizer.encode(t, false))
                .transpose()
                .map_err(|e| ApiError::invalid_value("prediction", e))?
                .unwrap_or_default();
            let mut params = params;
            params.reasoning_open = opened;
            params.prompt_tokens = prompts[0].0.len();
            Ok::<_, ApiError>((prompts, params, grammar, prediction))
        })
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task: {e}")))??
    };
    tr.rec.prompt_tokens = prompts.iter().map(|(ids, _)| ids.len()).sum();
    if st.cfg.log_prompts {
        let texts: Vec<&str> = prompts.iter().map(|(_, t)| t.as_str()).collect();
        tr.rec.prompt = Some(texts.join("\n"));
    }
    let mut prompts = prompts.into_iter().map(|(ids, _)| ids);
    let ids = prompts.next().expect("one prompt at least");
    let more_prompts: Vec<Vec<u32>> = prompts.collect();
    let max_tokens_for = |len: usize| {
        params.max_tokens.unwrap_or_else(|| {
            st.max_request()
                .saturating_sub(len)
                .clamp(1, st.cfg.default_max_tokens)
        })
    };
    let max_tokens = max_tokens_for(ids.len());
    let req = GenRequest {
        tenant: tenant.id,
        prompt: ids,
        max_tokens,
        params: SamplingParams {
            temperature: params.temperature,
            top_k: params.top_k,
            top_p: params.top_p,
            min_p: params.min_p,
            repetition_penalty: params.repetition_penalty,
            presence_penalty: params.presence_penalty,
            frequency_penalty: params.frequency_penalty,
            seed: params.seed.unwrap_or_else(random_u64),
            logit_bias: params.logit_bias.clone(),
        },
        stop: params.stop.clone(),
        ignore_eos: params.ignore_eos,
        logprobs: params.logprobs,
        cache_scope: st
            .tenants
            .cache_scope(&tenant, params.cache_salt.as_deref()),
        priority: params.priority,
        weight: tenant.weight,
        // W3C Trace Context: a malformed header is ignored (the spec: start
        // a new trace), never an error.
        trace: headers
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .and_then(request::trace::TraceContext::parse),
        grammar,
        prediction,
    };
    if let Some(m) = tenant.max_priority.filter(|&m| params.priority < m) {
        // Priority orders only the tenant's own requests; the operator may
        // still bound it (K13).
        return Err(ApiError::invalid_value(
            "priority",
            format!(
                "{} is more precedence than this tenant may ask: the lowest value allowed is {m} \
                 (lower values run earlier)",
                params.priority
            ),
        ));
    }
    let engine_err = |e: &request::RequestError| {
        ApiError::from_engine(e, ep.prompt_param(), ep.logprobs_param())
    };
    // The window check (K8) before any tenant budget or queue slot is used
    // (the test-only `fault-incident` build skips it: the engine's
    // placeholder path takes over-long requests).
    let window = if cfg!(feature = "fault-incident") {
        usize::MAX
    } else {
        st.max_request()
    };
    // Every prompt of a batch is checked before anything is queued.
    let mut reqs = vec![req];
    for ids in more_prompts {
        let mut r = reqs[0].clone();
        r.max_tokens = max_tokens_for(ids.len());
        r.prompt = ids;
        reqs.push(r);
    }
    for r in &reqs {
        request::validate(r, window, st.vocab).map_err(|e| engine_err(&e))?;
    }
    // Each choice is a sequence of its own in the engine and counts as one
    // of the tenant's concurrent requests: `n` (or a batch) cannot multiply
    // a tenant's share past what the operator allowed.
    let n = params.n;
    let sequences = n * reqs.len();
    if sequences > tenant.max_concurrent {
        return Err(ApiError::invalid_value(
            "n",
            format!(
                "{} prompts × {n} choices are more than this tenant may run at once \
                 (max_concurrent {})",
                reqs.len(),
                tenant.max_concurrent
            ),
        ));
    }
    // Sequence k is prompt k / n's choice k % n; all admitted or none.
    let needs: Vec<u64> = (0..sequences)
        .map(|k| (reqs[k / n].prompt.len() + reqs[k / n].max_tokens) as u64)
        .collect();
    let mut permits = st.tenants.admit_all(&tenant, &needs, Instant::now())?;
    tr.rec.sequences = sequences;
    let mut handles = Vec::with_capacity(sequences);
    for k in 0..sequences {
        let (req, i) = (&reqs[k / n], k % n);
        // Choice i samples with seed + i: choice 0 is what n = 1 gives.
        let mut choice = req.clone();
        choice.params.seed = req.params.seed.wrapping_add(i as u64);
        match st.engine.submit(choice) {
            Ok(h) => {
                tr.pages.push(h.pages_cell());
                handles.push(h);
            }
            Err(e) => {
                // Sequences already submitted are cancelled as `handles`
                // drops; none ran, so every permit's tokens go back.
                permits.iter_mut().for_each(TenantPermit::refund);
                return Err(engine_err(&e));
            }
        }
    }
    Ok(Admitted {
        handles,
        params,
        permits,
        inflight: InflightGuard::new(st),
    })
}

/// A generation request, start to end: admitted (or refused in OpenAI's
/// shape), then answered by its endpoint's shaper, whole or streamed.
pub(crate) async fn generate(
    st: Arc<AppState>,
    ep: &'static dyn Generate,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let id = request_id(ep);
    let mut tr = Tracker::new(&st, ep.name(), &id);
    let adm = match admit(&st, ep, &headers, body, &mut tr).await {
        Ok(a) => a,
        Err(e) => {
            tracing::debug!(id, reason = e.reason.as_str(), "refused: {e}");
            tr.reject(&e);
            return ep.error_response(e);
        }
    };
    let base = Base {
        st: st.clone(),
        id,
        created: unix_now(),
    };
    let shaper = ep.shaper(base, &adm.params, adm.handles.len());
    if adm.params.stream {
        stream_response(ep, shaper, adm, tr)
    } else {
        full_response(&st, ep, shaper, adm, tr).await
    }
}

fn engine_error(ep: &dyn Generate, e: &request::RequestError) -> ApiError {
    ApiError::from_engine(e, ep.prompt_param(), ep.logprobs_param())
}

fn ended_without_result() -> ApiError {
    ApiError::internal("the engine ended the request without a result")
}

// ---- choices ---------------------------------------------------------------

/// Every choice's events, merged as they come: `(choice, event)`, where
/// `None` is a handle that ended without a result. A choice's handle is
/// dropped after its last event.
type ChoiceEvents = futures_util::stream::SelectAll<
    std::pin::Pin<Box<dyn futures_util::Stream<Item = (usize, Option<Event>)> + Send>>,
>;

fn choice_events(handles: Vec<RequestHandle>) -> ChoiceEvents {
    futures_util::stream::select_all(handles.into_iter().enumerate().map(|(i, h)| {
        let s = futures_util::stream::unfold(Some(h), move |h| async move {
            let mut h = h?;
            match h.next().await {
                Some(e @ (Event::Done(_) | Event::Error(_))) => Some(((i, Some(e)), None)),
                Some(e) => Some(((i, Some(e)), Some(h))),
                None => Some(((i, None), None)),
            }
        });
        Box::pin(s) as std::pin::Pin<Box<dyn futures_util::Stream<Item = _> + Send>>
    }))
}

/// The request's end from its sequences' ends (`n` choices of each
/// prompt): each prompt counted once (as OpenAI's usage does), with its
/// first choice's cached tokens; completions summed, pages summed, the
/// longest queue wait; the finish reason of the first choice.
fn combined(dones: &[DoneEvent], n: usize) -> DoneEvent {
    let first = &dones[0];
    let firsts = || dones.iter().step_by(n.max(1));
    DoneEvent {
        finish: first.finish,
        usage: request::Usage {
            prompt_tokens: firsts().map(|d| d.usage.prompt_tokens).sum(),
            completion_tokens: dones.iter().map(|d| d.usage.completion_tokens).sum(),
            cached_tokens: firsts().map(|d| d.usage.cached_tokens).sum(),
            accepted_prediction_tokens: dones
                .iter()
                .map(|d| d.usage.accepted_prediction_tokens)
                .sum(),
            rejected_prediction_tokens: dones
                .iter()
                .map(|d| d.usage.rejected_prediction_tokens)
                .sum(),
        },
        tail_text: String::new(),
        stop_index: first.stop_index,
        queue_ms: dones.iter().map(|d| d.queue_ms).fold(0.0, f64::max),
        ttft_ms: first.ttft_ms,
        total_ms: dones.iter().map(|d| d.total_ms).fold(0.0, f64::max),
        pages: dones.iter().map(|d| d.pages).sum(),
    }
}

// ---- non-streaming ---------------------------------------------------------

async fn full_response(
    st: &AppState,
    ep: &dyn Generate,
    mut sh: Box<dyn Shaper>,
    adm: Admitted,
    mut tr: Tracker,
) -> Response {
    let Admitted {
        handles,
        params,
        permits: _permits,
        inflight: _inflight,
    } = adm;
    let n = handles.len();
    let logprobs = params.logprobs.is_some();
    let mut texts = vec![String::new(); n];
    let mut events: Vec<Vec<TokenEvent>> = vec![Vec::new(); n];
    let mut dones: Vec<Option<DoneEvent>> = vec![None; n];
    let mut merged = choice_events(handles);
    while let Some((i, ev)) = merged.next().await {
        match ev {
            Some(Event::Token(t)) => {
                tr.token(i);
                // With tools, a format marker that is a control token (left
                // out of the text) is shown to the call parser.
                match params.tools.as_ref().filter(|x| x.set.active()) {
                    Some(_) => texts[i].push_str(st.tool_markers.visible(t.id, &t.text)),
                    None => texts[i].push_str(&t.text),
                }
                if logprobs {
                    events[i].push(t);
                }
            }
            Some(Event::Done(d)) => dones[i] = Some(d),
            Some(Event::Error(e)) => {
                // The other choices are cancelled as `merged` drops.
                let e = engine_error(ep, &e);
                tr.failed(&e);
                return e.into_response();
            }
            None => {
                let e = ended_without_result();
                tr.failed(&e);
                return e.into_response();
            }
        }
    }
    let Some(dones) = dones.into_iter().collect::<Option<Vec<DoneEvent>>>() else {
        let e = ended_without_result();
        tr.failed(&e);
        return e.into_response();
    };
    let all = combined(&dones, params.n);
    tr.finished(&all);
    let choices = texts
        .into_iter()
        .zip(events)
        .zip(dones)
        .map(|((mut text, tokens), done)| {
            text.push_str(&done.tail_text);
            Choice { text, tokens, done }
        })
        .collect();
    sh.full(choices, &all)
}

// ---- streaming -------------------------------------------------------------

enum Phase {
    Start,
    Tokens,
    End,
}

/// The state of an SSE body. It owns the engine handles: when hyper drops
/// the body (the client disconnected), the handles are dropped with it and
/// the engine cancels every choice; the tracker records `cancelled`.
struct Streaming {
    ep: &'static dyn Generate,
    sh: Box<dyn Shaper>,
    merged: ChoiceEvents,
    _permits: Vec<TenantPermit>,
    _inflight: InflightGuard,
    tr: Tracker,
    phase: Phase,
    /// Log-probabilities asked for: a token with no text is still sent.
    logprobs: bool,
    /// Choices per prompt.
    n: usize,
    dones: Vec<Option<DoneEvent>>,
}

impl Streaming {
    async fn next_bytes(&mut self) -> Option<Vec<u8>> {
        match self.phase {
            Phase::End => return None,
            Phase::Start => {
                self.phase = Phase::Tokens;
                if let Some(first) = self.sh.start() {
                    return Some(first);
                }
            }
            Phase::Tokens => {}
        }
        loop {
            match self.merged.next().await {
                Some((i, Some(Event::Token(t)))) => {
                    self.tr.token(i);
                    if t.text.is_empty() && !self.logprobs {
                        continue;
                    }
                    return Some(self.sh.token(i, t));
                }
                Some((i, Some(Event::Done(d)))) => {
                    // A choice ends once: its handle is dropped after it.
                    assert!(self.dones[i].is_none(), "choice {i} ended twice");
                    let mut out = self.sh.finish_choice(i, &d);
                    self.dones[i] = Some(d);
                    if self.dones.iter().all(Option::is_some) {
                        self.phase = Phase::End;
                        let dones: Vec<DoneEvent> = self.dones.iter().flatten().cloned().collect();
                        let all = combined(&dones, self.n);
                        self.tr.finished(&all);
                        out.extend(self.sh.end(&all));
                    }
                    return Some(out);
                }
                Some((_, Some(Event::Error(e)))) => {
                    self.phase = Phase::End;
                    let e = engine_error(self.ep, &e);
                    self.tr.failed(&e);
                    return Some(self.sh.error(&e));
                }
                Some((_, None)) | None => {
                    self.phase = Phase::End;
                    let e = ended_without_result();
                    self.tr.failed(&e);
                    return Some(self.sh.error(&e));
                }
            }
        }
    }
}

fn stream_response(
    ep: &'static dyn Generate,
    sh: Box<dyn Shaper>,
    adm: Admitted,
    tr: Tracker,
) -> Response {
    let n = adm.handles.len();
    let state = Streaming {
        ep,
        sh,
        merged: choice_events(adm.handles),
        _permits: adm.permits,
        _inflight: adm.inflight,
        tr,
        phase: Phase::Start,
        logprobs: adm.params.logprobs.is_some(),
        n: adm.params.n,
        dones: vec![None; n],
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        let bytes = s.next_bytes().await?;
        Some((Ok::<Bytes, Infallible>(Bytes::from(bytes)), s))
    });
    let mut resp = Response::new(Body::from_stream(stream));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    resp
}
