//! Anthropic's Messages API on the same engine, tenants and limits:
//! [`messages`] (`POST /v1/messages`, whole or as Anthropic's event
//! stream) and [`count_tokens`] (`POST /v1/messages/count_tokens`).
//!
//! A Messages body is translated into the chat request it means
//! ([`to_chat`]: `system`, content blocks, `tool_use` and `tool_result`,
//! `tools` and `tool_choice`, `stop_sequences`, `thinking`) and parsed by
//! chat's own parser, so the two APIs validate alike; an error names the
//! field by Anthropic's name ([`anthropic_names`]) and comes in Anthropic's
//! shape ([`error_response`]). `x-api-key` authenticates as `Authorization`
//! does (`http::auth_header`).

pub mod count_tokens;
pub mod messages;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::openai::fields::{parse_object, type_name, Fields};

/// Anthropic's error type for a status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// An OpenAI-named field path in Anthropic's names (`stop` is
/// `stop_sequences`, a tool's `function.parameters` its `input_schema`).
fn anthropic_names(param: &str) -> String {
    let mut p = param.to_string();
    for (from, to) in [
        (".function.parameters", ".input_schema"),
        (".function.description", ".description"),
        (".function.name", ".name"),
        ("tool_choice.function.name", "tool_choice.name"),
        ("chat_template_kwargs.enable_thinking", "thinking"),
        ("response_format", "output_config.format"),
    ] {
        p = p.replace(from, to);
    }
    if p == "stop" || p.starts_with("stop[") {
        p = p.replacen("stop", "stop_sequences", 1);
    }
    p
}

/// The error body Anthropic sends.
pub(crate) fn error_body(e: &ApiError) -> Value {
    let message = match &e.param {
        Some(p) => {
            let named = anthropic_names(p);
            e.message.replace(p.as_str(), &named)
        }
        None => e.message.clone(),
    };
    json!({"type": "error", "error": {"type": error_type(e.status), "message": message}})
}

/// An error in Anthropic's shape, with its status (and `Retry-After`).
pub(crate) fn error_response(e: ApiError) -> Response {
    let mut resp = (e.status, axum::Json(error_body(&e))).into_response();
    if let Some(secs) = e.retry_after {
        resp.headers_mut().insert(
            axum::http::header::RETRY_AFTER,
            axum::http::HeaderValue::from(secs),
        );
    }
    resp
}

/// A content block list's text (`text` blocks joined by newlines), or the
/// string itself; `at` names the field.
fn blocks_text(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = Vec::new();
            for (i, b) in blocks.iter().enumerate() {
                let bat = format!("{at}.{i}");
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => match b.get("text") {
                        Some(Value::String(t)) => out.push(t.clone()),
                        _ => return Err(ApiError::invalid_type(format!("{bat}.text"), "a string")),
                    },
                    Some(other) => {
                        return Err(ApiError::unsupported(
                            &format!("{bat}.type"),
                            &format!(
                            "content blocks of type `{other}` are not supported here (only text)"
                        ),
                        ))
                    }
                    None => return Err(ApiError::missing(&format!("{bat}.type"))),
                }
            }
            Ok(out.join("\n"))
        }
        other => Err(ApiError::invalid_type(
            at,
            &format!(
                "a string or an array of content blocks, got {}",
                type_name(other)
            ),
        )),
    }
}

/// One Anthropic message as the chat messages it means: a user turn's
/// `tool_result` blocks become `tool` messages (in order, text around them
/// kept as user turns); an assistant turn's `tool_use` blocks become its
/// `tool_calls`; its `thinking` blocks are dropped (as Anthropic drops
/// past turns' thoughts from the context).
fn message_to_chat(m: &Value, at: &str, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let Value::Object(mm) = m else {
        return Err(ApiError::invalid_type(
            at,
            &format!("an object, got {}", type_name(m)),
        ));
    };
    let f = Fields(mm);
    let role = f
        .string("role")
        .map_err(|_| ApiError::invalid_type(format!("{at}.role"), "a string"))?
        .ok_or_else(|| ApiError::missing(&format!("{at}.role")))?;
    if role != "user" && role != "assistant" {
        return Err(ApiError::invalid_value(
            format!("{at}.role"),
            format!("`{role}` is not one of user, assistant (the system prompt is `system`)"),
        ));
    }
    let content = f
        .get("content")
        .ok_or_else(|| ApiError::missing(&format!("{at}.content")))?;
    let blocks = match content {
        Value::String(s) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Value::Array(b) => b,
        other => {
            return Err(ApiError::invalid_type(
                format!("{at}.content"),
                &format!(
                    "a string or an array of content blocks, got {}",
                    type_name(other)
                ),
            ))
        }
    };
    let mut text: Vec<String> = Vec::new();
    let mut calls: Vec<Value> = Vec::new();
    let flush_text = |text: &mut Vec<String>, out: &mut Vec<Value>| {
        if !text.is_empty() {
            out.push(json!({"role": "user", "content": text.join("\n")}));
            text.clear();
        }
    };
    for (i, b) in blocks.iter().enumerate() {
        let bat = format!("{at}.content.{i}");
        let Value::Object(bm) = b else {
            return Err(ApiError::invalid_type(
                bat,
                &format!("an object, got {}", type_name(b)),
            ));
        };
        let bf = Fields(bm);
        let ty = bf
            .string("type")
            .map_err(|_| ApiError::invalid_type(format!("{bat}.type"), "a string"))?
            .ok_or_else(|| ApiError::missing(&format!("{bat}.type")))?;
        let string = |k: &str| -> Result<String, ApiError> {
            bf.string(k)
                .map_err(|_| ApiError::invalid_type(format!("{bat}.{k}"), "a string"))?
                .map(str::to_string)
                .ok_or_else(|| ApiError::missing(&format!("{bat}.{k}")))
        };
        match (role, ty) {
            (_, "text") => text.push(string("text")?),
            ("assistant", "tool_use") => {
                let input = match bf.get("input") {
                    Some(v @ Value::Object(_)) => v.clone(),
                    _ => return Err(ApiError::invalid_type(format!("{bat}.input"), "an object")),
                };
                calls.push(
                    json!({"id": string("id")?, "type": "function", "function": {
                    "name": string("name")?, "arguments": input.to_string()}}),
                );
            }
            ("assistant", "thinking" | "redacted_thinking") => {}
            ("user", "tool_result") => {
                flush_text(&mut text, out);
                let id = string("tool_use_id")?;
                let body = match bf.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(v) => blocks_text(v, &format!("{bat}.content"))?,
                };
                let body = match bf.bool("is_error") {
                    Ok(Some(true)) => format!("Error: {body}"),
                    Ok(_) => body,
                    Err(_) => {
                        return Err(ApiError::invalid_type(
                            format!("{bat}.is_error"),
                            "a boolean",
                        ))
                    }
                };
                out.push(json!({"role": "tool", "tool_call_id": id, "content": body}));
            }
            (_, other) => {
                return Err(ApiError::unsupported(
                    &format!("{bat}.type"),
                    &format!("`{other}` blocks in a {role} message are not supported"),
                ))
            }
        }
    }
    if role == "user" {
        flush_text(&mut text, out);
    } else {
        let mut msg = Map::new();
        msg.insert("role".into(), json!("assistant"));
        msg.insert(
            "content".into(),
            match text.is_empty() {
                true => Value::Null,
                false => Value::String(text.join("\n")),
            },
        );
        if !calls.is_empty() {
            msg.insert("tool_calls".into(), Value::Array(calls));
        }
        out.push(Value::Object(msg));
    }
    Ok(())
}

/// A Messages body as the chat body it means. `max_tokens` is required
/// (as Anthropic requires it) unless `counting` (count_tokens).
pub(crate) fn to_chat(body: &[u8], counting: bool) -> Result<Value, ApiError> {
    let obj = parse_object(body)?;
    let f = Fields(&obj);
    let mut chat = Map::new();
    let mut msgs: Vec<Value> = Vec::new();
    match f.get("system") {
        None | Some(Value::Null) => {}
        Some(v) => msgs.push(json!({"role": "system", "content": blocks_text(v, "system")?})),
    }
    match f.get("messages") {
        None => return Err(ApiError::missing("messages")),
        Some(Value::Array(a)) => {
            if a.len() > crate::openai::MESSAGES_MAX {
                return Err(ApiError::invalid_value(
                    "messages",
                    format!("at most {} messages", crate::openai::MESSAGES_MAX),
                ));
            }
            for (i, m) in a.iter().enumerate() {
                message_to_chat(m, &format!("messages.{i}"), &mut msgs)?;
            }
        }
        Some(v) => {
            return Err(ApiError::invalid_type(
                "messages",
                &format!("an array, got {}", type_name(v)),
            ))
        }
    }
    chat.insert("messages".into(), Value::Array(msgs));
    for k in ["model", "temperature", "top_p", "top_k", "stream"] {
        if let Some(v) = f.get(k) {
            chat.insert(k.into(), v.clone());
        }
    }
    match f.get("max_tokens") {
        Some(v) => {
            chat.insert("max_tokens".into(), v.clone());
        }
        None if counting => {}
        None => return Err(ApiError::missing("max_tokens")),
    }
    if let Some(v) = f.get("stop_sequences") {
        chat.insert("stop".into(), v.clone());
    }
    match f.get("thinking") {
        None | Some(Value::Null) => {}
        Some(Value::Object(t)) => match t.get("type").and_then(Value::as_str) {
            // The thought is not cut at `budget_tokens` here: a budget is
            // honoured only when `max_tokens` already bounds it (a smaller
            // one is refused, not ignored).
            Some("enabled" | "between_tools") => {
                if let Some(b) = t.get("budget_tokens") {
                    let b = b.as_u64().ok_or_else(|| {
                        ApiError::invalid_type("thinking.budget_tokens", "an integer")
                    })?;
                    let max = f.get("max_tokens").and_then(Value::as_u64).unwrap_or(0);
                    if !counting && b < max {
                        return Err(ApiError::unsupported(
                            "thinking.budget_tokens",
                            "a thinking budget below max_tokens is not supported: this server \
                             does not cut a thought short (send budget_tokens ≥ max_tokens, or \
                             thinking type adaptive)",
                        ));
                    }
                }
                chat.insert(
                    "chat_template_kwargs".into(),
                    json!({"enable_thinking": true}),
                );
            }
            Some("disabled") => {
                chat.insert(
                    "chat_template_kwargs".into(),
                    json!({"enable_thinking": false}),
                );
            }
            // The model's (template's) own default.
            Some("adaptive") => {}
            _ => {
                return Err(ApiError::invalid_value(
                    "thinking.type",
                    "is one of enabled, adaptive, disabled",
                ))
            }
        },
        Some(v) => {
            return Err(ApiError::invalid_type(
                "thinking",
                &format!("an object, got {}", type_name(v)),
            ))
        }
    }
    // Structured outputs: `output_config.format`. `effort` has no
    // counterpart here: refused, not ignored.
    match f.get("output_config") {
        None | Some(Value::Null) => {}
        Some(Value::Object(oc)) if oc.get("effort").is_some_and(|e| !e.is_null()) => {
            return Err(ApiError::unsupported(
                "output_config.effort",
                "an effort level is not supported by this server",
            ))
        }
        Some(Value::Object(oc)) => match oc.get("format") {
            None | Some(Value::Null) => {}
            Some(Value::Object(fm)) => {
                if fm.get("type").and_then(Value::as_str) != Some("json_schema") {
                    return Err(ApiError::invalid_value(
                        "output_config.format.type",
                        "is json_schema",
                    ));
                }
                let schema = fm
                    .get("schema")
                    .ok_or_else(|| ApiError::missing("output_config.format.schema"))?;
                chat.insert(
                    "response_format".into(),
                    json!({"type": "json_schema",
                           "json_schema": {"name": "output", "schema": schema, "strict": true}}),
                );
            }
            Some(v) => {
                return Err(ApiError::invalid_type(
                    "output_config.format",
                    &format!("an object, got {}", type_name(v)),
                ))
            }
        },
        Some(v) => {
            return Err(ApiError::invalid_type(
                "output_config",
                &format!("an object, got {}", type_name(v)),
            ))
        }
    }
    match f.get("tools") {
        None | Some(Value::Null) => {}
        Some(Value::Array(tools)) => {
            let mut out = Vec::with_capacity(tools.len());
            for (i, t) in tools.iter().enumerate() {
                let Value::Object(tm) = t else {
                    return Err(ApiError::invalid_type(format!("tools.{i}"), "an object"));
                };
                match tm.get("type").and_then(Value::as_str) {
                    None | Some("custom") => {}
                    Some(other) => {
                        return Err(ApiError::unsupported(
                            &format!("tools.{i}.type"),
                            &format!(
                                "server tools (`{other}`) are not supported: only client tools"
                            ),
                        ))
                    }
                }
                let mut func = Map::new();
                for (from, to) in [
                    ("name", "name"),
                    ("description", "description"),
                    ("input_schema", "parameters"),
                ] {
                    if let Some(v) = tm.get(from) {
                        func.insert(to.into(), v.clone());
                    }
                }
                if !tm.contains_key("input_schema") {
                    return Err(ApiError::missing(&format!("tools.{i}.input_schema")));
                }
                out.push(json!({"type": "function", "function": func}));
            }
            chat.insert("tools".into(), Value::Array(out));
        }
        Some(v) => {
            return Err(ApiError::invalid_type(
                "tools",
                &format!("an array, got {}", type_name(v)),
            ))
        }
    }
    match f.get("tool_choice") {
        None | Some(Value::Null) => {}
        Some(Value::Object(c)) => {
            let choice = match c.get("type").and_then(Value::as_str) {
                Some("auto") => json!("auto"),
                Some("any") => json!("required"),
                Some("none") => json!("none"),
                Some("tool") => match c.get("name") {
                    Some(Value::String(n)) => json!({"type": "function", "function": {"name": n}}),
                    _ => return Err(ApiError::missing("tool_choice.name")),
                },
                _ => {
                    return Err(ApiError::invalid_value(
                        "tool_choice.type",
                        "is one of auto, any, tool, none",
                    ))
                }
            };
            chat.insert("tool_choice".into(), choice);
            match c.get("disable_parallel_tool_use") {
                None | Some(Value::Null) => {}
                Some(Value::Bool(b)) => {
                    chat.insert("parallel_tool_calls".into(), json!(!b));
                }
                Some(_) => {
                    return Err(ApiError::invalid_type(
                        "tool_choice.disable_parallel_tool_use",
                        "a boolean",
                    ))
                }
            }
        }
        Some(v) => {
            return Err(ApiError::invalid_type(
                "tool_choice",
                &format!("an object, got {}", type_name(v)),
            ))
        }
    }
    Ok(Value::Object(chat))
}
