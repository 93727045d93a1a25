//! `isoserve generate` and `isoserve bench`: one sequence, straight through
//! the model and the KV pool (the server's engine batches many).

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kv::{DType, Owner, PageRef, Pool, PoolOptions, RequestId, TenantId};
use model::sample::{FinishReason, Sampler, SamplingParams, StopStrings};
use model::{Model, Row, Scratch, SeqCtx};
use tokenizer::{ChatMessage, ChatTemplate, Tokenizer};

/// Token slots per KV page.
pub const PAGE_SIZE_TOKENS: usize = 16;
/// Rows per prefill chunk.
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
    let template = ChatTemplate::from_gguf(model.gguf()).ok();
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
}

pub struct Timings {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill: Duration,
    pub decode: Duration,
    pub finish: FinishReason,
}

impl Loaded {
    /// Prompt token ids: the chat template applied if `chat`, special tokens
    /// recognised in the text, BOS prepended when the model asks for it.
    pub fn prompt_ids(&self, prompt: &str, chat: bool) -> Result<Vec<u32>> {
        let text = if chat {
            let t = self
                .template
                .as_ref()
                .context("--chat: the model has no chat template")?;
            t.render(&[ChatMessage::user(prompt)], true)?
        } else {
            prompt.to_string()
        };
        let mut ids = self.tokenizer.encode(&text, true)?;
        if self.tokenizer.add_bos() {
            if let Some(b) = self.tokenizer.bos_id() {
                ids.insert(0, b);
            }
        }
        if ids.is_empty() {
            bail!("the prompt is empty");
        }
        Ok(ids)
    }

    /// Generates from `ids`, calling `emit` with each piece of text.
    pub fn generate(
        &self,
        ids: &[u32],
        args: &GenerateArgs,
        mut emit: impl FnMut(&str) -> Result<()>,
    ) -> Result<Timings> {
        args.params.validate()?;
        let m = &self.model;
        let window = m.config.context_length;
        if ids.len() + args.max_tokens > window {
            bail!(
                "prompt ({} tokens) + max tokens ({}) = {} exceeds the model's context window of {window} tokens",
                ids.len(),
                args.max_tokens,
                ids.len() + args.max_tokens
            );
        }
        let shape = m.kv_shape(PAGE_SIZE_TOKENS, DType::F32)?;
        let need = ids.len() + args.max_tokens;
        let pages_n = shape.pages_for_tokens(need as u64).max(1);
        let mut pool = Pool::new(shape, pages_n, PoolOptions::default())?;
        let owner = Owner::new(RequestId(1), TenantId(1));
        let mut pages: Vec<PageRef> = Vec::new();
        pool.alloc(owner, pages_n as usize, &mut pages)?;
        let mut scratch = Scratch::new(m, PREFILL_CHUNK_ROWS);
        let mut sampler = Sampler::new(args.params.clone());
        let mut stops = StopStrings::new(args.stop.clone())?;
        let mut decoder = self.tokenizer.stream_decoder().skip_special(true);
        let mut history: Vec<u32> = ids.to_vec();
        let mut rows = Vec::with_capacity(PREFILL_CHUNK_ROWS);

        let t0 = Instant::now();
        for (c, chunk) in ids.chunks(PREFILL_CHUNK_ROWS).enumerate() {
            rows.clear();
            let base = c * PREFILL_CHUNK_ROWS;
            rows.extend(chunk.iter().enumerate().map(|(i, &token)| Row {
                seq: 0,
                pos: base + i,
                token,
                logits: base + i == ids.len() - 1,
            }));
            let seqs = [SeqCtx {
                owner,
                pages: &pages,
            }];
            m.forward(&mut pool, &seqs, &rows, &mut scratch)?;
        }
        let prefill = t0.elapsed();
        let t1 = Instant::now();
        let mut generated = 0;
        let mut finish = FinishReason::Length;
        while generated < args.max_tokens {
            let next = sampler.sample(&mut scratch.logits, &history);
            generated += 1;
            history.push(next);
            if !args.ignore_eos && self.tokenizer.is_eos(next) {
                finish = FinishReason::Stop;
                break;
            }
            let piece = decoder.push(next)?;
            let (out, stopped) = stops.push(&piece);
            if !out.is_empty() {
                emit(&out)?;
            }
            if stopped {
                finish = FinishReason::Stop;
                break;
            }
            if generated == args.max_tokens {
                break;
            }
            let pos = history.len() - 1;
            let row = [Row {
                seq: 0,
                pos,
                token: next,
                logits: true,
            }];
            let seqs = [SeqCtx {
                owner,
                pages: &pages,
            }];
            m.forward(&mut pool, &seqs, &row, &mut scratch)?;
        }
        if finish == FinishReason::Length {
            let rest = stops.flush();
            if !rest.is_empty() {
                emit(&rest)?;
            }
        }
        let decode = t1.elapsed();
        for h in pages {
            pool.free(h, owner)?;
        }
        debug_assert_eq!(pool.pages_free(), pool.pages_total());
        Ok(Timings {
            prompt_tokens: ids.len(),
            generated_tokens: generated,
            prefill,
            decode,
            finish,
        })
    }
}

pub fn run_generate(model_path: &Path, args: GenerateArgs) -> Result<()> {
    let loaded = load(model_path)?;
    let ids = loaded.prompt_ids(&args.prompt, args.chat)?;
    let stdout = std::io::stdout();
    let t = loaded.generate(&ids, &args, |s| {
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
) -> Result<()> {
    if prompt_tokens == 0 || gen_tokens < 2 {
        bail!("--prompt-tokens must be ≥ 1 and --gen-tokens ≥ 2");
    }
    let loaded = load(model_path)?;
    // A deterministic pseudo-prompt of ordinary tokens (ids 100.. avoid the
    // special tokens at the start of the vocabulary).
    let vocab = loaded.model.config.vocab as u32;
    let ids: Vec<u32> = (0..prompt_tokens as u32)
        .map(|i| 100 + (i * 7919) % (vocab - 100))
        .collect();
    let args = |max_tokens| GenerateArgs {
        prompt: String::new(),
        chat: false,
        max_tokens,
        params: SamplingParams::default(),
        stop: Vec::new(),
        ignore_eos: true,
    };
    let (mut pp, mut tg, mut tg_ctx) = (Vec::new(), Vec::new(), Vec::new());
    // One warm-up run (page faults of the mmapped weights).
    loaded.generate(&ids, &args(2), |_| Ok(()))?;
    for _ in 0..reps.max(1) {
        let t = loaded.generate(&ids, &args(1), |_| Ok(()))?;
        pp.push(prompt_tokens as f64 / t.prefill.as_secs_f64());
        // The first token comes from the prompt's logits; the decode time
        // covers the remaining gen_tokens forward steps.
        let t = loaded.generate(&ids[..1], &args(gen_tokens + 1), |_| Ok(()))?;
        tg.push(gen_tokens as f64 / t.decode.as_secs_f64());
        let t = loaded.generate(&ids, &args(gen_tokens + 1), |_| Ok(()))?;
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
        "prefill pp{prompt_tokens}: {p:.1} tok/s (min {pl:.1}, max {ph:.1}); decode tg{gen_tokens}: {d:.1} tok/s (min {dl:.1}, max {dh:.1}); decode tg{gen_tokens} after pp{prompt_tokens}: {c:.1} tok/s (min {cl:.1}, max {ch:.1}); {} reps, {} threads, kernels {:?}",
        reps.max(1),
        loaded.model.threads().n_threads(),
        kernels::KernelLevel::active(),
    );
    Ok(())
}
