//! The operations routes: `/health` (200, or 503 while shutting down or
//! before the backend is ready) and `/metrics` (Prometheus text; on the
//! API port the operator's key only, on `--metrics-port` open).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::error::ApiError;
use crate::state::AppState;

pub(crate) async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.is_shutting_down() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "shutting_down"})),
        )
            .into_response()
    } else if !st.engine.ready() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "unavailable"})),
        )
            .into_response()
    } else {
        Json(serde_json::json!({"status": "ok"})).into_response()
    }
}

/// `GET /metrics` on the API port: with a tenants file, the operator's key
/// only (what every tenant does is not a tenant's business).
pub(crate) async fn metrics_api(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let auth = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
    let refusal = match st.tenants.operator(auth) {
        Ok(true) => return metrics(State(st)).await,
        Ok(false) => ApiError::forbidden(
            "/metrics on the API port needs the operator's key: add an [operator] section with \
             its api_key_sha256 to the tenants file, or serve metrics on --metrics-port",
        ),
        Err(why) => ApiError::from(why),
    };
    st.metrics.rejection(refusal.reason);
    refusal.into_response()
}

pub(crate) async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    st.metrics.set_inflight(st.inflight());
    // A backend may ask its nodes (bounded, loopback): off the async threads.
    let backend = st.engine.clone();
    let mut samples = tokio::task::spawn_blocking(move || backend.metric_samples())
        .await
        .unwrap_or_default();
    let stats = st.engine.stats();
    // Each active tenant's requests in the engine, under its name (K13).
    for t in &stats.tenants {
        let name = st
            .tenants
            .name_of(t.tenant)
            .unwrap_or("unknown")
            .to_string();
        for (state, n) in [
            ("running", t.running),
            ("waiting", t.waiting),
            ("preempted", t.preempted),
        ] {
            samples.push(crate::metrics::tenant_requests(&name, state, n as f64));
        }
        samples.push(crate::metrics::tenant_weight(&name, f64::from(t.weight)));
        samples.push(crate::metrics::tenant_service(&name, t.service));
    }
    let text = st.metrics.render(stats, st.grammar_stats(), samples);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
        )],
        text,
    )
        .into_response()
}
