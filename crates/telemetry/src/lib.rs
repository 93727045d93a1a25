//! `telemetry` — one request's path over gateway, prefill and decode hosts
//! as spans under its W3C trace context: each span is logged (target
//! `isoserve::span`, with the trace id and the request id) and, when an
//! OTLP endpoint is given, exported over OTLP/HTTP (protobuf or JSON) by
//! a batching background thread.
//!
//! The gateway opens a `request` span per request ([`Telemetry::start`])
//! whose id travels to the nodes as the parent of their spans; nodes
//! record `queue`, `prefill`, `transfer` and `decode` spans once they end
//! ([`Telemetry::record`]). Spans carry counts and ids only — never
//! prompt text or tokens.
//!
//! [`metrics`] is the other half of what the processes report: metric
//! families declared once, as data, by each source, and the one
//! Prometheus encoder every `/metrics` goes through.
//!
//! ```
//! use std::time::{Duration, SystemTime};
//! use telemetry::{Span, Telemetry};
//! let t = Telemetry::logs_only("isoserve-decode");
//! let root = t.start("request", None, request::RequestId(7));
//! let ctx = root.context(); // what the wire carries to the nodes
//! let now = SystemTime::now();
//! t.record(&Span::new("decode", ctx, now, now + Duration::from_millis(3), request::RequestId(7)));
//! root.end(true);
//! ```

#![forbid(unsafe_code)]

pub mod metrics;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use request::trace::TraceContext;
use request::RequestId;
use thiserror::Error;

/// How often the exporter sends what it has batched (also the longest a
/// finished span waits before it leaves the process).
pub const EXPORT_INTERVAL: Duration = Duration::from_millis(500);
/// Spans waiting for export at most; beyond it new ones are dropped (and
/// counted by the SDK), never blocking a request.
pub const EXPORT_QUEUE_MAX: usize = 4096;
/// One export's time limit.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Error)]
pub enum TelemetryError {
    #[error("--otlp-endpoint `{0}`: expected an http:// or https:// URL")]
    Endpoint(String),
    #[error("--otlp-protocol `{0}`: expected http/protobuf or http/json")]
    Protocol(String),
    #[error("OTLP exporter: {0}")]
    Exporter(String),
}

/// The wire encoding of OTLP/HTTP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OtlpProtocol {
    Protobuf,
    Json,
}

impl std::str::FromStr for OtlpProtocol {
    type Err = TelemetryError;
    fn from_str(s: &str) -> Result<OtlpProtocol, TelemetryError> {
        match s {
            "http/protobuf" => Ok(OtlpProtocol::Protobuf),
            "http/json" => Ok(OtlpProtocol::Json),
            other => Err(TelemetryError::Protocol(other.to_string())),
        }
    }
}

/// A finished span of a node.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    pub name: &'static str,
    /// The trace, and the parent span (the gateway's request span).
    pub parent: TraceContext,
    pub start: SystemTime,
    pub end: SystemTime,
    pub req: RequestId,
    /// Ended by a failure (its code), or `None`.
    pub error: Option<String>,
    pub attrs: Vec<(&'static str, i64)>,
}

impl Span {
    pub fn new(
        name: &'static str,
        parent: TraceContext,
        start: SystemTime,
        end: SystemTime,
        req: RequestId,
    ) -> Span {
        Span {
            name,
            parent,
            start,
            end,
            req,
            error: None,
            attrs: Vec::new(),
        }
    }
}

struct Otlp {
    provider: SdkTracerProvider,
    tracer: opentelemetry_sdk::trace::SdkTracer,
}

/// Where a process's spans go: its log, and an OTLP endpoint if given.
/// Cheap to clone (one exporter per process).
#[derive(Clone)]
pub struct Telemetry {
    service: Arc<str>,
    otlp: Option<Arc<Otlp>>,
    /// Tests: every recorded span is also kept here.
    kept: Option<Arc<std::sync::Mutex<Vec<Span>>>>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("service", &self.service)
            .field("otlp", &self.otlp.is_some())
            .finish()
    }
}

impl Default for Telemetry {
    fn default() -> Telemetry {
        Telemetry::logs_only("isoserve")
    }
}

/// 8 random bytes, never all zero (an invalid id).
pub fn new_span_id() -> [u8; 8] {
    let mut b = [0u8; 8];
    while b == [0; 8] {
        // An OS without randomness is an OS the server cannot run on.
        getrandom::fill(&mut b).expect("the OS random source");
    }
    b
}

/// 16 random bytes, never all zero.
pub fn new_trace_id() -> [u8; 16] {
    let mut b = [0u8; 16];
    while b == [0; 16] {
        getrandom::fill(&mut b).expect("the OS random source");
    }
    b
}

/// A new sampled trace with a random root.
pub fn new_trace() -> TraceContext {
    TraceContext {
        trace_id: new_trace_id(),
        span_id: new_span_id(),
        flags: 1,
    }
}

/// `http://host:port` gets the traces path; a URL with a path is taken as
/// the traces endpoint itself.
fn traces_url(endpoint: &str) -> Result<String, TelemetryError> {
    let rest = endpoint
        .strip_prefix("http://")
        .or_else(|| endpoint.strip_prefix("https://"))
        .filter(|r| !r.is_empty() && !r.starts_with('/'))
        .ok_or_else(|| TelemetryError::Endpoint(endpoint.to_string()))?;
    Ok(match rest.find('/') {
        None => format!("{endpoint}/v1/traces"),
        Some(i) if rest[i..] == *"/" => format!("{}v1/traces", endpoint),
        Some(_) => endpoint.to_string(),
    })
}

fn remote(parent: &TraceContext) -> Context {
    Context::new().with_remote_span_context(SpanContext::new(
        TraceId::from_bytes(parent.trace_id),
        SpanId::from_bytes(parent.span_id),
        TraceFlags::new(parent.flags),
        true,
        TraceState::NONE,
    ))
}

fn log_span(
    service: &str,
    name: &str,
    parent: &TraceContext,
    span_id: &[u8; 8],
    req: RequestId,
    ms: f64,
    error: Option<&str>,
) {
    let span_hex: String = span_id.iter().map(|b| format!("{b:02x}")).collect();
    tracing::info!(
        target: "isoserve::span",
        service,
        span = name,
        req = req.0,
        trace_id = %parent.trace_hex(),
        span_id = %span_hex,
        parent_id = %parent.span_hex(),
        ms = format!("{ms:.3}"),
        error = error.unwrap_or(""),
        "span"
    );
}

impl Telemetry {
    /// Spans go to the log only.
    pub fn logs_only(service: &str) -> Telemetry {
        Telemetry {
            service: service.into(),
            otlp: None,
            kept: None,
        }
    }

    /// Spans go to the log and are kept in the returned list (for tests of
    /// what records them).
    pub fn keeping(service: &str) -> (Telemetry, Arc<std::sync::Mutex<Vec<Span>>>) {
        let kept = Arc::new(std::sync::Mutex::new(Vec::new()));
        let t = Telemetry {
            service: service.into(),
            otlp: None,
            kept: Some(kept.clone()),
        };
        (t, kept)
    }

    /// Spans go to the log and to `endpoint` over OTLP/HTTP. `instance`
    /// names this process among the service's (`service.instance.id`).
    /// Call from outside an async runtime (the exporter's HTTP client has
    /// one of its own).
    pub fn otlp(
        service: &str,
        instance: &str,
        endpoint: &str,
        protocol: OtlpProtocol,
    ) -> Result<Telemetry, TelemetryError> {
        let url = traces_url(endpoint)?;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(url)
            .with_protocol(match protocol {
                OtlpProtocol::Protobuf => Protocol::HttpBinary,
                OtlpProtocol::Json => Protocol::HttpJson,
            })
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|e| TelemetryError::Exporter(e.to_string()))?;
        let batch = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_scheduled_delay(EXPORT_INTERVAL)
                    .with_max_queue_size(EXPORT_QUEUE_MAX)
                    .build(),
            )
            .build();
        let resource = opentelemetry_sdk::Resource::builder_empty()
            .with_service_name(service.to_string())
            .with_attribute(KeyValue::new("service.instance.id", instance.to_string()))
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(batch)
            .with_resource(resource)
            .build();
        let tracer = opentelemetry::trace::TracerProvider::tracer(&provider, "isoserve");
        Ok(Telemetry {
            service: service.into(),
            otlp: Some(Arc::new(Otlp { provider, tracer })),
            kept: None,
        })
    }

    pub fn exporting(&self) -> bool {
        self.otlp.is_some()
    }

    /// Opens a span that stays open while the request runs (the gateway's
    /// `request` span), under `parent` (the caller's `traceparent`) or at
    /// the root of a new trace.
    pub fn start(
        &self,
        name: &'static str,
        parent: Option<TraceContext>,
        req: RequestId,
    ) -> OpenSpan {
        let (parent, root) = match parent {
            Some(p) => (p, false),
            None => (new_trace(), true),
        };
        let start = SystemTime::now();
        let otel = self.otlp.as_ref().map(|o| {
            let b = o
                .tracer
                .span_builder(name)
                .with_kind(SpanKind::Server)
                .with_start_time(start)
                .with_attributes([KeyValue::new("isoserve.request_id", req.0 as i64)]);
            if root {
                o.tracer.build_with_context(b, &Context::new())
            } else {
                o.tracer.build_with_context(b, &remote(&parent))
            }
        });
        // The exporter's ids when it made the span (a root's trace id is
        // the SDK's too), else our own.
        let ctx = match &otel {
            Some(s) => TraceContext {
                trace_id: s.span_context().trace_id().to_bytes(),
                span_id: s.span_context().span_id().to_bytes(),
                flags: parent.flags,
            },
            None => parent.child(new_span_id()),
        };
        let parent_shown = if root { None } else { Some(parent) };
        OpenSpan {
            service: self.service.clone(),
            name,
            req,
            ctx,
            parent: parent_shown,
            start,
            otel,
        }
    }

    /// A node's finished span: logged, and exported if sampled.
    pub fn record(&self, span: &Span) {
        let ms = span
            .end
            .duration_since(span.start)
            .unwrap_or_default()
            .as_secs_f64()
            * 1e3;
        let mut id = None;
        if let Some(o) = &self.otlp {
            let mut attrs = vec![KeyValue::new("isoserve.request_id", span.req.0 as i64)];
            attrs.extend(span.attrs.iter().map(|&(k, v)| KeyValue::new(k, v)));
            let b = o
                .tracer
                .span_builder(span.name)
                .with_kind(SpanKind::Internal)
                .with_start_time(span.start)
                .with_attributes(attrs);
            let mut s = o.tracer.build_with_context(b, &remote(&span.parent));
            if let Some(code) = &span.error {
                s.set_status(Status::error(code.clone()));
            }
            id = Some(s.span_context().span_id().to_bytes());
            s.end_with_timestamp(span.end);
        }
        if let Some(k) = &self.kept {
            k.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(span.clone());
        }
        let id = id.unwrap_or_else(new_span_id);
        log_span(
            &self.service,
            span.name,
            &span.parent,
            &id,
            span.req,
            ms,
            span.error.as_deref(),
        );
    }

    /// Sends what is batched and stops the exporter (at exit).
    pub fn shutdown(&self) {
        if let Some(o) = &self.otlp {
            let _ = o.provider.force_flush();
            let _ = o.provider.shutdown();
        }
    }
}

/// A span still open (the gateway's request span).
pub struct OpenSpan {
    service: Arc<str>,
    name: &'static str,
    req: RequestId,
    ctx: TraceContext,
    parent: Option<TraceContext>,
    start: SystemTime,
    otel: Option<opentelemetry_sdk::trace::Span>,
}

impl OpenSpan {
    /// The trace with this span as the parent: what goes on the wire.
    pub fn context(&self) -> TraceContext {
        self.ctx
    }

    /// Ends it now; `ok` false marks it failed.
    pub fn end(mut self, ok: bool) {
        let end = SystemTime::now();
        if let Some(mut s) = self.otel.take() {
            if !ok {
                s.set_status(Status::error("request failed"));
            }
            s.end_with_timestamp(end);
        }
        let ms = end
            .duration_since(self.start)
            .unwrap_or_default()
            .as_secs_f64()
            * 1e3;
        let parent = self.parent.unwrap_or(TraceContext {
            span_id: [0; 8],
            ..self.ctx
        });
        log_span(
            &self.service,
            self.name,
            &parent,
            &self.ctx.span_id,
            self.req,
            ms,
            (!ok).then_some("failed"),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_get_the_traces_path_once() {
        assert_eq!(
            traces_url("http://c:4318").unwrap(),
            "http://c:4318/v1/traces"
        );
        assert_eq!(
            traces_url("http://c:4318/").unwrap(),
            "http://c:4318/v1/traces"
        );
        assert_eq!(
            traces_url("https://c/x/v1/traces").unwrap(),
            "https://c/x/v1/traces"
        );
        assert!(traces_url("c:4318").is_err());
        assert!(traces_url("http://").is_err());
        assert!("grpc".parse::<OtlpProtocol>().is_err());
    }

    #[test]
    fn ids_are_random_and_never_zero() {
        let (a, b) = (new_span_id(), new_span_id());
        assert_ne!(a, b);
        assert_ne!(new_trace_id(), [0; 16]);
        let t = Telemetry::logs_only("x");
        let parent = new_trace();
        let s = t.start("request", Some(parent), RequestId(1));
        assert_eq!(s.context().trace_id, parent.trace_id);
        assert_ne!(s.context().span_id, parent.span_id);
        s.end(true);
        // Without a parent: a new sampled trace.
        let s = t.start("request", None, RequestId(2));
        assert!(s.context().sampled());
        s.end(false);
    }
}
