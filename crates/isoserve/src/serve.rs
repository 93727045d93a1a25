//! `isoserve serve`: the OpenAI-compatible server (the `server` crate) over
//! one engine, in one process.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use engine::Engine;
use server::Server;

use crate::{fetch, generate};

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub http: HttpArgs,
    #[command(flatten)]
    pub engine: NodeEngineArgs,
    /// Run disaggregated: this process is the gateway and supervises one
    /// prefill and one decode node as child processes on loopback, which
    /// hand KV pages over TCP (checksums, canaries, deferred release). A
    /// child that dies is restarted (at most 5 times a minute, then the
    /// set comes down). Engine flags apply to both nodes.
    #[arg(long)]
    pub disaggregated: bool,
}

/// The HTTP side of `serve` and `gateway`.
#[derive(clap::Args, Debug, Clone)]
pub struct HttpArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on; 0 picks a free port. Once listening, the server
    /// prints `isoserve: listening on http://HOST:PORT` to stdout.
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Tenants file (TOML: `[[tenant]] name, api_key_sha256,
    /// max_concurrent, max_tokens_per_minute`). Without it, every request
    /// runs as one anonymous tenant and no API key is checked.
    #[arg(long)]
    pub tenants: Option<PathBuf>,
    /// Append one JSON line per request (id, tenant, token counts, timings,
    /// pages, outcome) to this file. Default: no request log.
    #[arg(long)]
    pub request_log: Option<PathBuf>,
    /// Also write prompt text to the request log (off: prompts are
    /// customer data).
    #[arg(long)]
    pub log_prompts: bool,
    /// Largest request body (bytes or with a suffix, e.g. 4MiB); larger
    /// bodies get 413.
    #[arg(long, default_value = "4MiB", value_parser = parse_bytes)]
    pub max_body: u64,
    /// max_tokens of a request that sets none: the rest of the context
    /// window, capped at this (pages for prompt + max_tokens are reserved
    /// up front).
    #[arg(long, default_value_t = 1024)]
    pub default_max_tokens: usize,
    /// Most open client connections (more wait in the listen backlog).
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// After SIGTERM or Ctrl-C: seconds running requests get to finish
    /// before they are cancelled (new requests get 503 meanwhile).
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_secs: u64,
}

/// The engine side of `serve`, `prefill` and `decode`.
#[derive(clap::Args, Debug, Clone)]
pub struct NodeEngineArgs {
    /// A LLaMA-family GGUF file (default: the cached default model, fetched
    /// if missing). Its file stem is the model id clients must name (or
    /// `default`).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Advertise a context window smaller than the model's (needed when
    /// the KV pool holds less than the model's window).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// KV pool memory budget: bytes, or with a suffix (512MiB, 1GiB, 2GB;
    /// K/M/G alone are binary).
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    pub kv_memory: u64,
    /// KV pool size in pages (overrides --kv-memory).
    #[arg(long)]
    pub kv_pages: Option<u64>,
    /// Token slots per KV page.
    #[arg(long, default_value_t = 16)]
    pub page_size: usize,
    /// Requests that may wait for admission; beyond it new requests get 429.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Requests the engine runs at once (at most --step-tokens).
    #[arg(long, default_value_t = 32)]
    pub max_running: usize,
    /// Token budget of one forward step (decode rows plus prefill chunks).
    #[arg(long, default_value_t = 256)]
    pub step_tokens: usize,
    /// PD only: KV pages a transfer may have in flight before decode
    /// acknowledges them (the bounded transfer batch).
    #[arg(long, default_value_t = 8)]
    pub transfer_window_pages: u32,
}

/// `1234`, `4KiB`, `512MiB`, `1GiB`, `2GB`, `64k`, `1g`: bytes.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let mult: u64 = match unit.as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => {
            return Err(format!(
                "unknown size unit `{unit}` (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            ))
        }
    };
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 512MiB)"))?;
    let bytes = value * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("`{s}` is out of range"));
    }
    Ok(bytes as u64)
}

pub(crate) fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("ISOSERVE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// Resolves on the first SIGTERM or Ctrl-C; a second one exits at once.
pub(crate) async fn shutdown_signal() {
    async fn ctrl_c() {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
    #[cfg(unix)]
    async fn term() {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    }
    #[cfg(not(unix))]
    async fn term() {
        std::future::pending::<()>().await
    }
    tokio::select! {
        _ = ctrl_c() => tracing::info!("Ctrl-C received"),
        _ = term() => tracing::info!("SIGTERM received"),
    }
    tokio::spawn(async {
        tokio::select! {
            _ = ctrl_c() => {}
            _ = term() => {}
        }
        tracing::warn!("second signal: exiting without draining");
        std::process::exit(130);
    });
}

pub fn run(args: ServeArgs) -> Result<()> {
    if args.disaggregated {
        return crate::disagg::run_supervised(args);
    }
    init_tracing();
    let ServeArgs {
        http, engine: e, ..
    } = args;
    // Cheap checks first: a bad tenants file or log path fails before the
    // model loads.
    let (tenants, reqlog) = crate::disagg::tenants_and_log(&http)?;

    let path = fetch::resolve_model(e.model.as_deref(), false)?;
    let model_id = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "model".to_string());
    let generate::Loaded {
        model,
        tokenizer,
        template,
    } = generate::load(&path)?;
    if template.is_none() {
        tracing::warn!("the model has no chat template: /v1/chat/completions will answer 400");
    }
    let ecfg = crate::disagg::engine_config(&e);
    // K8: refuses to start when the pool cannot hold one full window.
    let engine = Engine::start(model, tokenizer.clone(), ecfg)?;
    eprintln!("{}", engine.capacity().table());

    let scfg = crate::disagg::server_config(&model_id, &http)?;
    let server = Server::new(engine, tokenizer, template, tenants, reqlog, scfg);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("isoserve-http")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((http.host.as_str(), http.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", http.host, http.port))?;
        let addr = listener.local_addr()?;
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "isoserve: listening on http://{addr}")?;
            out.flush()?;
        }
        tracing::info!(model = %model_id, "serving on http://{addr}");
        server.run(listener, shutdown_signal()).await?;
        anyhow::Ok(())
    })?;
    // Connection tasks still parked (none normally) end with the runtime.
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_parse_with_and_without_units() {
        assert_eq!(parse_bytes("1234"), Ok(1234));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("1g"), Ok(1 << 30));
        assert_eq!(parse_bytes("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_bytes("1.5KiB"), Ok(1536));
        assert_eq!(parse_bytes(" 4 MiB "), Ok(4 << 20));
        assert!(parse_bytes("12XB").is_err());
        assert!(parse_bytes("MiB").is_err());
        assert!(parse_bytes("-1").is_err());
        assert!(parse_bytes("1e30TiB").is_err());
    }
}
