//! Tokenizer and chat template built from a GGUF file's metadata.
//!
//! [`Tokenizer::from_gguf`] builds a byte-level BPE tokenizer (the
//! `tokenizers` library, pure Rust) from `tokenizer.ggml.tokens`, `merges`
//! and `token_type`, with the pre-tokenizer `tokenizer.ggml.pre` names
//! (`smollm`: every digit split off, then GPT-2's regex; `gpt2`: GPT-2's
//! regex). Control tokens (type 3) such as `<|im_start|>` are special added
//! tokens: [`Tokenizer::encode`] maps their text to their ids only when asked
//! to (`parse_special`), so user text cannot smuggle them in.
//!
//! Decoding maps each token back to its bytes; [`StreamDecoder`] does so
//! incrementally and never emits part of a UTF-8 character.
//!
//! [`ChatTemplate::from_gguf`] compiles `tokenizer.chat_template` with
//! minijinja, configured like Hugging Face `apply_chat_template`.
//!
//! ```no_run
//! use gguf::GgufFile;
//! use tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
//!
//! # fn main() -> Result<(), tokenizer::TokenizerError> {
//! let file = GgufFile::open("/root/.cache/isoserve/SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let tok = Tokenizer::from_gguf(&file)?;
//! let chat = ChatTemplate::from_gguf(&file)?;
//!
//! let prompt = chat.render(&[ChatMessage::user("Hi")], true)?;
//! let ids = tok.encode(&prompt, true)?; // the template's <|im_start|> → id 1
//! assert_eq!(ids[0], 1);
//!
//! let mut stream = tok.stream_decoder();
//! let mut text = String::new();
//! for &id in &ids {
//!     text += &stream.push(id)?;
//! }
//! text += &stream.finish();
//! assert_eq!(text, prompt);
//! assert!(tok.eos_ids().contains(&2)); // <|im_end|>
//! # Ok(())
//! # }
//! ```

#![forbid(unsafe_code)]

mod bpe;
mod chat;
mod error;
mod prompt;
mod pyjson;
pub mod spm;
mod stream;

pub use bpe::{PreTokenizer, TokenType, Tokenizer};
pub use chat::{ChatMessage, ChatTemplate, TemplateKwargs, TemplateValue, TEMPLATE_RESERVED};
pub use error::{Result, TokenizerError};
pub use prompt::{encode_chat, encode_chat_with, encode_text, Prompt};
pub use stream::StreamDecoder;
