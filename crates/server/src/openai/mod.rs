//! OpenAI's API, one module per endpoint. Each owns its request parsing
//! (every error names its field) and its response shaping, streamed and
//! not: [`chat`], [`completions`], [`responses`], [`models`]. What they
//! share lives here: the parsed request ([`GenParams`]), the usage and
//! log-probability shapes, and the two traits that `http`'s admission and
//! streaming loop drive (`Generate` for a generation endpoint, `Shaper`
//! for one request's answer).
//!
//! Requests are parsed from a `serde_json::Value` by hand rather than with a
//! derived `Deserialize`, so that a wrong type or value is reported with the
//! exact field (`messages[2].content[0].text`, `max_tokens`, ...) and
//! unknown fields are ignored, as OpenAI does (`fields`).
//!
//! Adding a generation endpoint: a module here with its parser, a
//! `Generate` and a `Shaper`, and one line in `http::router`.

pub mod chat;
pub mod completions;
pub(crate) mod fields;
pub mod models;
pub mod responses;
pub(crate) mod structured;
#[cfg(test)]
mod tests;
pub mod tools;

use std::sync::Arc;

use axum::response::Response;
use request::{DoneEvent, TokenEvent};
use serde::{Deserialize, Serialize};

use crate::error::ApiError;
use crate::state::AppState;

/// At most this many chat messages.
pub const MESSAGES_MAX: usize = 4096;
/// At most this many content parts in one message.
pub const CONTENT_PARTS_MAX: usize = 256;
/// Most choices (`n`) one request may ask for: each is a sequence in the
/// engine with its own pages, and counts against the tenant's
/// `max_concurrent`.
pub const CHOICES_MAX: usize = 16;
/// Largest `top_logprobs` (chat) / `logprobs` (completions).
pub const TOP_LOGPROBS_MAX: usize = request::TOP_LOGPROBS_MAX;
/// The roles a chat message may have (`function`: the legacy form of
/// `tool`).
pub const ROLES: [&str; 6] = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];
/// Most tool calls one assistant message of the history may carry.
pub const HISTORY_CALLS_MAX: usize = 128;

/// A call an assistant message of the history made.
#[derive(Clone, Debug, PartialEq)]
pub struct HistoryCall {
    pub id: String,
    pub name: String,
    /// The arguments, parsed (templates print them as an object).
    pub arguments: serde_json::Value,
}

/// One chat message as the request sent it.
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    pub role: String,
    /// `None`: `null` or absent (an assistant turn that only calls tools).
    pub content: Option<String>,
    /// An assistant turn's calls (`tool_calls`, or the legacy
    /// `function_call`).
    pub tool_calls: Vec<HistoryCall>,
    /// A tool turn's `tool_call_id`.
    pub tool_call_id: Option<String>,
    /// A tool turn's (or participant's) `name`.
    pub name: Option<String>,
}

impl Message {
    /// A message of text only.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: Some(content.into()),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }
}

/// What to generate from.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// Chat messages, to be rendered with the chat template.
    Chat(Vec<Message>),
    /// Raw text (completions).
    Text(String),
    /// Token ids (completions).
    Tokens(Vec<u32>),
}

/// A validated generation request.
#[derive(Clone, Debug, PartialEq)]
pub struct GenParams {
    pub model: Option<String>,
    pub input: Input,
    /// The other prompts of a `/v1/completions` batch (`prompt` as an array
    /// of strings or of token arrays), after `input`; choice `n × p + j` is
    /// prompt p's j-th.
    pub more_inputs: Vec<Input>,
    /// `n`: choices to generate for each prompt, 1 to [`CHOICES_MAX`].
    pub n: usize,
    /// The Responses API's `instructions` (also the first, system, message
    /// of `input`), echoed in the response.
    pub instructions: Option<String>,
    /// `max_completion_tokens`, else `max_tokens`; `None`: the default.
    pub max_tokens: Option<usize>,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Return log-probabilities with this many alternatives per token.
    pub logprobs: Option<usize>,
    pub ignore_eos: bool,
    /// `cache_salt` (vLLM, SGLang) and `prompt_cache_key` (OpenAI), joined:
    /// narrows the request's prefix-cache scope inside its tenant's (K11).
    pub cache_salt: Option<String>,
    /// Order among the tenant's own requests (lower first; default 0).
    pub priority: i32,
    /// `logit_bias`: (token id, bias), sorted by id.
    pub logit_bias: Vec<(u32, f32)>,
    /// The grammar the output must follow, and the field that asked.
    pub structured: Option<structured::StructuredOutput>,
    /// `chat_template_kwargs`: variables for the chat template.
    pub template_kwargs: tokenizer::TemplateKwargs,
    /// `tools` (or the legacy `functions`) and how they may be called.
    pub tools: Option<tools::ToolRequest>,
    /// Tokens of the (first) prompt, set at admission (Anthropic's stream
    /// opens with them).
    pub prompt_tokens: usize,
    /// The rendered prompt left a thought open (`<think>` in the
    /// generation prompt): the output starts inside the reasoning. Set at
    /// admission, from the prompt.
    pub reasoning_open: bool,
    /// `prediction.content` (chat, OpenAI's Predicted Outputs): the text
    /// the caller expects, tokenised at admission into the request's
    /// drafts.
    pub prediction: Option<String>,
}

// ---- shapes every endpoint shares ------------------------------------------

/// Token counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// OpenAI's `prompt_tokens_details`: `cached_tokens`, the prompt tokens
    /// whose KV came from the prefix cache (always present, 0 on a miss).
    pub prompt_tokens_details: PromptTokensDetails,
    /// OpenAI's `completion_tokens_details`: how much of a prediction the
    /// model kept (always present, 0 without one).
    pub completion_tokens_details: CompletionTokensDetails,
}

/// The part of `usage` that breaks the completion down: of the
/// prediction's tokens the model verified, those it kept and those it
/// rejected (rejected ones are not in the output, and are counted in
/// `completion_tokens`, as OpenAI bills them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct CompletionTokensDetails {
    pub accepted_prediction_tokens: usize,
    pub rejected_prediction_tokens: usize,
}

/// The part of `usage` that breaks the prompt down.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: PromptTokensDetails::default(),
            completion_tokens_details: CompletionTokensDetails::default(),
        }
    }

    /// The usage of a finished request. OpenAI bills a prediction's
    /// rejected tokens as completion tokens: so does this count.
    pub fn of(u: &request::Usage) -> Usage {
        Usage {
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_tokens,
            },
            completion_tokens_details: CompletionTokensDetails {
                accepted_prediction_tokens: u.accepted_prediction_tokens,
                rejected_prediction_tokens: u.rejected_prediction_tokens,
            },
            ..Usage::new(
                u.prompt_tokens,
                u.completion_tokens + u.rejected_prediction_tokens,
            )
        }
    }
}

/// One alternative token.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// One generated token with its log-probability (chat).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

// ---- what a generation endpoint gives `http` ---------------------------------

/// A generation endpoint: how `http::generate` parses its body, names it
/// and shapes its answer. Implemented by a unit struct per endpoint.
pub(crate) trait Generate: Sync {
    /// Its name in the request log and metrics (`chat`).
    fn name(&self) -> &'static str;
    /// The prefix of its response ids (OpenAI's: `chatcmpl-`, `cmpl-`,
    /// `resp_`).
    fn id_prefix(&self) -> &'static str;
    /// The field holding the prompt (errors about the prompt name it).
    fn prompt_param(&self) -> &'static str;
    /// The field asking for alternatives' log-probabilities.
    fn logprobs_param(&self) -> &'static str;
    /// Parses and validates a body.
    fn parse(&self, body: &[u8]) -> Result<GenParams, ApiError>;
    /// The shaper of one admitted request's answer, of `choices` choices
    /// (the engine requests it runs: prompts × `n`).
    fn shaper(&self, base: Base, params: &GenParams, choices: usize) -> Box<dyn Shaper>;
    /// An error before the answer started, in the API's own shape
    /// (OpenAI's; Anthropic's endpoint answers in its own).
    fn error_response(&self, e: ApiError) -> Response {
        axum::response::IntoResponse::into_response(e)
    }
}

/// One finished choice, for an answer sent whole.
pub(crate) struct Choice {
    /// Its whole text, the held-back tail included.
    pub text: String,
    /// Its tokens, when log-probabilities were asked for (else empty).
    pub tokens: Vec<TokenEvent>,
    pub done: DoneEvent,
}

/// Shapes one request's answer in its endpoint's JSON: as server-sent
/// events (`start`, `token`…, `finish_choice` per choice, then `end` or
/// `error`), or whole (`full`). It keeps what its endpoint repeats at the
/// end (text so far, text offsets).
pub(crate) trait Shaper: Send {
    /// What opens the stream, if anything (chat: the role, per choice).
    fn start(&mut self) -> Option<Vec<u8>>;
    /// A token of choice `index`.
    fn token(&mut self, index: usize, t: TokenEvent) -> Vec<u8>;
    /// The end of one choice: its held-back tail (if any) and its finish.
    fn finish_choice(&mut self, index: usize, d: &DoneEvent) -> Vec<u8>;
    /// After every choice finished, `all` their sum: usage, `[DONE]`.
    fn end(&mut self, all: &DoneEvent) -> Vec<u8>;
    /// An error after the stream started.
    fn error(&mut self, e: &ApiError) -> Vec<u8> {
        let mut out = sse(&e.body());
        out.extend_from_slice(SSE_DONE);
        out
    }
    /// The whole answer, not streamed; `all` is the choices' sum.
    fn full(&mut self, choices: Vec<Choice>, all: &DoneEvent) -> Response;
}

/// What every shaper knows of its request: the server (the tokenizer, the
/// model's id), the response id and its creation time.
pub(crate) struct Base {
    pub st: Arc<AppState>,
    pub id: String,
    pub created: u64,
}

impl Base {
    pub fn model(&self) -> String {
        self.st.cfg.model_id.clone()
    }

    /// A token's text (lossy) and bytes.
    pub fn token_str(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self
            .st
            .tokenizer
            .token_bytes(id)
            .map(<[u8]>::to_vec)
            .unwrap_or_default();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    /// A token's log-probabilities as chat and the Responses API show them.
    pub fn chat_logprob(&self, t: &TokenEvent) -> TokenLogprob {
        let (token, bytes) = self.token_str(t.id);
        TokenLogprob {
            token,
            logprob: finite(t.logprob.unwrap_or(0.0)),
            bytes,
            top_logprobs: t
                .top_logprobs
                .iter()
                .map(|&(id, lp)| {
                    let (token, bytes) = self.token_str(id);
                    TopLogprob {
                        token,
                        logprob: finite(lp),
                        bytes,
                    }
                })
                .collect(),
        }
    }
}

/// A logprob as JSON can carry it (no infinities).
pub(crate) fn finite(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else {
        -9999.0
    }
}

/// One server-sent event carrying `v`.
pub(crate) fn sse<T: Serialize>(v: &T) -> Vec<u8> {
    let mut out = b"data: ".to_vec();
    if serde_json::to_writer(&mut out, v).is_err() {
        out.extend_from_slice(b"{}");
    }
    out.extend_from_slice(b"\n\n");
    out
}

/// The last event of a chat or completions stream.
pub(crate) const SSE_DONE: &[u8] = b"data: [DONE]\n\n";
