//! `POST /v1/messages/count_tokens`: the input tokens a Messages request
//! would send, `{"input_tokens": N}`, from the same translation and the
//! same encoder (system prompt, tools and all). Nothing reaches the engine.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::error::ApiError;
use crate::state::AppState;

pub(crate) async fn handle(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = async {
        st.tenants
            .authenticate(crate::http::auth_header(&headers).as_deref())?;
        let bytes =
            crate::http::read_body(body, &headers, st.cfg.max_body_bytes, st.cfg.body_timeout)
                .await?;
        let chat = super::to_chat(&bytes, true)?;
        let p = crate::openai::chat::parse_chat(chat.to_string().as_bytes())?;
        let st2 = st.clone();
        let ids = tokio::task::spawn_blocking(move || {
            crate::http::tokenize(
                &st2,
                &p.input,
                "messages",
                &p.template_kwargs,
                p.tools.as_ref(),
            )
        })
        .await
        .map_err(|e| ApiError::internal(format!("tokenizer task: {e}")))??;
        Ok::<_, ApiError>(serde_json::json!({"input_tokens": ids.0.len()}))
    }
    .await;
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => {
            st.metrics.rejection(e.reason);
            super::error_response(e)
        }
    }
}
