//! `POST /v1/responses`: OpenAI's Responses API, stateless. Text or
//! message items in (with `instructions`); a `response` object out, or its
//! `response.*` events with sequence numbers.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use request::{DoneEvent, TokenEvent};
use serde_json::{json, Value};

use super::fields::{parse_common, parse_content, parse_object, type_name, Fields, Variant};
use super::structured::StructuredOutput;
use super::{
    sse, Base, Choice, GenParams, Generate, Input, Message, Shaper, TokenLogprob, MESSAGES_MAX,
    TOP_LOGPROBS_MAX,
};
use crate::error::ApiError;
use crate::state::AppState;

pub(crate) async fn handle(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    crate::http::generate(st, &Responses, headers, body).await
}

/// The endpoint.
pub(crate) struct Responses;

impl Generate for Responses {
    fn name(&self) -> &'static str {
        "responses"
    }
    fn id_prefix(&self) -> &'static str {
        "resp_"
    }
    fn prompt_param(&self) -> &'static str {
        "input"
    }
    fn logprobs_param(&self) -> &'static str {
        "top_logprobs"
    }
    fn parse(&self, body: &[u8]) -> Result<GenParams, ApiError> {
        parse_responses(body)
    }
    fn shaper(&self, base: Base, p: &GenParams, _choices: usize) -> Box<dyn Shaper> {
        let reasoning =
            (base.st.reasoning != tools::ReasoningFormat::None).then_some(p.reasoning_open);
        let active = p.tools.as_ref().filter(|t| t.set.active());
        let calls = active.map(|_| base.st.tool_format);
        // The tools as the Responses API writes them (flat).
        let echoed: Vec<Value> = p.tools.as_ref().map_or(Vec::new(), |t| {
            t.declared
                .iter()
                .map(|d| {
                    let mut f = d["function"].clone();
                    f["type"] = json!("function");
                    f
                })
                .collect()
        });
        let tool_choice = match p.tools.as_ref().map(|t| &t.set.choice) {
            None | Some(tools::Choice::None) => json!("none"),
            Some(tools::Choice::Auto) => json!("auto"),
            Some(tools::Choice::Required) => json!("required"),
            Some(tools::Choice::Named(n)) => json!({"type": "function", "name": n}),
        };
        Box::new(ResponseShaper {
            base,
            logprobs: p.logprobs.is_some(),
            temperature: p.temperature,
            top_p: p.top_p,
            max_tokens: p.max_tokens,
            instructions: p.instructions.clone(),
            format: p
                .structured
                .as_ref()
                .and_then(|s| s.format.clone())
                .unwrap_or_else(|| json!({"type": "text"})),
            tools: Value::Array(echoed),
            tool_choice,
            parallel: p.tools.as_ref().is_some_and(|t| t.set.parallel),
            seq: 0,
            tokens: Vec::new(),
            reasoning,
            calls,
            parser: tools::OutputParser::new(reasoning, calls),
            items: Vec::new(),
            open: false,
        })
    }
}

const VARIANT: Variant = Variant {
    max_tokens: |f| f.int_in("max_output_tokens", 1, request::MAX_TOKENS_MAX as i64),
    logprobs,
    structured,
    chat_template: true,
};

/// `text.format`; the chat fields that ask for a format are refused here
/// (the Responses API names it `text.format`).
fn structured(f: &Fields<'_>) -> Result<Option<StructuredOutput>, ApiError> {
    for field in ["response_format", "structured_outputs"] {
        if f.get(field).is_some() {
            return Err(ApiError::unsupported(
                field,
                "the Responses API asks for a format with `text.format`",
            ));
        }
    }
    super::structured::parse_text_format(f)
}

/// Log-probabilities come with the output text when `include` names
/// them; `top_logprobs` alternatives each.
fn logprobs(f: &Fields<'_>) -> Result<Option<usize>, ApiError> {
    let top = f.int_in("top_logprobs", 0, TOP_LOGPROBS_MAX as i64)?;
    let on = match f.get("include") {
        None => false,
        Some(Value::Array(a)) => {
            let mut on = false;
            for (i, v) in a.iter().enumerate() {
                match v.as_str() {
                    Some("message.output_text.logprobs") => on = true,
                    Some(other) => {
                        return Err(ApiError::unsupported(
                            &format!("include[{i}]"),
                            &format!(
                                "`{other}` is not supported (only \
                                 `message.output_text.logprobs`)"
                            ),
                        ))
                    }
                    None => {
                        return Err(ApiError::invalid_type(format!("include[{i}]"), "a string"))
                    }
                }
            }
            on
        }
        Some(v) => {
            return Err(ApiError::invalid_type(
                "include",
                &format!("an array, got {}", type_name(v)),
            ))
        }
    };
    Ok(on.then_some(top.unwrap_or(0) as usize))
}

/// A `function_call` input item (a call a past response made).
fn function_call_item(mf: &Fields<'_>, at: &str) -> Result<super::HistoryCall, ApiError> {
    let s = |k: &str| {
        mf.string(k)
            .map_err(|_| ApiError::invalid_type(format!("{at}.{k}"), "a string"))?
            .map(str::to_string)
            .ok_or_else(|| ApiError::missing(&format!("{at}.{k}")))
    };
    let arguments = s("arguments")?;
    let arguments = serde_json::from_str(&arguments).map_err(|e| {
        ApiError::invalid_value(
            format!("{at}.arguments"),
            format!("the arguments are not JSON: {e}"),
        )
    })?;
    Ok(super::HistoryCall {
        id: s("call_id")?,
        name: s("name")?,
        arguments,
    })
}

/// Parses and validates a `/v1/responses` body: `input` (a string, or
/// messages as `{role, content}` items whose content is a string or
/// `input_text`/`output_text` parts), `instructions` (a system message
/// first), `max_output_tokens`, the sampling fields, `stream`, and
/// `text.format` (structured outputs). Nothing is stored, so what needs a
/// stored response or a tool is refused: `previous_response_id`,
/// `conversation`, `background`, tools.
pub fn parse_responses(body: &[u8]) -> Result<GenParams, ApiError> {
    let obj = parse_object(body)?;
    let f = Fields(&obj);
    for field in ["previous_response_id", "conversation"] {
        if f.get(field).is_some() {
            return Err(ApiError::unsupported(
                field,
                "this server stores no responses or conversations: send the whole \
                 conversation in `input`",
            ));
        }
    }
    if f.bool("background")?.unwrap_or(false) {
        return Err(ApiError::unsupported(
            "background",
            "background responses are not supported",
        ));
    }
    if f.get("n").is_some() {
        return Err(ApiError::unsupported(
            "n",
            "the Responses API has one output; ask /v1/chat/completions for `n` choices",
        ));
    }
    let mut msgs = Vec::new();
    let instructions = f.string("instructions")?.map(str::to_string);
    if let Some(s) = &instructions {
        msgs.push(Message::text("system", s.clone()));
    }
    match f.get("input") {
        None => return Err(ApiError::missing("input")),
        Some(Value::String(s)) => msgs.push(Message::text("user", s.clone())),
        Some(Value::Array(items)) => {
            if items.is_empty() {
                return Err(ApiError::invalid_value("input", "the input is empty"));
            }
            if items.len() > MESSAGES_MAX {
                return Err(ApiError::invalid_value(
                    "input",
                    format!("at most {MESSAGES_MAX} items"),
                ));
            }
            for (i, item) in items.iter().enumerate() {
                let at = format!("input[{i}]");
                let Value::Object(m) = item else {
                    return Err(ApiError::invalid_type(
                        at,
                        &format!("an object, got {}", type_name(item)),
                    ));
                };
                let mf = Fields(m);
                match mf
                    .string("type")
                    .map_err(|_| ApiError::invalid_type(format!("{at}.type"), "a string"))?
                {
                    None | Some("message") => {}
                    Some("function_call") => {
                        let call = function_call_item(&mf, &at)?;
                        // Calls of one turn: one assistant message.
                        match msgs.last_mut() {
                            Some(last) if last.role == "assistant" => last.tool_calls.push(call),
                            _ => msgs.push(Message {
                                role: "assistant".into(),
                                content: None,
                                tool_calls: vec![call],
                                tool_call_id: None,
                                name: None,
                            }),
                        }
                        continue;
                    }
                    Some("function_call_output") => {
                        let s = |k: &str| {
                            mf.string(k)
                                .map_err(|_| {
                                    ApiError::invalid_type(format!("{at}.{k}"), "a string")
                                })?
                                .map(str::to_string)
                                .ok_or_else(|| ApiError::missing(&format!("{at}.{k}")))
                        };
                        msgs.push(Message {
                            role: "tool".into(),
                            content: Some(s("output")?),
                            tool_calls: Vec::new(),
                            tool_call_id: Some(s("call_id")?),
                            name: None,
                        });
                        continue;
                    }
                    // A past turn's thought: dropped, as chat templates drop
                    // past thoughts.
                    Some("reasoning") => continue,
                    Some(ty) => {
                        return Err(ApiError::unsupported(
                            &format!("{at}.type"),
                            &format!(
                                "input items of type `{ty}` are not supported (messages, \
                                 function_call, function_call_output, reasoning)"
                            ),
                        ))
                    }
                }
                let role = mf
                    .string("role")
                    .map_err(|_| ApiError::invalid_type(format!("{at}.role"), "a string"))?
                    .ok_or_else(|| ApiError::missing(&format!("{at}.role")))?;
                let role = match role {
                    "user" | "assistant" | "system" => role,
                    "developer" => "system",
                    other => {
                        return Err(ApiError::invalid_value(
                            format!("{at}.role"),
                            format!("`{other}` is not one of user, assistant, system, developer"),
                        ))
                    }
                };
                let content = parse_content(mf.get("content"), &format!("{at}.content"))?;
                msgs.push(Message::text(role, content));
            }
        }
        Some(v) => {
            return Err(ApiError::invalid_type(
                "input",
                &format!("a string or an array of messages, got {}", type_name(v)),
            ))
        }
    }
    if msgs.is_empty() {
        return Err(ApiError::invalid_value(
            "input",
            "the input has no message, call or call output",
        ));
    }
    // The Responses API's function tools are flat (`{"type": "function",
    // "name", "parameters", …}`, `tool_choice: {"type": "function",
    // "name"}`): read as chat's, through the same parser.
    let mut obj = obj.clone();
    if let Some(Value::Array(tools)) = obj.get("tools").cloned() {
        let chat_tools: Vec<Value> = tools
            .iter()
            .map(|t| match t {
                Value::Object(m) if m.get("type").and_then(Value::as_str) == Some("function") => {
                    let mut func = m.clone();
                    func.remove("type");
                    json!({"type": "function", "function": func})
                }
                other => other.clone(),
            })
            .collect();
        obj.insert("tools".into(), Value::Array(chat_tools));
    }
    if let Some(Value::Object(c)) = obj.get("tool_choice").cloned() {
        if let (Some("function"), Some(n)) = (c.get("type").and_then(Value::as_str), c.get("name"))
        {
            obj.insert(
                "tool_choice".into(),
                json!({"type": "function", "function": {"name": n}}),
            );
        }
    }
    let f = Fields(&obj);
    let mut p = parse_common(&VARIANT, Input::Chat(msgs), &f)?;
    p.instructions = instructions;
    Ok(p)
}

// ---- shaping -----------------------------------------------------------------

/// What an output item is, in a stream.
#[derive(Clone, Debug, PartialEq)]
enum Kind {
    Reasoning,
    Message,
    /// A function call: its `call_id` and name.
    Call {
        call_id: String,
        name: String,
    },
}

/// One output item as the stream builds it.
#[derive(Clone, Debug)]
struct Item {
    kind: Kind,
    id: String,
    /// The thought, the message's text, or the call's arguments.
    text: String,
}

struct ResponseShaper {
    base: Base,
    logprobs: bool,
    /// What a response echoes of its request.
    temperature: f32,
    top_p: f32,
    max_tokens: Option<usize>,
    instructions: Option<String>,
    /// `text.format` as the request gave it.
    format: Value,
    /// `tools`, `tool_choice` and `parallel_tool_calls` as the response
    /// echoes them.
    tools: Value,
    tool_choice: Value,
    parallel: bool,
    /// The `sequence_number` of the next stream event.
    seq: u64,
    /// The message's tokens (with log-probabilities, when asked for).
    tokens: Vec<TokenEvent>,
    /// The thought split off (a reasoning format) and the calls parsed
    /// (active tools).
    reasoning: Option<bool>,
    calls: Option<tools::Format>,
    parser: tools::OutputParser,
    /// The output items so far; the last may be open.
    items: Vec<Item>,
    open: bool,
}

/// An f32 as JSON shows the decimal the client sent (0.7, not
/// 0.699999988079071): its shortest round-trip text, read as f64.
fn shown_f32(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

/// A finished response's status: `incomplete` when it ran out of
/// `max_output_tokens`.
fn response_status(d: &DoneEvent) -> &'static str {
    match d.finish {
        request::FinishReason::Length => "incomplete",
        request::FinishReason::Stop => "completed",
    }
}

impl ResponseShaper {
    fn suffix(&self) -> &str {
        self.base.id.trim_start_matches("resp_")
    }

    /// One stream event: `event:` names it, `data:` carries it with its
    /// `type` and `sequence_number`.
    fn event(&mut self, ty: &str, mut v: Value) -> Vec<u8> {
        v["type"] = Value::from(ty);
        v["sequence_number"] = Value::from(self.seq);
        self.seq += 1;
        let mut out = format!("event: {ty}\n").into_bytes();
        out.extend(sse(&v));
        out
    }

    /// An item as `response.output_item.added` shows it (nothing yet).
    fn item_added(&self, item: &Item) -> Value {
        match &item.kind {
            Kind::Reasoning => json!({"type": "reasoning", "id": item.id, "status": "in_progress",
                                      "summary": [], "content": []}),
            Kind::Message => json!({"type": "message", "id": item.id, "status": "in_progress",
                                    "role": "assistant", "content": []}),
            Kind::Call { call_id, name } => json!({"type": "function_call", "id": item.id,
                "call_id": call_id, "name": name, "arguments": "", "status": "in_progress"}),
        }
    }

    /// An item finished.
    fn item_done(&self, item: &Item, status: &str) -> Value {
        match &item.kind {
            Kind::Reasoning => json!({"type": "reasoning", "id": item.id, "status": "completed",
                "summary": [], "content": [{"type": "reasoning_text", "text": item.text}],
                "encrypted_content": null}),
            Kind::Message => {
                let lp: Vec<TokenLogprob> = if self.logprobs {
                    self.tokens
                        .iter()
                        .map(|t| self.base.chat_logprob(t))
                        .collect()
                } else {
                    Vec::new()
                };
                json!({"type": "message", "id": item.id, "status": status, "role": "assistant",
                       "content": [{"type": "output_text", "text": item.text, "annotations": [],
                                    "logprobs": lp}]})
            }
            Kind::Call { call_id, name } => json!({"type": "function_call", "id": item.id,
                "call_id": call_id, "name": name, "arguments": item.text,
                "status": status}),
        }
    }

    /// Opens an item of `kind` (closing the open one) unless it is open.
    fn open(&mut self, kind: Kind, status: &str) -> Vec<u8> {
        let mut out = Vec::new();
        if self.open {
            let same = match (&self.items.last().expect("open").kind, &kind) {
                (Kind::Call { .. }, Kind::Call { .. }) => false,
                (a, b) => a == b,
            };
            if same {
                return out;
            }
            out.extend(self.close(status));
        }
        let id = match &kind {
            Kind::Reasoning => format!("rs_{}", self.suffix()),
            Kind::Message => format!("msg_{}", self.suffix()),
            Kind::Call { .. } => format!("fc_{}_{}", self.suffix(), self.items.len()),
        };
        let item = Item {
            kind,
            id,
            text: String::new(),
        };
        let index = self.items.len();
        let added = json!({"output_index": index, "item": self.item_added(&item)});
        out.extend(self.event("response.output_item.added", added));
        match &item.kind {
            Kind::Reasoning => {
                let part = json!({"item_id": item.id, "output_index": index, "content_index": 0,
                                  "part": {"type": "reasoning_text", "text": ""}});
                out.extend(self.event("response.content_part.added", part));
            }
            Kind::Message => {
                let part = json!({"item_id": item.id, "output_index": index, "content_index": 0,
                                  "part": {"type": "output_text", "text": "", "annotations": [],
                                           "logprobs": []}});
                out.extend(self.event("response.content_part.added", part));
            }
            Kind::Call { .. } => {}
        }
        self.items.push(item);
        self.open = true;
        out
    }

    /// Closes the open item: its done events.
    fn close(&mut self, status: &str) -> Vec<u8> {
        if !self.open {
            return Vec::new();
        }
        self.open = false;
        let index = self.items.len() - 1;
        let item = self.items[index].clone();
        let done = self.item_done(&item, status);
        let mut out = Vec::new();
        match &item.kind {
            Kind::Reasoning => {
                out.extend(self.event(
                    "response.reasoning_text.done",
                    json!({"item_id": item.id,
                    "output_index": index, "content_index": 0, "text": item.text}),
                ));
                out.extend(self.event(
                    "response.content_part.done",
                    json!({"item_id": item.id,
                    "output_index": index, "content_index": 0, "part": done["content"][0]}),
                ));
            }
            Kind::Message => {
                let part = done["content"][0].clone();
                out.extend(self.event(
                    "response.output_text.done",
                    json!({"item_id": item.id,
                    "output_index": index, "content_index": 0, "text": item.text,
                    "logprobs": part["logprobs"]}),
                ));
                out.extend(self.event(
                    "response.content_part.done",
                    json!({"item_id": item.id,
                    "output_index": index, "content_index": 0, "part": part}),
                ));
            }
            Kind::Call { name, .. } => {
                out.extend(self.event(
                    "response.function_call_arguments.done",
                    json!({"item_id": item.id, "output_index": index, "name": name,
                           "arguments": item.text}),
                ));
            }
        }
        out.extend(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": done}),
        ));
        out
    }

    /// The events of one piece of the output.
    fn piece(&mut self, p: tools::Piece, lp: &mut Vec<TokenLogprob>) -> Vec<u8> {
        let mut out = Vec::new();
        match p {
            tools::Piece::Reasoning(t) => {
                out.extend(self.open(Kind::Reasoning, "completed"));
                let (index, id) = (
                    self.items.len() - 1,
                    self.items.last().expect("open").id.clone(),
                );
                self.items[index].text.push_str(&t);
                out.extend(self.event(
                    "response.reasoning_text.delta",
                    json!({"item_id": id,
                    "output_index": index, "content_index": 0, "delta": t}),
                ));
            }
            tools::Piece::Content(t) => {
                out.extend(self.open(Kind::Message, "completed"));
                let (index, id) = (
                    self.items.len() - 1,
                    self.items.last().expect("open").id.clone(),
                );
                self.items[index].text.push_str(&t);
                out.extend(self.event(
                    "response.output_text.delta",
                    json!({"item_id": id,
                    "output_index": index, "content_index": 0, "delta": t,
                    "logprobs": std::mem::take(lp)}),
                ));
            }
            tools::Piece::CallBegin { name, .. } => {
                let call_id = super::chat::random_id("call_");
                out.extend(self.open(Kind::Call { call_id, name }, "completed"));
            }
            tools::Piece::CallArgs { text, .. } => {
                if self.open
                    && matches!(self.items.last().map(|i| &i.kind), Some(Kind::Call { .. }))
                {
                    let (index, id) = (
                        self.items.len() - 1,
                        self.items.last().expect("open").id.clone(),
                    );
                    self.items[index].text.push_str(&text);
                    out.extend(self.event(
                        "response.function_call_arguments.delta",
                        json!({"item_id": id, "output_index": index, "delta": text}),
                    ));
                }
            }
        }
        out
    }

    /// The response object: `in_progress` with no output yet, or the end
    /// with its output and usage.
    fn response_obj(&self, status: &str, output: Vec<Value>, done: Option<&DoneEvent>) -> Value {
        let thought = output
            .iter()
            .find(|i| i["type"] == "reasoning")
            .and_then(|i| i["content"][0]["text"].as_str())
            .unwrap_or("");
        let usage = done.map(|d| {
            let u = &d.usage;
            json!({"input_tokens": u.prompt_tokens,
                   "input_tokens_details": {"cached_tokens": u.cached_tokens},
                   "output_tokens": u.completion_tokens,
                   "output_tokens_details": {
                       "reasoning_tokens": self.reasoning_tokens(thought, u.completion_tokens)},
                   "total_tokens": u.prompt_tokens + u.completion_tokens})
        });
        let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
        json!({"id": self.base.id, "object": "response", "created_at": self.base.created,
               "status": status, "model": self.base.model(), "output": output, "usage": usage,
               "error": null, "incomplete_details": incomplete,
               "instructions": self.instructions, "max_output_tokens": self.max_tokens,
               "metadata": {}, "parallel_tool_calls": self.parallel,
               "temperature": shown_f32(self.temperature), "top_p": shown_f32(self.top_p),
               "tool_choice": self.tool_choice, "tools": self.tools,
               "text": {"format": self.format}, "truncation": "disabled",
               "store": false, "background": false, "previous_response_id": null,
               "reasoning": {"effort": null, "summary": null}})
    }

    /// Tokens of the thought (as the tokenizer encodes its text: the
    /// tags and a token split across the boundary are not counted).
    fn reasoning_tokens(&self, thought: &str, completion: usize) -> usize {
        match thought.is_empty() {
            true => 0,
            false => self
                .base
                .st
                .tokenizer
                .encode(thought, false)
                .map_or(0, |ids| ids.len())
                .min(completion),
        }
    }

    /// The items finished, a message always among them (empty when the
    /// answer had no text and made no call).
    fn finished_items(&self, status: &str) -> Vec<Value> {
        let mut out: Vec<Value> = self
            .items
            .iter()
            .map(|i| self.item_done(i, status))
            .collect();
        if !self.items.iter().any(|i| i.kind != Kind::Reasoning) {
            let empty = Item {
                kind: Kind::Message,
                id: format!("msg_{}", self.suffix()),
                text: String::new(),
            };
            out.push(self.item_done(&empty, status));
        }
        out
    }

    /// A text as the endpoint shows it: a format marker that is a control
    /// token (left out of the output's text) is shown to the call parser.
    fn visible<'a>(&'a self, t: &'a TokenEvent) -> &'a str {
        match self.calls {
            Some(_) => self.base.st.tool_markers.visible(t.id, &t.text),
            None => &t.text,
        }
    }
}

impl Shaper for ResponseShaper {
    fn start(&mut self) -> Option<Vec<u8>> {
        let created = json!({"response": self.response_obj("in_progress", vec![], None)});
        let mut out = self.event("response.created", created.clone());
        out.extend(self.event("response.in_progress", created));
        if self.reasoning.is_none() && self.calls.is_none() {
            // Nothing but the message can come: it opens now.
            out.extend(self.open(Kind::Message, "completed"));
        }
        Some(out)
    }

    fn token(&mut self, index: usize, t: TokenEvent) -> Vec<u8> {
        debug_assert_eq!(index, 0, "one choice a response");
        let mut lp: Vec<TokenLogprob> = self
            .logprobs
            .then(|| self.base.chat_logprob(&t))
            .into_iter()
            .collect();
        let text = self.visible(&t).to_string();
        let pieces = self.parser.push(&text);
        let mut out = Vec::new();
        for p in pieces {
            out.extend(self.piece(p, &mut lp));
        }
        if self.logprobs {
            self.tokens.push(t);
        }
        out
    }

    /// The held-back tail, then every item closed.
    fn finish_choice(&mut self, _index: usize, d: &DoneEvent) -> Vec<u8> {
        let status = response_status(d);
        let mut pieces = self.parser.push(&d.tail_text);
        pieces.extend(self.parser.finish());
        let mut out = Vec::new();
        let mut lp = Vec::new();
        for p in pieces {
            out.extend(self.piece(p, &mut lp));
        }
        // An answer with no text and no call still has its (empty) message.
        if !self.items.iter().any(|i| i.kind != Kind::Reasoning) {
            out.extend(self.open(Kind::Message, status));
        }
        out.extend(self.close(status));
        out
    }

    /// `response.completed` (or `.incomplete`) with the whole response.
    fn end(&mut self, all: &DoneEvent) -> Vec<u8> {
        let status = response_status(all);
        let output = self.finished_items(status);
        let response = json!({"response": self.response_obj(status, output, Some(all))});
        self.event(&format!("response.{status}"), response)
    }

    /// `response.failed`, the error in the response.
    fn error(&mut self, e: &ApiError) -> Vec<u8> {
        let mut r = self.response_obj("failed", vec![], None);
        r["error"] = json!({"code": e.code.unwrap_or(e.kind), "message": e.message});
        self.event("response.failed", json!({"response": r}))
    }

    fn full(&mut self, choices: Vec<Choice>, all: &DoneEvent) -> Response {
        let first = &choices[0];
        self.tokens = first.tokens.clone();
        let mut p = tools::OutputParser::new(self.reasoning, self.calls);
        let mut pieces = p.push(&first.text);
        pieces.extend(p.finish());
        // The same items a stream builds, without its events.
        let mut lp = Vec::new();
        for piece in pieces {
            let _ = self.piece(piece, &mut lp);
        }
        self.open = false;
        let status = response_status(all);
        let output = self.finished_items(status);
        Json(self.response_obj(status, output, Some(all))).into_response()
    }
}
