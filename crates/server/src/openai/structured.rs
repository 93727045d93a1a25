//! Structured outputs: the fields that ask for output under a grammar,
//! parsed into one [`GrammarSpec`] with the field that asked (errors about
//! the grammar name it). OpenAI's `response_format` (chat and completions)
//! and the Responses API's `text.format`; vLLM's `structured_outputs`
//! (`json`, `regex`, `choice`, `grammar`, `json_object`) and its older
//! `guided_json`/`guided_regex`/`guided_choice`/`guided_grammar`; and
//! llama.cpp's `{"type": "json_object", "schema": …}`. One constraint a
//! request: two fields asking for one are refused, as is any key or value
//! the server would not honour.

use request::GrammarSpec;
use serde_json::{Map, Value};

use super::fields::{type_name, Fields};
use crate::error::ApiError;

/// A request's output grammar and where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct StructuredOutput {
    pub spec: GrammarSpec,
    /// The field that asked for it (`response_format`, `text.format`,
    /// `structured_outputs`, `guided_json`, …): errors name it.
    pub param: &'static str,
    /// The Responses API's `text.format` as sent, echoed in the response.
    pub format: Option<Value>,
}

/// A schema as a field carries it: an object (or `true`), or its JSON text
/// (vLLM accepts both).
fn schema_text(param: &str, v: &Value) -> Result<String, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.to_string()),
        Value::String(s) => {
            let parsed: Value = serde_json::from_str(s).map_err(|e| {
                ApiError::invalid_value(param, format!("the schema is not JSON: {e}"))
            })?;
            match parsed {
                Value::Object(_) | Value::Bool(_) => Ok(parsed.to_string()),
                other => Err(ApiError::invalid_type(
                    param,
                    &format!("a JSON schema object, got {}", type_name(&other)),
                )),
            }
        }
        other => Err(ApiError::invalid_type(
            param,
            &format!("a JSON schema object, got {}", type_name(other)),
        )),
    }
}

fn string_list(param: &str, v: &Value) -> Result<Vec<String>, ApiError> {
    let Value::Array(a) = v else {
        return Err(ApiError::invalid_type(
            param,
            &format!("an array of strings, got {}", type_name(v)),
        ));
    };
    if a.len() > request::constraint::GRAMMAR_CHOICES_MAX {
        return Err(ApiError::invalid_value(
            param,
            format!(
                "at most {} choices, got {}",
                request::constraint::GRAMMAR_CHOICES_MAX,
                a.len()
            ),
        ));
    }
    a.iter()
        .enumerate()
        .map(|(i, s)| match s {
            Value::String(s) => Ok(s.clone()),
            v => Err(ApiError::invalid_type(
                format!("{param}[{i}]"),
                &format!("a string, got {}", type_name(v)),
            )),
        })
        .collect()
}

fn a_string(param: &str, v: &Value) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        v => Err(ApiError::invalid_type(
            param,
            &format!("a string, got {}", type_name(v)),
        )),
    }
}

/// `strict`: a boolean or absent (false).
fn strict_of(m: &Map<String, Value>, param: &str) -> Result<bool, ApiError> {
    Fields(m)
        .bool("strict")
        .map_err(|_| ApiError::invalid_type(format!("{param}.strict"), "a boolean"))
        .map(|s| s.unwrap_or(false))
}

/// A `json_schema` format's `name`: OpenAI's rule (1 to 64 of
/// `a-zA-Z0-9_-`), required as OpenAI requires it.
fn check_name(m: &Map<String, Value>, param: &str) -> Result<(), ApiError> {
    let p = format!("{param}.name");
    match m.get("name") {
        None | Some(Value::Null) => Err(ApiError::missing(&p)),
        Some(Value::String(n)) => {
            let ok = !n.is_empty()
                && n.len() <= 64
                && n.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if ok {
                Ok(())
            } else {
                Err(ApiError::invalid_value(
                    p,
                    "must be 1 to 64 characters of a-z, A-Z, 0-9, `_` and `-`",
                ))
            }
        }
        Some(v) => Err(ApiError::invalid_type(
            p,
            &format!("a string, got {}", type_name(v)),
        )),
    }
}

/// Refuses keys of `m` outside `known` (a key the server would not honour).
fn only_keys(m: &Map<String, Value>, param: &str, known: &[&str]) -> Result<(), ApiError> {
    match m
        .iter()
        .find(|(k, v)| !v.is_null() && !known.contains(&k.as_str()))
    {
        None => Ok(()),
        Some((k, _)) => Err(ApiError::unsupported(
            &format!("{param}.{k}"),
            &format!("`{k}` is not supported here (known: {})", known.join(", ")),
        )),
    }
}

/// The object under `key`, if present; another type is the error.
fn object<'a>(f: &Fields<'a>, key: &str) -> Result<Option<&'a Map<String, Value>>, ApiError> {
    match f.get(key) {
        None => Ok(None),
        Some(Value::Object(m)) => Ok(Some(m)),
        Some(v) => Err(ApiError::invalid_type(
            key,
            &format!("an object, got {}", type_name(v)),
        )),
    }
}

/// A `json_schema` format's fields (`name`, `schema`, `strict`; the
/// object `m`, named `param` in errors).
fn json_schema_of(m: &Map<String, Value>, param: &str) -> Result<GrammarSpec, ApiError> {
    check_name(m, param)?;
    let schema_param = format!("{param}.schema");
    let schema = match m.get("schema").filter(|v| !v.is_null()) {
        Some(s) => schema_text(&schema_param, s)?,
        None => return Err(ApiError::missing(&schema_param)),
    };
    Ok(GrammarSpec::JsonSchema {
        schema,
        strict: strict_of(m, param)?,
    })
}

/// OpenAI's `response_format` (chat and completions): `text`,
/// `json_object` (llama.cpp's `schema` inside it too) or `json_schema`.
fn response_format(f: &Fields<'_>) -> Result<Option<StructuredOutput>, ApiError> {
    const P: &str = "response_format";
    let Some(m) = object(f, P)? else {
        return Ok(None);
    };
    let spec = match m.get("type") {
        Some(Value::String(t)) if t == "text" => {
            only_keys(m, P, &["type"])?;
            return Ok(None);
        }
        Some(Value::String(t)) if t == "json_object" => {
            only_keys(m, P, &["type", "schema"])?;
            match m.get("schema").filter(|v| !v.is_null()) {
                None => GrammarSpec::JsonObject,
                Some(s) => GrammarSpec::JsonSchema {
                    schema: schema_text("response_format.schema", s)?,
                    strict: false,
                },
            }
        }
        Some(Value::String(t)) if t == "json_schema" => {
            only_keys(m, P, &["type", "json_schema"])?;
            let js = match m.get("json_schema") {
                Some(Value::Object(js)) => js,
                None | Some(Value::Null) => {
                    return Err(ApiError::missing("response_format.json_schema"))
                }
                Some(v) => {
                    return Err(ApiError::invalid_type(
                        "response_format.json_schema",
                        &format!("an object, got {}", type_name(v)),
                    ))
                }
            };
            const JS: &str = "response_format.json_schema";
            only_keys(js, JS, &["name", "description", "schema", "strict"])?;
            json_schema_of(js, JS)?
        }
        Some(Value::String(t)) => {
            return Err(ApiError::unsupported(
                "response_format.type",
                &format!("`{t}` is not a format (text, json_object, json_schema)"),
            ))
        }
        _ => {
            return Err(ApiError::invalid_type(
                "response_format.type",
                "a string (text, json_object or json_schema)",
            ))
        }
    };
    Ok(Some(StructuredOutput {
        spec,
        param: P,
        format: None,
    }))
}

/// vLLM's `structured_outputs`: exactly one of `json`, `regex`, `choice`,
/// `grammar`, `json_object`.
fn structured_outputs(f: &Fields<'_>) -> Result<Option<StructuredOutput>, ApiError> {
    const P: &str = "structured_outputs";
    let Some(m) = object(f, P)? else {
        return Ok(None);
    };
    only_keys(m, P, &["json", "regex", "choice", "grammar", "json_object"])?;
    let mut found: Vec<GrammarSpec> = Vec::new();
    let g = Fields(m);
    if let Some(v) = g.get("json") {
        found.push(GrammarSpec::JsonSchema {
            schema: schema_text("structured_outputs.json", v)?,
            strict: false,
        });
    }
    if let Some(v) = g.get("regex") {
        found.push(GrammarSpec::Regex(a_string("structured_outputs.regex", v)?));
    }
    if let Some(v) = g.get("choice") {
        found.push(GrammarSpec::Choice(string_list(
            "structured_outputs.choice",
            v,
        )?));
    }
    if let Some(v) = g.get("grammar") {
        found.push(GrammarSpec::Lark(a_string(
            "structured_outputs.grammar",
            v,
        )?));
    }
    match g.bool("json_object") {
        Ok(Some(true)) => found.push(GrammarSpec::JsonObject),
        Ok(_) => {}
        Err(_) => {
            return Err(ApiError::invalid_type(
                "structured_outputs.json_object",
                "a boolean",
            ))
        }
    }
    match found.len() {
        0 => Err(ApiError::invalid_value(
            P,
            "name one constraint: json, regex, choice, grammar or json_object",
        )),
        1 => Ok(Some(StructuredOutput {
            spec: found.pop().expect("one"),
            param: P,
            format: None,
        })),
        _ => Err(ApiError::invalid_value(
            P,
            "only one of json, regex, choice, grammar and json_object may be given",
        )),
    }
}

/// vLLM's older top-level `guided_*` fields (still sent by older clients).
fn guided(f: &Fields<'_>) -> Result<Option<StructuredOutput>, ApiError> {
    let mut found = Vec::new();
    if let Some(v) = f.get("guided_json") {
        found.push(StructuredOutput {
            spec: GrammarSpec::JsonSchema {
                schema: schema_text("guided_json", v)?,
                strict: false,
            },
            param: "guided_json",
            format: None,
        });
    }
    if let Some(v) = f.get("guided_regex") {
        found.push(StructuredOutput {
            spec: GrammarSpec::Regex(a_string("guided_regex", v)?),
            param: "guided_regex",
            format: None,
        });
    }
    if let Some(v) = f.get("guided_choice") {
        found.push(StructuredOutput {
            spec: GrammarSpec::Choice(string_list("guided_choice", v)?),
            param: "guided_choice",
            format: None,
        });
    }
    if let Some(v) = f.get("guided_grammar") {
        found.push(StructuredOutput {
            spec: GrammarSpec::Lark(a_string("guided_grammar", v)?),
            param: "guided_grammar",
            format: None,
        });
    }
    for field in [
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "structural_tag",
    ] {
        if f.get(field).is_some() {
            return Err(ApiError::unsupported(
                field,
                "not supported: the grammar engine is llguidance, and JSON is generated \
                 compact",
            ));
        }
    }
    match found.len() {
        0 | 1 => Ok(found.pop()),
        _ => Err(ApiError::invalid_value(
            found[1].param,
            format!(
                "only one constraint per request (also `{}`)",
                found[0].param
            ),
        )),
    }
}

/// Checks a constraint's own bounds (its size, its choices) at parse time.
fn bounded(s: StructuredOutput) -> Result<StructuredOutput, ApiError> {
    s.spec
        .check_bounds()
        .map_err(|why| ApiError::invalid_value(s.param, why))?;
    Ok(s)
}

/// The constraint of a chat or completions body, if any.
pub(crate) fn parse(f: &Fields<'_>) -> Result<Option<StructuredOutput>, ApiError> {
    let all: Vec<StructuredOutput> = [response_format(f)?, structured_outputs(f)?, guided(f)?]
        .into_iter()
        .flatten()
        .collect();
    match all.len() {
        0 => Ok(None),
        1 => all.into_iter().next().map(bounded).transpose(),
        _ => Err(ApiError::invalid_value(
            all[1].param,
            format!(
                "only one constraint per request: `{}` already asks for one",
                all[0].param
            ),
        )),
    }
}

/// The Responses API's `text.format`: `text`, `json_object`, or
/// `json_schema` with `name`, `schema`, `strict` and `description` beside
/// `type` (the Responses API's flat form).
pub(crate) fn parse_text_format(f: &Fields<'_>) -> Result<Option<StructuredOutput>, ApiError> {
    const P: &str = "text.format";
    let Some(t) = object(f, "text")? else {
        return Ok(None);
    };
    only_keys(t, "text", &["format", "verbosity"])?;
    if let Some(v) = t.get("verbosity").filter(|v| !v.is_null()) {
        // Only the default: the model is not asked to be terse or wordy.
        if v.as_str() != Some("medium") {
            return Err(ApiError::unsupported(
                "text.verbosity",
                "only `medium` (the model's own length)",
            ));
        }
    }
    let fm = match t.get("format").filter(|v| !v.is_null()) {
        None => return Ok(None),
        Some(Value::Object(fm)) => fm,
        Some(v) => {
            return Err(ApiError::invalid_type(
                P,
                &format!("an object, got {}", type_name(v)),
            ))
        }
    };
    let spec = match fm.get("type").and_then(Value::as_str) {
        Some("text") => {
            only_keys(fm, P, &["type"])?;
            return Ok(None);
        }
        Some("json_object") => {
            only_keys(fm, P, &["type"])?;
            GrammarSpec::JsonObject
        }
        Some("json_schema") => {
            only_keys(fm, P, &["type", "name", "description", "schema", "strict"])?;
            json_schema_of(fm, P)?
        }
        Some(other) => {
            return Err(ApiError::unsupported(
                "text.format.type",
                &format!("`{other}` is not a format (text, json_object, json_schema)"),
            ))
        }
        None => {
            return Err(ApiError::invalid_type(
                "text.format.type",
                "a string (text, json_object or json_schema)",
            ))
        }
    };
    bounded(StructuredOutput {
        spec,
        param: P,
        format: Some(Value::Object(fm.clone())),
    })
    .map(Some)
}
