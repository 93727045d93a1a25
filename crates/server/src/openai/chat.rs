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
        Box::new(ChatShaper {
            base,
            choices,
            include_usage: p.include_usage,
            logprobs: p.logprobs.is_some(),
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
    parse_common(&VARIANT, Input::Chat(out), &f)
}

// ---- shapes -------------------------------------------------------------------

/// A chat message in a response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessageOut {
    pub role: String,
    pub content: String,
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
                        },
                        None,
                        None,
                    )
                })
                .collect(),
        )
    }

    fn token(&mut self, index: usize, t: TokenEvent) -> Vec<u8> {
        let lp = self.logprobs.then(|| ChatLogprobs {
            content: vec![self.base.chat_logprob(&t)],
        });
        self.chunk(
            index,
            Delta {
                role: None,
                content: Some(t.text),
            },
            lp,
            None,
        )
    }

    fn finish_choice(&mut self, index: usize, d: &DoneEvent) -> Vec<u8> {
        let mut out = Vec::new();
        if !d.tail_text.is_empty() {
            out.extend(self.chunk(
                index,
                Delta {
                    role: None,
                    content: Some(d.tail_text.clone()),
                },
                None,
                None,
            ));
        }
        out.extend(self.chunk(index, Delta::default(), None, Some(d.finish.as_openai())));
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
        Json(ChatCompletion {
            id: self.base.id.clone(),
            object: "chat.completion".into(),
            created: self.base.created,
            model: self.base.model(),
            choices: choices
                .into_iter()
                .enumerate()
                .map(|(index, c)| ChatChoice {
                    index,
                    message: ChatMessageOut {
                        role: "assistant".into(),
                        content: c.text,
                    },
                    logprobs: self.logprobs.then(|| ChatLogprobs {
                        content: c.tokens.iter().map(|t| self.base.chat_logprob(t)).collect(),
                    }),
                    finish_reason: Some(c.done.finish.as_openai().to_string()),
                })
                .collect(),
            usage: Usage::of(&all.usage),
        })
        .into_response()
    }
}
