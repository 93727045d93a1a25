//! Model-check the KV transfer protocol within chosen bounds.
//!
//! `cargo run --release -p verify --bin pd-check` runs CI's bound sets;
//! `--suite two-tenants --requests 3 --cancels 3 --crashes 2` a deeper
//! search (README, "Verification"). Exit 0: every property holds and every
//! `sometimes` was reached; 1: a violation (its trace printed) or an
//! unreached state; 2: bad arguments.

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use verify::{check, Bounds, Search};

#[derive(Parser)]
#[command(about = "Model-check the PD KV transfer protocol (stateright)")]
struct Args {
    /// Bound set: two-tenants, oversize, stale-writer, adversarial, or all.
    #[arg(long, default_value = "all")]
    suite: String,
    /// Checker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Requests (tenants alternate; prompts of 5 tokens).
    #[arg(long)]
    requests: Option<usize>,
    #[arg(long)]
    cancels: Option<usize>,
    #[arg(long)]
    crashes: Option<usize>,
    #[arg(long)]
    kills: Option<usize>,
    #[arg(long)]
    stale_writes: Option<usize>,
    /// Decode pool pages.
    #[arg(long)]
    decode_pages: Option<u64>,
    /// Switch on a test-only mutation: placeholder, free-without-drain,
    /// skip-epoch-check, skip-rewind (the search must then find a
    /// counterexample).
    #[arg(long)]
    mutation: Option<String>,
    /// Depth-first search (less memory, for deeper bounds).
    #[arg(long)]
    dfs: bool,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 3600)]
    timeout_s: u64,
}

fn main() -> ExitCode {
    let a = Args::parse();
    let mut suites: Vec<Bounds> = match a.suite.as_str() {
        "all" => Bounds::ci(),
        name => match Bounds::ci().into_iter().find(|b| b.name == name) {
            Some(b) => vec![b],
            None => {
                eprintln!("error: unknown suite `{name}` (two-tenants, oversize, stale-writer, adversarial, prefix-cache, speculation, all)");
                return ExitCode::from(2);
            }
        },
    };
    for b in &mut suites {
        if let Some(n) = a.requests {
            let proto = b.requests[0].clone();
            b.requests = (0..n)
                .map(|i| {
                    let mut c = proto.clone();
                    c.tenant = transfer::TenantId(1 + i as u64 % 2);
                    c.prompt = c.prompt.iter().map(|t| t + 10 * i as u32).collect();
                    c
                })
                .collect();
        }
        b.cancels = a.cancels.unwrap_or(b.cancels);
        b.crashes = a.crashes.unwrap_or(b.crashes);
        b.kills = a.kills.unwrap_or(b.kills);
        b.stale_writes = a.stale_writes.unwrap_or(b.stale_writes);
        b.params.decode_pages = a.decode_pages.unwrap_or(b.params.decode_pages);
        b.timeout = Duration::from_secs(a.timeout_s);
        if a.dfs {
            b.search = Search::Dfs;
        }
        match a.mutation.as_deref() {
            None => {}
            Some("placeholder") => b.mutations.prefill.placeholder = true,
            Some("free-without-drain") => b.mutations.decode.free_without_drain = true,
            Some("skip-epoch-check") => b.mutations.decode.skip_epoch_check = true,
            Some("skip-rewind") => b.mutations.skip_rewind = true,
            Some(m) => {
                eprintln!("error: unknown mutation `{m}` (placeholder, free-without-drain, skip-epoch-check, skip-rewind)");
                return ExitCode::from(2);
            }
        }
    }
    let mut clean = true;
    for b in &suites {
        println!(
            "{}: {} requests, {} decode pages, {} prefill pages, {} cancels, {} crashes, {} kills, {} stale writes, {:?}, {:?}",
            b.name,
            b.requests.len(),
            b.params.decode_pages,
            b.params.prefill_pages,
            b.cancels,
            b.crashes,
            b.kills,
            b.stale_writes,
            b.network,
            b.search
        );
        let r = check(b, a.threads);
        print!("{r}");
        clean &= r.violations.is_empty() && r.unreached.is_empty() && !r.timed_out;
    }
    if clean {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
