//! Reasoning split from the answer: models that think (Qwen 3, DeepSeek-R1
//! distills, SmolLM3) write `<think>…</think>` before they answer. The
//! parser sends the thought as reasoning and the rest as content, piece by
//! piece, like [`crate::CallParser`] (whose input is the content).

/// How a model marks its reasoning (`--reasoning-parser`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// No reasoning is split off: everything is content.
    None,
    /// `<think>…</think>` (vLLM's `deepseek_r1` and `qwen3` parsers).
    Think,
}

/// Every reasoning format by the names `--reasoning-parser` takes (vLLM's
/// names are aliases).
pub const REASONING_FORMATS: [(&str, ReasoningFormat); 4] = [
    ("none", ReasoningFormat::None),
    ("think", ReasoningFormat::Think),
    ("deepseek_r1", ReasoningFormat::Think),
    ("qwen3", ReasoningFormat::Think),
];

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

impl ReasoningFormat {
    /// The format a chat template's model thinks in: `Think` if the
    /// template writes `<think>`.
    pub fn detect(template_source: &str) -> ReasoningFormat {
        if template_source.contains(OPEN) {
            ReasoningFormat::Think
        } else {
            ReasoningFormat::None
        }
    }

    pub fn from_name(name: &str) -> Option<ReasoningFormat> {
        REASONING_FORMATS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, f)| *f)
    }

    /// A Lark grammar (root `start`) made to apply after the thought, as
    /// vLLM applies structured outputs to a thinking model's answer: the
    /// thought is free text up to `</think>`, then up to 8 whitespace
    /// characters, then the grammar. `opened`: the prompt opened the
    /// thought; else the model may open one (`<think>`) or answer at once.
    /// `None` without a reasoning format.
    pub fn after_thought(self, grammar: &str, opened: bool) -> Option<String> {
        if self == ReasoningFormat::None {
            return None;
        }
        // The grammar's root becomes `answer`: `start` is the wrapper's.
        let mut body = String::with_capacity(grammar.len() + 256);
        for line in grammar.lines() {
            match line.strip_prefix("start:") {
                Some(rest) => {
                    body.push_str("answer:");
                    body.push_str(rest);
                }
                None => body.push_str(line),
            }
            body.push('\n');
        }
        let start = if opened {
            "start: THOUGHT SEP answer\n".to_string()
        } else {
            format!("start: answer | {} THOUGHT SEP answer\n", "\"<think>\"")
        };
        Some(format!(
            "{start}THOUGHT: THOUGHT_TEXT \"</think>\"\n\
             THOUGHT_TEXT: /(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/\n\
             SEP: /[ \\t\\r\\n]{{0,8}}/\n{body}"
        ))
    }

    /// Whether a rendered prompt leaves a thought open (the template wrote
    /// `<think>` into the generation prompt, as DeepSeek-R1's does): the
    /// output then starts inside the reasoning.
    pub fn opened_by(self, prompt: &str) -> bool {
        self == ReasoningFormat::Think && prompt.trim_end().ends_with(OPEN)
    }
}

/// A piece of one choice's output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Split {
    Reasoning(String),
    Content(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Nothing decided: an opening `<think>` may come.
    Start,
    Reasoning,
    /// Just after `</think>`: leading whitespace is dropped.
    AfterClose,
    Content,
}

/// The incremental splitter of one choice's output.
#[derive(Debug)]
pub struct ReasoningParser {
    mode: Mode,
    held: String,
}

impl ReasoningParser {
    /// `opened`: the prompt left a thought open
    /// ([`ReasoningFormat::opened_by`]).
    pub fn new(opened: bool) -> ReasoningParser {
        ReasoningParser {
            mode: if opened { Mode::Reasoning } else { Mode::Start },
            held: String::new(),
        }
    }

    /// Whether the output is still inside the reasoning (or may be).
    pub fn in_reasoning(&self) -> bool {
        matches!(self.mode, Mode::Reasoning | Mode::Start)
    }

    pub fn push(&mut self, text: &str) -> Vec<Split> {
        self.held.push_str(text);
        let mut out = Vec::new();
        for _ in 0..4 {
            match self.mode {
                Mode::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.mode = Mode::Reasoning;
                        continue;
                    }
                    if OPEN.starts_with(t) {
                        // Maybe the opening tag, not whole yet.
                        break;
                    }
                    self.mode = Mode::Content;
                }
                Mode::Reasoning => {
                    if let Some(at) = self.held.find(CLOSE) {
                        if at > 0 {
                            out.push(Split::Reasoning(self.held[..at].to_string()));
                        }
                        self.held.drain(..at + CLOSE.len());
                        self.mode = Mode::AfterClose;
                        continue;
                    }
                    let keep = crate::parse::partial_suffix(&self.held, CLOSE);
                    let emit = self.held.len() - keep;
                    if emit > 0 {
                        out.push(Split::Reasoning(self.held[..emit].to_string()));
                        self.held.drain(..emit);
                    }
                    break;
                }
                Mode::AfterClose => {
                    let t = self.held.trim_start();
                    if t.is_empty() {
                        self.held.clear();
                        break;
                    }
                    self.held = t.to_string();
                    self.mode = Mode::Content;
                }
                Mode::Content => {
                    if !self.held.is_empty() {
                        out.push(Split::Content(std::mem::take(&mut self.held)));
                    }
                    break;
                }
            }
        }
        out
    }

    /// The output ended: what was held back. A thought never closed is
    /// all reasoning (as vLLM's `deepseek_r1` parser reads it).
    pub fn finish(&mut self) -> Vec<Split> {
        let held = std::mem::take(&mut self.held);
        if held.is_empty() {
            return Vec::new();
        }
        match self.mode {
            Mode::Reasoning => vec![Split::Reasoning(held)],
            Mode::Start | Mode::Content => vec![Split::Content(held)],
            Mode::AfterClose => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(opened: bool, text: &str, n: usize) -> (String, String) {
        let mut p = ReasoningParser::new(opened);
        let mut out = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(n) {
            out.extend(p.push(&piece.iter().collect::<String>()));
        }
        out.extend(p.finish());
        let (mut r, mut c) = (String::new(), String::new());
        for s in out {
            match s {
                Split::Reasoning(t) => r += &t,
                Split::Content(t) => c += &t,
            }
        }
        (r, c)
    }

    #[test]
    fn thoughts_split_from_answers_in_any_pieces() {
        for n in [1, 2, 5, 100] {
            assert_eq!(
                run(false, "<think>\nhmm, 2+2 </thin k></think>\n\nIt is 4.", n),
                ("\nhmm, 2+2 </thin k>".into(), "It is 4.".into())
            );
            // Opened by the prompt.
            assert_eq!(
                run(true, "so 4</think>Four", n),
                ("so 4".into(), "Four".into())
            );
            // Never closed: all reasoning.
            assert_eq!(
                run(true, "still going <", n),
                ("still going <".into(), "".into())
            );
            // No thought at all.
            assert_eq!(
                run(false, "  <thin> plain", n),
                ("".into(), "  <thin> plain".into())
            );
            assert_eq!(
                run(false, "Plain <think>x</think>", n),
                ("".into(), "Plain <think>x</think>".into())
            );
            // An empty thought (Qwen 3 with enable_thinking false writes
            // it into the prompt; a model may write it too).
            assert_eq!(
                run(false, "<think>\n\n</think>\n\nHi", n),
                ("\n\n".into(), "Hi".into())
            );
        }
        assert!(ReasoningFormat::Think.opened_by("<|im_start|>assistant\n<think>\n"));
        assert!(!ReasoningFormat::Think.opened_by("<think>\n\n</think>\n\n"));
        assert!(!ReasoningFormat::None.opened_by("<think>\n"));
    }
}

/// What one choice's output says, in order: thought, answer text, calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    /// Call `index` begins, with its name.
    CallBegin {
        index: usize,
        name: String,
    },
    /// More of call `index`'s arguments (JSON text).
    CallArgs {
        index: usize,
        text: String,
    },
}

/// One choice's whole output parser: the thought split off (with a
/// reasoning format), the answer parsed for calls (with active tools).
#[derive(Debug)]
pub struct OutputParser {
    reasoning: Option<ReasoningParser>,
    calls: Option<crate::CallParser>,
}

impl OutputParser {
    /// `reasoning`: `Some(opened)` to split a thought off; `calls`: the
    /// tool format, when tools are active.
    pub fn new(reasoning: Option<bool>, calls: Option<crate::Format>) -> OutputParser {
        OutputParser {
            reasoning: reasoning.map(ReasoningParser::new),
            calls: calls.map(crate::CallParser::new),
        }
    }

    /// The calls parsed so far.
    pub fn calls(&self) -> &[crate::Call] {
        self.calls.as_ref().map_or(&[], |c| c.calls())
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let splits = match &mut self.reasoning {
            Some(r) => r.push(text),
            None if text.is_empty() => Vec::new(),
            None => vec![Split::Content(text.to_string())],
        };
        self.route(splits)
    }

    pub fn finish(&mut self) -> Vec<Piece> {
        let splits = match &mut self.reasoning {
            Some(r) => r.finish(),
            None => Vec::new(),
        };
        let mut out = self.route(splits);
        if let Some(c) = &mut self.calls {
            out.extend(c.finish().into_iter().map(piece));
        }
        out
    }

    fn route(&mut self, splits: Vec<Split>) -> Vec<Piece> {
        let mut out = Vec::new();
        for s in splits {
            match s {
                Split::Reasoning(t) => out.push(Piece::Reasoning(t)),
                Split::Content(t) => match &mut self.calls {
                    Some(c) => out.extend(c.push(&t).into_iter().map(piece)),
                    None => out.push(Piece::Content(t)),
                },
            }
        }
        out
    }
}

fn piece(e: crate::Event) -> Piece {
    match e {
        crate::Event::Content(t) => Piece::Content(t),
        crate::Event::Begin { index, name } => Piece::CallBegin { index, name },
        crate::Event::Args { index, text } => Piece::CallArgs { index, text },
    }
}
