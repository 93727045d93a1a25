//! `tools` — tool calling, apart from HTTP. A request's tools
//! ([`ToolSet`]) meet a model through a [`Format`]: how the prompt shows
//! them, the grammar that constrains a call ([`Format::grammar`]), and the
//! parser that splits the output into content and calls
//! ([`CallParser`], incremental, so a stream sends each call's name once
//! and its arguments in pieces).
//!
//! - **Hermes** (Qwen 2.5/3, Hermes, SmolLM3): the chat template shows the
//!   tools; a call is `<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`.
//! - **Generic**, for a template with no tool format (SmolLM2's), as
//!   llama.cpp falls back: the tools are described in a system message
//!   ([`generic_system_prompt`]) and a call is one JSON object,
//!   `{"tool_calls": [{"name": …, "arguments": …}]}`.
//!
//! Under `required` or a named tool the whole output is the call, by
//! grammar. Under `auto` the model writes prose until it starts a call
//! (the format's trigger); from the trigger on the grammar holds the call
//! to a declared tool and its schema, and prose before it is free.
//!
//! ```
//! use serde_json::json;
//! use tools::{CallParser, Choice, Event, Format, Tool, ToolSet};
//! let set = ToolSet {
//!     tools: vec![Tool::new("get_weather", None, json!({"type": "object"}))],
//!     choice: Choice::Auto,
//!     parallel: true,
//! };
//! let mut p = CallParser::new(Format::Hermes);
//! let mut ev = p.push("Let me look.<tool_call>\n{\"name\": \"get_weather\", ");
//! ev.extend(p.push("\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"));
//! ev.extend(p.finish());
//! assert_eq!(ev[0], Event::Content("Let me look.".into()));
//! assert_eq!(ev[1], Event::Begin { index: 0, name: "get_weather".into() });
//! assert_eq!(p.calls()[0].arguments, r#"{"city": "Paris"}"#);
//! assert!(Format::Hermes.grammar(&set, &Default::default()).unwrap().is_some());
//! ```

#![forbid(unsafe_code)]

mod format;
mod parse;
mod pythonic;
mod reasoning;

pub use format::{
    generic_calls_text, generic_system_prompt, py_json, Format, Markers, CALLS_MAX, FORMATS,
};
pub use parse::{Call, CallParser, Event};
pub use reasoning::{
    OutputParser, Piece, ReasoningFormat, ReasoningParser, Split, REASONING_FORMATS,
};

use serde_json::Value;

/// Most tools one request may declare.
pub const TOOLS_MAX: usize = 128;
/// Longest tool name (OpenAI's bound).
pub const TOOL_NAME_BYTES_MAX: usize = 64;

/// One function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// The arguments' JSON schema (an object schema).
    pub parameters: Value,
    /// OpenAI's `strict`, as sent. Calls are generated as strict ones
    /// either way: objects without `additionalProperties` are closed.
    pub strict: bool,
}

impl Tool {
    pub fn new(name: impl Into<String>, description: Option<String>, parameters: Value) -> Tool {
        Tool {
            name: name.into(),
            description,
            parameters,
            strict: false,
        }
    }
}

/// Whether and which tool the model must call (`tool_choice`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    /// No call: the tools are not shown and nothing is parsed.
    None,
    /// The model decides; a call it starts is held to the grammar.
    Auto,
    /// At least one call, of any declared tool.
    Required,
    /// A call of this tool.
    Named(String),
}

/// A request's tools and how they may be called.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolSet {
    pub tools: Vec<Tool>,
    pub choice: Choice,
    /// `parallel_tool_calls`: more than one call in a turn.
    pub parallel: bool,
}

impl ToolSet {
    /// Whether the output is parsed for calls (tools declared and the
    /// choice not `none`).
    pub fn active(&self) -> bool {
        !self.tools.is_empty() && self.choice != Choice::None
    }

    /// The tools a call may name: the named one, or all.
    pub fn callable(&self) -> Vec<&Tool> {
        match &self.choice {
            Choice::Named(n) => self.tools.iter().filter(|t| &t.name == n).collect(),
            _ => self.tools.iter().collect(),
        }
    }
}

/// Why a tool set cannot be turned into a grammar.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolError {
    /// The tool at fault (its index in the request), if one is.
    pub tool: Option<usize>,
    pub message: String,
}

impl std::fmt::Display for ToolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ToolError {}
