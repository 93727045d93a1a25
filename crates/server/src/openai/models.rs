//! `GET /v1/models` and `GET /v1/models/{id}`: the one served model, under
//! a tenant's key when there is a tenants file.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

use crate::error::ApiError;
use crate::state::AppState;

pub(crate) async fn list(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(r) = crate::http::check_key(&st, &headers) {
        return *r;
    }
    Json(ModelList {
        object: "list".into(),
        data: vec![model_card(&st)],
    })
    .into_response()
}

pub(crate) async fn by_id(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Err(r) = crate::http::check_key(&st, &headers) {
        return *r;
    }
    if st.cfg.serves_model(&id) {
        Json(model_card(&st)).into_response()
    } else {
        let e = ApiError::model_not_found(&id);
        st.metrics.rejection(e.reason);
        e.into_response()
    }
}

fn model_card(st: &AppState) -> ModelCard {
    ModelCard {
        id: st.cfg.model_id.clone(),
        object: "model".into(),
        created: st.started,
        owned_by: "isoserve".into(),
        max_model_len: st.max_request(),
        context_length: st.max_request(),
    }
}

/// One entry of `/v1/models`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    /// The advertised window (vLLM's name).
    pub max_model_len: usize,
    /// The same, under the name some clients read.
    pub context_length: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}
