//! SentencePiece-style tokenisation from a GGUF vocabulary with scores
//! (`tokenizer.ggml.model = "llama"`: Gemma, LLaMA 1/2, Mistral), as
//! llama.cpp does it — so that the ids equal the ones llama.cpp computes
//! for the same text (checked by scripts/compare-llama-cpp).
//!
//! 1. The text is cut at special tokens: user-defined ones always, control
//!    ones only when special tokens are parsed; longer tokens first.
//! 2. In each remaining piece spaces become `▁` (U+2581); a space is
//!    prepended first when the vocabulary asks (`add_space_prefix`).
//! 3. Starting from single characters, the adjacent pair whose
//!    concatenation is the vocabulary entry with the highest score is merged
//!    (ties: the leftmost), until no pair is in the vocabulary.
//! 4. Each final piece is its token (a merge is only made when its text is
//!    a token); a single character outside the vocabulary becomes the byte
//!    tokens `<0xXX>` of its UTF-8 encoding.
//!
//! ```
//! use tokenizer::spm::Spm;
//! // "▁a" and "▁ab" score higher than "ab": " ab" is one token.
//! let vocab = ["<unk>", "▁", "a", "b", "▁a", "ab", "▁ab"];
//! let scores = [0.0, -1.0, -2.0, -3.0, -1.5, -4.0, -0.5];
//! let spm = Spm::new(&vocab, &scores, Some(0), false);
//! assert_eq!(spm.encode_piece(" ab"), vec![6]);
//! assert_eq!(spm.encode_piece("ba"), vec![3, 2]);
//! ```

use std::collections::{BinaryHeap, HashMap};

/// The whitespace marker of SentencePiece vocabularies.
pub const SPACE: char = '\u{2581}';

/// A scored vocabulary and the merge search over it.
#[derive(Clone, Debug)]
pub struct Spm {
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    /// `<0xXX>` token of each byte (the unknown token when absent).
    byte_ids: [u32; 256],
    add_space_prefix: bool,
}

#[derive(Clone, Copy, Debug)]
struct Symbol {
    /// Byte range in the piece.
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of symbols `left` and its successor (`len` bytes).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    /// Highest score first; among equal scores the leftmost (llama.cpp's
    /// `llm_bigram_spm::comparator`).
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.score
            .total_cmp(&o.score)
            .then_with(|| o.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

impl Spm {
    /// `tokens[i]` has score `scores[i]` (missing scores count as 0).
    /// Later duplicates of a text win, as in llama.cpp.
    pub fn new(tokens: &[&str], scores: &[f32], unk: Option<u32>, add_space_prefix: bool) -> Spm {
        let ids: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let mut byte_ids = [unk.unwrap_or(0); 256];
        for (b, id) in byte_ids.iter_mut().enumerate() {
            if let Some(&i) = ids.get(&format!("<0x{b:02X}>")) {
                *id = i;
            }
        }
        let mut s = scores.to_vec();
        s.resize(tokens.len(), 0.0);
        Spm {
            ids,
            scores: s,
            byte_ids,
            add_space_prefix,
        }
    }

    /// Whether a space is prepended to the text (`add_space_prefix`).
    pub fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    /// Tokens of one piece of text that holds no special token (step 2–4 of
    /// the module docs, without the space prefix).
    pub fn encode_piece(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        self.encode_into(text, &mut out);
        out
    }

    pub(crate) fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        let piece: String = text
            .chars()
            .map(|c| if c == ' ' { SPACE } else { c })
            .collect();
        let mut symbols: Vec<Symbol> = Vec::with_capacity(piece.len());
        for (start, c) in piece.char_indices() {
            let i = symbols.len();
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: None,
            });
            if i > 0 {
                symbols[i - 1].next = Some(i);
            }
        }
        let mut queue = BinaryHeap::new();
        let bigram = |symbols: &[Symbol],
                      queue: &mut BinaryHeap<Bigram>,
                      left: Option<usize>,
                      right: Option<usize>| {
            let (Some(l), Some(r)) = (left, right) else {
                return;
            };
            let (a, b) = (symbols[l], symbols[r]);
            let text = &piece[a.start..a.start + a.len + b.len];
            if let Some(&id) = self.ids.get(text) {
                queue.push(Bigram {
                    score: self.scores[id as usize],
                    left: l,
                    right: r,
                    len: text.len(),
                });
            }
        };
        for i in 1..symbols.len() {
            bigram(&symbols, &mut queue, Some(i - 1), Some(i));
        }
        while let Some(g) = queue.pop() {
            let (l, r) = (symbols[g.left], symbols[g.right]);
            // Stale: one side merged away or grown since it was queued.
            if l.len == 0 || r.len == 0 || l.len + r.len != g.len {
                continue;
            }
            symbols[g.left].len += r.len;
            symbols[g.right].len = 0;
            symbols[g.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(g.left);
            }
            let (prev, next) = (symbols[g.left].prev, symbols[g.left].next);
            bigram(&symbols, &mut queue, prev, Some(g.left));
            bigram(&symbols, &mut queue, Some(g.left), next);
        }
        let mut i = Some(0);
        while let Some(k) = i {
            let s = symbols[k];
            let text = &piece[s.start..s.start + s.len];
            match self.ids.get(text) {
                Some(&id) => out.push(id),
                None => out.extend(text.bytes().map(|b| self.byte_ids[b as usize])),
            }
            i = s.next;
        }
    }
}
