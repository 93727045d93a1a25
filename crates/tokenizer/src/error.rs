//! The crate's error type.

/// Errors building a tokenizer or chat template from GGUF metadata, encoding,
/// decoding or rendering.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// A required GGUF key is missing or has the wrong type.
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),

    /// `tokenizer.ggml.model` is not a supported tokenizer family.
    #[error("unsupported tokenizer model {0:?} (supported: \"gpt2\" byte-level BPE, \"llama\" SentencePiece)")]
    UnsupportedModel(String),

    /// `tokenizer.ggml.pre` names a pre-tokenizer this crate does not know.
    #[error("unsupported pre-tokenizer {0:?} (supported: \"llama-bpe\", \"qwen2\", \"smollm\", \"starcoder\", \"refact\", \"gpt2\", \"default\")")]
    UnsupportedPreTokenizer(String),

    /// The vocabulary arrays are inconsistent.
    #[error("invalid vocabulary: {0}")]
    InvalidVocab(String),

    /// A merge rule is malformed or refers to unknown tokens.
    #[error("invalid merge #{index} {merge:?}: {reason}")]
    InvalidMerge {
        index: usize,
        merge: String,
        reason: String,
    },

    /// The `tokenizers` library refused the model or failed to encode.
    #[error("tokenizer backend error: {0}")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync>),

    /// A token id outside the vocabulary.
    #[error("token id {id} out of range (vocabulary size {vocab_size})")]
    InvalidTokenId { id: u32, vocab_size: usize },

    /// The chat template failed to compile or render.
    #[error("chat template error: {0:#}")]
    Template(#[from] minijinja::Error),

    /// The chat template does not keep a message's content verbatim, so
    /// content and template text cannot be told apart.
    #[error("the model's chat template does not keep message content verbatim")]
    TemplateAltersContent,

    /// A request's template variable would replace one the render sets
    /// (`messages`, `bos_token`, ...).
    #[error("`{0}` is the template's own variable and cannot be passed in")]
    ReservedTemplateVariable(String),

    /// Client text the template prints outside a message's content (a
    /// tool's schema, a call's arguments, a template variable) holds a
    /// control token's text: rendered, it would be that token, a forged
    /// turn. `at` is where (`messages[2].tool_calls[0]...`, `tools[0]...`).
    #[error(
        "{at} contains the control token text {token:?}, which only the chat template may write"
    )]
    ControlTokenInTemplateInput { at: String, token: String },

    /// The chat template called `raise_exception(message)`.
    #[error("chat template raised an exception: {0}")]
    TemplateException(String),
}

/// Shorthand result type.
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;
