//! The workspace's crate graph, pinned: every dependency edge between
//! workspace crates (normal dependencies; dev-dependencies are the tests'
//! business) must be in the table below, and every edge in the table must
//! exist. A new edge fails here with its name, so layering changes are
//! decisions, not accidents. Beyond the direct edges, what the HTTP layer
//! and the PD gateway link is checked transitively: neither may reach the
//! model, the kernels or the engine (the gateway process has no model).

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

/// crate → the workspace crates it depends on (normal dependencies).
const ALLOWED: &[(&str, &[&str])] = &[
    ("request", &[]),
    ("gguf", &[]),
    ("kernels", &[]),
    ("probe", &[]),
    ("audit", &[]),
    ("telemetry", &["request"]),
    ("kv", &["request"]),
    ("tokenizer", &["gguf"]),
    // Structured outputs: llguidance over the tokenizer's vocabulary.
    ("grammar", &["request", "tokenizer"]),
    // Tool calls and reasoning: formats, call grammars, output parsers.
    ("tools", &["grammar"]),
    ("model", &["gguf", "kernels", "kv", "request"]),
    (
        "engine",
        &["grammar", "kernels", "kv", "model", "request", "tokenizer"],
    ),
    ("transfer", &["kv", "request"]),
    ("transport", &["transfer"]),
    (
        "gateway",
        &["request", "telemetry", "transfer", "transport"],
    ),
    (
        "pd",
        &[
            "engine",
            "grammar",
            "kv",
            "model",
            "request",
            "telemetry",
            "tokenizer",
            "transfer",
            "transport",
        ],
    ),
    (
        "server",
        &["grammar", "request", "telemetry", "tokenizer", "tools"],
    ),
    // testkit writes K-quant test models with the kernels' quantisers.
    ("testkit", &["gguf", "kernels", "kv", "transfer"]),
    ("verify", &["testkit", "transfer"]),
    (
        "isoserve",
        &[
            "audit",
            "engine",
            "gateway",
            "gguf",
            "kernels",
            "kv",
            "model",
            "pd",
            "probe",
            "request",
            "server",
            "telemetry",
            "tokenizer",
            "tools",
            "transfer",
            "transport",
        ],
    ),
];

/// Crates that must not be reachable (transitively) from each key.
const NEVER_LINKED: &[(&str, &[&str])] = &[
    ("request", &["kv", "model", "kernels", "transfer", "engine"]),
    ("server", &["model", "kernels", "engine", "kv", "transfer"]),
    (
        "gateway",
        &["model", "kernels", "engine", "tokenizer", "gguf"],
    ),
    ("engine", &["transfer", "transport", "gateway", "server"]),
    ("transfer", &["model", "kernels", "engine"]),
    // The grammar engine knows the vocabulary, nothing of models or pools.
    (
        "grammar",
        &["model", "kernels", "engine", "kv", "transfer", "server"],
    ),
    // Tool formats and parsers are pure: no engine, no HTTP.
    (
        "tools",
        &["model", "kernels", "engine", "kv", "transfer", "server"],
    ),
    // Test support is never linked into the binary.
    ("isoserve", &["testkit", "verify"]),
];

fn workspace_edges() -> BTreeMap<String, BTreeSet<String>> {
    let out = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata is JSON");
    let packages = v["packages"].as_array().expect("packages");
    let names: BTreeSet<String> = packages
        .iter()
        .map(|p| p["name"].as_str().expect("name").to_string())
        .collect();
    let mut edges = BTreeMap::new();
    for p in packages {
        let name = p["name"].as_str().expect("name").to_string();
        let deps: BTreeSet<String> = p["dependencies"]
            .as_array()
            .expect("dependencies")
            .iter()
            // Normal dependencies only (kind null); build deps count too.
            .filter(|d| d["kind"].is_null() || d["kind"] == "build")
            .map(|d| d["name"].as_str().expect("dep name").to_string())
            .filter(|d| names.contains(d))
            .collect();
        edges.insert(name, deps);
    }
    edges
}

#[test]
fn workspace_dependency_edges_are_the_pinned_ones() {
    let edges = workspace_edges();
    let allowed: BTreeMap<&str, BTreeSet<&str>> = ALLOWED
        .iter()
        .map(|(k, v)| (*k, v.iter().copied().collect()))
        .collect();
    let mut wrong = Vec::new();
    for (krate, deps) in &edges {
        let Some(ok) = allowed.get(krate.as_str()) else {
            wrong.push(format!(
                "crate `{krate}` is not in the pinned table (crates/isoserve/tests/deps.rs)"
            ));
            continue;
        };
        for d in deps {
            if !ok.contains(d.as_str()) {
                wrong.push(format!("edge `{krate} -> {d}` is not allowed"));
            }
        }
        for d in ok {
            if !deps.contains(*d) {
                wrong.push(format!(
                    "edge `{krate} -> {d}` is pinned but gone: update the table"
                ));
            }
        }
    }
    for k in allowed.keys() {
        if !edges.contains_key(*k) {
            wrong.push(format!("pinned crate `{k}` is not in the workspace"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_http_layer_and_the_gateway_link_no_model() {
    let edges = workspace_edges();
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(c) = todo.pop() {
            for d in edges.get(&c).into_iter().flatten() {
                if seen.insert(d.clone()) {
                    todo.push(d.clone());
                }
            }
        }
        seen
    };
    let mut wrong = Vec::new();
    for (from, never) in NEVER_LINKED {
        let r = reach(from);
        for n in *never {
            if r.contains(*n) {
                wrong.push(format!("`{from}` reaches `{n}`"));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
