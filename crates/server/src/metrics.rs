//! Prometheus metrics (`GET /metrics`, text format 0.0.4).
//!
//! Built on `prometheus-client`, the Prometheus project's own Rust client:
//! typed metric families without a global registry, real histograms (cumulative
//! buckets, `_sum`, `_count`) and an encoder that follows the exposition
//! format (escaping, `# HELP`/`# TYPE`, `_total` suffixes), so none of that is
//! hand-written here. Server-side events (requests, rejections, latencies)
//! are counters and histograms updated as they happen; the engine's and the
//! pool's state is read from `Engine::stats()` at scrape time by a
//! [`Collector`], so the exported values are exactly the engine's.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use request::{EngineStats, MetricKind, MetricSample};

use crate::error::Reason;

/// The content type of the exposition.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

type Labels = Vec<(&'static str, &'static str)>;
/// Per-tenant series: bounded by the tenants file (`tenants::TENANTS_MAX`).
type TenantLabels = Vec<(&'static str, String)>;

/// A tenant's totals of finished requests ([`Metrics::tenant_totals`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TenantTotals {
    pub finished: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

/// Request outcomes (`isoserve_requests_total{outcome}`).
pub const OUTCOMES: [&str; 4] = ["finished", "cancelled", "rejected", "error"];

/// Every metric of the server.
pub struct Metrics {
    registry: Registry,
    requests: Family<Labels, Counter>,
    rejections: Family<Labels, Counter>,
    prompt_tokens: Counter,
    tenant_prompt_tokens: Family<TenantLabels, Counter>,
    tenant_cached_tokens: Family<TenantLabels, Counter>,
    tenant_completion_tokens: Family<TenantLabels, Counter>,
    tenant_finished: Family<TenantLabels, Counter>,
    tenant_queue_seconds: Family<TenantLabels, Counter<f64, AtomicU64>>,
    completion_tokens: Counter,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub queue_time: Histogram,
    pub e2e: Histogram,
    http_inflight: Gauge,
    engine: Arc<EngineCollector>,
    backend: Arc<SamplesCollector>,
}

/// Samples a backend (or a node) reports, encoded through the registry.
#[derive(Debug, Default)]
struct SamplesCollector {
    samples: Mutex<Vec<MetricSample>>,
}

impl Collector for SamplesCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let samples = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        // One family per name, in order of first appearance; its kind and
        // help are its first sample's.
        let mut names: Vec<&str> = Vec::new();
        for s in samples.iter() {
            if !names.contains(&s.name.as_str()) {
                names.push(&s.name);
            }
        }
        for name in names {
            let group: Vec<&MetricSample> = samples.iter().filter(|s| s.name == name).collect();
            let first = group[0];
            let (ty, base) = match first.kind {
                // The encoder appends `_total` to a counter's name.
                MetricKind::Counter => (
                    MetricType::Counter,
                    name.strip_suffix("_total").unwrap_or(name),
                ),
                MetricKind::Gauge => (MetricType::Gauge, name),
            };
            let mut m = enc.encode_descriptor(base, &first.help, None, ty)?;
            if group.len() == 1 && first.labels.is_empty() {
                encode_value(first, m)?;
                continue;
            }
            for s in group {
                encode_value(s, m.encode_family(&s.labels)?)?;
            }
        }
        Ok(())
    }
}

/// Encodes one sample's value as its metric kind.
fn encode_value(
    s: &MetricSample,
    m: prometheus_client::encoding::MetricEncoder,
) -> Result<(), std::fmt::Error> {
    match s.kind {
        MetricKind::Counter => ConstCounter::new(s.value).encode(m),
        MetricKind::Gauge => ConstGauge::new(s.value).encode(m),
    }
}

/// Prometheus text of `samples` alone (a PD node's `/metrics`).
pub fn encode_samples(samples: Vec<MetricSample>) -> String {
    let mut registry = Registry::default();
    let c = Arc::new(SamplesCollector {
        samples: Mutex::new(samples),
    });
    registry.register_collector(Box::new(c));
    let mut out = String::with_capacity(4096);
    if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry) {
        tracing::error!("cannot encode metrics: {e}");
    }
    out
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// The engine's state, refreshed before each scrape.
#[derive(Debug, Default)]
struct EngineCollector {
    stats: Mutex<EngineStats>,
}

fn const_counter(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: u64,
) -> Result<(), std::fmt::Error> {
    let c = ConstCounter::new(v);
    let m = enc.encode_descriptor(name, help, None, c.metric_type())?;
    c.encode(m)
}

fn const_gauge(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: u64,
) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(v as i64);
    let m = enc.encode_descriptor(name, help, None, g.metric_type())?;
    g.encode(m)
}

impl Collector for EngineCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let p = &s.pool;
        // A backend without a pool of its own (the PD gateway: its nodes'
        // pools come as `isoserve_node_*` samples) exports none, rather
        // than a pool of 0 pages that trips "no free pages" alerts.
        if p.pages_total > 0 {
            const_gauge(
                &mut enc,
                "isoserve_kv_pages_total",
                "Pages in the KV pool",
                p.pages_total,
            )?;
            {
                let mut m = enc.encode_descriptor(
                    "isoserve_kv_pages",
                    "KV pages by state. free: no request or transfer holds it — on the free list, or cached and idle (evictable, taken back on demand, as vLLM counts its cached free blocks); owned: held (= total − free), leased and release-pending ones included; cached: in the prefix cache, held or idle; evictable: cached and idle",
                    None,
                    MetricType::Gauge,
                )?;
                for (state, v) in [
                    ("free", p.pages_unheld()),
                    ("owned", p.pages_total - p.pages_unheld()),
                    ("leased", p.pages_leased),
                    ("release_pending", p.pages_release_pending),
                    ("cached", p.pages_cached),
                    ("evictable", p.pages_evictable),
                ] {
                    let labels = [("state", state)];
                    ConstGauge::new(v as i64).encode(m.encode_family(&labels)?)?;
                }
            }
            {
                // What the Gateway API Inference Extension's endpoint picker
                // reads as KV usage (`--kv-cache-usage-percentage-metric`;
                // vLLM's is `vllm:kv_cache_usage_perc`): held pages over all,
                // 0 to 1, idle cached pages counted free as above.
                let used = (p.pages_total - p.pages_unheld()) as f64 / p.pages_total as f64;
                let g = ConstGauge::new(used);
                let m = enc.encode_descriptor(
                    "isoserve_kv_usage_ratio",
                    "Fraction of KV pages held by requests or transfers (0 to 1)",
                    None,
                    g.metric_type(),
                )?;
                g.encode(m)?;
            }
            {
                let mut m = enc.encode_descriptor(
                    "isoserve_kv_refusals",
                    "KV pool refusals by kind (every one but out_of_pages is a safety check firing)",
                    None,
                    MetricType::Counter,
                )?;
                for (kind, v) in p.refusals() {
                    let labels = [("kind", kind)];
                    ConstCounter::new(v).encode(m.encode_family(&labels)?)?;
                }
            }
            const_counter(
                &mut enc,
                "isoserve_kv_safety_refusals",
                "Sum of every KV safety refusal (must stay 0)",
                p.safety_refusals(),
            )?;
            const_counter(
                &mut enc,
                "isoserve_kv_allocs",
                "KV page allocations",
                p.allocs,
            )?;
            const_counter(&mut enc, "isoserve_kv_frees", "KV page frees", p.frees)?;
            const_counter(
                &mut enc,
                "isoserve_kv_frees_deferred",
                "KV page frees deferred by a lease",
                p.frees_deferred,
            )?;
            const_counter(
                &mut enc,
                "isoserve_prefix_cache_publishes",
                "KV pages entered into the prefix cache",
                p.cache_publishes,
            )?;
            const_counter(
                &mut enc,
                "isoserve_prefix_cache_evictions",
                "Idle cached KV pages evicted for an allocation",
                p.cache_evictions,
            )?;
        }
        const_gauge(
            &mut enc,
            "isoserve_requests_running",
            "Requests running in the engine",
            s.running as u64,
        )?;
        const_gauge(
            &mut enc,
            "isoserve_requests_waiting",
            "Requests waiting for admission in the engine",
            s.waiting as u64,
        )?;
        const_gauge(
            &mut enc,
            "isoserve_requests_preempted",
            "Requests preempted for another tenant's fair share, waiting to resume (K13)",
            s.preempted as u64,
        )?;
        const_counter(
            &mut enc,
            "isoserve_requests_preemptions",
            "Running requests preempted (pages given back, recomputed on resuming) to make room \
             for a tenant under its fair share or a better priority of the same tenant",
            s.requests_preempted_total,
        )?;
        const_counter(
            &mut enc,
            "isoserve_prompt_tokens",
            "Prompt tokens admitted by the engine",
            s.prompt_tokens_total,
        )?;
        const_counter(
            &mut enc,
            "isoserve_generation_tokens",
            "Tokens generated by the engine",
            s.generated_tokens_total,
        )?;
        const_counter(
            &mut enc,
            "isoserve_engine_steps",
            "Forward steps run by the engine",
            s.steps_total,
        )?;
        {
            let mut m = enc.encode_descriptor(
                "isoserve_engine_requests",
                "Requests ended by the engine, by how",
                None,
                MetricType::Counter,
            )?;
            for (how, v) in [
                ("finished", s.requests_finished_total),
                ("cancelled", s.requests_cancelled_total),
                ("failed", s.requests_failed_total),
                ("refused", s.requests_refused_total),
            ] {
                let labels = [("how", how)];
                ConstCounter::new(v).encode(m.encode_family(&labels)?)?;
            }
        }
        const_counter(
            &mut enc,
            "isoserve_prefix_cache_queries",
            "Requests that looked up the prefix cache",
            s.prefix_cache_queries_total,
        )?;
        const_counter(
            &mut enc,
            "isoserve_prefix_cache_query_tokens",
            "Prompt tokens of requests that looked up the prefix cache",
            s.prefix_cache_query_tokens_total,
        )?;
        const_counter(
            &mut enc,
            "isoserve_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            s.prefix_cache_hit_tokens_total,
        )?;
        const_counter(
            &mut enc,
            "isoserve_prefix_cache_hit_pages",
            "KV pages served from the prefix cache",
            s.prefix_cache_hit_pages_total,
        )?;
        Ok(())
    }
}

/// Latency buckets from 1 ms to ~65 s (doubling).
fn latency_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, 17)
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let requests = Family::<Labels, Counter>::default();
        let rejections = Family::<Labels, Counter>::default();
        // Pre-create every series so a dashboard (and a test) sees zeros.
        for o in OUTCOMES {
            let _ = requests.get_or_create(&vec![("outcome", o)]);
        }
        for r in Reason::ALL {
            let _ = rejections.get_or_create(&vec![("reason", r.as_str())]);
        }
        registry.register(
            "isoserve_requests",
            "Generation requests by outcome (finished, cancelled, rejected, error)",
            requests.clone(),
        );
        registry.register(
            "isoserve_rejections",
            "Requests refused before generation, by reason",
            rejections.clone(),
        );
        let prompt_tokens = Counter::default();
        let completion_tokens = Counter::default();
        registry.register(
            "isoserve_http_prompt_tokens",
            "Prompt tokens of requests answered by the HTTP layer",
            prompt_tokens.clone(),
        );
        registry.register(
            "isoserve_http_completion_tokens",
            "Completion tokens of requests answered by the HTTP layer",
            completion_tokens.clone(),
        );
        let tenant_prompt_tokens = Family::<TenantLabels, Counter>::default();
        let tenant_cached_tokens = Family::<TenantLabels, Counter>::default();
        registry.register(
            "isoserve_tenant_prompt_tokens",
            "Prompt tokens of finished requests, per tenant",
            tenant_prompt_tokens.clone(),
        );
        registry.register(
            "isoserve_tenant_prompt_tokens_cached",
            "Prompt tokens served from the tenant's prefix cache scope, per tenant",
            tenant_cached_tokens.clone(),
        );
        let tenant_completion_tokens = Family::<TenantLabels, Counter>::default();
        let tenant_finished = Family::<TenantLabels, Counter>::default();
        let tenant_queue_seconds = Family::<TenantLabels, Counter<f64, AtomicU64>>::default();
        registry.register(
            "isoserve_tenant_completion_tokens",
            "Tokens generated for finished requests, per tenant (its share of the engine, with \
             its prompt tokens)",
            tenant_completion_tokens.clone(),
        );
        registry.register(
            "isoserve_tenant_requests_finished",
            "Requests finished, per tenant",
            tenant_finished.clone(),
        );
        registry.register(
            "isoserve_tenant_queue_seconds",
            "Time finished requests waited for admission, summed per tenant (divide by \
             isoserve_tenant_requests_finished_total for the mean)",
            tenant_queue_seconds.clone(),
        );
        let ttft = Histogram::new(latency_buckets());
        let inter_token = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        let queue_time = Histogram::new(latency_buckets());
        let e2e = Histogram::new(latency_buckets());
        registry.register(
            "isoserve_time_to_first_token_seconds",
            "Time from the request's arrival to its first generated token",
            ttft.clone(),
        );
        registry.register(
            "isoserve_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            inter_token.clone(),
        );
        registry.register(
            "isoserve_queue_time_seconds",
            "Time a request waited in the engine's queue before admission",
            queue_time.clone(),
        );
        registry.register(
            "isoserve_request_duration_seconds",
            "Time from the request's arrival to its end (finished requests)",
            e2e.clone(),
        );
        let http_inflight = Gauge::default();
        registry.register(
            "isoserve_http_inflight_requests",
            "Generation requests admitted by the HTTP layer and not yet ended",
            http_inflight.clone(),
        );
        let engine = Arc::new(EngineCollector::default());
        registry.register_collector(Box::new(engine.clone()));
        let backend = Arc::new(SamplesCollector::default());
        registry.register_collector(Box::new(backend.clone()));
        Metrics {
            registry,
            requests,
            rejections,
            prompt_tokens,
            tenant_prompt_tokens,
            tenant_cached_tokens,
            tenant_completion_tokens,
            tenant_finished,
            tenant_queue_seconds,
            completion_tokens,
            ttft,
            inter_token,
            queue_time,
            e2e,
            http_inflight,
            engine,
            backend,
        }
    }

    pub fn request(&self, outcome: &'static str) {
        self.requests
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    pub fn rejection(&self, reason: Reason) {
        self.rejections
            .get_or_create(&vec![("reason", reason.as_str())])
            .inc();
    }

    pub fn tokens(&self, prompt: usize, completion: usize) {
        self.prompt_tokens.inc_by(prompt as u64);
        self.completion_tokens.inc_by(completion as u64);
    }

    /// A finished request under its tenant's name: prompt tokens (and how
    /// many came from the prefix cache), generated tokens, queue time.
    pub fn tenant_finished(&self, tenant: &str, usage: &request::Usage, queue_s: f64) {
        let labels = vec![("tenant", tenant.to_string())];
        self.tenant_completion_tokens
            .get_or_create(&labels)
            .inc_by(usage.completion_tokens as u64);
        self.tenant_finished.get_or_create(&labels).inc();
        self.tenant_queue_seconds
            .get_or_create(&labels)
            .inc_by(queue_s.max(0.0));
        let (prompt, cached) = (usage.prompt_tokens, usage.cached_tokens);
        self.tenant_prompt_tokens
            .get_or_create(&labels)
            .inc_by(prompt as u64);
        self.tenant_cached_tokens
            .get_or_create(&labels)
            .inc_by(cached as u64);
    }

    /// A tenant's finished requests and their prompt and cached tokens so
    /// far (what `tenant_finished` counted; zeros before the first), for
    /// the operator console.
    pub fn tenant_totals(&self, tenant: &str) -> TenantTotals {
        let labels = vec![("tenant", tenant.to_string())];
        let get = |f: &Family<TenantLabels, Counter>| f.get(&labels).map_or(0, |c| c.get());
        TenantTotals {
            finished: get(&self.tenant_finished),
            prompt_tokens: get(&self.tenant_prompt_tokens),
            cached_tokens: get(&self.tenant_cached_tokens),
        }
    }

    pub fn set_inflight(&self, n: usize) {
        self.http_inflight.set(n as i64);
    }

    /// The exposition, with the engine's state as of `stats` and the
    /// backend's own samples.
    pub fn render(&self, stats: EngineStats, backend: Vec<MetricSample>) -> String {
        *self.engine.stats.lock().unwrap_or_else(|e| e.into_inner()) = stats;
        *self
            .backend
            .samples
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = backend;
        let mut out = String::with_capacity(8192);
        if let Err(e) =
            prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
        {
            tracing::error!("cannot encode metrics: {e}");
        }
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of the series `name` (exact text before the value).
    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn exposition_has_every_family_and_real_histograms() {
        let m = Metrics::new();
        m.rejection(Reason::QueueFull);
        m.rejection(Reason::QueueFull);
        m.request("finished");
        m.ttft.observe(0.003);
        m.ttft.observe(10.0);
        let mut s = EngineStats::default();
        s.pool.pages_total = 64;
        s.pool.pages_free = 58;
        s.pool.pages_evictable = 2;
        s.pool.pages_cached = 3;
        s.pool.pages_owned = 6;
        s.pool.refused_stale_handle = 3;
        s.running = 2;
        let text = m.render(s, Vec::new());
        assert_eq!(
            value(&text, "isoserve_rejections_total{reason=\"queue_full\"}"),
            Some(2.0)
        );
        assert_eq!(
            value(&text, "isoserve_rejections_total{reason=\"unauthorized\"}"),
            Some(0.0)
        );
        assert_eq!(
            value(&text, "isoserve_requests_total{outcome=\"finished\"}"),
            Some(1.0)
        );
        assert_eq!(value(&text, "isoserve_kv_pages_total"), Some(64.0));
        // Idle cached pages count as free (they are taken back on demand).
        assert_eq!(
            value(&text, "isoserve_kv_pages{state=\"free\"}"),
            Some(60.0)
        );
        assert_eq!(
            value(&text, "isoserve_kv_pages{state=\"owned\"}"),
            Some(4.0)
        );
        assert_eq!(
            value(&text, "isoserve_kv_pages{state=\"evictable\"}"),
            Some(2.0)
        );
        assert_eq!(
            value(&text, "isoserve_kv_pages{state=\"owned\"}"),
            Some(4.0)
        );
        assert_eq!(
            value(&text, "isoserve_kv_refusals_total{kind=\"stale_handle\"}"),
            Some(3.0)
        );
        assert_eq!(value(&text, "isoserve_kv_safety_refusals_total"), Some(3.0));
        assert_eq!(value(&text, "isoserve_requests_running"), Some(2.0));
        // Histogram: cumulative buckets, +Inf, sum and count.
        assert_eq!(
            value(
                &text,
                "isoserve_time_to_first_token_seconds_bucket{le=\"0.004\"}"
            ),
            Some(1.0)
        );
        assert_eq!(
            value(
                &text,
                "isoserve_time_to_first_token_seconds_bucket{le=\"+Inf\"}"
            ),
            Some(2.0)
        );
        assert_eq!(
            value(&text, "isoserve_time_to_first_token_seconds_count"),
            Some(2.0)
        );
        let sum = value(&text, "isoserve_time_to_first_token_seconds_sum").expect("sum");
        assert!((sum - 10.003).abs() < 1e-9);
        assert!(text.contains("# TYPE isoserve_inter_token_latency_seconds histogram"));
        assert!(text.contains("# TYPE isoserve_queue_time_seconds histogram"));
    }

    /// A backend's samples go through the same encoder: counters get one
    /// `_total`, labelled samples of one name are one family, and a value
    /// is encoded as its kind.
    #[test]
    fn backend_samples_are_encoded_as_families() {
        let samples = vec![
            MetricSample::counter("isoserve_gateway_requests_total", "Requests", 5.0),
            MetricSample::gauge("isoserve_gateway_node_up", "Up", 1.0).label("node", "a:1"),
            MetricSample::gauge("isoserve_gateway_node_up", "Up", 0.0).label("node", "b:2"),
            MetricSample::counter("isoserve_node_transfer_seconds_total", "Seconds", 1.5)
                .label("node", "decode-0"),
        ];
        let text = encode_samples(samples);
        assert_eq!(value(&text, "isoserve_gateway_requests_total"), Some(5.0));
        assert_eq!(
            value(&text, "isoserve_gateway_node_up{node=\"a:1\"}"),
            Some(1.0)
        );
        assert_eq!(
            value(&text, "isoserve_gateway_node_up{node=\"b:2\"}"),
            Some(0.0)
        );
        assert_eq!(
            value(
                &text,
                "isoserve_node_transfer_seconds_total{node=\"decode-0\"}"
            ),
            Some(1.5)
        );
        assert_eq!(
            text.matches("# TYPE isoserve_gateway_node_up gauge")
                .count(),
            1
        );
        assert!(
            text.contains("# TYPE isoserve_gateway_requests_total counter"),
            "{text}"
        );
        assert!(!text.contains("_total_total"), "{text}");
    }
}
