//! Errors: [`ApiError`] is what a client sees (always OpenAI's JSON shape
//! `{"error":{"message","type","param","code"}}`), [`ServerError`] is what
//! can go wrong starting or running the server.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use request::RequestError;
use serde::{Deserialize, Serialize};

/// Why a request was refused, as the `reason` label of
/// `isoserve_rejections_total` and the `error_kind` of the request log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    ContextLengthExceeded,
    QueueFull,
    TenantLimit,
    Unauthorized,
    InvalidRequest,
    ModelNotFound,
    BodyTooLarge,
    ShuttingDown,
    NotFound,
    MethodNotAllowed,
    Timeout,
    Internal,
    /// A prefill or decode node failed under the request (PD).
    Upstream,
    /// The client's address, or the server, holds its limit of
    /// connections (the front door, K13).
    ConnectionLimit,
}

impl Reason {
    /// Every reason, for pre-registering metric series at 0.
    pub const ALL: [Reason; 14] = [
        Reason::ContextLengthExceeded,
        Reason::QueueFull,
        Reason::TenantLimit,
        Reason::Unauthorized,
        Reason::InvalidRequest,
        Reason::ModelNotFound,
        Reason::BodyTooLarge,
        Reason::ShuttingDown,
        Reason::NotFound,
        Reason::MethodNotAllowed,
        Reason::Timeout,
        Reason::Internal,
        Reason::Upstream,
        Reason::ConnectionLimit,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::ContextLengthExceeded => "context_length_exceeded",
            Reason::QueueFull => "queue_full",
            Reason::TenantLimit => "tenant_limit",
            Reason::Unauthorized => "unauthorized",
            Reason::InvalidRequest => "invalid_request",
            Reason::ModelNotFound => "model_not_found",
            Reason::BodyTooLarge => "body_too_large",
            Reason::ShuttingDown => "shutting_down",
            Reason::NotFound => "not_found",
            Reason::MethodNotAllowed => "method_not_allowed",
            Reason::Timeout => "timeout",
            Reason::Internal => "internal_error",
            Reason::Upstream => "upstream_error",
            Reason::ConnectionLimit => "connection_limit",
        }
    }
}

/// An error answered to a client.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type`, e.g. `invalid_request_error`.
    pub kind: &'static str,
    pub code: Option<&'static str>,
    /// The request field at fault (`max_tokens`, `messages[1].content`, ...).
    pub param: Option<String>,
    pub message: String,
    /// Seconds for the `Retry-After` header (429, 503).
    pub retry_after: Option<u64>,
    pub reason: Reason,
}

/// The JSON body of an error, exactly OpenAI's shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, reason: Reason, message: String) -> ApiError {
        ApiError {
            status,
            kind,
            code: None,
            param: None,
            message,
            retry_after: None,
            reason,
        }
    }

    fn code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    fn param(mut self, param: impl Into<String>) -> ApiError {
        self.param = Some(param.into());
        self
    }

    /// 400 for a field with the wrong type.
    pub fn invalid_type(param: impl Into<String>, expected: &str) -> ApiError {
        let param = param.into();
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Reason::InvalidRequest,
            format!("Invalid type for '{param}': expected {expected}."),
        )
        .code("invalid_type")
        .param(param)
    }

    /// 400 for a field with a value out of range or otherwise invalid.
    pub fn invalid_value(param: impl Into<String>, why: impl std::fmt::Display) -> ApiError {
        let param = param.into();
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Reason::InvalidRequest,
            format!("Invalid value for '{param}': {why}"),
        )
        .code("invalid_value")
        .param(param)
    }

    /// 400 for a required field that is absent.
    pub fn missing(param: &str) -> ApiError {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Reason::InvalidRequest,
            format!("Missing required parameter: '{param}'."),
        )
        .code("missing_required_parameter")
        .param(param)
    }

    /// 400 for a parameter this server does not implement.
    pub fn unsupported(param: &str, why: &str) -> ApiError {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Reason::InvalidRequest,
            format!("Unsupported value for '{param}': {why}"),
        )
        .code("unsupported_value")
        .param(param)
    }

    /// 400 for a parameter that cannot be used together with another
    /// (OpenAI's `unsupported_parameter`: "Unsupported parameter: 'x' is
    /// not supported with ...").
    pub fn unsupported_parameter(param: &str, why: &str) -> ApiError {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Reason::InvalidRequest,
            format!("Unsupported parameter: '{param}' {why}"),
        )
        .code("unsupported_parameter")
        .param(param)
    }

    /// 400 for a body that is not JSON (or not an object).
    pub fn invalid_json(why: impl std::fmt::Display) -> ApiError {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Reason::InvalidRequest,
            format!("We could not parse the JSON body of your request: {why}"),
        )
        .code("invalid_json")
    }

    /// 400 for a prompt the tokenizer or the chat template refused.
    pub fn bad_prompt(param: &str, why: impl std::fmt::Display) -> ApiError {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Reason::InvalidRequest,
            format!("The prompt could not be prepared: {why}"),
        )
        .code("invalid_prompt")
        .param(param)
    }

    /// 401: wrong or missing API key (the message per cause is
    /// `tenants`' `From<AuthError>`).
    pub fn unauthorized(message: String) -> ApiError {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Reason::Unauthorized,
            message,
        )
        .code("invalid_api_key")
    }

    /// 431: the request head is over the limit.
    pub fn head_too_large(limit: usize) -> ApiError {
        ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "invalid_request_error",
            Reason::InvalidRequest,
            format!("The request line and headers are over {limit} bytes, the limit."),
        )
        .code("headers_too_large")
    }

    /// 431: more headers than the limit.
    pub fn too_many_headers(limit: usize) -> ApiError {
        ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "invalid_request_error",
            Reason::InvalidRequest,
            format!("The request has more than {limit} headers, the limit."),
        )
        .code("too_many_headers")
    }

    /// 400: the request line or a header is not HTTP/1.1.
    pub fn malformed_request(why: &str) -> ApiError {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Reason::InvalidRequest,
            format!("The request is not valid HTTP/1.1: {why}."),
        )
        .code("malformed_request")
    }

    /// 400: an unusable `Content-Length`.
    pub fn bad_content_length(why: &str) -> ApiError {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Reason::InvalidRequest,
            format!("Bad Content-Length: {why}."),
        )
        .code("invalid_content_length")
    }

    /// 400: a request over the tenant's whole per-minute budget.
    pub fn never_fits(message: String) -> ApiError {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Reason::TenantLimit,
            message,
        )
        .code("request_exceeds_tokens_per_minute")
        .param("max_tokens")
    }

    /// 403: the key is fine but may not do this.
    pub fn forbidden(why: &str) -> ApiError {
        ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            Reason::Unauthorized,
            why.to_string(),
        )
        .code("forbidden")
    }

    /// 404: the `model` field names no model served here.
    pub fn model_not_found(model: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Reason::ModelNotFound,
            format!("The model `{model}` does not exist or you do not have access to it."),
        )
        .code("model_not_found")
        .param("model")
    }

    /// 404 for an unknown route.
    pub fn route_not_found(method: &str, path: &str) -> ApiError {
        // Keep the message bounded whatever the path.
        let path: String = path.chars().take(200).collect();
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Reason::NotFound,
            format!("Invalid URL ({method} {path})"),
        )
        .code("not_found")
    }

    /// 405 for a known route with the wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> ApiError {
        let path: String = path.chars().take(200).collect();
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            Reason::MethodNotAllowed,
            format!("Method {method} is not allowed for {path}"),
        )
        .code("method_not_allowed")
    }

    /// 413: the body is larger than the limit.
    pub fn body_too_large(limit: usize) -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            Reason::BodyTooLarge,
            format!("The request body exceeds the limit of {limit} bytes."),
        )
        .code("request_too_large")
    }

    /// 408: the body did not arrive in time.
    pub fn body_timeout(secs: u64) -> ApiError {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            Reason::Timeout,
            format!("The request body did not arrive within {secs} s."),
        )
        .code("timeout")
    }

    /// 429: a tenant's concurrency or tokens-per-minute limit.
    pub fn tenant_limit(message: String, retry_after: u64) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            Reason::TenantLimit,
            message,
        )
        .code("rate_limit_exceeded");
        e.retry_after = Some(retry_after.max(1));
        e
    }

    /// 429: the client's address holds its limit of connections.
    pub fn client_connections(limit: usize) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            Reason::ConnectionLimit,
            format!(
                "Your address holds {limit} connections to this server, the most one client may \
                 hold; reuse or close one and retry."
            ),
        )
        .code("too_many_connections");
        e.retry_after = Some(1);
        e
    }

    /// 503: the server holds its limit of connections.
    pub fn server_connections(limit: usize) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            Reason::ConnectionLimit,
            format!("The server holds {limit} connections, its limit; retry shortly."),
        )
        .code("server_busy");
        e.retry_after = Some(1);
        e
    }

    /// 503: the server is shutting down.
    pub fn shutting_down() -> ApiError {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            Reason::ShuttingDown,
            "The server is shutting down; retry on another instance.".to_string(),
        )
        .code("shutting_down");
        e.retry_after = Some(5);
        e
    }

    /// 500.
    pub fn internal(why: impl std::fmt::Display) -> ApiError {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            Reason::Internal,
            format!("Internal error: {why}"),
        )
        .code("internal_error")
    }

    /// Maps an engine error. `prompt_param` names the prompt's field
    /// (`messages` or `prompt`), `logprobs_param` the field that asked for
    /// alternatives (`top_logprobs` or `logprobs`).
    pub fn from_engine(e: &RequestError, prompt_param: &str, logprobs_param: &str) -> ApiError {
        match e {
            RequestError::ContextLengthExceeded { .. } => ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Reason::ContextLengthExceeded,
                e.to_string(),
            )
            .code("context_length_exceeded")
            .param(prompt_param),
            RequestError::EmptyPrompt => ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Reason::InvalidRequest,
                "The prompt is empty.".to_string(),
            )
            .code("empty_prompt")
            .param(prompt_param),
            RequestError::InvalidParam { field, why } => {
                let field = match *field {
                    "top_logprobs" => logprobs_param,
                    "prompt" => prompt_param,
                    f => f,
                };
                ApiError::invalid_value(field, why)
            }
            RequestError::QueueFull { .. } => {
                let mut e = ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    Reason::QueueFull,
                    e.to_string(),
                )
                .code("queue_full");
                e.retry_after = Some(1);
                e
            }
            RequestError::ShuttingDown => ApiError::shutting_down(),
            RequestError::ClientTooSlow { .. } => ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "timeout_error",
                Reason::Timeout,
                e.to_string(),
            )
            .code("client_too_slow"),
            // The request's own grammar went past a bound mid-output.
            RequestError::Grammar(_) => ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Reason::InvalidRequest,
                e.to_string(),
            )
            .code("grammar_error"),
            RequestError::Internal(why) => ApiError::internal(why),
            RequestError::Remote {
                status,
                code,
                message,
            } => ApiError::from_remote(*status, code, message, prompt_param),
        }
    }

    /// A node's original error (PD, K9): its status and OpenAI code, its
    /// message unchanged.
    fn from_remote(status: u16, code: &str, message: &str, prompt_param: &str) -> ApiError {
        const CODES: &[&str] = &[
            "context_length_exceeded",
            "empty_prompt",
            "invalid_value",
            "grammar_error",
            "queue_full",
            "prefill_lost",
            "decode_lost",
            "checksum_mismatch",
            "canary_mismatch",
            "transfer_incomplete",
            "transfer_fenced",
            "transfer_refused",
            "transfer_protocol",
            "pairing_refused",
            "decode_unreachable",
            "duplicate_request",
            "unavailable",
            "internal_error",
        ];
        let known = CODES.iter().copied().find(|&c| c == code);
        let message = message.to_string();
        match status {
            400 if code == "context_length_exceeded" => ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Reason::ContextLengthExceeded,
                message,
            )
            .code("context_length_exceeded")
            .param(prompt_param),
            400..=499 if code == "queue_full" || status == 429 => {
                let mut e = ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    Reason::QueueFull,
                    message,
                )
                .code("queue_full");
                e.retry_after = Some(1);
                e
            }
            400..=499 => ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Reason::InvalidRequest,
                message,
            )
            .code(if code == "invalid_parameter" {
                "invalid_value"
            } else {
                known.unwrap_or("invalid_request")
            }),
            502 => ApiError::new(
                StatusCode::BAD_GATEWAY,
                "server_error",
                Reason::Upstream,
                message,
            )
            .code(known.unwrap_or("upstream_error")),
            503 => {
                let mut e = ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "service_unavailable",
                    Reason::ShuttingDown,
                    message,
                )
                .code(known.unwrap_or("unavailable"));
                e.retry_after = Some(1);
                e
            }
            _ => ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                Reason::Internal,
                message,
            )
            .code(known.unwrap_or("internal_error")),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: self.kind.to_string(),
                param: self.param.clone(),
                code: self.code.map(str::to_string),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

/// Why a tenants file (or its specs) is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TenantsError {
    #[error("no [[tenant]] entries")]
    NoTenants,
    #[error("more than {max} tenants")]
    TooMany { max: usize },
    #[error("tenant #{index}: name must be 1 to 128 bytes")]
    BadName { index: usize },
    #[error("tenant `{tenant}`: api_key_sha256 must be 64 hex digits (the SHA-256 of the key)")]
    BadKeyHash { tenant: String },
    #[error("tenant `{tenant}`: {field} must be positive")]
    NotPositive { tenant: String, field: &'static str },
    #[error("tenant `{tenant}`: cache_group must be 1 to 128 bytes")]
    BadCacheGroup { tenant: String },
    #[error("tenant `{tenant}`: weight must be 1 to {max}")]
    BadWeight { tenant: String, max: u32 },
    #[error("tenant name `{tenant}` appears twice")]
    DuplicateName { tenant: String },
    #[error("tenant `{tenant}` has the same api_key_sha256 as another tenant")]
    DuplicateKey { tenant: String },
    /// The TOML itself (its parser's message).
    #[error("{0}")]
    Toml(String),
    #[error("[operator]: api_key_sha256 must be 64 hex digits (the SHA-256 of the key)")]
    OperatorKeyHash,
    #[error("[operator]: api_key_sha256 is also a tenant's key")]
    OperatorIsTenant,
}

/// Errors starting or running the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot read the tenants file {path}: {source}")]
    TenantsIo {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid tenants file {path}: {why}")]
    TenantsInvalid { path: String, why: TenantsError },
    #[error("cannot open the request log {path}: {source}")]
    RequestLog {
        path: String,
        source: std::io::Error,
    },
    #[error("the model has no chat template")]
    NoChatTemplate,
    #[error("invalid server configuration: {0}")]
    Config(String),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}
