//! The engine on the real default model (release-mode tests; the model is
//! fetched by scripts/test — a missing model fails, never skips).

use engine::{Engine, EngineConfig, Event, GenRequest, RequestError, StartError};
use kv::TenantId;
use model::sample::FinishReason;
use model::Model;
use tokenizer::Tokenizer;

use testkit::model_path;

fn load() -> (Model, Tokenizer) {
    let m = Model::load(&model_path(), kernels::ThreadPool::new(2)).unwrap();
    let t = Tokenizer::from_gguf(m.gguf()).unwrap();
    (m, t)
}

fn start(cfg: EngineConfig) -> (Engine, Tokenizer) {
    let (m, t) = load();
    (Engine::start(m, t.clone(), cfg).unwrap(), t)
}

/// Runs a request to the end; returns (token ids, text, finish).
fn run(engine: &Engine, req: GenRequest) -> Result<(Vec<u32>, String, FinishReason), RequestError> {
    let mut h = engine.submit(req)?;
    let mut ids = Vec::new();
    let mut text = String::new();
    while let Some(ev) = h.blocking_next() {
        match ev {
            Event::Token(t) => {
                ids.push(t.id);
                text.push_str(&t.text);
            }
            Event::Done(d) => {
                text.push_str(&d.tail_text);
                assert!(d.usage.completion_tokens >= ids.len());
                return Ok((ids, text, d.finish));
            }
            Event::Error(e) => return Err(e),
        }
    }
    panic!("event stream ended without Done");
}

fn small_cfg() -> EngineConfig {
    EngineConfig {
        kv_pages: Some(160), // 2560 tokens
        max_context: Some(2048),
        ..EngineConfig::default()
    }
}

#[test]
fn paris_through_the_engine() {
    let (engine, tok) = start(small_cfg());
    let prompt = tok.encode("The capital of France is", true).unwrap();
    let (_, text, finish) = run(&engine, GenRequest::greedy(TenantId(1), prompt, 3)).unwrap();
    assert!(text.starts_with(" Paris"), "got {text:?}");
    assert_eq!(finish, FinishReason::Length);
    let s = engine.stats();
    assert_eq!(s.pool.pages_unheld(), s.pool.pages_total);
    assert_eq!(s.pool.safety_refusals(), 0);
}

/// K12 through the scheduler: 32 concurrent greedy requests from 4 tenants
/// (continuous batching, chunked prefill mixed with decode rows, a small
/// step budget so prompts split) give token-for-token the output each
/// prompt gives alone.
#[test]
fn concurrent_greedy_outputs_equal_alone() {
    let cfg = EngineConfig {
        step_tokens: 24,
        max_running: 24,
        ..small_cfg()
    };
    let (engine, tok) = start(cfg);
    let texts = [
        "The capital of France is",
        "Once upon a time, in a small village,",
        "def fibonacci(n):",
        "The three primary colors are",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        "Water boils at a temperature of",
        "List three fruits: apple,",
        "In 1969, the first humans",
    ];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t, true).unwrap()).collect();
    let max_tokens = 12;
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            run(
                &engine,
                GenRequest::greedy(TenantId(9), p.clone(), max_tokens),
            )
            .unwrap()
            .0
        })
        .collect();
    let mut handles = Vec::new();
    for i in 0..32 {
        let req = GenRequest {
            ignore_eos: false,
            ..GenRequest::greedy(
                TenantId((i % 4) as u64),
                prompts[i % prompts.len()].clone(),
                max_tokens,
            )
        };
        handles.push((i, engine.submit(req).unwrap()));
    }
    let mut max_running = 0;
    for (i, mut h) in handles {
        let mut ids = Vec::new();
        while let Some(ev) = h.blocking_next() {
            max_running = max_running.max(engine.stats().running);
            match ev {
                Event::Token(t) => ids.push(t.id),
                Event::Done(_) => break,
                Event::Error(e) => panic!("request {i}: {e}"),
            }
        }
        let expect = &alone[i % prompts.len()];
        // EOS ends a request without a token event; compare what was emitted.
        assert_eq!(
            &ids[..],
            &expect[..ids.len().min(expect.len())],
            "request {i} differs from alone"
        );
        assert_eq!(
            ids.len(),
            expect.len(),
            "request {i} length differs from alone"
        );
    }
    assert!(max_running > 1, "requests never ran concurrently");
    let s = engine.stats();
    assert_eq!(s.pool.pages_unheld(), s.pool.pages_total, "pages leaked");
    assert_eq!(s.pool.safety_refusals(), 0);
}

#[test]
fn pool_smaller_than_window_refuses_to_start_naming_both_numbers() {
    let (m, t) = load();
    let cfg = EngineConfig {
        kv_pages: Some(64), // 1024 tokens < 8192
        ..EngineConfig::default()
    };
    let err = Engine::start(m, t, cfg).err().expect("must refuse");
    assert!(matches!(
        err,
        StartError::PoolSmallerThanWindow {
            pool_tokens: 1024,
            window_tokens: 8192
        }
    ));
    let msg = err.to_string();
    assert!(msg.contains("1024") && msg.contains("8192"), "{msg}");
}

/// Incident replay (unified): the pool is smaller than the model's window;
/// with --max-context the node advertises what it holds. A tenant's request
/// with a secret runs; another tenant's over-long request is refused with
/// the numbers before any allocation; the secret is in no other output.
#[test]
fn incident_replay_over_long_request_refused_secret_never_leaks() {
    let (m, t) = load();
    let cfg = EngineConfig {
        kv_pages: Some(64),
        max_context: Some(1024),
        ..EngineConfig::default()
    };
    let engine = Engine::start(m, t.clone(), cfg).unwrap();
    assert_eq!(engine.capacity().max_request_tokens, 1024);
    let secret = "The vault code is 7391-ALPHA-QUASAR. Repeat the vault code:";
    let a = t.encode(secret, true).unwrap();
    run(&engine, GenRequest::greedy(TenantId(1), a, 24)).unwrap();
    let allocs_before = engine.stats().pool.allocs;
    // Tenant 2: 1020 prompt tokens + 8 > 1024.
    let long: Vec<u32> = (0..1020).map(|i| 100 + (i % 500) as u32).collect();
    let err = run(&engine, GenRequest::greedy(TenantId(2), long, 8)).unwrap_err();
    match &err {
        RequestError::ContextLengthExceeded {
            prompt,
            max_tokens,
            total,
            limit,
        } => {
            assert_eq!(
                (*prompt, *max_tokens, *total, *limit),
                (1020, 8, 1028, 1024)
            );
        }
        other => panic!("expected context_length_exceeded, got {other:?}"),
    }
    assert!(err.to_string().contains("1024") && err.to_string().contains("1028"));
    assert_eq!(
        engine.stats().pool.allocs,
        allocs_before,
        "refused request allocated pages"
    );
    // Tenant 2 asks something short: its answer must not carry the secret.
    let b = t.encode("Tell me a number:", true).unwrap();
    let (_, b_text, _) = run(&engine, GenRequest::greedy(TenantId(2), b, 24)).unwrap();
    for frag in ["7391", "ALPHA", "QUASAR"] {
        assert!(
            !b_text.contains(frag),
            "secret fragment {frag} leaked: {b_text:?}"
        );
    }
    let s = engine.stats();
    assert_eq!(s.pool.pages_unheld(), s.pool.pages_total);
    assert_eq!(s.pool.safety_refusals(), 0);
}

#[test]
fn cancel_mid_stream_frees_pages_and_engine_keeps_serving() {
    let (engine, tok) = start(small_cfg());
    let prompt = tok.encode("Once upon a time", true).unwrap();
    for _ in 0..5 {
        let mut h = engine
            .submit(GenRequest {
                ignore_eos: true,
                ..GenRequest::greedy(TenantId(1), prompt.clone(), 200)
            })
            .unwrap();
        // Read two tokens, then drop the handle (a client disconnect).
        for _ in 0..2 {
            assert!(matches!(h.blocking_next(), Some(Event::Token(_))));
        }
        drop(h);
    }
    let (_, text, _) = run(
        &engine,
        GenRequest::greedy(
            TenantId(2),
            tok.encode("The capital of France is", true).unwrap(),
            3,
        ),
    )
    .unwrap();
    assert!(text.starts_with(" Paris"));
    // The engine reaps cancelled requests at its next step; wait for idle.
    for _ in 0..200 {
        let s = engine.stats();
        if s.running == 0 && s.pool.pages_unheld() == s.pool.pages_total {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let s = engine.stats();
    assert_eq!(s.pool.pages_unheld(), s.pool.pages_total);
    assert_eq!(s.requests_cancelled_total, 5);
    assert_eq!(s.pool.safety_refusals(), 0);
}

#[test]
fn invalid_requests_are_refused_with_the_field() {
    let (engine, _) = start(small_cfg());
    let e = engine
        .submit(GenRequest::greedy(TenantId(1), vec![], 4))
        .err()
        .unwrap();
    assert_eq!(e, RequestError::EmptyPrompt);
    let e = engine
        .submit(GenRequest::greedy(TenantId(1), vec![1, 2], 0))
        .err()
        .unwrap();
    assert!(matches!(
        e,
        RequestError::InvalidParam {
            field: "max_tokens",
            ..
        }
    ));
    let e = engine
        .submit(GenRequest::greedy(TenantId(1), vec![999_999], 4))
        .err()
        .unwrap();
    assert!(matches!(
        e,
        RequestError::InvalidParam {
            field: "prompt",
            ..
        }
    ));
    let mut r = GenRequest::greedy(TenantId(1), vec![504], 4);
    r.params.top_p = 2.0;
    assert!(matches!(
        engine.submit(r).err().unwrap(),
        RequestError::InvalidParam { field: "top_p", .. }
    ));
    assert_eq!(engine.stats().pool.allocs, 0);
}

#[test]
fn stop_strings_and_eos_end_requests() {
    let (engine, tok) = start(small_cfg());
    let prompt = tok.encode("The capital of France is", true).unwrap();
    let (_, full, _) = run(&engine, GenRequest::greedy(TenantId(1), prompt.clone(), 12)).unwrap();
    // Stop on the second word of the greedy continuation.
    let word = full
        .split_whitespace()
        .nth(1)
        .expect("two words")
        .to_string();
    let req = GenRequest {
        stop: vec![word.clone()],
        ..GenRequest::greedy(TenantId(1), prompt, 12)
    };
    let (_, text, finish) = run(&engine, req).unwrap();
    assert_eq!(finish, FinishReason::Stop);
    assert!(
        !text.contains(&word),
        "{text:?} contains the stop string {word:?}"
    );
    assert!(full.starts_with(&text));
}

/// Per-request event channels are bounded (`request::REQUEST_EVENTS_MAX`).
/// A client that stops reading holds up only its own request: the engine
/// stops stepping it once its channel is (almost) full, keeps its pages,
/// serves everyone else meanwhile, and resumes when the client reads — the
/// client then gets every token, the same as a request read at once (K12),
/// and nothing was dropped. Without the engine's room check, events beyond
/// the bound are lost and the token count below fails.
#[test]
fn a_client_that_stops_reading_pauses_only_its_own_request() {
    let (engine, tok) = start(small_cfg());
    let prompt = tok.encode("Once upon a time", true).unwrap();
    let n = 600;
    let req = || GenRequest {
        ignore_eos: true,
        ..GenRequest::greedy(TenantId(1), prompt.clone(), n)
    };
    let (alone, _, _) = run(&engine, req()).unwrap();
    assert_eq!(alone.len(), n);
    let generated_before = engine.stats().generated_tokens_total;

    let mut slow = engine.submit(req()).unwrap();
    // Wait until the engine has stopped stepping the unread request.
    // (No change for 250 ms; bounded at 30 s.)
    let (mut last, mut stable) = (u64::MAX, 0);
    for _ in 0..1200 {
        std::thread::sleep(std::time::Duration::from_millis(25));
        let g = engine.stats().generated_tokens_total;
        stable = if g == last { stable + 1 } else { 0 };
        last = g;
        if stable >= 10 {
            break;
        }
    }
    let paused_at = (last - generated_before) as usize;
    assert!(
        paused_at < request::REQUEST_EVENTS_MAX && paused_at + 2 >= request::REQUEST_EVENTS_MAX,
        "the unread request generated {paused_at} tokens (bound {})",
        request::REQUEST_EVENTS_MAX
    );
    let s = engine.stats();
    assert_eq!(
        s.running, 1,
        "the paused request keeps running (and its pages)"
    );
    assert!(s.pool.pages_unheld() < s.pool.pages_total);

    // Another tenant is served meanwhile.
    let (_, text, _) = run(
        &engine,
        GenRequest::greedy(
            TenantId(2),
            tok.encode("The capital of France is", true).unwrap(),
            3,
        ),
    )
    .unwrap();
    assert!(text.starts_with(" Paris"), "{text:?}");

    // Reading resumes it; nothing was lost.
    let mut ids = Vec::new();
    loop {
        match slow.blocking_next() {
            Some(Event::Token(t)) => ids.push(t.id),
            Some(Event::Done(d)) => {
                assert_eq!(d.usage.completion_tokens, n);
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(
        ids, alone,
        "the paused request's tokens differ from an unpaused run"
    );
    for _ in 0..200 {
        let s = engine.stats();
        if s.running == 0 && s.pool.pages_unheld() == s.pool.pages_total {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let s = engine.stats();
    assert_eq!(s.pool.pages_unheld(), s.pool.pages_total);
    assert_eq!(s.pool.safety_refusals(), 0);
}

/// Speculation changes how many steps make the output, never the output
/// (K12): greedy and seeded sampling, with prompt lookup and with
/// predictions (right, edited and wrong), alone and all at once in one
/// batch, give the tokens the engine without speculation gives. The
/// drafts were really verified: the engine kept some and rejected some.
#[test]
fn speculation_never_changes_the_output_alone_or_batched_k12() {
    let (plain, tok) = start(small_cfg());
    let paragraph = "The river rises in the hills, runs through the old town, \
                     turns the mill, and reaches the sea after forty miles.";
    let texts = [
        format!(
            "<|im_start|>user\nRepeat this sentence exactly: {paragraph}<|im_end|>\n\
             <|im_start|>assistant\n"
        ),
        "def fibonacci(n):".to_string(),
        "Once upon a time, in a small village,".to_string(),
    ];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| tok.encode(t, true).unwrap()).collect();
    let max_tokens = 48;
    let seeded = |p: &Vec<u32>| GenRequest {
        params: model::sample::SamplingParams {
            temperature: 0.8,
            seed: 7,
            ..Default::default()
        },
        ..GenRequest::greedy(TenantId(1), p.clone(), max_tokens)
    };
    let mut reqs: Vec<GenRequest> = Vec::new();
    for p in &prompts {
        reqs.push(GenRequest::greedy(TenantId(1), p.clone(), max_tokens));
        reqs.push(seeded(p));
    }
    let want: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| run(&plain, r.clone()).unwrap().0)
        .collect();
    drop(plain);
    // Predictions: the output itself, the output with an edit in the
    // middle, and text it never says.
    let mut predicted = Vec::new();
    for (r, w) in reqs.iter().zip(&want) {
        let mut edited = w.clone();
        edited.splice(10..12, tok.encode(" purple elephants", false).unwrap());
        for prediction in [
            w.clone(),
            edited,
            tok.encode(" zebra ".repeat(20).as_str(), false).unwrap(),
        ] {
            predicted.push((
                GenRequest {
                    prediction,
                    ..r.clone()
                },
                w.clone(),
            ));
        }
    }
    let cfg = EngineConfig {
        // Room for drafts beside a full batch, so the batched run below
        // verifies drafts too.
        speculation: engine::Speculation {
            method: engine::SpecMethod::Ngram,
            rows_max: 96,
            ..Default::default()
        },
        max_running: 32,
        ..small_cfg()
    };
    let (spec, _) = start(cfg);
    for (i, (r, w)) in reqs
        .iter()
        .zip(&want)
        .chain(predicted.iter().map(|(r, w)| (r, w)))
        .enumerate()
    {
        let mut h = spec.submit(r.clone()).unwrap();
        let mut ids = Vec::new();
        while let Some(ev) = h.blocking_next() {
            match ev {
                Event::Token(t) => ids.push(t.id),
                Event::Done(d) => {
                    let u = d.usage;
                    if i >= reqs.len() && (i - reqs.len()).is_multiple_of(3) {
                        // The exact output as the prediction: some kept (how
                        // much depends on the cost model's view of this
                        // machine's step times).
                        assert!(u.accepted_prediction_tokens > 0, "{u:?}");
                    }
                    if r.prediction.is_empty() {
                        assert_eq!(
                            u.accepted_prediction_tokens + u.rejected_prediction_tokens,
                            0
                        );
                    }
                    break;
                }
                Event::Error(e) => panic!("request {i}: {e}"),
            }
        }
        assert_eq!(&ids, w, "request {i} alone");
    }
    let alone = spec.stats();
    assert!(alone.spec_accepted_tokens_total > 0, "{alone:?}");
    assert!(alone.spec_draft_tokens_total > alone.spec_accepted_tokens_total);
    // All at once, in one batch (which turns speculation down: the batch
    // fills the step by itself).
    let handles: Vec<_> = reqs
        .iter()
        .zip(&want)
        .chain(predicted.iter().map(|(r, w)| (r, w)))
        .map(|(r, w)| (spec.submit(r.clone()).unwrap(), w))
        .collect();
    for (i, (mut h, w)) in handles.into_iter().enumerate() {
        let mut ids = Vec::new();
        while let Some(ev) = h.blocking_next() {
            match ev {
                Event::Token(t) => ids.push(t.id),
                Event::Done(_) => break,
                Event::Error(e) => panic!("request {i}: {e}"),
            }
        }
        assert_eq!(
            &ids[..],
            &w[..ids.len().min(w.len())],
            "batched request {i}"
        );
        assert_eq!(ids.len(), w.len(), "batched request {i}");
    }
    let s = spec.stats();
    assert!(
        s.spec_accepted_tokens_total > alone.spec_accepted_tokens_total,
        "no draft was kept in the batch"
    );
    assert_eq!(s.pool.pages_unheld(), s.pool.pages_total, "pages leaked");
    assert_eq!(s.pool.safety_refusals(), 0);
}

/// Writes a draft of the default model's `layers` (the GGUF writer's
/// self-speculation draft), with `edit` applied to its writer.
fn write_draft(
    name: &str,
    layers: &[usize],
    edit: impl FnOnce(&mut gguf::write::GgufWriter),
) -> std::path::PathBuf {
    let file = gguf::GgufFile::open(model_path()).unwrap();
    let mut w = gguf::write::select_layers(&file, layers).unwrap();
    edit(&mut w);
    let path =
        std::env::temp_dir().join(format!("isoserve-draft-{name}-{}.gguf", std::process::id()));
    w.write(&path).unwrap();
    path
}

/// `--draft-model` (K12): drafts written by the GGUF writer from the
/// default model's own layers — its first and last four, and all of them
/// (a draft that agrees with the model, so its probes are kept) — leave
/// greedy and seeded output as the engine without a draft gives it, alone
/// and in one batch. The draft pool is whole at the end, its checks never
/// refused, and the draft model really ran and drafted.
#[test]
fn a_draft_model_of_the_models_own_layers_never_changes_the_output_k12() {
    let (plain, tok) = start(small_cfg());
    let prompts: Vec<Vec<u32>> = [
        "<|im_start|>user\nName three rivers in Europe.<|im_end|>\n<|im_start|>assistant\n",
        "def fibonacci(n):",
    ]
    .iter()
    .map(|t| tok.encode(t, true).unwrap())
    .collect();
    let mut reqs = Vec::new();
    for p in &prompts {
        reqs.push(GenRequest::greedy(TenantId(1), p.clone(), 40));
        reqs.push(GenRequest {
            params: model::sample::SamplingParams {
                temperature: 0.8,
                seed: 11,
                ..Default::default()
            },
            ..GenRequest::greedy(TenantId(2), p.clone(), 40)
        });
    }
    let want: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| run(&plain, r.clone()).unwrap().0)
        .collect();
    drop(plain);
    let skip: Vec<usize> = (0..4).chain(26..30).collect();
    let all: Vec<usize> = (0..30).collect();
    for (name, layers) in [("skip", skip), ("all", all)] {
        let path = write_draft(name, &layers, |_| {});
        let cfg = EngineConfig {
            draft_model: Some(path.clone()),
            ..small_cfg()
        };
        let (engine, _) = start(cfg);
        for (i, (r, w)) in reqs.iter().zip(&want).enumerate() {
            assert_eq!(
                &run(&engine, r.clone()).unwrap().0,
                w,
                "{name} draft, request {i} alone"
            );
        }
        let handles: Vec<_> = reqs
            .iter()
            .map(|r| engine.submit(r.clone()).unwrap())
            .collect();
        for (i, (mut h, w)) in handles.into_iter().zip(&want).enumerate() {
            let mut ids = Vec::new();
            while let Some(ev) = h.blocking_next() {
                match ev {
                    Event::Token(t) => ids.push(t.id),
                    Event::Done(_) => break,
                    Event::Error(e) => panic!("{name} draft, batched request {i}: {e}"),
                }
            }
            assert_eq!(&ids, w, "{name} draft, batched request {i}");
        }
        let s = engine.stats();
        let d = s.draft_pool.expect("a draft pool");
        assert_eq!(d.pages_free, d.pages_total, "draft pages leaked");
        assert_eq!(d.safety_refusals(), 0);
        assert!(
            s.spec_draft_passes_total > 0 && s.spec_draft_tokens_total > 0,
            "{s:?}"
        );
        if name == "all" {
            assert!(
                s.spec_accepted_tokens_total > 0,
                "the model's own draft kept nothing: {s:?}"
            );
        }
        drop(engine);
        let _ = std::fs::remove_file(path);
    }
}

/// `--draft-model` with another vocabulary is refused at start, and the
/// refusal names the first token that differs.
#[test]
fn a_draft_model_with_another_vocabulary_is_refused_naming_the_token() {
    let file = gguf::GgufFile::open(model_path()).unwrap();
    let mut tokens: Vec<gguf::Value> = file
        .get_string_array("tokenizer.ggml.tokens")
        .unwrap()
        .into_iter()
        .map(|t| gguf::Value::String(t.to_string()))
        .collect();
    tokens[1234] = gguf::Value::String("not-the-same".into());
    let path = write_draft("vocab", &[0, 1], |w| {
        w.add_kv("tokenizer.ggml.tokens", gguf::Value::Array(tokens));
    });
    let (m, t) = load();
    let cfg = EngineConfig {
        draft_model: Some(path.clone()),
        ..small_cfg()
    };
    let err = match Engine::start(m, t, cfg) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a draft of another vocabulary was accepted"),
    };
    let _ = std::fs::remove_file(path);
    assert!(
        err.contains("--draft-model") && err.contains("token 1234"),
        "{err}"
    );
    assert!(err.contains("not-the-same"), "{err}");
}
