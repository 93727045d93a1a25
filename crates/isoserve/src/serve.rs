//! `isoserve serve`: the OpenAI-compatible server (the `server` crate) over
//! one engine, in one process.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use anyhow::{Context, Result};
use engine::Engine;
use server::reqlog::RequestLog;
use server::tenants::Tenants;
use server::Server;

use crate::args::{engine_config, server_config, HttpArgs, ServeArgs};
use crate::{fetch, generate};

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
/// The operations listener (`--metrics-port`): `/metrics` and `/health`
/// without a key, on its own address; runs until the process ends.
pub(crate) async fn serve_ops(server: &Server, http: &crate::args::HttpArgs) -> Result<()> {
    let Some(port) = http.metrics_port else {
        return Ok(());
    };
    let l = tokio::net::TcpListener::bind((http.metrics_host.as_str(), port))
        .await
        .with_context(|| {
            format!(
                "cannot listen on {}:{port} (--metrics-port)",
                http.metrics_host
            )
        })?;
    let addr = l.local_addr()?;
    eprintln!("isoserve: metrics on http://{addr}/metrics");
    server.spawn_ops(l);
    Ok(())
}

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

/// `isoserve serve` in one process (`--disaggregated` is
/// [`crate::disagg::run_supervised`]).
pub fn run(args: ServeArgs) -> Result<()> {
    init_tracing();
    let ServeArgs {
        http, engine: e, ..
    } = args;
    // Cheap checks first: a bad tenants file or log path fails before the
    // model loads.
    let (tenants, reqlog) = tenants_and_log(&http)?;

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
    let template = http.chat_template(model.gguf(), template)?;
    if template.is_none() {
        tracing::warn!("the model has no chat template: /v1/chat/completions will answer 400");
    }
    let ecfg = engine_config(&e)?;
    let summary = ecfg.summary();
    // K8: refuses to start when the pool cannot hold one full window.
    let engine = Engine::start(model, tokenizer.clone(), ecfg)?;
    eprintln!("{}", engine.capacity().table());
    eprintln!("config: {summary}");

    let scfg = server_config(&model_id, &http)?;
    // One grammar cache (per scope) for the HTTP layer and the engine.
    let grammar = engine.grammar();
    let server =
        Server::new(engine, tokenizer, template, tenants, reqlog, scfg).with_grammar(grammar);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("isoserve-http")
        // Every tenant's tokens wait on the engine thread and its kernel
        // workers; what one request costs on the HTTP side (parsing,
        // tokenising, compiling its grammar) yields the CPU to them. With a
        // tenant sending pathological schemas, another's inter-token latency
        // rose 1.5–1.75× without this and 1.17× with it (BENCHMARKS.md).
        .on_thread_start(|| lower_thread_priority(HTTP_THREAD_NICE))
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
        serve_ops(&server, &http).await?;
        server.run(listener, shutdown_signal()).await?;
        anyhow::Ok(())
    })?;
    // Connection tasks still parked (none normally) end with the runtime.
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}

/// The tenants file and the request log of `serve` and `gateway`.
pub(crate) fn tenants_and_log(http: &HttpArgs) -> Result<(Tenants, Option<RequestLog>)> {
    let tenants = match &http.tenants {
        Some(p) => Tenants::load(p)?,
        None => {
            tracing::warn!(
                "no --tenants file: every request runs as one anonymous tenant and API keys are not checked"
            );
            Tenants::anonymous()
        }
    };
    let reqlog = http
        .request_log
        .as_deref()
        .map(RequestLog::open)
        .transpose()?;
    Ok((tenants, reqlog))
}

/// The nice value of the HTTP runtime's threads (workers and blocking
/// ones) under `serve`: below the engine's (0), which every tenant's
/// decode waits on.
const HTTP_THREAD_NICE: i32 = 10;

/// Lowers the calling thread's scheduling priority to `nice` (Linux: a
/// thread's nice value is its own). Best effort: a failure is logged and
/// the thread runs on at its priority.
fn lower_thread_priority(nice: i32) {
    // SAFETY: gettid takes no arguments and cannot fail; setpriority with
    // PRIO_PROCESS and a thread id only changes that thread's nice value
    // (raising it needs no privilege) and touches no memory of ours.
    let rc = unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, nice)
    };
    if rc != 0 {
        tracing::warn!(
            "cannot lower an HTTP thread's priority: {}",
            std::io::Error::last_os_error()
        );
    }
}
