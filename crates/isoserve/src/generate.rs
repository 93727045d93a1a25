//! `isoserve generate`, `isoserve bench` and `isoserve tokenize`: one
//! request at a time through the same engine the server runs (the batch
//! core, its pool checks and its sampler), and through the same prompt
//! encoder (`tokenizer::encode_text` / `encode_chat`).

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use crate::roofline;
use anyhow::{bail, Context, Result};
use engine::{Engine, EngineConfig, Event, GenRequest};
use kv::TenantId;
use model::sample::{FinishReason, SamplingParams};
use model::Model;
use tokenizer::{ChatMessage, ChatTemplate, Tokenizer};

/// Token slots per KV page.
pub const PAGE_SIZE_TOKENS: usize = 16;
/// Rows per forward step: prefill runs in chunks of this many tokens.
pub const PREFILL_CHUNK_ROWS: usize = 512;

pub struct Loaded {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
}

pub fn load(path: &Path) -> Result<Loaded> {
    let threads = kernels::ThreadPool::from_env();
    let model = Model::load(path, threads)
        .with_context(|| format!("cannot load model {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(model.gguf()).context("cannot build the tokenizer")?;
    let template = ChatTemplate::from_gguf_or_builtin(model.gguf())
        .ok()
        .map(|(t, _)| t);
    Ok(Loaded {
        model,
        tokenizer,
        template,
    })
}

pub struct GenerateArgs {
    pub prompt: String,
    pub chat: bool,
    pub max_tokens: usize,
    pub params: SamplingParams,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// The grammar the output must follow (`--json-schema`, `--regex`,
    /// `--grammar-file`); compiled by the engine's compiler on submit.
    pub grammar: Option<request::GrammarSpec>,
}

pub struct Timings {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Admission to the first token: the prompt's forward steps and the
    /// first sample.
    pub prefill: Duration,
    /// First token to the end: one forward step per further token.
    pub decode: Duration,
    pub finish: FinishReason,
}

/// Prompt token ids as the server computes them: with `chat`, the text as
/// one user message through the chat template (only the template's text
/// may produce special tokens); without, raw text in which special tokens
/// are recognised. BOS as the model asks.
pub fn prompt_ids(
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    prompt: &str,
    chat: bool,
) -> Result<Vec<u32>> {
    let ids = if chat {
        let t = template.context("--chat: the model has no chat template")?;
        tokenizer::encode_chat(tokenizer, t, &[ChatMessage::user(prompt)])?.ids
    } else {
        tokenizer::encode_text(tokenizer, prompt)?
    };
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    Ok(ids)
}

/// An engine for one request at a time of up to `tokens_max` tokens
/// (prompt + generated), its pool sized for exactly that.
pub fn one_request_engine(
    model: Model,
    tokenizer: Tokenizer,
    tokens_max: usize,
    kv_dtype: kv::DType,
) -> Result<Engine> {
    // One request at a time: nothing to share, and a benchmark that
    // repeats its prompt must compute it every time.
    engine_for_one(
        model,
        tokenizer,
        tokens_max,
        kv_dtype,
        engine::PrefixCache::Off,
    )
}

/// [`one_request_engine`] with a prefix cache as given.
fn engine_for_one(
    model: Model,
    tokenizer: Tokenizer,
    tokens_max: usize,
    kv_dtype: kv::DType,
    prefix_cache: engine::PrefixCache,
) -> Result<Engine> {
    let window = model.config.context_length;
    let pages = tokens_max.max(1).div_ceil(PAGE_SIZE_TOKENS);
    let cfg = EngineConfig {
        page_size_tokens: PAGE_SIZE_TOKENS,
        kv_pages: Some(pages as u64),
        max_context: Some(window.min(pages * PAGE_SIZE_TOKENS)),
        step_tokens: PREFILL_CHUNK_ROWS,
        max_running: 1,
        max_queue: 1,
        kv_dtype,
        prefix_cache,
        ..EngineConfig::default()
    };
    Ok(Engine::start(model, tokenizer, cfg)?)
}

/// Runs one request on `engine`, calling `emit` with each piece of text.
pub fn generate(
    engine: &Engine,
    ids: &[u32],
    args: &GenerateArgs,
    mut emit: impl FnMut(&str) -> Result<()>,
) -> Result<Timings> {
    let req = GenRequest {
        tenant: TenantId(1),
        prompt: ids.to_vec(),
        max_tokens: args.max_tokens,
        params: args.params.clone(),
        stop: args.stop.clone(),
        ignore_eos: args.ignore_eos,
        logprobs: None,
        cache_scope: None,
        priority: 0,
        weight: 1,
        trace: None,
        grammar: args.grammar.clone().map(request::Constraint::new),
        prediction: Vec::new(),
    };
    let mut h = engine.submit(req)?;
    while let Some(ev) = h.blocking_next() {
        match ev {
            Event::Token(t) => {
                if !t.text.is_empty() {
                    emit(&t.text)?;
                }
            }
            Event::Done(d) => {
                if !d.tail_text.is_empty() {
                    emit(&d.tail_text)?;
                }
                let ms = |x: f64| Duration::from_secs_f64(x.max(0.0) / 1e3);
                return Ok(Timings {
                    prompt_tokens: d.usage.prompt_tokens,
                    generated_tokens: d.usage.completion_tokens,
                    prefill: ms(d.ttft_ms - d.queue_ms),
                    decode: ms(d.total_ms - d.ttft_ms),
                    finish: d.finish,
                });
            }
            Event::Error(e) => return Err(e.into()),
        }
    }
    bail!("the engine ended the request without a result")
}

pub fn run_generate(model_path: &Path, args: GenerateArgs) -> Result<()> {
    let Loaded {
        model,
        tokenizer,
        template,
    } = load(model_path)?;
    let ids = prompt_ids(&tokenizer, template.as_ref(), &args.prompt, args.chat)?;
    let engine = one_request_engine(
        model,
        tokenizer,
        ids.len() + args.max_tokens,
        EngineConfig::default().kv_dtype,
    )?;
    let stdout = std::io::stdout();
    let t = generate(&engine, &ids, &args, |s| {
        let mut out = stdout.lock();
        out.write_all(s.as_bytes())?;
        out.flush()?;
        Ok(())
    })?;
    println!();
    let rate = |n: usize, d: Duration| n as f64 / d.as_secs_f64().max(1e-9);
    eprintln!(
        "prefill: {} tokens in {:.1} ms ({:.1} tok/s); decode: {} tokens in {:.1} ms ({:.1} tok/s); finish: {}",
        t.prompt_tokens,
        t.prefill.as_secs_f64() * 1e3,
        rate(t.prompt_tokens, t.prefill),
        t.generated_tokens,
        t.decode.as_secs_f64() * 1e3,
        // The first generated token comes from the prefill's logits.
        rate(t.generated_tokens.saturating_sub(1), t.decode),
        t.finish.as_openai(),
    );
    Ok(())
}

/// `isoserve bench`: the same two tests as `llama-bench -p N -n M`:
/// prefill of an N-token prompt, and decode of M tokens from an empty
/// context (a 1-token prompt); plus decode of M tokens after the N-token
/// prompt (attention over a longer context). Medians over `reps` runs.
pub fn run_bench(
    model_path: &Path,
    prompt_tokens: usize,
    gen_tokens: usize,
    reps: usize,
    kv_dtype: kv::DType,
    depths: &[usize],
) -> Result<()> {
    if prompt_tokens == 0 || gen_tokens < 2 {
        bail!("--prompt-tokens must be ≥ 1 and --gen-tokens ≥ 2");
    }
    let Loaded {
        model, tokenizer, ..
    } = load(model_path)?;
    let threads = model.threads().n_threads();
    let window = model.config.context_length;
    if let Some(&d) = depths.iter().find(|&&d| d + gen_tokens + 1 > window) {
        bail!(
            "--depths {d} with --gen-tokens {gen_tokens} is past the model's window of {window} \
             tokens"
        );
    }
    let config = model.config.clone();
    let weights = roofline::weight_bytes(&gguf::GgufFile::open(model_path)?);
    // A deterministic pseudo-prompt of ordinary tokens (ids 100.. avoid the
    // special tokens at the start of the vocabulary).
    let vocab = model.config.vocab as u32;
    let longest = depths.iter().copied().max().unwrap_or(0).max(prompt_tokens);
    let ids: Vec<u32> = (0..longest as u32)
        .map(|i| 100 + (i * 7919) % (vocab - 100))
        .collect();
    let engine = one_request_engine(model, tokenizer, longest + gen_tokens + 1, kv_dtype)?;
    let args = |max_tokens| GenerateArgs {
        prompt: String::new(),
        chat: false,
        max_tokens,
        params: SamplingParams::default(),
        stop: Vec::new(),
        ignore_eos: true,
        grammar: None,
    };
    let (mut pp, mut tg, mut tg_ctx) = (Vec::new(), Vec::new(), Vec::new());
    // One warm-up run (page faults of the mmapped weights).
    generate(&engine, &ids[..prompt_tokens], &args(2), |_| Ok(()))?;
    for _ in 0..reps.max(1) {
        let t = generate(&engine, &ids[..prompt_tokens], &args(1), |_| Ok(()))?;
        pp.push(prompt_tokens as f64 / t.prefill.as_secs_f64());
        // The first token comes from the prompt's logits; the decode time
        // covers the remaining gen_tokens forward steps.
        let t = generate(&engine, &ids[..1], &args(gen_tokens + 1), |_| Ok(()))?;
        tg.push(gen_tokens as f64 / t.decode.as_secs_f64());
        let t = generate(
            &engine,
            &ids[..prompt_tokens],
            &args(gen_tokens + 1),
            |_| Ok(()),
        )?;
        tg_ctx.push(gen_tokens as f64 / t.decode.as_secs_f64());
    }
    let summary = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        (v[v.len() / 2], v[0], v[v.len() - 1])
    };
    let (p, pl, ph) = summary(&mut pp);
    let (d, dl, dh) = summary(&mut tg);
    let (c, cl, ch) = summary(&mut tg_ctx);
    println!(
        "prefill pp{prompt_tokens}: {p:.1} tok/s (min {pl:.1}, max {ph:.1}); decode tg{gen_tokens}: {d:.1} tok/s (min {dl:.1}, max {dh:.1}); decode tg{gen_tokens} after pp{prompt_tokens}: {c:.1} tok/s (min {cl:.1}, max {ch:.1}); {} reps, {} threads, kernels {:?}, KV {}",
        reps.max(1),
        threads,
        kernels::KernelLevel::active(),
        kv_dtype.name(),
    );
    // The roofline: what memory allows each decode (the mean depth of a
    // decode of gen_tokens after d tokens is d + gen_tokens / 2).
    let probe = roofline::Bandwidth::new(threads);
    let bandwidth = probe.measure(5);
    let at = |depth: usize| roofline::kv_bytes(&config, kv_dtype, depth + gen_tokens / 2);
    println!(
        "roofline: read bandwidth {:.1} GB/s ({threads} threads, a buffer past the last-level cache)",
        bandwidth / 1e9
    );
    println!(
        "  tg{gen_tokens}: {}",
        roofline::line(d, weights, at(1), bandwidth)
    );
    println!(
        "  tg{gen_tokens} after pp{prompt_tokens}: {}",
        roofline::line(c, weights, at(prompt_tokens), bandwidth)
    );
    if depths.is_empty() {
        return Ok(());
    }
    // Prefill at depth (llama-bench's `-p N -d D`): the depth's prompt
    // cached, then N new tokens after it, timed alone. A second engine with
    // a prefix cache; each rep's N tokens differ, so none is a cache hit.
    let Loaded {
        model: model2,
        tokenizer: tokenizer2,
        ..
    } = load(model_path)?;
    let cached = engine_for_one(
        model2,
        tokenizer2,
        longest + 2 * prompt_tokens + gen_tokens + 1,
        kv_dtype,
        engine::PrefixCache::Tenant,
    )?;
    let tail = |rep: usize| -> Vec<u32> {
        (0..prompt_tokens as u32)
            .map(|i| 100 + ((i + 1 + 1000 * rep as u32) * 104_729) % (vocab - 100))
            .collect()
    };
    for &depth in depths {
        let mut v = Vec::new();
        for _ in 0..reps.max(1) {
            let t = generate(&engine, &ids[..depth.max(1)], &args(gen_tokens + 1), |_| {
                Ok(())
            })?;
            v.push(gen_tokens as f64 / t.decode.as_secs_f64());
        }
        // The bandwidth beside this depth's runs (best of three passes).
        let here = probe.measure(3);
        let (m, lo, hi) = summary(&mut v);
        println!(
            "depth {depth}: tg{gen_tokens} (min {lo:.1}, max {hi:.1}): {}",
            roofline::line(m, weights, at(depth.max(1)), here)
        );
        // Cache the depth's prompt (whole pages are what the cache keeps).
        // Where the window leaves no room for the new tokens after the
        // depth (8128 + 512 > 8192), the prefill runs at the deepest
        // depth that leaves room, and its line says which.
        let room = window.saturating_sub(prompt_tokens + 1);
        let cached_depth = depth.min(room) / PAGE_SIZE_TOKENS * PAGE_SIZE_TOKENS;
        if cached_depth > 0 {
            generate(&cached, &ids[..cached_depth], &args(1), |_| Ok(()))?;
        }
        let mut v = Vec::new();
        for rep in 0..reps.max(1) {
            let mut prompt = ids[..cached_depth].to_vec();
            prompt.extend(tail(rep));
            let t = generate(&cached, &prompt, &args(1), |_| Ok(()))?;
            if t.prompt_tokens != prompt.len() {
                bail!(
                    "prefill at depth {depth}: {} prompt tokens counted",
                    t.prompt_tokens
                );
            }
            v.push(prompt_tokens as f64 / t.prefill.as_secs_f64());
        }
        let (p, lo, hi) = summary(&mut v);
        println!(
            "depth {cached_depth}: pp{prompt_tokens} (min {lo:.1}, max {hi:.1}): {p:.1} tok/s"
        );
    }
    Ok(())
}

/// Tokens per forward step of [`write_logits`] and [`perplexity`].
const LOGITS_CHUNK_ROWS: usize = 256;

/// One sequence through the model (KV in a pool as the server keeps it),
/// calling `each(position, logits)` for the positions `want` selects.
fn sequence_logits(
    m: &Model,
    ids: &[u32],
    dtype: kv::DType,
    want: impl Fn(usize) -> bool,
    mut each: impl FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    let vocab = m.config.vocab;
    if ids.is_empty() {
        bail!("no token ids");
    }
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
        bail!("token id {bad} is outside the vocabulary of {vocab}");
    }
    let window = m.config.context_length;
    if ids.len() > window {
        bail!("{} tokens exceed the model's window of {window}", ids.len());
    }
    let shape = m.kv_shape(PAGE_SIZE_TOKENS, dtype)?;
    let n_pages = ids.len().div_ceil(PAGE_SIZE_TOKENS);
    let mut pool = kv::Pool::new(shape, n_pages as u64, kv::PoolOptions::default())?;
    let owner = kv::Owner::new(kv::RequestId(1), TenantId(1));
    let mut pages = Vec::new();
    pool.alloc(owner, n_pages, &mut pages)?;
    let mut scratch = model::Scratch::new(m, LOGITS_CHUNK_ROWS);
    for (c, chunk) in ids.chunks(LOGITS_CHUNK_ROWS).enumerate() {
        let rows: Vec<model::Row> = chunk
            .iter()
            .enumerate()
            .map(|(i, &token)| model::Row {
                seq: 0,
                pos: c * LOGITS_CHUNK_ROWS + i,
                token,
                logits: want(c * LOGITS_CHUNK_ROWS + i),
            })
            .collect();
        let seqs = [model::SeqCtx {
            owner,
            pages: &pages,
        }];
        m.forward(&mut pool, &seqs, &rows, &mut scratch)?;
        for (k, r) in rows.iter().filter(|r| r.logits).enumerate() {
            each(r.pos, &scratch.logits[k * vocab..(k + 1) * vocab])?;
        }
    }
    Ok(())
}

/// `isoserve logits`: the logits at the positions of `ids` from `from` on
/// (one sequence), written as little-endian f32 `[positions][vocab]` to `out`.
pub fn write_logits(
    path: &Path,
    ids: &[u32],
    from: usize,
    out: &Path,
    dtype: kv::DType,
) -> Result<()> {
    let threads = kernels::ThreadPool::from_env();
    let m = Model::load(path, threads)
        .with_context(|| format!("cannot load model {}", path.display()))?;
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(out).with_context(|| format!("cannot create {}", out.display()))?,
    );
    sequence_logits(
        &m,
        ids,
        dtype,
        |p| p >= from,
        |_, logits| {
            for v in logits {
                file.write_all(&v.to_le_bytes())?;
            }
            Ok(())
        },
    )
    .context("--ids")?;
    file.flush()?;
    Ok(())
}

/// Perplexity as llama.cpp's `llama-perplexity` computes it: the tokens
/// cut into chunks of `ctx` (BOS, if the model adds one, in place of each
/// chunk's first token), each chunk one sequence, the negative log
/// likelihood of each token of a chunk's second half given what precedes
/// it. Returns (perplexity, tokens scored, chunks).
pub fn perplexity(
    m: &Model,
    tokens: &[u32],
    bos: Option<u32>,
    ctx: usize,
    dtype: kv::DType,
    mut progress: impl FnMut(usize, f64),
) -> Result<(f64, usize, usize)> {
    if ctx < 2 {
        bail!("--ctx must be at least 2");
    }
    let chunks = tokens.len() / ctx;
    if chunks == 0 {
        bail!(
            "the text has {} tokens, fewer than one chunk of {ctx}",
            tokens.len()
        );
    }
    let first = ctx / 2;
    let (mut nll, mut count) = (0.0f64, 0usize);
    for c in 0..chunks {
        let mut ids = tokens[c * ctx..(c + 1) * ctx].to_vec();
        if let Some(b) = bos {
            ids[0] = b;
        }
        let next = &tokens[c * ctx..(c + 1) * ctx];
        sequence_logits(
            m,
            &ids,
            dtype,
            |p| p >= first && p + 1 < ctx,
            |p, logits| {
                let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
                let z: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
                let target = next[p + 1] as usize;
                nll += max + z.ln() - logits[target] as f64;
                count += 1;
                Ok(())
            },
        )?;
        progress(c, (nll / count as f64).exp());
    }
    Ok(((nll / count as f64).exp(), count, chunks))
}
