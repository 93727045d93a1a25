//! Cross-check of `encode` against an independent from-scratch GPT-2 BPE
//! written in plain Python (only the standard library plus the `gguf`
//! package to read the vocabulary and merges from the real model file). It
//! emulates the pre-tokenizer regex by hand, splits digits for `smollm`, and
//! applies merges by rank. FAILS, never skips, when python3, gguf or the
//! model file is missing.

mod common;

use std::process::Command;

use common::{model, model_path, TempPath, ROUND_TRIP};
use tokenizer::Tokenizer;

const REFERENCE_BPE: &str = r#"
import sys, struct, unicodedata, re
import gguf

model_path, corpus_path = sys.argv[1], sys.argv[2]
r = gguf.GGUFReader(model_path)
tokens = r.fields['tokenizer.ggml.tokens'].contents()
types = r.fields['tokenizer.ggml.token_type'].contents()
merges = r.fields['tokenizer.ggml.merges'].contents()
pre = r.fields['tokenizer.ggml.pre'].contents()
assert pre == 'smollm', pre
vocab = {t: i for i, t in enumerate(tokens)}
ranks = {}
for i, m in enumerate(merges):
    a, b = m.split(' ', 1)
    ranks[(a, b)] = i
specials = sorted((t for t, ty in zip(tokens, types) if ty == 3), key=len, reverse=True)

# GPT-2 bytes_to_unicode
bs = list(range(ord('!'), ord('~') + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
cs = bs[:]
n = 0
for b in range(256):
    if b not in bs:
        bs.append(b); cs.append(256 + n); n += 1
byte_char = {b: chr(c) for b, c in zip(bs, cs)}

WS = set('\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000') | {chr(c) for c in range(0x2000, 0x200B)}
def is_l(c): return unicodedata.category(c)[0] == 'L'
def is_n(c): return unicodedata.category(c)[0] == 'N'
def is_ws(c): return c in WS
def is_other(c): return not (is_ws(c) or is_l(c) or is_n(c))

def gpt2_split(s):
    # 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    out, i, n = [], 0, len(s)
    while i < n:
        m = None
        for c in ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d"):
            if s.startswith(c, i):
                m = i + len(c); break
        if m is None:
            for cls in (is_l, is_n, is_other):
                j = i + 1 if s[i] == ' ' and i + 1 < n and cls(s[i + 1]) else i
                if cls(s[j]):
                    k = j
                    while k < n and cls(s[k]): k += 1
                    m = k; break
        if m is None:
            assert is_ws(s[i])
            k = i
            while k < n and is_ws(s[k]): k += 1
            if k == n: m = k
            elif k - 1 > i: m = k - 1
            else: m = i + 1
        out.append(s[i:m]); i = m
    return out

def digits_split(s):
    out, cur = [], ''
    for c in s:
        if is_n(c):
            if cur: out.append(cur)
            out.append(c); cur = ''
        else:
            cur += c
    if cur: out.append(cur)
    return out

def bpe(piece):
    parts = [byte_char[b] for b in piece.encode('utf-8')]
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            rk = ranks.get((parts[i], parts[i + 1]))
            if rk is not None and (best is None or rk < best[0]):
                best = (rk, i)
        if best is None: break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [vocab[p] for p in parts]

def encode(text, parse_special):
    segs = [text]
    if parse_special:
        segs = [x for x in re.split('(' + '|'.join(map(re.escape, specials)) + ')', text) if x]
    ids = []
    for seg in segs:
        if parse_special and seg in vocab and types[vocab[seg]] == 3:
            ids.append(vocab[seg]); continue
        for d in digits_split(seg):
            for p in gpt2_split(d):
                ids.extend(bpe(p))
    return ids

data = open(corpus_path, 'rb').read()
pos = 0
while pos < len(data):
    flag, ln = struct.unpack_from('<BI', data, pos); pos += 5
    text = data[pos:pos + ln].decode('utf-8'); pos += ln
    print(' '.join(map(str, encode(text, bool(flag)))))
"#;

fn corpus() -> Vec<String> {
    let mut c: Vec<String> = ROUND_TRIP.iter().map(|s| s.to_string()).collect();
    c.push(include_str!("../src/bpe.rs").to_string());
    c.push(include_str!("../src/chat.rs").to_string());
    c.push(include_str!("../../gguf/src/parse.rs").to_string());
    c.extend(
        [
            "don't 's 't're've'm'll'd ' s",
            "  a   b\n\n c\t\td \r\n e",
            "x  \n  y",
            "!!! ??? ... --- ***",
            "user@example.com https://example.com/a?b=c&d=e#f",
            "$1,234.56 (approx.) 50% off!!!",
            "٣ ٤٥ Arabic-Indic digits, ² superscript, Ⅻ roman, ½",
            "CamelCaseIdentifier snake_case_identifier kebab-case-identifier",
            "   ",
            " ",
            "a",
            "\u{3000}\u{3000}x",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    // Seeded random strings over well-established Unicode ranges.
    let pools: &[&str] = &[
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        " \n\t\r  ",
        "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
        "éèêëàâäôöüçñßøåæœÉÀÇ",
        "αβγδεζηθλμπσωΩΔ",
        "абвгдежзийклмнопрстуфхцчшщыэюяАБВ",
        "日本語中文字漢字的一是不了",
        "ひらがなカタカナ",
        "😀😂👍🏽🦀🎉❤️✨",
        "\u{301}\u{308}\u{200d}",
        "\u{a0}\u{2003}\u{3000}",
    ];
    let mut state = 0x0123_4567_89AB_CDEFu64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..150 {
        let len = 1 + next() % 40;
        let mut s = String::new();
        for _ in 0..len {
            let pool: Vec<char> = pools[(next() % pools.len() as u64) as usize]
                .chars()
                .collect();
            s.push(pool[(next() % pool.len() as u64) as usize]);
        }
        c.push(s);
    }
    c
}

#[test]
fn encode_matches_independent_python_bpe() {
    let tok = Tokenizer::from_gguf(&model()).unwrap();
    let corpus = corpus();
    let mut cases = Vec::new();
    let mut bytes = Vec::new();
    for s in &corpus {
        for parse_special in [false, true] {
            bytes.push(u8::from(parse_special));
            bytes.extend_from_slice(&(s.len() as u32).to_le_bytes());
            bytes.extend_from_slice(s.as_bytes());
            cases.push((s, parse_special));
        }
    }
    let file = TempPath::new("corpus.bin");
    std::fs::write(&file.0, &bytes).unwrap();
    let model = model_path();
    let out = Command::new("python3")
        .arg("-c")
        .arg(REFERENCE_BPE)
        .arg(&model)
        .arg(&file.0)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run python3 ({e}): this test needs python3 with the gguf package")
        });
    assert!(
        out.status.success(),
        "python reference BPE failed (needs python3 with the gguf package):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = stdout.split('\n').collect();
    assert_eq!(
        lines.len(),
        cases.len() + 1,
        "one line per case plus the final newline"
    );
    let mut total_tokens = 0;
    for ((s, parse_special), line) in cases.iter().zip(&lines) {
        let expected: Vec<u32> = line
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect();
        let ours = tok.encode(s, *parse_special).unwrap();
        if ours != expected {
            let texts = |ids: &[u32]| -> Vec<String> {
                ids.iter()
                    .map(|&i| tok.token_text(i).unwrap_or("?").to_string())
                    .collect()
            };
            panic!(
                "encode({s:?}, parse_special={parse_special}) differs:\n ours   {:?}\n python {:?}",
                texts(&ours),
                texts(&expected)
            );
        }
        total_tokens += ours.len();
    }
    assert!(total_tokens > 10_000, "{total_tokens}");
}
