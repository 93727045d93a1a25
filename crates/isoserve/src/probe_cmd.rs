//! `isoserve probe`: the black-box isolation tester (crate `probe`) on the
//! command line. Exit 0 clean, 1 findings, 2 could not run.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use probe::http::HttpEndpoint;
use probe::run::{Config, Progress};
use probe::Endpoint;

#[derive(clap::Args)]
pub struct ProbeArgs {
    /// Base URL of the OpenAI-compatible server (http://host:port). Only
    /// this URL is contacted.
    #[arg(long)]
    url: String,
    /// A tenant's API key (give two or more; isolation is between them).
    #[arg(long = "tenant-key", required = true)]
    tenant_keys: Vec<String>,
    /// The context window in tokens, if the server does not advertise it
    /// in /v1/models (max_model_len / context_length).
    #[arg(long)]
    context_window: Option<u64>,
    /// The server claims greedy output does not depend on load (isoserve
    /// does): any difference is a finding, not a statistic.
    #[arg(long)]
    deterministic: bool,
    /// Secret-bearing prompts per tenant.
    #[arg(long, default_value_t = 3)]
    prompts: usize,
    /// Times each prompt is sent under load.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Requests in flight under load.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Tokens generated per probe prompt.
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// Tokens of a long (marker) prompt; default a quarter of the window,
    /// at most 2048.
    #[arg(long)]
    long_prompt_tokens: Option<u64>,
    /// Limit on the whole run, in seconds (exit 2 beyond it).
    #[arg(long, default_value_t = 900)]
    time_budget_s: u64,
    /// Limit on one request, in seconds.
    #[arg(long, default_value_t = 300)]
    request_timeout_s: u64,
    /// Seed of the secrets and the load's order.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
}

struct Bar(Mutex<Option<ProgressBar>>);

impl Progress for Bar {
    fn phase(&self, name: &str, requests: u64) {
        let mut b = self.0.lock().expect("not poisoned");
        if let Some(old) = b.take() {
            old.finish_and_clear();
        }
        let bar = ProgressBar::new(requests).with_message(name.to_string());
        bar.set_style(
            ProgressStyle::with_template("{msg:>22} [{bar:30}] {pos}/{len} requests {elapsed}")
                .expect("a valid template")
                .progress_chars("=> "),
        );
        *b = Some(bar);
    }
    fn tick(&self) {
        if let Some(b) = self.0.lock().expect("not poisoned").as_ref() {
            b.inc(1);
        }
    }
}

pub fn run(a: ProbeArgs) -> ExitCode {
    let cfg = Config {
        tenant_keys: a.tenant_keys,
        context_window: a.context_window,
        deterministic: a.deterministic,
        prompts_per_tenant: a.prompts,
        rounds: a.rounds,
        concurrency: a.concurrency,
        max_tokens: a.max_tokens,
        long_prompt_tokens: a.long_prompt_tokens,
        time_budget: Duration::from_secs(a.time_budget_s),
        request_timeout: Duration::from_secs(a.request_timeout_s),
        seed: a.seed,
    };
    let bar = Bar(Mutex::new(None));
    let result = cfg
        .validate()
        .and_then(|()| HttpEndpoint::new(&a.url, Duration::from_secs(a.request_timeout_s)))
        .and_then(|mut ep| {
            let info = ep.model(&cfg.tenant_keys[0])?;
            ep.set_model(info.id);
            probe::run::run(&ep, &a.url, &cfg, &bar)
        });
    if let Some(b) = bar.0.lock().expect("not poisoned").take() {
        b.finish_and_clear();
    }
    let report = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("isoserve probe: could not run: {e}");
            return ExitCode::from(2);
        }
    };
    print!("{}", report.human());
    if let Some(path) = a.json {
        let json = serde_json::to_string_pretty(&report).expect("a report serialises");
        if let Err(e) = std::fs::write(&path, json + "\n") {
            eprintln!("isoserve probe: cannot write {}: {e}", path.display());
            return ExitCode::from(2);
        }
    }
    ExitCode::from(report.exit_code())
}
