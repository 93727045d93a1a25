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
