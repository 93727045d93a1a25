//! The I/O edge: an [`Endpoint`] over plain HTTP (ureq). It contacts only
//! the URL it was given.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::{Completion, Endpoint, ModelInfo, ProbeError, Request};

/// An OpenAI-compatible server at `base` (e.g. `http://127.0.0.1:8080`).
pub struct HttpEndpoint {
    base: String,
    model: Option<String>,
    agent: ureq::Agent,
    /// Ask for `logprobs: 0` (the tokens of each answer, for the markers
    /// check); cleared, once, if the server refuses the parameter.
    tokens: AtomicBool,
}

impl HttpEndpoint {
    /// `request_timeout`: the limit on one request, connect to last byte.
    pub fn new(url: &str, request_timeout: Duration) -> Result<HttpEndpoint, ProbeError> {
        let base = url
            .trim_end_matches('/')
            .trim_end_matches("/v1")
            .to_string();
        if !base.starts_with("http://") {
            return Err(ProbeError::Config(format!(
                "--url must be an http:// URL (https needs a TLS build of the probe), got `{url}`"
            )));
        }
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(request_timeout))
            .http_status_as_error(false)
            .build()
            .into();
        Ok(HttpEndpoint {
            base,
            model: None,
            agent,
            tokens: AtomicBool::new(true),
        })
    }

    /// The model id to put in requests (from `/v1/models`).
    pub fn set_model(&mut self, id: String) {
        self.model = Some(id);
    }

    /// Whether answers come with their tokens (the server took `logprobs`).
    pub fn reports_tokens(&self) -> bool {
        self.tokens.load(Ordering::Relaxed)
    }

    fn post(
        &self,
        key: &str,
        req: &Request,
        tokens: bool,
    ) -> Result<(u16, Value, f64), ProbeError> {
        let url = format!("{}/v1/completions", self.base);
        let mut body = json!({
            "model": self.model.as_deref().unwrap_or("default"),
            "prompt": req.prompt,
            "max_tokens": req.max_tokens,
            "temperature": 0,
            "stream": false,
        });
        if tokens {
            body["logprobs"] = json!(0);
        }
        if let Some(schema) = &req.schema {
            let schema: Value = serde_json::from_str(schema).unwrap_or(Value::Null);
            body["response_format"] = json!({"type": "json_schema",
                "json_schema": {"name": "probe", "schema": schema}});
        }
        let start = Instant::now();
        let timed_out = || ProbeError::TimedOut {
            url: self.base.clone(),
            what: format!(
                "POST /v1/completions of a {}-word prompt, max_tokens {}",
                req.prompt.split_whitespace().count(),
                req.max_tokens
            ),
            after_s: start.elapsed().as_secs_f64(),
        };
        let mut resp = self
            .agent
            .post(&url)
            .header("Authorization", &format!("Bearer {key}"))
            .send_json(&body)
            .map_err(|e| match e {
                ureq::Error::Timeout(_) => timed_out(),
                e => self.unreachable(e),
            })?;
        let status = resp.status().as_u16();
        // The limit covers the body too: a body cut off by it is a
        // timeout, not an answer without JSON.
        let v = match resp.body_mut().read_to_string() {
            Ok(text) => serde_json::from_str(&text).unwrap_or(Value::Null),
            Err(ureq::Error::Timeout(_)) => return Err(timed_out()),
            Err(_) => Value::Null,
        };
        Ok((status, v, start.elapsed().as_secs_f64()))
    }

    fn unreachable(&self, e: ureq::Error) -> ProbeError {
        ProbeError::Unreachable {
            url: self.base.clone(),
            why: e.to_string(),
        }
    }
}

fn read_json(resp: &mut ureq::http::Response<ureq::Body>) -> Option<Value> {
    let text = resp.body_mut().read_to_string().ok()?;
    serde_json::from_str(&text).ok()
}

impl Endpoint for HttpEndpoint {
    fn model(&self, key: &str) -> Result<ModelInfo, ProbeError> {
        let url = format!("{}/v1/models", self.base);
        let mut resp = self
            .agent
            .get(&url)
            .header("Authorization", &format!("Bearer {key}"))
            .call()
            .map_err(|e| self.unreachable(e))?;
        let status = resp.status().as_u16();
        let v = read_json(&mut resp).ok_or_else(|| ProbeError::NotOpenAi {
            url: url.clone(),
            why: format!("GET /v1/models answered {status} without JSON"),
        })?;
        let first = v["data"].get(0).ok_or_else(|| ProbeError::NotOpenAi {
            url: url.clone(),
            why: format!("GET /v1/models answered {status} with no `data[0]`"),
        })?;
        let id = first["id"].as_str().unwrap_or("default").to_string();
        let context_window = first["max_model_len"]
            .as_u64()
            .or_else(|| first["context_length"].as_u64())
            .or_else(|| first["context_window"].as_u64());
        Ok(ModelInfo { id, context_window })
    }

    fn complete(&self, key: &str, req: &Request) -> Result<Completion, ProbeError> {
        let mut tokens = self.reports_tokens();
        let (mut status, mut v, mut latency_s) = self.post(key, req, tokens)?;
        // A server without logprobs refuses the parameter: ask once more
        // without it, and from then on never.
        if tokens && (400..500).contains(&status) && refuses_logprobs(&v) {
            self.tokens.store(false, Ordering::Relaxed);
            tokens = false;
            (status, v, latency_s) = self.post(key, req, false)?;
        }
        let usage = &v["usage"];
        let error = &v["error"];
        Ok(Completion {
            status,
            text: v["choices"][0]["text"].as_str().unwrap_or("").to_string(),
            prompt_tokens: usage["prompt_tokens"].as_u64(),
            completion_tokens: usage["completion_tokens"].as_u64(),
            tokens: tokens
                .then(|| v["choices"][0]["logprobs"]["tokens"].as_array())
                .flatten()
                .map(|t| {
                    t.iter()
                        .map(|x| x.as_str().unwrap_or("").to_string())
                        .collect()
                }),
            error_code: error["code"]
                .as_str()
                .or_else(|| error["type"].as_str())
                .map(str::to_string),
            latency_s,
            cached_tokens: usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
        })
    }
}

/// An error answer that names `logprobs` as the parameter at fault.
fn refuses_logprobs(v: &Value) -> bool {
    let e = &v["error"];
    e["param"].as_str() == Some("logprobs")
        || e["message"]
            .as_str()
            .is_some_and(|m| m.contains("logprobs"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 18: a server that takes the request and never answers is a
    /// timed-out request, named with its limit — not "cannot reach".
    #[test]
    fn a_request_past_its_limit_says_it_timed_out_and_after_how_long() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let holder = std::thread::spawn(move || {
            let (mut c, _) = listener.accept().unwrap();
            c.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
            let mut buf = [0u8; 4096];
            let _ = std::io::Read::read(&mut c, &mut buf);
            std::thread::sleep(Duration::from_millis(1500));
        });
        let ep = HttpEndpoint::new(&url, Duration::from_millis(500)).unwrap();
        let req = Request {
            prompt: "one two three".into(),
            max_tokens: 4,
            schema: None,
        };
        let err = ep.complete("k", &req).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, ProbeError::TimedOut { .. }), "{text}");
        assert!(text.contains("got no answer within 0.5 s"), "{text}");
        assert!(
            text.contains("3-word prompt") && !text.contains("cannot reach"),
            "{text}"
        );
        holder.join().unwrap();
    }

    #[test]
    fn a_refusal_naming_logprobs_is_told_from_other_errors() {
        let param = json!({"error": {"message": "unsupported", "param": "logprobs"}});
        let message = json!({"error": {"message": "logprobs is not supported"}});
        let other = json!({"error": {"message": "max_tokens too large", "param": "max_tokens"}});
        assert!(refuses_logprobs(&param));
        assert!(refuses_logprobs(&message));
        assert!(!refuses_logprobs(&other));
        assert!(!refuses_logprobs(&Value::Null));
    }
}
