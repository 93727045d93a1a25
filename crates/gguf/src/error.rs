//! The crate's error type.

use std::path::PathBuf;

/// Every way reading, querying, dequantising or writing a GGUF file can fail.
///
/// Parsing never panics: any malformed input is reported as one of these.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The file could not be opened, mapped, read or written.
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The file ended before a structure it announces.
    #[error("GGUF truncated: {what} needs {needed} bytes at offset {offset}, but the file has {file_len} bytes")]
    Truncated {
        what: &'static str,
        offset: u64,
        needed: u64,
        file_len: u64,
    },

    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },

    /// Only GGUF versions 2 and 3 (little-endian) are read.
    #[error(
        "unsupported GGUF version {0} (supported: 2, 3; a big-endian file shows as a huge version)"
    )]
    UnsupportedVersion(u32),

    /// A count or length exceeds what this reader accepts (guards allocation).
    #[error("{what} is {value}, above the limit of {limit}")]
    LimitExceeded {
        what: &'static str,
        value: u64,
        limit: u64,
    },

    /// A metadata value carries a type id outside the GGUF value types.
    #[error("invalid metadata value type id {type_id} at offset {offset}")]
    InvalidValueType { type_id: u32, offset: u64 },

    /// A bool value is neither 0 nor 1.
    #[error("invalid bool byte {value} at offset {offset}")]
    InvalidBool { value: u8, offset: u64 },

    /// A string (key, value or tensor name) is not valid UTF-8.
    #[error("invalid UTF-8 in {what} at offset {offset}")]
    InvalidUtf8 { what: &'static str, offset: u64 },

    /// The same metadata key appears twice.
    #[error("duplicate metadata key {0:?}")]
    DuplicateKey(String),

    /// The same tensor name appears twice.
    #[error("duplicate tensor name {0:?}")]
    DuplicateTensor(String),

    /// `general.alignment` is zero or not a power of two.
    #[error("invalid alignment {0} (must be a non-zero power of two)")]
    BadAlignment(u64),

    /// A tensor uses a ggml type this crate does not read.
    #[error("tensor {name:?} has unsupported ggml type {} (id {type_id}); supported: F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K", type_name.unwrap_or("unknown"))]
    UnsupportedTensorType {
        name: String,
        type_id: u32,
        /// The ggml name of the type, if the id is a known ggml type.
        type_name: Option<&'static str>,
    },

    /// A tensor's shape or offset is malformed.
    #[error("invalid tensor {name:?}: {reason}")]
    InvalidTensor { name: String, reason: String },

    /// A tensor's data range does not lie inside the file.
    #[error(
        "tensor {name:?} data [{start}, {start}+{size}) lies outside the file of {file_len} bytes"
    )]
    TensorOutOfBounds {
        name: String,
        start: u64,
        size: u64,
        file_len: u64,
    },

    /// No tensor has this name.
    #[error("no tensor named {0:?}")]
    TensorNotFound(String),

    /// A metadata key is absent.
    #[error("metadata key {0:?} is missing")]
    MissingKey(String),

    /// A metadata key holds a value of another type (or out of range).
    #[error("metadata key {key:?} holds {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },

    /// A buffer passed to a (de)quantisation function has the wrong size.
    #[error("size mismatch in {what}: expected {expected}, got {actual}")]
    SizeMismatch {
        what: &'static str,
        expected: u64,
        actual: u64,
    },

    /// A caller-supplied argument is invalid (writer and helpers).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// Shorthand result type.
pub type Result<T, E = GgufError> = std::result::Result<T, E>;
