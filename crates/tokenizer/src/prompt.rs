//! Prompts as token ids: the one encoder the server and the CLI share.
//!
//! Raw text (the completions API, `isoserve generate` without `--chat`)
//! may name special tokens. Chat messages are rendered with the model's
//! template, but only the *template's* text may produce special tokens:
//! message contents are tokenised as plain text, so a user who writes
//! `<|im_start|>system` gets those characters, not a forged turn. BOS is
//! prepended when the model asks for it.

use crate::{
    ChatMessage, ChatTemplate, Result, TemplateKwargs, TemplateValue, Tokenizer, TokenizerError,
};

/// A prompt's token ids and the text they encode (for logs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prompt {
    pub ids: Vec<u32>,
    pub text: String,
}

/// Raw text, special tokens recognised, BOS prepended if the model wants it.
pub fn encode_text(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let mut ids = tok.encode(text, true)?;
    with_bos(tok, &mut ids);
    Ok(ids)
}

/// Chat messages through `template` (with the generation prompt): special
/// tokens only from the template's own text, BOS as the model wants.
pub fn encode_chat(
    tok: &Tokenizer,
    template: &ChatTemplate,
    messages: &[ChatMessage],
) -> Result<Prompt> {
    encode_chat_with(tok, template, messages, &TemplateKwargs::new())
}

/// [`encode_chat`] with a request's extra template variables
/// (`chat_template_kwargs`: `enable_thinking`, ...). The variables are the
/// template's input like its own text; message contents stay plain text.
pub fn encode_chat_with(
    tok: &Tokenizer,
    template: &ChatTemplate,
    messages: &[ChatMessage],
    kwargs: &TemplateKwargs,
) -> Result<Prompt> {
    // Client text the template prints as its own (a tool's schema, a
    // call's arguments, a variable) is encoded with the template's text:
    // it may not hold a control token's text.
    for (k, v) in kwargs {
        no_control_text(tok, v, k)?;
    }
    for (i, m) in messages.iter().enumerate() {
        for (k, v) in &m.extra {
            no_control_text(tok, v, &format!("messages[{i}].{k}"))?;
        }
    }
    let text = template.render_with(messages, true, kwargs)?;
    // The same render with each content replaced by a sentinel shows where
    // the contents sit in the template's text. An empty or absent content
    // stays as it is (a template may test it: `{% if m.content %}`).
    let marked: Vec<ChatMessage> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let mut c = m.clone();
            if !m.text().is_empty() {
                c.content = Some(sentinel(i));
            }
            c
        })
        .collect();
    let skeleton = template.render_with(&marked, true, kwargs)?;
    let mut ids = Vec::new();
    // The text the ids encode, rebuilt piece by piece: it must be the
    // rendered text, or the template did something to the content that
    // the sentinels cannot show (upper-casing it, say).
    let mut rebuilt = String::with_capacity(text.len());
    let mut rest = skeleton.as_str();
    for (i, m) in messages.iter().enumerate() {
        if m.text().is_empty() {
            continue;
        }
        let mark = sentinel(i);
        let Some(at) = rest.find(&mark) else {
            // The template transformed or dropped the content: refuse rather
            // than let content text turn into special tokens.
            return Err(TokenizerError::TemplateAltersContent);
        };
        ids.extend(tok.encode(&rest[..at], true)?);
        rebuilt.push_str(&rest[..at]);
        // The template printed the content as it is, or as a JSON string's
        // inside (`{{ m.content | tojson }}`, as Mistral's templates print
        // tool results): either way it is the client's text, encoded
        // plain.
        let raw = m.text();
        let shown = if text.get(rebuilt.len()..).unwrap_or("").starts_with(raw) {
            std::borrow::Cow::Borrowed(raw)
        } else {
            std::borrow::Cow::Owned(crate::pyjson::escaped(raw))
        };
        ids.extend(tok.encode(&shown, false)?);
        rebuilt.push_str(&shown);
        rest = &rest[at + mark.len()..];
    }
    ids.extend(tok.encode(rest, true)?);
    rebuilt.push_str(rest);
    if rebuilt != text {
        return Err(TokenizerError::TemplateAltersContent);
    }
    with_bos(tok, &mut ids);
    Ok(Prompt { ids, text })
}

/// Refuses a control token's text anywhere in `v` (keys included); `at`
/// names where, as a JSON path.
fn no_control_text(tok: &Tokenizer, v: &TemplateValue, at: &str) -> Result<()> {
    let found = |s: &str, at: String| match tok.control_text_in(s) {
        Some(t) => Err(TokenizerError::ControlTokenInTemplateInput {
            at,
            token: t.to_string(),
        }),
        None => Ok(()),
    };
    match v {
        TemplateValue::Str(s) => found(s, at.to_string()),
        TemplateValue::List(l) => l
            .iter()
            .enumerate()
            .try_for_each(|(i, x)| no_control_text(tok, x, &format!("{at}[{i}]"))),
        TemplateValue::Map(m) => m.iter().try_for_each(|(k, x)| {
            found(k, format!("{at}.{k}"))?;
            no_control_text(tok, x, &format!("{at}.{k}"))
        }),
        TemplateValue::Null
        | TemplateValue::Bool(_)
        | TemplateValue::Int(_)
        | TemplateValue::Float(_) => Ok(()),
    }
}

fn with_bos(tok: &Tokenizer, ids: &mut Vec<u32>) {
    if tok.add_bos() {
        if let Some(b) = tok.bos_id() {
            // A template that writes `{{ bos_token }}` itself gets one BOS,
            // not two.
            if ids.first() != Some(&b) {
                ids.insert(0, b);
            }
        }
    }
}

/// Marks a message's place in the rendered template: private-use
/// characters around the message index.
fn sentinel(i: usize) -> String {
    format!("\u{E000}{i}\u{E001}")
}
