//! The HTTP API byte for byte: every endpoint's success and error shapes,
//! streamed and not, recorded in `tests/golden/http.txt` and compared on
//! every run. It was recorded before the server was split into one module
//! per endpoint (issue 33), so a move that changes one byte of an answer
//! fails here.
//!
//! What varies between runs is normalised and nothing else: response ids
//! (`chatcmpl-…`, `cmpl-…`, `resp_…`, `msg_…`) become zeros of the same
//! length, `created`/`created_at` become 0, the `date` header is dropped.
//! `/metrics` is recorded as its family and series names (the values are
//! timings); the console's static files as their SHA-256; its snapshot as
//! the shape of its JSON.
//!
//! To record anew after a deliberate change of the API:
//! `UPDATE_EXPECT=1 cargo test -p server --test golden`, and say why in the
//! commit.

use std::fmt::Write as _;
use std::path::PathBuf;

use axum::body::Body;
use axum::http::Request;
use axum::Router;
use serde_json::{json, Value};
use server::tenants::{key_sha256_hex, sha256, Tenants};
use server::{Server, ServerConfig};
use testkit::synthetic::{write_synthetic_llama, SyntheticConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

const ALICE: &str = "sk-golden-alice";
const BOB: &str = "sk-golden-bob";
const OPERATOR: &str = "sk-golden-operator";

fn model_path() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("isoserve-golden-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("synthetic.gguf");
    if !path.exists() {
        let cfg = SyntheticConfig {
            context_length: 256,
            ..SyntheticConfig::default()
        };
        write_synthetic_llama(&path, cfg, 7).expect("write model");
    }
    path
}

fn tenants() -> Tenants {
    let file = format!(
        "[[tenant]]\nname = \"alice\"\napi_key_sha256 = \"{}\"\nmax_concurrent = 4\n\n\
         [[tenant]]\nname = \"bob\"\napi_key_sha256 = \"{}\"\nmax_concurrent = 1\n\n\
         [operator]\napi_key_sha256 = \"{}\"\n",
        key_sha256_hex(ALICE),
        key_sha256_hex(BOB),
        key_sha256_hex(OPERATOR)
    );
    Tenants::from_toml(&file).expect("tenants")
}

fn server() -> Server {
    let model = model::Model::load(&model_path(), kernels::ThreadPool::new(1)).expect("load");
    let tok = tokenizer::Tokenizer::from_gguf(model.gguf()).expect("tokenizer");
    let template = tokenizer::ChatTemplate::from_gguf(model.gguf()).ok();
    let engine =
        engine::Engine::start(model, tok.clone(), engine::EngineConfig::default()).expect("start");
    let mut cfg = ServerConfig::new("synthetic");
    cfg.max_body_bytes = 8192;
    Server::new(engine, tok, template, tenants(), None, cfg)
}

/// One request of the record.
struct Case {
    name: &'static str,
    method: &'static str,
    path: &'static str,
    key: Option<&'static str>,
    body: Option<String>,
    /// How the body is written down.
    show: Show,
}

#[derive(Clone, Copy)]
enum Show {
    /// Every byte, ids and clocks normalised.
    Text,
    /// A stream of several choices: its events grouped by choice, each
    /// choice's in order (how choices interleave is the scheduler's).
    ByChoice,
    /// Prometheus text: family and series names only.
    Metrics,
    /// The SHA-256 of the bytes (static files).
    Digest,
    /// The shape of a JSON document (what is there, not its values).
    Shape,
}

fn case(name: &'static str, method: &'static str, path: &'static str) -> Case {
    Case {
        name,
        method,
        path,
        key: Some(ALICE),
        body: None,
        show: Show::Text,
    }
}

impl Case {
    fn body(mut self, v: Value) -> Case {
        self.body = Some(v.to_string());
        self
    }
    fn raw(mut self, s: &str) -> Case {
        self.body = Some(s.to_string());
        self
    }
    fn key(mut self, k: Option<&'static str>) -> Case {
        self.key = k;
        self
    }
    fn show(mut self, s: Show) -> Case {
        self.show = s;
        self
    }
}

fn cases() -> Vec<Case> {
    let msgs = json!([{"role": "user", "content": "Hello there"}]);
    let chat = |v: Value| {
        let mut b = json!({"model": "synthetic", "messages": msgs, "max_tokens": 6,
                           "temperature": 0});
        for (k, x) in v.as_object().expect("object") {
            b[k] = x.clone();
        }
        b
    };
    let cmpl = |v: Value| {
        let mut b = json!({"model": "synthetic", "prompt": "Once upon a time", "max_tokens": 5,
                           "temperature": 0});
        for (k, x) in v.as_object().expect("object") {
            b[k] = x.clone();
        }
        b
    };
    let resp = |v: Value| {
        let mut b = json!({"model": "synthetic", "input": "Hello there", "max_output_tokens": 5,
                           "temperature": 0});
        for (k, x) in v.as_object().expect("object") {
            b[k] = x.clone();
        }
        b
    };
    const CHAT: &str = "/v1/chat/completions";
    const CMPL: &str = "/v1/completions";
    const RESP: &str = "/v1/responses";
    vec![
        // Models, tokenize, health.
        case("models", "GET", "/v1/models"),
        case("models without a key", "GET", "/v1/models").key(None),
        case("models with a wrong key", "GET", "/v1/models").key(Some("sk-nope")),
        case("model by id", "GET", "/v1/models/synthetic"),
        case("model by unknown id", "GET", "/v1/models/other"),
        case("tokenize a prompt", "POST", "/tokenize").body(json!({"prompt": "Hello there"})),
        case("tokenize messages", "POST", "/tokenize").body(json!({"messages": msgs})),
        case("tokenize without input", "POST", "/tokenize").body(json!({})),
        case("tokenize without a key", "POST", "/tokenize")
            .key(None)
            .body(json!({"prompt": "x"})),
        case("health", "GET", "/health").key(None),
        // Chat completions.
        case("chat", "POST", CHAT).body(chat(json!({}))),
        case("chat streamed", "POST", CHAT).body(chat(json!({"stream": true}))),
        case("chat streamed with usage", "POST", CHAT).body(chat(
            json!({"stream": true, "stream_options": {"include_usage": true}}),
        )),
        case("chat with logprobs", "POST", CHAT).body(chat(
            json!({"logprobs": true, "top_logprobs": 2, "max_tokens": 3}),
        )),
        case("chat streamed with logprobs", "POST", CHAT).body(chat(
            json!({"logprobs": true, "top_logprobs": 1, "max_tokens": 2, "stream": true}),
        )),
        case("chat n=2 seeded", "POST", CHAT)
            .body(chat(json!({"n": 2, "temperature": 0.8, "seed": 11}))),
        case("chat n=2 streamed", "POST", CHAT)
            .body(chat(json!({"n": 2, "stream": true})))
            .show(Show::ByChoice),
        case("chat with logit_bias", "POST", CHAT)
            .body(chat(json!({"logit_bias": {"5": 100}, "max_tokens": 3}))),
        case("chat with penalties and stop", "POST", CHAT).body(chat(json!(
            {"presence_penalty": 0.5, "frequency_penalty": 0.5, "stop": ["zz"]}
        ))),
        // A stop string whose first letter ends every token: the held-back
        // text is flushed at the end (`tail_text`).
        case("chat with a held-back tail", "POST", CHAT)
            .body(chat(json!({"stop": ["rz"], "max_tokens": 3}))),
        case("chat streamed with a held-back tail", "POST", CHAT).body(chat(
            json!({"stop": ["rz"], "max_tokens": 3, "stream": true}),
        )),
        case("chat max_completion_tokens", "POST", CHAT)
            .body(chat(json!({"max_completion_tokens": 2}))),
        // Chat errors.
        case("chat: invalid JSON", "POST", CHAT).raw("{\"model\":"),
        case("chat: not an object", "POST", CHAT).raw("[1,2]"),
        case("chat: messages missing", "POST", CHAT).body(json!({"model": "synthetic"})),
        case("chat: messages empty", "POST", CHAT)
            .body(json!({"model": "synthetic", "messages": []})),
        case("chat: bad role", "POST", CHAT).body(chat(
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
        )),
        case("chat: temperature out of range", "POST", CHAT).body(chat(json!({"temperature": 3}))),
        case("chat: max_tokens wrong type", "POST", CHAT).body(chat(json!({"max_tokens": "many"}))),
        case("chat: top_logprobs without logprobs", "POST", CHAT)
            .body(chat(json!({"top_logprobs": 2}))),
        case("chat: unknown model", "POST", CHAT).body(chat(json!({"model": "gpt-9"}))),
        case("chat: context length exceeded", "POST", CHAT)
            .body(chat(json!({"max_tokens": 100000}))),
        case("chat: response_format json_object", "POST", CHAT)
            .body(chat(json!({"response_format": {"type": "json_object"}}))),
        case("chat: a malformed tool", "POST", CHAT).body(chat(json!({"tools": [
            {"type": "function", "function": {"name": "f", "parameters": {}}},
            {"type": "function", "function": {"name": "two words"}}
        ]}))),
        case("chat: logit_bias past the vocabulary", "POST", CHAT)
            .body(chat(json!({"logit_bias": {"99999999": 1}}))),
        case("chat: n too large", "POST", CHAT).body(chat(json!({"n": 99}))),
        case("chat: more choices than the tenant may run", "POST", CHAT)
            .key(Some(BOB))
            .body(chat(json!({"n": 2}))),
        case("chat: priority", "POST", CHAT).body(chat(json!({"priority": 3, "max_tokens": 1}))),
        case("chat: stop not a string", "POST", CHAT).body(chat(json!({"stop": [1]}))),
        case("chat: without a key", "POST", CHAT)
            .key(None)
            .body(chat(json!({}))),
        case("chat: body too large", "POST", CHAT).raw(&format!(
            "{{\"model\":\"synthetic\",\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}]}}",
            "a".repeat(9000)
        )),
        case("chat: GET", "GET", CHAT),
        // Completions.
        case("completion", "POST", CMPL).body(cmpl(json!({}))),
        case("completion streamed", "POST", CMPL).body(cmpl(json!({"stream": true}))),
        case("completion batch", "POST", CMPL)
            .body(cmpl(json!({"prompt": ["One", "Two"], "max_tokens": 3}))),
        case("completion batch streamed", "POST", CMPL)
            .body(cmpl(
                json!({"prompt": ["One", "Two"], "max_tokens": 2, "stream": true}),
            ))
            .show(Show::ByChoice),
        case("completion streamed with logprobs", "POST", CMPL).body(cmpl(
            json!({"logprobs": 1, "max_tokens": 2, "stream": true}),
        )),
        case("completion streamed with usage", "POST", CMPL).body(cmpl(json!(
            {"stream": true, "stream_options": {"include_usage": true}, "max_tokens": 2}
        ))),
        case("completion batch with logprobs", "POST", CMPL).body(cmpl(
            json!({"prompt": ["One", "Two"], "max_tokens": 2, "logprobs": 1}),
        )),
        case("completion batch streamed with logprobs", "POST", CMPL)
            .body(cmpl(
                json!({"prompt": ["One", "Two"], "max_tokens": 2, "logprobs": 1,
                               "stream": true}),
            ))
            .show(Show::ByChoice),
        case("completion with a held-back tail", "POST", CMPL)
            .body(cmpl(json!({"stop": ["ez"], "max_tokens": 3}))),
        case("completion streamed with a held-back tail", "POST", CMPL).body(cmpl(
            json!({"stop": ["ez"], "max_tokens": 3, "stream": true}),
        )),
        case("completion of token ids", "POST", CMPL)
            .body(cmpl(json!({"prompt": [1, 2, 3], "max_tokens": 3}))),
        case("completion with logprobs", "POST", CMPL)
            .body(cmpl(json!({"logprobs": 2, "max_tokens": 3}))),
        case("completion with echo", "POST", CMPL)
            .body(cmpl(json!({"echo": true, "max_tokens": 2}))),
        case("completion: prompt missing", "POST", CMPL).body(json!({"model": "synthetic"})),
        case("completion: suffix", "POST", CMPL).body(cmpl(json!({"suffix": "end"}))),
        case("completion: context length exceeded", "POST", CMPL)
            .body(cmpl(json!({"max_tokens": 100000}))),
        // Responses.
        case("responses", "POST", RESP).body(resp(json!({}))),
        case("responses streamed", "POST", RESP).body(resp(json!({"stream": true}))),
        case("responses with instructions and messages", "POST", RESP).body(resp(json!({
            "instructions": "Be brief.",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]
        }))),
        case("responses with logprobs", "POST", RESP).body(resp(json!({
            "include": ["message.output_text.logprobs"], "top_logprobs": 1, "max_output_tokens": 2
        }))),
        case("responses streamed with logprobs", "POST", RESP).body(resp(json!({
            "include": ["message.output_text.logprobs"], "top_logprobs": 1,
            "max_output_tokens": 2, "stream": true
        }))),
        case("responses: text.format json", "POST", RESP)
            .body(resp(json!({"text": {"format": {"type": "json_object"}}}))),
        case("responses: n", "POST", RESP).body(resp(json!({"n": 2}))),
        case("responses with a held-back tail", "POST", RESP)
            .body(resp(json!({"stop": ["rz"], "max_output_tokens": 3}))),
        case("responses streamed with a held-back tail", "POST", RESP).body(resp(
            json!({"stop": ["rz"], "max_output_tokens": 3, "stream": true}),
        )),
        case("responses incomplete", "POST", RESP).body(resp(json!({"max_output_tokens": 1}))),
        case("responses: previous_response_id", "POST", RESP)
            .body(resp(json!({"previous_response_id": "resp_123"}))),
        case("responses: input missing", "POST", RESP).body(json!({"model": "synthetic"})),
        // Routes and methods.
        case("unknown route", "GET", "/v2/nothing"),
        case("unknown route, POST", "POST", "/v1/engines").body(json!({})),
        // Operations on the API port.
        case("metrics for the operator", "GET", "/metrics")
            .key(Some(OPERATOR))
            .show(Show::Metrics),
        case("metrics for a tenant", "GET", "/metrics"),
        case("metrics without a key", "GET", "/metrics").key(None),
        // The console.
        case("console page", "GET", "/console")
            .key(Some(OPERATOR))
            .show(Show::Digest),
        case("console page with a slash", "GET", "/console/")
            .key(Some(OPERATOR))
            .show(Show::Digest),
        case("console script", "GET", "/console/console.js")
            .key(Some(OPERATOR))
            .show(Show::Digest),
        case("console style", "GET", "/console/console.css")
            .key(Some(OPERATOR))
            .show(Show::Digest),
        case("console snapshot", "GET", "/console/snapshot")
            .key(Some(OPERATOR))
            .show(Show::Shape),
        case("console for a tenant", "GET", "/console"),
        case("console without a key", "GET", "/console").key(None),
    ]
}

/// Replaces what differs between runs: ids after their prefix (hex
/// digits) and `"created"`/`"created_at"` numbers.
fn normalise(text: &str) -> String {
    let mut out = text.to_string();
    for prefix in ["chatcmpl-", "cmpl-", "resp_", "msg_"] {
        let mut res = String::with_capacity(out.len());
        let mut rest = out.as_str();
        while let Some(at) = rest.find(prefix) {
            let (head, tail) = rest.split_at(at + prefix.len());
            res.push_str(head);
            let hex = tail.bytes().take_while(|b| b.is_ascii_hexdigit()).count();
            // Only generated ids (24 hex digits); a client's `resp_123`
            // echoed in an error stays.
            if hex >= 16 {
                res.push_str(&"0".repeat(hex));
            } else {
                res.push_str(&tail[..hex]);
            }
            rest = &tail[hex..];
        }
        res.push_str(rest);
        out = res;
    }
    for key in ["\"created\":", "\"created_at\":"] {
        let mut res = String::with_capacity(out.len());
        let mut rest = out.as_str();
        while let Some(at) = rest.find(key) {
            let (head, tail) = rest.split_at(at + key.len());
            res.push_str(head);
            let digits = tail.bytes().take_while(|b| b.is_ascii_digit()).count();
            res.push('0');
            rest = &tail[digits..];
        }
        res.push_str(rest);
        out = res;
    }
    out
}

/// Family and series names; a family's series sorted (the client
/// library keeps labelled series in a hash map).
fn metric_names(text: &str) -> String {
    let mut out = String::new();
    let mut series: Vec<&str> = Vec::new();
    let flush = |series: &mut Vec<&str>, out: &mut String| {
        series.sort();
        for s in series.drain(..) {
            out.push_str(s);
            out.push('\n');
        }
    };
    for line in text.lines() {
        if line.starts_with('#') {
            flush(&mut series, &mut out);
            out.push_str(line);
            out.push('\n');
        } else if let Some(i) = line.rfind(' ') {
            // Bucket bounds are names too; the value after the last space
            // is not.
            series.push(&line[..i]);
        }
    }
    flush(&mut series, &mut out);
    out
}

/// SSE events grouped by `choices[0].index`, stable; events without a
/// choice (usage, `[DONE]`) after them in order.
fn by_choice(text: &str) -> String {
    let mut events: Vec<(usize, &str)> = text
        .split_inclusive("\n\n")
        .map(|e| {
            let index = e
                .strip_prefix("data: ")
                .and_then(|j| serde_json::from_str::<Value>(j.trim_end()).ok())
                .and_then(|v| v["choices"][0]["index"].as_u64())
                .map_or(usize::MAX, |i| i as usize);
            (index, e)
        })
        .collect();
    events.sort_by_key(|&(i, _)| i);
    events.iter().map(|&(_, e)| e).collect()
}

fn shape(v: &Value) -> Value {
    match v {
        Value::Null => json!("null"),
        Value::Bool(_) => json!("bool"),
        Value::Number(_) => json!("number"),
        Value::String(_) => json!("string"),
        Value::Array(a) => match a.first() {
            Some(x) => json!([shape(x)]),
            None => json!([]),
        },
        Value::Object(m) => Value::Object(m.iter().map(|(k, x)| (k.clone(), shape(x))).collect()),
    }
}

async fn record(app: &Router, c: &Case, out: &mut String) {
    let mut b = Request::builder().method(c.method).uri(c.path);
    if let Some(k) = c.key {
        b = b.header("authorization", format!("Bearer {k}"));
    }
    let req = match &c.body {
        Some(body) => b
            .header("content-type", "application/json")
            .body(Body::from(body.clone())),
        None => b.body(Body::empty()),
    }
    .expect("request");
    let resp = app.clone().oneshot(req).await.expect("infallible");
    writeln!(out, "### {}", c.name).unwrap();
    writeln!(out, "> {} {}", c.method, c.path).unwrap();
    if let Some(body) = &c.body {
        let shown = if body.len() > 200 {
            format!("({} bytes)", body.len())
        } else {
            body.clone()
        };
        writeln!(out, "> {shown}").unwrap();
    }
    writeln!(out, "< {}", resp.status().as_u16()).unwrap();
    let mut headers: Vec<(String, String)> = resp
        .headers()
        .iter()
        .filter(|(n, _)| *n != "date")
        .map(|(n, v)| {
            (
                n.to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    headers.sort();
    for (n, v) in headers {
        // A body shown by digest or shape has no fixed length.
        if n == "content-length" && matches!(c.show, Show::Metrics | Show::Shape) {
            continue;
        }
        writeln!(out, "< {n}: {v}").unwrap();
    }
    let bytes = axum::body::to_bytes(resp.into_body(), 16 << 20)
        .await
        .expect("body");
    let text = String::from_utf8_lossy(&bytes);
    let shown = match c.show {
        Show::Text => normalise(&text),
        Show::ByChoice => normalise(&by_choice(&text)),
        Show::Metrics => metric_names(&text),
        Show::Digest => format!("sha256 {}\n", hex(&sha256(&bytes))),
        Show::Shape => {
            let v: Value = serde_json::from_slice(&bytes).expect("json");
            format!("{}\n", serde_json::to_string_pretty(&shape(&v)).unwrap())
        }
    };
    out.push_str(&shown);
    if !shown.ends_with('\n') {
        out.push('\n');
    }
    out.push('\n');
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The front door answers malformed heads itself, before hyper: written
/// to a real listener, read back whole.
async fn raw(addr: std::net::SocketAddr, name: &str, bytes: &[u8], out: &mut String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(bytes).await.expect("write");
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(10), s.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf);
    writeln!(out, "### door: {name}").unwrap();
    for line in text.split("\r\n") {
        if line.to_ascii_lowercase().starts_with("date:") {
            continue;
        }
        writeln!(out, "{line}").unwrap();
    }
    out.push('\n');
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_answers_as_recorded() {
    let srv = server();
    let app = srv.router();
    let ops = srv.ops_router();
    let mut out = String::new();
    for c in cases() {
        record(&app, &c, &mut out).await;
    }
    for c in [
        case("ops: health", "GET", "/health").key(None),
        case("ops: metrics", "GET", "/metrics")
            .key(None)
            .show(Show::Metrics),
        case("ops: console without a key", "GET", "/console").key(None),
        case("ops: unknown route", "GET", "/v1/models").key(None),
    ] {
        record(&ops, &c, &mut out).await;
    }

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(srv.run(listener, async {
        let _ = stopped.await;
    }));
    raw(
        addr,
        "two content lengths",
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n{}",
        &mut out,
    )
    .await;
    raw(
        addr,
        "a content length that is not a number",
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: ten\r\n\r\n",
        &mut out,
    )
    .await;
    let mut many = b"GET /health HTTP/1.1\r\nhost: x\r\n".to_vec();
    for i in 0..120 {
        many.extend_from_slice(format!("x-h{i}: v\r\n").as_bytes());
    }
    many.extend_from_slice(b"\r\n");
    raw(addr, "too many headers", &many, &mut out).await;
    raw(
        addr,
        "health, then close",
        b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        &mut out,
    )
    .await;
    let _ = stop.send(());
    run.await.expect("join").expect("run");

    expect_test::expect_file!["golden/http.txt"].assert_eq(&out);
}
