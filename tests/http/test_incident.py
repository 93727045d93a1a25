"""The incident, replayed against the unified server.

1. A KV pool smaller than the advertised window is refused at start (K8),
   naming both numbers.
2. With the window lowered to what the pool holds, one tenant's request
   carrying a secret runs; another tenant's over-long request is refused
   with its original error (400 context_length_exceeded, with the numbers)
   before any page is allocated; and nothing the other tenant receives —
   errors, completions, streams — contains the secret.
"""

import subprocess

import pytest
import requests

from conftest import (BIN, Server, Stream, assert_pool_clean, auth, wait_pool_idle,
                      write_tenants)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
SECRET = "QX-7731-ZEBRA"
ALICE, MALLORY = "sk-alice-incident", "sk-mallory-incident"


def test_pool_smaller_than_window_refuses_to_start(tmp_root):
    p = subprocess.run([str(BIN), "serve", "--port", "0", "--kv-pages", "64"],
                       capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode != 0
    assert b"listening" not in p.stdout
    err = p.stderr.decode()
    last = [l for l in err.splitlines() if l.startswith("isoserve: ")][-1]
    assert "1024" in last and "8192" in last, err
    assert "--max-context" in last


@pytest.fixture(scope="module")
def incident_server(tmp_root):
    path = write_tenants(tmp_root / "incident-tenants.toml", [
        {"name": "alice", "key": ALICE},
        {"name": "mallory", "key": MALLORY},
    ])
    s = Server(["--kv-pages", "64", "--max-context", "1024", "--tenants", str(path)],
               tmp_root, "incident")
    yield s
    assert s.terminate() == 0, s.stderr()


def test_incident_replay(incident_server):
    s = incident_server
    assert "max request 1024 tokens" in s.stderr()
    # Under --tenants, what is served is not public: a key is wanted.
    r = requests.get(s.url("/v1/models"), timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    r = requests.get(s.url("/v1/models"), headers={"Authorization": "Bearer " + "x" * 2000},
                     timeout=10)
    assert r.status_code == 401 and "longer than 1024 bytes" in r.json()["error"]["message"]
    models = requests.get(s.url("/v1/models"), headers=auth(ALICE), timeout=10).json()
    assert models["data"][0]["max_model_len"] == 1024

    # Alice's request with a secret runs and fills pages with its KV.
    r = requests.post(s.url("/v1/chat/completions"), headers=auth(ALICE), timeout=60, json={
        "model": MODEL, "temperature": 0, "max_tokens": 64,
        "messages": [{"role": "system", "content": f"The vault code is {SECRET}."},
                     {"role": "user", "content": "Repeat the vault code exactly."}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 20
    allocs_before = s.metrics()["isoserve_kv_allocs_total"]
    assert allocs_before > 0

    # Mallory's over-long request: refused with the numbers, nothing
    # allocated for it.
    mallory_outputs = []
    long_text = "Tell me everything you remember. " * 200
    r = requests.post(s.url("/v1/chat/completions"), headers=auth(MALLORY), timeout=60, json={
        "model": MODEL, "temperature": 0, "max_tokens": 8,
        "messages": [{"role": "user", "content": long_text}]})
    mallory_outputs.append(r.text)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert err["type"] == "invalid_request_error"
    assert "1024" in err["message"]
    n_prompt = int(err["message"].split("(")[1].split(" in the messages")[0])
    assert n_prompt > 1024 and str(n_prompt + 8) in err["message"]
    # The same over-long request as token ids, streaming: refused before the
    # stream starts.
    with Stream(s, "/v1/completions", {"model": MODEL, "prompt": [504] * 1020,
                                       "max_tokens": 16, "stream": True},
                auth(MALLORY)) as st:
        body = st.resp.read().decode()
        mallory_outputs.append(body)
        assert st.status == 400, body
        assert "context_length_exceeded" in body and "1036" in body and "1024" in body
    assert s.metrics()["isoserve_kv_allocs_total"] == allocs_before

    # Mallory's requests that do run see nothing of Alice's.
    for prompt in ("The vault code is", "Repeat the previous conversation:", "QX-"):
        r = requests.post(s.url("/v1/completions"), headers=auth(MALLORY), timeout=60,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 48,
                                "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        mallory_outputs.append(r.text)
    with Stream(s, "/v1/chat/completions", {
            "model": MODEL, "max_tokens": 48, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "What is the vault code?"}]},
            auth(MALLORY)) as st:
        assert st.status == 200
        mallory_outputs.extend(st.events())
    assert all(SECRET not in o and "7731" not in o for o in mallory_outputs), mallory_outputs

    m = wait_pool_idle(s)
    assert_pool_clean(m)
    rej = m['isoserve_rejections_total{reason="context_length_exceeded"}']
    assert rej == 2
    # The request log has no prompt text (no --log-prompts) and no secret.
    log = s.request_log.read_text()
    assert SECRET not in log
    recs = s.log_records()
    assert [r["outcome"] for r in recs if r["tenant"] == "mallory"][:2] == ["rejected"] * 2
    assert all(r["error_kind"] == "context_length_exceeded"
               for r in recs if r["tenant"] == "mallory" and r["outcome"] == "rejected")
