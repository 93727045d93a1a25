//! The formats: how a model is shown its tools, and the grammar its calls
//! are held to.

use serde_json::{json, Map, Value};

use crate::{Choice, ToolError, ToolSet};

/// Most calls in one turn (`parallel_tool_calls`): the grammar allows no
/// more, so a model that repeats a call cannot spend its whole budget.
pub const CALLS_MAX: usize = 16;

/// A way a model calls tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// No tool format in the template: the tools in a system message, a
    /// call as `{"tool_calls": [{"name": …, "arguments": …}]}`.
    Generic,
    /// `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>` (Hermes,
    /// Qwen 2.5 and 3): the template shows the tools.
    Hermes,
    /// Llama 3.1–3.3's JSON calls: `{"name": …, "parameters": …}` as the
    /// whole answer, optionally after `<|python_tag|>`, several joined by
    /// `; `.
    Llama3,
    /// Mistral's `[TOOL_CALLS]` followed by a JSON array of `{"name": …,
    /// "arguments": …}`; its templates want 9-character call ids.
    Mistral,
    /// Gemma's convention: a Python list of calls,
    /// `[get_weather(city="Paris")]`; the tools described in the system
    /// text (Gemma's templates have no tool section).
    Gemma,
}

/// Every format by the name `--tool-format` takes (vLLM's parser names
/// are aliases).
pub const FORMATS: [(&str, Format); 8] = [
    ("generic", Format::Generic),
    ("hermes", Format::Hermes),
    ("llama3", Format::Llama3),
    ("llama3_json", Format::Llama3),
    ("mistral", Format::Mistral),
    ("qwen", Format::Hermes),
    ("gemma", Format::Gemma),
    ("pythonic", Format::Gemma),
];

/// Hermes's markers.
pub(crate) const TOOL_CALL_OPEN: &str = "<tool_call>";
pub(crate) const TOOL_CALL_CLOSE: &str = "</tool_call>";
/// Llama 3's and Mistral's.
pub(crate) const PYTHON_TAG: &str = "<|python_tag|>";
pub(crate) const TOOL_CALLS: &str = "[TOOL_CALLS]";

/// Marker texts the model's vocabulary has as one special token (by id):
/// the grammar names such a marker by id, so the model writes the token
/// and not its text piece by piece. A marker not listed is text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Markers {
    pub special: Vec<(String, u32)>,
}

impl Markers {
    /// The texts a format's grammar may name: look each up in the
    /// vocabulary and list those that are special tokens.
    pub fn texts() -> [&'static str; 4] {
        [TOOL_CALL_OPEN, TOOL_CALL_CLOSE, PYTHON_TAG, TOOL_CALLS]
    }

    /// The marker whose special token `id` is, if any: its text goes to
    /// the call parser (the output's text leaves control tokens out).
    pub fn text_of(&self, id: u32) -> Option<&str> {
        self.special
            .iter()
            .find(|(_, i)| *i == id)
            .map(|(t, _)| t.as_str())
    }

    /// A token's text as the call parser must see it: a marker's text for
    /// a marker token, else `text` (what the output shows).
    pub fn visible<'a>(&'a self, id: u32, text: &'a str) -> &'a str {
        self.text_of(id).unwrap_or(text)
    }

    /// `text` in the grammar: a token reference, or a string literal.
    fn lark(&self, text: &str) -> String {
        match self.special.iter().find(|(t, _)| t == text) {
            Some((_, id)) => format!("<[{id}]>"),
            None => lark_string(text),
        }
    }

    fn is_special(&self, text: &str) -> bool {
        self.special.iter().any(|(t, _)| t == text)
    }
}

/// A Lark string literal (JSON's escapes are Lark's).
fn lark_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// Escapes `s` for use inside a `/…/` regex literal.
fn lark_regex_literal(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if c == '/' {
            out.push_str("\\/");
        } else if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
            out.push(c);
        } else {
            out.push(c);
        }
    }
    out
}

impl Format {
    /// The format a chat template speaks: Hermes if it writes
    /// `<tool_call>`, else the generic fallback.
    pub fn detect(template_source: &str) -> Format {
        if template_source.contains(TOOL_CALLS) {
            Format::Mistral
        } else if template_source.contains(TOOL_CALL_OPEN) {
            Format::Hermes
        } else if template_source.contains(PYTHON_TAG) {
            Format::Llama3
        } else if template_source.contains("<start_of_turn>") {
            Format::Gemma
        } else {
            Format::Generic
        }
    }

    /// The system text that shows a template with no tool section the
    /// tools (the generic format's and Gemma's).
    pub fn system_prompt(self, set: &ToolSet) -> String {
        match self {
            Format::Gemma => crate::pythonic::system_prompt(set),
            _ => generic_system_prompt(set),
        }
    }

    /// Past calls as this format writes them (for a template that cannot
    /// show calls): `(name, arguments)`.
    pub fn history_calls(self, calls: &[(String, Value)]) -> String {
        match self {
            Format::Gemma => crate::pythonic::calls_text(calls),
            _ => {
                let c: Vec<(String, String)> =
                    calls.iter().map(|(n, a)| (n.clone(), py_json(a))).collect();
                generic_calls_text(&c)
            }
        }
    }

    /// A past tool result as this format writes it (for a template that
    /// cannot show results).
    pub fn history_result(self, id: Option<&str>, name: Option<&str>, content: &str) -> String {
        match self {
            Format::Gemma => crate::pythonic::result_text(content),
            _ => {
                let mut r = Map::new();
                if let Some(id) = id {
                    r.insert("tool_call_id".into(), Value::String(id.to_string()));
                }
                if let Some(n) = name {
                    r.insert("name".into(), Value::String(n.to_string()));
                }
                r.insert("content".into(), Value::String(content.to_string()));
                py_json(&json!({"tool_response": Value::Object(r)}))
            }
        }
    }

    /// The key of a call's arguments in this format's JSON.
    pub fn args_key(self) -> &'static str {
        match self {
            Format::Llama3 => "parameters",
            _ => "arguments",
        }
    }

    /// Length of the call ids this format's templates accept (Mistral's
    /// want 9 letters and digits); `None`: OpenAI's `call_…`.
    pub fn call_id_len(self) -> Option<usize> {
        (self == Format::Mistral).then_some(9)
    }

    /// Its `--tool-format` name.
    pub fn name(self) -> &'static str {
        FORMATS
            .iter()
            .find(|(_, f)| *f == self)
            .map(|(n, _)| *n)
            .unwrap_or("generic")
    }

    /// The format `--tool-format NAME` names.
    pub fn from_name(name: &str) -> Option<Format> {
        FORMATS.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
    }

    /// Whether the chat template shows the tools, the calls and their
    /// results itself (else the server writes them into the messages).
    pub fn native(self) -> bool {
        !matches!(self, Format::Generic | Format::Gemma)
    }

    /// The Lark grammar the output follows, or `None` when nothing is
    /// constrained (no tools, or `tool_choice: none`).
    pub fn grammar(self, set: &ToolSet, markers: &Markers) -> Result<Option<String>, ToolError> {
        if !set.active() {
            return Ok(None);
        }
        let callable = set.callable();
        if callable.is_empty() {
            return Err(ToolError {
                tool: None,
                message: "tool_choice names a tool that is not declared".into(),
            });
        }
        let mut schemas = Vec::with_capacity(callable.len());
        for t in &callable {
            let i = set.tools.iter().position(|x| x.name == t.name);
            // Objects are closed where the schema does not say otherwise
            // (as OpenAI's strict mode and llama.cpp's converter close
            // them): a call with keys the tool never declared is no call.
            // `strict` changes nothing more here.
            let params = grammar::narrowed_schema(&t.parameters, true).map_err(|e| ToolError {
                tool: i,
                message: e.to_string(),
            })?;
            let (args, def) = embed(params, schemas.len());
            schemas.push((call_schema(&t.name, self.args_key(), args), def));
        }
        // Every tool's own definitions, under the root that holds them.
        let defs_of = |which: &[&(Value, Option<(String, Value)>)]| -> Option<Value> {
            let m: Map<String, Value> = which.iter().filter_map(|(_, d)| d.clone()).collect();
            (!m.is_empty()).then_some(Value::Object(m))
        };
        let max_calls = if set.parallel { CALLS_MAX } else { 1 };
        let forced = matches!(set.choice, Choice::Required | Choice::Named(_));
        Ok(Some(match self {
            Format::Generic => {
                let calls: Vec<Value> = schemas.iter().map(|(s, _)| s.clone()).collect();
                let mut tool_calls =
                    json!({"type": "array", "items": {"anyOf": calls}, "minItems": 1});
                tool_calls["maxItems"] = json!(max_calls);
                let mut envelope = json!({
                    "type": "object",
                    "properties": {"tool_calls": tool_calls},
                    "required": ["tool_calls"],
                    "additionalProperties": false,
                });
                if let Some(d) = defs_of(&schemas.iter().collect::<Vec<_>>()) {
                    envelope["$defs"] = d;
                }
                let body = grammar::inline_schema(&envelope);
                if forced {
                    format!("start: calls\ncalls: {body}\n")
                } else {
                    // Prose must not open with `{`: an output that does is
                    // the call, under the schema.
                    format!("start: TEXT | calls\nTEXT: /([^{{](?s:.*))?/\ncalls: {body}\n")
                }
            }
            Format::Hermes => {
                let mut g = String::new();
                let open = markers.lark(TOOL_CALL_OPEN);
                let close = markers.lark(TOOL_CALL_CLOSE);
                let more = match max_calls {
                    1 => String::new(),
                    n => format!("(\"\\n\" call){{0,{}}}", n - 1),
                };
                if forced {
                    g.push_str(&format!("start: call {more}\n"));
                } else if markers.is_special(TOOL_CALL_OPEN) {
                    // The trigger is a token no text can form: prose is free.
                    g.push_str(&format!(
                        "start: TEXT? | TEXT? call {more}\nTEXT: /(?s:.+)/\n"
                    ));
                } else {
                    // Prose is any text without the trigger; the first
                    // trigger ends it and starts the call.
                    let rx = lark_regex_literal(TOOL_CALL_OPEN);
                    g.push_str(&format!(
                        "start: FREE | LEAD body {close} {more}\n\
                         FREE: /(?s:.*)/ & ~/(?s:.*){rx}(?s:.*)/\n\
                         LEAD: FREE {}\n",
                        lark_string(TOOL_CALL_OPEN)
                    ));
                }
                g.push_str(&format!("call: {open} body {close}\n"));
                g.push_str("body: \"\\n\" args \"\\n\"\n");
                let alts: Vec<String> = (0..schemas.len()).map(|i| format!("c{i}")).collect();
                g.push_str(&format!("args: {}\n", alts.join(" | ")));
                for (i, entry) in schemas.iter().enumerate() {
                    let mut s = entry.0.clone();
                    if let Some(d) = defs_of(&[entry]) {
                        s["$defs"] = d;
                    }
                    g.push_str(&format!("c{i}: {}\n", grammar::inline_schema(&s)));
                }
                g
            }
            Format::Gemma => {
                let params: Vec<(String, Value)> = callable
                    .iter()
                    .map(|t| {
                        let p = grammar::narrowed_schema(&t.parameters, true)
                            .unwrap_or_else(|_| t.parameters.clone());
                        (t.name.clone(), p)
                    })
                    .collect();
                crate::pythonic::grammar(set, &params, max_calls)
            }
            Format::Llama3 => {
                let mut g = String::new();
                let more = match max_calls {
                    1 => String::new(),
                    n => format!("(\"; \" call){{0,{}}}", n - 1),
                };
                if forced {
                    g.push_str("start: calls\n");
                } else {
                    // Prose must not open with `{`: an answer that does is
                    // a call. The tag, when it is a token, may come first.
                    let tag = match markers.is_special(PYTHON_TAG) {
                        true => format!(" | {} calls", markers.lark(PYTHON_TAG)),
                        false => String::new(),
                    };
                    g.push_str(&format!(
                        "start: TEXT | calls{tag}\nTEXT: /([^{{](?s:.*))?/\n"
                    ));
                }
                g.push_str(&format!("calls: call {more}\n"));
                let alts: Vec<String> = (0..schemas.len()).map(|i| format!("c{i}")).collect();
                g.push_str(&format!("call: {}\n", alts.join(" | ")));
                for (i, entry) in schemas.iter().enumerate() {
                    let mut s = entry.0.clone();
                    if let Some(d) = defs_of(&[entry]) {
                        s["$defs"] = d;
                    }
                    g.push_str(&format!("c{i}: {}\n", grammar::inline_schema(&s)));
                }
                g
            }
            Format::Mistral => {
                let calls: Vec<Value> = schemas.iter().map(|(s, _)| s.clone()).collect();
                let mut list = json!({"type": "array", "items": {"anyOf": calls}, "minItems": 1,
                                      "maxItems": max_calls});
                if let Some(d) = defs_of(&schemas.iter().collect::<Vec<_>>()) {
                    list["$defs"] = d;
                }
                let body = grammar::inline_schema(&list);
                let tc = markers.lark(TOOL_CALLS);
                let mut g = String::new();
                if forced {
                    g.push_str(&format!("start: {tc} list\n"));
                } else if markers.is_special(TOOL_CALLS) {
                    g.push_str(&format!(
                        "start: TEXT? | TEXT? {tc} list\nTEXT: /(?s:.+)/\n"
                    ));
                } else {
                    let rx = lark_regex_literal(TOOL_CALLS);
                    g.push_str(&format!(
                        "start: FREE | LEAD list\n\
                         FREE: /(?s:.*)/ & ~/(?s:.*){rx}(?s:.*)/\n\
                         LEAD: FREE {}\n",
                        lark_string(TOOL_CALLS)
                    ));
                }
                g.push_str(&format!("list: {body}\n"));
                g
            }
        }))
    }
}

/// A tool's argument schema as a call schema holds it. A schema with
/// references (`$ref: "#/$defs/item"`, `"#"`) points into its own root,
/// which is no longer the root once it sits inside a call: it moves to the
/// root's `$defs` as `t{i}`, its references rewritten to point there, and
/// the arguments refer to it.
fn embed(params: Value, i: usize) -> (Value, Option<(String, Value)>) {
    fn has_ref(v: &Value) -> bool {
        match v {
            Value::Object(m) => m.contains_key("$ref") || m.values().any(has_ref),
            Value::Array(a) => a.iter().any(has_ref),
            _ => false,
        }
    }
    fn rewrite(v: &mut Value, root: &str) {
        match v {
            Value::Object(m) => {
                for (k, x) in m.iter_mut() {
                    match (k.as_str(), &*x) {
                        ("$ref", Value::String(r)) if r.starts_with('#') => {
                            *x = Value::String(format!("{root}{}", &r[1..]));
                        }
                        // `enum`, `const`, `default` and `examples` hold
                        // data, not schemas.
                        ("enum" | "const" | "default" | "examples", _) => {}
                        _ => rewrite(x, root),
                    }
                }
            }
            Value::Array(a) => a.iter_mut().for_each(|x| rewrite(x, root)),
            _ => {}
        }
    }
    if !has_ref(&params) {
        return (params, None);
    }
    let name = format!("t{i}");
    let mut p = params;
    rewrite(&mut p, &format!("#/$defs/{name}"));
    (json!({"$ref": format!("#/$defs/{name}")}), Some((name, p)))
}

/// A call of one tool: its name, then its arguments under its schema.
fn call_schema(name: &str, args_key: &str, params: Value) -> Value {
    let mut props = Map::new();
    props.insert("name".into(), json!({"const": name}));
    props.insert(args_key.into(), params);
    json!({
        "type": "object",
        "properties": props,
        "required": ["name", args_key],
        "additionalProperties": false,
    })
}

/// The system message that shows a template with no tool format the
/// tools, and the one way to call them.
pub fn generic_system_prompt(set: &ToolSet) -> String {
    let mut s = String::from(
        "You can call the following functions (tools). Each is described by its name, \
         what it does and a JSON schema of its arguments:\n",
    );
    for t in set.callable() {
        let mut d = Map::new();
        d.insert("name".into(), Value::String(t.name.clone()));
        if let Some(desc) = &t.description {
            d.insert("description".into(), Value::String(desc.clone()));
        }
        d.insert("parameters".into(), t.parameters.clone());
        s.push_str(&py_json(&Value::Object(d)));
        s.push('\n');
    }
    s.push_str(
        "\nTo call functions, reply with only a JSON object of this form and nothing else:\n\
         {\"tool_calls\": [{\"name\": \"<function name>\", \"arguments\": {<its arguments>}}]}\n",
    );
    match &set.choice {
        Choice::Auto => s.push_str("If no function is needed, reply to the user in plain text."),
        Choice::Required => s.push_str("You must call at least one function."),
        Choice::Named(n) => s.push_str(&format!("You must call the function `{n}`.")),
        Choice::None => {}
    }
    s
}

/// Calls as the generic format writes them (an assistant turn of the
/// history, shown to a template with no tool format): `(name, arguments
/// JSON text)`.
pub fn generic_calls_text(calls: &[(String, String)]) -> String {
    let items: Vec<String> = calls
        .iter()
        .map(|(n, a)| format!("{{\"name\": {}, \"arguments\": {a}}}", lark_string(n)))
        .collect();
    format!("{{\"tool_calls\": [{}]}}", items.join(", "))
}

/// JSON laid out as Python's `json.dumps` writes it (`", "`, `": "`, no
/// escaping beyond JSON's): the layout the call grammars generate, so the
/// history shows the model calls as it writes them.
pub fn py_json(v: &Value) -> String {
    let mut out = String::new();
    write_py(&mut out, v);
    out
}

fn write_py(out: &mut String, v: &Value) {
    match v {
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py(out, x);
            }
            out.push(']');
        }
        Value::Object(m) => {
            out.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(": ");
                write_py(out, x);
            }
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}
