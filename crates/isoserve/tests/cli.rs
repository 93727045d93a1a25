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
