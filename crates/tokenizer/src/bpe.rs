//! The tokenizer: byte-level BPE (`tokenizers`) or SentencePiece-style
//! ([`crate::spm`]), chosen by `tokenizer.ggml.model`.

use std::collections::HashMap;
use std::sync::Arc;

use gguf::GgufFile;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::AddedToken;
use tokenizers::SplitDelimiterBehavior;

use crate::error::{Result, TokenizerError};
use crate::stream::StreamDecoder;

/// GGUF token types (`tokenizer.ggml.token_type`), as in llama.cpp.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// 0
    Undefined,
    /// 1: an ordinary BPE token.
    Normal,
    /// 2
    Unknown,
    /// 3: a control/special token such as `<|im_start|>`; matched in text
    /// only when `parse_special` is set.
    Control,
    /// 4: a user-defined added token; always matched in text.
    UserDefined,
    /// 5
    Unused,
    /// 6: a raw byte token `<0xXX>`.
    Byte,
}

impl TokenType {
    /// The type for a GGUF token type id.
    pub fn from_id(id: i32) -> Option<TokenType> {
        Some(match id {
            0 => TokenType::Undefined,
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => return None,
        })
    }
}

/// Which pre-tokenizer `tokenizer.ggml.pre` selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizer {
    /// GPT-2's regex over byte-level text (`"gpt2"`, `"default"` or absent).
    Gpt2,
    /// Every digit on its own, then GPT-2's regex (`"smollm"`, `"starcoder"`,
    /// `"refact"`).
    DigitsThenGpt2,
    /// Llama 3's regex (`"llama-bpe"`, `"llama3"`): letters with one
    /// leading non-letter, numbers of up to 3 digits, then byte-level.
    Llama3,
    /// Qwen 2's regex (`"qwen2"`): as Llama 3's with one digit at a time.
    Qwen2,
    /// None: a SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`)
    /// tokenises whole pieces between special tokens.
    SentencePiece,
}

impl PreTokenizer {
    /// The pre-tokenizer for a `tokenizer.ggml.pre` value.
    pub fn from_gguf_name(name: Option<&str>) -> Result<PreTokenizer> {
        match name {
            None | Some("gpt2") | Some("default") => Ok(PreTokenizer::Gpt2),
            Some("smollm") | Some("starcoder") | Some("refact") => Ok(PreTokenizer::DigitsThenGpt2),
            Some("llama-bpe") | Some("llama3") => Ok(PreTokenizer::Llama3),
            Some("qwen2") => Ok(PreTokenizer::Qwen2),
            Some(other) => Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
        }
    }

    fn build(self) -> Result<PreTokenizerWrapper> {
        // add_prefix_space = false, trim_offsets = true, use_regex = true.
        let byte_level = ByteLevel::new(false, true, true);
        // The regex splits, then byte-level mapping without GPT-2's regex
        // (as the models' own tokenizer.json files do).
        let regex_then_bytes = |re: &str| -> Result<PreTokenizerWrapper> {
            let split = Split::new(
                SplitPattern::Regex(re.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(backend)?;
            Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Split(split),
                PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
            ])))
        };
        Ok(match self {
            PreTokenizer::Llama3 => regex_then_bytes(LLAMA3_REGEX)?,
            PreTokenizer::Qwen2 => regex_then_bytes(QWEN2_REGEX)?,
            PreTokenizer::Gpt2 => PreTokenizerWrapper::ByteLevel(byte_level),
            PreTokenizer::DigitsThenGpt2 => PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                PreTokenizerWrapper::ByteLevel(byte_level),
            ])),
            PreTokenizer::SentencePiece => {
                return Err(TokenizerError::UnsupportedModel(
                    "a SentencePiece vocabulary has no BPE pre-tokenizer".into(),
                ))
            }
        })
    }
}

/// Llama 3's pre-tokenizer regex (llama.cpp's `LLAMA3`, the model's
/// tokenizer.json).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's pre-tokenizer regex (digits one by one).
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Texts of tokens that end generation when they are control tokens (the
/// list llama.cpp uses to find end-of-generation tokens).
const EOG_TEXTS: [&str; 11] = [
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<EOT>",
    "_<EOT>",
    "<|end▁of▁sentence|>",
];

/// GPT-2's byte → character table.
pub(crate) fn byte_chars() -> [char; 256] {
    gguf::write::gpt2_byte_chars()
}

/// How text becomes ids.
enum Engine {
    /// Byte-level BPE (`tokenizer.ggml.model = "gpt2"`).
    Bpe {
        /// Matches control tokens in the input text.
        with_special: Box<tokenizers::Tokenizer>,
        /// Encodes control-token text as ordinary text.
        without_special: Box<tokenizers::Tokenizer>,
    },
    /// SentencePiece-style (`"llama"`), special tokens cut out first:
    /// `(text, id, is_control)`, longest text first.
    Spm {
        spm: Box<crate::spm::Spm>,
        specials: Vec<(String, u32, bool)>,
    },
}

struct Inner {
    engine: Engine,
    tokens: Vec<String>,
    types: Vec<TokenType>,
    /// The bytes each token decodes to.
    bytes: Vec<Box<[u8]>>,
    ids: HashMap<String, u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eos_ids: Vec<u32>,
    add_bos: bool,
    pre: PreTokenizer,
    /// Matches control tokens' texts ([`Tokenizer::control_text_in`]), and
    /// the id of each pattern.
    controls: std::sync::OnceLock<(Option<aho_corasick::AhoCorasick>, Vec<u32>)>,
}

/// A byte-level BPE tokenizer built from GGUF metadata.
///
/// Cheap to clone (the tables are shared) and `Send + Sync`.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("pre", &self.inner.pre)
            .field("bos", &self.inner.bos)
            .field("eos_ids", &self.inner.eos_ids)
            .finish()
    }
}

/// The bytes a normal token's byte-level text stands for; tokens with a
/// character outside the byte alphabet decode to their UTF-8 text (as the
/// `tokenizers` ByteLevel decoder does).
fn byte_level_bytes(text: &str, char_bytes: &HashMap<char, u8>) -> Vec<u8> {
    let mapped: Option<Vec<u8>> = text.chars().map(|c| char_bytes.get(&c).copied()).collect();
    mapped.unwrap_or_else(|| text.as_bytes().to_vec())
}

/// `<0xAB>` → `0xAB`.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

fn backend(e: tokenizers::Error) -> TokenizerError {
    TokenizerError::Backend(e)
}

impl Tokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata: `model` must be
    /// `"gpt2"`; `tokens`, `merges` are required; `token_type`, `pre`,
    /// `bos_token_id`, `eos_token_id`, `eot_token_id`, `eom_token_id` and
    /// `add_bos_token` are optional.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
        let model = file.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" && model != "llama" {
            return Err(TokenizerError::UnsupportedModel(model.to_string()));
        }
        let spm = model == "llama";
        let pre = if spm {
            PreTokenizer::SentencePiece
        } else {
            match file.get("tokenizer.ggml.pre") {
                None => PreTokenizer::from_gguf_name(None)?,
                Some(_) => PreTokenizer::from_gguf_name(Some(file.get_str("tokenizer.ggml.pre")?))?,
            }
        };
        let tokens = file.get_string_array("tokenizer.ggml.tokens")?;
        let merges = if spm {
            Vec::new()
        } else {
            file.get_string_array("tokenizer.ggml.merges")?
        };
        let types = if file.contains_key("tokenizer.ggml.token_type") {
            let raw = file.get_i32_array("tokenizer.ggml.token_type")?;
            if raw.len() != tokens.len() {
                return Err(TokenizerError::InvalidVocab(format!(
                    "{} token types for {} tokens",
                    raw.len(),
                    tokens.len()
                )));
            }
            raw.iter()
                .enumerate()
                .map(|(i, &t)| {
                    TokenType::from_id(t).ok_or_else(|| {
                        TokenizerError::InvalidVocab(format!("token {i} has unknown type {t}"))
                    })
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            vec![TokenType::Normal; tokens.len()]
        };
        let optional_id = |key: &str| -> Result<Option<u32>> {
            if file.contains_key(key) {
                Ok(Some(file.get_u32(key)?))
            } else {
                Ok(None)
            }
        };
        let bos = optional_id("tokenizer.ggml.bos_token_id")?;
        let eos = optional_id("tokenizer.ggml.eos_token_id")?;
        let eot = optional_id("tokenizer.ggml.eot_token_id")?;
        let eom = optional_id("tokenizer.ggml.eom_token_id")?;
        let add_bos = if file.contains_key("tokenizer.ggml.add_bos_token") {
            file.get_bool("tokenizer.ggml.add_bos_token")?
        } else {
            // llama.cpp's default: SentencePiece vocabularies add BOS.
            spm
        };
        if spm {
            let scores = if file.contains_key("tokenizer.ggml.scores") {
                file.get_f32_array("tokenizer.ggml.scores")?
            } else {
                Vec::new()
            };
            if !scores.is_empty() && scores.len() != tokens.len() {
                return Err(TokenizerError::InvalidVocab(format!(
                    "{} scores for {} tokens",
                    scores.len(),
                    tokens.len()
                )));
            }
            let add_space_prefix = if file.contains_key("tokenizer.ggml.add_space_prefix") {
                file.get_bool("tokenizer.ggml.add_space_prefix")?
            } else {
                true
            };
            let unk = optional_id("tokenizer.ggml.unknown_token_id")?;
            let engine = Engine::Spm {
                spm: Box::new(crate::spm::Spm::new(
                    &tokens,
                    &scores,
                    unk,
                    add_space_prefix,
                )),
                specials: Vec::new(),
            };
            return Self::build_with(
                engine,
                tokens.iter().map(|s| s.to_string()).collect(),
                types,
                bos,
                eos,
                [eot, eom].into_iter().flatten().collect(),
                add_bos,
                pre,
            );
        }
        let split_merges = merges
            .iter()
            .enumerate()
            .map(|(index, m)| {
                // Byte-level tokens never contain a space; split at the first
                // space after the first character, as llama.cpp does.
                let first_len = m.chars().next().map_or(0, char::len_utf8);
                match m[first_len..].find(' ') {
                    Some(p) => {
                        let (a, b) = m.split_at(first_len + p);
                        Ok((a.to_string(), b[1..].to_string()))
                    }
                    None => Err(TokenizerError::InvalidMerge {
                        index,
                        merge: m.to_string(),
                        reason: "no space separating the two parts".into(),
                    }),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        Self::build(
            tokens.iter().map(|s| s.to_string()).collect(),
            types,
            split_merges,
            pre,
            bos,
            eos,
            [eot, eom].into_iter().flatten().collect(),
            add_bos,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        tokens: Vec<String>,
        types: Vec<TokenType>,
        merges: Vec<(String, String)>,
        pre: PreTokenizer,
        bos: Option<u32>,
        eos: Option<u32>,
        extra_eos: Vec<u32>,
        add_bos: bool,
    ) -> Result<Tokenizer> {
        if tokens.is_empty() {
            return Err(TokenizerError::InvalidVocab("no tokens".into()));
        }
        // (Token count, special ids: checked in `build_with`.)
        // Later duplicates win, as in llama.cpp.
        let ids: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        for (index, (a, b)) in merges.iter().enumerate() {
            for part in [a, b, &format!("{a}{b}")] {
                if !ids.contains_key(part.as_str()) {
                    return Err(TokenizerError::InvalidMerge {
                        index,
                        merge: format!("{a} {b}"),
                        reason: format!("{part:?} is not in the vocabulary"),
                    });
                }
            }
        }
        let vocab: Vocab = ids.iter().map(|(k, &v)| (k.clone(), v)).collect();
        drop(ids);
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(backend)?;
        let mut with_special = tokenizers::Tokenizer::new(bpe);
        with_special.with_pre_tokenizer(Some(pre.build()?));
        let mut specials = Vec::new();
        let mut user_defined = Vec::new();
        for (t, ty) in tokens.iter().zip(&types) {
            if t.is_empty() {
                continue;
            }
            match ty {
                TokenType::Control => {
                    specials.push(AddedToken::from(t.clone(), true).normalized(false))
                }
                TokenType::UserDefined => {
                    user_defined.push(AddedToken::from(t.clone(), false).normalized(false))
                }
                _ => {}
            }
        }
        with_special.add_special_tokens(&specials);
        with_special.add_tokens(&user_defined);
        let mut without_special = with_special.clone();
        without_special.set_encode_special_tokens(true);
        let engine = Engine::Bpe {
            with_special: Box::new(with_special),
            without_special: Box::new(without_special),
        };
        Self::build_with(engine, tokens, types, bos, eos, extra_eos, add_bos, pre)
    }

    /// The tables every engine shares; SentencePiece's special-token list.
    #[allow(clippy::too_many_arguments)]
    fn build_with(
        mut engine: Engine,
        tokens: Vec<String>,
        types: Vec<TokenType>,
        bos: Option<u32>,
        eos: Option<u32>,
        extra_eos: Vec<u32>,
        add_bos: bool,
        pre: PreTokenizer,
    ) -> Result<Tokenizer> {
        if tokens.is_empty() {
            return Err(TokenizerError::InvalidVocab("no tokens".into()));
        }
        if tokens.len() != types.len() {
            return Err(TokenizerError::InvalidVocab(
                "token types do not match tokens".into(),
            ));
        }
        if u32::try_from(tokens.len()).is_err() {
            return Err(TokenizerError::InvalidVocab(format!(
                "{} tokens do not fit u32 ids",
                tokens.len()
            )));
        }
        let n = tokens.len();
        for (what, id) in [("bos", bos), ("eos", eos)]
            .into_iter()
            .chain(extra_eos.iter().map(|&i| ("eot/eom", Some(i))))
        {
            if let Some(id) = id {
                if id as usize >= n {
                    return Err(TokenizerError::InvalidVocab(format!(
                        "{what} token id {id} out of range for {n} tokens"
                    )));
                }
            }
        }
        let ids: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let spm = matches!(engine, Engine::Spm { .. });
        if let Engine::Spm { specials, .. } = &mut engine {
            for (i, (t, ty)) in tokens.iter().zip(&types).enumerate() {
                if !t.is_empty() && matches!(ty, TokenType::Control | TokenType::UserDefined) {
                    specials.push((t.clone(), i as u32, *ty == TokenType::Control));
                }
            }
            // Longer first, then by id (llama.cpp's order).
            specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        }

        let char_bytes: HashMap<char, u8> = byte_chars()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let bytes = tokens
            .iter()
            .zip(&types)
            .map(|(t, ty)| match ty {
                TokenType::Control | TokenType::UserDefined => t.as_bytes().into(),
                TokenType::Byte => match parse_byte_token(t) {
                    Some(b) => Box::from([b]),
                    None if spm => t.as_bytes().into(),
                    None => byte_level_bytes(t, &char_bytes).into(),
                },
                // SentencePiece: `▁` stands for a space.
                _ if spm => t.replace(crate::spm::SPACE, " ").into_bytes().into(),
                _ => byte_level_bytes(t, &char_bytes).into(),
            })
            .collect();

        let mut eos_ids: Vec<u32> = eos.into_iter().chain(extra_eos).collect();
        for text in EOG_TEXTS {
            if let Some(&id) = ids.get(text) {
                if types[id as usize] == TokenType::Control {
                    eos_ids.push(id);
                }
            }
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();

        Ok(Tokenizer {
            inner: Arc::new(Inner {
                engine,
                tokens,
                types,
                bytes,
                ids,
                bos,
                eos,
                eos_ids,
                add_bos,
                pre,
                controls: std::sync::OnceLock::new(),
            }),
        })
    }

    /// Encodes `text`. With `parse_special`, control-token texts such as
    /// `<|im_start|>` in `text` become their ids; without, they are encoded
    /// as ordinary text. User-defined tokens are always matched. No BOS is
    /// added (see [`add_bos`](Self::add_bos)).
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        match &self.inner.engine {
            Engine::Bpe {
                with_special,
                without_special,
            } => {
                let tk = if parse_special {
                    with_special
                } else {
                    without_special
                };
                let enc = tk.encode_fast(text, false).map_err(backend)?;
                Ok(enc.get_ids().to_vec())
            }
            Engine::Spm { spm, specials } => Ok(encode_spm(spm, specials, text, parse_special)),
        }
    }

    /// The first control token's text (`<|im_start|>`, ...) that occurs in
    /// `s`, if any: text that [`encode`](Self::encode) with
    /// `parse_special` would turn into that token.
    pub fn control_text_in(&self, s: &str) -> Option<&str> {
        let i = &self.inner;
        // One automaton over every control text, built on first use (Gemma's
        // vocabulary has thousands of them).
        let (ac, ids) = i.controls.get_or_init(|| {
            let ids: Vec<u32> = (0..i.tokens.len() as u32)
                .filter(|&id| {
                    i.types[id as usize] == TokenType::Control && !i.tokens[id as usize].is_empty()
                })
                .collect();
            let ac =
                aho_corasick::AhoCorasick::new(ids.iter().map(|&id| &i.tokens[id as usize])).ok();
            (ac, ids)
        });
        let m = ac.as_ref()?.find(s)?;
        Some(i.tokens[ids[m.pattern().as_usize()] as usize].as_str())
    }

    /// The id of the control or user-defined token whose text is `text`
    /// (`<tool_call>` in Qwen's vocabulary): a format's marker the model
    /// writes as one token.
    pub fn special_id(&self, text: &str) -> Option<u32> {
        let id = *self.inner.ids.get(text)?;
        matches!(
            self.inner.types[id as usize],
            TokenType::Control | TokenType::UserDefined
        )
        .then_some(id)
    }

    /// The bytes token `id` decodes to (control tokens: their text).
    pub fn token_bytes(&self, id: u32) -> Result<&[u8]> {
        self.inner
            .bytes
            .get(id as usize)
            .map(|b| &b[..])
            .ok_or(TokenizerError::InvalidTokenId {
                id,
                vocab_size: self.vocab_size(),
            })
    }

    /// Appends the bytes of `ids` to `out`, skipping control tokens when
    /// `skip_special`.
    pub(crate) fn extend_bytes(
        &self,
        ids: &[u32],
        skip_special: bool,
        out: &mut Vec<u8>,
    ) -> Result<()> {
        for &id in ids {
            let b = self.token_bytes(id)?;
            if !(skip_special && self.inner.types[id as usize] == TokenType::Control) {
                out.extend_from_slice(b);
            }
        }
        Ok(())
    }

    /// Decodes `ids` to text, control tokens included as their text.
    /// Invalid UTF-8 (e.g. a sequence cut inside a character) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.decode_with(ids, false)
    }

    /// Decodes `ids`, leaving control tokens out when `skip_special`.
    pub fn decode_with(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let mut bytes = Vec::new();
        self.extend_bytes(ids, skip_special, &mut bytes)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// An incremental decoder for generated tokens.
    pub fn stream_decoder(&self) -> StreamDecoder {
        StreamDecoder::new(self.clone())
    }

    /// The BOS token id (`tokenizer.ggml.bos_token_id`).
    pub fn bos_id(&self) -> Option<u32> {
        self.inner.bos
    }

    /// The EOS token id (`tokenizer.ggml.eos_token_id`).
    pub fn eos_id(&self) -> Option<u32> {
        self.inner.eos
    }

    /// Every id that ends generation, sorted: the EOS id, EOT/EOM ids if
    /// given, and control tokens with a well-known end text
    /// (`<|endoftext|>`, `<|im_end|>`, `<|eot_id|>`, ...).
    pub fn eos_ids(&self) -> &[u32] {
        &self.inner.eos_ids
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.inner.eos_ids.binary_search(&id).is_ok()
    }

    /// `tokenizer.ggml.add_bos_token` (false when absent).
    pub fn add_bos(&self) -> bool {
        self.inner.add_bos
    }

    /// Number of tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.tokens.len()
    }

    /// The vocabulary text of token `id` (byte-level form, e.g. `Ġworld`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.inner.tokens.get(id as usize).map(String::as_str)
    }

    /// The type of token `id`.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.inner.types.get(id as usize).copied()
    }

    /// The id of a vocabulary text (byte-level form), if present.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.inner.ids.get(text).copied()
    }

    /// The pre-tokenizer in use.
    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.inner.pre
    }
}

/// A piece of text being cut at special tokens.
enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

/// SentencePiece encoding with llama.cpp's special-token partition: each
/// special token in turn (longest first) is cut out of the text pieces
/// that remain; control tokens only with `parse_special`.
fn encode_spm(
    spm: &crate::spm::Spm,
    specials: &[(String, u32, bool)],
    text: &str,
    parse_special: bool,
) -> Vec<u32> {
    let mut frags = vec![Fragment::Text(text)];
    // Which byte pairs the text holds (one pass, 8 KiB): a special whose
    // first two bytes never meet in the text cannot be in any fragment of
    // it, so most of a large vocabulary's specials (Gemma has 6 414) are
    // skipped without scanning the text. Only a shortcut: the partition is
    // the same.
    let mut pairs = vec![0u64; 1024];
    for w in text.as_bytes().windows(2) {
        let at = (usize::from(w[0]) << 8) | usize::from(w[1]);
        pairs[at >> 6] |= 1 << (at & 63);
    }
    let may_hold = |sp: &str| match sp.as_bytes() {
        [a, b, ..] => {
            let at = (usize::from(*a) << 8) | usize::from(*b);
            pairs[at >> 6] & (1 << (at & 63)) != 0
        }
        _ => true,
    };
    for (sp, id, control) in specials {
        if *control && !parse_special {
            continue;
        }
        if !may_hold(sp) {
            continue;
        }
        if !frags
            .iter()
            .any(|f| matches!(f, Fragment::Text(t) if t.contains(sp.as_str())))
        {
            continue;
        }
        let mut next = Vec::with_capacity(frags.len() + 2);
        for f in frags {
            match f {
                Fragment::Text(mut t) => {
                    while let Some(at) = t.find(sp.as_str()) {
                        if at > 0 {
                            next.push(Fragment::Text(&t[..at]));
                        }
                        next.push(Fragment::Token(*id));
                        t = &t[at + sp.len()..];
                    }
                    if !t.is_empty() {
                        next.push(Fragment::Text(t));
                    }
                }
                tok => next.push(tok),
            }
        }
        frags = next;
    }
    let mut out = Vec::new();
    let mut prev_special = true;
    for f in frags {
        match f {
            Fragment::Token(id) => {
                out.push(id);
                prev_special = true;
            }
            Fragment::Text(t) => {
                // llama.cpp prefixes a space to text at the start and after
                // a special token (when the vocabulary asks for it).
                if spm.add_space_prefix() && prev_special {
                    let mut s = String::with_capacity(t.len() + 1);
                    s.push(' ');
                    s.push_str(t);
                    spm.encode_into(&s, &mut out);
                } else {
                    spm.encode_into(t, &mut out);
                }
                prev_special = false;
            }
        }
    }
    out
}

#[cfg(test)]
mod pre_tokenizer_tests {
    use super::PreTokenizer;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer as _};

    /// The pieces a pre-tokenizer cuts `text` into (byte-level characters:
    /// `Ġ` is a space).
    fn split(p: PreTokenizer, text: &str) -> Vec<String> {
        let mut s = PreTokenizedString::from(text);
        p.build().unwrap().pre_tokenize(&mut s).unwrap();
        s.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(piece, _, _)| piece.to_string())
            .collect()
    }

    /// Llama 3 keeps numbers in groups of up to three digits and
    /// contractions in any case; Qwen 2 splits every digit; both keep one
    /// leading non-letter with a word and runs of newlines apart.
    #[test]
    fn llama3_and_qwen2_regexes_cut_as_their_tokenizers_do() {
        let text = "12345 DON'T stop\n\n  x=1;";
        assert_eq!(
            split(PreTokenizer::Llama3, text),
            ["123", "45", "ĠDON", "'T", "Ġstop", "ĊĊ", "Ġ", "Ġx", "=", "1", ";"]
        );
        assert_eq!(
            split(PreTokenizer::Qwen2, text),
            ["1", "2", "3", "4", "5", "ĠDON", "'T", "Ġstop", "ĊĊ", "Ġ", "Ġx", "=", "1", ";"]
        );
    }
}
