//! The PD stack on the real default model, in one process over loopback TCP:
//! a decode node, a prefill node and the gateway backend (release-mode
//! tests; the model is fetched by scripts/test — missing fails, never
//! skips). Each test asserts outputs and the pools' final state.

use std::io::{Read, Write};
use std::net::{TcpListener as StdListener, TcpStream as StdStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{Backend, Engine, EngineConfig, Event, GenRequest, RequestError};
use gateway::{GatewayBackend, GatewayOptions};
use kv::TenantId;
use model::Model;
use pd::node::{start_node, RunningNode};
use pd::role::{PdConfig, PdRole};
use tokenizer::Tokenizer;
use transfer::wire::Message;
use transport::TransportConfig;

use testkit::model_path;

fn load() -> (Model, Tokenizer, [u8; 32]) {
    let m = Model::load(&model_path(), kernels::ThreadPool::new(1)).unwrap();
    let t = Tokenizer::from_gguf(m.gguf()).unwrap();
    let fp = m.gguf().fingerprint().unwrap();
    (m, t, fp)
}

struct Stack {
    rt: tokio::runtime::Runtime,
    prefill: RunningNode,
    decode: RunningNode,
    gateway: Arc<GatewayBackend>,
    tok: Tokenizer,
}

struct StackCfg {
    prefill: EngineConfig,
    decode: EngineConfig,
    /// Put a tampering proxy between the nodes (and the gateway) and decode.
    proxy: Option<Tamper>,
    skip_limit_check: bool,
    decode_fingerprint: Option<[u8; 32]>,
}

impl Default for StackCfg {
    fn default() -> Self {
        let small = EngineConfig {
            kv_memory_bytes: 64 << 20,
            max_context: Some(1024),
            ..EngineConfig::default()
        };
        StackCfg {
            prefill: small.clone(),
            decode: small,
            proxy: None,
            skip_limit_check: false,
            decode_fingerprint: None,
        }
    }
}

type Tamper = Arc<dyn Fn(Message) -> Option<Message> + Send + Sync>;

/// A TCP proxy that passes frames through, letting `tamper` rewrite (or,
/// returning the raw-flip marker, corrupt) decoded messages. Returns its
/// address.
fn proxy(target: std::net::SocketAddr, tamper: Tamper, flips: Arc<AtomicUsize>) -> String {
    let l = StdListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(client) = c else { return };
            let Ok(server) = StdStream::connect(target) else {
                return;
            };
            let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            // server → client: as is.
            std::thread::spawn(move || {
                let (mut s2, mut c2) = (s2, c2);
                let _ = std::io::copy(&mut s2, &mut c2);
                let _ = c2.shutdown(std::net::Shutdown::Both);
            });
            // client → server: frame by frame, through the tamper.
            let t = tamper.clone();
            let flips = flips.clone();
            std::thread::spawn(move || {
                let (mut client, mut server) = (client, server);
                let mut buf = Vec::new();
                let mut chunk = vec![0u8; 1 << 16];
                loop {
                    let n = match client.read(&mut chunk) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    buf.extend_from_slice(&chunk[..n]);
                    while buf.len() >= 4 {
                        let len = u32::from_le_bytes(buf[..4].try_into().unwrap()) as usize;
                        if buf.len() < 4 + len {
                            break;
                        }
                        let mut frame: Vec<u8> = buf.drain(..4 + len).collect();
                        if let Ok(Some((msg, _))) = Message::decode(&frame) {
                            let kind = msg.kind_name();
                            match t(msg.clone()) {
                                Some(m) if m != msg => {
                                    flips.fetch_add(1, Ordering::SeqCst);
                                    frame.clear();
                                    m.encode(&mut frame);
                                }
                                None => {
                                    // Raw corruption: flip a byte past the header.
                                    flips.fetch_add(1, Ordering::SeqCst);
                                    let at = if kind == "Page" { 54 + 10 } else { 8 };
                                    frame[at] ^= 0x40;
                                }
                                _ => {}
                            }
                        }
                        if server.write_all(&frame).is_err() {
                            return;
                        }
                    }
                }
                let _ = server.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    addr
}

impl Stack {
    fn start(cfg: StackCfg) -> Stack {
        Self::start_with(cfg, Arc::new(AtomicUsize::new(0)))
    }

    fn start_with(cfg: StackCfg, flips: Arc<AtomicUsize>) -> Stack {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let _g = rt.enter();
        let (dm, dt, fp) = load();
        let (pm, pt, _) = load();
        let tok = pt.clone();
        let bind = || {
            let l = StdListener::bind("127.0.0.1:0").unwrap();
            l.set_nonblocking(true).unwrap();
            tokio::net::TcpListener::from_std(l).unwrap()
        };
        let decode = start_node(
            PdRole::Decode,
            dm,
            dt,
            cfg.decode,
            PdConfig {
                node: "decode-0".into(),
                fingerprint: cfg.decode_fingerprint.unwrap_or(fp),
                transfer_window_pages: 4,
                ..PdConfig::default()
            },
            bind(),
            TransportConfig::default(),
        )
        .unwrap();
        let prefill = start_node(
            PdRole::Prefill,
            pm,
            pt,
            cfg.prefill,
            PdConfig {
                node: "prefill-0".into(),
                fingerprint: fp,
                transfer_window_pages: 4,
                ..PdConfig::default()
            },
            bind(),
            TransportConfig::default(),
        )
        .unwrap();
        let decode_addr = match cfg.proxy {
            Some(t) => proxy(decode.addr, t, flips),
            None => decode.addr.to_string(),
        };
        let mut opts =
            GatewayOptions::new(vec![prefill.addr.to_string()], vec![decode_addr], fp, 8192);
        opts.skip_limit_check = cfg.skip_limit_check;
        let gateway = Arc::new(GatewayBackend::start(opts));
        drop(_g);
        Stack {
            rt,
            prefill,
            decode,
            gateway,
            tok,
        }
    }

    fn wait_ready(&self) {
        let t0 = Instant::now();
        while !self.gateway.ready() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "gateway never paired: {:?}",
                self.gateway.nodes()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs a request to its end: (tokens, text) or the error.
    fn run(&self, req: GenRequest) -> Result<(Vec<u32>, String), RequestError> {
        self.run_usage(req).map(|(ids, text, _)| (ids, text))
    }

    /// [`Stack::run`], with the usage the gateway reported.
    fn run_usage(
        &self,
        req: GenRequest,
    ) -> Result<(Vec<u32>, String, engine::Usage), RequestError> {
        let mut h = self.gateway.submit(req)?;
        self.rt.block_on(async move {
            let mut ids = Vec::new();
            let mut text = String::new();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
            loop {
                let ev = tokio::time::timeout_at(deadline, h.next()).await.expect("request timed out");
                match ev {
                    Some(Event::Token(t)) => {
                        ids.push(t.id);
                        text.push_str(&t.text);
                    }
                    Some(Event::Done(d)) => {
                        text.push_str(&d.tail_text);
                        // An EOS that ended it counts, but is no Token event.
                        assert!(d.usage.completion_tokens >= ids.len());
                        return Ok((ids, text, d.usage));
                    }
                    Some(Event::Error(e)) => {
                        assert!(ids.is_empty() || matches!(&e, RequestError::Remote { code, .. } if code == "decode_lost"),
                            "error after {} tokens: {e}", ids.len());
                        return Err(e);
                    }
                    None => panic!("event stream ended without an end"),
                }
            }
        })
    }

    /// Waits until no page of either pool is held (prefill may keep idle
    /// cached pages; decode caches nothing), bounded; then
    /// returns their stats.
    fn pools_free(&self) -> (kv::PoolStats, kv::PoolStats) {
        let t0 = Instant::now();
        loop {
            let p = self.prefill.node.stats().engine.pool;
            let d = self.decode.node.stats().engine.pool;
            if p.pages_unheld() == p.pages_total
                && d.pages_free == d.pages_total
                && p.pages_total > 0
            {
                assert_eq!(p.pages_leased + d.pages_leased, 0);
                assert_eq!(p.refused_double_free + d.refused_double_free, 0);
                return (p, d);
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "pages not released: prefill {p:?}, decode {d:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Reads a node's counters until `ok` holds (bounded: 20 s), then returns
/// them. Stats are a snapshot each node publishes after a loop iteration, and
/// a node sends a request's end before that iteration's publish: a client can
/// see the end before the counter that records it (CI flake: prefill's
/// `prefills_refused_total` read as 0 right after its refusal arrived).
fn settled<T: std::fmt::Debug>(what: &str, read: impl Fn() -> T, ok: impl Fn(&T) -> bool) -> T {
    let t0 = Instant::now();
    loop {
        let v = read();
        if ok(&v) {
            return v;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{what} never settled: {v:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn greedy(tok: &Tokenizer, tenant: u64, text: &str, max_tokens: usize) -> GenRequest {
    GenRequest::greedy(
        TenantId(tenant),
        tok.encode(text, true).unwrap(),
        max_tokens,
    )
}

/// Each prompt's greedy tokens (tenant 1, `max_tokens`) on the unified
/// engine, one at a time: the reference PD output must equal.
fn unified_outputs(
    unified: &Engine,
    tok: &Tokenizer,
    prompts: &[&str],
    max_tokens: usize,
) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .map(|p| {
            let mut h = unified.submit(greedy(tok, 1, p, max_tokens)).unwrap();
            let mut ids = Vec::new();
            while let Some(ev) = h.blocking_next() {
                match ev {
                    Event::Token(t) => ids.push(t.id),
                    Event::Done(_) => break,
                    Event::Error(e) => panic!("{e}"),
                }
            }
            ids
        })
        .collect()
}

const PROMPTS: [&str; 24] = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite book is",
    "In 1969, the first humans",
    "The quick brown fox",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "import numpy as np\n",
    "Dear Sir or Madam,",
    "The meaning of life is",
    "Photosynthesis is the process by which",
    "A haiku about the sea:",
    "SELECT name FROM users WHERE",
    "The best way to learn a language is",
    "Breaking news: scientists have discovered",
    "Roses are red, violets are",
    "The Pythagorean theorem states that",
    "Here is a list of fruits: apple, banana,",
    "The stock market today",
    "How to change a tyre: step one,",
    "The opposite of hot is",
];

#[test]
fn pd_output_equals_unified_token_for_token() {
    let (m, t, _) = load();
    let unified = Engine::start(
        m,
        t.clone(),
        EngineConfig {
            kv_memory_bytes: 64 << 20,
            max_context: Some(1024),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let expected = unified_outputs(&unified, &t, &PROMPTS, 12);
    drop(unified);
    let stack = Stack::start(StackCfg::default());
    stack.wait_ready();
    // All at once: batched together on both nodes.
    let stack = Arc::new(stack);
    let handles: Vec<_> = PROMPTS
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let s = stack.clone();
            let req = greedy(&s.tok, 1 + i as u64 % 3, p, 12);
            std::thread::spawn(move || s.run(req))
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (ids, _) = h
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("prompt {i}: {e}"));
        assert_eq!(ids, expected[i], "prompt {i} {:?}", PROMPTS[i]);
    }
    let (p, d) = stack.pools_free();
    assert_eq!(p.safety_refusals() + d.safety_refusals(), 0);
    let ds = settled(
        "decode's completed transfers",
        || stack.decode.node.stats().decode.unwrap(),
        |d| d.transfers_completed_total >= 24,
    );
    assert_eq!(ds.transfers_completed_total, 24);
    assert_eq!(
        ds.checksum_failures_total + ds.canary_failures_total + ds.pages_fenced_total,
        0
    );
    let ps = settled(
        "prefill's pages sent",
        || stack.prefill.node.stats().prefill.unwrap(),
        |p| p.pages_sent_total >= ds.pages_received_total,
    );
    assert_eq!(ps.pages_sent_total, ds.pages_received_total);
}

/// Runs `reqs` at once (a thread each) and returns their tokens, in order.
fn run_at_once(stack: &Arc<Stack>, reqs: Vec<GenRequest>) -> Vec<Vec<u32>> {
    let handles: Vec<_> = reqs
        .into_iter()
        .map(|r| {
            let s = stack.clone();
            std::thread::spawn(move || s.run(r))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().unwrap().unwrap().0)
        .collect()
}

/// The speculation tests' small engine configuration, and the unified
/// engine's greedy outputs (24 tokens) for `prompts` without speculation.
fn small_unified_outputs(prompts: &[&str]) -> (EngineConfig, Vec<Vec<u32>>) {
    let (m, t, _) = load();
    let small = EngineConfig {
        kv_memory_bytes: 64 << 20,
        max_context: Some(1024),
        ..EngineConfig::default()
    };
    let unified = Engine::start(m, t.clone(), small.clone()).unwrap();
    (small, unified_outputs(&unified, &t, prompts, 24))
}

/// The decode node speculates (prompt lookup, and predictions that
/// travelled in the request): the output is the unified engine's without
/// speculation, token for token, alone and batched; the prediction's usage
/// crosses the wire to the gateway; rolled-back rows never trouble the
/// transfer (no refusal, every page back).
#[test]
fn pd_decode_speculates_and_the_output_is_unified_without_speculation_k12() {
    let prompts = &PROMPTS[..8];
    let (small, expected) = small_unified_outputs(prompts);
    let spec = EngineConfig {
        speculation: engine::Speculation {
            method: engine::SpecMethod::Ngram,
            rows_max: 64,
            ..Default::default()
        },
        ..small.clone()
    };
    let stack = Arc::new(Stack::start(StackCfg {
        prefill: small,
        decode: spec,
        ..StackCfg::default()
    }));
    stack.wait_ready();
    // Request i: even ones predict their exact output, odd ones an edit.
    let req = |i: usize| {
        let mut prediction = expected[i].clone();
        if i % 2 == 1 && prediction.len() > 16 {
            prediction[8] = prediction[8].wrapping_add(1) % 1000;
            prediction.remove(16);
        }
        GenRequest {
            prediction,
            ..greedy(&stack.tok, 1 + i as u64 % 3, prompts[i], 24)
        }
    };
    for (i, want) in expected.iter().enumerate() {
        let (ids, _, usage) = stack.run_usage(req(i)).unwrap();
        assert_eq!(&ids, want, "alone: prompt {i}");
        // How much is kept depends on the cost model's view of this
        // machine's step times; that something was verified and kept, and
        // that the counts crossed the wire, does not.
        assert!(
            usage.accepted_prediction_tokens > 0,
            "prompt {i}: {usage:?}"
        );
    }
    let batched = run_at_once(&stack, (0..prompts.len()).map(req).collect());
    for (i, ids) in batched.iter().enumerate() {
        assert_eq!(ids, &expected[i], "batched: prompt {i}");
    }
    let (p, d) = stack.pools_free();
    assert_eq!(p.safety_refusals() + d.safety_refusals(), 0);
    let ds = stack.decode.node.stats().engine;
    assert!(ds.spec_accepted_tokens_total > 0, "{ds:?}");
}

/// The decode node drafts with a draft model (`--draft-model`, a draft the
/// GGUF writer made of the default model's first and last four layers):
/// the output is the unified engine's without speculation, alone and
/// batched; the draft model ran; its pool — the decode node's own, the
/// prompt's K/V having come by transfer into the target pool only — is
/// whole at the end with no refusal; the prefill node has no draft.
#[test]
fn pd_decode_drafts_with_a_draft_model_and_the_output_is_unchanged_k12() {
    let prompts = &PROMPTS[..6];
    let (small, expected) = small_unified_outputs(prompts);
    let file = gguf::GgufFile::open(testkit::model_path()).unwrap();
    let layers: Vec<usize> = (0..4).chain(26..30).collect();
    let draft = std::env::temp_dir().join(format!("isoserve-pd-draft-{}.gguf", std::process::id()));
    gguf::write::select_layers(&file, &layers)
        .unwrap()
        .write(&draft)
        .unwrap();
    let with_draft = EngineConfig {
        draft_model: Some(draft.clone()),
        ..small.clone()
    };
    let stack = Arc::new(Stack::start(StackCfg {
        prefill: with_draft.clone(),
        decode: with_draft,
        ..StackCfg::default()
    }));
    stack.wait_ready();
    for (i, want) in expected.iter().enumerate() {
        let (ids, _) = stack
            .run(greedy(&stack.tok, 1 + i as u64 % 3, prompts[i], 24))
            .unwrap();
        assert_eq!(&ids, want, "alone: prompt {i}");
    }
    let reqs = (0..prompts.len())
        .map(|i| greedy(&stack.tok, 1 + i as u64 % 3, prompts[i], 24))
        .collect();
    for (i, ids) in run_at_once(&stack, reqs).iter().enumerate() {
        assert_eq!(ids, &expected[i], "batched: prompt {i}");
    }
    let (p, d) = stack.pools_free();
    assert_eq!(p.safety_refusals() + d.safety_refusals(), 0);
    let ds = settled(
        "the decode node's draft pool whole",
        || stack.decode.node.stats().engine,
        |e| e.draft_pool.is_some_and(|d| d.pages_free == d.pages_total),
    );
    let dp = ds.draft_pool.expect("the decode node has a draft pool");
    assert_eq!(dp.safety_refusals(), 0);
    assert!(ds.spec_draft_passes_total > 0, "{ds:?}");
    assert!(ds.spec_draft_tokens_total > 0, "{ds:?}");
    assert!(stack.prefill.node.stats().engine.draft_pool.is_none());
    let _ = std::fs::remove_file(draft);
}

#[test]
fn incident_placeholder_request_never_decodes() {
    // Prefill's pool: 4 pages × 16 = 64 tokens, below decode's and the
    // window; prefill advertises 64 honestly. The gateway is made to pass
    // an over-long request on, so prefill's own check must catch it.
    let cfg = StackCfg {
        prefill: EngineConfig {
            kv_pages: Some(4),
            max_context: Some(64),
            ..EngineConfig::default()
        },
        decode: EngineConfig {
            kv_pages: Some(64),
            max_context: Some(1024),
            ..EngineConfig::default()
        },
        skip_limit_check: true,
        ..StackCfg::default()
    };
    let stack = Stack::start(cfg);
    stack.wait_ready();
    let secret = "The vault code is PINEAPPLE-7731. Repeat the vault code:";
    let (_, text1) = stack.run(greedy(&stack.tok, 1, secret, 12)).unwrap();
    let long = "Tell me about the weather in the mountains in spring. ".repeat(8);
    let req = greedy(&stack.tok, 2, &long, 16);
    let prompt_len = req.prompt.len();
    assert!(
        prompt_len + 16 > 64 && prompt_len + 16 <= 1024,
        "{prompt_len}"
    );
    // Stats are published after each step: wait for the first request's end
    // to show (its pages free) before reading the counter.
    stack.pools_free();
    let gen_before = settled(
        "decode's end of the first request",
        || stack.decode.node.stats(),
        |s| s.engine.running == 0 && s.decode.as_ref().unwrap().transfers_completed_total >= 1,
    )
    .engine
    .generated_tokens_total;
    let err = stack.run(req).expect_err("prefill must refuse it");
    match &err {
        RequestError::Remote {
            status,
            code,
            message,
        } => {
            assert_eq!((*status, code.as_str()), (400, "context_length_exceeded"));
            assert!(
                message.contains("maximum context length is 64 tokens"),
                "{message}"
            );
        }
        e => panic!("not prefill's original error: {e:?}"),
    }
    let (_p, d) = stack.pools_free();
    assert_eq!(d.safety_refusals(), 0);
    let ds = stack.decode.node.stats();
    assert_eq!(
        ds.engine.generated_tokens_total, gen_before,
        "decode generated tokens for it"
    );
    assert_eq!(ds.decode.unwrap().transfers_completed_total, 1);
    let ps = settled(
        "prefill's refusals",
        || stack.prefill.node.stats().prefill.unwrap(),
        |p| p.prefills_refused_total >= 1,
    );
    assert_eq!(ps.prefills_refused_total, 1);
    // A later request of tenant 2 never sees tenant 1's secret.
    let (_, text2) = stack
        .run(greedy(&stack.tok, 2, "Repeat the vault code:", 16))
        .unwrap();
    assert!(
        !text2.contains("PINEAPPLE") && !text2.contains("7731"),
        "{text2:?} (tenant 1 got {text1:?})"
    );
}

#[test]
fn gateway_advertises_the_smallest_node_limit() {
    let cfg = StackCfg {
        prefill: EngineConfig {
            kv_pages: Some(4),
            max_context: Some(64),
            ..EngineConfig::default()
        },
        ..StackCfg::default()
    };
    let stack = Stack::start(cfg);
    stack.wait_ready();
    assert_eq!(stack.gateway.max_request_tokens(), 64);
    let long = "word ".repeat(80);
    let err = stack.run(greedy(&stack.tok, 2, &long, 8)).unwrap_err();
    assert!(
        matches!(&err, RequestError::Remote { code, .. } if code == "context_length_exceeded"),
        "{err:?}"
    );
    assert_eq!(
        stack.decode.node.stats().decode.unwrap().reservations_total,
        0
    );
    stack.pools_free();
}

#[test]
fn corrupted_page_bytes_fail_the_checksum_with_zero_tokens() {
    let flipped = Arc::new(AtomicUsize::new(0));
    let once = Arc::new(AtomicUsize::new(0));
    let o = once.clone();
    let tamper: Tamper = Arc::new(move |m: Message| {
        if matches!(m, Message::Page { position: 1, .. }) && o.fetch_add(1, Ordering::SeqCst) == 0 {
            return None; // flip a KV byte
        }
        Some(m)
    });
    let stack = Stack::start_with(
        StackCfg {
            proxy: Some(tamper),
            ..StackCfg::default()
        },
        flipped.clone(),
    );
    stack.wait_ready();
    let long = "A long prompt that needs several pages of KV cache to hold it all. ".repeat(3);
    let err = stack.run(greedy(&stack.tok, 1, &long, 8)).unwrap_err();
    assert!(
        matches!(&err, RequestError::Remote { code, status: 502, .. } if code == "checksum_mismatch"),
        "{err:?}"
    );
    assert_eq!(flipped.load(Ordering::SeqCst), 1);
    let d = settled(
        "decode's checksum failures",
        || stack.decode.node.stats().decode.unwrap(),
        |d| d.checksum_failures_total >= 1,
    );
    assert_eq!(d.checksum_failures_total, 1);
    // The link survives a KV corruption (the frame check passed): the next
    // request runs on it.
    let (ids, _) = stack
        .run(greedy(&stack.tok, 1, "The capital of France is", 4))
        .unwrap();
    assert_eq!(ids.len(), 4);
    stack.pools_free();
}

#[test]
fn a_flipped_header_byte_ends_the_link_and_the_request_cleanly() {
    let once = Arc::new(AtomicUsize::new(0));
    let o = once.clone();
    let tamper: Tamper = Arc::new(move |m: Message| {
        if matches!(m, Message::Done { .. }) && o.fetch_add(1, Ordering::SeqCst) == 0 {
            return None; // flip a byte of the frame's header fields
        }
        Some(m)
    });
    let stack = Stack::start(StackCfg {
        proxy: Some(tamper),
        ..StackCfg::default()
    });
    stack.wait_ready();
    // The frame fails its check and ends the prefill→decode link; no token
    // had reached the client, so the gateway places the request again
    // under a new id (issue 19) and it is answered — the same tokens a
    // clean run gives.
    let (ids, _) = stack
        .run(greedy(&stack.tok, 1, "The capital of France is", 8))
        .unwrap();
    assert_eq!(
        once.load(Ordering::SeqCst),
        2,
        "the Done was tampered once, sent twice"
    );
    let lost = settled(
        "decode's lost prefill link",
        || stack.decode.node.stats().decode.unwrap(),
        |d| d.prefill_links_lost_total >= 1,
    );
    assert_eq!(lost.checksum_failures_total, 0);
    stack.pools_free();
    let (again, _) = stack
        .run(greedy(&stack.tok, 1, "The capital of France is", 8))
        .unwrap();
    assert_eq!(ids, again);
    stack.pools_free();
}

#[test]
fn a_page_for_a_stale_handle_is_fenced() {
    let once = Arc::new(AtomicUsize::new(0));
    let o = once.clone();
    let tamper: Tamper = Arc::new(move |m: Message| match m {
        Message::Page {
            req,
            position,
            mut dst,
            slots,
            checksum,
            canary,
            bytes,
        } if o.fetch_add(1, Ordering::SeqCst) == 0 => {
            // A well-formed frame (new frame check) naming an older epoch
            // of the reserved page.
            dst.epoch = dst.epoch.wrapping_sub(2);
            Some(Message::Page {
                req,
                position,
                dst,
                slots,
                checksum,
                canary,
                bytes,
            })
        }
        m => Some(m),
    });
    let stack = Stack::start(StackCfg {
        proxy: Some(tamper),
        ..StackCfg::default()
    });
    stack.wait_ready();
    let err = stack
        .run(greedy(&stack.tok, 1, "The capital of France is", 8))
        .unwrap_err();
    assert!(
        matches!(&err, RequestError::Remote { code, .. } if code == "transfer_fenced"),
        "{err:?}"
    );
    let d = settled(
        "decode's fenced pages",
        || stack.decode.node.stats().decode.unwrap(),
        |d| d.pages_fenced_total >= 1,
    );
    assert!(d.pages_fenced_total >= 1);
    let (_, dp) = stack.pools_free();
    assert_eq!(
        dp.refused_stale_handle, 0,
        "the fence is in front of the pool: nothing stale reached it"
    );
}

#[test]
fn fingerprint_mismatch_refuses_pairing() {
    // The decode node announces another model's fingerprint (that of a
    // synthetic GGUF: a different file).
    let dir = std::env::temp_dir().join(format!("isoserve-fp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let other = testkit::synthetic::synthetic_llama_writer(
        &testkit::synthetic::SyntheticConfig::default(),
        1,
    )
    .unwrap()
    .to_bytes()
    .unwrap();
    let other = gguf::GgufFile::from_bytes(other)
        .unwrap()
        .fingerprint()
        .unwrap();
    let stack = Stack::start(StackCfg {
        decode_fingerprint: Some(other),
        ..StackCfg::default()
    });
    let t0 = Instant::now();
    loop {
        let nodes = stack.gateway.nodes();
        if let Some(why) = nodes.iter().find_map(|n| n.refused.clone()) {
            assert!(
                why.contains("pairing refused") && why.contains("another model"),
                "{why}"
            );
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "{nodes:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!stack.gateway.ready());
    let err = stack.run(greedy(&stack.tok, 1, "Hello", 4)).unwrap_err();
    assert!(
        matches!(&err, RequestError::Remote { status: 503, .. }),
        "{err:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn random_cancels_never_leak_and_the_set_keeps_serving() {
    let stack = Arc::new(Stack::start(StackCfg::default()));
    stack.wait_ready();
    let mut rng = 0x1234_5678u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut threads = Vec::new();
    for i in 0..96u64 {
        let s = stack.clone();
        let delay_us = next() % 40_000;
        let len = 1 + next() % 4;
        let prompt = "Count slowly from one to fifty: one, two, three, ".repeat(len as usize);
        threads.push(std::thread::spawn(move || {
            let h = s.gateway.submit(greedy(&s.tok, 1 + i % 4, &prompt, 24));
            std::thread::sleep(Duration::from_micros(delay_us));
            drop(h); // the client goes away at a random point
        }));
        if i % 8 == 7 {
            for t in threads.drain(..) {
                t.join().unwrap();
            }
        }
    }
    for t in threads {
        t.join().unwrap();
    }
    let (p, d) = stack.pools_free();
    assert_eq!(p.safety_refusals() + d.safety_refusals(), 0);
    let ds = stack.decode.node.stats().decode.unwrap();
    assert!(
        ds.cancels_receiving_total + ds.cancels_decoding_total + ds.cancels_waiting_total > 0,
        "{ds:?}"
    );
    // Healthy: a request after the storm is the same as ever.
    let (ids, text) = stack
        .run(greedy(&stack.tok, 1, "The capital of France is", 4))
        .unwrap();
    assert_eq!(ids.len(), 4);
    assert!(text.contains("Paris"), "{text:?}");
}

/// The gateway's per-request event channel is bounded too
/// (`request::REQUEST_EVENTS_MAX`), and a remote decode cannot be paused:
/// a client that stops reading gets exactly the tokens that fit, then
/// `client_too_slow` as its last event (the last slot is kept for it); the
/// gateway cancels the request on both nodes, which free every page, and
/// the set keeps serving. Without the gateway's check, tokens beyond the
/// bound are dropped silently and the stream never ends: the test's read
/// of the end fails.
#[test]
fn a_pd_client_that_stops_reading_is_ended_as_too_slow() {
    let stack = Stack::start(StackCfg::default());
    stack.wait_ready();
    let prompt = stack.tok.encode("Once upon a time", true).unwrap();
    let mut h = stack
        .gateway
        .submit(GenRequest {
            ignore_eos: true,
            ..GenRequest::greedy(TenantId(1), prompt, 900)
        })
        .unwrap();
    let events = stack.rt.block_on(async move {
        // Let decode run far past the bound before reading anything.
        tokio::time::sleep(Duration::from_secs(8)).await;
        let mut events = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while let Some(ev) = tokio::time::timeout_at(deadline, h.next())
            .await
            .expect("the stream ends")
        {
            events.push(ev);
        }
        events
    });
    let tokens = events
        .iter()
        .filter(|e| matches!(e, Event::Token(_)))
        .count();
    assert_eq!(
        tokens,
        request::REQUEST_EVENTS_MAX - 1,
        "tokens before the end"
    );
    assert!(
        matches!(
            events.last(),
            Some(Event::Error(RequestError::ClientTooSlow { limit })) if *limit == request::REQUEST_EVENTS_MAX
        ),
        "last event: {:?}",
        events.last()
    );
    let (p, d) = stack.pools_free();
    assert_eq!(p.safety_refusals() + d.safety_refusals(), 0);
    let text = stack
        .run(greedy(&stack.tok, 2, "The capital of France is", 3))
        .unwrap()
        .1;
    assert!(text.starts_with(" Paris"), "{text:?}");
    let samples = stack.gateway.metric_samples();
    assert!(
        samples
            .iter()
            .any(|s| s.name == "isoserve_gateway_client_too_slow_total" && s.value == 1.0),
        "{samples:?}"
    );
}
