//! The command line's argument structs and what they configure: one
//! source of truth for `serve`, `prefill`, `decode`, `gateway` and the
//! children `serve --disaggregated` starts ([`NodeEngineArgs::to_cli_args`]
//! derives a child's engine flags from the struct itself, so a new engine
//! flag cannot miss the children).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use engine::EngineConfig;
use server::ServerConfig;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub http: HttpArgs,
    #[command(flatten)]
    pub engine: NodeEngineArgs,
    /// Run disaggregated: this process is the gateway and supervises one
    /// prefill and one decode node as child processes on loopback, which
    /// hand KV pages over TCP (checksums, canaries, deferred release). A
    /// child that dies is restarted (at most 5 times a minute, then the
    /// set comes down). Engine flags apply to both nodes.
    #[arg(long)]
    pub disaggregated: bool,
}

/// The HTTP side of `serve` and `gateway`.
#[derive(clap::Args, Debug, Clone)]
pub struct HttpArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on; 0 picks a free port. Once listening, the server
    /// prints `isoserve: listening on http://HOST:PORT` to stdout.
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Tenants file (TOML: `[[tenant]] name, api_key_sha256,
    /// max_concurrent, max_tokens_per_minute`). Without it, every request
    /// runs as one anonymous tenant and no API key is checked.
    #[arg(long)]
    pub tenants: Option<PathBuf>,
    /// Append one JSON line per request (id, tenant, token counts, timings,
    /// pages, outcome) to this file. Default: no request log.
    #[arg(long)]
    pub request_log: Option<PathBuf>,
    /// Also write prompt text to the request log (off: prompts are
    /// customer data).
    #[arg(long)]
    pub log_prompts: bool,
    /// Largest request body (bytes or with a suffix, e.g. 4MiB); larger
    /// bodies get 413.
    #[arg(long, default_value = "4MiB", value_parser = parse_bytes)]
    pub max_body: u64,
    /// max_tokens of a request that sets none: the rest of the context
    /// window, capped at this (pages for prompt + max_tokens are reserved
    /// up front).
    #[arg(long, default_value_t = 1024)]
    pub default_max_tokens: usize,
    /// Most open client connections; beyond it a connection is answered
    /// 503 and closed, but `/health` still answers.
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// Most open connections from one client address (beyond it: 429).
    /// Default: a quarter of --max-connections.
    #[arg(long)]
    pub max_connections_per_client: Option<usize>,
    /// Seconds a new connection has to send its first request byte before
    /// it is closed.
    #[arg(long, default_value_t = 5)]
    pub first_byte_timeout_s: u64,
    /// Serve `/metrics` and `/health` (no key) on this port too, on
    /// --metrics-host. With --tenants, `/metrics` on the API port wants the
    /// operator's key (tenants file `[operator]`).
    #[arg(long)]
    pub metrics_port: Option<u16>,
    /// Address of the --metrics-port listener.
    #[arg(long, default_value = "127.0.0.1")]
    pub metrics_host: String,
    /// After SIGTERM or Ctrl-C: seconds running requests get to finish
    /// before they are cancelled (new requests get 503 meanwhile).
    #[arg(long, default_value_t = 30)]
    pub shutdown_grace_secs: u64,
    /// A Jinja chat template file to render chat messages with, in place
    /// of the model's own (`tokenizer.chat_template`), as vLLM's and
    /// llama.cpp's `--chat-template` take one.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// How the model calls tools: `hermes` (`<tool_call>` JSON, Qwen's),
    /// or `generic` (tools described in a system message, a call as one
    /// JSON object). Default: the chat template's own format when it has
    /// one (it writes `<tool_call>`), else `generic`.
    #[arg(long, value_name = "FORMAT", value_parser = parse_tool_format)]
    pub tool_format: Option<tools::Format>,
    /// How the model marks its reasoning, split from the answer into
    /// `reasoning_content`: `think` (`<think>…</think>`; vLLM's names
    /// `deepseek_r1` and `qwen3` are aliases) or `none`. Default: `think`
    /// when the chat template writes `<think>`, else `none`.
    #[arg(long, value_name = "FORMAT", value_parser = parse_reasoning)]
    pub reasoning_parser: Option<tools::ReasoningFormat>,
}

fn parse_reasoning(s: &str) -> Result<tools::ReasoningFormat, String> {
    tools::ReasoningFormat::from_name(s).ok_or_else(|| {
        let names: Vec<&str> = tools::REASONING_FORMATS.iter().map(|(n, _)| *n).collect();
        format!(
            "`{s}` is not a reasoning format (one of: {})",
            names.join(", ")
        )
    })
}

fn parse_tool_format(s: &str) -> Result<tools::Format, String> {
    tools::Format::from_name(s).ok_or_else(|| {
        let names: Vec<&str> = tools::FORMATS.iter().map(|(n, _)| *n).collect();
        format!("`{s}` is not a tool format (one of: {})", names.join(", "))
    })
}

impl HttpArgs {
    /// The chat template to serve: `--chat-template`'s, or `own` (the
    /// model's).
    pub fn chat_template(
        &self,
        gguf: &gguf::GgufFile,
        own: Option<tokenizer::ChatTemplate>,
    ) -> anyhow::Result<Option<tokenizer::ChatTemplate>> {
        use anyhow::Context as _;
        let Some(path) = &self.chat_template else {
            return Ok(own);
        };
        let source = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the chat template {}", path.display()))?;
        let t = tokenizer::ChatTemplate::with_source(source, gguf)
            .with_context(|| format!("the chat template {} does not compile", path.display()))?;
        Ok(Some(t))
    }
}

/// The engine side of `serve`, `prefill` and `decode`.
#[derive(clap::Args, Debug, Clone, PartialEq, serde::Serialize)]
pub struct NodeEngineArgs {
    /// A GGUF file (architectures llama, qwen2, qwen3, gemma3) or a known
    /// model's name (`smollm2-135m`, the default; `gemma3-270m`), fetched if
    /// missing. Its file stem is the model id clients name (as do `default`
    /// and a known model's name).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Advertise a context window smaller than the model's (needed when
    /// the KV pool holds less than the model's window).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// KV pool memory budget: bytes, or with a suffix (512MiB, 1GiB, 2GB;
    /// K/M/G alone are binary).
    #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
    pub kv_memory: u64,
    /// KV pool size in pages (overrides --kv-memory).
    #[arg(long)]
    pub kv_pages: Option<u64>,
    /// Token slots per KV page.
    #[arg(long, default_value_t = 16)]
    pub page_size: usize,
    /// Requests that may wait for admission; beyond it new requests get 429.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// Requests the engine runs at once (at most --step-tokens).
    #[arg(long, default_value_t = 32)]
    pub max_running: usize,
    /// Token budget of one forward step (decode rows plus prefill chunks).
    #[arg(long, default_value_t = 256)]
    pub step_tokens: usize,
    /// PD only: KV pages a transfer may have in flight before decode
    /// acknowledges them (the bounded transfer batch).
    #[arg(long, default_value_t = 8)]
    pub transfer_window_pages: u32,
    /// Reuse the KV of prompts' shared prefixes (whole pages): `tenant`
    /// (the default) within each tenant's cache scope — or its
    /// `cache_group` in the tenants file, narrowed by a request's
    /// `cache_salt`/`prompt_cache_key` — or `off`.
    #[arg(long, value_enum, default_value_t = PrefixCacheArg::Tenant)]
    pub prefix_cache: PrefixCacheArg,
    /// How the KV pool stores keys and values: `f16` (the default, as
    /// llama.cpp's), `f32` (twice the memory and bandwidth) or `q8_0`
    /// (GGML's 8-bit blocks: 1.88× the tokens of f16 per GiB, about 0.4% of
    /// each value's block maximum lost). PD nodes must agree (the pairing
    /// handshake compares it).
    #[arg(long, value_enum, default_value_t = KvDtypeArg::F16)]
    pub kv_dtype: KvDtypeArg,
    /// Speculative decoding's drafts besides a request's `prediction`
    /// (which is always verified): `off`; `ngram` — prompt lookup, the
    /// output's tail looked up in the request's own prompt and output
    /// (vLLM's `ngram`, llama.cpp's lookup decoding); or `suffix` — prompt
    /// lookup and the suffix cache, earlier requests' prompts and outputs
    /// of the same cache scope (vLLM's `suffix`; needs --prefix-cache
    /// tenant). Output is unchanged.
    #[arg(long, value_enum, default_value_t = SpeculativeArg::Off)]
    pub speculative: SpeculativeArg,
    /// Draft tokens a request verifies in one step at most (prompt
    /// lookup); adapted per request below it.
    #[arg(long, default_value_t = 16, value_parser = spec_tokens)]
    pub num_speculative_tokens: usize,
    /// The shortest and longest tail of the output prompt lookup looks up.
    #[arg(long, default_value_t = 2, value_parser = ngram_size)]
    pub prompt_lookup_min: usize,
    #[arg(long, default_value_t = 4, value_parser = ngram_size)]
    pub prompt_lookup_max: usize,
    /// Draft tokens a request verifies in one step at most from its
    /// `prediction` (OpenAI's Predicted Outputs).
    #[arg(long, default_value_t = 32, value_parser = spec_tokens)]
    pub prediction_draft_tokens: usize,
    /// Rows one step gives to drafts at most, less one per decoding
    /// request: speculation gives way as the batch grows, and stops from
    /// this many decoding requests on (0: never speculate, predictions
    /// included).
    #[arg(long, default_value_t = 32)]
    pub speculative_rows: usize,
    /// The suffix cache's tokens per cache scope (`--speculative suffix`;
    /// at most 256 scopes are kept, the least recently used going first).
    #[arg(long, default_value_t = 16384, value_parser = suffix_tokens)]
    pub suffix_cache_tokens: usize,
    /// vLLM's form of the above, as JSON: `{"method": "ngram",
    /// "num_speculative_tokens": 5, "prompt_lookup_min": 2,
    /// "prompt_lookup_max": 4}` (overrides those flags; an unknown key is
    /// refused).
    #[arg(long, value_parser = speculative_config)]
    pub speculative_config: Option<String>,
    /// A smaller GGUF with the model's vocabulary (checked at start: a
    /// difference is refused and named) that drafts tokens where a
    /// request's prediction and the lookups have nothing to follow
    /// (vLLM's draft model, llama.cpp's `--model-draft`); `isoserve
    /// make-draft` writes one from the model's first layers. Its K/V has
    /// a pool of its own; output is unchanged.
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
}

/// `--speculative off|ngram`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SpeculativeArg {
    Off,
    Ngram,
    Suffix,
}

fn suffix_tokens(v: &str) -> Result<usize, String> {
    let n: usize = v.parse().map_err(|e| format!("`{v}`: {e}"))?;
    if n > engine::SUFFIX_TOKENS_MAX {
        return Err(format!("{n} is more than {}", engine::SUFFIX_TOKENS_MAX));
    }
    Ok(n)
}

fn spec_tokens(v: &str) -> Result<usize, String> {
    let n: usize = v.parse().map_err(|e| format!("`{v}`: {e}"))?;
    if !(1..=engine::SPEC_K_MAX).contains(&n) {
        return Err(format!("{n} is not in 1..={}", engine::SPEC_K_MAX));
    }
    Ok(n)
}

/// The longest n-gram prompt lookup matches.
const NGRAM_MAX: usize = 16;

fn ngram_size(v: &str) -> Result<usize, String> {
    let n: usize = v.parse().map_err(|e| format!("`{v}`: {e}"))?;
    if !(1..=NGRAM_MAX).contains(&n) {
        return Err(format!("{n} is not in 1..={NGRAM_MAX}"));
    }
    Ok(n)
}

/// vLLM's `--speculative-config`, the keys this server honours.
#[derive(serde::Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct SpeculativeConfig {
    method: Option<String>,
    /// The draft model's path (`"method": "draft_model"`, vLLM's form).
    model: Option<PathBuf>,
    num_speculative_tokens: Option<usize>,
    prompt_lookup_min: Option<usize>,
    prompt_lookup_max: Option<usize>,
}

fn parse_speculative_config(v: &str) -> Result<SpeculativeConfig, String> {
    let c: SpeculativeConfig = serde_json::from_str(v).map_err(|e| e.to_string())?;
    match c.method.as_deref() {
        None | Some("ngram") | Some("suffix") | Some("draft_model") => {}
        Some(m) => {
            return Err(format!(
                "method `{m}`: the methods served are `ngram`, `suffix` and `draft_model`"
            ))
        }
    }
    match (c.method.as_deref(), &c.model) {
        (Some("draft_model"), None) => {
            return Err("method `draft_model` needs `model`, the draft's GGUF".into())
        }
        (Some("ngram") | Some("suffix"), Some(_)) => {
            return Err("`model` is the draft model's: it needs method `draft_model`".into())
        }
        _ => {}
    }
    if let Some(n) = c.num_speculative_tokens {
        spec_tokens(&n.to_string()).map_err(|e| format!("num_speculative_tokens: {e}"))?;
    }
    for (k, n) in [
        ("prompt_lookup_min", c.prompt_lookup_min),
        ("prompt_lookup_max", c.prompt_lookup_max),
    ] {
        if let Some(n) = n {
            ngram_size(&n.to_string()).map_err(|e| format!("{k}: {e}"))?;
        }
    }
    Ok(c)
}

fn speculative_config(v: &str) -> Result<String, String> {
    parse_speculative_config(v).map(|_| v.to_string())
}

/// `--kv-dtype f32|f16|q8_0`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtypeArg {
    F32,
    F16,
    #[value(name = "q8_0")]
    #[serde(rename = "q8_0")]
    Q8_0,
}

impl KvDtypeArg {
    pub fn dtype(self) -> kv::DType {
        match self {
            KvDtypeArg::F32 => kv::DType::F32,
            KvDtypeArg::F16 => kv::DType::F16,
            KvDtypeArg::Q8_0 => kv::DType::Q8_0,
        }
    }
}

/// `--prefix-cache off|tenant`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefixCacheArg {
    Off,
    Tenant,
}

/// `1234`, `4KiB`, `512MiB`, `1GiB`, `2GB`, `64k`, `1g`: bytes.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let unit = unit.trim().to_ascii_lowercase();
    let mult: u64 = match unit.as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => {
            return Err(format!(
                "unknown size unit `{unit}` (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            ))
        }
    };
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 512MiB)"))?;
    let bytes = value * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("`{s}` is out of range"));
    }
    Ok(bytes as u64)
}

#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct NodeArgs {
    /// Address to listen on for the PD protocol.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port; 0 picks a free one. Once listening, the node prints
    /// `isoserve: ROLE node NAME listening on HOST:PORT` to stdout.
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// This node's name (unique in a deployment).
    #[arg(long)]
    pub node: Option<String>,
    /// Serve `GET /metrics` (pool, transfer checks, transport) on this
    /// port of --host; 0 picks one. Once listening, the node prints
    /// `isoserve: metrics on http://HOST:PORT/metrics`. Default: none.
    #[arg(long)]
    pub metrics_port: Option<u16>,
    /// On SIGTERM, refuse new requests (the gateway places them on other
    /// nodes) and wait this long for those in flight before exiting; a
    /// second signal ends at once. 0: exit at once.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub drain_grace_secs: u64,
    #[command(flatten)]
    pub tls: TransferTlsArgs,
    #[command(flatten)]
    pub otlp: OtlpArgs,
    #[command(flatten)]
    pub engine: NodeEngineArgs,
}

/// Request spans over OTLP (gateway and nodes).
#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct OtlpArgs {
    /// Export request spans over OTLP/HTTP to this collector
    /// (`http://HOST:4318`, or the full traces URL): the gateway's
    /// `request` span, under the caller's W3C `traceparent`; prefill's
    /// `queue` and `prefill`; decode's `queue`, `transfer` and `decode` —
    /// one trace per request across hosts. Spans are logged either way
    /// (target `isoserve::span`); they carry ids and counts, never prompts.
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// `http/protobuf` or `http/json`.
    #[arg(long, default_value = "http/protobuf", value_parser = ["http/protobuf", "http/json"])]
    pub otlp_protocol: String,
}

impl OtlpArgs {
    /// Where spans go for `service` (`isoserve-gateway`, …); `instance`
    /// names this process. The exporter's HTTP client brings its own
    /// runtime, so it is built on a thread of its own.
    pub fn telemetry(&self, service: &str, instance: &str) -> anyhow::Result<telemetry::Telemetry> {
        let Some(endpoint) = self.otlp_endpoint.clone() else {
            return Ok(telemetry::Telemetry::logs_only(service));
        };
        let protocol: telemetry::OtlpProtocol = self.otlp_protocol.parse()?;
        let (service, instance) = (service.to_string(), instance.to_string());
        let t = std::thread::spawn(move || {
            telemetry::Telemetry::otlp(&service, &instance, &endpoint, protocol)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the OTLP exporter's setup panicked"))??;
        Ok(t)
    }
}

/// Mutual TLS on the transfer channel (K14), for prefill, decode and the
/// gateway alike.
#[derive(clap::Args, Debug, Clone, PartialEq, Default)]
pub struct TransferTlsArgs {
    /// This node's certificate chain (PEM), signed by --transfer-tls-ca
    /// and naming --transfer-tls-server-name. With --transfer-tls-key and
    /// --transfer-tls-ca, every transfer connection is mutually
    /// authenticated TLS 1.3; a peer without a certificate from that CA is
    /// refused before any message is read (`isoserve transfer-certs` writes
    /// a CA and node certificates).
    #[arg(long, value_name = "PEM")]
    pub transfer_tls_cert: Option<PathBuf>,
    /// This node's private key (PEM).
    #[arg(long, value_name = "PEM")]
    pub transfer_tls_key: Option<PathBuf>,
    /// The CA certificate peers must chain to (PEM).
    #[arg(long, value_name = "PEM")]
    pub transfer_tls_ca: Option<PathBuf>,
    /// The DNS name every node certificate carries; dialled nodes must
    /// present it.
    #[arg(long, default_value = transport::tls::DEFAULT_SERVER_NAME)]
    pub transfer_tls_server_name: String,
    /// Allow plaintext transfer on a non-loopback address: KV pages and
    /// prompts then cross the network unencrypted and anyone who can reach
    /// the port talks the protocol. Without TLS and without this flag, a
    /// node or gateway whose transfer addresses are not loopback refuses to
    /// start.
    #[arg(long)]
    pub insecure_transfer: bool,
}

/// Whether `host` (an address or `localhost`, with or without a port)
/// names only this machine.
pub fn is_loopback_host(host: &str) -> bool {
    let h = host.trim();
    // `dns:NAME:PORT` (discovery) is loopback when NAME is.
    let h = h.strip_prefix("dns:").unwrap_or(h);
    let h = h
        .parse::<std::net::SocketAddr>()
        .map(|a| a.ip().to_string())
        .unwrap_or_else(|_| match h.rsplit_once(':') {
            Some((name, port)) if port.parse::<u16>().is_ok() && !name.contains(':') => {
                name.to_string()
            }
            _ => h.to_string(),
        });
    let h = h.trim_start_matches('[').trim_end_matches(']');
    h.eq_ignore_ascii_case("localhost")
        || h.parse::<std::net::IpAddr>()
            .map(|ip| ip.is_loopback())
            .unwrap_or(false)
}

impl TransferTlsArgs {
    /// The transport configuration these flags ask for, checked against the
    /// addresses the transfer channel uses (`what` names them in errors):
    /// TLS when the three files are given; plaintext on loopback; plaintext
    /// elsewhere only with --insecure-transfer.
    pub fn transport_config(
        &self,
        addrs: &[&str],
        what: &str,
    ) -> Result<transport::TransportConfig> {
        let files = [
            &self.transfer_tls_cert,
            &self.transfer_tls_key,
            &self.transfer_tls_ca,
        ];
        let given = files.iter().filter(|f| f.is_some()).count();
        let mut cfg = transport::TransportConfig::default();
        if given == 3 {
            let settings = transport::TlsSettings {
                cert: self.transfer_tls_cert.clone().unwrap_or_default(),
                key: self.transfer_tls_key.clone().unwrap_or_default(),
                ca: self.transfer_tls_ca.clone().unwrap_or_default(),
                server_name: self.transfer_tls_server_name.clone(),
            };
            cfg.tls = Some(transport::TransportTls::load(&settings).context("transfer TLS")?);
            return Ok(cfg);
        }
        if given != 0 {
            anyhow::bail!(
                "give --transfer-tls-cert, --transfer-tls-key and --transfer-tls-ca together"
            );
        }
        if let Some(a) = addrs.iter().find(|a| !is_loopback_host(a)) {
            if !self.insecure_transfer {
                anyhow::bail!(
                    "{what} `{a}` is not a loopback address, and the transfer channel carries \
                     prompts and KV pages: give --transfer-tls-cert, --transfer-tls-key and \
                     --transfer-tls-ca (mutual TLS), or --insecure-transfer to send them in \
                     the clear"
                );
            }
            tracing::warn!(
                "--insecure-transfer: {what} `{a}` is not loopback and the transfer channel is \
                 plaintext and unauthenticated"
            );
        }
        Ok(cfg)
    }
}

#[derive(clap::Args, Debug)]
pub struct GatewayArgs {
    /// A prefill node's `host:port` (repeat for several), or
    /// `dns:NAME:PORT`: every address NAME resolves to, re-resolved every
    /// 5 s (a Kubernetes headless Service) — addresses that appear join,
    /// ones that vanish stop getting requests.
    #[arg(long, required = true)]
    pub prefill: Vec<String>,
    /// A decode node's `host:port` or `dns:NAME:PORT` (repeat for several).
    #[arg(long, required = true)]
    pub decode: Vec<String>,
    /// The GGUF the nodes serve (tokenizer, chat template, fingerprint);
    /// default: the cached default model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Advertise a window smaller than the model's (the gateway advertises
    /// the minimum over this, the model and every node's limit).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// A node's metrics listener as NAME=HOST:PORT (repeat for each node):
    /// its samples join the gateway's `/metrics` with a `node` label, and
    /// its pool and transfers the operator console. Default: none.
    #[arg(long, value_name = "NAME=HOST:PORT", value_parser = parse_node_metrics)]
    pub node_metrics: Vec<(String, std::net::SocketAddr)>,
    #[command(flatten)]
    pub tls: TransferTlsArgs,
    #[command(flatten)]
    pub otlp: OtlpArgs,
    #[command(flatten)]
    pub http: HttpArgs,
}

/// `--node-metrics NAME=HOST:PORT`: the name and the (first) address
/// HOST:PORT resolves to.
fn parse_node_metrics(v: &str) -> Result<(String, std::net::SocketAddr), String> {
    use std::net::ToSocketAddrs;
    let (name, addr) = v
        .split_once('=')
        .ok_or_else(|| format!("`{v}`: expected NAME=HOST:PORT"))?;
    if name.is_empty() || name.len() > 64 {
        return Err(format!("`{v}`: the node name must be 1 to 64 bytes"));
    }
    let resolved = addr
        .to_socket_addrs()
        .map_err(|e| format!("`{addr}`: {e}"))?
        .next()
        .ok_or_else(|| format!("`{addr}` resolves to no address"))?;
    Ok((name.to_string(), resolved))
}

/// The draft model: `--draft-model`, or `--speculative-config`'s `model`
/// (not both).
fn draft_model(e: &NodeEngineArgs) -> Result<Option<PathBuf>> {
    let from_json = match &e.speculative_config {
        Some(json) => {
            parse_speculative_config(json)
                .map_err(|why| anyhow::anyhow!("--speculative-config: {why}"))?
                .model
        }
        None => None,
    };
    match (e.draft_model.clone(), from_json) {
        (Some(_), Some(_)) => anyhow::bail!(
            "--draft-model and --speculative-config's `model` both name a draft model: give one"
        ),
        (Some(p), None) | (None, Some(p)) => {
            if !p.is_file() {
                anyhow::bail!("--draft-model {}: no such file", p.display());
            }
            Ok(Some(p))
        }
        (None, None) => Ok(None),
    }
}

/// The engine configuration of `serve`, `prefill` and `decode`.
pub(crate) fn engine_config(e: &NodeEngineArgs) -> Result<EngineConfig> {
    let mut spec = engine::Speculation {
        method: match e.speculative {
            SpeculativeArg::Off => engine::SpecMethod::Off,
            SpeculativeArg::Ngram => engine::SpecMethod::Ngram,
            SpeculativeArg::Suffix => engine::SpecMethod::Suffix,
        },
        k_max: e.num_speculative_tokens,
        ngram_min: e.prompt_lookup_min,
        ngram_max: e.prompt_lookup_max,
        prediction_k_max: e.prediction_draft_tokens,
        rows_max: e.speculative_rows,
        suffix_tokens: e.suffix_cache_tokens,
    };
    if let Some(json) = &e.speculative_config {
        let c = parse_speculative_config(json)
            .map_err(|why| anyhow::anyhow!("--speculative-config: {why}"))?;
        spec.method = match (c.method.as_deref(), &c.model) {
            (Some("suffix"), _) => engine::SpecMethod::Suffix,
            // A draft model alone: no lookups besides the predictions.
            (Some("draft_model"), _) | (None, Some(_)) => engine::SpecMethod::Off,
            _ => engine::SpecMethod::Ngram,
        };
        spec.k_max = c.num_speculative_tokens.unwrap_or(spec.k_max);
        spec.ngram_min = c.prompt_lookup_min.unwrap_or(spec.ngram_min);
        spec.ngram_max = c.prompt_lookup_max.unwrap_or(spec.ngram_max);
    }
    if spec.method == engine::SpecMethod::Suffix && e.prefix_cache == PrefixCacheArg::Off {
        anyhow::bail!(
            "--speculative suffix needs the prefix cache (--prefix-cache tenant): the suffix \
             cache's entries live and go with their scope's cached pages"
        );
    }
    if spec.ngram_min > spec.ngram_max {
        anyhow::bail!(
            "the prompt lookup's shortest tail ({}) is longer than its longest ({})",
            spec.ngram_min,
            spec.ngram_max
        );
    }
    Ok(EngineConfig {
        page_size_tokens: e.page_size,
        kv_pages: e.kv_pages,
        kv_memory_bytes: e.kv_memory,
        max_context: e.max_context,
        step_tokens: e.step_tokens,
        max_running: e.max_running,
        max_queue: e.max_queue,
        prefix_cache: match e.prefix_cache {
            PrefixCacheArg::Off => engine::PrefixCache::Off,
            PrefixCacheArg::Tenant => engine::PrefixCache::Tenant,
        },
        kv_dtype: e.kv_dtype.dtype(),
        speculation: spec,
        draft_model: draft_model(e)?,
        ..EngineConfig::default()
    })
}

/// The HTTP layer's configuration of `serve` and `gateway`.
pub(crate) fn server_config(model_id: &str, http: &HttpArgs) -> Result<ServerConfig> {
    let mut scfg = ServerConfig::new(model_id.to_string());
    // `--model gemma3-270m` serves `gemma-3-270m-q4_k_m.gguf`: the name the
    // operator typed is one a client will send.
    scfg.model_aliases = crate::fetch::known_model_of_id(model_id)
        .map(|m| vec![m.name.to_string()])
        .unwrap_or_default();
    scfg.max_body_bytes = usize::try_from(http.max_body).context("--max-body is too large")?;
    scfg.default_max_tokens = http.default_max_tokens.max(1);
    scfg.max_connections = http.max_connections.max(1);
    scfg.max_connections_per_client = http
        .max_connections_per_client
        .unwrap_or(scfg.max_connections / 4)
        .clamp(1, scfg.max_connections);
    scfg.first_byte_timeout = Duration::from_secs(http.first_byte_timeout_s.max(1));
    scfg.shutdown_grace = Duration::from_secs(http.shutdown_grace_secs);
    scfg.log_prompts = http.log_prompts;
    scfg.tool_format = http.tool_format;
    scfg.reasoning = http.reasoning_parser;
    Ok(scfg)
}

impl NodeEngineArgs {
    /// These arguments as command-line flags (`--page-size 16 ...`), for a
    /// child process that parses them back with the same struct. Derived
    /// from the struct's fields (serde), not listed by hand: a field is a
    /// flag of the same name in kebab case (clap's rule), `None` is left
    /// out, `true` is a bare flag.
    pub fn to_cli_args(&self) -> Vec<String> {
        let value = serde_json::to_value(self).expect("plain data serialises");
        let mut out = Vec::new();
        for (field, v) in value.as_object().expect("a struct is an object") {
            let flag = format!("--{}", field.replace('_', "-"));
            match v {
                serde_json::Value::Null | serde_json::Value::Bool(false) => {}
                serde_json::Value::Bool(true) => out.push(flag),
                serde_json::Value::String(s) => out.extend([flag, s.clone()]),
                other => out.extend([flag, other.to_string()]),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::{engine_config, parse_bytes, NodeEngineArgs};
    use clap::{Args, Parser};

    #[test]
    fn loopback_hosts_are_told_apart_from_the_network() {
        use super::is_loopback_host as lo;
        for h in [
            "127.0.0.1",
            "127.0.0.1:7000",
            "localhost",
            "localhost:9",
            "::1",
            "[::1]:80",
            "127.9.9.9",
            "dns:localhost:7100",
        ] {
            assert!(lo(h), "{h}");
        }
        for h in [
            "0.0.0.0",
            "10.0.0.1:7000",
            "::",
            "[::]:80",
            "node.example",
            "prefill-0:7100",
            "dns:x:1",
            "",
        ] {
            assert!(!lo(h), "{h}");
        }
    }

    /// K14 at the command line: plaintext off loopback only with the
    /// explicit flag; TLS files all three or none.
    #[test]
    fn plaintext_transfer_off_loopback_needs_the_explicit_flag() {
        let plain = super::TransferTlsArgs::default();
        assert!(plain.transport_config(&["127.0.0.1"], "--host").is_ok());
        let err = plain
            .transport_config(&["127.0.0.1:1", "10.0.0.2:7000"], "node address")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`10.0.0.2:7000` is not a loopback address"),
            "{err}"
        );
        let insecure = super::TransferTlsArgs {
            insecure_transfer: true,
            ..plain.clone()
        };
        let cfg = insecure.transport_config(&["0.0.0.0"], "--host").unwrap();
        assert!(cfg.tls.is_none());
        let partial = super::TransferTlsArgs {
            transfer_tls_cert: Some("/x.pem".into()),
            ..plain
        };
        let err = partial
            .transport_config(&["127.0.0.1"], "--host")
            .unwrap_err();
        assert!(err.to_string().contains("together"), "{err}");
    }

    /// `serve --disaggregated` hands its engine flags to the children
    /// through [`NodeEngineArgs::to_cli_args`]: every flag clap knows for
    /// the struct is there, and a child parses them back to the same
    /// arguments and engine configuration.
    #[test]
    fn every_engine_flag_of_serve_disaggregated_reaches_the_children() {
        // A value other than the default for every engine flag.
        let draft = std::env::temp_dir().join(format!("isoserve-args-{}.gguf", std::process::id()));
        std::fs::write(&draft, b"a draft (only its existence is checked here)").unwrap();
        let parent = [
            "isoserve",
            "serve",
            "--disaggregated",
            "--model",
            "/m/x.gguf",
            "--max-context",
            "4000",
            "--kv-memory",
            "3MiB",
            "--kv-pages",
            "77",
            "--page-size",
            "32",
            "--max-queue",
            "9",
            "--max-running",
            "5",
            "--step-tokens",
            "100",
            "--prefix-cache",
            "off",
            "--transfer-window-pages",
            "4",
            "--kv-dtype",
            "q8_0",
            "--speculative",
            "ngram",
            "--num-speculative-tokens",
            "7",
            "--prompt-lookup-min",
            "1",
            "--prompt-lookup-max",
            "3",
            "--prediction-draft-tokens",
            "9",
            "--speculative-rows",
            "11",
            "--suffix-cache-tokens",
            "999",
            "--speculative-config",
            r#"{"method": "ngram", "num_speculative_tokens": 6}"#,
            "--draft-model",
            draft.to_str().unwrap(),
        ];
        let crate::Cmd::Serve(serve) = crate::Cli::try_parse_from(parent).expect("parses").command
        else {
            panic!("not serve");
        };
        let flags = serve.engine.to_cli_args();
        let cmd = NodeEngineArgs::augment_args(clap::Command::new("engine"));
        for a in cmd.get_arguments() {
            let long = a.get_long().expect("every engine flag is a long flag");
            assert!(
                flags.contains(&format!("--{long}")),
                "--{long} is not passed to the children: {flags:?}"
            );
        }
        let mut child = vec!["isoserve".to_string(), "prefill".into()];
        child.extend(flags);
        let crate::Cmd::Prefill(node) = crate::Cli::try_parse_from(&child).expect("parses").command
        else {
            panic!("not prefill");
        };
        assert_eq!(node.engine, serve.engine);
        assert_eq!(
            format!("{:?}", engine_config(&node.engine).unwrap()),
            format!("{:?}", engine_config(&serve.engine).unwrap())
        );
        let _ = std::fs::remove_file(&draft);
    }

    #[test]
    fn sizes_parse_with_and_without_units() {
        assert_eq!(parse_bytes("1234"), Ok(1234));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("1g"), Ok(1 << 30));
        assert_eq!(parse_bytes("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_bytes("1.5KiB"), Ok(1536));
        assert_eq!(parse_bytes(" 4 MiB "), Ok(4 << 20));
        assert!(parse_bytes("12XB").is_err());
        assert!(parse_bytes("MiB").is_err());
        assert!(parse_bytes("-1").is_err());
        assert!(parse_bytes("1e30TiB").is_err());
    }
}
