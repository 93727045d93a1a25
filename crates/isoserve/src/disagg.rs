//! Disaggregated serving: `isoserve prefill`, `isoserve decode`,
//! `isoserve gateway`, and `isoserve serve --disaggregated`, which runs the
//! gateway in this process and supervises one prefill and one decode node
//! as child processes on loopback.
//!
//! Supervision: a child that dies is reported (its exit status) and
//! restarted on the same port, at most [`RESTARTS_MAX`] times in
//! [`RESTART_WINDOW`]; beyond that the whole set comes down with a non-zero
//! exit. While a node is down the gateway fails the requests on it cleanly
//! (502), answers new ones 503, and pairs again when the node is back (its
//! limit re-read, K8). SIGTERM/Ctrl-C: the gateway drains (as `serve`),
//! then the children get SIGTERM, then SIGKILL after 10 s.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use gateway::{GatewayBackend, GatewayOptions};
use pd::role::{PdConfig, PdRole};
use server::reqlog::RequestLog;
use server::tenants::Tenants;
use server::Server;
use transport::TransportConfig;

use crate::args::{
    engine_config, server_config, GatewayArgs, HttpArgs, NodeArgs, NodeEngineArgs, ServeArgs,
};
use crate::serve::{self, tenants_and_log};
use crate::{fetch, generate};

/// Restarts of one child allowed within [`RESTART_WINDOW`].
pub const RESTARTS_MAX: usize = 5;
pub const RESTART_WINDOW: Duration = Duration::from_secs(60);
/// How long a child may take to start listening (loading the model).
const CHILD_START_TIMEOUT: Duration = Duration::from_secs(180);

/// `isoserve prefill` / `isoserve decode`.
pub fn run_node(role: PdRole, args: NodeArgs) -> Result<()> {
    serve::init_tracing();
    // K14: refuse plaintext on a non-loopback address before loading anything.
    let tcfg = args.tls.transport_config(&[&args.host], "--host")?;
    let path = fetch::resolve_model(args.engine.model.as_deref(), false)?;
    let generate::Loaded {
        model, tokenizer, ..
    } = generate::load(&path)?;
    let fingerprint = model
        .gguf()
        .fingerprint()
        .context("cannot fingerprint the model")?;
    let role_name = match role {
        PdRole::Prefill => "prefill",
        PdRole::Decode => "decode",
    };
    let node_name = args
        .node
        .clone()
        .unwrap_or_else(|| format!("{role_name}-{}:{}", args.host, args.port));
    let telemetry = args
        .otlp
        .telemetry(&format!("isoserve-{role_name}"), &node_name)?;
    let pd = PdConfig {
        node: node_name.clone(),
        fingerprint,
        transfer_window_pages: args.engine.transfer_window_pages,
        requests_max: args.engine.max_queue.max(1) + args.engine.max_running.max(1),
        waiting_max: args.engine.max_queue.max(1),
        telemetry: telemetry.clone(),
        ..PdConfig::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(format!("isoserve-{role_name}-io"))
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let cfg = engine_config(&args.engine)?;
    let cfg_summary = cfg.summary();
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
        // K8: refuses to start when the pool cannot hold one full window.
        let node = pd::node::start_node(
            role,
            model,
            tokenizer,
            cfg,
            pd,
            listener,
            tcfg,
        )?;
        eprintln!("{}", node.node.capacity().table());
        eprintln!(
            "{node_name} config: {} transfer_window_pages={}",
            cfg_summary, args.engine.transfer_window_pages
        );
        let metrics = match args.metrics_port {
            Some(port) => {
                let l = tokio::net::TcpListener::bind((args.host.as_str(), port))
                    .await
                    .with_context(|| format!("cannot listen on {}:{port} for metrics", args.host))?;
                let addr = l.local_addr()?;
                let task = tokio::spawn(pd::ops::serve(
                    l,
                    node.node.clone(),
                    node.transport.clone(),
                ));
                Some((addr, task))
            }
            None => None,
        };
        {
            let mut out = std::io::stdout().lock();
            if let Some((addr, _)) = &metrics {
                writeln!(out, "isoserve: metrics on http://{addr}/metrics")?;
            }
            writeln!(
                out,
                "isoserve: {role_name} node {node_name} listening on {}",
                node.addr
            )?;
            out.flush()?;
        }
        tracing::info!(node = %node_name, fingerprint = %transfer::short_hex(&fingerprint), "{role_name} node on {}", node.addr);
        serve::shutdown_signal().await;
        drain(&node.node, Duration::from_secs(args.drain_grace_secs)).await;
        tracing::info!("shutting down: closing every connection (peers release their side)");
        node.shutdown();
        anyhow::Ok(())
    })?;
    rt.shutdown_timeout(Duration::from_secs(1));
    // The last spans leave before the process does.
    std::thread::spawn(move || telemetry.shutdown()).join().ok();
    Ok(())
}

/// SIGTERM on a node: stop taking requests (the gateway places new ones on
/// other pairs) and wait — at most `grace`, or until a second signal — for
/// the ones in flight to end.
async fn drain(node: &pd::role::PdNode, grace: Duration) {
    if grace.is_zero() {
        return;
    }
    node.drain();
    let t0 = Instant::now();
    tracing::info!(
        requests = node.stats().requests,
        "draining: no new requests; waiting up to {grace:?} for those in flight"
    );
    let idle = async {
        // The loop sees the drain within its idle poll (500 ms); until then
        // `draining` is false and nothing is concluded.
        loop {
            let s = node.stats();
            if s.draining && s.requests == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::select! {
        _ = idle => tracing::info!("drained in {:?}", t0.elapsed()),
        _ = tokio::time::sleep(grace) => tracing::warn!(
            requests = node.stats().requests,
            "drain grace of {grace:?} over: ending the rest"
        ),
        _ = serve::shutdown_signal() => tracing::warn!("second signal: ending now"),
    }
}

/// What the gateway needs of the model file: tokenizer, template, window
/// and fingerprint (no weights in memory).
struct GatewayModel {
    id: String,
    tokenizer: tokenizer::Tokenizer,
    template: Option<tokenizer::ChatTemplate>,
    window: usize,
    fingerprint: [u8; 32],
}

fn gateway_model(path: &Path, http: &HttpArgs) -> Result<GatewayModel> {
    let f =
        gguf::GgufFile::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let config = model::Config::from_gguf(&f).context("unsupported model")?;
    let tokenizer = tokenizer::Tokenizer::from_gguf(&f).context("cannot build the tokenizer")?;
    let template = tokenizer::ChatTemplate::from_gguf_or_builtin(&f)
        .ok()
        .map(|(t, _)| t);
    let template = http.chat_template(&f, template)?;
    let fingerprint = f.fingerprint().context("cannot fingerprint the model")?;
    Ok(GatewayModel {
        id: path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "model".into()),
        tokenizer,
        template,
        window: config.context_length,
        fingerprint,
    })
}

/// Serves HTTP through a gateway to the given nodes until `stop` resolves;
/// `node_metrics` (name, metrics address) join the gateway's `/metrics`.
#[allow(clippy::too_many_arguments)]
async fn serve_gateway(
    model: GatewayModel,
    prefill: Vec<String>,
    decode: Vec<String>,
    max_context: Option<usize>,
    transport: TransportConfig,
    http: &HttpArgs,
    tenants: Tenants,
    reqlog: Option<RequestLog>,
    node_metrics: Vec<(String, std::net::SocketAddr)>,
    telemetry: telemetry::Telemetry,
    stop: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    let mut opts = GatewayOptions::new(
        prefill,
        decode,
        model.fingerprint,
        model.window.min(u32::MAX as usize) as u32,
    );
    opts.max_context = max_context.map(|m| m.min(u32::MAX as usize) as u32);
    opts.transport = transport;
    opts.telemetry = telemetry;
    let backend = Arc::new(GatewayBackend::start(opts));
    let scfg = server_config(&model.id, http)?;
    let served: Arc<dyn request::Backend> = if node_metrics.is_empty() {
        backend.clone()
    } else {
        Arc::new(gateway::nodes::WithNodeMetrics {
            inner: backend.clone(),
            nodes: node_metrics,
        })
    };
    let server = Server::with_backend(
        served,
        model.tokenizer,
        model.template,
        tenants,
        reqlog,
        scfg,
    );
    let listener = tokio::net::TcpListener::bind((http.host.as_str(), http.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", http.host, http.port))?;
    let addr = listener.local_addr()?;
    // Wait (bounded) for a pair before announcing, so that "listening"
    // means "serving"; without one the gateway still serves (503s).
    // Stop waiting early once every node has answered (up or refused):
    // nothing more will change by itself.
    let t0 = Instant::now();
    let settled =
        |b: &gateway::GatewayBackend| b.nodes().iter().all(|n| n.up() || n.refused.is_some());
    while !engine::Backend::ready(&*backend)
        && !settled(&backend)
        && t0.elapsed() < Duration::from_secs(30)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if !engine::Backend::ready(&*backend) {
        for why in backend.layout_mismatches() {
            tracing::error!("{why}");
        }
        for n in backend.nodes() {
            if let Some(why) = &n.refused {
                tracing::error!(node = %n.addr, "{why}");
            } else if !n.up() {
                tracing::warn!(node = %n.addr, "node not reachable yet");
            }
        }
    }
    tracing::info!(
        "gateway advertises {} tokens (min over the model and every node)",
        engine::Backend::max_request_tokens(&*backend)
    );
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "isoserve: listening on http://{addr}")?;
        out.flush()?;
    }
    crate::serve::serve_ops(&server, http).await?;
    server.run(listener, stop).await?;
    Ok(())
}

/// `isoserve gateway`.
pub fn run_gateway(args: GatewayArgs) -> Result<()> {
    serve::init_tracing();
    let addrs: Vec<&str> = args
        .prefill
        .iter()
        .chain(&args.decode)
        .map(String::as_str)
        .collect();
    for a in &addrs {
        if a.starts_with("dns:") && gateway::parse_dns(a).is_none() {
            anyhow::bail!("node address `{a}`: expected dns:NAME:PORT");
        }
    }
    let transport = args.tls.transport_config(&addrs, "node address")?;
    let (tenants, reqlog) = tenants_and_log(&args.http)?;
    let path = fetch::resolve_model(args.model.as_deref(), false)?;
    let model = gateway_model(&path, &args.http)?;
    let telemetry = args.otlp.telemetry("isoserve-gateway", "gateway")?;
    let rt = runtime()?;
    rt.block_on(serve_gateway(
        model,
        args.prefill.clone(),
        args.decode.clone(),
        args.max_context,
        transport,
        &args.http,
        tenants,
        reqlog,
        args.node_metrics.clone(),
        telemetry.clone(),
        serve::shutdown_signal(),
    ))?;
    rt.shutdown_timeout(Duration::from_secs(1));
    std::thread::spawn(move || telemetry.shutdown()).join().ok();
    Ok(())
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("isoserve-http")
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

// ----------------------------------------------------------- supervisor

struct ChildSpec {
    role: &'static str,
    args: Vec<String>,
    port: u16,
}

struct Supervised {
    spec: ChildSpec,
    child: Option<Child>,
    restarts: Vec<Instant>,
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("cannot pick a port")?;
    Ok(l.local_addr()?.port())
}

/// Starts a child and waits for its "listening" line.
fn spawn_child(spec: &ChildSpec) -> Result<Child> {
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let mut cmd = Command::new(exe);
    cmd.args(&spec.args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: prctl is async-signal-safe; it only asks the kernel to
        // send SIGTERM to the child when this process dies (so a killed
        // supervisor leaves no orphans).
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start the {} node", spec.role))?;
    let stdout = child.stdout.take().expect("piped");
    let role = spec.role;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        for line in lines.by_ref() {
            let Ok(line) = line else { break };
            if let Some(url) = line.strip_prefix("isoserve: metrics on ") {
                tracing::info!("{role} node metrics: {url}");
            }
            if line.contains("listening on") {
                let _ = tx.send(line);
                break;
            }
        }
        // Keep draining so the child never blocks on a full pipe.
        for _ in lines {}
    });
    match rx.recv_timeout(CHILD_START_TIMEOUT) {
        Ok(_) => Ok(child),
        Err(_) => {
            let status = child.try_wait().ok().flatten();
            let _ = child.kill();
            let _ = child.wait();
            match status {
                Some(s) => bail!("the {} node exited before listening ({s})", spec.role),
                None => bail!(
                    "the {} node did not listen within {} s",
                    spec.role,
                    CHILD_START_TIMEOUT.as_secs()
                ),
            }
        }
    }
}

fn terminate(child: &mut Child) {
    // SAFETY: kill(2) with a pid we own and a valid signal number.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(10) {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// `isoserve serve --disaggregated`.
pub fn run_supervised(args: ServeArgs) -> Result<()> {
    serve::init_tracing();
    let (tenants, reqlog) = tenants_and_log(&args.http)?;
    let path = fetch::resolve_model(args.engine.model.as_deref(), false)?;
    let model = gateway_model(&path, &args.http)?;
    // The children's engine flags come from the same struct (a new flag
    // cannot miss them), with the model resolved here.
    let engine = NodeEngineArgs {
        model: Some(path.clone()),
        ..args.engine.clone()
    };
    let mut common = vec!["--host".to_string(), "127.0.0.1".into()];
    common.extend(engine.to_cli_args());
    let mut children = Vec::new();
    // The children's metrics ports are fixed here (kept across restarts),
    // so the gateway's /metrics can show their samples (node label).
    let mut node_metrics = Vec::new();
    for role in ["prefill", "decode"] {
        let port = free_port()?;
        let metrics_port = free_port()?;
        let name = format!("{role}-0");
        node_metrics.push((
            name.clone(),
            std::net::SocketAddr::from(([127, 0, 0, 1], metrics_port)),
        ));
        let mut a = vec![role.to_string()];
        a.extend(common.iter().cloned());
        a.extend([
            "--port".into(),
            port.to_string(),
            "--metrics-port".into(),
            metrics_port.to_string(),
            "--node".into(),
            name,
        ]);
        children.push(Supervised {
            spec: ChildSpec {
                role: if role == "prefill" {
                    "prefill"
                } else {
                    "decode"
                },
                args: a,
                port,
            },
            child: None,
            restarts: Vec::new(),
        });
    }
    for c in &mut children {
        c.child = Some(spawn_child(&c.spec)?);
        tracing::info!("{} node started on 127.0.0.1:{}", c.spec.role, c.spec.port);
    }
    let prefill = vec![format!("127.0.0.1:{}", children[0].spec.port)];
    let decode = vec![format!("127.0.0.1:{}", children[1].spec.port)];
    let children = Arc::new(Mutex::new(children));
    let stopping = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(Mutex::new(None::<String>));
    let rt = runtime()?;
    let result = rt.block_on(async {
        let give_up = Arc::new(tokio::sync::Notify::new());
        // The supervisor: watch the children, restart or give up.
        let sup = {
            let children = children.clone();
            let stopping = stopping.clone();
            let failed = failed.clone();
            let give_up = give_up.clone();
            tokio::task::spawn_blocking(move || {
                while !stopping.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(100));
                    let mut cs = children.lock().unwrap_or_else(|e| e.into_inner());
                    for c in cs.iter_mut() {
                        let Some(ch) = c.child.as_mut() else { continue };
                        let Ok(Some(status)) = ch.try_wait() else { continue };
                        if stopping.load(Ordering::Acquire) {
                            break;
                        }
                        let now = Instant::now();
                        c.restarts.retain(|t| now.duration_since(*t) < RESTART_WINDOW);
                        if c.restarts.len() >= RESTARTS_MAX {
                            let why = format!(
                                "the {} node died ({status}) {} times within {} s: bringing the set down",
                                c.spec.role,
                                RESTARTS_MAX + 1,
                                RESTART_WINDOW.as_secs()
                            );
                            tracing::error!("{why}");
                            *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
                            c.child = None;
                            give_up.notify_one();
                            return;
                        }
                        c.restarts.push(now);
                        tracing::error!(
                            "the {} node exited ({status}); restarting it ({} of {RESTARTS_MAX} in {} s)",
                            c.spec.role,
                            c.restarts.len(),
                            RESTART_WINDOW.as_secs()
                        );
                        match spawn_child(&c.spec) {
                            Ok(ch) => c.child = Some(ch),
                            Err(e) => {
                                let why = format!("cannot restart the {} node: {e:#}", c.spec.role);
                                tracing::error!("{why}");
                                *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
                                c.child = None;
                                give_up.notify_one();
                                return;
                            }
                        }
                    }
                }
            })
        };
        let stop = {
            let give_up = give_up.clone();
            async move {
                tokio::select! {
                    _ = serve::shutdown_signal() => {}
                    _ = give_up.notified() => {}
                }
            }
        };
        let r = serve_gateway(
            model,
            prefill,
            decode,
            args.engine.max_context,
            // The children listen on loopback: plaintext stays on this host.
            TransportConfig::default(),
            &args.http,
            tenants,
            reqlog,
            node_metrics,
            telemetry::Telemetry::logs_only("isoserve-gateway"),
            stop,
        )
        .await;
        stopping.store(true, Ordering::Release);
        let _ = sup.await;
        r
    });
    // The gateway has drained; now the nodes.
    let mut cs = children.lock().unwrap_or_else(|e| e.into_inner());
    for c in cs.iter_mut() {
        if let Some(mut ch) = c.child.take() {
            terminate(&mut ch);
        }
    }
    rt.shutdown_timeout(Duration::from_secs(1));
    result?;
    if let Some(why) = failed.lock().unwrap_or_else(|e| e.into_inner()).take() {
        bail!(why);
    }
    Ok(())
}
