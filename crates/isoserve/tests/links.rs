//! Nothing in the repository points outside it: someone who clones
//! isoserve has only what is tracked. Every tracked text file is read;
//! a relative path (`../…`) or Markdown link that leaves the repository
//! root, a Markdown link to a file that is not there, an absolute
//! filesystem link or a `file:` URL fails, naming the file and line.

use std::path::{Component, Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `dir/target` with `.` and `..` folded; `None` when it climbs above
/// the repository root (`dir` is relative to the root).
fn resolve(dir: &Path, target: &str) -> Option<PathBuf> {
    let mut parts: Vec<String> = Vec::new();
    for c in dir.join(target).components() {
        match c {
            Component::Normal(p) => parts.push(p.to_string_lossy().into_owned()),
            Component::CurDir => {}
            Component::ParentDir => {
                parts.pop()?;
            }
            Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    Some(parts.iter().collect())
}

const DELIMS: &[char] = &[' ', '\t', '(', '"', '`', '\'', '=', '<', '['];
const ENDS: &[char] = &[' ', '\t', ')', '"', '`', '\'', '>', ']', ',', ';', '#', '?'];

/// What is wrong with `text` (the file `path`, relative to the root):
/// one line per finding. `exists` says whether a root-relative path is
/// tracked (or is a directory holding tracked files).
fn findings(path: &Path, text: &str, exists: &dyn Fn(&Path) -> bool) -> Vec<String> {
    let dir = path.parent().unwrap_or(Path::new(""));
    let markdown = path.extension().is_some_and(|e| e == "md");
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let at = format!("{}:{}", path.display(), n + 1);
        if line.contains(concat!("file", "://")) {
            out.push(format!("{at}: a file: URL"));
        }
        // The design document lived beside the repository once.
        if line.contains(concat!("shared", "/DESIGN")) {
            out.push(format!(
                "{at}: the design outside the repository (docs/design.md)"
            ));
        }
        // Relative paths that climb: `../x` after a delimiter.
        let mut i = 0;
        while let Some(k) = line[i..].find("../") {
            let start = i + k;
            let before = line[..start].chars().next_back();
            i = start + 3;
            if before.is_some_and(|c| !DELIMS.contains(&c)) {
                continue;
            }
            let token: String = line[start..]
                .chars()
                .take_while(|c| !ENDS.contains(c))
                .collect();
            if resolve(dir, &token).is_none() {
                out.push(format!("{at}: `{token}` leaves the repository"));
            }
            i = start + token.len().max(3);
        }
        let rest = line;
        // Markdown links: `](target)`.
        if markdown {
            let mut j = 0;
            while let Some(k) = rest[j..].find("](") {
                let s = j + k + 2;
                let target: String = rest[s..].chars().take_while(|c| *c != ')').collect();
                j = s;
                let target = target.split_whitespace().next().unwrap_or("");
                if target.is_empty()
                    || target.starts_with('#')
                    || target.starts_with("http://")
                    || target.starts_with("https://")
                    || target.starts_with("mailto:")
                {
                    continue;
                }
                let file = target.split(['#', '?']).next().unwrap_or("");
                if file.starts_with('/') {
                    out.push(format!("{at}: link to an absolute path `{target}`"));
                    continue;
                }
                match resolve(dir, file) {
                    None => out.push(format!("{at}: link `{target}` leaves the repository")),
                    Some(p) if !exists(&p) => {
                        out.push(format!("{at}: link `{target}` names no tracked file"))
                    }
                    Some(_) => {}
                }
            }
        }
    }
    out
}

#[test]
fn no_tracked_file_links_outside_the_repository() {
    let listed = Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root())
        .output()
        .expect("git ls-files (git is on every machine that builds isoserve)");
    assert!(listed.status.success(), "git ls-files failed");
    let files: Vec<PathBuf> = listed
        .stdout
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| PathBuf::from(String::from_utf8_lossy(s).into_owned()))
        .collect();
    assert!(files.len() > 100, "only {} tracked files", files.len());
    let exists = |p: &Path| {
        files
            .iter()
            .any(|f| f == p || (f.starts_with(p) && !p.as_os_str().is_empty()))
    };
    let mut all = Vec::new();
    for f in &files {
        let Ok(text) = std::fs::read_to_string(root().join(f)) else {
            continue; // binary (a PNG)
        };
        all.extend(findings(f, &text, &exists));
    }
    assert!(
        all.is_empty(),
        "links outside the repository:\n{}",
        all.join("\n")
    );
}

#[test]
fn each_kind_of_outside_link_is_found() {
    let tracked = |p: &Path| p == Path::new("docs/design.md") || p == Path::new("README.md");
    let f = |path: &str, text: &str| findings(Path::new(path), text, &tracked);
    // What the old docs said.
    let old = concat!("see `../", "sha", "red/DES", "IGN.md`");
    assert_eq!(f("README.md", old).len(), 2, "{:?}", f("README.md", old));
    assert_eq!(f("docs/a.md", "[x](../../etc/passwd)").len(), 2);
    assert_eq!(f("docs/a.md", "[x](/work/x.md)").len(), 1);
    assert_eq!(f("docs/a.md", "[x](missing.md)").len(), 1);
    // Split so that this file does not climb out itself.
    let climb = concat!("// see \"../../", "../../x\"");
    assert_eq!(f("crates/a/src/lib.rs", climb).len(), 1);
    assert_eq!(f("a.md", concat!("<file", ":///etc/hosts>")).len(), 1);
    // What is fine.
    assert!(f("docs/a.md", "[d](design.md#k1) [r](../README.md)").is_empty());
    assert!(f("docs/a.md", "[w](https://example.com/../x)").is_empty());
    assert!(f(
        "crates/a/tests/t.rs",
        "concat!(env!(\"X\"), \"/../../scripts\")"
    )
    .is_empty());
    assert!(f("scripts/x", "cd scripts && run \"../out/a.json\"").is_empty());
}
