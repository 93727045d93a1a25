//! The request log: one JSON line per generation request (finished,
//! cancelled, rejected or failed). Prompt text only with `--log-prompts`.

use std::fs::{File, OpenOptions};
use std::io::{LineWriter, Write};
use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::error::ServerError;

/// One line of the log.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LogRecord {
    pub id: String,
    pub endpoint: &'static str,
    /// The tenant's name (`null` when the request was refused before
    /// authentication succeeded).
    pub tenant: Option<String>,
    /// Engine sequences the request ran: its prompts × `n` (0 when it was
    /// refused before admission). Token counts and pages are their sums.
    pub sequences: usize,
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache (K11).
    pub cached_tokens: usize,
    pub output_tokens: usize,
    pub queue_ms: Option<f64>,
    pub ttft_ms: Option<f64>,
    pub total_ms: f64,
    /// KV pages allocated to the request when it ended: for a refused or
    /// failed one, what it held at the refusal (0: refused before any
    /// allocation; `null`: the backend cannot tell).
    pub pages: Option<usize>,
    /// `finished`, `cancelled`, `rejected` or `error`.
    pub outcome: &'static str,
    pub finish_reason: Option<&'static str>,
    pub error_kind: Option<&'static str>,
    /// OpenAI's `error.code` of the answer (e.g. `checksum_mismatch`).
    pub error_code: Option<&'static str>,
    /// The KV pool's capacity in tokens at the time (`null` for a PD
    /// gateway, which has no pool of its own).
    pub kv_capacity_tokens: Option<usize>,
    /// The largest request (prompt + completion) accepted at the time.
    pub context_window_tokens: usize,
    /// The engine's measured prefill rate at the time (`null` before any
    /// large step ran, and on a PD gateway).
    pub prefill_tokens_per_s: Option<f64>,
    /// RFC 3339 UTC time of the request's end.
    pub ts: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
}

/// An append-only JSONL file.
#[derive(Debug)]
pub struct RequestLog {
    file: Mutex<LineWriter<File>>,
}

impl RequestLog {
    pub fn open(path: &Path) -> Result<RequestLog, ServerError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| ServerError::RequestLog {
                path: path.display().to_string(),
                source,
            })?;
        Ok(RequestLog {
            file: Mutex::new(LineWriter::new(file)),
        })
    }

    /// Appends one record (errors are logged, never fatal to the request).
    pub fn write(&self, rec: &LogRecord) {
        let mut line = match serde_json::to_vec(rec) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("cannot encode a request log record: {e}");
                return;
            }
        };
        line.push(b'\n');
        let mut f = self.file.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = f.write_all(&line) {
            tracing::error!("cannot write the request log: {e}");
        }
    }
}

/// `SystemTime` as RFC 3339 UTC with milliseconds.
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let ms = d.subsec_millis();
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (h, m, s) = (rem / 3600, (rem % 3600) / 60, rem % 60);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{ms:03}Z")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn rfc3339_of_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(1_709_210_096_789);
        assert_eq!(rfc3339(t), "2024-02-29T12:34:56.789Z");
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(t), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn records_are_one_json_line_each_without_prompt_by_default() {
        let dir = std::env::temp_dir().join(format!("isoserve-reqlog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("r.jsonl");
        let _ = std::fs::remove_file(&path);
        let log = RequestLog::open(&path).expect("open");
        let rec = LogRecord {
            id: "chatcmpl-1".into(),
            endpoint: "chat",
            tenant: Some("a".into()),
            prompt_tokens: 5,
            output_tokens: 2,
            outcome: "finished",
            finish_reason: Some("stop"),
            ts: rfc3339(SystemTime::now()),
            ..LogRecord::default()
        };
        log.write(&rec);
        log.write(&LogRecord {
            outcome: "rejected",
            error_kind: Some("unauthorized"),
            prompt: Some("secret".into()),
            ..rec.clone()
        });
        let text = std::fs::read_to_string(&path).expect("read");
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("json line"))
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["outcome"], "finished");
        assert!(lines[0].get("prompt").is_none());
        assert_eq!(lines[1]["error_kind"], "unauthorized");
        assert_eq!(lines[1]["prompt"], "secret");
        for key in [
            "id",
            "tenant",
            "prompt_tokens",
            "output_tokens",
            "queue_ms",
            "ttft_ms",
            "total_ms",
            "pages",
            "outcome",
            "finish_reason",
            "error_kind",
            "ts",
        ] {
            assert!(lines[0].get(key).is_some(), "{key}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
