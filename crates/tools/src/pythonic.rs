//! Gemma's convention: calls written as a Python list of calls,
//! `[get_weather(city="Paris", unit="celsius"), now()]`, the form Google's
//! Gemma 3 function-calling guide prompts for (and vLLM's `pythonic`
//! parser reads). Gemma's templates have no tool section, so the server
//! describes the tools in the system text (which Gemma's template puts in
//! the first user turn) and shows past calls and results as text.
//!
//! Values are JSON under each argument's schema, except that a boolean
//! argument is Python's `True`/`False`; the parser turns what it reads
//! back into JSON (`True` → `true`, `None` → `null`).

use serde_json::{Map, Value};

use crate::parse::Event;
use crate::{Choice, ToolSet};

/// The Lark rules of one tool's call, `c{t}: "name(" args ")"`, its
/// arguments in the schema's property order, every required one present.
pub(crate) fn call_rules(t: usize, name: &str, params: &Value) -> String {
    let props: Vec<(&String, &Value)> = params
        .get("properties")
        .and_then(Value::as_object)
        .map(|m| m.iter().collect())
        .unwrap_or_default();
    let required: Vec<&str> = params
        .get("required")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let defs = params.get("$defs").cloned();
    let lit = |s: &str| Value::String(s.to_string()).to_string();
    let mut g = String::new();
    let n = props.len();
    if n == 0 {
        g.push_str(&format!("c{t}: {}\n", lit(&format!("{name}()"))));
        return g;
    }
    // `h{t}_{i}`: a non-empty list of arguments from i on; `r{t}_{i}`: ", "
    // and such a list. Every required argument from i on is in it.
    let req = |i: usize| required.contains(&props[i].0.as_str());
    let all_optional_from = |i: usize| (i..n).all(|j| !req(j));
    for (i, (key, schema)) in props.iter().enumerate() {
        let value = match schema.get("type").and_then(Value::as_str) {
            Some("boolean") if schema.as_object().is_some_and(|m| m.len() == 1) => {
                "(\"True\" | \"False\")".to_string()
            }
            _ => {
                let mut s = (*schema).clone();
                if let (Some(d), Value::Object(m)) = (&defs, &mut s) {
                    m.insert("$defs".into(), d.clone());
                }
                grammar::inline_schema(&s)
            }
        };
        g.push_str(&format!("k{t}_{i}: {} {value}\n", lit(&format!("{key}="))));
        let mut alts = Vec::new();
        if i + 1 == n || all_optional_from(i + 1) {
            alts.push(format!("k{t}_{i}"));
        }
        if i + 1 < n {
            alts.push(format!("k{t}_{i} r{t}_{}", i + 1));
            if !req(i) {
                alts.push(format!("h{t}_{}", i + 1));
            }
        }
        g.push_str(&format!("h{t}_{i}: {}\n", alts.join(" | ")));
        g.push_str(&format!("r{t}_{i}: \", \" h{t}_{i}\n"));
    }
    let args = if all_optional_from(0) {
        format!("h{t}_0?")
    } else {
        format!("h{t}_0")
    };
    g.push_str(&format!(
        "c{t}: {} {args} \")\"\n",
        lit(&format!("{name}("))
    ));
    g
}

/// The whole grammar: `[call, …]`; under `auto`, prose that does not
/// open with `[` instead.
pub(crate) fn grammar(set: &ToolSet, params: &[(String, Value)], max_calls: usize) -> String {
    let forced = matches!(set.choice, Choice::Required | Choice::Named(_));
    let mut g = String::new();
    if forced {
        g.push_str("start: calls\n");
    } else {
        g.push_str("start: TEXT | calls\nTEXT: /([^\\[](?s:.*))?/\n");
    }
    let more = match max_calls {
        1 => String::new(),
        n => format!("(\", \" call){{0,{}}}", n - 1),
    };
    g.push_str(&format!("calls: \"[\" call {more} \"]\"\n"));
    let alts: Vec<String> = (0..params.len()).map(|i| format!("c{i}")).collect();
    g.push_str(&format!("call: {}\n", alts.join(" | ")));
    for (i, (name, p)) in params.iter().enumerate() {
        g.push_str(&call_rules(i, name, p));
    }
    g
}

/// The system text that shows Gemma the tools and the one form of a call.
pub(crate) fn system_prompt(set: &ToolSet) -> String {
    let mut s = String::from(
        "You have access to functions. If you decide to invoke any of the function(s), you \
         MUST put it in the format of [func_name1(params_name1=params_value1, \
         params_name2=params_value2...), func_name2(params)]\n\
         You SHOULD NOT include any other text in the response if you call a function.\n",
    );
    let defs: Vec<Value> = set
        .callable()
        .iter()
        .map(|t| {
            let mut d = Map::new();
            d.insert("name".into(), Value::String(t.name.clone()));
            if let Some(desc) = &t.description {
                d.insert("description".into(), Value::String(desc.clone()));
            }
            d.insert("parameters".into(), t.parameters.clone());
            Value::Object(d)
        })
        .collect();
    s.push_str(&crate::py_json(&Value::Array(defs)));
    match &set.choice {
        Choice::Required => s.push_str("\nYou must call at least one function."),
        Choice::Named(n) => s.push_str(&format!("\nYou must call the function `{n}`.")),
        _ => {}
    }
    s
}

/// A JSON value as Python writes it in a call (`True`, `None`).
fn py_value(v: &Value) -> String {
    match v {
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Null => "None".into(),
        Value::Array(a) => format!(
            "[{}]",
            a.iter().map(py_value).collect::<Vec<_>>().join(", ")
        ),
        Value::Object(m) => format!(
            "{{{}}}",
            m.iter()
                .map(|(k, x)| format!("{}: {}", Value::String(k.clone()), py_value(x)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => other.to_string(),
    }
}

/// Past calls as Gemma writes them.
pub(crate) fn calls_text(calls: &[(String, Value)]) -> String {
    let items: Vec<String> = calls
        .iter()
        .map(|(name, args)| {
            let kw: Vec<String> = args
                .as_object()
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| format!("{k}={}", py_value(v)))
                        .collect()
                })
                .unwrap_or_default();
            format!("{name}({})", kw.join(", "))
        })
        .collect();
    format!("[{}]", items.join(", "))
}

/// A tool's result as Gemma's guide shows it.
pub(crate) fn result_text(content: &str) -> String {
    format!("```tool_output\n{content}\n```")
}

/// Where the reader is in a call list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    /// Before `[` (or deciding prose).
    Start,
    Prose,
    /// Reading a call's name.
    Name,
    /// Reading an argument's key.
    Key,
    /// Reading an argument's value.
    Value,
    /// After a call's `)`: `, ` or `]`.
    Between,
    Done,
}

/// The incremental reader of a Python call list.
#[derive(Debug)]
pub(crate) struct PyParser {
    at: At,
    buf: String,
    /// Calls so far: (name, arguments JSON, complete).
    pub(crate) calls: Vec<crate::Call>,
    /// Inside the value: nesting, string, escape.
    depth: usize,
    in_str: Option<char>,
    esc: bool,
    /// Arguments of the open call written so far, and its name.
    args: String,
    open_name: Option<String>,
}

impl PyParser {
    pub(crate) fn new() -> PyParser {
        PyParser {
            at: At::Start,
            buf: String::new(),
            calls: Vec::new(),
            depth: 0,
            in_str: None,
            esc: false,
            args: String::new(),
            open_name: None,
        }
    }

    fn emit_args(&mut self, text: &str, out: &mut Vec<Event>) {
        self.args.push_str(text);
        out.push(Event::Args {
            index: self.calls.len(),
            text: text.to_string(),
        });
    }

    pub(crate) fn push(&mut self, text: &str) -> Vec<Event> {
        let mut out = Vec::new();
        for c in text.chars() {
            self.char(c, &mut out);
        }
        if self.at == At::Prose && !self.buf.is_empty() {
            out.push(Event::Content(std::mem::take(&mut self.buf)));
        }
        out
    }

    fn char(&mut self, c: char, out: &mut Vec<Event>) {
        match self.at {
            At::Start => {
                if c == '[' {
                    self.at = At::Name;
                } else {
                    self.at = At::Prose;
                    self.buf.push(c);
                }
            }
            At::Prose => self.buf.push(c),
            At::Name => {
                if c == '(' {
                    let name = std::mem::take(&mut self.buf).trim().to_string();
                    // The call is filed when it closes; until then its
                    // index is the one after the filed ones.
                    out.push(Event::Begin {
                        index: self.calls.len(),
                        name: name.clone(),
                    });
                    self.open_name = Some(name);
                    self.args.clear();
                    self.emit_args("{", out);
                    self.at = At::Key;
                } else if !(c == ' ' && self.buf.is_empty()) {
                    self.buf.push(c);
                }
            }
            At::Key => match c {
                '=' => {
                    let key = std::mem::take(&mut self.buf).trim().to_string();
                    let sep = if self.args.len() > 1 { ", " } else { "" };
                    let k = format!("{sep}{}: ", Value::String(key));
                    self.emit_args(&k, out);
                    self.at = At::Value;
                }
                ')' => self.end_call(out),
                ',' => {}
                c => {
                    if !(c == ' ' && self.buf.is_empty()) {
                        self.buf.push(c);
                    }
                }
            },
            At::Value => {
                if let Some(q) = self.in_str {
                    self.buf.push(c);
                    if self.esc {
                        self.esc = false;
                    } else if c == '\\' {
                        self.esc = true;
                    } else if c == q {
                        self.in_str = None;
                    }
                    return;
                }
                match c {
                    '"' | '\'' => {
                        self.in_str = Some(c);
                        self.buf.push(c);
                    }
                    '[' | '{' | '(' => {
                        self.depth += 1;
                        self.buf.push(c);
                    }
                    ']' | '}' => {
                        self.depth = self.depth.saturating_sub(1);
                        self.buf.push(c);
                    }
                    ')' if self.depth == 0 => {
                        self.flush_value(out);
                        self.end_call(out);
                    }
                    ')' => {
                        self.depth -= 1;
                        self.buf.push(c);
                    }
                    ',' if self.depth == 0 => {
                        self.flush_value(out);
                        self.at = At::Key;
                    }
                    c => self.buf.push(c),
                }
            }
            At::Between => match c {
                ']' => self.at = At::Done,
                '(' => {}
                c if c == ',' || c.is_whitespace() => {}
                c => {
                    self.buf.push(c);
                    self.at = At::Name;
                }
            },
            At::Done => {}
        }
    }

    /// A value read whole: Python's literals as JSON's.
    fn flush_value(&mut self, out: &mut Vec<Event>) {
        let raw = std::mem::take(&mut self.buf);
        let json = py_to_json(raw.trim());
        self.emit_args(&json, out);
    }

    fn end_call(&mut self, out: &mut Vec<Event>) {
        self.emit_args("}", out);
        let name = self.open_name.take().unwrap_or_default();
        self.calls.push(crate::Call {
            name,
            arguments: std::mem::take(&mut self.args),
            complete: true,
        });
        self.buf.clear();
        self.at = At::Between;
    }

    pub(crate) fn finish(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        match self.at {
            At::Start | At::Prose if !self.buf.is_empty() => {
                out.push(Event::Content(std::mem::take(&mut self.buf)));
            }
            At::Key | At::Value if self.open_name.is_some() => {
                // Cut off inside a call: it keeps what it had.
                if self.at == At::Value && !self.buf.is_empty() {
                    let partial = std::mem::take(&mut self.buf);
                    self.emit_args(&partial, &mut out);
                }
                self.calls.push(crate::Call {
                    name: self.open_name.take().unwrap_or_default(),
                    arguments: std::mem::take(&mut self.args),
                    complete: false,
                });
            }
            At::Name => {
                // Cut off before the name was whole: shown as written.
                let name = std::mem::take(&mut self.buf);
                out.push(Event::Content(format!("[{name}")));
            }
            _ => {}
        }
        out
    }
}

/// A Python literal (or nest of them) as JSON: `True`/`False`/`None`
/// outside strings become `true`/`false`/`null`, single-quoted strings
/// double-quoted.
fn py_to_json(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                out.push('"');
                let mut esc = false;
                for d in chars.by_ref() {
                    out.push(d);
                    if esc {
                        esc = false;
                    } else if d == '\\' {
                        esc = true;
                    } else if d == '"' {
                        break;
                    }
                }
            }
            '\'' => {
                let mut inner = String::new();
                let mut esc = false;
                for d in chars.by_ref() {
                    if esc {
                        inner.push(d);
                        esc = false;
                    } else if d == '\\' {
                        esc = true;
                    } else if d == '\'' {
                        break;
                    } else {
                        inner.push(d);
                    }
                }
                out.push_str(&Value::String(inner).to_string());
            }
            c if c.is_ascii_alphabetic() => {
                let mut word = String::from(c);
                while let Some(&d) = chars.peek() {
                    if d.is_ascii_alphanumeric() || d == '_' {
                        word.push(d);
                        chars.next();
                    } else {
                        break;
                    }
                }
                out.push_str(match word.as_str() {
                    "True" => "true",
                    "False" => "false",
                    "None" => "null",
                    w => w,
                });
            }
            '(' => out.push('['),
            ')' => out.push(']'),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::Event;

    fn run(text: &str, n: usize) -> (String, Vec<(String, String)>, Vec<crate::Call>) {
        let mut p = PyParser::new();
        let mut ev = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(n) {
            ev.extend(p.push(&piece.iter().collect::<String>()));
        }
        ev.extend(p.finish());
        let mut content = String::new();
        let mut calls: Vec<(String, String)> = Vec::new();
        for e in ev {
            match e {
                Event::Content(t) => content.push_str(&t),
                Event::Begin { index, name } => {
                    assert_eq!(index, calls.len());
                    calls.push((name, String::new()));
                }
                Event::Args { index, text } => calls[index].1.push_str(&text),
            }
        }
        (content, calls, p.calls.clone())
    }

    #[test]
    fn python_calls_read_as_json_in_any_pieces() {
        let text = r#"[get_weather(city="Paris, \"FR\")", days=[1, 2], ok=True, x=None), now()]"#;
        for n in [1, 2, 5, 500] {
            let (content, folded, calls) = run(text, n);
            assert_eq!(content, "");
            assert_eq!(folded.len(), 2, "pieces of {n}");
            assert_eq!(folded[0].0, "get_weather");
            let args: Value = serde_json::from_str(&folded[0].1).unwrap();
            assert_eq!(
                args,
                serde_json::json!({"city": "Paris, \"FR\")", "days": [1, 2], "ok": true, "x": null})
            );
            assert_eq!(folded[1], ("now".to_string(), "{}".to_string()));
            assert_eq!(calls[0].arguments, folded[0].1);
            assert!(calls.iter().all(|c| c.complete));
            let (content, folded, _) = run("Sure, [it] is sunny.", n);
            assert_eq!(
                (content.as_str(), folded.len()),
                ("Sure, [it] is sunny.", 0)
            );
        }
        assert_eq!(
            calls_text(&[(
                "f".into(),
                serde_json::json!({"a": true, "b": "x", "c": [null]})
            )]),
            r#"[f(a=True, b="x", c=[None])]"#
        );
    }
}
