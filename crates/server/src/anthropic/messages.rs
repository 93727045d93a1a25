//! `POST /v1/messages`: Anthropic's Messages API. The body is translated
//! into the chat request it means and checked by chat's parser
//! ([`super::to_chat`]); the answer is a `message` with content blocks
//! (`thinking`, `text`, `tool_use`), or Anthropic's event stream
//! (`message_start`, `content_block_start`/`_delta`/`_stop` per block,
//! `message_delta` with the stop reason and usage, `message_stop`).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use request::{DoneEvent, FinishReason, TokenEvent};
use serde_json::{json, Value};
use tools::{OutputParser, Piece, ReasoningFormat};

use crate::error::ApiError;
use crate::openai::chat::random_id;
use crate::openai::{Base, Choice, GenParams, Generate, Shaper};
use crate::state::AppState;

pub(crate) async fn handle(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    crate::http::generate(st, &Messages, headers, body).await
}

/// The endpoint.
pub(crate) struct Messages;

impl Generate for Messages {
    fn name(&self) -> &'static str {
        "messages"
    }
    fn id_prefix(&self) -> &'static str {
        "msg_"
    }
    fn prompt_param(&self) -> &'static str {
        "messages"
    }
    fn logprobs_param(&self) -> &'static str {
        "logprobs"
    }
    fn parse(&self, body: &[u8]) -> Result<GenParams, ApiError> {
        let chat = super::to_chat(body, false)?;
        crate::openai::chat::parse_chat(chat.to_string().as_bytes())
    }
    fn shaper(&self, base: Base, p: &GenParams, _choices: usize) -> Box<dyn Shaper> {
        let reasoning = (base.st.reasoning != ReasoningFormat::None).then_some(p.reasoning_open);
        let calls = p
            .tools
            .as_ref()
            .filter(|t| t.set.active())
            .map(|_| base.st.tool_format);
        Box::new(MessagesShaper {
            base,
            prompt_tokens: p.prompt_tokens,
            stops: p.stop.clone(),
            parser: OutputParser::new(reasoning, calls),
            reasoning,
            calls,
            open: None,
            blocks: 0,
        })
    }
    fn error_response(&self, e: ApiError) -> Response {
        super::error_response(e)
    }
}

/// The kind of content block a stream has open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Block {
    Thinking,
    Text,
    /// Call `n` of the answer.
    ToolUse(usize),
}

struct MessagesShaper {
    base: Base,
    prompt_tokens: usize,
    /// `stop_sequences`, to name the one that matched.
    stops: Vec<String>,
    parser: OutputParser,
    reasoning: Option<bool>,
    calls: Option<tools::Format>,
    /// The open block and its index.
    open: Option<(Block, usize)>,
    /// Blocks started so far.
    blocks: usize,
}

/// One event of Anthropic's stream.
fn event(ty: &str, mut v: Value) -> Vec<u8> {
    v["type"] = Value::from(ty);
    let mut out = format!("event: {ty}\n").into_bytes();
    out.extend(crate::openai::sse(&v));
    out
}

/// Anthropic's usage: cache reads apart from the rest of the input.
fn usage(u: &request::Usage) -> Value {
    json!({"input_tokens": u.prompt_tokens.saturating_sub(u.cached_tokens),
           "cache_creation_input_tokens": 0,
           "cache_read_input_tokens": u.cached_tokens,
           "output_tokens": u.completion_tokens})
}

/// The stop reason, and the stop sequence that ended the answer (the
/// engine says which of the request's stop strings matched).
fn stop_reason(d: &DoneEvent, called: bool, stops: &[String]) -> (&'static str, Value) {
    match (d.finish, called, d.stop_index) {
        (FinishReason::Length, _, _) => ("max_tokens", Value::Null),
        (FinishReason::Stop, true, _) => ("tool_use", Value::Null),
        (FinishReason::Stop, false, Some(k)) => match stops.get(usize::from(k)) {
            Some(s) => ("stop_sequence", Value::String(s.clone())),
            None => ("end_turn", Value::Null),
        },
        (FinishReason::Stop, false, None) => ("end_turn", Value::Null),
    }
}

impl MessagesShaper {
    /// Closes the open block, if any.
    fn close(&mut self) -> Vec<u8> {
        match self.open.take() {
            Some((_, index)) => event("content_block_stop", json!({"index": index})),
            None => Vec::new(),
        }
    }

    /// Opens `kind` unless it is the open block.
    fn ensure(&mut self, kind: Block, start: Value) -> (Vec<u8>, usize) {
        if let Some((k, i)) = self.open {
            if k == kind {
                return (Vec::new(), i);
            }
        }
        let mut out = self.close();
        let index = self.blocks;
        self.blocks += 1;
        self.open = Some((kind, index));
        out.extend(event(
            "content_block_start",
            json!({"index": index, "content_block": start}),
        ));
        (out, index)
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> Vec<u8> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Reasoning(t) => {
                    let (o, i) = self.ensure(
                        Block::Thinking,
                        json!({"type": "thinking", "thinking": "", "signature": ""}),
                    );
                    out.extend(o);
                    out.extend(event(
                        "content_block_delta",
                        json!({"index": i,
                        "delta": {"type": "thinking_delta", "thinking": t}}),
                    ));
                }
                Piece::Content(t) => {
                    let (o, i) = self.ensure(Block::Text, json!({"type": "text", "text": ""}));
                    out.extend(o);
                    out.extend(event(
                        "content_block_delta",
                        json!({"index": i,
                        "delta": {"type": "text_delta", "text": t}}),
                    ));
                }
                Piece::CallBegin { index, name } => {
                    let (o, _) = self.ensure(
                        Block::ToolUse(index),
                        json!({"type": "tool_use", "id": random_id("toolu_"), "name": name,
                               "input": {}}),
                    );
                    out.extend(o);
                }
                Piece::CallArgs { index, text } => {
                    if let Some((Block::ToolUse(k), i)) = self.open {
                        if k == index {
                            out.extend(event(
                                "content_block_delta",
                                json!({"index": i,
                                "delta": {"type": "input_json_delta", "partial_json": text}}),
                            ));
                        }
                    }
                }
            }
        }
        out
    }
}

impl Shaper for MessagesShaper {
    fn start(&mut self) -> Option<Vec<u8>> {
        let message = json!({"id": self.base.id, "type": "message", "role": "assistant",
            "model": self.base.model(), "content": [], "stop_reason": null,
            "stop_sequence": null,
            "usage": {"input_tokens": self.prompt_tokens, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0, "output_tokens": 0}});
        let mut out = event("message_start", json!({"message": message}));
        out.extend(event("ping", json!({})));
        Some(out)
    }

    fn token(&mut self, _index: usize, t: TokenEvent) -> Vec<u8> {
        // A format marker that is a control token is shown to the parser.
        let text = match self.calls {
            Some(_) => self.base.st.tool_markers.visible(t.id, &t.text).to_string(),
            None => t.text.clone(),
        };
        let pieces = self.parser.push(&text);
        self.pieces(pieces)
    }

    fn finish_choice(&mut self, _index: usize, d: &DoneEvent) -> Vec<u8> {
        let mut pieces = self.parser.push(&d.tail_text);
        pieces.extend(self.parser.finish());
        let mut out = self.pieces(pieces);
        out.extend(self.close());
        let called = !self.parser.calls().is_empty();
        let (reason, sequence) = stop_reason(d, called, &self.stops);
        out.extend(event(
            "message_delta",
            json!({"delta": {"stop_reason": reason, "stop_sequence": sequence},
                   "usage": usage(&d.usage)}),
        ));
        out
    }

    fn end(&mut self, _all: &DoneEvent) -> Vec<u8> {
        event("message_stop", json!({}))
    }

    fn error(&mut self, e: &ApiError) -> Vec<u8> {
        event("error", super::error_body(e))
    }

    fn full(&mut self, choices: Vec<Choice>, all: &DoneEvent) -> Response {
        let first = &choices[0];
        let mut p = OutputParser::new(self.reasoning, self.calls);
        let mut pieces = p.push(&first.text);
        pieces.extend(p.finish());
        let mut content: Vec<Value> = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Reasoning(t) => match content.last_mut() {
                    Some(b) if b["type"] == "thinking" => {
                        let s = format!("{}{t}", b["thinking"].as_str().unwrap_or(""));
                        b["thinking"] = Value::String(s);
                    }
                    _ => content.push(json!({"type": "thinking", "thinking": t, "signature": ""})),
                },
                Piece::Content(t) => match content.last_mut() {
                    Some(b) if b["type"] == "text" => {
                        let s = format!("{}{t}", b["text"].as_str().unwrap_or(""));
                        b["text"] = Value::String(s);
                    }
                    _ => content.push(json!({"type": "text", "text": t})),
                },
                Piece::CallBegin { .. } | Piece::CallArgs { .. } => {}
            }
        }
        for c in p.calls() {
            // A call cut off by max_tokens has arguments that do not parse:
            // its input is what parses, an empty object (the stop reason
            // says max_tokens).
            let input: Value = serde_json::from_str(&c.arguments)
                .ok()
                .filter(Value::is_object)
                .unwrap_or_else(|| json!({}));
            content.push(json!({"type": "tool_use", "id": random_id("toolu_"),
                                "name": c.name, "input": input}));
        }
        let called = !p.calls().is_empty();
        let (reason, sequence) = stop_reason(&first.done, called, &self.stops);
        Json(
            json!({"id": self.base.id, "type": "message", "role": "assistant",
                    "model": self.base.model(), "content": content,
                    "stop_reason": reason, "stop_sequence": sequence,
                    "usage": usage(&all.usage)}),
        )
        .into_response()
    }
}
