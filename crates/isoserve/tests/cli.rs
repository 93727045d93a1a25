//! The command line's error paths: a one-line message and a non-zero exit,
//! never a panic, and nothing left half-written.

use std::process::Command;

fn isoserve() -> Command {
    Command::new(env!("CARGO_BIN_EXE_isoserve"))
}

fn temp_home(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("isoserve-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn fetch_without_python_is_a_clear_error() {
    let home = temp_home("nopython");
    let out = isoserve()
        .arg("fetch-model")
        .env("ISOSERVE_HOME", &home)
        .env("PATH", "/nonexistent")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("python3") && err.contains("--model"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    // Nothing half-written in the cache.
    let left: Vec<_> = std::fs::read_dir(&home).unwrap().collect();
    assert!(left.is_empty(), "cache not clean: {left:?}");
}

#[test]
fn missing_model_file_is_a_clear_error() {
    let out = isoserve()
        .args([
            "generate",
            "--prompt",
            "hi",
            "--model",
            "/nonexistent/model.gguf",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("isoserve: ") && err.contains("/nonexistent/model.gguf"),
        "{err}"
    );
    assert!(
        out.stdout.is_empty(),
        "stdout must carry only generated text"
    );
}

#[test]
fn corrupt_model_file_is_a_clear_error() {
    let home = temp_home("corrupt");
    let bad = home.join("bad.gguf");
    std::fs::write(&bad, b"GGUF\x03\x00\x00\x00truncated").unwrap();
    let out = isoserve()
        .args(["generate", "--prompt", "hi", "--model"])
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("isoserve: ") && !err.contains("panicked"),
        "{err}"
    );
}

#[test]
fn bad_arguments_are_refused_by_the_parser() {
    let out = isoserve()
        .args(["generate", "--prompt", "hi", "--max-tokens", "abc"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--max-tokens"));
    let out = isoserve()
        .args(["serve", "--kv-memory", "lots"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

#[test]
fn unknown_model_names_are_a_clear_error_listing_the_known_ones() {
    let home = temp_home("unknown-name");
    let out = isoserve()
        .args(["fetch-model", "llama-9000b"])
        .env("ISOSERVE_HOME", &home)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("isoserve: ")
            && err.contains("llama-9000b")
            && err.contains("smollm2-135m")
            && err.contains("gemma3-270m"),
        "{err}"
    );
    // A name that is neither a file nor a known model: the same list.
    let out = isoserve()
        .args(["generate", "--prompt", "hi", "--model", "gemma9"])
        .env("ISOSERVE_HOME", &home)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("gemma9") && err.contains("gemma3-270m"),
        "{err}"
    );
    assert!(
        std::fs::read_dir(&home).unwrap().next().is_none(),
        "nothing fetched"
    );
}

#[test]
fn bad_ids_for_logits_and_perplexity_are_clear_errors() {
    let home = temp_home("bad-ids");
    let out = isoserve()
        .args(["logits", "--ids", "1,x,3", "--out"])
        .arg(home.join("o.bin"))
        .args(["--model", "/nonexistent/model.gguf"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("isoserve: ") && !err.contains("panicked"),
        "{err}"
    );
    let out = isoserve()
        .args([
            "perplexity",
            "-f",
            "/nonexistent/text.txt",
            "--model",
            "/nonexistent/m.gguf",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("isoserve: ") && !err.contains("panicked"),
        "{err}"
    );
}

/// `isoserve generate` takes llama.cpp's grammar flags: the output follows
/// the grammar; a bad grammar is a one-line error; two grammars are the
/// parser's refusal. (The default model: scripts/test fetches it.)
#[test]
fn generate_follows_a_regex_or_a_json_schema_and_refuses_bad_ones() {
    let run = |args: &[&str]| {
        isoserve()
            .args([
                "generate",
                "--prompt",
                "The year it happened:",
                "--max-tokens",
                "24",
            ])
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&["--regex", " [12][0-9]{3}\\."]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let t = text.trim_end_matches('\n');
    assert!(
        t.len() == 6
            && t.starts_with(' ')
            && t.ends_with('.')
            && t[1..5].bytes().all(|b| b.is_ascii_digit()),
        "{t:?}"
    );
    let out = run(&[
        "--json-schema",
        r#"{"type":"object","properties":{"year":{"type":"integer","minimum":1000,"maximum":2100}},"required":["year"],"additionalProperties":false}"#,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let t = text.trim_end_matches('\n');
    assert!(t.starts_with("{\"year\": ") && t.ends_with('}'), "{t:?}");
    let out = run(&["--regex", "(unclosed"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("isoserve: ") && err.contains("regex"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let out = run(&["--regex", "a", "--json-schema", "{}"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot be used with"));
}

/// The number in `line` between `before` and the next `after`.
fn number_between(line: &str, before: &str, after: &str) -> f64 {
    let rest = &line[line
        .find(before)
        .unwrap_or_else(|| panic!("{before:?} in {line}"))
        + before.len()..];
    rest[..rest
        .find(after)
        .unwrap_or_else(|| panic!("{after:?} in {line}"))]
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{e}: {line}"))
}

/// `isoserve bench --depths` (issue 36's roofline): per depth, decode speed
/// with the bytes a token reads (the weights, and K/V at that depth) and
/// the tok/s the measured bandwidth allows; then the prefill after that
/// depth, which runs at the deepest depth the window leaves room for when
/// the depth leaves none (and says which). A depth past the window is a
/// one-line error. (The default model: scripts/test fetches it.)
#[test]
fn bench_at_depths_prints_the_roofline_and_keeps_prefill_inside_the_window() {
    let out = isoserve()
        .args([
            "bench",
            "--depths",
            "0,8180",
            "--gen-tokens",
            "4",
            "--reps",
            "1",
        ])
        .args(["--prompt-tokens", "16"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tg: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("depth ") && l.contains(": tg4 "))
        .collect();
    assert_eq!(tg.len(), 2, "{text}");
    assert!(
        tg[0].starts_with("depth 0: ") && tg[1].starts_with("depth 8180: "),
        "{text}"
    );
    let weights: Vec<f64> = tg
        .iter()
        .map(|l| number_between(l, "(weights ", "+"))
        .collect();
    let kv: Vec<f64> = tg
        .iter()
        .map(|l| number_between(l, "+ K/V ", ")"))
        .collect();
    // The default model: 96.6 MB of weights read per token; f16 K/V of 30
    // layers × 3 KV heads × 64 dims × 2 (K and V) × 2 bytes = 23,040 bytes
    // a position, at the mean depth of the 4 decoded tokens (8182).
    assert!(
        (90.0..100.0).contains(&weights[0]) && weights[0] == weights[1],
        "{text}"
    );
    assert!(kv[0] <= 0.1, "{text}");
    assert!((kv[1] - 8182.0 * 23_040.0 / 1e6).abs() < 0.1, "{text}");
    for l in &tg {
        let mb = number_between(l, "a token reads ", "MB");
        assert!(
            (mb - (number_between(l, "(weights ", "+") + number_between(l, "+ K/V ", ")"))).abs()
                < 0.11,
            "{l}"
        );
        let roofline = number_between(l, "roofline ", "tok/s");
        let gbs = number_between(l, " at ", "GB/s");
        assert!(gbs > 0.5, "{l}");
        assert!(
            (roofline - gbs * 1e3 / mb).abs() <= 1.0 + 0.01 * roofline,
            "{l}"
        );
        let tok_s = number_between(l, "): ", "tok/s");
        let reached = number_between(l, "GB/s: ", "%");
        assert!(
            (reached - 100.0 * tok_s / roofline).abs() <= 1.0 + 0.02 * reached,
            "{l}"
        );
    }
    // 8180 + 16 new tokens do not fit the 8192-token window: the prefill
    // runs after 8160 (the deepest whole page that leaves room).
    let pp: Vec<&str> = text.lines().filter(|l| l.contains(": pp16 ")).collect();
    assert_eq!(pp.len(), 2, "{text}");
    assert!(
        pp[0].starts_with("depth 0: ") && pp[1].starts_with("depth 8160: "),
        "{text}"
    );

    let out = isoserve()
        .args(["bench", "--depths", "8190", "--gen-tokens", "4"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("isoserve: ")
            && err.contains("past the model's window")
            && err.lines().count() == 1,
        "{err}"
    );
}

/// `isoserve make-draft` writes a draft of the default model's layers that
/// `serve --draft-model` takes; bad layer lists, an existing output and a
/// draft of another vocabulary are one-line errors with a non-zero exit.
#[test]
fn make_draft_writes_a_draft_and_bad_drafts_are_refused_in_one_line() {
    let dir = temp_home("drafts");
    let out_path = dir.join("d.gguf");
    let out = isoserve()
        .args(["make-draft", "--layers", "0-1,28-29", "-o"])
        .arg(&out_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let f = gguf::GgufFile::open(&out_path).unwrap();
    assert_eq!(f.get_u64("llama.block_count").unwrap(), 4);
    assert!(f.tensor_info("blk.3.ffn_down.weight").is_some());
    assert!(f.tensor_info("blk.4.ffn_down.weight").is_none());
    let one_line_error = |args: &[&str], want: &str| {
        let out = isoserve().args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    };
    let p = out_path.to_str().unwrap();
    one_line_error(&["make-draft", "--layers", "0-1", "-o", p], "exists");
    let other = dir.join("e.gguf");
    let o = other.to_str().unwrap();
    one_line_error(&["make-draft", "--layers", "3-1", "-o", o], "A <= B");
    one_line_error(
        &["make-draft", "--layers", "2,1", "-o", o],
        "increasing order",
    );
    one_line_error(
        &["make-draft", "--layers", "0-30", "-o", o],
        "the model has 30",
    );
    one_line_error(
        &[
            "serve",
            "--port",
            "0",
            "--draft-model",
            "/nonexistent/d.gguf",
        ],
        "no such file",
    );
    one_line_error(
        &[
            "serve",
            "--port",
            "0",
            "--draft-model",
            p,
            "--speculative-config",
            &format!(r#"{{"method": "draft_model", "model": "{p}"}}"#),
        ],
        "give one",
    );
    one_line_error(
        &[
            "serve",
            "--port",
            "0",
            "--speculative-config",
            r#"{"method": "draft_model"}"#,
        ],
        "needs `model`",
    );
    // A draft whose vocabulary differs (a Gemma-sized stand-in: the
    // synthetic model's) is refused at start, naming the difference.
    let synthetic = dir.join("synthetic.gguf");
    testkit::synthetic::write_synthetic_llama(&synthetic, Default::default(), 1).unwrap();
    one_line_error(
        &[
            "serve",
            "--port",
            "0",
            "--draft-model",
            synthetic.to_str().unwrap(),
        ],
        "not the model's vocabulary",
    );
    let _ = std::fs::remove_dir_all(dir);
}
