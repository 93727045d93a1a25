//! The fields every generation endpoint reads, parsed and checked the
//! same way for each: typed access that names the field in every error
//! ([`Fields`]), and the common sampling, stop, bias, cache and streaming
//! fields ([`parse_common`]). What differs between endpoints inside them
//! (which field bounds the output, how log-probabilities are asked for)
//! comes in a [`Variant`], read at the same point for every endpoint so
//! that the order of checks, and so which error a bad body gets, is one.

use serde_json::{Map, Value};

use super::structured::StructuredOutput;
use super::{GenParams, Input, Message, CHOICES_MAX, CONTENT_PARTS_MAX, MESSAGES_MAX, ROLES};
use crate::error::ApiError;

/// What differs between the endpoints inside the common fields.
pub(crate) struct Variant {
    /// The output bound (`max_tokens`, `max_output_tokens`, ...).
    pub max_tokens: fn(&Fields<'_>) -> Result<Option<i64>, ApiError>,
    /// Log-probabilities asked for, with this many alternatives.
    pub logprobs: fn(&Fields<'_>) -> Result<Option<usize>, ApiError>,
    /// The output's grammar, from the fields the endpoint reads it from.
    pub structured: fn(&Fields<'_>) -> Result<Option<StructuredOutput>, ApiError>,
    /// The endpoint renders messages through the chat template (and so
    /// takes `chat_template_kwargs`).
    pub chat_template: bool,
}

/// A number as an error message shows it: short whatever its size (Rust's
/// `{}` writes 1e300 as 301 digits).
pub(crate) fn shown_number(x: f64) -> String {
    let a = x.abs();
    if a != 0.0 && !(1e-4..1e9).contains(&a) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Typed access to the fields of a JSON object; `null` counts as absent.
pub(crate) struct Fields<'a>(pub &'a Map<String, Value>);

impl<'a> Fields<'a> {
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ApiError::invalid_type(
                key,
                &format!("a boolean, got {}", type_name(v)),
            )),
        }
    }

    pub fn number(&self, key: &str) -> Result<Option<f64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(ApiError::invalid_value(key, "not a finite number")),
            },
            Some(v) => Err(ApiError::invalid_type(
                key,
                &format!("a number, got {}", type_name(v)),
            )),
        }
    }

    /// A number within `lo..=hi` (`lo_open`: `lo` itself excluded).
    fn number_in(
        &self,
        key: &str,
        lo: f64,
        lo_open: bool,
        hi: f64,
    ) -> Result<Option<f32>, ApiError> {
        let Some(x) = self.number(key)? else {
            return Ok(None);
        };
        let ok = if lo_open { x > lo } else { x >= lo } && x <= hi;
        if !ok {
            let open = if lo_open { "(" } else { "[" };
            return Err(ApiError::invalid_value(
                key,
                format!("{} is not in {open}{lo}, {hi}]", shown_number(x)),
            ));
        }
        Ok(Some(x as f32))
    }

    pub fn int(&self, key: &str) -> Result<Option<i64>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => {
                if let Some(i) = n.as_i64() {
                    Ok(Some(i))
                } else if let Some(u) = n.as_u64() {
                    // Larger than i64::MAX: saturate; ranges reject it.
                    Ok(Some(i64::try_from(u).unwrap_or(i64::MAX)))
                } else {
                    Err(ApiError::invalid_type(key, "an integer, got a fraction"))
                }
            }
            Some(v) => Err(ApiError::invalid_type(
                key,
                &format!("an integer, got {}", type_name(v)),
            )),
        }
    }

    pub fn int_in(&self, key: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        let Some(i) = self.int(key)? else {
            return Ok(None);
        };
        if i < lo || i > hi {
            return Err(ApiError::invalid_value(
                key,
                format!("{i} is not in [{lo}, {hi}]"),
            ));
        }
        Ok(Some(i))
    }

    pub fn string(&self, key: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(ApiError::invalid_type(
                key,
                &format!("a string, got {}", type_name(v)),
            )),
        }
    }
}

pub(crate) fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(ApiError::invalid_json)?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::invalid_json(format!(
            "expected a JSON object, got {}",
            type_name(&other)
        ))),
    }
}

/// `stop`: a string, an array of at most 4 strings, or null.
fn parse_stop(f: &Fields<'_>) -> Result<Vec<String>, ApiError> {
    let stops = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            if a.len() > request::STOP_STRINGS_MAX {
                return Err(ApiError::invalid_value(
                    "stop",
                    format!(
                        "at most {} stop strings, got {}",
                        request::STOP_STRINGS_MAX,
                        a.len()
                    ),
                ));
            }
            let mut out = Vec::with_capacity(a.len());
            for (i, s) in a.iter().enumerate() {
                match s {
                    Value::String(s) => out.push(s.clone()),
                    v => {
                        return Err(ApiError::invalid_type(
                            format!("stop[{i}]"),
                            &format!("a string, got {}", type_name(v)),
                        ))
                    }
                }
            }
            out
        }
        Some(v) => {
            return Err(ApiError::invalid_type(
                "stop",
                &format!("a string or an array of strings, got {}", type_name(v)),
            ))
        }
    };
    if let Some(s) = stops
        .iter()
        .find(|s| s.is_empty() || s.len() > request::STOP_STRING_BYTES_MAX)
    {
        return Err(ApiError::invalid_value(
            "stop",
            format!(
                "each stop string must be 1 to {} bytes (got {})",
                request::STOP_STRING_BYTES_MAX,
                s.len()
            ),
        ));
    }
    Ok(stops)
}

/// The fields common to every generation endpoint.
pub(crate) fn parse_common(
    variant: &Variant,
    input: Input,
    f: &Fields<'_>,
) -> Result<GenParams, ApiError> {
    let model = f.string("model")?.map(str::to_string);
    let n = f.int_in("n", 1, CHOICES_MAX as i64)?.unwrap_or(1) as usize;
    if let Some(b) = f.int("best_of")? {
        // best_of = n returns every choice generated: nothing to rank.
        if b != n as i64 {
            return Err(ApiError::unsupported(
                "best_of",
                "best_of is supported only equal to n (the server does not rank choices)",
            ));
        }
    }
    let logit_bias = parse_logit_bias(f)?;
    let tools = super::tools::parse(f)?;
    let template_kwargs = parse_template_kwargs(f)?;
    if !template_kwargs.is_empty() && !variant.chat_template {
        return Err(ApiError::unsupported(
            "chat_template_kwargs",
            "this endpoint does not render a chat template (use /v1/chat/completions)",
        ));
    }
    if tools.is_some() && !variant.chat_template {
        return Err(ApiError::unsupported(
            "tools",
            "tools are served on /v1/chat/completions and /v1/responses",
        ));
    }
    let structured = (variant.structured)(f)?;
    if let (Some(t), Some(s)) = (&tools, &structured) {
        if t.set.active() {
            return Err(ApiError::unsupported(
                s.param,
                "an output format together with active tools is not supported: send one, or \
                 `tool_choice: \"none\"`",
            ));
        }
    }
    let max_tokens = (variant.max_tokens)(f)?;
    let temperature = f.number_in("temperature", 0.0, false, 2.0)?.unwrap_or(1.0);
    let top_p = f.number_in("top_p", 0.0, true, 1.0)?.unwrap_or(1.0);
    let top_k = match f.int_in("top_k", -1, request::TOP_K_MAX as i64)? {
        None | Some(-1) | Some(0) => 0,
        Some(k) => k as usize,
    };
    let min_p = f.number_in("min_p", 0.0, false, 1.0)?.unwrap_or(0.0);
    let presence_penalty = f
        .number_in("presence_penalty", -2.0, false, 2.0)?
        .unwrap_or(0.0);
    let frequency_penalty = f
        .number_in("frequency_penalty", -2.0, false, 2.0)?
        .unwrap_or(0.0);
    let repetition_penalty = f
        .number_in("repetition_penalty", 0.0, true, 10.0)?
        .unwrap_or(1.0);
    // Any 64-bit integer; negative seeds are reinterpreted as unsigned.
    let seed = f.int("seed")?.map(|s| s as u64);
    let stop = parse_stop(f)?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(m)) => Fields(m)
            .bool("include_usage")
            .map_err(|_| ApiError::invalid_type("stream_options.include_usage", "a boolean"))?
            .unwrap_or(false),
        Some(v) => {
            return Err(ApiError::invalid_type(
                "stream_options",
                &format!("an object, got {}", type_name(v)),
            ))
        }
    };
    let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
    let mut salts = Vec::new();
    for field in ["cache_salt", "prompt_cache_key"] {
        if let Some(s) = f.string(field)? {
            if s.is_empty() || s.len() > crate::tenants::CACHE_SALT_BYTES_MAX {
                return Err(ApiError::invalid_value(
                    field,
                    format!(
                        "must be 1 to {} bytes",
                        crate::tenants::CACHE_SALT_BYTES_MAX
                    ),
                ));
            }
            salts.push(format!("{field}={s}"));
        }
    }
    let cache_salt = (!salts.is_empty()).then(|| salts.join("\u{0}"));
    let priority = f
        .int_in("priority", i64::from(i32::MIN), i64::from(i32::MAX))?
        .unwrap_or(0) as i32;
    let logprobs = (variant.logprobs)(f)?;
    Ok(GenParams {
        model,
        input,
        more_inputs: Vec::new(),
        n,
        instructions: None,
        max_tokens: max_tokens.map(|m| m as usize),
        temperature,
        top_p,
        top_k,
        min_p,
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        seed,
        stop,
        stream,
        include_usage,
        logprobs,
        ignore_eos,
        cache_salt,
        priority,
        logit_bias,
        structured,
        template_kwargs,
        tools,
        reasoning_open: false,
        prompt_tokens: 0,
        prediction: None,
    })
}

/// Most keys of `chat_template_kwargs`.
pub const TEMPLATE_KWARGS_MAX: usize = 64;

/// `chat_template_kwargs` (vLLM's): an object whose members reach the
/// chat template as variables (`enable_thinking`, or anything the
/// template reads); not an object is a 400, as is a name the template's
/// render sets itself (`messages`, ...).
pub(crate) fn parse_template_kwargs(f: &Fields<'_>) -> Result<tokenizer::TemplateKwargs, ApiError> {
    const P: &str = "chat_template_kwargs";
    let m = match f.get(P) {
        None => return Ok(tokenizer::TemplateKwargs::new()),
        Some(Value::Object(m)) => m,
        Some(v) => {
            return Err(ApiError::invalid_type(
                P,
                &format!("an object, got {}", type_name(v)),
            ))
        }
    };
    if m.len() > TEMPLATE_KWARGS_MAX {
        return Err(ApiError::invalid_value(
            P,
            format!("at most {TEMPLATE_KWARGS_MAX} keys, got {}", m.len()),
        ));
    }
    if let Some(k) = m
        .keys()
        .find(|k| tokenizer::TEMPLATE_RESERVED.contains(&k.as_str()) || k.as_str() == "tools")
    {
        return Err(ApiError::invalid_value(
            format!("{P}.{k}"),
            "the template sets this variable itself",
        ));
    }
    Ok(m.iter()
        .map(|(k, v)| (k.clone(), template_value(v)))
        .collect())
}

/// A JSON value as the template sees it (the body parser bounded its
/// nesting).
pub(crate) fn template_value(v: &Value) -> tokenizer::TemplateValue {
    use tokenizer::TemplateValue as T;
    match v {
        Value::Null => T::Null,
        Value::Bool(b) => T::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => T::Int(i),
            None => T::Float(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => T::Str(s.clone()),
        Value::Array(a) => T::List(a.iter().map(template_value).collect()),
        Value::Object(m) => T::Map(
            m.iter()
                .map(|(k, v)| (k.clone(), template_value(v)))
                .collect(),
        ),
    }
}

/// `logit_bias`: an object from token ids (decimal strings, as JSON keys
/// must be) to a bias in [-100, 100]; at most [`request::LOGIT_BIAS_MAX`]
/// entries. Ids past the vocabulary are refused later, where the vocabulary
/// is known. Returned sorted by id.
fn parse_logit_bias(f: &Fields<'_>) -> Result<Vec<(u32, f32)>, ApiError> {
    let m = match f.get("logit_bias") {
        None => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(v) => {
            return Err(ApiError::invalid_type(
                "logit_bias",
                &format!("an object, got {}", type_name(v)),
            ))
        }
    };
    if m.len() > request::LOGIT_BIAS_MAX {
        return Err(ApiError::invalid_value(
            "logit_bias",
            format!(
                "at most {} tokens, got {}",
                request::LOGIT_BIAS_MAX,
                m.len()
            ),
        ));
    }
    let max = f64::from(request::LOGIT_BIAS_ABS_MAX);
    let mut out = Vec::with_capacity(m.len());
    for (k, v) in m {
        // Digits only: no sign, no spaces, no `0x` (u32's parser takes a `+`).
        let id = k
            .bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| k.parse::<u32>().ok())
            .flatten()
            .ok_or_else(|| {
                ApiError::invalid_value(
                    "logit_bias",
                    format!(
                        "key `{}` is not a token id",
                        k.chars().take(40).collect::<String>()
                    ),
                )
            })?;
        let b = v.as_f64().ok_or_else(|| {
            ApiError::invalid_type(
                "logit_bias",
                &format!(
                    "the bias of token {id} must be a number, got {}",
                    type_name(v)
                ),
            )
        })?;
        if !(-max..=max).contains(&b) {
            return Err(ApiError::invalid_value(
                "logit_bias",
                format!(
                    "the bias of token {id} is {}: must be between -100 and 100",
                    shown_number(b)
                ),
            ));
        }
        out.push((id, b as f32));
    }
    out.sort_by_key(|&(t, _)| t);
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        // "7" and "07" name one token.
        return Err(ApiError::invalid_value(
            "logit_bias",
            format!("token {} appears twice", w[0].0),
        ));
    }
    Ok(out)
}

/// A message's content: a string, an array of `{type: "text", text}` parts
/// (joined with newlines, as vLLM does), or null (empty).
pub(crate) fn parse_content(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            if parts.len() > CONTENT_PARTS_MAX {
                return Err(ApiError::invalid_value(
                    at,
                    format!("at most {CONTENT_PARTS_MAX} content parts"),
                ));
            }
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let pat = format!("{at}[{j}]");
                let Value::Object(pm) = p else {
                    return Err(ApiError::invalid_type(
                        pat,
                        &format!("an object, got {}", type_name(p)),
                    ));
                };
                let pf = Fields(pm);
                let ty = pf
                    .string("type")
                    .map_err(|_| ApiError::invalid_type(format!("{pat}.type"), "a string"))?
                    .ok_or_else(|| ApiError::missing(&format!("{pat}.type")))?;
                // `input_text`/`output_text`: the Responses API's names.
                if !matches!(ty, "text" | "input_text" | "output_text") {
                    return Err(ApiError::unsupported(
                        &format!("{pat}.type"),
                        &format!("content parts of type `{ty}` are not supported (only text)"),
                    ));
                }
                let t = pf
                    .string("text")
                    .map_err(|_| ApiError::invalid_type(format!("{pat}.text"), "a string"))?
                    .ok_or_else(|| ApiError::missing(&format!("{pat}.text")))?;
                if j > 0 {
                    text.push('\n');
                }
                text.push_str(t);
            }
            Ok(text)
        }
        Some(v) => Err(ApiError::invalid_type(
            at,
            &format!(
                "a string or an array of content parts, got {}",
                type_name(v)
            ),
        )),
    }
}

/// A chat body's `messages`: (role, text) pairs, `developer` read as
/// `system`.
pub(crate) fn parse_messages(f: &Fields<'_>) -> Result<Vec<Message>, ApiError> {
    let msgs = match f.get("messages") {
        None => return Err(ApiError::missing("messages")),
        Some(Value::Array(a)) => a,
        Some(v) => {
            return Err(ApiError::invalid_type(
                "messages",
                &format!("an array, got {}", type_name(v)),
            ))
        }
    };
    if msgs.is_empty() {
        return Err(ApiError::invalid_value(
            "messages",
            "at least one message is required",
        ));
    }
    if msgs.len() > MESSAGES_MAX {
        return Err(ApiError::invalid_value(
            "messages",
            format!("at most {MESSAGES_MAX} messages"),
        ));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Value::Object(mm) = m else {
            return Err(ApiError::invalid_type(
                at,
                &format!("an object, got {}", type_name(m)),
            ));
        };
        let mf = Fields(mm);
        let role = mf
            .string("role")
            .map_err(|_| ApiError::invalid_type(format!("{at}.role"), "a string"))?
            .ok_or_else(|| ApiError::missing(&format!("{at}.role")))?;
        if !ROLES.contains(&role) {
            return Err(ApiError::invalid_value(
                format!("{at}.role"),
                format!("`{role}` is not one of {}", ROLES.join(", ")),
            ));
        }
        // `developer` is OpenAI's new name for `system`.
        let role = if role == "developer" { "system" } else { role };
        // `null` content: an assistant turn that only calls tools.
        let content = match mf.get("content") {
            None | Some(Value::Null) => None,
            v => Some(parse_content(v, &format!("{at}.content"))?),
        };
        let tool_calls = match role {
            "assistant" => super::tools::parse_history_calls(&mf, &at)?,
            _ => Vec::new(),
        };
        let string = |k: &str| {
            mf.string(k)
                .map_err(|_| ApiError::invalid_type(format!("{at}.{k}"), "a string"))
                .map(|s| s.map(str::to_string))
        };
        let tool_call_id = match role {
            "tool" => string("tool_call_id")?,
            _ => None,
        };
        let name = string("name")?;
        if role == "function" && name.is_none() {
            return Err(ApiError::missing(&format!("{at}.name")));
        }
        out.push(Message {
            role: role.to_string(),
            content,
            tool_calls,
            tool_call_id,
            name,
        });
    }
    Ok(out)
}

pub(crate) fn parse_token_ids(a: &[Value], at: &str) -> Result<Vec<u32>, ApiError> {
    a.iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64()
                .and_then(|u| u32::try_from(u).ok())
                .ok_or_else(|| {
                    ApiError::invalid_type(format!("{at}[{i}]"), "a token id (integer ≥ 0)")
                })
        })
        .collect()
}

/// `max_completion_tokens`, else `max_tokens` (chat and completions).
pub(crate) fn max_tokens(f: &Fields<'_>) -> Result<Option<i64>, ApiError> {
    let max = request::MAX_TOKENS_MAX as i64;
    let m = f.int_in("max_tokens", 1, max)?;
    Ok(f.int_in("max_completion_tokens", 1, max)?.or(m))
}
