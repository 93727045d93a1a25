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

#[allow(unused_imports)]
pub use testkit::model_path;
