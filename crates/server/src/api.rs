//! OpenAI's API: parsing and validating requests (every error names its
//! field), and the response, chunk and model-list shapes.
//!
//! Requests are parsed from a `serde_json::Value` by hand rather than with a
//! derived `Deserialize`, so that a wrong type or value is reported with the
//! exact field (`messages[2].content[0].text`, `max_tokens`, ...) and
//! unknown fields are ignored, as OpenAI does.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::ApiError;

/// At most this many chat messages.
pub const MESSAGES_MAX: usize = 4096;
/// At most this many content parts in one message.
pub const CONTENT_PARTS_MAX: usize = 256;
/// Most choices (`n`) one request may ask for: each is a sequence in the
/// engine with its own pages, and counts against the tenant's
/// `max_concurrent`.
pub const CHOICES_MAX: usize = 16;
/// Most prompts in one `/v1/completions` request (a batch), and most
/// sequences (prompts × `n`) it may run.
pub const PROMPTS_MAX: usize = 64;
pub const SEQUENCES_MAX: usize = 64;
/// Largest `top_logprobs` (chat) / `logprobs` (completions).
pub const TOP_LOGPROBS_MAX: usize = request::TOP_LOGPROBS_MAX;
/// The roles a chat message may have.
pub const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// The generation endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    /// OpenAI's Responses API (`/v1/responses`), stateless: text in and
    /// out, nothing stored.
    Responses,
}

impl Endpoint {
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completions => "completions",
            Endpoint::Responses => "responses",
        }
    }
    /// The field holding the prompt.
    pub fn prompt_param(self) -> &'static str {
        match self {
            Endpoint::Chat => "messages",
            Endpoint::Completions => "prompt",
            Endpoint::Responses => "input",
        }
    }
    /// The field asking for alternatives' log-probabilities.
    pub fn logprobs_param(self) -> &'static str {
        match self {
            Endpoint::Chat | Endpoint::Responses => "top_logprobs",
            Endpoint::Completions => "logprobs",
        }
    }
}

/// What to generate from.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// Chat messages (role, text), to be rendered with the chat template.
    Chat(Vec<(String, String)>),
    /// Raw text (completions).
    Text(String),
    /// Token ids (completions).
    Tokens(Vec<u32>),
}

/// A validated generation request.
#[derive(Clone, Debug, PartialEq)]
pub struct GenParams {
    pub endpoint: Endpoint,
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
}

/// A number as an error message shows it: short whatever its size (Rust's
/// `{}` writes 1e300 as 301 digits).
fn shown_number(x: f64) -> String {
    let a = x.abs();
    if a != 0.0 && !(1e-4..1e9).contains(&a) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

fn type_name(v: &Value) -> &'static str {
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
struct Fields<'a>(&'a Map<String, Value>);

impl<'a> Fields<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ApiError::invalid_type(
                key,
                &format!("a boolean, got {}", type_name(v)),
            )),
        }
    }

    fn number(&self, key: &str) -> Result<Option<f64>, ApiError> {
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

    fn int(&self, key: &str) -> Result<Option<i64>, ApiError> {
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

    fn int_in(&self, key: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
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

    fn string(&self, key: &str) -> Result<Option<&'a str>, ApiError> {
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

fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
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

/// `response_format`, `tools`, `tool_choice` and `functions` ask for output
/// the server would have to constrain or parse (JSON, tool calls). It does
/// neither, so a request that relies on them is refused rather than answered
/// with free text under a 200 (as llama.cpp's server without `--jinja` and
/// vLLM without a tool parser refuse tools). Their "off" values pass: a
/// `text` format, an empty tool list, `tool_choice: "none"` (or `"auto"`
/// with no tools).
fn refuse_structured_output(f: &Fields<'_>) -> Result<(), ApiError> {
    match f.get("response_format") {
        None => {}
        Some(Value::Object(m)) => match m.get("type") {
            Some(Value::String(t)) if t == "text" => {}
            Some(Value::String(t)) => {
                return Err(ApiError::unsupported(
                    "response_format",
                    &format!(
                        "response_format `{t}` is not supported: this server does not \
                         constrain output (only `text`)"
                    ),
                ))
            }
            _ => {
                return Err(ApiError::invalid_type(
                    "response_format.type",
                    "a string (`text`)",
                ))
            }
        },
        Some(v) => {
            return Err(ApiError::invalid_type(
                "response_format",
                &format!("an object, got {}", type_name(v)),
            ))
        }
    }
    let mut tools = false;
    for field in ["tools", "functions"] {
        match f.get(field) {
            None => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(Value::Array(_)) => tools = true,
            Some(v) => {
                return Err(ApiError::invalid_type(
                    field,
                    &format!("an array, got {}", type_name(v)),
                ))
            }
        }
        if tools {
            return Err(ApiError::unsupported(
                field,
                "tool calling is not supported: this server does not parse tool calls \
                 from the model's output",
            ));
        }
    }
    for field in ["tool_choice", "function_call"] {
        match f.get(field) {
            None => {}
            Some(Value::String(c)) if c == "none" || c == "auto" => {}
            Some(_) => {
                return Err(ApiError::unsupported(
                    field,
                    "tool calling is not supported (only `none`, or `auto` with no tools)",
                ))
            }
        }
    }
    Ok(())
}

/// The fields common to both endpoints.
fn parse_common(endpoint: Endpoint, input: Input, f: &Fields<'_>) -> Result<GenParams, ApiError> {
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
    refuse_structured_output(f)?;
    let max_tokens_max = request::MAX_TOKENS_MAX as i64;
    let max_tokens = if endpoint == Endpoint::Responses {
        f.int_in("max_output_tokens", 1, max_tokens_max)?
    } else {
        let m = f.int_in("max_tokens", 1, max_tokens_max)?;
        f.int_in("max_completion_tokens", 1, max_tokens_max)?.or(m)
    };
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
    let logprobs = match endpoint {
        Endpoint::Chat => {
            let on = f.bool("logprobs")?.unwrap_or(false);
            let top = f.int_in("top_logprobs", 0, TOP_LOGPROBS_MAX as i64)?;
            if top.is_some() && !on {
                return Err(ApiError::invalid_value(
                    "top_logprobs",
                    "requires `logprobs` to be true",
                ));
            }
            on.then_some(top.unwrap_or(0) as usize)
        }
        // Log-probabilities come with the output text when `include` names
        // them; `top_logprobs` alternatives each.
        Endpoint::Responses => {
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
                                return Err(ApiError::invalid_type(
                                    format!("include[{i}]"),
                                    "a string",
                                ))
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
            on.then_some(top.unwrap_or(0) as usize)
        }
        Endpoint::Completions => {
            if f.get("logprobs").is_some_and(Value::is_boolean) {
                return Err(ApiError::invalid_type(
                    "logprobs",
                    "an integer (the number of alternatives), got boolean",
                ));
            }
            f.int_in("logprobs", 0, TOP_LOGPROBS_MAX as i64)?
                .map(|n| n as usize)
        }
    };
    Ok(GenParams {
        endpoint,
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
    })
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
fn parse_content(v: Option<&Value>, at: &str) -> Result<String, ApiError> {
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

/// Parses and validates a `/v1/chat/completions` body.
pub fn parse_chat(body: &[u8]) -> Result<GenParams, ApiError> {
    let obj = parse_object(body)?;
    let f = Fields(&obj);
    let out = parse_messages(&f)?;
    parse_common(Endpoint::Chat, Input::Chat(out), &f)
}

/// Parses a `/tokenize` body (the endpoint vLLM's and llama.cpp's servers
/// have): `messages`, rendered as `/v1/chat/completions` renders them, or
/// a text `prompt`, tokenised as `/v1/completions` tokenises it.
pub fn parse_tokenize(body: &[u8]) -> Result<Input, ApiError> {
    let obj = parse_object(body)?;
    let f = Fields(&obj);
    match (f.get("messages"), f.get("prompt")) {
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
    }
}

/// A chat body's `messages`: (role, text) pairs, `developer` read as
/// `system`.
fn parse_messages(f: &Fields<'_>) -> Result<Vec<(String, String)>, ApiError> {
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
        let content = parse_content(mf.get("content"), &format!("{at}.content"))?;
        out.push((role.to_string(), content));
    }
    Ok(out)
}

fn parse_token_ids(a: &[Value], at: &str) -> Result<Vec<u32>, ApiError> {
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

/// Parses and validates a `/v1/responses` body: `input` (a string, or
/// messages as `{role, content}` items whose content is a string or
/// `input_text`/`output_text` parts), `instructions` (a system message
/// first), `max_output_tokens`, the sampling fields, `stream`. Nothing is
/// stored, so what needs a stored response or a tool is refused:
/// `previous_response_id`, `conversation`, `background`, tools, and a
/// `text.format` other than `text`.
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
    match f.get("text") {
        None => {}
        Some(Value::Object(t)) => match t.get("format").filter(|v| !v.is_null()) {
            None => {}
            Some(Value::Object(fm)) if fm.get("type").and_then(Value::as_str) == Some("text") => {}
            Some(_) => {
                return Err(ApiError::unsupported(
                    "text.format",
                    "only `{\"type\": \"text\"}`: this server does not constrain output",
                ))
            }
        },
        Some(v) => {
            return Err(ApiError::invalid_type(
                "text",
                &format!("an object, got {}", type_name(v)),
            ))
        }
    }
    let mut msgs = Vec::new();
    let instructions = f.string("instructions")?.map(str::to_string);
    if let Some(s) = &instructions {
        msgs.push(("system".to_string(), s.clone()));
    }
    match f.get("input") {
        None => return Err(ApiError::missing("input")),
        Some(Value::String(s)) => msgs.push(("user".to_string(), s.clone())),
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
                msgs.push((role.to_string(), content));
            }
        }
        Some(v) => {
            return Err(ApiError::invalid_type(
                "input",
                &format!("a string or an array of messages, got {}", type_name(v)),
            ))
        }
    }
    let mut p = parse_common(Endpoint::Responses, Input::Chat(msgs), &f)?;
    p.instructions = instructions;
    Ok(p)
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
    let mut p = parse_common(Endpoint::Completions, input, &f)?;
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

// ---- response shapes -------------------------------------------------------

/// Token counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// OpenAI's `prompt_tokens_details`: `cached_tokens`, the prompt tokens
    /// whose KV came from the prefix cache (always present, 0 on a miss).
    pub prompt_tokens_details: PromptTokensDetails,
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
        }
    }

    /// The usage of a finished request.
    pub fn of(u: &request::Usage) -> Usage {
        Usage {
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: u.cached_tokens,
            },
            ..Usage::new(u.prompt_tokens, u.completion_tokens)
        }
    }
}

/// A chat message in a response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessageOut {
    pub role: String,
    pub content: String,
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

/// One entry of `/v1/models`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    /// The advertised window (vLLM's name).
    pub max_model_len: usize,
    /// The same, under the name some clients read.
    pub context_length: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(v: Value) -> Result<GenParams, ApiError> {
        parse_chat(v.to_string().as_bytes())
    }

    fn completion(v: Value) -> Result<GenParams, ApiError> {
        parse_completion(v.to_string().as_bytes())
    }

    fn msgs() -> Value {
        json!([{"role": "user", "content": "hi"}])
    }

    /// The error of `chat` with `field: value` added names `param`.
    fn chat_err(field: &str, value: Value, param: &str) {
        let mut body = json!({"model": "m", "messages": msgs()});
        body[field] = value.clone();
        let e = chat(body).expect_err(&format!("{field} = {value} must fail"));
        assert_eq!(e.status.as_u16(), 400, "{field} = {value}");
        assert_eq!(e.param.as_deref(), Some(param), "{field} = {value}: {e}");
        assert_eq!(e.kind, "invalid_request_error");
    }

    #[test]
    fn defaults_of_a_minimal_chat_request() {
        let p = chat(json!({"model": "m", "messages": msgs()})).expect("valid");
        assert_eq!(p.input, Input::Chat(vec![("user".into(), "hi".into())]));
        assert_eq!(p.model.as_deref(), Some("m"));
        assert_eq!(p.max_tokens, None);
        assert_eq!(p.temperature, 1.0);
        assert_eq!((p.top_p, p.top_k, p.min_p), (1.0, 0, 0.0));
        assert_eq!(p.repetition_penalty, 1.0);
        assert_eq!(p.seed, None);
        assert!(!p.stream && !p.include_usage && !p.ignore_eos);
        assert_eq!(p.logprobs, None);
        assert!(p.stop.is_empty());
    }

    #[test]
    fn every_field_is_read() {
        let p = chat(json!({
            "model": "m", "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null}
            ],
            "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5,
            "top_k": 3, "min_p": 0.1, "presence_penalty": 1, "frequency_penalty": -1,
            "repetition_penalty": 1.2, "seed": -1, "stop": ["x", "y"], "stream": true,
            "stream_options": {"include_usage": true}, "logprobs": true, "top_logprobs": 4,
            "ignore_eos": true, "user": "u", "some_future_field": {"x": 1}, "n": 1
        }))
        .expect("valid");
        assert_eq!(
            p.input,
            Input::Chat(vec![
                ("system".into(), "be brief".into()),
                ("user".into(), "a\nb".into()),
                ("assistant".into(), "".into())
            ])
        );
        assert_eq!(p.max_tokens, Some(7), "max_completion_tokens wins");
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.min_p),
            (0.0, 0.5, 3, 0.1)
        );
        assert_eq!((p.presence_penalty, p.frequency_penalty), (1.0, -1.0));
        assert_eq!(p.repetition_penalty, 1.2);
        assert_eq!(p.seed, Some(u64::MAX));
        assert_eq!(p.stop, vec!["x".to_string(), "y".to_string()]);
        assert!(p.stream && p.include_usage && p.ignore_eos);
        assert_eq!(p.logprobs, Some(4));
    }

    #[test]
    fn wrong_types_name_the_field() {
        for (field, value) in [
            ("max_tokens", json!("x")),
            ("max_tokens", json!(1.5)),
            ("max_completion_tokens", json!(true)),
            ("temperature", json!("hot")),
            ("top_p", json!([])),
            ("top_k", json!(1.5)),
            ("min_p", json!({})),
            ("presence_penalty", json!("0")),
            ("frequency_penalty", json!(false)),
            ("repetition_penalty", json!("1")),
            ("seed", json!("42")),
            ("stop", json!(5)),
            ("stream", json!("yes")),
            ("stream_options", json!(1)),
            ("logprobs", json!(1)),
            ("top_logprobs", json!("2")),
            ("ignore_eos", json!(0)),
            ("model", json!(3)),
            ("n", json!("1")),
            ("logit_bias", json!(3)),
            ("messages", json!("hi")),
        ] {
            chat_err(field, value, field);
        }
        chat_err("stop", json!(["a", 1]), "stop[1]");
        chat_err(
            "stream_options",
            json!({"include_usage": 1}),
            "stream_options.include_usage",
        );
        chat_err("messages", json!([1]), "messages[0]");
        chat_err("messages", json!([{"content": "x"}]), "messages[0].role");
        chat_err(
            "messages",
            json!([{"role": 1, "content": "x"}]),
            "messages[0].role",
        );
        chat_err(
            "messages",
            json!([{"role": "user", "content": 5}]),
            "messages[0].content",
        );
        chat_err(
            "messages",
            json!([{"role": "user", "content": [{"type": "text", "text": 1}]}]),
            "messages[0].content[0].text",
        );
        chat_err(
            "messages",
            json!([{"role": "user", "content": [{"text": "x"}]}]),
            "messages[0].content[0].type",
        );
    }

    fn responses(v: Value) -> Result<GenParams, ApiError> {
        parse_responses(v.to_string().as_bytes())
    }

    #[test]
    fn a_responses_body_becomes_a_conversation() {
        let p = responses(json!({"input": "hi", "instructions": "be brief",
                                 "max_output_tokens": 9, "temperature": 0.5}))
        .expect("valid");
        assert_eq!(
            p.input,
            Input::Chat(vec![
                ("system".into(), "be brief".into()),
                ("user".into(), "hi".into())
            ])
        );
        assert_eq!((p.max_tokens, p.temperature, p.n), (Some(9), 0.5, 1));
        assert_eq!(p.logprobs, None);
        let p = responses(json!({"input": [
            {"role": "developer", "content": "sys"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]}
        ], "max_tokens": 3, "top_logprobs": 2, "include": ["message.output_text.logprobs"]}))
        .expect("valid");
        assert_eq!(
            p.input,
            Input::Chat(vec![
                ("system".into(), "sys".into()),
                ("user".into(), "a".into()),
                ("assistant".into(), "b".into())
            ])
        );
        assert_eq!(p.max_tokens, None, "max_tokens is not a Responses field");
        assert_eq!(p.logprobs, Some(2));
        for (body, param) in [
            (json!({}), "input"),
            (json!({"input": []}), "input"),
            (json!({"input": [1]}), "input[0]"),
            (
                json!({"input": [{"role": "tool", "content": "x"}]}),
                "input[0].role",
            ),
            (json!({"input": [{"type": "reasoning"}]}), "input[0].type"),
            (
                json!({"input": "x", "previous_response_id": "resp_1"}),
                "previous_response_id",
            ),
            (json!({"input": "x", "conversation": "c"}), "conversation"),
            (json!({"input": "x", "background": true}), "background"),
            (json!({"input": "x", "n": 2}), "n"),
            (
                json!({"input": "x", "text": {"format": {"type": "json_schema"}}}),
                "text.format",
            ),
            (json!({"input": "x", "text": 1}), "text"),
            (
                json!({"input": "x", "include": ["file_search_call.results"]}),
                "include[0]",
            ),
            (json!({"input": "x", "include": "x"}), "include"),
            (
                json!({"input": "x", "max_output_tokens": 0}),
                "max_output_tokens",
            ),
            (
                json!({"input": "x", "tools": [{"type": "web_search"}]}),
                "tools",
            ),
        ] {
            let e = responses(body.clone()).expect_err(&body.to_string());
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
        }
        responses(
            json!({"input": "x", "text": {"format": {"type": "text"}}, "store": false,
                         "metadata": {"k": "v"}, "tool_choice": "none"}),
        )
        .expect("their off values pass");
    }

    #[test]
    fn n_choices_are_read_and_bounded() {
        assert_eq!(chat(json!({"messages": msgs()})).expect("valid").n, 1);
        let p = chat(json!({"messages": msgs(), "n": 3, "best_of": 3})).expect("valid");
        assert_eq!(p.n, 3);
        let p = completion(json!({"prompt": "x", "n": CHOICES_MAX})).expect("valid");
        assert_eq!(p.n, CHOICES_MAX);
        let e = completion(json!({"prompt": "x", "n": 2, "best_of": 3})).expect_err("ranking");
        assert_eq!(e.param.as_deref(), Some("best_of"));
        let e = completion(json!({"prompt": "x", "n": CHOICES_MAX + 1})).expect_err("too many");
        assert_eq!(e.param.as_deref(), Some("n"));
    }

    #[test]
    fn logit_bias_is_read_sorted_and_bounded() {
        let p = chat(json!({"messages": msgs(), "logit_bias": {"50": -100, "7": 2.5, "0": 100}}))
            .expect("valid");
        assert_eq!(p.logit_bias, vec![(0, 100.0), (7, 2.5), (50, -100.0)]);
        let p = completion(json!({"prompt": "x", "logit_bias": {}})).expect("valid");
        assert!(p.logit_bias.is_empty());
        let p = completion(json!({"prompt": "x", "logit_bias": null})).expect("valid");
        assert!(p.logit_bias.is_empty());
        let many: Map<String, Value> = (0..=request::LOGIT_BIAS_MAX)
            .map(|t| (t.to_string(), json!(1)))
            .collect();
        chat_err("logit_bias", Value::Object(many), "logit_bias");
        chat_err("logit_bias", json!({"1": "5"}), "logit_bias");
    }

    /// JSON mode and tool calls are refused, never answered with free text
    /// under a 200; their "off" values pass.
    #[test]
    fn structured_output_requests_are_refused_not_ignored() {
        for (field, value, param) in [
            (
                "response_format",
                json!({"type": "json_object"}),
                "response_format",
            ),
            (
                "response_format",
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
                "response_format",
            ),
            ("response_format", json!({}), "response_format.type"),
            ("response_format", json!("json"), "response_format"),
            (
                "tools",
                json!([{"type": "function", "function": {"name": "f"}}]),
                "tools",
            ),
            ("tools", json!({}), "tools"),
            ("functions", json!([{"name": "f"}]), "functions"),
            ("tool_choice", json!("required"), "tool_choice"),
            (
                "tool_choice",
                json!({"type": "function", "function": {"name": "f"}}),
                "tool_choice",
            ),
            ("function_call", json!({"name": "f"}), "function_call"),
        ] {
            chat_err(field, value, param);
        }
        let e = chat(json!({"messages": msgs(), "response_format": {"type": "json_object"}}))
            .expect_err("json mode");
        assert_eq!(e.code, Some("unsupported_value"), "{e}");
        for (field, value) in [
            ("response_format", json!({"type": "text"})),
            ("tools", json!([])),
            ("tools", Value::Null),
            ("tool_choice", json!("none")),
            ("tool_choice", json!("auto")),
            ("function_call", json!("none")),
        ] {
            let mut body = json!({"messages": msgs()});
            body[field] = value.clone();
            chat(body).unwrap_or_else(|e| panic!("{field} = {value}: {e}"));
        }
        let e = completion(json!({"prompt": "x", "response_format": {"type": "json_object"}}))
            .expect_err("json mode on completions");
        assert_eq!(e.param.as_deref(), Some("response_format"));
    }

    #[test]
    fn out_of_range_values_name_the_field() {
        for (field, value) in [
            ("max_tokens", json!(0)),
            ("max_tokens", json!(-5)),
            ("max_tokens", json!(u64::MAX)),
            ("temperature", json!(-1)),
            ("temperature", json!(2.5)),
            ("top_p", json!(0)),
            ("top_p", json!(1.1)),
            ("top_k", json!(-2)),
            ("min_p", json!(1.5)),
            ("presence_penalty", json!(3)),
            ("frequency_penalty", json!(-3)),
            ("repetition_penalty", json!(0)),
            ("repetition_penalty", json!(11)),
            ("n", json!(17)),
            ("n", json!(0)),
            ("best_of", json!(2)),
            ("top_logprobs", json!(21)),
            ("logit_bias", json!({"1": 101})),
            ("logit_bias", json!({"1": -100.5})),
            ("logit_bias", json!({"x": 1})),
            ("logit_bias", json!({"-1": 1})),
            ("logit_bias", json!({"+1": 1})),
            ("logit_bias", json!({" 1": 1})),
            ("logit_bias", json!({"4294967296": 1})),
            ("logit_bias", json!({"7": 1, "07": 2})),
            ("stop", json!(["a", "b", "c", "d", "e"])),
            ("stop", json!("")),
            ("stop", json!("x".repeat(300))),
            ("messages", json!([])),
        ] {
            chat_err(field, value, field);
        }
        // top_logprobs without logprobs
        let e = chat(json!({"messages": msgs(), "top_logprobs": 2})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        chat_err(
            "messages",
            json!([{"role": "wizard", "content": "x"}]),
            "messages[0].role",
        );
        chat_err(
            "messages",
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            "messages[0].content[0].type",
        );
    }

    #[test]
    fn malformed_json_and_missing_fields() {
        for body in [&b"{"[..], b"", b"[1]", b"\"x\"", b"{\"a\":}", b"\xff\xfe"] {
            let e = parse_chat(body).unwrap_err();
            assert_eq!(e.status.as_u16(), 400);
            assert_eq!(e.code, Some("invalid_json"));
            assert_eq!(e.param, None);
        }
        let e = chat(json!({"model": "m"})).unwrap_err();
        assert_eq!(
            (e.param.as_deref(), e.code),
            (Some("messages"), Some("missing_required_parameter"))
        );
        let e = completion(json!({"model": "m"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        // Deep nesting is refused by serde_json's recursion limit, not a crash.
        let deep = "[".repeat(100_000);
        assert!(parse_chat(deep.as_bytes()).is_err());
    }

    #[test]
    fn completion_prompts() {
        let p = completion(json!({"prompt": "The capital"})).expect("string");
        assert_eq!(p.input, Input::Text("The capital".into()));
        let p = completion(json!({"prompt": ["one"]})).expect("one string");
        assert_eq!(p.input, Input::Text("one".into()));
        let p = completion(json!({"prompt": [1, 2, 3]})).expect("ids");
        assert_eq!(p.input, Input::Tokens(vec![1, 2, 3]));
        let p = completion(json!({"prompt": [[4, 5]]})).expect("one id list");
        assert_eq!(p.input, Input::Tokens(vec![4, 5]));
        let p = completion(json!({"prompt": "x", "logprobs": 3})).expect("logprobs");
        assert_eq!(p.logprobs, Some(3));
        let p = completion(json!({"prompt": ["a", [7, 8], "c"], "n": 2})).expect("a batch");
        assert_eq!(p.input, Input::Text("a".into()));
        assert_eq!(
            p.more_inputs,
            vec![Input::Tokens(vec![7, 8]), Input::Text("c".into())]
        );
        assert_eq!(p.n, 2);
        let many: Vec<Value> = (0..=PROMPTS_MAX).map(|i| json!(i.to_string())).collect();
        for (body, param) in [
            (json!({"prompt": many}), "prompt"),
            (json!({"prompt": ["a", "b", "c", "d", "e"], "n": 16}), "n"),
            (json!({"prompt": ["a", []]}), "prompt[1]"),
            (json!({"prompt": ["a", 3]}), "prompt[1]"),
            (json!({"prompt": [[1], ["x"]]}), "prompt[1][0]"),
            (json!({"prompt": []}), "prompt"),
            (json!({"prompt": 5}), "prompt"),
            (json!({"prompt": [1, -2]}), "prompt[1]"),
            (json!({"prompt": [1, "a"]}), "prompt[1]"),
            (json!({"prompt": [1, 5_000_000_000u64]}), "prompt[1]"),
            (json!({"prompt": [true]}), "prompt[0]"),
            (json!({"prompt": "x", "logprobs": true}), "logprobs"),
            (json!({"prompt": "x", "logprobs": 21}), "logprobs"),
            (json!({"prompt": "x", "echo": true}), "echo"),
            (json!({"prompt": "x", "best_of": 2}), "best_of"),
            (json!({"prompt": "x", "suffix": "y"}), "suffix"),
            (json!({"prompt": "x", "n": 17}), "n"),
        ] {
            let e = completion(body.clone()).expect_err(&body.to_string());
            assert_eq!(e.status.as_u16(), 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
        }
    }

    #[test]
    fn chunk_usage_field_is_absent_null_or_set() {
        let mut c = ChatChunk {
            id: "chatcmpl-1".into(),
            object: "chat.completion.chunk".into(),
            created: 1,
            model: "m".into(),
            choices: vec![ChatChunkChoice {
                index: 0,
                delta: Delta {
                    role: Some("assistant".into()),
                    content: Some(String::new()),
                },
                logprobs: None,
                finish_reason: None,
            }],
            usage: None,
        };
        let v = serde_json::to_value(&c).expect("ser");
        assert!(v.get("usage").is_none());
        assert_eq!(
            v["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        assert_eq!(v["choices"][0]["finish_reason"], Value::Null);
        c.usage = Some(None);
        let v = serde_json::to_value(&c).expect("ser");
        assert_eq!(v["usage"], Value::Null);
        c.usage = Some(Some(Usage::new(3, 4)));
        c.choices.clear();
        let v = serde_json::to_value(&c).expect("ser");
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                   "prompt_tokens_details": {"cached_tokens": 0}})
        );
        assert_eq!(v["choices"], json!([]));
    }

    #[test]
    fn response_shapes_round_trip() {
        let resp = ChatCompletion {
            id: "chatcmpl-abc".into(),
            object: "chat.completion".into(),
            created: 1_700_000_000,
            model: "SmolLM2".into(),
            choices: vec![ChatChoice {
                index: 0,
                message: ChatMessageOut {
                    role: "assistant".into(),
                    content: "Paris".into(),
                },
                logprobs: Some(ChatLogprobs {
                    content: vec![TokenLogprob {
                        token: "Paris".into(),
                        logprob: -0.25,
                        bytes: b"Paris".to_vec(),
                        top_logprobs: vec![TopLogprob {
                            token: " Lyon".into(),
                            logprob: -3.5,
                            bytes: b" Lyon".to_vec(),
                        }],
                    }],
                }),
                finish_reason: Some("stop".into()),
            }],
            usage: Usage::new(10, 2),
        };
        let text = serde_json::to_string(&resp).expect("ser");
        let back: ChatCompletion = serde_json::from_str(&text).expect("de");
        assert_eq!(back, resp);
        let v: Value = serde_json::from_str(&text).expect("value");
        assert_eq!(v["choices"][0]["message"]["content"], "Paris");
        assert_eq!(v["usage"]["total_tokens"], 12);

        let mut top = Map::new();
        top.insert(" Paris".into(), json!(-0.5));
        let comp = Completion {
            id: "cmpl-abc".into(),
            object: "text_completion".into(),
            created: 1,
            model: "m".into(),
            choices: vec![CompletionChoice {
                index: 0,
                text: " Paris".into(),
                logprobs: Some(CompletionLogprobs {
                    tokens: vec![" Paris".into()],
                    token_logprobs: vec![-0.5],
                    top_logprobs: vec![top],
                    text_offset: vec![0],
                }),
                finish_reason: Some("length".into()),
            }],
            usage: Some(Some(Usage::new(5, 1))),
        };
        let text = serde_json::to_string(&comp).expect("ser");
        assert_eq!(serde_json::from_str::<Completion>(&text).expect("de"), comp);

        let models = ModelList {
            object: "list".into(),
            data: vec![ModelCard {
                id: "m".into(),
                object: "model".into(),
                created: 1,
                owned_by: "isoserve".into(),
                max_model_len: 8192,
                context_length: 8192,
            }],
        };
        let text = serde_json::to_string(&models).expect("ser");
        assert_eq!(
            serde_json::from_str::<ModelList>(&text).expect("de"),
            models
        );
    }

    #[test]
    fn error_body_is_openai_shaped() {
        let e = ApiError::invalid_type("max_tokens", "an integer, got string");
        let v = serde_json::to_value(e.body()).expect("ser");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert_eq!(v["error"]["param"], "max_tokens");
        assert_eq!(v["error"]["code"], "invalid_type");
        assert!(v["error"]["message"]
            .as_str()
            .expect("msg")
            .contains("max_tokens"));
        let back: crate::error::ErrorBody = serde_json::from_value(v).expect("de");
        assert_eq!(back, e.body());
        let ctx = ApiError::from_engine(
            &request::RequestError::ContextLengthExceeded {
                prompt: 900,
                max_tokens: 200,
                total: 1100,
                limit: 1024,
            },
            "messages",
            "top_logprobs",
        );
        assert_eq!(ctx.code, Some("context_length_exceeded"));
        assert!(ctx.message.contains("1024") && ctx.message.contains("1100"));
        assert_eq!(ctx.param.as_deref(), Some("messages"));
    }

    #[test]
    fn a_huge_number_is_shown_short_in_an_error() {
        let body = br#"{"prompt": "x", "temperature": 1e300}"#;
        let e = parse_completion(body).expect_err("out of range");
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert!(e.message.len() < 120, "{}", e.message);
        assert!(e.message.contains("1e300"), "{}", e.message);
        assert_eq!(shown_number(0.5), "0.5");
        assert_eq!(shown_number(-3.0), "-3");
    }
}
