"""SIGTERM: in-flight streams finish (or end with an error event once the
grace period is over), new requests get 503 meanwhile, and the process
exits 0 within a bound."""

import json
import signal
import time

import requests

from conftest import Server, Stream

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def new_request_status(server):
    """Status of a new request during shutdown, or 'refused' once the
    listener is gone."""
    try:
        r = requests.post(server.url("/v1/completions"), timeout=10,
                          json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    except requests.ConnectionError:
        return "refused"
    if r.status_code == 503:
        err = r.json()["error"]
        assert err["code"] == "shutting_down" and err["type"] == "service_unavailable"
        assert int(r.headers["Retry-After"]) >= 1
    return r.status_code


def test_sigterm_lets_a_running_stream_finish(tmp_root):
    s = Server([], tmp_root, "sigterm")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with Stream(s, "/v1/completions", body) as st:
        assert st.status == 200
        events = st.events()
        first = [next(events) for _ in range(3)]
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert new_request_status(s) in (503, "refused")
        health = requests.get(s.url("/health"), timeout=10)
        assert health.status_code == 503
        rest = list(events)
    assert rest[-1] == "[DONE]"
    chunks = [json.loads(e) for e in first + rest[:-1]]
    assert all("error" not in c for c in chunks)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 300
    t0 = time.monotonic()
    s.proc.wait(timeout=30)
    assert s.proc.returncode == 0, s.stderr()
    assert time.monotonic() - t0 < 30
    assert s.terminate() == 0
    recs = s.log_records()
    assert any(r["outcome"] == "finished" and r["output_tokens"] == 300 for r in recs)
    assert any(r["error_kind"] == "shutting_down" for r in recs)
    assert "shut down" in s.stderr()


def test_sigterm_past_the_grace_period_ends_the_stream_with_an_error(tmp_root):
    s = Server(["--shutdown-grace-secs", "1"], tmp_root, "sigterm-grace")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with Stream(s, "/v1/completions", body) as st:
        events = st.events()
        next(events)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rest = list(events)
        elapsed = time.monotonic() - t0
    assert elapsed < 15, elapsed
    assert rest[-1] == "[DONE]"
    err = json.loads(rest[-2])
    assert err["error"]["code"] == "shutting_down", err
    s.proc.wait(timeout=30)
    assert s.proc.returncode == 0, s.stderr()
    recs = s.log_records()
    assert recs[-1]["outcome"] == "error" and recs[-1]["error_kind"] == "shutting_down"
    assert 0 < recs[-1]["output_tokens"] < 4000
