//! `isoserve` — the command-line entry point. See README.md.

mod fetch;

use std::path::PathBuf;
use std::process::ExitCode;

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
        /// Re-hash an already cached file instead of trusting its marker.
        #[arg(long)]
        verify: bool,
        /// Print only the path.
        #[arg(long, short)]
        quiet: bool,
    },
    /// Print where the model cache lives.
    ModelPath {
        #[arg(long)]
        model: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
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
        Cmd::FetchModel { verify, quiet } => {
            let path = fetch::fetch_default_model(verify, quiet)?;
            println!("{}", path.display());
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
