//! Chat templates (`tokenizer.chat_template`) rendered with minijinja.

use std::collections::BTreeMap;

use gguf::GgufFile;
use minijinja::syntax::SyntaxConfig;
use minijinja::value::Value;
use minijinja::{Environment, ErrorKind};

use crate::error::{Result, TokenizerError};

/// Template name inside the environment; no extension, so no auto-escaping.
const NAME: &str = "chat";
/// Prefix marking errors raised by the template's `raise_exception`.
const RAISE_PREFIX: &str = "raise_exception: ";
/// Instruction budget for one render: bounds a runaway template.
const FUEL: u64 = 50_000_000;

/// One chat message.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message text; `None` where the client sent `null` (an assistant
    /// turn that only calls tools): the template sees `none`.
    pub content: Option<String>,
    /// Further members the template may read, in order: `tool_calls`,
    /// `tool_call_id`, `name`, `reasoning_content`. Client-supplied text in
    /// them is the template's input like its own text (see
    /// [`crate::encode_chat_with`] for what keeps it from forging special
    /// tokens).
    pub extra: Vec<(String, TemplateValue)>,
}

impl ChatMessage {
    /// A message with any role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: Some(content.into()),
            extra: Vec::new(),
        }
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> ChatMessage {
        Self::new("system", content)
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> ChatMessage {
        Self::new("user", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> ChatMessage {
        Self::new("assistant", content)
    }

    /// The message with one more member for the template.
    pub fn with(mut self, key: impl Into<String>, value: TemplateValue) -> ChatMessage {
        self.extra.push((key.into(), value));
        self
    }

    /// The text, `""` when there is none.
    pub fn text(&self) -> &str {
        self.content.as_deref().unwrap_or("")
    }
}

/// A value a request hands the template (`chat_template_kwargs`, as
/// vLLM's and Hugging Face's `apply_chat_template` take extra variables):
/// JSON's shapes, without a JSON library here.
#[derive(Debug, Clone, PartialEq)]
pub enum TemplateValue {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<TemplateValue>),
    /// Members in the order given (a tool's JSON schema reaches the model
    /// with its properties in the client's order, as Python's dicts keep it).
    Map(Vec<(String, TemplateValue)>),
}

/// A request's extra template variables, by name.
pub type TemplateKwargs = BTreeMap<String, TemplateValue>;

/// The variables the template's render sets itself: a request may not
/// replace them.
pub const TEMPLATE_RESERVED: [&str; 5] = [
    "messages",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
    "raise_exception",
];

impl TemplateValue {
    fn to_value(&self) -> Value {
        match self {
            TemplateValue::Null => Value::from(()),
            TemplateValue::Bool(b) => Value::from(*b),
            TemplateValue::Int(i) => Value::from(*i),
            TemplateValue::Float(x) => Value::from(*x),
            TemplateValue::Str(s) => Value::from(s.as_str()),
            TemplateValue::List(l) => Value::from(l.iter().map(Self::to_value).collect::<Vec<_>>()),
            TemplateValue::Map(m) => ordered_map(m.iter().map(|(k, v)| (k.clone(), v.to_value()))),
        }
    }
}

/// A template map whose members keep the order given.
pub(crate) fn ordered_map(members: impl Iterator<Item = (String, Value)>) -> Value {
    Value::from(
        members
            .map(|(k, v)| (Value::from(k), v))
            .collect::<indexmap::IndexMap<Value, Value>>(),
    )
}

/// A compiled chat template.
///
/// Rendered like Hugging Face `apply_chat_template`: Jinja with
/// `trim_blocks` and `lstrip_blocks`, loop controls, Python string/dict/list
/// methods (`.strip()`, `.startswith()`, `.items()`, ...), and the globals
/// `messages`, `add_generation_prompt`, `bos_token`, `eos_token` and
/// `raise_exception(msg)`.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

fn token_text(file: &GgufFile, id_key: &str) -> Result<String> {
    if !file.contains_key(id_key) {
        return Ok(String::new());
    }
    let id = file.get_u32(id_key)? as usize;
    let tokens = file.get_array("tokenizer.ggml.tokens")?;
    match tokens.get(id).and_then(|v| v.as_str()) {
        Some(s) => Ok(s.to_string()),
        None => Err(TokenizerError::InvalidVocab(format!(
            "{id_key} = {id} is not a string token of the vocabulary ({} tokens)",
            tokens.len()
        ))),
    }
}

/// Gemma's turn format (for Gemma files without a template): a system
/// message opens the first user turn, `assistant` is `model`.
pub const GEMMA_TEMPLATE: &str = "{%- if messages and messages[0]['role'] == 'system' -%}{%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set rest = messages[1:] -%}{%- else -%}{%- set prefix = '' -%}{%- set rest = messages -%}{%- endif -%}{%- for m in rest -%}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\\n' }}{{ prefix if loop.first else '' }}{{ m['content'] }}{{ '<end_of_turn>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}";

/// ChatML (llama.cpp's default for files without a template).
pub const CHATML_TEMPLATE: &str = "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' }}{{ m['content'] }}{{ '<|im_end|>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}";

impl ChatTemplate {
    /// The file's template if it has one; otherwise a built-in one:
    /// [`GEMMA_TEMPLATE`] when the vocabulary has Gemma's
    /// `<start_of_turn>`/`<end_of_turn>`, else [`CHATML_TEMPLATE`] (as
    /// llama.cpp's server). The second value says which was built in.
    pub fn from_gguf_or_builtin(file: &GgufFile) -> Result<(ChatTemplate, Option<&'static str>)> {
        if file.contains_key("tokenizer.chat_template") {
            return Ok((Self::from_gguf(file)?, None));
        }
        let bos = token_text(file, "tokenizer.ggml.bos_token_id")?;
        let eos = token_text(file, "tokenizer.ggml.eos_token_id")?;
        let tokens = file.get_string_array("tokenizer.ggml.tokens")?;
        let has = |t: &str| tokens.contains(&t);
        if has("<start_of_turn>") && has("<end_of_turn>") {
            Ok((Self::new(GEMMA_TEMPLATE, bos, eos)?, Some("gemma")))
        } else {
            Ok((Self::new(CHATML_TEMPLATE, bos, eos)?, Some("chatml")))
        }
    }

    /// The template in `tokenizer.chat_template`, with `bos_token` and
    /// `eos_token` the texts of `tokenizer.ggml.bos_token_id` /
    /// `eos_token_id` (empty when absent).
    pub fn from_gguf(file: &GgufFile) -> Result<ChatTemplate> {
        let source = file.get_str("tokenizer.chat_template")?;
        let bos = token_text(file, "tokenizer.ggml.bos_token_id")?;
        let eos = token_text(file, "tokenizer.ggml.eos_token_id")?;
        Self::new(source, bos, eos)
    }

    /// A template of one's own (`--chat-template FILE`) in place of the
    /// GGUF's, with the model's `bos_token` and `eos_token` texts.
    pub fn with_source(source: impl Into<String>, file: &GgufFile) -> Result<ChatTemplate> {
        let bos = token_text(file, "tokenizer.ggml.bos_token_id")?;
        let eos = token_text(file, "tokenizer.ggml.eos_token_id")?;
        Self::new(source, bos, eos)
    }

    /// Compiles a template; syntax errors are [`TokenizerError::Template`].
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<ChatTemplate> {
        let source = source.into();
        let mut env = Environment::new();
        env.set_syntax(
            SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()?,
        );
        env.set_fuel(Some(FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", crate::pyjson::tojson);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("{RAISE_PREFIX}{msg}"),
                ))
            },
        );
        env.add_template_owned(NAME, source.clone())?;
        Ok(ChatTemplate {
            env,
            source,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The template source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The `bos_token` global.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The `eos_token` global.
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends with
    /// the opening of the assistant's turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(messages, add_generation_prompt, &TemplateKwargs::new())
    }

    /// [`ChatTemplate::render`] with a request's extra variables
    /// (`enable_thinking`, ...); a name in [`TEMPLATE_RESERVED`] is an
    /// error, never a replacement.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &TemplateKwargs,
    ) -> Result<String> {
        if let Some(k) = kwargs
            .keys()
            .find(|k| TEMPLATE_RESERVED.contains(&k.as_str()))
        {
            return Err(TokenizerError::ReservedTemplateVariable(k.clone()));
        }
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                let content = match &m.content {
                    Some(c) => Value::from(c.as_str()),
                    None => Value::from(()),
                };
                ordered_map(
                    [
                        ("role".to_string(), Value::from(m.role.as_str())),
                        ("content".to_string(), content),
                    ]
                    .into_iter()
                    .chain(m.extra.iter().map(|(k, v)| (k.clone(), v.to_value()))),
                )
            })
            .collect();
        let mut ctx: BTreeMap<String, Value> = kwargs
            .iter()
            .map(|(k, v)| (k.clone(), v.to_value()))
            .collect();
        ctx.insert("messages".to_string(), Value::from(messages));
        ctx.insert(
            "add_generation_prompt".to_string(),
            Value::from(add_generation_prompt),
        );
        ctx.insert(
            "bos_token".to_string(),
            Value::from(self.bos_token.as_str()),
        );
        ctx.insert(
            "eos_token".to_string(),
            Value::from(self.eos_token.as_str()),
        );
        let tmpl = self.env.get_template(NAME)?;
        tmpl.render(Value::from(ctx)).map_err(map_render_error)
    }
}

fn map_render_error(e: minijinja::Error) -> TokenizerError {
    // raise_exception's error may be wrapped by the engine; look through
    // the chain for it.
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = cur {
        if let Some(mj) = err.downcast_ref::<minijinja::Error>() {
            if mj.kind() == ErrorKind::InvalidOperation {
                if let Some(msg) = mj.detail().and_then(|d| d.strip_prefix(RAISE_PREFIX)) {
                    return TokenizerError::TemplateException(msg.to_string());
                }
            }
        }
        cur = err.source();
    }
    TokenizerError::Template(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thinking model's switch, as Qwen 3's template reads it.
    const THINKING: &str = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}\
        {% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not \
        enable_thinking %}<think></think>{% endif %}{% endif %}\
        {% if style is defined %}[{{ style.tone }}:{{ style.levels | join(',') }}]{% endif %}";

    #[test]
    fn kwargs_reach_the_template_and_cannot_replace_its_own_variables() {
        let t = ChatTemplate::new(THINKING, "<s>", "</s>").unwrap();
        let msgs = [ChatMessage::user("hi")];
        let plain = t.render(&msgs, true).unwrap();
        assert_eq!(plain, "<|user|>hi\n<|assistant|>");
        let off: TemplateKwargs = [("enable_thinking".to_string(), TemplateValue::Bool(false))]
            .into_iter()
            .collect();
        assert_eq!(
            t.render_with(&msgs, true, &off).unwrap(),
            "<|user|>hi\n<|assistant|><think></think>"
        );
        // Anything else passes through, nested values included.
        let style: TemplateKwargs = [(
            "style".to_string(),
            TemplateValue::Map(
                [
                    ("tone".to_string(), TemplateValue::Str("dry".into())),
                    (
                        "levels".to_string(),
                        TemplateValue::List(vec![TemplateValue::Int(1), TemplateValue::Float(2.5)]),
                    ),
                ]
                .into_iter()
                .collect(),
            ),
        )]
        .into_iter()
        .collect();
        assert!(t
            .render_with(&msgs, true, &style)
            .unwrap()
            .ends_with("[dry:1,2.5]"));
        for name in TEMPLATE_RESERVED {
            let bad: TemplateKwargs = [(name.to_string(), TemplateValue::Null)]
                .into_iter()
                .collect();
            let e = t.render_with(&msgs, true, &bad).unwrap_err();
            assert!(matches!(e, TokenizerError::ReservedTemplateVariable(ref k) if k == name));
        }
    }
}
