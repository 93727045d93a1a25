"""Disaggregated serving, as processes: `isoserve prefill`, `isoserve decode`,
`isoserve gateway`, and `isoserve serve --disaggregated`.

* Output over PD equals the unified server's, streaming or not (K12).
* Over-long requests are refused at the gateway (400) before any node.
* kill -9 of prefill while it holds a request, and of decode while it
  streams: the request fails cleanly (an error, never a wrong answer), the
  other node's pool is entirely free again, and after a restart on the same
  port the set serves again (the gateway re-pairs on its own).
* Two different GGUFs: the pairing is refused with a clear error; the
  gateway answers 503 and /health says unavailable.
* `serve --disaggregated`: one command; SIGTERM brings gateway and both
  children down with exit 0.

Every node and server listens on 127.0.0.1 with ephemeral ports; every wait
is bounded.
"""

import json
import os
import re
import select
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from conftest import BIN, Server, Stream, parse_metrics, tokenize

MODEL = "SmolLM2-135M-Instruct.Q4_1"
NODE_RE = re.compile(r"^isoserve: (\w+) node \S+ listening on ([0-9.]+):(\d+)$")
METRICS_RE = re.compile(r"^isoserve: metrics on (http://\S+)$")
NODE_ARGS = ["--kv-memory", "256MiB", "--max-context", "2048"]

PROMPTS = [
    "What is the capital of France? Answer in one word.",
    "Write a haiku about autumn.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
]


class Node:
    """A running `isoserve prefill|decode` process."""

    def __init__(self, role, tmp: Path, name: str, port=0, model=None, args=NODE_ARGS,
                 binary: Path = BIN, host="127.0.0.1", metrics_port=0, prefix=()):
        """`prefix`: words before the binary (`ip netns exec NS` for a node
        on a host of its own, listening on that host's address)."""
        self.role, self.tmp, self.name = role, tmp, name
        self.stderr_path = tmp / f"{name}.stderr"
        cmd = list(prefix) + [str(binary), role, "--host", host, "--port", str(port),
                              "--metrics-port", str(metrics_port),
                              "--node", name] + list(args)
        if model:
            cmd += ["--model", str(model)]
        self._stderr = open(self.stderr_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._stderr,
                                     stdin=subprocess.DEVNULL)
        self.metrics_url = None
        deadline = time.monotonic() + 120
        buf = b""
        fd = self.proc.stdout.fileno()
        while time.monotonic() < deadline:
            r, _, _ = select.select([fd], [], [], 0.2)
            if r:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.decode()
                    if m := METRICS_RE.match(line):
                        self.metrics_url = m.group(1)
                    elif m := NODE_RE.match(line):
                        assert m.group(1) == role
                        self.addr = f"{m.group(2)}:{m.group(3)}"
                        self.port = int(m.group(3))
                        return
            elif self.proc.poll() is not None:
                break
        self.kill()
        raise AssertionError(f"{role} node did not start:\n{self.stderr_path.read_text()}")

    def metrics(self) -> dict:
        r = requests.get(self.metrics_url, timeout=10)
        assert r.status_code == 200, r.text
        return parse_metrics(r.text)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def terminate(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
        self._stderr.close()
        return self.proc.returncode


class Gateway(Server):
    """A running `isoserve gateway`."""

    def __init__(self, prefill, decode, tmp, name, extra=(), binary: Path = BIN):
        super().__init__(["--prefill", prefill, "--decode", decode] + list(extra), tmp, name,
                         command="gateway", binary=binary)


def wait_until(pred, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def pool_free(node: Node) -> dict:
    def ok():
        m = node.metrics()
        return m if (m["isoserve_node_kv_pages_free"] == m["isoserve_node_kv_pages_total"]
                     and m["isoserve_node_kv_pages_leased"] == 0
                     and m["isoserve_node_requests"] == 0) else None
    m = wait_until(ok, what=f"{node.role} pool to be free")
    assert m["isoserve_node_kv_safety_refusals_total"] == 0, m
    return m


def healthy(gw) -> bool:
    try:
        return requests.get(gw.url("/health"), timeout=5).status_code == 200
    except requests.RequestException:
        return False


def chat(s, content, max_tokens=24, stream=False, timeout=120):
    body = {"model": MODEL, "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}]}
    if not stream:
        return requests.post(s.url("/v1/chat/completions"), json=body, timeout=timeout)
    body["stream"] = True
    st = Stream(s, "/v1/chat/completions", body, timeout=timeout)
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in st.json_events() if c.get("choices"))
    return text


@pytest.fixture(scope="module")
def pd_set(tmp_root):
    d = Node("decode", tmp_root, "decode-0")
    p = Node("prefill", tmp_root, "prefill-0")
    gw = Gateway(p.addr, d.addr, tmp_root, "gateway")
    wait_until(lambda: healthy(gw), what="gateway to pair")
    nodes = {"prefill": p, "decode": d, "gateway": gw}
    yield nodes
    assert gw.terminate() == 0, gw.stderr()
    # The tests replace killed nodes with restarted ones.
    for n in (nodes["prefill"], nodes["decode"]):
        assert n.terminate() == 0, n.stderr_path.read_text()


def test_pd_output_equals_unified(pd_set, server):
    gw = pd_set["gateway"]
    for prompt in PROMPTS:
        a = chat(server, prompt)
        b = chat(gw, prompt)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        ja, jb = a.json(), b.json()
        assert ja["choices"][0]["message"] == jb["choices"][0]["message"], prompt
        # Token counts agree; what came from a prefix cache may not (PD
        # nodes do not cache yet).
        strip = lambda u: {k: v for k, v in u.items() if k != "prompt_tokens_details"}
        assert strip(ja["usage"]) == strip(jb["usage"])
        assert chat(gw, prompt, stream=True) == ja["choices"][0]["message"]["content"]
    m = pool_free(pd_set["decode"])
    assert m["isoserve_node_decode_transfers_completed_total"] >= 2 * len(PROMPTS)
    assert m["isoserve_node_decode_checksum_failures_total"] == 0
    pool_free(pd_set["prefill"])


def test_logit_bias_crosses_from_gateway_to_both_nodes(pd_set, server):
    # Prefill samples the first token, decode the rest: a forced token in
    # every position shows both nodes got the bias (wire v5); a ban gives the
    # unified server's text.
    gw = pd_set["gateway"]
    banana = tokenize(" banana", chat=False)[0]
    paris = tokenize(" Paris", chat=False)[0]
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5,
            "temperature": 0.7, "seed": 3, "logit_bias": {str(banana): 100}}
    r = requests.post(gw.url("/v1/completions"), json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " banana" * 5
    body.update(temperature=0, max_tokens=8, logit_bias={str(paris): -100})
    a = requests.post(server.url("/v1/completions"), json=body, timeout=120).json()
    b = requests.post(gw.url("/v1/completions"), json=body, timeout=120).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert not a["choices"][0]["text"].startswith(" Paris")
    body["logit_bias"] = {"49152": 1}
    r = requests.post(gw.url("/v1/completions"), json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_n_choices_over_pd_equal_unified(pd_set, server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.9,
            "seed": 11, "n": 3}
    a = requests.post(server.url("/v1/completions"), json=body, timeout=120).json()
    b = requests.post(pd_set["gateway"].url("/v1/completions"), json=body, timeout=120).json()
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    assert len({c["text"] for c in b["choices"]}) > 1
    assert b["usage"]["completion_tokens"] == 24 and b["usage"]["prompt_tokens"] == 4
    # The Responses API through the gateway: the unified server's answer.
    body = {"model": MODEL, "input": "Name a colour.", "max_output_tokens": 8, "temperature": 0}
    a = requests.post(server.url("/v1/responses"), json=body, timeout=120).json()
    b = requests.post(pd_set["gateway"].url("/v1/responses"), json=body, timeout=120).json()
    assert b["object"] == "response" and b["status"] in ("completed", "incomplete"), b
    assert a["output"][0]["content"][0]["text"] == b["output"][0]["content"][0]["text"]


def test_structured_outputs_over_pd_equal_unified(pd_set, server):
    """The grammar crosses with the request (wire v6): prefill samples the
    first token under it, decode continues from its state after that
    token; greedy and seeded output equal the unified server's byte for
    byte (K12), streamed and not, and a bad grammar is the gateway's 400."""
    gw = pd_set["gateway"]
    person = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["name", "age", "tags"], "additionalProperties": False}
    cases = [
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "p", "schema": person, "strict": True}}},
        {"structured_outputs": {"regex": "[A-Z][a-z]{2,8}, [0-9]{2}"}},
        {"structured_outputs": {"choice": ["north", "south", "east", "west"]}},
        {"structured_outputs": {"grammar": 'start: "Answer: " WORD\nWORD: /[a-z]{1,12}/'}},
    ]
    for extra in cases:
        for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 5}):
            body = dict({"model": MODEL, "max_tokens": 60,
                         "messages": [{"role": "user", "content": "Describe someone."}]},
                        **sampling, **extra)
            a = requests.post(server.url("/v1/chat/completions"), json=body, timeout=120)
            b = requests.post(gw.url("/v1/chat/completions"), json=body, timeout=120)
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            ca, cb = a.json()["choices"][0], b.json()["choices"][0]
            assert ca["message"] == cb["message"], extra
            assert ca["finish_reason"] == cb["finish_reason"] == "stop", (ca, cb)
            assert b.json()["usage"]["completion_tokens"] == a.json()["usage"]["completion_tokens"]
            body["stream"] = True
            st = Stream(gw, "/v1/chat/completions", body, timeout=120)
            text = "".join(c["choices"][0]["delta"].get("content") or ""
                           for c in st.json_events() if c.get("choices"))
            assert text == ca["message"]["content"]
    json.loads(requests.post(gw.url("/v1/chat/completions"), timeout=120, json=dict(
        {"model": MODEL, "max_tokens": 60, "temperature": 0,
         "messages": [{"role": "user", "content": "Describe someone."}]}, **cases[0])
    ).json()["choices"][0]["message"]["content"])
    r = requests.post(gw.url("/v1/chat/completions"), timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "structured_outputs": {"regex": "(unclosed"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    pool_free(pd_set["decode"])
    pool_free(pd_set["prefill"])


def test_tool_calls_over_pd_equal_unified(pd_set, server):
    """Tool calls cross as a grammar (the call grammar, compiled at the
    gateway and on each node in its own scope): the calls, their arguments
    and the finish reason equal the unified server's (K12), streamed and
    not."""
    gw = pd_set["gateway"]
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"]}}},
        {"type": "function", "function": {"name": "now", "parameters": {}}}]
    for extra in ({"tool_choice": "required", "parallel_tool_calls": False},
                  {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                  {"tool_choice": "auto"}):
        body = dict({"model": MODEL, "max_tokens": 120, "temperature": 0, "tools": tools,
                     "messages": [{"role": "user", "content": "Weather in Oslo?"}]}, **extra)
        a = requests.post(server.url("/v1/chat/completions"), json=body, timeout=120)
        b = requests.post(gw.url("/v1/chat/completions"), json=body, timeout=120)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        ca, cb = a.json()["choices"][0], b.json()["choices"][0]
        assert ca["finish_reason"] == cb["finish_reason"], (ca, cb)
        calls = lambda m: [(c["function"]["name"], c["function"]["arguments"])
                           for c in m.get("tool_calls") or []]
        assert calls(ca["message"]) == calls(cb["message"]), (ca, cb)
        assert ca["message"]["content"] == cb["message"]["content"]
        if extra["tool_choice"] != "auto":
            assert ca["finish_reason"] == "tool_calls" and calls(ca["message"]), ca
        body["stream"] = True
        st = Stream(gw, "/v1/chat/completions", body, timeout=120)
        args = {}
        for c in st.json_events():
            for d in (c.get("choices") or [{}])[0].get("delta", {}).get("tool_calls") or []:
                args.setdefault(d["index"], ["", ""])
                args[d["index"]][0] += d["function"].get("name") or ""
                args[d["index"]][1] += d["function"].get("arguments") or ""
        assert [tuple(args[i]) for i in sorted(args)] == calls(ca["message"])
    # Which stop sequence ended an answer crosses the wire too (Anthropic's
    # stop_sequence).
    full = requests.post(server.url("/v1/messages"), timeout=120, json={
        "model": MODEL, "max_tokens": 30, "temperature": 0,
        "messages": [{"role": "user", "content": "Count from one to ten in words."}]}).json()
    word = full["content"][0]["text"].split()[3]
    body = {"model": MODEL, "max_tokens": 30, "temperature": 0,
            "stop_sequences": ["zzz-never", word],
            "messages": [{"role": "user", "content": "Count from one to ten in words."}]}
    a = requests.post(server.url("/v1/messages"), json=body, timeout=120).json()
    b = requests.post(gw.url("/v1/messages"), json=body, timeout=120).json()
    assert (a["stop_reason"], a["stop_sequence"]) == ("stop_sequence", word), a
    assert (b["stop_reason"], b["stop_sequence"], b["content"]) == \
        (a["stop_reason"], a["stop_sequence"], a["content"])
    pool_free(pd_set["decode"])
    pool_free(pd_set["prefill"])


def test_over_long_request_is_refused_at_the_gateway(pd_set):
    gw, d = pd_set["gateway"], pd_set["decode"]
    models = requests.get(gw.url("/v1/models"), timeout=10).json()
    assert models["data"][0]["max_model_len"] == 2048
    before = d.metrics()["isoserve_node_decode_reservations_total"]
    r = chat(gw, "word " * 2100, max_tokens=8)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert "2048" in err["message"]
    assert d.metrics()["isoserve_node_decode_reservations_total"] == before


def test_nodes_report_their_load_to_the_gateway(pd_set):
    """Each node tells the gateway its queued and running requests and free
    pages every 250 ms (`Message::Load`); the gateway exports what it was
    told per node and routes by it (the machine tests show the routing)."""
    gw, p, d = pd_set["gateway"], pd_set["prefill"], pd_set["decode"]
    pool_free(d)
    total = d.metrics()["isoserve_node_kv_pages_total"]

    def reported(name, node):
        return gw.metrics().get(f'isoserve_gateway_node_{name}{{node="{node.addr}"}}')

    # Reports lag by up to 250 ms: the previous test's pages may show.
    wait_until(lambda: reported("kv_pages_total", d) == total
               and reported("kv_pages_free", d) == total, what="decode's report")
    assert reported("requests_running", d) == 0 and reported("requests_queued", d) == 0
    assert reported("kv_pages_total", p) == p.metrics()["isoserve_node_kv_pages_total"]
    before = gw.metrics()["isoserve_gateway_load_reports_total"]
    time.sleep(1.0)
    # Two nodes at 4 Hz (the loop's timing is loose, so a lower bound).
    assert gw.metrics()["isoserve_gateway_load_reports_total"] - before >= 4
    # A long stream runs on decode: its report shows it and its pages.
    body = {"model": MODEL, "temperature": 0, "max_tokens": 600, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Count to a thousand."}], "stream": True}
    with Stream(gw, "/v1/chat/completions", body, timeout=120) as st:
        assert st.status == 200
        events = st.json_events()
        next(events)
        wait_until(lambda: reported("requests_running", d) == 1, timeout=5,
                   what="decode to report the running request")
        assert reported("kv_pages_free", d) < total
    # Cancelled by the close: back to idle in the report.
    wait_until(lambda: reported("requests_running", d) == 0
               and reported("kv_pages_free", d) == total, timeout=10,
               what="decode to report itself idle")
    pool_free(d)
    pool_free(p)


def long_prompt():
    return "Summarise the following notes. " + "The meeting covered budgets, hiring and the roadmap. " * 130


def test_kill9_prefill_while_it_holds_a_request(pd_set, tmp_root):
    gw, p, d = pd_set["gateway"], pd_set["prefill"], pd_set["decode"]
    result = {}
    t = threading.Thread(target=lambda: result.update(r=chat(gw, long_prompt(), max_tokens=64)))
    t.start()
    wait_until(lambda: p.metrics()["isoserve_node_requests"] > 0, what="prefill to hold the request")
    p.kill()
    t.join(timeout=120)
    r = result["r"]
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] in ("prefill_lost", "decode_lost", "transfer_incomplete"), r.text
    # Decode released the reservation: the link is gone, no more writes.
    pool_free(d)
    # Restart on the same port: the gateway pairs again by itself.
    p2 = Node("prefill", tmp_root, "prefill-0", port=p.port)
    pd_set["prefill"] = p2
    wait_until(lambda: healthy(gw), what="gateway to pair again")
    ok = chat(gw, PROMPTS[0])
    assert ok.status_code == 200, ok.text
    assert "Paris" in ok.json()["choices"][0]["message"]["content"]
    pool_free(d)
    pool_free(p2)


def test_kill9_decode_mid_stream_and_mid_transfer(pd_set, tmp_root):
    gw, p, d = pd_set["gateway"], pd_set["prefill"], pd_set["decode"]
    # Mid-stream: tokens are flowing from decode.
    body = {"model": MODEL, "temperature": 0, "max_tokens": 1000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Count from one to one thousand."}], "stream": True}
    st = Stream(gw, "/v1/chat/completions", body, timeout=120)
    assert st.status == 200
    events = st.json_events()
    got = [next(events) for _ in range(4)]
    assert all("choices" in c for c in got)
    d.kill()
    rest = list(events)
    assert any("error" in c for c in rest), rest[-3:]
    err = [c for c in rest if "error" in c][0]["error"]
    assert err["code"] == "decode_lost", err
    pool_free(p)
    d2 = Node("decode", tmp_root, "decode-0", port=d.port)
    pd_set["decode"] = d2
    wait_until(lambda: healthy(gw), what="gateway to pair again")
    # Mid-transfer (or mid-prefill: timing-dependent; the simulator covers
    # each protocol state exactly): decode dies under a long prompt.
    result = {}
    t = threading.Thread(target=lambda: result.update(r=chat(gw, long_prompt(), max_tokens=64)))
    t.start()
    wait_until(lambda: p.metrics()["isoserve_node_requests"] > 0, what="prefill to hold the request")
    d2.kill()
    t.join(timeout=120)
    assert result["r"].status_code == 502, result["r"].text
    pool_free(p)
    d3 = Node("decode", tmp_root, "decode-0", port=d.port)
    pd_set["decode"] = d3
    wait_until(lambda: healthy(gw), what="gateway to pair again")
    ok = chat(gw, PROMPTS[0])
    assert ok.status_code == 200, ok.text
    assert "Paris" in ok.json()["choices"][0]["message"]["content"]
    # The Responses API's stream ends a lost decode with `response.failed`
    # carrying the error (not a chat-style error chunk).
    body = {"model": MODEL, "temperature": 0, "max_output_tokens": 1000, "ignore_eos": True,
            "input": "Count from one to one thousand.", "stream": True}
    st = Stream(gw, "/v1/responses", body, timeout=120)
    assert st.status == 200
    events = st.json_events()
    got = [next(events) for _ in range(6)]
    assert got[-1]["type"] == "response.output_text.delta", got
    d3.kill()
    rest = list(events)
    assert rest[-1]["type"] == "response.failed", rest[-3:]
    failed = rest[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "decode_lost", failed
    assert [e["sequence_number"] for e in got + rest] == list(range(len(got) + len(rest)))
    pool_free(p)
    d4 = Node("decode", tmp_root, "decode-0", port=d.port)
    pd_set["decode"] = d4
    wait_until(lambda: healthy(gw), what="gateway to pair again")
    ok = chat(gw, PROMPTS[0])
    assert ok.status_code == 200, ok.text
    pool_free(d4)
    pool_free(p)


@pytest.fixture(scope="module")
def other_gguf(tmp_root):
    """A second, different GGUF: the default model with one weight byte
    changed near the end of the file (still loads; another fingerprint)."""
    src = Path(subprocess.run([str(BIN), "model-path"], check=True, capture_output=True,
                              text=True, timeout=30).stdout.strip())
    dst = tmp_root / "other-model.gguf"
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        f.seek(-4096, os.SEEK_END)
        b = f.read(1)
        f.seek(-4096, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))
    return dst


def test_fingerprint_mismatch_refuses_pairing(tmp_root, other_gguf):
    d = Node("decode", tmp_root, "decode-other", model=other_gguf)
    p = Node("prefill", tmp_root, "prefill-fp")
    gw = Gateway(p.addr, d.addr, tmp_root, "gateway-fp")
    try:
        wait_until(lambda: "pairing refused" in gw.stderr(), what="the refusal to be logged")
        log = gw.stderr()
        assert "another model" in log, log
        assert not healthy(gw)
        r = chat(gw, PROMPTS[0])
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "unavailable"
        assert d.metrics()["isoserve_node_decode_reservations_total"] == 0
    finally:
        gw.terminate()
        d.terminate()
        p.terminate()


def test_q8_0_kv_over_pd_equals_unified_and_a_dtype_mismatch_refuses_pairing(tmp_root):
    """`--kv-dtype q8_0` pages cross the wire as they are; a node storing
    another type is refused at pairing (the layout is part of the handshake),
    never fed pages it would misread."""
    q8 = NODE_ARGS + ["--kv-dtype", "q8_0"]
    d = Node("decode", tmp_root, "decode-q8", args=q8)
    p16 = Node("prefill", tmp_root, "prefill-f16")
    gw = Gateway(p16.addr, d.addr, tmp_root, "gateway-mixed-dtype")
    p8 = gw8 = unified = None
    try:
        wait_until(lambda: "pairing refused" in gw.stderr(), what="the refusal to be logged")
        assert "KV layout" in gw.stderr(), gw.stderr()
        assert not healthy(gw)
        assert chat(gw, PROMPTS[0]).status_code == 503
        assert d.metrics()["isoserve_node_decode_reservations_total"] == 0
        p8 = Node("prefill", tmp_root, "prefill-q8", args=q8)
        gw8 = Gateway(p8.addr, d.addr, tmp_root, "gateway-q8")
        wait_until(lambda: healthy(gw8), what="the q8_0 set to pair")
        unified = Server(["--kv-dtype", "q8_0"], tmp_root, "unified-q8")
        assert "KV q8_0 (12240 bytes a token" in unified.stderr(), unified.stderr()
        for prompt in PROMPTS[:3]:
            a, b = chat(unified, prompt), chat(gw8, prompt)
            assert a.status_code == b.status_code == 200, (a.text, b.text)
            assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"], prompt
        m = pool_free(d)
        assert m["isoserve_node_decode_transfers_completed_total"] >= 3
        assert m["isoserve_node_decode_checksum_failures_total"] == 0
        pool_free(p8)
    finally:
        for x in (gw, gw8, unified):
            if x is not None:
                x.terminate()
        for n in (d, p16, p8):
            if n is not None:
                n.terminate()


def children_of(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_serve_disaggregated_one_command_and_clean_sigterm(tmp_root):
    # Every engine flag, off its default: each child must run with it.
    flags = {"max_running": "5", "step_tokens": "100", "max_queue": "9",
             "transfer_window_pages": "4", "page_size": "32"}
    extra = [a for k, v in flags.items() for a in ("--" + k.replace("_", "-"), v)]
    s = Server(["--disaggregated"] + NODE_ARGS + extra, tmp_root, "disagg")
    kids = children_of(s.proc.pid)
    assert len(kids) == 2, kids
    configs = dict(re.findall(r"^(prefill|decode)-0 config: (.*)$", s.stderr(), re.M))
    assert set(configs) == {"prefill", "decode"}, s.stderr()
    for role, line in configs.items():
        got = dict(kv.split("=", 1) for kv in line.split())
        for k, v in flags.items():
            assert got[k] == v, (role, k, line)
        assert got["max_context"] == "2048" and got["kv_memory_bytes"] == str(256 << 20), line
    r = chat(s, PROMPTS[0])
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    # Each child's /metrics is logged; the decode node counted the transfer.
    urls = dict(re.findall(r"(prefill|decode) node metrics: (http://\S+)", s.stderr()))
    assert set(urls) == {"prefill", "decode"}, s.stderr()
    dm = parse_metrics(requests.get(urls["decode"], timeout=10).text)
    assert dm["isoserve_node_decode_transfers_completed_total"] == 1
    assert dm["isoserve_node_decode_checksum_failures_total"] == 0
    # One scrape of the gateway sees the whole set: every child's samples
    # with a `node` label, encoded by the same Prometheus library.
    gm = s.metrics()
    # The gateway has no pool of its own and exports none (a pool of 0
    # pages would trip "no free pages" alerts); its nodes' pools are here.
    assert not any(k.startswith("isoserve_kv_") for k in gm), sorted(gm)
    assert gm['isoserve_node_scrape_ok{node="prefill-0"}'] == 1
    assert gm['isoserve_node_scrape_ok{node="decode-0"}'] == 1
    assert gm['isoserve_node_decode_transfers_completed_total{node="decode-0"}'] == 1
    assert gm['isoserve_node_prefill_transfers_done_total{node="prefill-0"}'] == 1
    assert gm['isoserve_node_kv_pages_total{node="decode-0"}'] == dm["isoserve_node_kv_pages_total"]
    assert gm["isoserve_gateway_finished_total"] == 1
    assert s.terminate() == 0, s.stderr()
    for k in kids:
        assert not Path(f"/proc/{k}").exists() or "zombie" in Path(f"/proc/{k}/status").read_text().lower()


def test_serve_disaggregated_restarts_a_killed_child(tmp_root):
    s = Server(["--disaggregated"] + NODE_ARGS, tmp_root, "disagg-restart")
    try:
        kids = children_of(s.proc.pid)
        os.kill(kids[1], signal.SIGKILL)
        wait_until(lambda: "restarting it (1 of 5" in s.stderr(), what="the restart to be reported")
        wait_until(lambda: healthy(s) and len(children_of(s.proc.pid)) == 2, timeout=60,
                   what="the set to serve again")
        r = chat(s, PROMPTS[0])
        assert r.status_code == 200, r.text
    finally:
        assert s.terminate() == 0, s.stderr()
