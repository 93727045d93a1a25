#![allow(dead_code)]

use std::path::PathBuf;

use gguf::GgufFile;

#[allow(unused_imports)]
pub use testkit::model_path;

pub fn model() -> GgufFile {
    GgufFile::open(model_path()).expect("open the real model")
}

/// A file path in a per-process temporary directory, removed on drop.
pub struct TempPath(pub PathBuf);

impl TempPath {
    pub fn new(name: &str) -> TempPath {
        let dir =
            std::env::temp_dir().join(format!("isoserve-tokenizer-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempPath(dir.join(name))
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Strings for round trips: unicode, emoji, code, numbers, whitespace runs.
pub const ROUND_TRIP: &[&str] = &[
    "",
    "Hello",
    "Hello world",
    " Hello  world   ",
    "The quick brown fox jumps over the lazy dog.",
    "\n",
    "\n\n\n",
    "\t\tindented\r\nwindows line\r\n",
    "    four spaces then text",
    "trailing spaces    ",
    "12345",
    "3.14159 and 2,718,281 and -42 and 1e-9",
    "In 2024, 1 in 1000 people (0.1%) said so.",
    "I'm, you're, we'll, they'd, it's, I've, DON'T",
    "héllo wörld — naïve café, Straße",
    "日本語のテキストです。中文文本。한국어 텍스트",
    "Привет, мир! Ελληνικά. עברית. العربية",
    "emoji: 😀👍🏽🦀 family: 👨‍👩‍👧‍👦 flag: 🇫🇷",
    "fn main() {\n    println!(\"Hello, {}!\", name);\n}\n",
    "def f(x):\n\treturn x ** 2  # square\n",
    "<div class=\"a\">&amp; &lt;tag&gt;</div>",
    "SELECT * FROM users WHERE id = 42;",
    "a\u{0}b\u{7f}c\u{1b}[31m",
    "<|im_start|>user\nHi<|im_end|>\n",
    "<|endoftext|><repo_name>x<file_sep>",
    "\u{a0}non-breaking\u{2003}em space\u{3000}ideographic",
    "math: ∑ᵢ xᵢ² ≤ ∞, ½ ⅔ ① ⑽",
    "zero\u{200b}width\u{feff}bom",
    "ǅ ﬁ ﬀ ligatures and combining e\u{301} a\u{308}",
];
