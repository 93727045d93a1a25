//! `isoserve audit`: the incident's signature in a request log (crate
//! `audit`). Exit 0 no match, 1 matches, 2 could not audit.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek};
use std::path::PathBuf;
use std::process::ExitCode;

use audit::{read, Auditor, Format, Mapping, Signature};

#[derive(Clone, Copy, clap::ValueEnum)]
enum FormatArg {
    /// JSONL if the first line starts with `{`, else CSV.
    Auto,
    Jsonl,
    Csv,
}

#[derive(clap::Args)]
pub struct AuditArgs {
    /// The request log (`isoserve serve --request-log`, or another
    /// server's JSONL/CSV log with --map).
    #[arg(long)]
    log: PathBuf,
    #[arg(long, value_enum, default_value_t = FormatArg::Auto)]
    format: FormatArg,
    /// Where a field is in another server's log: FIELD=COLUMN, with an
    /// optional factor (ttft_ms=ttft_s*1000); FIELD= drops a field. Fields:
    /// id, tenant, ts, outcome, prompt_tokens, output_tokens, ttft_ms,
    /// kv_capacity_tokens, context_window_tokens, prefill_tokens_per_s,
    /// pages, error_code, kv_event. Unmapped fields keep our names. With a
    /// CSV log, every mapped column must be in the header.
    #[arg(long = "map", value_name = "FIELD=COLUMN")]
    map: Vec<String>,
    /// The prefill rate for records that do not carry their own (e.g. a
    /// PD gateway's log, or another server's): what `isoserve probe`
    /// measures, or the prefill node's own figure.
    #[arg(long)]
    prefill_tokens_per_s: Option<f64>,
    /// `too_fast` below this fraction of the prefill time a prompt needs.
    #[arg(long, default_value_t = 0.5)]
    ttft_fraction: f64,
    /// `too_fast` judges prompts of at least this many tokens.
    #[arg(long, default_value_t = 256)]
    min_prompt_tokens: u64,
    /// Width of the time windows matches are counted in, in minutes.
    #[arg(long, default_value_t = 60)]
    window_min: u64,
    /// Matches listed one by one (all are counted).
    #[arg(long, default_value_t = 1000)]
    list_max: usize,
    /// Write the JSON report here.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(a: AuditArgs) -> ExitCode {
    match audit(&a) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("isoserve audit: could not run: {e}");
            ExitCode::from(2)
        }
    }
}

fn audit(a: &AuditArgs) -> Result<ExitCode, String> {
    if !(a.ttft_fraction > 0.0 && a.ttft_fraction <= 1.0) {
        return Err(format!(
            "--ttft-fraction must be in (0, 1], not {}",
            a.ttft_fraction
        ));
    }
    if a.prefill_tokens_per_s
        .is_some_and(|r| !(r.is_finite() && r > 0.0))
    {
        return Err("--prefill-tokens-per-s must be a positive number".into());
    }
    if a.window_min == 0 || a.window_min > 366 * 24 * 60 {
        return Err("--window-min must be 1..=527040".into());
    }
    let mut mapping = Mapping::ours();
    for spec in &a.map {
        mapping.set(spec).map_err(|e| e.to_string())?;
    }
    let open = || File::open(&a.log).map_err(|e| format!("cannot open {}: {e}", a.log.display()));
    let mut file = BufReader::new(open()?);
    let format = match a.format {
        FormatArg::Jsonl => Format::Jsonl,
        FormatArg::Csv => Format::Csv,
        FormatArg::Auto => {
            let mut first = String::new();
            // Bounded: the first line only, as far as 64 KiB.
            let mut probe = Read::take(&mut file, 64 << 10);
            while first.trim().is_empty() {
                first.clear();
                if probe.read_line(&mut first).map_err(|e| e.to_string())? == 0 {
                    break;
                }
            }
            file.rewind().map_err(|e| e.to_string())?;
            Format::sniff(&first)
        }
    };
    let sig = Signature {
        prefill_tokens_per_s: a.prefill_tokens_per_s,
        ttft_fraction: a.ttft_fraction,
        too_fast_prompt_tokens_min: a.min_prompt_tokens,
        window_s: a.window_min * 60,
        matches_listed_max: a.list_max,
        ..Signature::default()
    };
    let mut auditor = Auditor::new(sig);
    match format {
        Format::Jsonl => read::read_jsonl(file, &mapping, |r| auditor.push(r)),
        // Columns named explicitly must exist; our defaults may be absent.
        Format::Csv => read::read_csv(file, &mapping, !a.map.is_empty(), |r| auditor.push(r)),
    }
    .map_err(|e| e.to_string())?;
    let report = auditor.finish();
    print!("{}", report.render(&a.log.display().to_string()));
    if let Some(path) = &a.json {
        let json = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(path, json + "\n")
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if report.exit_code() == 2 {
        eprintln!(
            "isoserve audit: could not audit: {}",
            if report.records == 0 {
                "no readable record in the log"
            } else {
                "no record carries the fields of any rule (see --map)"
            }
        );
    }
    Ok(ExitCode::from(report.exit_code() as u8))
}
