"""Abort storm: 240 clients start requests (85% streaming) and vanish at
random points — mid-request, before the first response byte, after k
chunks, while a non-streaming answer is being generated — with FIN or RST. Afterwards every KV page is free, nothing runs, no pool safety
check fired, and the server still answers correctly."""

import json
import random
import socket
import struct
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import requests

from conftest import assert_pool_clean, wait_pool_idle

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CLIENTS = 240
SEED = 20260901


def request_bytes(rng, port, stream=True):
    if rng.random() < 0.5:
        path = "/v1/chat/completions"
        body = {"model": MODEL, "stream": stream, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Count to {rng.randint(5, 99)}."}]}
    else:
        path = "/v1/completions"
        body = {"model": MODEL, "stream": stream, "ignore_eos": True,
                "prompt": f"Story number {rng.randint(1, 10**6)}:"}
    # Non-streaming requests are long enough to be cut while generating.
    body["max_tokens"] = rng.randint(16, 64) if stream else rng.randint(400, 800)
    body["temperature"] = rng.choice([0, 0.8])
    if stream and rng.random() < 0.3:
        body["stream_options"] = {"include_usage": True}
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    return head + data


def client(server, i):
    """One vanishing client; returns what it did."""
    rng = random.Random(SEED + i)
    mode = rng.random()
    req = request_bytes(rng, server.port, stream=mode < 0.85)
    k = rng.randint(0, 8)  # chunks to read before vanishing
    s = socket.create_connection((server.host, server.port), timeout=60)
    try:
        if rng.random() < 0.5:
            # Close with RST instead of FIN.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if mode < 0.1:
            s.sendall(req[: rng.randint(1, len(req) - 1)])  # cut mid-request
            return "partial"
        s.sendall(req)
        if mode >= 0.85:
            # Non-streaming: hang up while the answer is being generated.
            time.sleep(rng.uniform(0.0, 0.5))
            return "non_stream"
        if k == 0:
            return "before_first_byte"
        buf = b""
        while buf.count(b"data: ") < k and b"[DONE]" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        return "after_chunks" if b"200 OK" in buf[:20] else "refused"
    finally:
        s.close()


def test_abort_storm_leaves_the_pool_clean(server):
    before = server.metrics()
    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        kinds = list(pool.map(lambda i: client(server, i), range(CLIENTS), timeout=180))
    stats = Counter(kinds)
    assert sum(stats.values()) == CLIENTS, stats
    assert stats["after_chunks"] > 50 and stats["before_first_byte"] > 10, stats
    assert stats["non_stream"] > 10, stats

    m = wait_pool_idle(server, timeout=60)
    assert_pool_clean(m)
    assert m["isoserve_requests_waiting"] == 0
    assert m["isoserve_http_inflight_requests"] == 0
    cancelled = (m['isoserve_engine_requests_total{how="cancelled"}']
                 - before['isoserve_engine_requests_total{how="cancelled"}'])
    assert cancelled >= (stats["after_chunks"] + stats["non_stream"]) * 0.9, (cancelled, stats)
    finished = (m['isoserve_engine_requests_total{how="finished"}']
                - before['isoserve_engine_requests_total{how="finished"}'])
    assert finished <= 0.05 * CLIENTS, (finished, stats)
    assert m['isoserve_engine_requests_total{how="failed"}'] == 0
    # Every admitted request ended (finished or cancelled) in the engine's
    # own accounting as well as the server's.
    http_cancelled = (m['isoserve_requests_total{outcome="cancelled"}']
                      - before['isoserve_requests_total{outcome="cancelled"}'])
    assert http_cancelled >= cancelled

    # The server is healthy and still right.
    r = requests.post(server.url("/v1/chat/completions"), timeout=60, json={
        "model": MODEL, "temperature": 0, "max_tokens": 32,
        "messages": [{"role": "user",
                      "content": "What is the capital of France? Answer in one word."}]})
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    assert "panicked" not in server.stderr()
    assert_pool_clean(wait_pool_idle(server))
