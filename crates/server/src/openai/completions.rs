//! `POST /v1/completions`: a prompt (text, token ids, or a batch of
//! either) in; `text_completion` out, whole or as events.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use request::{DoneEvent, TokenEvent};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::fields::{
    self, parse_common, parse_object, parse_token_ids, type_name, Fields, Variant,
};
use super::{
    finite, sse, Base, Choice, GenParams, Generate, Input, Shaper, Usage, SSE_DONE,
    TOP_LOGPROBS_MAX,
};
use crate::error::ApiError;
use crate::state::AppState;

/// Most prompts in one `/v1/completions` request (a batch), and most
/// sequences (prompts × `n`) it may run.
pub const PROMPTS_MAX: usize = 64;
pub const SEQUENCES_MAX: usize = 64;

pub(crate) async fn handle(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    crate::http::generate(st, &Completions, headers, body).await
}

/// The endpoint.
pub(crate) struct Completions;

impl Generate for Completions {
    fn name(&self) -> &'static str {
        "completions"
    }
    fn id_prefix(&self) -> &'static str {
        "cmpl-"
    }
    fn prompt_param(&self) -> &'static str {
        "prompt"
    }
    fn logprobs_param(&self) -> &'static str {
        "logprobs"
    }
    fn parse(&self, body: &[u8]) -> Result<GenParams, ApiError> {
        parse_completion(body)
    }
    fn shaper(&self, base: Base, p: &GenParams, choices: usize) -> Box<dyn Shaper> {
        Box::new(CompletionShaper {
            base,
            include_usage: p.include_usage,
            logprobs: p.logprobs.is_some(),
            offsets: vec![0; choices],
        })
    }
}

const VARIANT: Variant = Variant {
    max_tokens: fields::max_tokens,
    logprobs,
    structured: super::structured::parse,
    chat_template: false,
};

/// `logprobs`: the number of alternatives (an integer, not chat's
/// boolean).
fn logprobs(f: &Fields<'_>) -> Result<Option<usize>, ApiError> {
    if f.get("logprobs").is_some_and(Value::is_boolean) {
        return Err(ApiError::invalid_type(
            "logprobs",
            "an integer (the number of alternatives), got boolean",
        ));
    }
    Ok(f.int_in("logprobs", 0, TOP_LOGPROBS_MAX as i64)?
        .map(|n| n as usize))
}

/// Parses and validates a `/v1/completions` body.
pub fn parse_completion(body: &[u8]) -> Result<GenParams, ApiError> {
    let obj = parse_object(body)?;
    let f = Fields(&obj);
    if f.bool("echo")?.unwrap_or(false) {
        return Err(ApiError::unsupported("echo", "echo is not supported"));
    }
    if f.string("suffix")?.is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported("suffix", "suffix is not supported"));
    }
    let mut batch = Vec::new();
    let input = match f.get("prompt") {
        None => return Err(ApiError::missing("prompt")),
        Some(Value::String(s)) => Input::Text(s.clone()),
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::invalid_value("prompt", "the prompt is empty"))
        }
        Some(Value::Array(a)) if a[0].is_number() => Input::Tokens(parse_token_ids(a, "prompt")?),
        // A batch: strings, or arrays of token ids (one kind or both).
        Some(Value::Array(a)) => {
            if a.len() > PROMPTS_MAX {
                return Err(ApiError::invalid_value(
                    "prompt",
                    format!("at most {PROMPTS_MAX} prompts, got {}", a.len()),
                ));
            }
            for (i, p) in a.iter().enumerate() {
                batch.push(match p {
                    Value::String(s) => Input::Text(s.clone()),
                    Value::Array(ids) if ids.is_empty() => {
                        return Err(ApiError::invalid_value(
                            format!("prompt[{i}]"),
                            "the prompt is empty",
                        ))
                    }
                    Value::Array(ids) => {
                        Input::Tokens(parse_token_ids(ids, &format!("prompt[{i}]"))?)
                    }
                    v => {
                        return Err(ApiError::invalid_type(
                            format!("prompt[{i}]"),
                            &format!("a string or an array of token ids, got {}", type_name(v)),
                        ))
                    }
                });
            }
            batch.remove(0)
        }
        Some(v) => {
            return Err(ApiError::invalid_type(
                "prompt",
                &format!(
                    "a string, an array of token ids or an array of one string, got {}",
                    type_name(v)
                ),
            ))
        }
    };
    let mut p = parse_common(&VARIANT, input, &f)?;
    if (1 + batch.len()) * p.n > SEQUENCES_MAX {
        return Err(ApiError::invalid_value(
            "n",
            format!(
                "{} prompts × n = {} is more than {SEQUENCES_MAX} sequences",
                1 + batch.len(),
                p.n
            ),
        ));
    }
    p.more_inputs = batch;
    Ok(p)
}

// ---- shapes -------------------------------------------------------------------

/// `choices[].logprobs` of completions.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<Map<String, Value>>,
    pub text_offset: Vec<usize>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<String>,
}

/// `text_completion` (both the response and its stream chunks).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub usage: Option<Option<Usage>>,
}

// ---- shaping -----------------------------------------------------------------

struct CompletionShaper {
    base: Base,
    include_usage: bool,
    logprobs: bool,
    /// Characters sent so far per choice (`text_offset`).
    offsets: Vec<usize>,
}

impl CompletionShaper {
    /// Appends `t` to `lp`; `offset` is the text offset (in characters)
    /// of the token.
    fn logprob(&self, lp: &mut CompletionLogprobs, t: &TokenEvent, offset: usize) {
        let (token, _) = self.base.token_str(t.id);
        let mut top = Map::new();
        for &(id, l) in &t.top_logprobs {
            let (s, _) = self.base.token_str(id);
            top.entry(s)
                .or_insert_with(|| Value::from(finite(l) as f64));
        }
        lp.tokens.push(token);
        lp.token_logprobs.push(finite(t.logprob.unwrap_or(0.0)));
        lp.top_logprobs.push(top);
        lp.text_offset.push(offset);
    }

    fn chunk(
        &self,
        index: usize,
        text: String,
        lp: Option<CompletionLogprobs>,
        finish: Option<&str>,
    ) -> Vec<u8> {
        sse(&Completion {
            id: self.base.id.clone(),
            object: "text_completion".into(),
            created: self.base.created,
            model: self.base.model(),
            choices: vec![CompletionChoice {
                index,
                text,
                logprobs: lp,
                finish_reason: finish.map(str::to_string),
            }],
            usage: self.include_usage.then_some(None),
        })
    }
}

impl Shaper for CompletionShaper {
    fn start(&mut self) -> Option<Vec<u8>> {
        None
    }

    fn token(&mut self, index: usize, t: TokenEvent) -> Vec<u8> {
        let offset = self.offsets[index];
        let lp = self.logprobs.then(|| {
            let mut lp = CompletionLogprobs::default();
            self.logprob(&mut lp, &t, offset);
            lp
        });
        self.offsets[index] += t.text.chars().count();
        self.chunk(index, t.text, lp, None)
    }

    fn finish_choice(&mut self, index: usize, d: &DoneEvent) -> Vec<u8> {
        let mut out = Vec::new();
        if !d.tail_text.is_empty() {
            out.extend(self.chunk(index, d.tail_text.clone(), None, None));
        }
        out.extend(self.chunk(index, String::new(), None, Some(d.finish.as_openai())));
        out
    }

    /// The usage chunk (if asked for), then `[DONE]`.
    fn end(&mut self, all: &DoneEvent) -> Vec<u8> {
        let mut out = match self.include_usage {
            false => Vec::new(),
            true => sse(&Completion {
                id: self.base.id.clone(),
                object: "text_completion".into(),
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
        Json(Completion {
            id: self.base.id.clone(),
            object: "text_completion".into(),
            created: self.base.created,
            model: self.base.model(),
            choices: choices
                .into_iter()
                .enumerate()
                .map(|(index, c)| {
                    let logprobs = self.logprobs.then(|| {
                        let mut lp = CompletionLogprobs::default();
                        let mut offset = 0;
                        for t in &c.tokens {
                            self.logprob(&mut lp, t, offset);
                            offset += t.text.chars().count();
                        }
                        lp
                    });
                    CompletionChoice {
                        index,
                        text: c.text,
                        logprobs,
                        finish_reason: Some(c.done.finish.as_openai().to_string()),
                    }
                })
                .collect(),
            usage: Some(Some(Usage::of(&all.usage))),
        })
        .into_response()
    }
}
