//! The output parser: text in, piece by piece as it is generated; content
//! and calls out. A call's name is sent once it is whole, its arguments as
//! they are written, so a stream is OpenAI's delta shape. The same parser
//! reads a whole answer, so a streamed and an unstreamed answer agree.

use crate::format::Format;

/// What the output said, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Text for the user (`content`).
    Content(String),
    /// Call `index` begins: its name.
    Begin { index: usize, name: String },
    /// More of call `index`'s arguments (JSON text).
    Args { index: usize, text: String },
}

/// A call as parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    pub name: String,
    /// The arguments' JSON text, as the model wrote it.
    pub arguments: String,
    /// Whether the call ended (its JSON closed): a call cut off by the
    /// token budget is not complete.
    pub complete: bool,
}

/// Where the output is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Nothing seen yet (the generic format decides on the first byte).
    Start,
    /// Prose: content, watching for the trigger.
    Text,
    /// Inside a call's JSON.
    Json,
    /// After a call's JSON: its closing marker, then more calls.
    After,
}

/// The incremental parser of one choice's output.
#[derive(Debug)]
pub struct CallParser {
    format: Format,
    mode: Mode,
    /// Text not yet decided (a possible trigger's start, a marker).
    held: String,
    scan: Scanner,
    calls: Vec<Call>,
    /// Gemma's Python calls have a reader of their own.
    py: Option<crate::pythonic::PyParser>,
}

impl CallParser {
    pub fn new(format: Format) -> CallParser {
        CallParser {
            format,
            mode: Mode::Start,
            held: String::new(),
            scan: Scanner::new(Self::call_depth(format)),
            calls: Vec::new(),
            py: (format == Format::Gemma).then(crate::pythonic::PyParser::new),
        }
    }

    /// Nesting of a call object in the format's JSON: Hermes's is the
    /// value itself; the generic's sits in `{"tool_calls": [ … ]}`.
    fn call_depth(format: Format) -> usize {
        match format {
            Format::Hermes | Format::Llama3 | Format::Gemma => 1,
            Format::Mistral => 2,
            Format::Generic => 3,
        }
    }

    /// The calls parsed so far.
    pub fn calls(&self) -> &[Call] {
        match &self.py {
            Some(py) => &py.calls,
            None => &self.calls,
        }
    }

    /// More output.
    pub fn push(&mut self, text: &str) -> Vec<Event> {
        if let Some(py) = &mut self.py {
            return merge(py.push(text));
        }
        let mut out = Vec::new();
        self.held.push_str(text);
        // Each pass consumes some of `held` or waits for more.
        for _ in 0..1_000_000 {
            if self.held.is_empty() || !self.step(&mut out) {
                break;
            }
        }
        merge(out)
    }

    /// The output ended: what was held back.
    pub fn finish(&mut self) -> Vec<Event> {
        if let Some(py) = &mut self.py {
            return merge(py.finish());
        }
        let mut out = Vec::new();
        match self.mode {
            Mode::Start | Mode::Text => {
                if !self.held.is_empty() {
                    out.push(Event::Content(std::mem::take(&mut self.held)));
                }
            }
            Mode::Json => {
                // Cut off inside a call: a call that began keeps what it
                // had; text before its name is shown as it was written.
                if !self.scan.flush(&mut self.calls, &mut out) {
                    let raw = std::mem::take(&mut self.scan.raw);
                    out.push(Event::Content(raw));
                }
            }
            Mode::After => {}
        }
        self.held.clear();
        merge(out)
    }

    /// One step over `held`; false: wait for more text.
    fn step(&mut self, out: &mut Vec<Event>) -> bool {
        match (self.mode, self.format) {
            (Mode::Start, Format::Generic) => {
                self.mode = if self.held.starts_with('{') {
                    Mode::Json
                } else {
                    Mode::Text
                };
                true
            }
            (Mode::Start, Format::Llama3) => {
                use crate::format::PYTHON_TAG;
                if let Some(rest) = self.held.strip_prefix(PYTHON_TAG) {
                    self.held = rest.trim_start().to_string();
                    if self.held.is_empty() {
                        return false;
                    }
                } else if PYTHON_TAG.starts_with(self.held.as_str()) {
                    return false;
                }
                self.mode = if self.held.starts_with('{') {
                    Mode::Json
                } else {
                    Mode::Text
                };
                true
            }
            // Gemma's calls have their own reader (`py`): nothing here.
            (_, Format::Gemma) => false,
            (Mode::Start, Format::Hermes | Format::Mistral) => {
                self.mode = Mode::Text;
                true
            }
            (Mode::Text, Format::Generic | Format::Llama3) => {
                out.push(Event::Content(std::mem::take(&mut self.held)));
                false
            }
            (Mode::Text, Format::Hermes | Format::Mistral) => {
                let open = match self.format {
                    Format::Mistral => crate::format::TOOL_CALLS,
                    _ => crate::format::TOOL_CALL_OPEN,
                };
                if let Some(at) = self.held.find(open) {
                    if at > 0 {
                        out.push(Event::Content(self.held[..at].to_string()));
                    }
                    self.held.drain(..at + open.len());
                    self.mode = Mode::Json;
                    self.scan = Scanner::new(Self::call_depth(self.format));
                    return true;
                }
                // Hold back what could be the trigger's start.
                let keep = partial_suffix(&self.held, open);
                let emit = self.held.len() - keep;
                if emit > 0 {
                    out.push(Event::Content(self.held[..emit].to_string()));
                    self.held.drain(..emit);
                }
                false
            }
            (Mode::Json, _) => {
                let text = std::mem::take(&mut self.held);
                let used = self.scan.feed(&text, &mut self.calls, out);
                if self.scan.done {
                    self.held = text[used..].to_string();
                    self.mode = Mode::After;
                    return true;
                }
                false
            }
            (Mode::After, Format::Generic) => {
                // Nothing follows the object but what the grammar allows
                // (nothing): whitespace is dropped.
                self.held.clear();
                false
            }
            (Mode::After, Format::Mistral) => {
                let t = self.held.trim_start();
                if t.is_empty() {
                    self.held.clear();
                    return false;
                }
                // Prose after the calls (no grammar held it): content.
                self.held = t.to_string();
                self.mode = Mode::Text;
                true
            }
            (Mode::After, Format::Llama3) => {
                let t = self.held.trim_start();
                let t = t.strip_prefix(';').map_or(t, str::trim_start);
                if t.is_empty() {
                    // Keep a `;` seen, so a next call is recognised.
                    return false;
                }
                if t.starts_with('{') {
                    self.held = t.to_string();
                    self.mode = Mode::Json;
                    self.scan = Scanner::new(Self::call_depth(self.format));
                    return true;
                }
                self.held = t.to_string();
                self.mode = Mode::Text;
                true
            }
            (Mode::After, Format::Hermes) => {
                const CLOSE: &str = "</tool_call>";
                const OPEN: &str = "<tool_call>";
                let t = self.held.trim_start();
                if let Some(rest) = t.strip_prefix(CLOSE) {
                    self.held = rest.to_string();
                    return true;
                }
                if let Some(rest) = t.strip_prefix(OPEN) {
                    self.held = rest.to_string();
                    self.mode = Mode::Json;
                    self.scan = Scanner::new(Self::call_depth(self.format));
                    return true;
                }
                if t.is_empty() || CLOSE.starts_with(t) || OPEN.starts_with(t) {
                    return false;
                }
                // Prose after the calls (no grammar held it): content.
                self.held = t.to_string();
                self.mode = Mode::Text;
                true
            }
        }
    }
}

/// Joins adjacent events of one kind (a push's pieces).
fn merge(events: Vec<Event>) -> Vec<Event> {
    let mut out: Vec<Event> = Vec::with_capacity(events.len());
    for e in events {
        match (out.last_mut(), e) {
            (Some(Event::Content(a)), Event::Content(b)) => a.push_str(&b),
            (Some(Event::Args { index: i, text: a }), Event::Args { index: j, text: b })
                if *i == j =>
            {
                a.push_str(&b)
            }
            (_, Event::Content(b)) if b.is_empty() => {}
            (_, e) => out.push(e),
        }
    }
    out
}

/// Length of the longest suffix of `s` that is a proper prefix of `marker`.
pub(crate) fn partial_suffix(s: &str, marker: &str) -> usize {
    (1..marker.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && marker.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

/// What an open container is.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Frame {
    /// An object, with the key of the member being read (if any) and
    /// whether a key comes next.
    Obj {
        key: Option<String>,
        want_key: bool,
    },
    Arr,
}

/// A streaming JSON reader that knows one thing: where call objects sit
/// (at `call_depth`), and in them the `name` and the `arguments`.
#[derive(Debug)]
struct Scanner {
    call_depth: usize,
    stack: Vec<Frame>,
    in_str: bool,
    esc: bool,
    /// The string being read is a key.
    str_key: bool,
    /// The string's raw text (escapes kept).
    sbuf: String,
    /// Reading a number or literal.
    in_prim: bool,
    /// Capturing the arguments' value: started.
    capturing: bool,
    /// The current call: name (once whole), arguments so far, whether its
    /// `Begin` was sent, how much of `args` was sent.
    name: Option<String>,
    args: String,
    begun: bool,
    sent: usize,
    /// Everything fed (for a call cut off before its name).
    raw: String,
    /// The top-level value closed.
    done: bool,
}

/// Keys that hold a call's arguments.
const ARGS_KEYS: [&str; 2] = ["arguments", "parameters"];

impl Scanner {
    fn new(call_depth: usize) -> Scanner {
        Scanner {
            call_depth,
            stack: Vec::new(),
            in_str: false,
            esc: false,
            str_key: false,
            sbuf: String::new(),
            in_prim: false,
            capturing: false,
            name: None,
            args: String::new(),
            begun: false,
            sent: 0,
            raw: String::new(),
            done: false,
        }
    }

    /// Whether the member being read is the call's arguments.
    fn at_args(&self) -> bool {
        self.stack.len() == self.call_depth
            && matches!(self.stack.last(), Some(Frame::Obj { key: Some(k), want_key: false }) if ARGS_KEYS.contains(&k.as_str()))
    }

    fn at_name(&self) -> bool {
        self.stack.len() == self.call_depth
            && matches!(self.stack.last(), Some(Frame::Obj { key: Some(k), want_key: false }) if k == "name")
    }

    /// Reads `text`; returns the bytes used (all, unless the top-level
    /// value closed inside it).
    fn feed(&mut self, text: &str, calls: &mut Vec<Call>, out: &mut Vec<Event>) -> usize {
        for (i, c) in text.char_indices() {
            if self.done {
                return i;
            }
            self.raw.push(c);
            self.char(c, calls, out);
        }
        self.send_args(calls.len(), out);
        text.len()
    }

    fn char(&mut self, c: char, calls: &mut Vec<Call>, out: &mut Vec<Event>) {
        if self.in_str {
            if self.capturing {
                self.args.push(c);
            }
            if self.esc {
                self.esc = false;
                self.sbuf.push(c);
            } else if c == '\\' {
                self.esc = true;
                self.sbuf.push(c);
            } else if c == '"' {
                self.in_str = false;
                self.string_end(calls, out);
            } else {
                self.sbuf.push(c);
            }
            return;
        }
        if self.in_prim {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '+' | '.') {
                if self.capturing {
                    self.args.push(c);
                }
                return;
            }
            self.in_prim = false;
            self.value_end(calls, out);
        }
        match c {
            '{' | '[' | '"' => {
                let key = c == '"'
                    && matches!(self.stack.last(), Some(Frame::Obj { want_key: true, .. }));
                if !key {
                    self.value_start();
                }
                if self.capturing {
                    self.args.push(c);
                }
                match c {
                    '{' => self.stack.push(Frame::Obj {
                        key: None,
                        want_key: true,
                    }),
                    '[' => self.stack.push(Frame::Arr),
                    _ => {
                        self.in_str = true;
                        self.str_key = key;
                        self.sbuf.clear();
                    }
                }
            }
            '}' | ']' => {
                let depth = self.stack.len();
                if self.capturing && depth > self.call_depth {
                    self.args.push(c);
                }
                self.stack.pop();
                if depth == self.call_depth && c == '}' {
                    self.call_end(calls, out);
                } else if self.capturing && self.stack.len() == self.call_depth {
                    self.value_end(calls, out);
                }
                if self.stack.is_empty() {
                    self.done = true;
                }
            }
            ',' => {
                if self.capturing {
                    self.args.push(c);
                }
                if let Some(Frame::Obj { key, want_key }) = self.stack.last_mut() {
                    *key = None;
                    *want_key = true;
                }
            }
            ':' => {
                if self.capturing {
                    self.args.push(c);
                }
            }
            c if c.is_whitespace() => {
                if self.capturing {
                    self.args.push(c);
                }
            }
            c => {
                // A number or a literal begins.
                self.value_start();
                self.in_prim = true;
                if self.capturing {
                    self.args.push(c);
                }
            }
        }
    }

    /// A value begins where the reader is.
    fn value_start(&mut self) {
        if !self.capturing && self.at_args() {
            self.capturing = true;
            self.args.clear();
        }
    }

    /// A value (string, number, literal, closed container) ended at the
    /// depth the reader is at.
    fn value_end(&mut self, calls: &mut [Call], out: &mut Vec<Event>) {
        if self.capturing && self.stack.len() == self.call_depth {
            self.capturing = false;
            self.send_args(calls.len(), out);
        }
    }

    fn string_end(&mut self, calls: &mut [Call], out: &mut Vec<Event>) {
        if self.str_key {
            if let Some(Frame::Obj { key, want_key }) = self.stack.last_mut() {
                let k = decode_string(&self.sbuf);
                *key = Some(k);
                *want_key = false;
            }
            return;
        }
        if !self.capturing && self.at_name() && self.name.is_none() {
            let name = decode_string(&self.sbuf);
            self.name = Some(name.clone());
            self.begun = true;
            out.push(Event::Begin {
                index: calls.len(),
                name,
            });
            self.send_args(calls.len(), out);
            return;
        }
        self.value_end(calls, out);
    }

    /// Sends the arguments written since the last send (once begun).
    fn send_args(&mut self, index: usize, out: &mut Vec<Event>) {
        if self.begun && self.args.len() > self.sent {
            out.push(Event::Args {
                index,
                text: self.args[self.sent..].to_string(),
            });
            self.sent = self.args.len();
        }
    }

    /// A call object closed.
    fn call_end(&mut self, calls: &mut Vec<Call>, out: &mut Vec<Event>) {
        if self.capturing {
            self.capturing = false;
        }
        if let Some(name) = self.name.take() {
            if self.args.is_empty() {
                self.args.push_str("{}");
            }
            self.send_args(calls.len(), out);
            calls.push(Call {
                name,
                arguments: std::mem::take(&mut self.args),
                complete: true,
            });
        }
        self.args.clear();
        self.begun = false;
        self.sent = 0;
    }

    /// The output ended inside the JSON: keep a call that began (its
    /// arguments as far as written). False: no call began.
    fn flush(&mut self, calls: &mut Vec<Call>, out: &mut Vec<Event>) -> bool {
        let had = !calls.is_empty();
        if let Some(name) = self.name.take() {
            self.send_args(calls.len(), out);
            calls.push(Call {
                name,
                arguments: std::mem::take(&mut self.args),
                complete: false,
            });
            return true;
        }
        had
    }
}

/// A JSON string's raw text (between its quotes) decoded; a malformed
/// escape is kept as written.
fn decode_string(raw: &str) -> String {
    serde_json::from_str::<String>(&format!("\"{raw}\"")).unwrap_or_else(|_| raw.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` in pieces of `n` bytes (on char boundaries).
    fn run(format: Format, text: &str, n: usize) -> (Vec<Event>, Vec<Call>) {
        let mut p = CallParser::new(format);
        let mut ev = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let mut k = n.min(rest.len());
            while !rest.is_char_boundary(k) {
                k += 1;
            }
            ev.extend(p.push(&rest[..k]));
            rest = &rest[k..];
        }
        ev.extend(p.finish());
        (ev, p.calls().to_vec())
    }

    /// The events folded the way a client's stream helper folds deltas.
    fn fold(ev: &[Event]) -> (String, Vec<(String, String)>) {
        let mut content = String::new();
        let mut calls: Vec<(String, String)> = Vec::new();
        for e in ev {
            match e {
                Event::Content(t) => content.push_str(t),
                Event::Begin { index, name } => {
                    assert_eq!(*index, calls.len(), "calls begin in order");
                    calls.push((name.clone(), String::new()));
                }
                Event::Args { index, text } => calls[*index].1.push_str(text),
            }
        }
        (content, calls)
    }

    #[test]
    fn hermes_calls_parse_alike_in_any_pieces() {
        let text = "I will check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris \\\"}\\\" <tool_call>\", \"days\": [1, {\"x\": null}], \"f\": -1.5e3}}\n</tool_call>\n<tool_call>\n{\"name\": \"t\\u00e9\", \"arguments\": {}}\n</tool_call>";
        let want_args = "{\"city\": \"Paris \\\"}\\\" <tool_call>\", \"days\": [1, {\"x\": null}], \"f\": -1.5e3}";
        for n in [1, 2, 3, 7, 1000] {
            let (ev, calls) = run(Format::Hermes, text, n);
            let (content, folded) = fold(&ev);
            assert_eq!(content, "I will check.", "pieces of {n}");
            assert_eq!(
                folded,
                vec![
                    ("get_weather".to_string(), want_args.to_string()),
                    ("té".to_string(), "{}".to_string())
                ]
            );
            assert_eq!(calls.len(), 2);
            assert_eq!(calls[0].arguments, want_args);
            assert!(calls.iter().all(|c| c.complete));
            let v: serde_json::Value = serde_json::from_str(&calls[0].arguments).unwrap();
            assert_eq!(v["days"][1]["x"], serde_json::Value::Null);
        }
    }

    #[test]
    fn prose_without_a_trigger_is_all_content_and_partial_triggers_are_released() {
        for n in [1, 4, 100] {
            let (ev, calls) = run(Format::Hermes, "a <tool_ca b <tool_", n);
            assert_eq!(fold(&ev).0, "a <tool_ca b <tool_");
            assert!(calls.is_empty());
            let (ev, calls) = run(Format::Generic, "Hello {not json", n);
            assert_eq!(fold(&ev).0, "Hello {not json");
            assert!(calls.is_empty());
        }
    }

    #[test]
    fn generic_calls_sit_in_the_envelope() {
        let text = "{\"tool_calls\": [{\"name\": \"a\", \"arguments\": {\"q\": [1, 2]}}, {\"name\": \"b\", \"arguments\": {\"s\": \"}\"}}]}";
        for n in [1, 5, 1000] {
            let (ev, calls) = run(Format::Generic, text, n);
            let (content, folded) = fold(&ev);
            assert_eq!(content, "");
            assert_eq!(
                folded,
                vec![
                    ("a".into(), "{\"q\": [1, 2]}".into()),
                    ("b".into(), "{\"s\": \"}\"}".into())
                ]
            );
            assert_eq!(calls.len(), 2);
        }
    }

    #[test]
    fn llama3_and_mistral_calls_parse_alike_in_any_pieces() {
        let text = "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"q\": \"x;y\"}}; {\"name\": \"b\", \"parameters\": {}}";
        for n in [1, 3, 1000] {
            let (ev, calls) = run(Format::Llama3, text, n);
            let (content, folded) = fold(&ev);
            assert_eq!(content, "", "pieces of {n}");
            assert_eq!(
                folded,
                vec![
                    ("a".into(), "{\"q\": \"x;y\"}".into()),
                    ("b".into(), "{}".into())
                ]
            );
            assert_eq!(calls.len(), 2);
            // Prose is content.
            let (ev, calls) = run(Format::Llama3, "The answer is {not} a call", n);
            assert_eq!(fold(&ev).0, "The answer is {not} a call");
            assert!(calls.is_empty());
            let text = "Sure. [TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"k\": [1]}}, {\"name\": \"b\", \"arguments\": {}}]";
            let (ev, calls) = run(Format::Mistral, text, n);
            let (content, folded) = fold(&ev);
            assert_eq!(content, "Sure. ");
            assert_eq!(
                folded,
                vec![
                    ("a".into(), "{\"k\": [1]}".into()),
                    ("b".into(), "{}".into())
                ]
            );
            assert!(calls.iter().all(|c| c.complete));
        }
    }

    #[test]
    fn a_call_cut_off_keeps_what_it_had() {
        let (ev, calls) = run(
            Format::Hermes,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": \"xy",
            3,
        );
        assert_eq!(fold(&ev).1, vec![("f".into(), "{\"a\": \"xy".into())]);
        assert!(!calls[0].complete);
        // Cut before the name: the text is content.
        let (ev, calls) = run(Format::Hermes, "<tool_call>\n{\"na", 3);
        assert!(calls.is_empty());
        assert_eq!(fold(&ev).0, "\n{\"na");
    }

    #[test]
    fn primitive_and_string_arguments_end_where_they_end() {
        let (_, calls) = run(
            Format::Hermes,
            "<tool_call>\n{\"name\": \"f\", \"arguments\": 12}\n</tool_call>",
            1,
        );
        assert_eq!(calls[0].arguments, "12");
        let (_, calls) = run(
            Format::Hermes,
            "<tool_call>\n{\"arguments\": \"x\", \"name\": \"f\"}\n</tool_call>",
            2,
        );
        assert_eq!(calls[0].arguments, "\"x\"");
        assert_eq!(calls[0].name, "f");
    }
}
