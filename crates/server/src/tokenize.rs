//! `POST /tokenize` (vLLM's and llama.cpp's servers have it): a prompt's
//! token ids exactly as a generation request would send them to the
//! engine (the same encoder, BOS included), for a tenant's key. Nothing
//! reaches the engine or the pool.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;

use crate::error::ApiError;
use crate::openai::fields::{parse_messages, parse_object, type_name, Fields};
use crate::openai::tools::ToolRequest;
use crate::openai::Input;
use crate::state::AppState;

pub(crate) async fn handle(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = async {
        let auth = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
        st.tenants.authenticate(auth)?;
        let bytes =
            crate::http::read_body(body, &headers, st.cfg.max_body_bytes, st.cfg.body_timeout)
                .await?;
        let (input, kwargs, tools) = parse_tokenize(&bytes)?;
        let (ids, _) = crate::http::tokenize(&st, &input, "messages", &kwargs, tools.as_ref())?;
        Ok::<_, ApiError>(serde_json::json!({
            "count": ids.len(),
            "max_model_len": st.max_request(),
            "tokens": ids,
        }))
    }
    .await;
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => {
            st.metrics.rejection(e.reason);
            e.into_response()
        }
    }
}

/// Parses a `/tokenize` body (the endpoint vLLM's and llama.cpp's servers
/// have): `messages`, rendered as `/v1/chat/completions` renders them, or
/// a text `prompt`, tokenised as `/v1/completions` tokenises it; with
/// messages, `chat_template_kwargs` and `tools` as chat takes them.
#[allow(clippy::type_complexity)]
pub fn parse_tokenize(
    body: &[u8],
) -> Result<(Input, tokenizer::TemplateKwargs, Option<ToolRequest>), ApiError> {
    let obj = parse_object(body)?;
    let f = Fields(&obj);
    let kwargs = crate::openai::fields::parse_template_kwargs(&f)?;
    if !kwargs.is_empty() && f.get("messages").is_none() {
        return Err(ApiError::unsupported(
            "chat_template_kwargs",
            "the chat template renders messages only",
        ));
    }
    let tools = crate::openai::tools::parse(&f)?;
    if tools.is_some() && f.get("messages").is_none() {
        return Err(ApiError::unsupported(
            "tools",
            "the chat template renders tools with messages only",
        ));
    }
    let input = match (f.get("messages"), f.get("prompt")) {
        (Some(_), Some(_)) => Err(ApiError::invalid_value(
            "prompt",
            "give either messages or prompt, not both",
        )),
        (Some(_), None) => Ok(Input::Chat(parse_messages(&f)?)),
        (None, Some(Value::String(s))) => Ok(Input::Text(s.clone())),
        (None, Some(v)) => Err(ApiError::invalid_type(
            "prompt",
            &format!("a string, got {}", type_name(v)),
        )),
        (None, None) => Err(ApiError::missing("prompt")),
    }?;
    Ok((input, kwargs, tools))
}
