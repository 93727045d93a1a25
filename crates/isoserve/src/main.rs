//! `isoserve` — the command-line entry point. See README.md.

mod args;
mod audit_cmd;
mod certs;
mod disagg;
mod fetch;
mod generate;
mod probe_cmd;
mod roofline;
mod serve;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "isoserve",
    version,
    about = "LLM serving engine with a provably tenant-isolated KV cache"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Fetch the default model (SmolLM2-135M-Instruct Q4_1) into $ISOSERVE_HOME
    /// (default ~/.cache/isoserve) and verify its SHA-256.
    FetchModel {
        /// Which model: smollm2-135m (the default) or gemma3-270m
        /// (Gemma 3 270M, Q4_K_M; Gemma Terms of Use).
        #[arg(default_value = "smollm2-135m")]
        name: String,
        /// Re-hash an already cached file instead of trusting its marker.
        #[arg(long)]
        verify: bool,
        /// Print only the path.
        #[arg(long, short)]
        quiet: bool,
    },
    /// Generate text from a prompt; the text goes to stdout, timings to stderr.
    Generate {
        /// The prompt. Without --chat it is raw text in which special tokens
        /// such as <|im_start|> are recognised.
        #[arg(long, short)]
        prompt: String,
        /// Wrap the prompt in the model's chat template as a user message.
        #[arg(long)]
        chat: bool,
        /// Maximum number of tokens to generate.
        #[arg(long, default_value_t = 256)]
        max_tokens: usize,
        /// Sampling temperature; 0 is greedy (deterministic).
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Keep only the K most likely tokens (0: off).
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        /// Nucleus sampling mass (1: off).
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        /// Drop tokens less likely than min_p × the most likely (0: off).
        #[arg(long, default_value_t = 0.0)]
        min_p: f32,
        /// Repetition penalty (1: off); `--repeat-penalty` (llama.cpp's
        /// name) is accepted too.
        #[arg(long, alias = "repeat-penalty", default_value_t = 1.0)]
        repetition_penalty: f32,
        /// Presence penalty, OpenAI style (0: off).
        #[arg(long, default_value_t = 0.0)]
        presence_penalty: f32,
        /// Frequency penalty, OpenAI style (0: off).
        #[arg(long, default_value_t = 0.0)]
        frequency_penalty: f32,
        /// Random seed for sampling.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Stop when this string is generated (repeatable, at most 4).
        #[arg(long)]
        stop: Vec<String>,
        /// Keep generating past end-of-sequence tokens.
        #[arg(long)]
        ignore_eos: bool,
        /// Constrain the output to JSON valid under this JSON schema (its
        /// text, as llama.cpp's `--json-schema`).
        #[arg(long, group = "grammar")]
        json_schema: Option<String>,
        /// Constrain the output to JSON valid under the JSON schema in
        /// this file.
        #[arg(long, group = "grammar")]
        json_schema_file: Option<PathBuf>,
        /// Constrain the output to match this regular expression.
        #[arg(long, group = "grammar")]
        regex: Option<String>,
        /// Constrain the output to the Lark grammar in this file
        /// (llguidance's dialect; llama.cpp's GBNF is not read).
        #[arg(long, group = "grammar")]
        grammar_file: Option<PathBuf>,
        /// A GGUF file (llama, qwen2, qwen3, gemma3) or a known model's name
        /// (`smollm2-135m`, the default; `gemma3-270m`), fetched if missing.
        #[arg(long)]
        model: Option<PathBuf>,
    },
    /// Measure prefill and single-stream decode speed.
    Bench {
        #[arg(long, default_value_t = 512)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 64)]
        gen_tokens: usize,
        #[arg(long, default_value_t = 5)]
        reps: usize,
        #[arg(long)]
        model: Option<PathBuf>,
        /// How the KV pool stores keys and values.
        #[arg(long, value_enum, default_value_t = args::KvDtypeArg::F16)]
        kv_dtype: args::KvDtypeArg,
        /// Decode speed at each of these context depths (tokens already in
        /// the context: `0,512,2048,4096,8128`), each with its roofline
        /// (the read bandwidth measured beside it); and the prefill of
        /// --prompt-tokens new tokens after each depth (its prompt cached).
        #[arg(long, value_delimiter = ',')]
        depths: Vec<usize>,
    },
    /// Print the token ids of a text as JSON (special tokens recognised).
    Tokenize {
        #[arg(long, short)]
        text: String,
        /// Apply the chat template to the text as a user message first.
        #[arg(long)]
        chat: bool,
        #[arg(long)]
        model: Option<PathBuf>,
    },
    /// Write the model's logits at every position of a token sequence (f32,
    /// little endian, [ids][vocab]) — for checking a model against another
    /// implementation (scripts/compare-llama-cpp).
    Logits {
        /// Token ids, comma separated.
        #[arg(long)]
        ids: String,
        /// Output file.
        #[arg(long)]
        out: PathBuf,
        /// Write only the positions from this one on.
        #[arg(long, default_value_t = 0)]
        from: usize,
        #[arg(long)]
        model: Option<PathBuf>,
        /// How the KV pool stores keys and values.
        #[arg(long, value_enum, default_value_t = args::KvDtypeArg::F16)]
        kv_dtype: args::KvDtypeArg,
    },
    /// Perplexity of a text file, computed as llama.cpp's llama-perplexity
    /// does (chunks of --ctx tokens, BOS first, the second half of each
    /// chunk scored).
    Perplexity {
        /// The text.
        #[arg(long, short)]
        file: PathBuf,
        /// Tokens per chunk.
        #[arg(long, default_value_t = 512)]
        ctx: usize,
        /// Token ids to score instead of the file's own tokenisation (comma
        /// separated, in a file; e.g. another implementation's).
        #[arg(long)]
        ids_file: Option<PathBuf>,
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, value_enum, default_value_t = args::KvDtypeArg::F16)]
        kv_dtype: args::KvDtypeArg,
    },
    /// Serve the OpenAI-compatible HTTP API (chat/completions, completions,
    /// models, health, metrics) with tenant-isolated KV, until SIGTERM or
    /// Ctrl-C.
    Serve(args::ServeArgs),
    /// Run a prefill node: computes prompts' KV and hands it to decode
    /// nodes over TCP (checksums, canaries, bounded batches, deferred
    /// release). Refuses to start when its pool cannot hold the window
    /// unless --max-context lowers it (K8).
    Prefill(args::NodeArgs),
    /// Run a decode node: reserves pages for requests, receives and checks
    /// their KV, decodes and streams tokens to the gateway.
    Decode(args::NodeArgs),
    /// Run the gateway: the OpenAI-compatible HTTP API over prefill and
    /// decode nodes (reserve on decode, then prefill; the first refusal is
    /// the client's answer).
    Gateway(args::GatewayArgs),
    /// Test any OpenAI-compatible server for cross-tenant leakage from the
    /// outside: secrets in one tenant's prompts must never reach another's
    /// answers, greedy output must not change under load, over-long
    /// requests must be refused, answers must not come faster than prefill
    /// allows, and usage must count the prompt. Exit 0 clean, 1 findings,
    /// 2 could not run.
    Probe(probe_cmd::ProbeArgs),
    /// Search a request log (ours, or any server's JSONL/CSV with --map)
    /// for the incident's signature: prompts longer than the KV pool held,
    /// first tokens faster than prefill allows, refusals of requests that
    /// held KV pages, KV safety checks firing; counted per tenant and time
    /// window. Exit 0 none, 1 matches, 2 could not audit.
    Audit(audit_cmd::AuditArgs),
    /// Write a CA and a certificate per node for the transfer channel's
    /// mutual TLS (--transfer-tls-cert/--transfer-tls-key/--transfer-tls-ca).
    TransferCerts(certs::CertsArgs),
    /// Write a draft model for `--draft-model`: some of a model's layers,
    /// with its embeddings, final norm, output head and tokenizer
    /// (self-speculation; the vocabulary is the model's by construction).
    MakeDraft {
        /// The model (a GGUF path or a known model's name; default: the
        /// default model, fetched if missing).
        #[arg(long)]
        model: Option<PathBuf>,
        /// The layers the draft keeps, in order: indices and ranges, e.g.
        /// `0-3` (the first four) or `0-5,24-29` (the first and last six,
        /// the middle skipped).
        #[arg(long, value_parser = layer_list)]
        layers: LayerList,
        /// Where to write the draft GGUF (refused if it exists).
        #[arg(long, short)]
        output: PathBuf,
    },
    /// Print where the model cache lives.
    ModelPath {
        #[arg(long)]
        model: Option<PathBuf>,
    },
}

/// `make-draft --layers`: layer indices, in increasing order.
#[derive(Clone, Debug)]
struct LayerList(Vec<usize>);

/// Layers the longest list names at most.
const LAYERS_MAX: usize = 1024;

fn layer_list(v: &str) -> Result<LayerList, String> {
    let mut out: Vec<usize> = Vec::new();
    for part in v.split(',') {
        let num = |s: &str| {
            s.trim()
                .parse::<usize>()
                .map_err(|e| format!("`{s}` in `{v}`: {e}"))
        };
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(part)?, num(part)?),
        };
        if a > b || b >= LAYERS_MAX {
            return Err(format!("`{part}`: expected A-B with A <= B < {LAYERS_MAX}"));
        }
        if out.last().is_some_and(|&l| l >= a) {
            return Err(format!(
                "`{v}`: give the layers once each, in increasing order"
            ));
        }
        out.extend(a..=b);
    }
    Ok(LayerList(out))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Probe(args) => return probe_cmd::run(args),
        Cmd::Audit(args) => return audit_cmd::run(args),
        _ => {}
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("isoserve: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Cmd::FetchModel {
            name,
            verify,
            quiet,
        } => {
            let Some(m) = fetch::known_model(&name) else {
                anyhow::bail!("unknown model {name:?} (known: {})", fetch::known_names());
            };
            let path = fetch::fetch_model(m, verify, quiet)?;
            println!("{}", path.display());
        }
        Cmd::Generate {
            prompt,
            chat,
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            presence_penalty,
            frequency_penalty,
            seed,
            stop,
            ignore_eos,
            json_schema,
            json_schema_file,
            regex,
            grammar_file,
            model,
        } => {
            let read = |p: &PathBuf| {
                std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))
            };
            let grammar = match (json_schema, json_schema_file, regex, grammar_file) {
                (Some(s), ..) => Some(request::GrammarSpec::JsonSchema {
                    schema: s,
                    strict: false,
                }),
                (_, Some(f), ..) => Some(request::GrammarSpec::JsonSchema {
                    schema: read(&f)?,
                    strict: false,
                }),
                (_, _, Some(r), _) => Some(request::GrammarSpec::Regex(r)),
                (_, _, _, Some(f)) => Some(request::GrammarSpec::Lark(read(&f)?)),
                _ => None,
            };
            let path = fetch::resolve_model(model.as_deref(), false)?;
            let params = model::sample::SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                repetition_penalty,
                presence_penalty,
                frequency_penalty,
                seed,
                logit_bias: Vec::new(),
            };
            generate::run_generate(
                &path,
                generate::GenerateArgs {
                    prompt,
                    chat,
                    max_tokens,
                    params,
                    stop,
                    ignore_eos,
                    grammar,
                },
            )?;
        }
        Cmd::Bench {
            prompt_tokens,
            gen_tokens,
            reps,
            model,
            kv_dtype,
            depths,
        } => {
            let path = fetch::resolve_model(model.as_deref(), false)?;
            generate::run_bench(
                &path,
                prompt_tokens,
                gen_tokens,
                reps,
                kv_dtype.dtype(),
                &depths,
            )?;
        }
        Cmd::Tokenize { text, chat, model } => {
            let path = fetch::resolve_model(model.as_deref(), false)?;
            // The tokenizer and template only: the weights are not needed.
            let file = gguf::GgufFile::open(&path)
                .with_context(|| format!("cannot open model {}", path.display()))?;
            let tok =
                tokenizer::Tokenizer::from_gguf(&file).context("cannot build the tokenizer")?;
            let template = tokenizer::ChatTemplate::from_gguf_or_builtin(&file)
                .ok()
                .map(|(t, _)| t);
            let ids = generate::prompt_ids(&tok, template.as_ref(), &text, chat)?;
            println!("{ids:?}");
        }
        Cmd::Perplexity {
            file,
            ctx,
            ids_file,
            model,
            kv_dtype,
        } => {
            let path = fetch::resolve_model(model.as_deref(), false)?;
            let loaded = generate::load(&path)?;
            let tokens = match ids_file {
                Some(f) => std::fs::read_to_string(&f)
                    .with_context(|| format!("cannot read {}", f.display()))?
                    .split(',')
                    .map(|t| t.trim().parse::<u32>())
                    .collect::<Result<Vec<u32>, _>>()
                    .context("--ids-file: expected comma separated token ids")?,
                None => {
                    let text = std::fs::read_to_string(&file)
                        .with_context(|| format!("cannot read {}", file.display()))?;
                    tokenizer::encode_text(&loaded.tokenizer, &text)?
                }
            };
            let bos = loaded
                .tokenizer
                .add_bos()
                .then(|| loaded.tokenizer.bos_id())
                .flatten();
            let (ppl, scored, chunks) = generate::perplexity(
                &loaded.model,
                &tokens,
                bos,
                ctx,
                kv_dtype.dtype(),
                |c, p| eprintln!("chunk {}: running perplexity {p:.4}", c + 1),
            )?;
            println!("PPL = {ppl:.4} ({scored} tokens scored in {chunks} chunks of {ctx})");
        }
        Cmd::Logits {
            ids,
            out,
            from,
            model,
            kv_dtype,
        } => {
            let path = fetch::resolve_model(model.as_deref(), false)?;
            let ids = ids
                .split(',')
                .map(|t| t.trim().parse::<u32>())
                .collect::<Result<Vec<u32>, _>>()
                .context("--ids: expected comma separated token ids")?;
            generate::write_logits(&path, &ids, from, &out, kv_dtype.dtype())?;
        }
        Cmd::Serve(args) if args.disaggregated => disagg::run_supervised(args)?,
        Cmd::Serve(args) => serve::run(args)?,
        Cmd::Prefill(args) => disagg::run_node(pd::role::PdRole::Prefill, args)?,
        Cmd::Decode(args) => disagg::run_node(pd::role::PdRole::Decode, args)?,
        Cmd::Gateway(args) => disagg::run_gateway(args)?,
        Cmd::TransferCerts(args) => certs::run(args)?,
        Cmd::Probe(_) | Cmd::Audit(_) => {
            unreachable!("handled in main: they have their own exit codes")
        }
        Cmd::MakeDraft {
            model,
            layers,
            output,
        } => {
            let path = fetch::resolve_model(model.as_deref(), false)?;
            if output.exists() {
                anyhow::bail!("{} exists: not overwriting it", output.display());
            }
            let file = gguf::GgufFile::open(&path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            let draft = gguf::write::select_layers(&file, &layers.0)
                .with_context(|| format!("cannot make a draft of {}", path.display()))?;
            draft
                .write(&output)
                .with_context(|| format!("cannot write {}", output.display()))?;
            println!("{}", output.display());
        }
        Cmd::ModelPath { model } => {
            let p = match model {
                Some(m) => m,
                None => fetch::default_model_path()?,
            };
            println!("{}", p.display());
        }
    }
    Ok(())
}
