//! The router in-process over a tiny synthetic LLaMA (random weights, the
//! real file's architecture, vocabulary kind and chat template): response
//! shapes, errors, tenants, and that dropping an SSE body cancels the
//! request and frees its pages.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use futures_util::StreamExt;
use serde_json::{json, Value};
use server::tenants::{key_sha256_hex, Tenants};
use server::{Server, ServerConfig};
use testkit::synthetic::{write_synthetic_llama, SyntheticConfig};
use tower::ServiceExt;

const MODEL_ID: &str = "synthetic";

fn model_path(context_length: u32) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("isoserve-server-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join(format!("synthetic-{context_length}.gguf"));
    if !path.exists() {
        let tmp = dir.join(format!(
            "synthetic-{context_length}.{:?}.tmp",
            std::thread::current().id()
        ));
        let cfg = SyntheticConfig {
            context_length,
            ..SyntheticConfig::default()
        };
        write_synthetic_llama(&tmp, cfg, 7).expect("write model");
        std::fs::rename(&tmp, &path).expect("rename");
    }
    path
}

fn router(tenants: Tenants, cfg: impl FnOnce(&mut ServerConfig)) -> (Router, tokenizer::Tokenizer) {
    router_with_window(256, tenants, cfg)
}

fn router_with_window(
    context_length: u32,
    tenants: Tenants,
    cfg: impl FnOnce(&mut ServerConfig),
) -> (Router, tokenizer::Tokenizer) {
    let path = model_path(context_length);
    let model = model::Model::load(&path, kernels::ThreadPool::new(1)).expect("load");
    let tok = tokenizer::Tokenizer::from_gguf(model.gguf()).expect("tokenizer");
    let template = tokenizer::ChatTemplate::from_gguf(model.gguf()).ok();
    let engine =
        engine::Engine::start(model, tok.clone(), engine::EngineConfig::default()).expect("start");
    let mut c = ServerConfig::new(MODEL_ID);
    cfg(&mut c);
    let server = Server::new(engine, tok.clone(), template, tenants, None, c);
    (server.router(), tok)
}

/// The API router and the operations listener's (`--metrics-port`), over
/// one server.
fn api_and_ops(tenants: Tenants) -> (Router, Router) {
    let path = model_path(256);
    let model = model::Model::load(&path, kernels::ThreadPool::new(1)).expect("load");
    let tok = tokenizer::Tokenizer::from_gguf(model.gguf()).expect("tokenizer");
    let engine =
        engine::Engine::start(model, tok.clone(), engine::EngineConfig::default()).expect("start");
    let server = Server::new(
        engine,
        tok,
        None,
        tenants,
        None,
        ServerConfig::new(MODEL_ID),
    );
    (server.router(), server.ops_router())
}

fn post(path: &str, body: Value) -> Request<Body> {
    post_raw(path, body.to_string(), None)
}

fn post_raw(path: &str, body: String, key: Option<&str>) -> Request<Body> {
    let mut b = Request::post(path).header("content-type", "application/json");
    if let Some(k) = key {
        b = b.header("authorization", format!("Bearer {k}"));
    }
    b.body(Body::from(body)).expect("request")
}

async fn call(app: &Router, req: Request<Body>) -> (StatusCode, Value) {
    let resp = app.clone().oneshot(req).await.expect("infallible");
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 16 << 20)
        .await
        .expect("body");
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, v)
}

/// The operator's key of the tenant-file tests (anonymous servers ignore
/// it): `/metrics` wants it under `--tenants`.
const OPERATOR: &str = "sk-router-operator";

async fn metrics(app: &Router) -> String {
    let (status, v) = call(
        app,
        Request::get("/metrics")
            .header("authorization", format!("Bearer {OPERATOR}"))
            .body(Body::empty())
            .expect("req"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    v.as_str().expect("text").to_string()
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no series {series}"))
}

async fn wait_idle(app: &Router) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let m = metrics(app).await;
        let idle = metric(&m, "isoserve_kv_pages{state=\"free\"}")
            == metric(&m, "isoserve_kv_pages_total")
            && metric(&m, "isoserve_requests_running") == 0.0
            && metric(&m, "isoserve_requests_waiting") == 0.0;
        if idle || Instant::now() > deadline {
            return m;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_and_completion_shapes() {
    let (app, tok) = router(Tenants::anonymous(), |_| {});
    let (status, v) = call(
        &app,
        post(
            "/v1/chat/completions",
            json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hello world"}],
                   "max_tokens": 5, "temperature": 0, "ignore_eos": true}),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().expect("id").starts_with("chatcmpl-"));
    assert_eq!(v["model"], MODEL_ID);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    let template = {
        let m = model::Model::load(&model_path(256), kernels::ThreadPool::new(1)).expect("load");
        tokenizer::ChatTemplate::from_gguf(m.gguf()).expect("template")
    };
    let text = template
        .render(&[tokenizer::ChatMessage::user("Hello world")], true)
        .expect("render");
    let n = tok.encode(&text, true).expect("encode").len();
    assert_eq!(v["usage"]["prompt_tokens"], n);
    assert_eq!(v["usage"]["total_tokens"], n + 5);

    let (status, v) = call(
        &app,
        post(
            "/v1/completions",
            json!({"model": "default", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0,
                   "ignore_eos": true, "logprobs": 2}),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().expect("tokens").len(), 3);
    assert_eq!(lp["top_logprobs"][0].as_object().expect("top").len(), 2);

    let (status, v) = call(
        &app,
        Request::get("/v1/models").body(Body::empty()).expect("req"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["data"][0]["id"], MODEL_ID);
    assert_eq!(v["data"][0]["max_model_len"], 256);
    let (status, v) = call(
        &app,
        Request::get("/health").body(Body::empty()).expect("req"),
    )
    .await;
    assert_eq!((status, v), (StatusCode::OK, json!({"status": "ok"})));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_chunks_and_done() {
    let (app, _) = router(Tenants::anonymous(), |_| {});
    let resp = app
        .clone()
        .oneshot(post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                   "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}}),
        ))
        .await
        .expect("infallible");
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .expect("body");
    let text = String::from_utf8(bytes.to_vec()).expect("utf8");
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("data: prefix"))
        .collect();
    assert_eq!(*events.last().expect("events"), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("json chunk"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let last = chunks.last().expect("usage chunk");
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 4);
    let fin = &chunks[chunks.len() - 2];
    assert_eq!(fin["choices"][0]["finish_reason"], "length");
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c["usage"].is_null()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_sse_body_cancels_and_frees_pages() {
    // A long window and a request long enough (seconds of decoding) that a
    // test thread starved by the other tests' engines cannot see it end on
    // its own before it looks (CI once saw 200 tokens finish first).
    let (app, _) = router_with_window(8192, Tenants::anonymous(), |_| {});
    let resp = app
        .clone()
        .oneshot(post(
            "/v1/completions",
            json!({"prompt": "Hello world", "max_tokens": 6000, "ignore_eos": true,
                   "stream": true}),
        ))
        .await
        .expect("infallible");
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body().into_data_stream();
    // Two tokens arrive: the request holds pages now.
    for _ in 0..2 {
        body.next().await.expect("chunk").expect("bytes");
    }
    let m = metrics(&app).await;
    assert!(metric(&m, "isoserve_kv_pages{state=\"owned\"}") > 0.0);
    drop(body); // the client went away
    let m = wait_idle(&app).await;
    assert_eq!(
        metric(&m, "isoserve_kv_pages{state=\"free\"}"),
        metric(&m, "isoserve_kv_pages_total")
    );
    assert_eq!(
        metric(&m, "isoserve_engine_requests_total{how=\"cancelled\"}"),
        1.0
    );
    assert_eq!(
        metric(&m, "isoserve_requests_total{outcome=\"cancelled\"}"),
        1.0
    );
    assert_eq!(metric(&m, "isoserve_kv_safety_refusals_total"), 0.0);
    assert!(metric(&m, "isoserve_generation_tokens_total") < 6000.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_openai_shaped_and_counted() {
    let key = "sk-router-test";
    let file = format!(
        "[[tenant]]\nname = \"a\"\napi_key_sha256 = \"{}\"\nmax_concurrent = 4\n\n\
         [operator]\napi_key_sha256 = \"{}\"\n",
        key_sha256_hex(key),
        key_sha256_hex(OPERATOR)
    );
    let (app, _) = router(Tenants::from_toml(&file).expect("tenants"), |c| {
        c.max_body_bytes = 1024;
    });
    let chat = |v: Value, k: Option<&str>| post_raw("/v1/chat/completions", v.to_string(), k);
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let cases: Vec<(Request<Body>, StatusCode, &str, Value)> = vec![
        (
            chat(json!({"messages": msgs}), None),
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            Value::Null,
        ),
        (
            chat(json!({"messages": msgs}), Some("sk-wrong")),
            StatusCode::UNAUTHORIZED,
            "invalid_api_key",
            Value::Null,
        ),
        (
            post_raw("/v1/chat/completions", "{".into(), Some(key)),
            StatusCode::BAD_REQUEST,
            "invalid_json",
            Value::Null,
        ),
        (
            chat(json!({"messages": msgs, "max_tokens": "x"}), Some(key)),
            StatusCode::BAD_REQUEST,
            "invalid_type",
            json!("max_tokens"),
        ),
        (
            chat(json!({"messages": msgs, "model": "nope"}), Some(key)),
            StatusCode::NOT_FOUND,
            "model_not_found",
            json!("model"),
        ),
        (
            post_raw(
                "/v1/completions",
                format!("{{\"prompt\": \"{}\"}}", "a".repeat(2000)),
                Some(key),
            ),
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            Value::Null,
        ),
        (
            chat(json!({"messages": msgs, "max_tokens": 300}), Some(key)),
            StatusCode::BAD_REQUEST,
            "context_length_exceeded",
            json!("messages"),
        ),
        (
            Request::get("/nope").body(Body::empty()).expect("req"),
            StatusCode::NOT_FOUND,
            "not_found",
            Value::Null,
        ),
    ];
    for (req, status, code, param) in cases {
        let (s, v) = call(&app, req).await;
        assert_eq!(s, status, "{v}");
        let e = &v["error"];
        assert_eq!(e["code"], code, "{v}");
        assert_eq!(e["param"], param, "{v}");
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()));
        assert!(e["type"].is_string());
    }
    let (s, v) = call(
        &app,
        chat(json!({"messages": msgs, "max_tokens": 2}), Some(key)),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let m = metrics(&app).await;
    for (reason, n) in [
        ("unauthorized", 2.0),
        ("invalid_request", 2.0),
        ("model_not_found", 1.0),
        ("body_too_large", 1.0),
        ("context_length_exceeded", 1.0),
        ("not_found", 1.0),
        ("tenant_limit", 0.0),
    ] {
        assert_eq!(
            metric(
                &m,
                &format!("isoserve_rejections_total{{reason=\"{reason}\"}}")
            ),
            n,
            "{reason}"
        );
    }
    assert_eq!(
        metric(&m, "isoserve_requests_total{outcome=\"rejected\"}"),
        7.0
    );
    assert_eq!(
        metric(&m, "isoserve_requests_total{outcome=\"finished\"}"),
        1.0
    );
}

// ---- the operator console ------------------------------------------------

const ALICE_KEY: &str = "sk-console-alice";
const BOB_KEY: &str = "sk-console-bob";
/// In a prompt and a cache salt: no console payload may carry it.
const SECRET: &str = "kumquat-zebra-7731";

fn console_tenants(operator: bool) -> Tenants {
    let mut file = format!(
        "[[tenant]]\nname = \"alice\"\napi_key_sha256 = \"{}\"\ncache_group = \"research\"\n\n\
         [[tenant]]\nname = \"bob\"\napi_key_sha256 = \"{}\"\nweight = 2\n\n",
        key_sha256_hex(ALICE_KEY),
        key_sha256_hex(BOB_KEY)
    );
    if operator {
        file += &format!(
            "[operator]\napi_key_sha256 = \"{}\"\n",
            key_sha256_hex(OPERATOR)
        );
    }
    Tenants::from_toml(&file).expect("tenants")
}

async fn get_auth(app: &Router, path: &str, auth: Option<String>) -> (StatusCode, String, String) {
    let mut b = Request::get(path);
    if let Some(a) = auth {
        b = b.header("authorization", a);
    }
    let resp = app
        .clone()
        .oneshot(b.body(Body::empty()).expect("req"))
        .await
        .expect("infallible");
    let status = resp.status();
    let challenge = resp
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().expect("ascii").to_string())
        .unwrap_or_default();
    let bytes = axum::body::to_bytes(resp.into_body(), 64 << 20)
        .await
        .expect("body");
    (
        status,
        challenge,
        String::from_utf8(bytes.to_vec()).expect("utf-8"),
    )
}

fn basic(user: &str, key: &str) -> String {
    use base64::Engine as _;
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:{key}"))
    )
}

const CONSOLE_PATHS: [&str; 4] = [
    "/console",
    "/console/console.js",
    "/console/console.css",
    "/console/snapshot",
];

/// Pins: a tenant's key never opens the console (403), no key asks for
/// credentials (401 with a Basic challenge), the operator's key opens it
/// as a bearer token or as a browser's Basic credentials; without an
/// `[operator]` section nobody does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_opens_for_the_operators_key_only() {
    let (api, ops) = api_and_ops(console_tenants(true));
    // The same rule on the API port and the operations listener.
    for (app, path) in CONSOLE_PATHS.iter().flat_map(|&p| [(&api, p), (&ops, p)]) {
        let (s, challenge, body) = get_auth(app, path, None).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{path}");
        assert!(challenge.starts_with("Basic realm="), "{path}: {challenge}");
        assert!(body.contains("\"error\""), "OpenAI-shaped: {body}");
        for tenant in [
            format!("Bearer {ALICE_KEY}"),
            basic("alice", ALICE_KEY),
            basic("operator", BOB_KEY),
        ] {
            let (s, _, body) = get_auth(app, path, Some(tenant.clone())).await;
            assert_eq!(s, StatusCode::FORBIDDEN, "{path} {tenant}: {body}");
            assert!(body.contains("a tenant's key does not open it"), "{body}");
        }
        let (s, _, _) = get_auth(app, path, Some("Bearer sk-nobody".into())).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{path}");
        let (s, _, _) = get_auth(app, path, Some(basic("x", "sk-nobody"))).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{path}");
        let (s, _, _) = get_auth(app, path, Some("Basic !!not-base64".into())).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{path}");
        for op in [format!("Bearer {OPERATOR}"), basic("anyone", OPERATOR)] {
            let (s, _, body) = get_auth(app, path, Some(op)).await;
            assert_eq!(s, StatusCode::OK, "{path}: {body}");
            assert!(!body.is_empty());
        }
    }
    let (app, _) = router(console_tenants(false), |_| {});
    let (s, _, body) = get_auth(&app, "/console/snapshot", Some(basic("op", OPERATOR))).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{body}");
    assert!(body.contains("add an [operator] section"), "{body}");
    let (s, _, body) = get_auth(&app, "/console", Some(format!("Bearer {BOB_KEY}"))).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{body}");
}

/// Every string a JSON document holds, and its largest integer.
fn strings_and_max(v: &Value, keys: &mut Vec<String>, out: &mut Vec<String>, max: &mut u64) {
    match v {
        Value::String(s) => out.push(s.clone()),
        Value::Number(n) => *max = (*max).max(n.as_u64().unwrap_or(0)),
        Value::Array(a) => a.iter().for_each(|x| strings_and_max(x, keys, out, max)),
        Value::Object(o) => {
            for (k, x) in o {
                keys.push(k.clone());
                strings_and_max(x, keys, out, max);
            }
        }
        _ => {}
    }
}

/// Pins: what the console sends is counts, states and names. A request
/// with a secret in its prompt and its cache salt runs (and leaves cached
/// pages in its salted scope, and in its group's): no page, script or
/// snapshot carries the secret, a key, a key's hash, a token id sequence
/// of the prompt or a scope's value; every string in a snapshot is a name
/// or a word of the console's own vocabulary; the cached pages show under
/// their group and as "salted".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_console_payload_carries_a_prompt_a_key_or_a_scope() {
    let (app, tok) = router(console_tenants(true), |_| {});
    let prompt = format!(
        "The vault code is {SECRET}. Never tell anyone {SECRET}; repeat it to nobody, {SECRET}."
    );
    let ids = tok.encode(&prompt, true).expect("encode");
    assert!(ids.len() > 32, "at least two pages to cache");
    let op = Some(format!("Bearer {OPERATOR}"));
    let mut payloads = Vec::new();
    for path in &CONSOLE_PATHS[..3] {
        payloads.push(get_auth(&app, path, op.clone()).await.2);
    }
    let run = |body: Value| {
        let app = app.clone();
        tokio::spawn(async move {
            call(
                &app,
                post_raw("/v1/completions", body.to_string(), Some(ALICE_KEY)),
            )
            .await
        })
    };
    let salted = run(
        json!({"prompt": prompt, "max_tokens": 64, "ignore_eos": true,
                            "cache_salt": SECRET}),
    );
    let grouped = run(json!({"prompt": prompt, "max_tokens": 64, "ignore_eos": true}));
    for _ in 0..4 {
        payloads.push(get_auth(&app, "/console/snapshot", op.clone()).await.2);
    }
    for r in [salted, grouped] {
        let (s, v) = r.await.expect("join");
        assert_eq!(s, StatusCode::OK, "{v}");
    }
    wait_idle(&app).await;
    // A map taken while they ran may still be young enough to be served:
    // ask until one shows no page held (bounded).
    let deadline = Instant::now() + Duration::from_secs(10);
    let last = loop {
        let (s, _, last) = get_auth(&app, "/console/snapshot", op.clone()).await;
        assert_eq!(s, StatusCode::OK);
        let v: Value = serde_json::from_str(&last).expect("json");
        let idle = !v["nodes"][0]["state"]
            .as_str()
            .expect("state")
            .contains(['o', 'l', 'r']);
        payloads.push(last.clone());
        if idle || Instant::now() > deadline {
            break last;
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
    };

    let id_runs: Vec<String> = ids
        .windows(3)
        .map(|w| format!("{},{},{}", w[0], w[1], w[2]))
        .collect();
    for p in &payloads {
        for needle in [SECRET, "kumquat", ALICE_KEY, BOB_KEY, OPERATOR] {
            assert!(!p.contains(needle), "{needle} in a console payload");
        }
        for key in [ALICE_KEY, BOB_KEY, OPERATOR] {
            assert!(!p.contains(&key_sha256_hex(key)), "a key hash in a payload");
        }
        for run in &id_runs {
            assert!(
                !p.contains(run.as_str()),
                "prompt token ids {run} in a payload"
            );
        }
    }
    let v: Value = serde_json::from_str(&last).expect("json");
    let node = &v["nodes"][0];
    let labels = v["labels"].as_array().expect("labels");
    let label_of = |name: &str| labels.iter().position(|l| l["name"] == name);
    let state = node["state"].as_str().expect("state");
    let cached: Vec<i64> = state
        .char_indices()
        .filter(|&(_, c)| c == 'c')
        .map(|(i, _)| node["label"][i].as_i64().expect("label"))
        .collect();
    let group = label_of("group research").expect("group label") as i64;
    let salted = label_of("salted scope").expect("salted label") as i64;
    assert!(cached.contains(&group), "{cached:?}");
    assert!(cached.contains(&salted), "{cached:?}");
    assert_eq!(v["tenants"][0]["name"], "alice");
    assert_eq!(v["tenants"][0]["finished"], 2);
    assert_eq!(v["tenants"][0]["tokens_generated"], 128);
    assert_eq!(v["tenants"][1]["finished"], 0);

    let allowed_words = [
        "alice",
        "bob",
        "group research",
        "salted scope",
        "unknown",
        "tenant",
        "group",
        "salted",
        "engine",
        "unified",
        "disaggregated",
        MODEL_ID,
    ];
    let counters: Vec<String> = request::console::pool_safety(&request::PoolStats::default())
        .into_iter()
        .map(|c| c.name)
        .collect();
    let allowed_keys = [
        "t_ms",
        "model",
        "uptime_s",
        "mode",
        "labels",
        "name",
        "kind",
        "tenants",
        "label",
        "weight",
        "in_flight",
        "running",
        "queued",
        "preempted",
        "tokens_generated",
        "tokens_per_s",
        "share",
        "weight_share",
        "prompt_tokens",
        "cached_tokens",
        "cache_hit_rate",
        "finished",
        "refused",
        "pages",
        "nodes",
        "role",
        "pages_total",
        "pages_per_cell",
        "page_size_tokens",
        "state",
        "epoch",
        "request",
        "written",
        "counts",
        "free",
        "poisoned",
        "cached",
        "private",
        "leased",
        "release_pending",
        "transfers",
        "snapshot_us_last",
        "snapshot_us_max",
        "map_age_ms",
        "safety",
        "node",
        "value",
        "history",
        "moved",
        "history_t_ms",
    ];
    for p in &payloads[3..] {
        let v: Value = serde_json::from_str(p).expect("json");
        let (mut keys, mut strings, mut max) = (Vec::new(), Vec::new(), 0u64);
        strings_and_max(&v, &mut keys, &mut strings, &mut max);
        for k in &keys {
            assert!(allowed_keys.contains(&k.as_str()), "unexpected field {k}");
        }
        for s in &strings {
            let ok = allowed_words.contains(&s.as_str())
                || counters.contains(s)
                || s.chars().all(|c| ".pcolr".contains(c))
                // Request ids (decimal).
                || (!s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit()));
            assert!(ok, "unexpected string {s:?} in a snapshot");
        }
        // Derived cache scopes have the top bit set: none may show.
        assert!(max < 1 << 63, "a scope value in a snapshot: {max}");
    }
}

/// Issue 35's first point: `chat_template_kwargs` reach the chat template
/// (as `enable_thinking` reaches Qwen 3's), on chat and `/tokenize` alike;
/// not an object, a name the template sets itself, or an endpoint without
/// a template is a 400 naming the field.
#[tokio::test]
async fn chat_template_kwargs_reach_the_template() {
    let path = model_path(256);
    let model = model::Model::load(&path, kernels::ThreadPool::new(1)).expect("load");
    let tok = tokenizer::Tokenizer::from_gguf(model.gguf()).expect("tokenizer");
    let template = tokenizer::ChatTemplate::new(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}\
         {% if enable_thinking is defined and not enable_thinking %}nothink\n{% endif %}\
         {% if add_generation_prompt %}assistant:{% endif %}",
        "",
        "",
    )
    .expect("template");
    let engine =
        engine::Engine::start(model, tok.clone(), engine::EngineConfig::default()).expect("start");
    let app = Server::new(
        engine,
        tok.clone(),
        Some(template),
        Tenants::anonymous(),
        None,
        ServerConfig::new(MODEL_ID),
    )
    .router();
    let msgs = json!([{"role": "user", "content": "hi"}]);
    // The text a /tokenize answer's ids decode to (BOS left out).
    let text = |v: &Value| {
        let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).expect("ids");
        tok.decode_with(&ids, true).expect("decode")
    };
    let (s, plain) = call(&app, post("/tokenize", json!({"messages": msgs}))).await;
    assert_eq!(s, StatusCode::OK, "{plain}");
    assert_eq!(text(&plain), "user: hi\nassistant:");
    let off = json!({"enable_thinking": false, "unused": {"a": [1, 2.5, null]}});
    let (s, v) = call(
        &app,
        post(
            "/tokenize",
            json!({"messages": msgs, "chat_template_kwargs": off}),
        ),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(text(&v), "user: hi\nnothink\nassistant:");
    let thinking_off = v["count"].clone();
    // A chat request renders the same prompt: its usage counts it.
    let (s, v) = call(
        &app,
        post(
            "/v1/chat/completions",
            json!({"messages": msgs, "max_tokens": 1, "chat_template_kwargs": off}),
        ),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], thinking_off);
    for (path, body, param) in [
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "chat_template_kwargs": [1]}),
            "chat_template_kwargs",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": msgs, "chat_template_kwargs": {"messages": []}}),
            "chat_template_kwargs.messages",
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "chat_template_kwargs": {"enable_thinking": false}}),
            "chat_template_kwargs",
        ),
        (
            "/tokenize",
            json!({"prompt": "x", "chat_template_kwargs": {"enable_thinking": false}}),
            "chat_template_kwargs",
        ),
    ] {
        let (s, v) = call(&app, post(path, body)).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{path}: {v}");
        assert_eq!(v["error"]["param"], json!(param), "{path}: {v}");
    }
}
