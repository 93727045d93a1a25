//! Reading a log into [`Record`]s: JSONL (one object per line) or CSV (a
//! header row names the columns), through a [`Mapping`] from our field
//! names to the log's.

use std::collections::BTreeMap;
use std::io::BufRead;

use serde_json::Value;

use crate::AuditError;

/// One request as the audit sees it. Every field but `line` may be absent
/// from a log; a rule is checked only on records that carry its inputs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Record {
    /// 1-based line of a JSONL file, or row of a CSV file (the header is
    /// row 1).
    pub line: usize,
    pub id: Option<String>,
    pub tenant: Option<String>,
    /// When the request ended, milliseconds since the Unix epoch.
    pub ts_ms: Option<i64>,
    pub outcome: Outcome,
    pub prompt_tokens: Option<u64>,
    /// Prompt tokens served from a prefix cache: not prefilled, so not
    /// timed (`too_fast`).
    pub cached_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub ttft_ms: Option<f64>,
    /// The KV pool's capacity in tokens when the request ran.
    pub kv_capacity_tokens: Option<u64>,
    /// The largest request (prompt + completion) the server accepted then.
    pub context_window_tokens: Option<u64>,
    /// The server's measured prefill rate when the request ran.
    pub prefill_tokens_per_s: Option<f64>,
    /// KV pages the request held when it ended (for a refused request: what
    /// was allocated to it before the refusal).
    pub pages: Option<u64>,
    /// The error's code (OpenAI's `error.code`), for refused requests.
    pub error_code: Option<String>,
    /// A KV safety check that fired on the request (checksum, canary,
    /// fence), as the log names it.
    pub kv_event: Option<String>,
}

/// How a request ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Outcome {
    Finished,
    Cancelled,
    Rejected,
    Error,
    #[default]
    Unknown,
}

impl Outcome {
    /// Our names (`finished`, `cancelled`, `rejected`, `error`), common
    /// synonyms, or an HTTP status: 2xx finished, 499 cancelled (the
    /// client closed), other 4xx rejected, 5xx error.
    pub fn parse(v: &str) -> Option<Outcome> {
        let v = v.trim();
        if let Ok(status) = v.parse::<u16>() {
            return match status {
                200..=299 => Some(Outcome::Finished),
                499 => Some(Outcome::Cancelled),
                400..=498 => Some(Outcome::Rejected),
                500..=599 => Some(Outcome::Error),
                _ => None,
            };
        }
        match v.to_ascii_lowercase().as_str() {
            "finished" | "ok" | "success" | "succeeded" | "completed" | "stop" | "length" => {
                Some(Outcome::Finished)
            }
            "cancelled" | "canceled" | "aborted" | "abort" => Some(Outcome::Cancelled),
            "rejected" | "refused" => Some(Outcome::Rejected),
            "error" | "failed" | "failure" => Some(Outcome::Error),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Finished => "finished",
            Outcome::Cancelled => "cancelled",
            Outcome::Rejected => "rejected",
            Outcome::Error => "error",
            Outcome::Unknown => "unknown",
        }
    }
}

/// The fields the audit reads, by our request log's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Field {
    Id,
    Tenant,
    Ts,
    Outcome,
    PromptTokens,
    OutputTokens,
    TtftMs,
    KvCapacityTokens,
    ContextWindowTokens,
    PrefillTokensPerS,
    Pages,
    ErrorCode,
    KvEvent,
    CachedTokens,
}

impl Field {
    pub const ALL: [Field; 14] = [
        Field::Id,
        Field::Tenant,
        Field::Ts,
        Field::Outcome,
        Field::PromptTokens,
        Field::OutputTokens,
        Field::TtftMs,
        Field::KvCapacityTokens,
        Field::ContextWindowTokens,
        Field::PrefillTokensPerS,
        Field::Pages,
        Field::ErrorCode,
        Field::KvEvent,
        Field::CachedTokens,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Field::Id => "id",
            Field::Tenant => "tenant",
            Field::Ts => "ts",
            Field::Outcome => "outcome",
            Field::PromptTokens => "prompt_tokens",
            Field::OutputTokens => "output_tokens",
            Field::TtftMs => "ttft_ms",
            Field::KvCapacityTokens => "kv_capacity_tokens",
            Field::ContextWindowTokens => "context_window_tokens",
            Field::PrefillTokensPerS => "prefill_tokens_per_s",
            Field::Pages => "pages",
            Field::ErrorCode => "error_code",
            Field::KvEvent => "kv_event",
            Field::CachedTokens => "cached_tokens",
        }
    }

    fn parse(name: &str) -> Option<Field> {
        Field::ALL.into_iter().find(|f| f.as_str() == name)
    }
}

/// Where a field comes from: a key (JSONL; `a.b` reaches into nested
/// objects) or a column (CSV), and a factor for numbers (`ttft_s*1000`
/// turns seconds into milliseconds; for `ts`, numbers are Unix seconds
/// after the factor).
#[derive(Clone, Debug, PartialEq)]
pub struct Source {
    pub key: String,
    pub factor: f64,
}

/// Our field names to the log's. [`Mapping::ours`] reads `isoserve`'s own
/// request log; [`Mapping::set`] overrides one field from a
/// `field=column`, `field=column*1000` or `field=column/1000` spec.
#[derive(Clone, Debug, PartialEq)]
pub struct Mapping {
    fields: BTreeMap<Field, Source>,
}

impl Mapping {
    /// Our request log: every field under its own name.
    pub fn ours() -> Mapping {
        Mapping {
            fields: Field::ALL
                .into_iter()
                .map(|f| {
                    (
                        f,
                        Source {
                            key: f.as_str().to_string(),
                            factor: 1.0,
                        },
                    )
                })
                .collect(),
        }
    }

    /// Applies one `field=column[*k|/k]` spec; `field=` (empty) drops the
    /// field.
    pub fn set(&mut self, spec: &str) -> Result<(), AuditError> {
        let bad = |why: String| AuditError::Mapping {
            spec: spec.to_string(),
            why,
        };
        let (name, src) = spec
            .split_once('=')
            .ok_or_else(|| bad("expected FIELD=COLUMN".into()))?;
        let field = Field::parse(name.trim()).ok_or_else(|| {
            let names: Vec<&str> = Field::ALL.iter().map(|f| f.as_str()).collect();
            bad(format!(
                "unknown field `{name}`; the fields are {}",
                names.join(", ")
            ))
        })?;
        let src = src.trim();
        if src.is_empty() {
            self.fields.remove(&field);
            return Ok(());
        }
        let (key, factor) = match src.rfind(['*', '/']) {
            Some(at) => {
                let k: f64 = src[at + 1..]
                    .trim()
                    .parse()
                    .map_err(|_| bad(format!("`{}` is not a number", &src[at + 1..])))?;
                if !k.is_finite() || k == 0.0 {
                    return Err(bad("the factor must be a finite non-zero number".into()));
                }
                let factor = if src.as_bytes()[at] == b'*' {
                    k
                } else {
                    1.0 / k
                };
                (src[..at].trim(), factor)
            }
            None => (src, 1.0),
        };
        if key.is_empty() {
            return Err(bad("the column name is empty".into()));
        }
        self.fields.insert(
            field,
            Source {
                key: key.to_string(),
                factor,
            },
        );
        Ok(())
    }

    pub fn source(&self, f: Field) -> Option<&Source> {
        self.fields.get(&f)
    }
}

/// The log's format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Jsonl,
    Csv,
}

impl Format {
    /// From the first non-blank line: `{` starts JSONL, anything else is a
    /// CSV header.
    pub fn sniff(first_line: &str) -> Format {
        if first_line.trim_start().starts_with('{') {
            Format::Jsonl
        } else {
            Format::Csv
        }
    }
}

/// A line that could not be read, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Unreadable {
    pub line: usize,
    pub why: String,
}

/// Reads a JSONL log, calling `each` with every record or unreadable line,
/// in order. Blank lines are skipped. Lines are read one at a time, so a
/// log of any size runs in bounded memory.
pub fn read_jsonl(
    input: impl BufRead,
    mapping: &Mapping,
    mut each: impl FnMut(Result<Record, Unreadable>),
) -> Result<(), AuditError> {
    for (i, line) in input.lines().enumerate() {
        let line_no = i + 1;
        let line = line.map_err(|e| AuditError::Io(format!("line {line_no}: {e}")))?;
        if line.trim().is_empty() {
            continue;
        }
        let rec = match serde_json::from_str::<Value>(&line) {
            Ok(Value::Object(obj)) => {
                let get = |key: &str| -> Option<Raw> {
                    let mut v = obj.get(key).or_else(|| {
                        // `a.b`: nested objects.
                        let mut parts = key.split('.');
                        let mut v = obj.get(parts.next()?)?;
                        for p in parts {
                            v = v.get(p)?;
                        }
                        Some(v)
                    })?;
                    if let Value::Object(_) | Value::Array(_) = v {
                        v = &Value::Null;
                    }
                    match v {
                        Value::Null => None,
                        Value::String(s) => Some(Raw::Text(s.clone())),
                        Value::Number(n) => n.as_f64().map(Raw::Number),
                        Value::Bool(b) => Some(Raw::Text(b.to_string())),
                        _ => None,
                    }
                };
                record(line_no, mapping, get)
            }
            Ok(_) => Err(Unreadable {
                line: line_no,
                why: "not a JSON object".into(),
            }),
            Err(e) => Err(Unreadable {
                line: line_no,
                why: format!("not JSON: {e}"),
            }),
        };
        each(rec);
    }
    Ok(())
}

/// Reads a CSV log with a header row, calling `each` like [`read_jsonl`].
/// A mapped column missing from the header is an error (the mapping does
/// not fit the file), except for our own default names, which are simply
/// absent.
pub fn read_csv(
    input: impl std::io::Read,
    mapping: &Mapping,
    strict_columns: bool,
    mut each: impl FnMut(Result<Record, Unreadable>),
) -> Result<(), AuditError> {
    let mut rdr = csv::ReaderBuilder::new().flexible(true).from_reader(input);
    let header = rdr
        .headers()
        .map_err(|e| AuditError::Io(format!("the CSV header: {e}")))?
        .clone();
    let col = |key: &str| header.iter().position(|h| h.trim() == key);
    if strict_columns {
        // `cached_tokens` is optional: a log without it (any server without
        // a prefix cache) times the whole prompt, as before.
        for f in Field::ALL.into_iter().filter(|&f| f != Field::CachedTokens) {
            if let Some(s) = mapping.source(f) {
                if col(&s.key).is_none() {
                    return Err(AuditError::Mapping {
                        spec: format!("{}={}", f.as_str(), s.key),
                        why: format!(
                            "no column `{}` in the header ({})",
                            s.key,
                            header.iter().collect::<Vec<_>>().join(", ")
                        ),
                    });
                }
            }
        }
    }
    let columns: BTreeMap<String, usize> = header
        .iter()
        .enumerate()
        .map(|(i, h)| (h.trim().to_string(), i))
        .collect();
    for (i, row) in rdr.records().enumerate() {
        // Row 1 is the header.
        let line_no = i + 2;
        let rec = match row {
            Ok(row) => record(line_no, mapping, |key| {
                let v = row.get(*columns.get(key)?)?.trim();
                if v.is_empty() {
                    return None;
                }
                Some(match v.parse::<f64>() {
                    Ok(n) => Raw::Both(v.to_string(), n),
                    Err(_) => Raw::Text(v.to_string()),
                })
            }),
            Err(e) => Err(Unreadable {
                line: line_no,
                why: format!("not CSV: {e}"),
            }),
        };
        each(rec);
    }
    Ok(())
}

/// A value as the log holds it.
enum Raw {
    Text(String),
    Number(f64),
    /// A CSV cell that reads as a number.
    Both(String, f64),
}

impl Raw {
    fn text(&self) -> String {
        match self {
            Raw::Text(s) | Raw::Both(s, _) => s.clone(),
            Raw::Number(n) => {
                if n.fract() == 0.0 && n.abs() < 1e15 {
                    format!("{}", *n as i64)
                } else {
                    n.to_string()
                }
            }
        }
    }

    fn number(&self) -> Option<f64> {
        match self {
            Raw::Number(n) | Raw::Both(_, n) => Some(*n),
            Raw::Text(s) => s.trim().parse().ok(),
        }
    }
}

fn record(
    line: usize,
    mapping: &Mapping,
    get: impl Fn(&str) -> Option<Raw>,
) -> Result<Record, Unreadable> {
    let raw = |f: Field| -> Option<(Raw, f64)> {
        let s = mapping.source(f)?;
        get(&s.key).map(|r| (r, s.factor))
    };
    let bad = |f: Field, why: String| Unreadable {
        line,
        why: format!(
            "`{}`: {why}",
            mapping.source(f).map_or("", |s| s.key.as_str())
        ),
    };
    let number = |f: Field| -> Result<Option<f64>, Unreadable> {
        match raw(f) {
            None => Ok(None),
            Some((r, k)) => match r.number() {
                Some(n) if (n * k).is_finite() && n * k >= 0.0 => Ok(Some(n * k)),
                _ => Err(bad(
                    f,
                    format!("`{}` is not a non-negative number", r.text()),
                )),
            },
        }
    };
    let count =
        |f: Field| -> Result<Option<u64>, Unreadable> { Ok(number(f)?.map(|n| n.round() as u64)) };
    let text = |f: Field| raw(f).map(|(r, _)| r.text());
    let ts_ms = match raw(Field::Ts) {
        None => None,
        Some((r, k)) => Some(match (&r, r.number()) {
            (Raw::Number(_) | Raw::Both(..), Some(n)) => {
                let ms = n * k * 1000.0;
                if !ms.is_finite() {
                    return Err(bad(Field::Ts, "not a time".into()));
                }
                ms.round() as i64
            }
            _ => parse_rfc3339_ms(&r.text())
                .ok_or_else(|| bad(Field::Ts, format!("`{}` is not an RFC 3339 time", r.text())))?,
        }),
    };
    let outcome = match text(Field::Outcome) {
        None => Outcome::Unknown,
        Some(v) => Outcome::parse(&v)
            .ok_or_else(|| bad(Field::Outcome, format!("unknown outcome `{v}`")))?,
    };
    Ok(Record {
        line,
        id: text(Field::Id),
        tenant: text(Field::Tenant),
        ts_ms,
        outcome,
        prompt_tokens: count(Field::PromptTokens)?,
        cached_tokens: count(Field::CachedTokens)?,
        output_tokens: count(Field::OutputTokens)?,
        ttft_ms: number(Field::TtftMs)?,
        kv_capacity_tokens: count(Field::KvCapacityTokens)?,
        context_window_tokens: count(Field::ContextWindowTokens)?,
        prefill_tokens_per_s: number(Field::PrefillTokensPerS)?,
        pages: count(Field::Pages)?,
        error_code: text(Field::ErrorCode),
        kv_event: text(Field::KvEvent),
    })
}

/// RFC 3339 (`2026-12-04T02:08:37.123Z`, or with an offset) to Unix
/// milliseconds.
pub fn parse_rfc3339_ms(s: &str) -> Option<i64> {
    let t = time::OffsetDateTime::parse(s.trim(), &time::format_description::well_known::Rfc3339)
        .ok()?;
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000).ok()
}

/// Unix milliseconds to RFC 3339 UTC (whole seconds).
pub fn format_rfc3339(ms: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp(ms.div_euclid(1000))
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| format!("@{ms}ms"))
}
