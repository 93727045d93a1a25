//! The probe's HTTP edge against a server that refuses `logprobs`, end to
//! end over loopback: the first answer is asked for once more without the
//! parameter, every later one without it from the start, and other 4xx
//! answers (an over-long prompt) are not retried. The server is a few lines
//! of std: one connection at a time, a bounded number of them.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use probe::http::HttpEndpoint;
use probe::{Endpoint, Request};

/// What the fake server saw of one request: whether it asked for
/// `logprobs`, and whether its prompt was over the fake's limit.
#[derive(Debug, PartialEq)]
struct Seen {
    logprobs: bool,
    long: bool,
}

/// Reads one HTTP/1.1 request (headers, then `Content-Length` bytes).
fn read_request(stream: &TcpStream) -> Option<(String, serde_json::Value)> {
    let mut r = BufReader::new(stream);
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let path = line.split_whitespace().nth(1)?.to_string();
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).ok()?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().ok()?;
            }
        }
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body).ok()?;
    let v = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    Some((path, v))
}

fn respond(mut stream: &TcpStream, status: u16, body: serde_json::Value) {
    let body = body.to_string();
    let _ = write!(
        stream,
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
}

/// Serves `n` connections: `/v1/models`, and `/v1/completions` that
/// refuses `logprobs` (400, `param: "logprobs"`, as vLLM-style servers
/// name it) and prompts over 40 characters (400 context_length_exceeded).
fn refusing_server(n: usize) -> (String, mpsc::Receiver<Seen>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for stream in l.incoming().take(n) {
            let Ok(stream) = stream else { continue };
            let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
            let Some((path, v)) = read_request(&stream) else {
                continue;
            };
            if path == "/v1/models" {
                respond(&stream, 200, serde_json::json!({"data": [{"id": "m"}]}));
                continue;
            }
            let seen = Seen {
                logprobs: v.get("logprobs").is_some(),
                long: v["prompt"].as_str().unwrap_or("").len() > 40,
            };
            let (status, body) = if seen.logprobs {
                (
                    400,
                    serde_json::json!({"error": {"message": "logprobs is not supported",
                        "type": "invalid_request_error", "param": "logprobs"}}),
                )
            } else if seen.long {
                (
                    400,
                    serde_json::json!({"error": {"message": "too long",
                        "type": "invalid_request_error", "code": "context_length_exceeded"}}),
                )
            } else {
                (
                    200,
                    serde_json::json!({"choices": [{"text": "Paris"}],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 1}}),
                )
            };
            tx.send(seen).expect("the test reads every request");
            respond(&stream, status, body);
        }
    });
    (url, rx)
}

#[test]
fn a_server_refusing_logprobs_is_asked_again_without_them_and_never_again() {
    let (url, seen) = refusing_server(4);
    let ep = HttpEndpoint::new(&url, Duration::from_secs(10)).expect("http url");
    assert!(ep.reports_tokens());
    let short = Request {
        prompt: "The capital of France is".into(),
        max_tokens: 1,
        schema: None,
    };
    // First: refused for logprobs, asked once more without, answered.
    let c = ep.complete("k", &short).expect("answered");
    assert_eq!((c.status, c.text.as_str()), (200, "Paris"));
    assert_eq!(c.tokens, None, "no tokens from a server without logprobs");
    assert_eq!(c.prompt_tokens, Some(5));
    assert!(!ep.reports_tokens());
    let t = Duration::from_secs(10);
    assert_eq!(
        [seen.recv_timeout(t).unwrap(), seen.recv_timeout(t).unwrap()],
        [
            Seen {
                logprobs: true,
                long: false
            },
            Seen {
                logprobs: false,
                long: false
            }
        ]
    );
    // From then on, never asked for: an over-long prompt's 400 is its own
    // error, returned as it came, not retried.
    let long = Request {
        prompt: "word ".repeat(20),
        max_tokens: 1,
        schema: None,
    };
    let c = ep.complete("k", &long).expect("answered");
    assert_eq!(c.status, 400);
    assert_eq!(c.error_code.as_deref(), Some("context_length_exceeded"));
    assert_eq!(
        seen.recv_timeout(t).unwrap(),
        Seen {
            logprobs: false,
            long: true
        }
    );
    let c = ep.complete("k", &short).expect("answered");
    assert_eq!((c.status, c.tokens), (200, None));
    assert_eq!(
        seen.recv_timeout(t).unwrap(),
        Seen {
            logprobs: false,
            long: false
        }
    );
    // Nothing more was sent than those four.
    assert!(seen.recv_timeout(Duration::from_millis(200)).is_err());
}
