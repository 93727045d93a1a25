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
    fn shaper(&self, base: Base, p: &GenParams, choices: usize) -> Box<dyn Shaper> {
        let base_reasoning = base.st.reasoning;
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
            seq: 0,
            texts: vec![String::new(); choices],
            tokens: vec![Vec::new(); choices],
            reasoning: (base_reasoning != tools::ReasoningFormat::None)
                .then(|| tools::ReasoningParser::new(p.reasoning_open)),
            reasoning_open: p.reasoning_open,
            thought: String::new(),
            rs_open: false,
            msg_index: None,
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
                    Some(ty) => {
                        return Err(ApiError::unsupported(
                            &format!("{at}.type"),
                            &format!(
                                "input items of type `{ty}` are not supported (only messages)"
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
    // The Responses API's function tools are flat (`{"type": "function",
    // "name": …}`): not served here yet, so refused rather than misread
    // as chat's.
    match f.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(_) => {
            return Err(ApiError::unsupported(
                "tools",
                "tools on /v1/responses are not served yet: use /v1/chat/completions",
            ))
        }
    }
    let mut p = parse_common(&VARIANT, Input::Chat(msgs), &f)?;
    p.instructions = instructions;
    Ok(p)
}

// ---- shaping -----------------------------------------------------------------

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
    /// The `sequence_number` of the next stream event.
    seq: u64,
    /// Text so far per choice, and its tokens (with log-probabilities,
    /// when asked for): the end repeats them.
    texts: Vec<String>,
    tokens: Vec<Vec<TokenEvent>>,
    /// With a reasoning format: the thought split from the answer (a
    /// `reasoning` output item before the message).
    reasoning: Option<tools::ReasoningParser>,
    reasoning_open: bool,
    /// The thought so far.
    thought: String,
    /// The stream opened the reasoning item and has not closed it.
    rs_open: bool,
    /// The message item's output index, once the stream opened it.
    msg_index: Option<usize>,
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
    /// The reasoning item's id.
    fn reasoning_id(&self) -> String {
        format!("rs_{}", self.base.id.trim_start_matches("resp_"))
    }

    /// A finished reasoning item.
    fn reasoning_item(&self, thought: &str) -> Value {
        json!({"type": "reasoning", "id": self.reasoning_id(), "status": "completed",
               "summary": [], "content": [{"type": "reasoning_text", "text": thought}],
               "encrypted_content": null})
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

    /// Opens the reasoning item in a stream (once).
    fn open_reasoning(&mut self) -> Vec<u8> {
        if self.rs_open || self.msg_index.is_some() {
            return Vec::new();
        }
        self.rs_open = true;
        let item = json!({"output_index": 0, "item": {
            "type": "reasoning", "id": self.reasoning_id(), "status": "in_progress",
            "summary": [], "content": []}});
        let mut out = self.event("response.output_item.added", item);
        let part = json!({"item_id": self.reasoning_id(), "output_index": 0, "content_index": 0,
                          "part": {"type": "reasoning_text", "text": ""}});
        out.extend(self.event("response.content_part.added", part));
        out
    }

    /// Closes the reasoning item (if open) and opens the message item
    /// (once): the message follows the thought.
    fn open_message(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        if self.msg_index.is_some() {
            return out;
        }
        let index = usize::from(self.rs_open);
        if self.rs_open {
            self.rs_open = false;
            let id = self.reasoning_id();
            let thought = self.thought.clone();
            out.extend(self.event(
                "response.reasoning_text.done",
                json!({"item_id": id, "output_index": 0, "content_index": 0, "text": thought}),
            ));
            out.extend(self.event(
                "response.content_part.done",
                json!({"item_id": id, "output_index": 0, "content_index": 0,
                       "part": {"type": "reasoning_text", "text": thought}}),
            ));
            let item = self.reasoning_item(&thought);
            out.extend(self.event(
                "response.output_item.done",
                json!({"output_index": 0, "item": item}),
            ));
        }
        self.msg_index = Some(index);
        let item = json!({"output_index": index, "item": {
            "type": "message", "id": self.message_id(), "status": "in_progress",
            "role": "assistant", "content": []}});
        out.extend(self.event("response.output_item.added", item));
        let part = json!({"item_id": self.message_id(), "output_index": index, "content_index": 0,
                          "part": {"type": "output_text", "text": "", "annotations": [],
                                   "logprobs": []}});
        out.extend(self.event("response.content_part.added", part));
        out
    }

    /// The events of `text` (choice 0's), its log-probabilities with the
    /// answer's first piece.
    fn pieces(&mut self, text: &str, last: bool, mut lp: Vec<TokenLogprob>) -> Vec<u8> {
        let splits = match &mut self.reasoning {
            Some(r) => {
                let mut s = r.push(text);
                if last {
                    s.extend(r.finish());
                }
                s
            }
            None if text.is_empty() => Vec::new(),
            None => vec![tools::Split::Content(text.to_string())],
        };
        let mut out = Vec::new();
        for s in splits {
            match s {
                tools::Split::Reasoning(t) => {
                    out.extend(self.open_reasoning());
                    self.thought.push_str(&t);
                    let d = json!({"item_id": self.reasoning_id(), "output_index": 0,
                                   "content_index": 0, "delta": t});
                    out.extend(self.event("response.reasoning_text.delta", d));
                }
                tools::Split::Content(t) => {
                    out.extend(self.open_message());
                    self.texts[0].push_str(&t);
                    let d = json!({"item_id": self.message_id(),
                                   "output_index": self.msg_index.unwrap_or(0),
                                   "content_index": 0, "delta": t,
                                   "logprobs": std::mem::take(&mut lp)});
                    out.extend(self.event("response.output_text.delta", d));
                }
            }
        }
        out
    }

    /// The thought and answer of a whole text (no stream).
    fn split_whole(&self, text: &str) -> (String, String) {
        let Some(_) = &self.reasoning else {
            return (String::new(), text.to_string());
        };
        let mut r = tools::ReasoningParser::new(self.reasoning_open);
        let mut s = r.push(text);
        s.extend(r.finish());
        let (mut th, mut c) = (String::new(), String::new());
        for x in s {
            match x {
                tools::Split::Reasoning(t) => th.push_str(&t),
                tools::Split::Content(t) => c.push_str(&t),
            }
        }
        (th, c)
    }

    /// The output message's id: the response's, renamed.
    fn message_id(&self) -> String {
        format!("msg_{}", self.base.id.trim_start_matches("resp_"))
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

    /// The output message of a finished choice.
    fn message_item(&self, d: &DoneEvent, text: &str, logprobs: &[TokenEvent]) -> Value {
        let lp: Vec<TokenLogprob> = if self.logprobs {
            logprobs.iter().map(|t| self.base.chat_logprob(t)).collect()
        } else {
            Vec::new()
        };
        json!({"type": "message", "id": self.message_id(), "status": response_status(d),
               "role": "assistant",
               "content": [{"type": "output_text", "text": text, "annotations": [],
                            "logprobs": lp}]})
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
               "metadata": {}, "parallel_tool_calls": false,
               "temperature": shown_f32(self.temperature), "top_p": shown_f32(self.top_p),
               "tool_choice": "none", "tools": [],
               "text": {"format": self.format}, "truncation": "disabled",
               "store": false, "background": false, "previous_response_id": null,
               "reasoning": {"effort": null, "summary": null}})
    }
}

impl Shaper for ResponseShaper {
    fn start(&mut self) -> Option<Vec<u8>> {
        let created = json!({"response": self.response_obj("in_progress", vec![], None)});
        let mut out = self.event("response.created", created.clone());
        out.extend(self.event("response.in_progress", created));
        if self.reasoning.is_none() {
            // No thought can come first: the message opens now.
            out.extend(self.open_message());
        }
        Some(out)
    }

    fn token(&mut self, index: usize, t: TokenEvent) -> Vec<u8> {
        debug_assert_eq!(index, 0, "one choice a response");
        let lp: Vec<TokenLogprob> = self
            .logprobs
            .then(|| self.base.chat_logprob(&t))
            .into_iter()
            .collect();
        let out = self.pieces(&t.text, false, lp);
        if self.logprobs {
            self.tokens[index].push(t);
        }
        out
    }

    /// The held-back tail, then the text, part and item done.
    fn finish_choice(&mut self, index: usize, d: &DoneEvent) -> Vec<u8> {
        let mut out = self.pieces(&d.tail_text, true, Vec::new());
        // An answer with no text still has its (empty) message.
        out.extend(self.open_message());
        let msg_index = self.msg_index.unwrap_or(0);
        let text = &self.texts[index];
        let item = self.message_item(d, text, &self.tokens[index]);
        let part = item["content"][0].clone();
        let text_done = json!({"item_id": self.message_id(), "output_index": msg_index,
                               "content_index": 0, "text": text,
                               "logprobs": part["logprobs"]});
        let part_done = json!({"item_id": self.message_id(), "output_index": msg_index,
                               "content_index": 0, "part": part});
        out.extend(self.event("response.output_text.done", text_done));
        out.extend(self.event("response.content_part.done", part_done));
        out.extend(self.event(
            "response.output_item.done",
            json!({"output_index": msg_index, "item": item}),
        ));
        out
    }

    /// `response.completed` (or `.incomplete`) with the whole response.
    fn end(&mut self, all: &DoneEvent) -> Vec<u8> {
        let status = response_status(all);
        let mut output = Vec::new();
        if !self.thought.is_empty() {
            output.push(self.reasoning_item(&self.thought));
        }
        output.push(self.message_item(all, &self.texts[0], &self.tokens[0]));
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
        let (thought, text) = self.split_whole(&first.text);
        let mut output = Vec::new();
        if !thought.is_empty() {
            output.push(self.reasoning_item(&thought));
        }
        output.push(self.message_item(&first.done, &text, &first.tokens));
        Json(self.response_obj(response_status(all), output, Some(all))).into_response()
    }
}
