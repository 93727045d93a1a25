//! Per-request accounting: metrics and the request log, written once
//! whatever way a generation request ends ([`Tracker`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use request::DoneEvent;

use crate::error::ApiError;
use crate::reqlog::{rfc3339, LogRecord};
use crate::state::AppState;

/// Accounts for one generation request: metrics and the request log, once,
/// whatever way it ends. Dropped without an explicit end (the client went
/// away) it records `cancelled`.
pub(crate) struct Tracker {
    st: Arc<AppState>,
    pub rec: LogRecord,
    start: Instant,
    first_token: Option<Instant>,
    /// Each choice's last token (inter-token gaps are per choice).
    last_token: Vec<Option<Instant>>,
    done: bool,
    /// The engine's count of pages allocated to each choice, once admitted.
    pub pages: Vec<Arc<std::sync::atomic::AtomicU64>>,
    /// The tenant, once authenticated (its console counters).
    pub tenant: Option<Arc<crate::tenants::Tenant>>,
}

impl Tracker {
    pub fn new(st: &Arc<AppState>, endpoint: &'static str, id: &str) -> Tracker {
        Tracker {
            st: st.clone(),
            rec: LogRecord {
                id: id.to_string(),
                endpoint,
                ..LogRecord::default()
            },
            start: Instant::now(),
            first_token: None,
            last_token: Vec::new(),
            done: false,
            pages: Vec::new(),
            tenant: None,
        }
    }

    /// A token of choice `choice` (0 when `n` is 1).
    pub fn token(&mut self, choice: usize) {
        let now = Instant::now();
        if self.first_token.is_none() {
            self.first_token = Some(now);
            self.st
                .metrics
                .ttft
                .observe((now - self.start).as_secs_f64());
        }
        if self.last_token.len() <= choice {
            self.last_token.resize(choice + 1, None);
        }
        if let Some(prev) = self.last_token[choice] {
            self.st
                .metrics
                .inter_token
                .observe((now - prev).as_secs_f64());
        }
        self.last_token[choice] = Some(now);
        self.rec.output_tokens += 1;
        if let Some(t) = &self.tenant {
            t.activity.tokens_generated.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn write(&mut self, outcome: &'static str) {
        // Milliseconds with microsecond resolution.
        let ms = |d: Duration| (d.as_secs_f64() * 1e6).round() / 1e3;
        // One record per request, whatever way it ends.
        assert!(!self.done, "request {} recorded twice", self.rec.id);
        self.done = true;
        self.rec.outcome = outcome;
        self.rec.total_ms = ms(self.start.elapsed());
        self.rec.ttft_ms = self.first_token.map(|t| ms(t - self.start));
        self.rec.queue_ms = self.rec.queue_ms.map(|q| (q * 1e3).round() / 1e3);
        self.rec.ts = rfc3339(SystemTime::now());
        if self.rec.pages.is_none() {
            // Refused before admission: nothing was allocated.
            self.rec.pages = self.pages.iter().try_fold(0usize, |sum, cell| {
                match cell.load(std::sync::atomic::Ordering::Acquire) {
                    request::PAGES_UNKNOWN => None,
                    n => Some(sum + n as usize),
                }
            });
        }
        self.rec.kv_capacity_tokens = self.st.engine.kv_capacity_tokens();
        self.rec.context_window_tokens = self.st.max_request();
        let rate = self.st.engine.stats().prefill_tokens_per_s;
        self.rec.prefill_tokens_per_s = (rate > 0.0).then(|| rate.round());
        self.st.metrics.request(outcome);
        if let Some(log) = &self.st.reqlog {
            log.write(&self.rec);
        }
    }

    pub fn reject(&mut self, e: &ApiError) {
        self.st.metrics.rejection(e.reason);
        if let Some(t) = &self.tenant {
            t.activity.refused.fetch_add(1, Ordering::Relaxed);
        }
        self.rec.error_kind = Some(e.reason.as_str());
        self.rec.error_code = e.code;
        self.write("rejected");
    }

    pub fn failed(&mut self, e: &ApiError) {
        self.rec.error_kind = Some(e.reason.as_str());
        self.rec.error_code = e.code;
        self.write("error");
    }

    pub fn finished(&mut self, d: &DoneEvent) {
        let m = &self.st.metrics;
        m.queue_time.observe(d.queue_ms / 1e3);
        m.e2e.observe(self.start.elapsed().as_secs_f64());
        m.tokens(d.usage.prompt_tokens, d.usage.completion_tokens);
        if let Some(t) = &self.rec.tenant {
            m.tenant_finished(t, &d.usage, d.queue_ms / 1e3);
        }
        self.rec.cached_tokens = d.usage.cached_tokens;
        // The prompt as the client sent it (tokenised here), not as the
        // backend says it ran it: the two differ only on a server that cut
        // the prompt, which is what the log must show.
        if self.rec.prompt_tokens == 0 {
            self.rec.prompt_tokens = d.usage.prompt_tokens;
        }
        self.rec.output_tokens = d.usage.completion_tokens;
        self.rec.queue_ms = Some(d.queue_ms);
        self.rec.pages = Some(d.pages);
        self.rec.finish_reason = Some(d.finish.as_openai());
        self.write("finished");
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        if !self.done {
            self.write("cancelled");
        }
    }
}
