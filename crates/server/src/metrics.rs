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
use prometheus_client::metrics::family::Family as Series;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use request::{EngineStats, MetricSample};
use telemetry::metrics::Family;

use crate::error::Reason;

/// The content type of the exposition.
pub use telemetry::metrics::CONTENT_TYPE;

type Labels = Vec<(&'static str, &'static str)>;
/// Per-tenant series: bounded by the tenants file (`tenants::TENANTS_MAX`).
type TenantLabels = Vec<(&'static str, String)>;

// ---- the families, declared once ------------------------------------------

const F_REQUESTS: Family = Family::counter(
    "isoserve_requests_total",
    "Generation requests by outcome (finished, cancelled, rejected, error)",
)
.with_labels(&["outcome"]);
const F_REJECTIONS: Family = Family::counter(
    "isoserve_rejections_total",
    "Requests refused before generation, by reason",
)
.with_labels(&["reason"]);
const F_HTTP_PROMPT_TOKENS: Family = Family::counter(
    "isoserve_http_prompt_tokens_total",
    "Prompt tokens of requests answered by the HTTP layer",
);
const F_HTTP_COMPLETION_TOKENS: Family = Family::counter(
    "isoserve_http_completion_tokens_total",
    "Completion tokens of requests answered by the HTTP layer",
);
const F_TENANT_PROMPT_TOKENS: Family = Family::counter(
    "isoserve_tenant_prompt_tokens_total",
    "Prompt tokens of finished requests, per tenant",
)
.with_labels(&["tenant"]);
const F_TENANT_PROMPT_TOKENS_CACHED: Family = Family::counter(
    "isoserve_tenant_prompt_tokens_cached_total",
    "Prompt tokens served from the tenant's prefix cache scope, per tenant",
)
.with_labels(&["tenant"]);
const F_TENANT_COMPLETION_TOKENS: Family = Family::counter(
    "isoserve_tenant_completion_tokens_total",
    "Tokens generated for finished requests, per tenant (its share of the engine, with \
             its prompt tokens)",
)
.with_labels(&["tenant"]);
const F_TENANT_REQUESTS_FINISHED: Family = Family::counter(
    "isoserve_tenant_requests_finished_total",
    "Requests finished, per tenant",
)
.with_labels(&["tenant"]);
const F_TENANT_QUEUE_SECONDS: Family = Family::counter(
    "isoserve_tenant_queue_seconds_total",
    "Time finished requests waited for admission, summed per tenant (divide by \
             isoserve_tenant_requests_finished_total for the mean)",
)
.with_labels(&["tenant"]);
const F_TIME_TO_FIRST_TOKEN_SECONDS: Family = Family::histogram(
    "isoserve_time_to_first_token_seconds",
    "Time from the request's arrival to its first generated token",
);
const F_INTER_TOKEN_LATENCY_SECONDS: Family = Family::histogram(
    "isoserve_inter_token_latency_seconds",
    "Time between consecutive generated tokens of a request",
);
const F_QUEUE_TIME_SECONDS: Family = Family::histogram(
    "isoserve_queue_time_seconds",
    "Time a request waited in the engine's queue before admission",
);
const F_REQUEST_DURATION_SECONDS: Family = Family::histogram(
    "isoserve_request_duration_seconds",
    "Time from the request's arrival to its end (finished requests)",
);
const F_HTTP_INFLIGHT_REQUESTS: Family = Family::gauge(
    "isoserve_http_inflight_requests",
    "Generation requests admitted by the HTTP layer and not yet ended",
);
const F_KV_PAGES_TOTAL: Family = Family::gauge("isoserve_kv_pages_total", "Pages in the KV pool");
const F_KV_SAFETY_REFUSALS: Family = Family::counter(
    "isoserve_kv_safety_refusals_total",
    "Sum of every KV safety refusal (must stay 0)",
);
const F_KV_ALLOCS: Family = Family::counter("isoserve_kv_allocs_total", "KV page allocations");
const F_KV_FREES: Family = Family::counter("isoserve_kv_frees_total", "KV page frees");
const F_KV_FREES_DEFERRED: Family = Family::counter(
    "isoserve_kv_frees_deferred_total",
    "KV page frees deferred by a lease",
);
const F_PREFIX_CACHE_PUBLISHES: Family = Family::counter(
    "isoserve_prefix_cache_publishes_total",
    "KV pages entered into the prefix cache",
);
const F_PREFIX_CACHE_EVICTIONS: Family = Family::counter(
    "isoserve_prefix_cache_evictions_total",
    "Idle cached KV pages evicted for an allocation",
);
const F_REQUESTS_RUNNING: Family = Family::gauge(
    "isoserve_requests_running",
    "Requests running in the engine",
);
const F_REQUESTS_WAITING: Family = Family::gauge(
    "isoserve_requests_waiting",
    "Requests waiting for admission in the engine",
);
const F_REQUESTS_PREEMPTED: Family = Family::gauge(
    "isoserve_requests_preempted",
    "Requests preempted for another tenant's fair share, waiting to resume (K13)",
);
const F_REQUESTS_PREEMPTIONS: Family = Family::counter(
    "isoserve_requests_preemptions_total",
    "Running requests preempted (pages given back, recomputed on resuming) to make room \
             for a tenant under its fair share or a better priority of the same tenant",
);
const F_PROMPT_TOKENS: Family = Family::counter(
    "isoserve_prompt_tokens_total",
    "Prompt tokens admitted by the engine",
);
const F_GENERATION_TOKENS: Family = Family::counter(
    "isoserve_generation_tokens_total",
    "Tokens generated by the engine",
);
const F_ENGINE_STEPS: Family = Family::counter(
    "isoserve_engine_steps_total",
    "Forward steps run by the engine",
);
const F_PREFIX_CACHE_QUERIES: Family = Family::counter(
    "isoserve_prefix_cache_queries_total",
    "Requests that looked up the prefix cache",
);
const F_PREFIX_CACHE_QUERY_TOKENS: Family = Family::counter(
    "isoserve_prefix_cache_query_tokens_total",
    "Prompt tokens of requests that looked up the prefix cache",
);
const F_PREFIX_CACHE_HIT_TOKENS: Family = Family::counter(
    "isoserve_prefix_cache_hit_tokens_total",
    "Prompt tokens served from the prefix cache",
);
const F_PREFIX_CACHE_HIT_PAGES: Family = Family::counter(
    "isoserve_prefix_cache_hit_pages_total",
    "KV pages served from the prefix cache",
);
const F_KV_PAGES: Family = Family::gauge(
    "isoserve_kv_pages",
    "KV pages by state. free: no request or transfer holds it — on the free list, or cached and idle (evictable, taken back on demand, as vLLM counts its cached free blocks); owned: held (= total − free), leased and release-pending ones included; cached: in the prefix cache, held or idle; evictable: cached and idle",
)
.with_labels(&["state"]);
const F_KV_REFUSALS: Family = Family::counter(
    "isoserve_kv_refusals_total",
    "KV pool refusals by kind (every one but out_of_pages is a safety check firing)",
)
.with_labels(&["kind"]);
const F_ENGINE_REQUESTS: Family = Family::counter(
    "isoserve_engine_requests_total",
    "Requests ended by the engine, by how",
)
.with_labels(&["how"]);
const F_KV_USAGE_RATIO: Family = Family::gauge(
    "isoserve_kv_usage_ratio",
    "Fraction of KV pages held by requests or transfers (0 to 1)",
);

const F_GRAMMAR_MASK_SECONDS: Family = Family::histogram(
    "isoserve_grammar_mask_seconds",
    "Time to compute one sequence's grammar mask for one step (structured outputs; beside \
     the forward pass)",
);
const F_GRAMMAR_COMPILE_SECONDS: Family = Family::histogram(
    "isoserve_grammar_compile_seconds",
    "Time to compile a grammar cold (a cache miss in the request's scope)",
);
const F_GRAMMAR_CACHE_LOOKUPS: Family = Family::counter(
    "isoserve_grammar_cache_lookups_total",
    "Compiled-grammar cache lookups in the request's cache scope (K11), by result",
)
.with_labels(&["result"]);
const F_GRAMMAR_DEFERRED: Family = Family::counter(
    "isoserve_grammar_deferred_samples_total",
    "Constrained tokens sampled a step late because their grammar mask was not ready when \
     the forward pass ended (the step did not wait for them)",
);
const F_SPEC_DRAFTS: Family = Family::counter(
    "isoserve_spec_decode_num_drafts_total",
    "Speculative decoding: verification steps that carried a request's draft (vLLM's \
     spec_decode_num_drafts)",
);
const F_SPEC_DRAFT_TOKENS: Family = Family::counter(
    "isoserve_spec_decode_num_draft_tokens_total",
    "Draft tokens verified (from predictions and prompt lookup)",
);
const F_SPEC_ACCEPTED_TOKENS: Family = Family::counter(
    "isoserve_spec_decode_num_accepted_tokens_total",
    "Draft tokens the model's own sampling kept (each saved a forward step)",
);
const F_SPEC_SUFFIX_SCOPES: Family = Family::gauge(
    "isoserve_spec_suffix_cache_scopes",
    "Cache scopes the suffix cache holds earlier requests' text for (each only ever drafts \
     its own scope's requests)",
);
const F_SPEC_SUFFIX_TOKENS: Family = Family::gauge(
    "isoserve_spec_suffix_cache_tokens",
    "Tokens the suffix cache holds, over every scope",
);
const F_SPEC_ROW_COST: Family = Family::gauge(
    "isoserve_spec_row_cost_ratio",
    "One more row's cost as a share of a one-row step, fitted from recent decode steps: what \
     speculation weighs each draft against",
);
const F_SPEC_DRAFT_PASSES: Family = Family::counter(
    "isoserve_spec_draft_model_passes_total",
    "Forward passes of the draft model (--draft-model): its drafts, and its catching up with \
     what requests kept",
);
const F_SPEC_DRAFT_POOL_FULL: Family = Family::counter(
    "isoserve_spec_draft_pool_full_total",
    "Requests that decoded without the draft model because its pool had no room for them",
);
const F_SPEC_DRAFT_POOL_PAGES: Family = Family::gauge(
    "isoserve_spec_draft_pool_pages",
    "The draft model's KV pool (its own shape, the same checks), by state; only with \
     --draft-model",
)
.with_labels(&["state"]);
const F_SPEC_DRAFT_POOL_REFUSALS: Family = Family::counter(
    "isoserve_spec_draft_pool_refusals_total",
    "The draft model's KV pool's refusals by kind (every one a safety check firing, as in \
     isoserve_kv_refusals_total); only with --draft-model",
)
.with_labels(&["kind"]);
const F_GRAMMAR_MASK_FAILURES: Family = Family::counter(
    "isoserve_grammar_mask_failures_total",
    "Grammar masks that failed (a step's bound, or no token allowed): each ends its request \
     with grammar_error",
);

const F_TENANT_REQUESTS: Family = Family::gauge(
    "isoserve_tenant_requests",
    "Requests of an active tenant in the engine, by state (K13)",
)
.with_labels(&["tenant", "state"]);
const F_TENANT_WEIGHT: Family = Family::gauge(
    "isoserve_tenant_weight",
    "An active tenant's fair-share weight (its share of the engine when others are busy: \
     weight over the active tenants' sum)",
)
.with_labels(&["tenant"]);
const F_TENANT_SERVICE: Family = Family::gauge(
    "isoserve_tenant_service",
    "Rows computed for an active tenant per unit of weight since it became active (the \
     virtual token counter admission serves lowest first)",
)
.with_labels(&["tenant"]);

/// Every family the HTTP layer exports itself, in the order `/metrics`
/// shows them: its own counters and histograms, the engine's state
/// (`Backend::stats`), then each active tenant's (after these come the
/// backend's own samples, declared by the backend: the PD gateway's and
/// its nodes').
pub const SERVER_FAMILIES: &[Family] = &[
    F_REQUESTS,
    F_REJECTIONS,
    F_HTTP_PROMPT_TOKENS,
    F_HTTP_COMPLETION_TOKENS,
    F_TENANT_PROMPT_TOKENS,
    F_TENANT_PROMPT_TOKENS_CACHED,
    F_TENANT_COMPLETION_TOKENS,
    F_TENANT_REQUESTS_FINISHED,
    F_TENANT_QUEUE_SECONDS,
    F_TIME_TO_FIRST_TOKEN_SECONDS,
    F_INTER_TOKEN_LATENCY_SECONDS,
    F_QUEUE_TIME_SECONDS,
    F_REQUEST_DURATION_SECONDS,
    F_HTTP_INFLIGHT_REQUESTS,
    F_KV_PAGES_TOTAL,
    F_KV_SAFETY_REFUSALS,
    F_KV_ALLOCS,
    F_KV_FREES,
    F_KV_FREES_DEFERRED,
    F_PREFIX_CACHE_PUBLISHES,
    F_PREFIX_CACHE_EVICTIONS,
    F_REQUESTS_RUNNING,
    F_REQUESTS_WAITING,
    F_REQUESTS_PREEMPTED,
    F_REQUESTS_PREEMPTIONS,
    F_PROMPT_TOKENS,
    F_GENERATION_TOKENS,
    F_ENGINE_STEPS,
    F_PREFIX_CACHE_QUERIES,
    F_PREFIX_CACHE_QUERY_TOKENS,
    F_PREFIX_CACHE_HIT_TOKENS,
    F_PREFIX_CACHE_HIT_PAGES,
    F_KV_PAGES,
    F_KV_REFUSALS,
    F_ENGINE_REQUESTS,
    F_KV_USAGE_RATIO,
    F_GRAMMAR_MASK_SECONDS,
    F_GRAMMAR_COMPILE_SECONDS,
    F_GRAMMAR_CACHE_LOOKUPS,
    F_GRAMMAR_DEFERRED,
    F_GRAMMAR_MASK_FAILURES,
    F_SPEC_DRAFTS,
    F_SPEC_DRAFT_TOKENS,
    F_SPEC_ACCEPTED_TOKENS,
    F_SPEC_SUFFIX_SCOPES,
    F_SPEC_SUFFIX_TOKENS,
    F_SPEC_ROW_COST,
    F_SPEC_DRAFT_PASSES,
    F_SPEC_DRAFT_POOL_FULL,
    F_SPEC_DRAFT_POOL_PAGES,
    F_SPEC_DRAFT_POOL_REFUSALS,
    F_TENANT_REQUESTS,
    F_TENANT_WEIGHT,
    F_TENANT_SERVICE,
];

/// Registers `metric` under its declared family.
fn register(registry: &mut Registry, f: &Family, metric: impl prometheus_client::registry::Metric) {
    registry.register(f.base(), f.help, metric);
}

/// A labelled family's samples, in OpenMetrics' shape.
pub(crate) fn tenant_requests(tenant: &str, state: &'static str, n: f64) -> MetricSample {
    F_TENANT_REQUESTS
        .sample(n)
        .label("tenant", tenant)
        .label("state", state)
}

pub(crate) fn tenant_weight(tenant: &str, weight: f64) -> MetricSample {
    F_TENANT_WEIGHT.sample(weight).label("tenant", tenant)
}

pub(crate) fn tenant_service(tenant: &str, service: f64) -> MetricSample {
    F_TENANT_SERVICE.sample(service).label("tenant", tenant)
}

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
    requests: Series<Labels, Counter>,
    rejections: Series<Labels, Counter>,
    prompt_tokens: Counter,
    tenant_prompt_tokens: Series<TenantLabels, Counter>,
    tenant_cached_tokens: Series<TenantLabels, Counter>,
    tenant_completion_tokens: Series<TenantLabels, Counter>,
    tenant_finished: Series<TenantLabels, Counter>,
    tenant_queue_seconds: Series<TenantLabels, Counter<f64, AtomicU64>>,
    completion_tokens: Counter,
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub queue_time: Histogram,
    pub e2e: Histogram,
    http_inflight: Gauge,
    engine: Arc<EngineCollector>,
    backend: Arc<SamplesCollector>,
}

/// Prometheus text of `samples` alone (what a PD node's `/metrics` serves).
pub use telemetry::metrics::encode_samples;
use telemetry::metrics::SamplesCollector;

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// The engine's state, refreshed before each scrape.
#[derive(Debug, Default)]
struct EngineCollector {
    stats: Mutex<EngineStats>,
    /// The grammar engine's counters as of the last render.
    grammar: Mutex<grammar::StatsSnapshot>,
}

/// A histogram family from a snapshot's per-bucket counts.
fn const_histogram(
    enc: &mut DescriptorEncoder,
    f: &Family,
    h: &grammar::stats::Histogram,
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(f.base(), f.help, None, MetricType::Histogram)?;
    m.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
        h.sum_s,
        h.count(),
        &h.buckets(),
        None,
    )
}

fn const_counter(enc: &mut DescriptorEncoder, f: &Family, v: u64) -> Result<(), std::fmt::Error> {
    let c = ConstCounter::new(v);
    let m = enc.encode_descriptor(f.base(), f.help, None, c.metric_type())?;
    c.encode(m)
}

fn const_gauge_f64(enc: &mut DescriptorEncoder, f: &Family, v: f64) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(v);
    let m = enc.encode_descriptor(f.base(), f.help, None, g.metric_type())?;
    g.encode(m)
}

fn const_gauge(enc: &mut DescriptorEncoder, f: &Family, v: u64) -> Result<(), std::fmt::Error> {
    let g = ConstGauge::new(v as i64);
    let m = enc.encode_descriptor(f.base(), f.help, None, g.metric_type())?;
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
            const_gauge(&mut enc, &F_KV_PAGES_TOTAL, p.pages_total)?;
            {
                let mut m = enc.encode_descriptor(
                    F_KV_PAGES.base(),
                    F_KV_PAGES.help,
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
                    F_KV_USAGE_RATIO.base(),
                    F_KV_USAGE_RATIO.help,
                    None,
                    g.metric_type(),
                )?;
                g.encode(m)?;
            }
            {
                let mut m = enc.encode_descriptor(
                    F_KV_REFUSALS.base(),
                    F_KV_REFUSALS.help,
                    None,
                    MetricType::Counter,
                )?;
                for (kind, v) in p.refusals() {
                    let labels = [("kind", kind)];
                    ConstCounter::new(v).encode(m.encode_family(&labels)?)?;
                }
            }
            const_counter(&mut enc, &F_KV_SAFETY_REFUSALS, p.safety_refusals())?;
            const_counter(&mut enc, &F_KV_ALLOCS, p.allocs)?;
            const_counter(&mut enc, &F_KV_FREES, p.frees)?;
            const_counter(&mut enc, &F_KV_FREES_DEFERRED, p.frees_deferred)?;
            const_counter(&mut enc, &F_PREFIX_CACHE_PUBLISHES, p.cache_publishes)?;
            const_counter(&mut enc, &F_PREFIX_CACHE_EVICTIONS, p.cache_evictions)?;
        }
        const_gauge(&mut enc, &F_REQUESTS_RUNNING, s.running as u64)?;
        const_gauge(&mut enc, &F_REQUESTS_WAITING, s.waiting as u64)?;
        const_gauge(&mut enc, &F_REQUESTS_PREEMPTED, s.preempted as u64)?;
        const_counter(
            &mut enc,
            &F_REQUESTS_PREEMPTIONS,
            s.requests_preempted_total,
        )?;
        const_counter(&mut enc, &F_PROMPT_TOKENS, s.prompt_tokens_total)?;
        const_counter(&mut enc, &F_GENERATION_TOKENS, s.generated_tokens_total)?;
        const_counter(&mut enc, &F_ENGINE_STEPS, s.steps_total)?;
        {
            let mut m = enc.encode_descriptor(
                F_ENGINE_REQUESTS.base(),
                F_ENGINE_REQUESTS.help,
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
            &F_PREFIX_CACHE_QUERIES,
            s.prefix_cache_queries_total,
        )?;
        const_counter(
            &mut enc,
            &F_PREFIX_CACHE_QUERY_TOKENS,
            s.prefix_cache_query_tokens_total,
        )?;
        const_counter(
            &mut enc,
            &F_PREFIX_CACHE_HIT_TOKENS,
            s.prefix_cache_hit_tokens_total,
        )?;
        const_counter(
            &mut enc,
            &F_PREFIX_CACHE_HIT_PAGES,
            s.prefix_cache_hit_pages_total,
        )?;
        let g = self
            .grammar
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        const_histogram(&mut enc, &F_GRAMMAR_MASK_SECONDS, &g.masks)?;
        const_histogram(&mut enc, &F_GRAMMAR_COMPILE_SECONDS, &g.compiles)?;
        {
            let mut m = enc.encode_descriptor(
                F_GRAMMAR_CACHE_LOOKUPS.base(),
                F_GRAMMAR_CACHE_LOOKUPS.help,
                None,
                MetricType::Counter,
            )?;
            for (result, v) in [("hit", g.cache_hits), ("miss", g.cache_misses)] {
                let labels = [("result", result)];
                ConstCounter::new(v).encode(m.encode_family(&labels)?)?;
            }
        }
        const_counter(&mut enc, &F_GRAMMAR_DEFERRED, s.grammar_deferred_total)?;
        const_counter(&mut enc, &F_GRAMMAR_MASK_FAILURES, g.mask_failures)?;
        const_counter(&mut enc, &F_SPEC_DRAFTS, s.spec_drafts_total)?;
        const_counter(&mut enc, &F_SPEC_DRAFT_TOKENS, s.spec_draft_tokens_total)?;
        const_counter(
            &mut enc,
            &F_SPEC_ACCEPTED_TOKENS,
            s.spec_accepted_tokens_total,
        )?;
        const_gauge(&mut enc, &F_SPEC_SUFFIX_SCOPES, s.spec_suffix_scopes as u64)?;
        const_gauge(&mut enc, &F_SPEC_SUFFIX_TOKENS, s.spec_suffix_tokens as u64)?;
        const_gauge_f64(&mut enc, &F_SPEC_ROW_COST, s.spec_row_cost)?;
        const_counter(&mut enc, &F_SPEC_DRAFT_PASSES, s.spec_draft_passes_total)?;
        const_counter(
            &mut enc,
            &F_SPEC_DRAFT_POOL_FULL,
            s.spec_draft_pool_full_total,
        )?;
        if let Some(d) = &s.draft_pool {
            {
                let mut m = enc.encode_descriptor(
                    F_SPEC_DRAFT_POOL_PAGES.base(),
                    F_SPEC_DRAFT_POOL_PAGES.help,
                    None,
                    MetricType::Gauge,
                )?;
                for (state, v) in [
                    ("free", d.pages_unheld()),
                    ("owned", d.pages_total - d.pages_unheld()),
                ] {
                    let labels = [("state", state)];
                    ConstGauge::new(v as i64).encode(m.encode_family(&labels)?)?;
                }
            }
            let mut m = enc.encode_descriptor(
                F_SPEC_DRAFT_POOL_REFUSALS.base(),
                F_SPEC_DRAFT_POOL_REFUSALS.help,
                None,
                MetricType::Counter,
            )?;
            for (kind, v) in d.refusals() {
                let labels = [("kind", kind)];
                ConstCounter::new(v).encode(m.encode_family(&labels)?)?;
            }
        }
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
        let requests = Series::<Labels, Counter>::default();
        let rejections = Series::<Labels, Counter>::default();
        // Pre-create every series so a dashboard (and a test) sees zeros.
        for o in OUTCOMES {
            let _ = requests.get_or_create(&vec![("outcome", o)]);
        }
        for r in Reason::ALL {
            let _ = rejections.get_or_create(&vec![("reason", r.as_str())]);
        }
        register(&mut registry, &F_REQUESTS, requests.clone());
        register(&mut registry, &F_REJECTIONS, rejections.clone());
        let prompt_tokens = Counter::default();
        let completion_tokens = Counter::default();
        register(&mut registry, &F_HTTP_PROMPT_TOKENS, prompt_tokens.clone());
        register(
            &mut registry,
            &F_HTTP_COMPLETION_TOKENS,
            completion_tokens.clone(),
        );
        let tenant_prompt_tokens = Series::<TenantLabels, Counter>::default();
        let tenant_cached_tokens = Series::<TenantLabels, Counter>::default();
        register(
            &mut registry,
            &F_TENANT_PROMPT_TOKENS,
            tenant_prompt_tokens.clone(),
        );
        register(
            &mut registry,
            &F_TENANT_PROMPT_TOKENS_CACHED,
            tenant_cached_tokens.clone(),
        );
        let tenant_completion_tokens = Series::<TenantLabels, Counter>::default();
        let tenant_finished = Series::<TenantLabels, Counter>::default();
        let tenant_queue_seconds = Series::<TenantLabels, Counter<f64, AtomicU64>>::default();
        register(
            &mut registry,
            &F_TENANT_COMPLETION_TOKENS,
            tenant_completion_tokens.clone(),
        );
        register(
            &mut registry,
            &F_TENANT_REQUESTS_FINISHED,
            tenant_finished.clone(),
        );
        register(
            &mut registry,
            &F_TENANT_QUEUE_SECONDS,
            tenant_queue_seconds.clone(),
        );
        let ttft = Histogram::new(latency_buckets());
        let inter_token = Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        let queue_time = Histogram::new(latency_buckets());
        let e2e = Histogram::new(latency_buckets());
        register(&mut registry, &F_TIME_TO_FIRST_TOKEN_SECONDS, ttft.clone());
        register(
            &mut registry,
            &F_INTER_TOKEN_LATENCY_SECONDS,
            inter_token.clone(),
        );
        register(&mut registry, &F_QUEUE_TIME_SECONDS, queue_time.clone());
        register(&mut registry, &F_REQUEST_DURATION_SECONDS, e2e.clone());
        let http_inflight = Gauge::default();
        register(
            &mut registry,
            &F_HTTP_INFLIGHT_REQUESTS,
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
        let get = |f: &Series<TenantLabels, Counter>| f.get(&labels).map_or(0, |c| c.get());
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
    pub fn render(
        &self,
        stats: EngineStats,
        grammar: grammar::StatsSnapshot,
        backend: Vec<MetricSample>,
    ) -> String {
        *self.engine.stats.lock().unwrap_or_else(|e| e.into_inner()) = stats;
        *self
            .engine
            .grammar
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = grammar;
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
        let mut g = grammar::StatsSnapshot::default();
        g.masks.counts[3] = 2; // ≤ 2.8 µs
        g.masks.counts[10] = 1; // ≤ 32 µs
        g.masks.sum_s = 4e-5;
        g.cache_hits = 5;
        let text = m.render(s, g, Vec::new());
        // The bucket at 32 µs counts every mask up to it (cumulative).
        let at_32us = text
            .lines()
            .filter_map(|l| l.strip_prefix("isoserve_grammar_mask_seconds_bucket{le=\""))
            .filter_map(|l| l.split_once("\"} "))
            .find(|(le, _)| le.parse::<f64>().is_ok_and(|x| (x - 3.2e-5).abs() < 1e-9))
            .map(|(_, v)| v.to_string());
        assert_eq!(at_32us.as_deref(), Some("3"), "{text}");
        assert_eq!(
            value(&text, "isoserve_grammar_mask_seconds_count"),
            Some(3.0)
        );
        assert_eq!(
            value(
                &text,
                "isoserve_grammar_cache_lookups_total{result=\"hit\"}"
            ),
            Some(5.0)
        );
        assert_eq!(
            value(&text, "isoserve_grammar_compile_seconds_count"),
            Some(0.0)
        );
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
