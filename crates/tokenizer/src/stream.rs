//! Incremental decoding of generated tokens.

use crate::bpe::Tokenizer;
use crate::error::Result;

/// Decodes tokens as they arrive, emitting only complete UTF-8 characters.
///
/// A token may end inside a multi-byte character (byte-level BPE splits
/// emoji and CJK across tokens); those bytes are held back until the
/// character completes. Invalid byte sequences become U+FFFD exactly as
/// [`Tokenizer::decode`] would render them, so the concatenation of every
/// [`push`](Self::push) result and [`finish`](Self::finish) equals
/// `decode(all ids)`.
#[derive(Debug, Clone)]
pub struct StreamDecoder {
    tokenizer: Tokenizer,
    pending: Vec<u8>,
    skip_special: bool,
}

impl StreamDecoder {
    /// A decoder rendering control tokens as their text.
    pub fn new(tokenizer: Tokenizer) -> StreamDecoder {
        StreamDecoder {
            tokenizer,
            pending: Vec::new(),
            skip_special: false,
        }
    }

    /// Leaves control tokens (e.g. `<|im_end|>`) out of the text.
    pub fn skip_special(mut self, skip: bool) -> StreamDecoder {
        self.skip_special = skip;
        self
    }

    /// Adds one token; returns the text that became complete (possibly
    /// empty). An invalid id is an error and changes nothing.
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.tokenizer
            .extend_bytes(&[id], self.skip_special, &mut self.pending)?;
        Ok(self.drain_complete())
    }

    /// Adds several tokens; returns the text that became complete.
    pub fn push_all(&mut self, ids: &[u32]) -> Result<String> {
        // Validate all ids first so an error changes nothing.
        for &id in ids {
            self.tokenizer.token_bytes(id)?;
        }
        self.tokenizer
            .extend_bytes(ids, self.skip_special, &mut self.pending)?;
        Ok(self.drain_complete())
    }

    /// Bytes held back waiting for the rest of a character (at most 3).
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }

    /// Ends the stream: returns whatever is held back (an incomplete
    /// character becomes U+FFFD) and resets the decoder.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    fn drain_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            let rest = &self.pending[start..];
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    if let Ok(s) = std::str::from_utf8(&rest[..valid]) {
                        out.push_str(s);
                    }
                    match e.error_len() {
                        // An incomplete character at the end: wait for more.
                        None => {
                            start += valid;
                            break;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start += valid + bad;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}
