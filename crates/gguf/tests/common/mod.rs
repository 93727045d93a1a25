#![allow(dead_code)]

use std::path::PathBuf;

/// A file path in a per-process temporary directory, removed on drop.
pub struct TempPath(pub PathBuf);

impl TempPath {
    pub fn new(name: &str) -> TempPath {
        let dir = std::env::temp_dir().join(format!("isoserve-gguf-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempPath(dir.join(name))
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The real model: `ISOSERVE_MODEL` or the default cache path. Panics (so
/// the test fails, never skips) when it is missing.
pub fn model_path() -> PathBuf {
    let p = std::env::var_os("ISOSERVE_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root/.cache/isoserve/SmolLM2-135M-Instruct.Q4_1.gguf"));
    assert!(
        p.is_file(),
        "real model file {} is missing: set ISOSERVE_MODEL or download \
         SmolLM2-135M-Instruct.Q4_1.gguf there (this test fails rather than skips)",
        p.display()
    );
    p
}
