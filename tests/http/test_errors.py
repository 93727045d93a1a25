"""Every error path with raw HTTP: status, OpenAI error shape, the field
named, and afterwards the rejection counters and a free pool."""

import http.client
import json
import socket
import time

import pytest
import requests

from conftest import (LIMITED_KEY, TENANT_KEYS, Server, Stream, assert_pool_clean, auth,
                      wait_pool_idle)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSGS = [{"role": "user", "content": "Say hi."}]


def post(server, path, body, headers=None, raw=False):
    data = body if raw else json.dumps(body)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    return requests.post(server.url(path), data=data, headers=h, timeout=60)


def assert_error(r, status, code=None, param=None, kind="invalid_request_error"):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == kind, err
    if code is not None:
        assert err["code"] == code, err
    assert err["param"] == param, err
    return err


def rejections(m):
    return {k[len('isoserve_rejections_total{reason="'):-2]: v
            for k, v in m.items() if k.startswith("isoserve_rejections_total")}


def test_invalid_requests_are_refused_with_the_field_named(server):
    before = rejections(server.metrics())
    rejected_before = server.metrics()['isoserve_requests_total{outcome="rejected"}']
    cases = [
        # (path, body, raw, status, code, param)
        (CHAT, '{"model": "x", "messages": [', True, 400, "invalid_json", None),
        (CHAT, "[1, 2]", True, 400, "invalid_json", None),
        (CHAT, {"model": MODEL, "messages": MSGS, "max_tokens": "x"}, False, 400,
         "invalid_type", "max_tokens"),
        (CHAT, {"model": MODEL, "messages": MSGS, "temperature": -1}, False, 400,
         "invalid_value", "temperature"),
        (CHAT, {"model": MODEL, "messages": MSGS, "n": 17}, False, 400, "invalid_value", "n"),
        (CHAT, {"model": MODEL, "messages": MSGS, "response_format": {"type": "xml"}},
         False, 400, "unsupported_value", "response_format.type"),
        (CHAT, {"model": MODEL, "messages": MSGS, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         False, 400, "invalid_value", "response_format"),
        (CHAT, {"model": MODEL, "messages": MSGS,
                "tools": [{"type": "function", "function": {"name": "f g"}}]},
         False, 400, "invalid_value", "tools[0].function.name"),
        (CHAT, {"model": MODEL, "messages": MSGS, "top_p": 0}, False, 400, "invalid_value",
         "top_p"),
        (CHAT, {"model": MODEL, "messages": MSGS, "stop": ["a", "b", "c", "d", "e"]}, False,
         400, "invalid_value", "stop"),
        (CHAT, {"model": MODEL, "messages": MSGS, "logprobs": True, "top_logprobs": 21}, False,
         400, "invalid_value", "top_logprobs"),
        (CHAT, {"model": MODEL}, False, 400, "missing_required_parameter", "messages"),
        (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 3}]}, False, 400,
         "invalid_type", "messages[0].content"),
        (COMP, {"model": MODEL, "prompt": ["a", 5]}, False, 400, "invalid_type",
         "prompt[1]"),
        (COMP, {"model": MODEL, "prompt": "x", "max_tokens": 0}, False, 400, "invalid_value",
         "max_tokens"),
        (COMP, {"model": MODEL, "prompt": [1, 99999999]}, False, 400, "invalid_value",
         "prompt"),
    ]
    for path, body, raw, status, code, param in cases:
        r = post(server, path, body, raw=raw)
        err = assert_error(r, status, code, param)
        if param:
            assert param.split("[")[0] in err["message"], err
    after = rejections(server.metrics())
    assert after["invalid_request"] - before["invalid_request"] == len(cases)
    rejected_after = server.metrics()['isoserve_requests_total{outcome="rejected"}']
    assert rejected_after - rejected_before == len(cases)
    # The request log has a `rejected` line for each, with no prompt text.
    recs = [r for r in server.log_records() if r["error_kind"] == "invalid_request"]
    assert len(recs) >= len(cases)
    assert all(r["outcome"] == "rejected" and "prompt" not in r for r in recs)


def test_unknown_model_is_404(server):
    before = rejections(server.metrics())
    r = post(server, CHAT, {"model": "gpt-4o", "messages": MSGS})
    err = assert_error(r, 404, "model_not_found", "model")
    assert "gpt-4o" in err["message"]
    # The alias `default` is accepted.
    r = post(server, CHAT, {"model": "default", "messages": MSGS, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL
    # So is the known model's short name (`--model smollm2-135m`), on both
    # endpoints and /v1/models/{id}; the answer names the served id.
    r = post(server, CHAT, {"model": "smollm2-135m", "messages": MSGS, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL
    r = post(server, "/v1/completions", {"model": "smollm2-135m", "prompt": "a", "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = requests.get(server.url("/v1/models/smollm2-135m"), timeout=10)
    assert r.status_code == 200 and r.json()["id"] == MODEL, r.text
    # A near miss is still unknown.
    r = post(server, CHAT, {"model": "smollm2-135m ", "messages": MSGS})
    assert_error(r, 404, "model_not_found", "model")
    assert rejections(server.metrics())["model_not_found"] - before["model_not_found"] == 2


def test_body_over_the_limit_is_413(server):
    before = rejections(server.metrics())
    big = json.dumps({"model": MODEL, "prompt": "a" * (5 << 20)})
    r = post(server, COMP, big, raw=True)
    assert_error(r, 413, "request_too_large")
    # With Expect: 100-continue the refusal comes before the body is sent.
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.putrequest("POST", COMP)
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(len(big)))
    conn.putheader("Expect", "100-continue")
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413
    assert json.loads(resp.read())["error"]["code"] == "request_too_large"
    conn.close()
    assert rejections(server.metrics())["body_too_large"] - before["body_too_large"] == 2


def test_over_long_prompt_is_400_with_the_numbers(server):
    before = rejections(server.metrics())
    r = post(server, COMP, {"model": MODEL, "prompt": [1000] * 8000, "max_tokens": 500})
    err = assert_error(r, 400, "context_length_exceeded", "prompt")
    for n in ("8192", "8500", "8000", "500"):
        assert n in err["message"], err
    # A chat request whose text alone exceeds the window.
    r = post(server, CHAT, {"model": MODEL, "max_tokens": 10,
                            "messages": [{"role": "user", "content": "hello " * 9000}]})
    err = assert_error(r, 400, "context_length_exceeded", "messages")
    assert "8192" in err["message"]
    assert rejections(server.metrics())["context_length_exceeded"] - \
        before["context_length_exceeded"] == 2


def test_unknown_route_and_method(server):
    before = rejections(server.metrics())
    r = requests.get(server.url("/v1/nothing-here"), timeout=10)
    err = assert_error(r, 404, "not_found")
    assert "/v1/nothing-here" in err["message"]
    r = requests.get(server.url(CHAT), timeout=10)
    assert_error(r, 405, "method_not_allowed")
    after = rejections(server.metrics())
    assert after["not_found"] - before["not_found"] == 1
    assert after["method_not_allowed"] - before["method_not_allowed"] == 1


def raw_request(server, data: bytes):
    """Sends raw bytes; returns (status, parsed JSON body or None)."""
    with socket.create_connection((server.host, server.port), timeout=10) as c:
        c.sendall(data)
        out = b""
        while True:
            chunk = c.recv(65536)
            if not chunk:
                break
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body else None


def test_oversized_headers_are_refused_and_server_survives(server):
    r = requests.get(server.url("/health"), headers={"X-Big": "a" * (80 << 10)}, timeout=10)
    assert_error(r, 431, "headers_too_large")
    r = requests.get(server.url("/health"), timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


@pytest.mark.parametrize("head,status,code", [
    (b"Content-Length: abc\r\n", 400, "invalid_content_length"),
    (b"Content-Length: 99999999999999999999999999\r\n", 400, "invalid_content_length"),
    (b"Content-Length: 5\r\nContent-Length: 6\r\n", 400, "invalid_content_length"),
    (b"".join(b"X-H%d: v\r\n" % i for i in range(150)), 431, "too_many_headers"),
    (b"Bad Header Line\r\n", 400, "malformed_request"),
])
def test_transport_errors_answer_in_openai_shape(server, head, status, code):
    data = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n"
    st, j = raw_request(server, data)
    assert st == status, (st, j)
    assert j["error"]["code"] == code and j["error"]["message"], j
    assert len(j["error"]["message"]) < 300, j
    r = requests.get(server.url("/health"), timeout=10)
    assert r.status_code == 200


@pytest.mark.parametrize("head,status,code", [
    (b"Content-Length: abc\r\n", 400, "malformed_request"),
    (b"Content-Length: 99999999999999999999999999\r\n", 400, "malformed_request"),
    (b"Content-Length: 5\r\nContent-Length: 6\r\n", 400, "malformed_request"),
    (b"".join(b"X-H%d: v\r\n" % i for i in range(150)), 431, "headers_too_large"),
    (b"X-Big: " + b"a" * (80 << 10) + b"\r\n", 431, "headers_too_large"),
    (b"Bad Header Line\r\n", 400, "malformed_request"),
])
def test_a_malformed_head_after_a_good_request_on_one_connection_answers_json(
        server, head, status, code):
    # The first head is checked before hyper sees the connection; later
    # ones are hyper's to refuse, and its bare status line is rewritten.
    with socket.create_connection((server.host, server.port), timeout=10) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while b"\r\n\r\n" not in first or not first.endswith(b"}"):
            chunk = c.recv(65536)
            assert chunk, first
            first += chunk
        assert first.startswith(b"HTTP/1.1 200 "), first
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
        out = b""
        while True:
            try:
                chunk = c.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
    head_out, _, body = out.partition(b"\r\n\r\n")
    assert head_out.startswith(b"HTTP/1.1 %d " % status), out
    assert b"content-type: application/json" in head_out.lower(), out
    j = json.loads(body)
    assert j["error"]["code"] == code and j["error"]["message"], j
    r = requests.get(server.url("/health"), timeout=10)
    assert r.status_code == 200


def test_a_huge_header_on_a_reused_session_connection_answers_json(server):
    with requests.Session() as s:
        assert s.get(server.url("/health"), timeout=10).status_code == 200
        r = s.get(server.url("/health"), headers={"X-Big": "a" * (80 << 10)}, timeout=10)
        assert_error(r, 431, "headers_too_large")
        assert s.get(server.url("/health"), timeout=10).json() == {"status": "ok"}


def test_a_huge_but_valid_content_length_is_413_before_the_body(server):
    st, j = raw_request(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                b"Content-Type: application/json\r\n"
                                b"Content-Length: 1000000000000\r\n\r\n{")
    assert st == 413 and j["error"]["code"] == "request_too_large", (st, j)


def test_cli_errors_are_one_line_and_nonzero(tmp_root):
    import subprocess
    from conftest import BIN
    for args, says in [(["serve", "--model", str(tmp_root)], "is a directory"),
                       (["serve", "--kv-pages", "0", "--port", "0"], "holds no page")]:
        p = subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=120)
        assert p.returncode != 0, p
        last = p.stderr.strip().splitlines()[-1]
        assert says in last, p.stderr
        assert "--max-context 0" not in p.stderr, p.stderr


def test_garbage_bytes_do_not_hurt_the_server(server):
    for payload in (b"\x00\xff\x16\x03\x01garbage\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\n"
                    b"Content-Length: 5\r\n\r\n{\"pr", b"GET / HTTP/1.1\r\nHost: x\r\n" * 200):
        with socket.create_connection((server.host, server.port), timeout=5) as s:
            try:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
                s.recv(4096)
            except OSError:
                pass
    r = requests.get(server.url("/health"), timeout=10)
    assert r.status_code == 200


def test_errors_left_the_pool_free(server):
    assert_pool_clean(wait_pool_idle(server))


# ---- tenants ---------------------------------------------------------------

def test_api_keys(tenant_server):
    before = rejections(tenant_server.metrics())
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 4, "temperature": 0}
    err = assert_error(post(tenant_server, CHAT, body, auth("sk-wrong")), 401, "invalid_api_key")
    assert "Incorrect API key" in err["message"]
    err = assert_error(post(tenant_server, CHAT, body), 401, "invalid_api_key")
    assert "didn't provide an API key" in err["message"]
    r = post(tenant_server, CHAT, body, {"Authorization": "Basic abc"})
    assert r.status_code == 401
    r = post(tenant_server, CHAT, body, auth(TENANT_KEYS["t2"]))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    assert rejections(tenant_server.metrics())["unauthorized"] - before["unauthorized"] == 3
    recs = tenant_server.log_records()
    assert any(r["tenant"] == "t2" and r["outcome"] == "finished" for r in recs)
    assert sum(1 for r in recs if r["error_kind"] == "unauthorized" and r["tenant"] is None) >= 3


def wait_metrics(server, pred, timeout=20.0):
    """Polls /metrics until pred(metrics) holds (bounded); returns them."""
    deadline = time.monotonic() + timeout
    m = server.metrics()
    while not pred(m) and time.monotonic() < deadline:
        time.sleep(0.05)
        m = server.metrics()
    return m


def test_tenant_max_concurrent_is_429_with_retry_after(tenant_server):
    before = rejections(tenant_server.metrics())
    long_req = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 380,
                "ignore_eos": True, "stream": True, "temperature": 0}
    with Stream(tenant_server, COMP, long_req, auth(LIMITED_KEY)) as running:
        assert running.status == 200
        next(running.events())  # the request is running
        r = post(tenant_server, COMP, {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                 auth(LIMITED_KEY))
        err = assert_error(r, 429, "rate_limit_exceeded", kind="rate_limit_error")
        assert int(r.headers["Retry-After"]) >= 1
        assert "max_concurrent" in err["message"]
        # Another tenant is not affected.
        r = post(tenant_server, COMP, {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                 auth(TENANT_KEYS["t0"]))
        assert r.status_code == 200
    # Closing the stream cancels it and frees the tenant's slot; its
    # tokens-per-minute budget (400, of which 384 are used by the cut
    # stream) is then what refuses the next request.
    m = wait_pool_idle(tenant_server)
    assert_pool_clean(m)
    assert m['isoserve_requests_total{outcome="cancelled"}'] >= 1
    r = post(tenant_server, COMP, {"model": MODEL, "prompt": "Hi", "max_tokens": 20},
             auth(LIMITED_KEY))
    err = assert_error(r, 429, "rate_limit_exceeded", kind="rate_limit_error")
    assert "tokens per minute" in err["message"]
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    assert rejections(tenant_server.metrics())["tenant_limit"] - before["tenant_limit"] == 2
    recs = [r for r in tenant_server.log_records() if r["tenant"] == "limited"]
    assert [r["outcome"] for r in recs] == ["rejected", "cancelled", "rejected"], recs
    assert [r["error_kind"] for r in recs] == ["tenant_limit", None, "tenant_limit"]
    assert 1 <= recs[1]["output_tokens"] < 380


def test_queue_full_is_429(tmp_root):
    s = Server(["--max-running", "1", "--max-queue", "1"], tmp_root, "tiny-queue")
    try:
        long_req = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400,
                    "ignore_eos": True, "stream": True, "temperature": 0}
        with Stream(s, COMP, long_req) as a:
            next(a.events())
            # The engine's waiting count is refreshed once per step: wait
            # until it shows A running and nothing waiting.
            m = wait_metrics(s, lambda m: m["isoserve_requests_running"] == 1
                             and m["isoserve_requests_waiting"] == 0)
            assert m["isoserve_requests_running"] == 1
            with Stream(s, COMP, long_req) as b:
                assert b.status == 200  # B waits in the queue
                m = wait_metrics(s, lambda m: m["isoserve_requests_waiting"] == 1)
                assert m["isoserve_requests_waiting"] == 1
                r = post(s, COMP, {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
                err = assert_error(r, 429, "queue_full", kind="rate_limit_error")
                assert "limit 1" in err["message"]
                assert int(r.headers["Retry-After"]) >= 1
        m = wait_pool_idle(s)
        assert_pool_clean(m)
        assert rejections(m)["queue_full"] == 1
        # Both streams were cut by the client: cancelled (A running, B
        # waiting), their pages back.
        assert m['isoserve_engine_requests_total{how="cancelled"}'] == 2
        assert m['isoserve_requests_total{outcome="cancelled"}'] == 2
        assert m['isoserve_engine_requests_total{how="finished"}'] == 0
        # And the server still works.
        r = post(s, COMP, {"model": MODEL, "prompt": "The capital of France is",
                           "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(" Paris")
    finally:
        assert s.terminate() == 0, s.stderr()
