//! Seeded deterministic simulation of the PD stack over many seeds.
//!
//! `cargo run --release -p verify --bin pd-sim -- --seeds 0..1000000`
//! runs a million seeds (README, "Verification", has the measured rate);
//! the first failing seed is printed with the command that replays it with
//! a trace. Exit 0: every seed passed; 1: a seed failed; 2: bad arguments.

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use clap::Parser;
use testkit::sim::{Sim, SimConfig};

#[derive(Parser)]
#[command(about = "Run the seeded PD simulation over a range of seeds")]
struct Args {
    /// Seeds to run, `start..end` (end exclusive).
    #[arg(long, default_value = "0..10000")]
    seeds: String,
    /// Worker threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Beyond TCP: also reorder, lose and duplicate frames (safety only).
    #[arg(long)]
    adversarial: bool,
}

fn parse_range(s: &str) -> Option<(u64, u64)> {
    let (a, b) = s.split_once("..")?;
    let (a, b) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    (a < b).then_some((a, b))
}

fn main() -> ExitCode {
    let args = Args::parse();
    let Some((start, end)) = parse_range(&args.seeds) else {
        eprintln!(
            "error: --seeds must be `start..end` with start < end, got `{}`",
            args.seeds
        );
        return ExitCode::from(2);
    };
    let cfg = if args.adversarial {
        SimConfig::default().adversarial()
    } else {
        SimConfig::default()
    };
    let next = AtomicU64::new(start);
    let done = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let failure: Mutex<Option<(u64, String)>> = Mutex::new(None);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..args.threads.max(1) {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= end {
                        break;
                    }
                    if let Err(e) = Sim::new(seed, cfg.clone()).run() {
                        let mut f = failure.lock().expect("no panics while held");
                        if f.as_ref().is_none_or(|(s0, _)| seed < *s0) {
                            *f = Some((seed, e));
                        }
                        stop.store(true, Ordering::Relaxed);
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        // Progress every 10 s, bounded by the run itself.
        s.spawn(|| {
            let mut last = Instant::now();
            while done.load(Ordering::Relaxed) < end - start && !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(200));
                if last.elapsed() >= Duration::from_secs(10) {
                    last = Instant::now();
                    let n = done.load(Ordering::Relaxed);
                    eprintln!(
                        "{n} of {} seeds, {:.0} seeds/s",
                        end - start,
                        n as f64 / t0.elapsed().as_secs_f64()
                    );
                }
            }
        });
    });
    let n = done.load(Ordering::Relaxed);
    let secs = t0.elapsed().as_secs_f64();
    match failure.into_inner().expect("threads joined") {
        Some((seed, e)) => {
            println!("seed {seed} FAILED: {e}");
            let adv = if args.adversarial {
                "SIM_ADVERSARIAL=1 "
            } else {
                ""
            };
            println!(
                "replay: {adv}SIM_SEED={seed} cargo test --release -p testkit --test sim replay -- --nocapture"
            );
            ExitCode::from(1)
        }
        None => {
            println!(
                "{n} seeds ({start}..{end}{}) passed in {secs:.1} s ({:.0} seeds/s)",
                if args.adversarial {
                    ", adversarial network"
                } else {
                    ""
                },
                n as f64 / secs
            );
            ExitCode::SUCCESS
        }
    }
}
