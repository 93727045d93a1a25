//! `POST /v1/chat/completions`: messages in, through the model's chat
//! template; `chat.completion` out, or `chat.completion.chunk` events.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use request::{DoneEvent, TokenEvent};
use serde::{Deserialize, Serialize};
use tools::{CallParser, Event, ReasoningFormat, ReasoningParser, Split};

use super::fields::{self, parse_common, parse_messages, parse_object, Fields, Variant};
use super::{
    sse, Base, Choice, GenParams, Generate, Input, Shaper, TokenLogprob, Usage, SSE_DONE,
    TOP_LOGPROBS_MAX,
};
use crate::error::ApiError;
use crate::state::AppState;

pub(crate) async fn handle(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    crate::http::generate(st, &Chat, headers, body).await
}

/// The endpoint.
pub(crate) struct Chat;

impl Generate for Chat {
    fn name(&self) -> &'static str {
        "chat"
    }
    fn id_prefix(&self) -> &'static str {
        "chatcmpl-"
    }
    fn prompt_param(&self) -> &'static str {
        "messages"
    }
    fn logprobs_param(&self) -> &'static str {
        "top_logprobs"
    }
    fn parse(&self, body: &[u8]) -> Result<GenParams, ApiError> {
        parse_chat(body)
    }
    fn shaper(&self, base: Base, p: &GenParams, choices: usize) -> Box<dyn Shaper> {
        let format = base.st.tool_format;
        let calls = p.tools.as_ref().filter(|t| t.set.active()).map(|t| Calls {
            legacy: t.legacy,
            format,
            parsers: (0..choices).map(|_| CallParser::new(format)).collect(),
        });
        let reasoning = (base.st.reasoning != ReasoningFormat::None).then(|| {
            (0..choices)
                .map(|_| ReasoningParser::new(p.reasoning_open))
                .collect()
        });
        Box::new(ChatShaper {
            base,
            choices,
            include_usage: p.include_usage,
            logprobs: p.logprobs.is_some(),
            reasoning_open: p.reasoning_open,
            reasoning,
            calls,
        })
    }
}

const VARIANT: Variant = Variant {
    max_tokens: fields::max_tokens,
    logprobs,
    structured: super::structured::parse,
    chat_template: true,
};

/// `logprobs: true`, with `top_logprobs` alternatives.
fn logprobs(f: &Fields<'_>) -> Result<Option<usize>, ApiError> {
    let on = f.bool("logprobs")?.unwrap_or(false);
    let top = f.int_in("top_logprobs", 0, TOP_LOGPROBS_MAX as i64)?;
    if top.is_some() && !on {
        return Err(ApiError::invalid_value(
            "top_logprobs",
            "requires `logprobs` to be true",
        ));
    }
    Ok(on.then_some(top.unwrap_or(0) as usize))
}

/// Parses and validates a `/v1/chat/completions` body.
pub fn parse_chat(body: &[u8]) -> Result<GenParams, ApiError> {
    let obj = parse_object(body)?;
    let f = Fields(&obj);
    let out = parse_messages(&f)?;
    let mut p = parse_common(&VARIANT, Input::Chat(out), &f)?;
    p.prediction = parse_prediction(&f, &p)?;
    Ok(p)
}

/// Most bytes of `prediction.content`: far more than a window of output.
pub const PREDICTION_BYTES_MAX: usize = 1 << 20;

/// `prediction` (Predicted Outputs): `{"type": "content", "content": …}`,
/// the content a string or an array of text parts (joined). Refused where
/// OpenAI refuses it — with `n` above 1, `logprobs` or `tools` — and beside
/// an output format, whose grammar is followed one token at a time (the
/// prediction would go unused, and a field the server does not honour is
/// refused).
fn parse_prediction(f: &Fields<'_>, p: &GenParams) -> Result<Option<String>, ApiError> {
    const P: &str = "prediction";
    let m = match f.get(P) {
        None => return Ok(None),
        Some(serde_json::Value::Object(m)) => m,
        Some(v) => {
            return Err(ApiError::invalid_type(
                P,
                &format!("an object, got {}", fields::type_name(v)),
            ))
        }
    };
    let pf = Fields(m);
    match pf.string("type") {
        Ok(Some("content")) => {}
        Ok(Some(t)) => {
            return Err(ApiError::invalid_value(
                "prediction.type",
                format!("'{t}': the supported type is 'content'"),
            ))
        }
        Ok(None) => return Err(ApiError::missing("prediction.type")),
        Err(_) => return Err(ApiError::invalid_type("prediction.type", "a string")),
    }
    let text = match pf.get("content") {
        None => return Err(ApiError::missing("prediction.content")),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Array(parts)) => {
            if parts.len() > super::CONTENT_PARTS_MAX {
                return Err(ApiError::invalid_value(
                    "prediction.content",
                    format!(
                        "at most {} parts, got {}",
                        super::CONTENT_PARTS_MAX,
                        parts.len()
                    ),
                ));
            }
            let mut text = String::new();
            for (i, part) in parts.iter().enumerate() {
                let at = format!("prediction.content[{i}]");
                let serde_json::Value::Object(pm) = part else {
                    return Err(ApiError::invalid_type(
                        at,
                        &format!("an object, got {}", fields::type_name(part)),
                    ));
                };
                let pf = Fields(pm);
                match pf.get("type") {
                    Some(serde_json::Value::String(t)) if t == "text" => {}
                    Some(_) => {
                        return Err(ApiError::invalid_value(
                            format!("{at}.type"),
                            "a prediction's parts are text: 'text'",
                        ))
                    }
                    None => return Err(ApiError::missing(&format!("{at}.type"))),
                }
                match pf.get("text") {
                    Some(serde_json::Value::String(t)) => text.push_str(t),
                    Some(v) => {
                        return Err(ApiError::invalid_type(
                            format!("{at}.text"),
                            &format!("a string, got {}", fields::type_name(v)),
                        ))
                    }
                    None => return Err(ApiError::missing(&format!("{at}.text"))),
                }
            }
            text
        }
        Some(v) => {
            return Err(ApiError::invalid_type(
                "prediction.content",
                &format!(
                    "a string or an array of text parts, got {}",
                    fields::type_name(v)
                ),
            ))
        }
    };
    if text.len() > PREDICTION_BYTES_MAX {
        return Err(ApiError::invalid_value(
            "prediction.content",
            format!("{} bytes: at most {PREDICTION_BYTES_MAX}", text.len()),
        ));
    }
    let with = "is not supported with predicted outputs.";
    if p.n > 1 {
        return Err(ApiError::unsupported_parameter(
            "n",
            &format!("greater than 1 {with}"),
        ));
    }
    if p.logprobs.is_some() {
        return Err(ApiError::unsupported_parameter("logprobs", with));
    }
    if p.tools.is_some() {
        return Err(ApiError::unsupported_parameter("tools", with));
    }
    if let Some(s) = &p.structured {
        return Err(ApiError::unsupported_parameter(s.param, with));
    }
    Ok(Some(text))
}

// ---- shapes -------------------------------------------------------------------

/// A chat message in a response. `content` is `null` when the turn only
/// calls tools.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessageOut {
    pub role: String,
    pub content: Option<String>,
    /// A thinking model's reasoning (`<think>…</think>`), split from the
    /// content: vLLM's `reasoning_content`, and its newer name.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub tool_calls: Option<Vec<ToolCallOut>>,
    /// The legacy `functions`' answer: the (one) call.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub function_call: Option<FunctionOut>,
}

/// A call the model made.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionOut,
}

/// A called function: its name and its arguments' JSON text.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FunctionOut {
    pub name: String,
    pub arguments: String,
}

/// A piece of a call in a stream: the first has its id, type and name
/// (arguments `""`), the rest more of the arguments.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none", default)]
    pub kind: Option<String>,
    pub function: FunctionDelta,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub arguments: Option<String>,
}

/// `choices[].logprobs` of chat.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessageOut,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
}

/// `chat.completion`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

/// `delta` of a chat chunk.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub role: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub reasoning: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub function_call: Option<FunctionDelta>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: Delta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
}

/// `chat.completion.chunk`. `usage` is absent unless the client asked for
/// it (`stream_options.include_usage`); then it is `null` on every chunk
/// but the last.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub usage: Option<Option<Usage>>,
}

// ---- shaping -----------------------------------------------------------------

struct ChatShaper {
    base: Base,
    choices: usize,
    include_usage: bool,
    logprobs: bool,
    /// The prompt left a thought open.
    reasoning_open: bool,
    /// With a reasoning format: each choice's thought split off first.
    reasoning: Option<Vec<ReasoningParser>>,
    /// With active tools: each choice's output parsed for calls.
    calls: Option<Calls>,
}

impl ChatShaper {
    /// The deltas `text` of choice `index` makes: reasoning split off, the
    /// content through the call parser; `last`: the choice ended.
    fn deltas(&mut self, index: usize, text: &str, last: bool) -> Vec<Delta> {
        let splits = match &mut self.reasoning {
            Some(r) => {
                let mut s = r[index].push(text);
                if last {
                    s.extend(r[index].finish());
                }
                s
            }
            None if text.is_empty() => Vec::new(),
            None => vec![Split::Content(text.to_string())],
        };
        let mut out = Vec::new();
        for s in splits {
            match s {
                Split::Reasoning(t) => out.push(Delta {
                    reasoning_content: Some(t.clone()),
                    reasoning: Some(t),
                    ..Delta::default()
                }),
                Split::Content(t) => match &mut self.calls {
                    Some(c) => {
                        let ev = c.parsers[index].push(&t);
                        out.extend(c.deltas(ev));
                    }
                    None => out.push(Delta {
                        content: Some(t),
                        ..Delta::default()
                    }),
                },
            }
        }
        if last {
            if let Some(c) = &mut self.calls {
                let ev = c.parsers[index].finish();
                out.extend(c.deltas(ev));
            }
        }
        out
    }
}

/// The calls of each choice.
struct Calls {
    /// Answer in the legacy `function_call` shape.
    legacy: bool,
    format: tools::Format,
    parsers: Vec<CallParser>,
}

/// A call id as OpenAI's look (`call_` and 24 random characters), or as
/// the format's templates want it (Mistral's: 9 letters and digits, which
/// the client sends back in the history).
fn call_id(format: tools::Format) -> String {
    match format.call_id_len() {
        Some(n) => random_chars("", n),
        None => random_id("call_"),
    }
}

/// `prefix` and 24 random letters and digits (OpenAI's `call_…`,
/// Anthropic's `toolu_…`).
pub(crate) fn random_id(prefix: &str) -> String {
    random_chars(prefix, 24)
}

fn random_chars(prefix: &str, n: usize) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut s = String::from(prefix);
    let mut r = crate::http::random_u64();
    for i in 0..n {
        if i % 10 == 9 {
            r = crate::http::random_u64();
        }
        s.push(ALPHABET[(r % ALPHABET.len() as u64) as usize] as char);
        r /= ALPHABET.len() as u64;
    }
    s
}

impl Calls {
    /// Stream deltas of one choice's `events`.
    fn deltas(&mut self, events: Vec<Event>) -> Vec<Delta> {
        let legacy = self.legacy;
        events
            .into_iter()
            .map(|e| match e {
                Event::Content(text) => Delta {
                    content: Some(text),
                    ..Delta::default()
                },
                Event::Begin { index: k, name } => {
                    let id = call_id(self.format);
                    let function = FunctionDelta {
                        name: Some(name),
                        arguments: Some(String::new()),
                    };
                    match legacy {
                        true => Delta {
                            function_call: Some(function),
                            ..Delta::default()
                        },
                        false => Delta {
                            tool_calls: Some(vec![ToolCallDelta {
                                index: k,
                                id: Some(id),
                                kind: Some("function".into()),
                                function,
                            }]),
                            ..Delta::default()
                        },
                    }
                }
                Event::Args { index: k, text } => {
                    let function = FunctionDelta {
                        name: None,
                        arguments: Some(text),
                    };
                    match legacy {
                        true => Delta {
                            function_call: Some(function),
                            ..Delta::default()
                        },
                        false => Delta {
                            tool_calls: Some(vec![ToolCallDelta {
                                index: k,
                                id: None,
                                kind: None,
                                function,
                            }]),
                            ..Delta::default()
                        },
                    }
                }
            })
            .collect()
    }

    /// The finish reason: a choice that called and stopped says so.
    fn finish<'a>(&self, index: usize, reason: &'a str) -> &'a str {
        if reason == "stop" && !self.parsers[index].calls().is_empty() {
            if self.legacy {
                "function_call"
            } else {
                "tool_calls"
            }
        } else {
            reason
        }
    }
}

impl ChatShaper {
    fn chunk(
        &self,
        index: usize,
        delta: Delta,
        lp: Option<ChatLogprobs>,
        finish: Option<&str>,
    ) -> Vec<u8> {
        sse(&ChatChunk {
            id: self.base.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.base.created,
            model: self.base.model(),
            choices: vec![ChatChunkChoice {
                index,
                delta,
                logprobs: lp,
                finish_reason: finish.map(str::to_string),
            }],
            usage: self.include_usage.then_some(None),
        })
    }
}

impl Shaper for ChatShaper {
    /// The assistant's role, once per choice.
    fn start(&mut self) -> Option<Vec<u8>> {
        Some(
            (0..self.choices)
                .flat_map(|i| {
                    self.chunk(
                        i,
                        Delta {
                            role: Some("assistant".into()),
                            content: Some(String::new()),
                            ..Delta::default()
                        },
                        None,
                        None,
                    )
                })
                .collect(),
        )
    }

    fn token(&mut self, index: usize, t: TokenEvent) -> Vec<u8> {
        let mut lp = self.logprobs.then(|| ChatLogprobs {
            content: vec![self.base.chat_logprob(&t)],
        });
        if self.calls.is_none() && self.reasoning.is_none() {
            return self.chunk(
                index,
                Delta {
                    content: Some(t.text),
                    ..Delta::default()
                },
                lp,
                None,
            );
        }
        // A format marker that is a control token is left out of the
        // output's text: the call parser still needs to see it.
        let text = match &self.calls {
            Some(_) => self.base.st.tool_markers.visible(t.id, &t.text).to_string(),
            None => t.text.clone(),
        };
        let mut out = Vec::new();
        for d in self.deltas(index, &text, false) {
            out.extend(self.chunk(index, d, lp.take(), None));
        }
        if lp.is_some() {
            // The token's text is held back (a possible marker): its
            // log-probability still goes out, with an empty delta.
            out.extend(self.chunk(index, Delta::default(), lp, None));
        }
        out
    }

    fn finish_choice(&mut self, index: usize, d: &DoneEvent) -> Vec<u8> {
        let mut out = Vec::new();
        let mut reason = d.finish.as_openai();
        for delta in self.deltas(index, &d.tail_text, true) {
            out.extend(self.chunk(index, delta, None, None));
        }
        if let Some(calls) = &self.calls {
            reason = calls.finish(index, reason);
        }
        out.extend(self.chunk(index, Delta::default(), None, Some(reason)));
        out
    }

    /// The usage chunk (if asked for), then `[DONE]`.
    fn end(&mut self, all: &DoneEvent) -> Vec<u8> {
        let mut out = match self.include_usage {
            false => Vec::new(),
            true => sse(&ChatChunk {
                id: self.base.id.clone(),
                object: "chat.completion.chunk".into(),
                created: self.base.created,
                model: self.base.model(),
                choices: Vec::new(),
                usage: Some(Some(Usage::of(&all.usage))),
            }),
        };
        out.extend_from_slice(SSE_DONE);
        out
    }

    fn full(&mut self, choices: Vec<Choice>, all: &DoneEvent) -> Response {
        let format = self.base.st.tool_format;
        let legacy = self.calls.as_ref().map(|c| c.legacy);
        let split_reasoning = self.reasoning.is_some();
        let opened = self.reasoning_open;
        let choices = choices
            .into_iter()
            .enumerate()
            .map(|(index, mut c)| {
                let reason = c.done.finish.as_openai();
                // The same splitter a stream uses, over the whole text.
                let mut thought = None;
                if split_reasoning {
                    let mut r = ReasoningParser::new(opened);
                    let mut s = r.push(&c.text);
                    s.extend(r.finish());
                    let (mut rs, mut cs) = (String::new(), String::new());
                    for x in s {
                        match x {
                            Split::Reasoning(t) => rs.push_str(&t),
                            Split::Content(t) => cs.push_str(&t),
                        }
                    }
                    thought = Some(rs);
                    c.text = cs;
                }
                let mut message = match legacy {
                    None => ChatMessageOut {
                        role: "assistant".into(),
                        content: Some(c.text.clone()),
                        reasoning_content: None,
                        reasoning: None,
                        tool_calls: None,
                        function_call: None,
                    },
                    Some(legacy) => {
                        // The same parser a stream uses, over the whole text.
                        let mut p = CallParser::new(format);
                        let mut events = p.push(&c.text);
                        events.extend(p.finish());
                        let content: String = events
                            .iter()
                            .filter_map(|e| match e {
                                Event::Content(t) => Some(t.as_str()),
                                _ => None,
                            })
                            .collect();
                        let calls: Vec<ToolCallOut> = p
                            .calls()
                            .iter()
                            .map(|k| ToolCallOut {
                                id: call_id(format),
                                kind: "function".into(),
                                function: FunctionOut {
                                    name: k.name.clone(),
                                    arguments: k.arguments.clone(),
                                },
                            })
                            .collect();
                        let content = match (content.is_empty(), calls.is_empty()) {
                            (true, false) => None,
                            _ => Some(content),
                        };
                        match (legacy, calls.is_empty()) {
                            (_, true) => ChatMessageOut {
                                role: "assistant".into(),
                                content,
                                reasoning_content: None,
                                reasoning: None,
                                tool_calls: None,
                                function_call: None,
                            },
                            (true, false) => ChatMessageOut {
                                role: "assistant".into(),
                                content,
                                reasoning_content: None,
                                reasoning: None,
                                tool_calls: None,
                                function_call: calls.into_iter().next().map(|c| c.function),
                            },
                            (false, false) => ChatMessageOut {
                                role: "assistant".into(),
                                content,
                                reasoning_content: None,
                                reasoning: None,
                                tool_calls: Some(calls),
                                function_call: None,
                            },
                        }
                    }
                };
                if let Some(r) = thought.filter(|r| !r.is_empty()) {
                    message.reasoning_content = Some(r.clone());
                    message.reasoning = Some(r);
                }
                let called = message.tool_calls.is_some() || message.function_call.is_some();
                let finish = match (called, reason, legacy) {
                    (true, "stop", Some(true)) => "function_call",
                    (true, "stop", _) => "tool_calls",
                    _ => reason,
                };
                ChatChoice {
                    index,
                    message,
                    logprobs: self.logprobs.then(|| ChatLogprobs {
                        content: c.tokens.iter().map(|t| self.base.chat_logprob(t)).collect(),
                    }),
                    finish_reason: Some(finish.to_string()),
                }
            })
            .collect();
        Json(ChatCompletion {
            id: self.base.id.clone(),
            object: "chat.completion".into(),
            created: self.base.created,
            model: self.base.model(),
            choices,
            usage: Usage::of(&all.usage),
        })
        .into_response()
    }
}
