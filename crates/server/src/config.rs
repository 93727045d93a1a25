//! The HTTP layer's limits and settings.

use std::time::Duration;

use crate::error::ServerError;

/// Limits and settings of the HTTP layer.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The served model's id (the GGUF file stem); `default` is an alias.
    pub model_id: String,
    /// Other names clients may send as `model` (a known model's short
    /// name); `/v1/models` lists the id alone.
    pub model_aliases: Vec<String>,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Time to receive a request body.
    pub body_timeout: Duration,
    /// Largest request head (request line and headers).
    pub header_limit: usize,
    /// Most request headers.
    pub max_headers: usize,
    /// Time to receive a request head.
    pub header_timeout: Duration,
    /// Most open connections; beyond it a connection gets 503 (`/health`
    /// is still answered: [`door`](crate::door)).
    pub max_connections: usize,
    /// Most open connections from one client address; beyond it 429.
    pub max_connections_per_client: usize,
    /// Time a new connection has to send its first request byte.
    pub first_byte_timeout: Duration,
    /// `max_tokens` of a request that sets none: the rest of the window,
    /// capped at this (every request reserves pages for its whole
    /// `prompt + max_tokens` up front).
    pub default_max_tokens: usize,
    /// How long running requests may take to finish after a shutdown signal.
    pub shutdown_grace: Duration,
    /// Write prompt text to the request log.
    pub log_prompts: bool,
    /// `--tool-format`: how the model calls tools, where the template's
    /// own format should not be detected.
    pub tool_format: Option<tools::Format>,
    /// `--reasoning-parser`: how the model marks its reasoning, where the
    /// template's should not be detected.
    pub reasoning: Option<tools::ReasoningFormat>,
}

/// Default body limit: 4 MiB.
pub const MAX_BODY_BYTES_DEFAULT: usize = 4 << 20;

impl ServerConfig {
    pub fn new(model_id: impl Into<String>) -> ServerConfig {
        ServerConfig {
            model_id: model_id.into(),
            model_aliases: Vec::new(),
            max_body_bytes: MAX_BODY_BYTES_DEFAULT,
            body_timeout: Duration::from_secs(30),
            header_limit: 64 << 10,
            max_headers: 100,
            header_timeout: Duration::from_secs(30),
            max_connections: 1024,
            max_connections_per_client: 256,
            first_byte_timeout: Duration::from_secs(5),
            default_max_tokens: 1024,
            shutdown_grace: Duration::from_secs(30),
            log_prompts: false,
            tool_format: None,
            reasoning: None,
        }
    }

    /// Whether a request's `model` names the served model.
    pub fn serves_model(&self, name: &str) -> bool {
        name == self.model_id || name == "default" || self.model_aliases.iter().any(|a| a == name)
    }

    pub(crate) fn validate(&self) -> Result<(), ServerError> {
        let bad = |w: &str| Err(ServerError::Config(w.to_string()));
        if self.model_id.is_empty() {
            return bad("the model id is empty");
        }
        if self.max_body_bytes == 0 {
            return bad("the body limit must be positive");
        }
        if self.header_limit < 1024 {
            return bad("the header limit must be at least 1024 bytes");
        }
        if self.max_headers == 0
            || self.max_connections == 0
            || self.max_connections_per_client == 0
            || self.default_max_tokens == 0
        {
            return bad(
                "header count, connections (in all and per client) and default max_tokens must \
                 be positive",
            );
        }
        if self.first_byte_timeout.is_zero() {
            return bad("the first-byte timeout must be positive");
        }
        Ok(())
    }
}
