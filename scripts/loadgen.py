#!/usr/bin/env python3
"""Closed-loop load generator for any OpenAI-compatible /v1/completions.

Each of C clients sends streaming greedy requests back to back (fixed
prompts, a fixed number of output tokens, ignore_eos so every request
generates exactly that many) until each has completed R requests. Reports
aggregate output tok/s, TTFT p50/p99 and inter-token latency p50/p99.

usage: loadgen.py URL --concurrency C [--requests-per-client R]
                  [--max-tokens 64] [--model NAME] [--json OUT]
Only the URL given is contacted. Standard library only.
"""
import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse

PROMPTS = [
    "The history of the city of Paris begins",
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator works in simple terms.",
    "List some facts about the planet Mars:",
    "The best way to learn a new language is",
    "Once upon a time in a quiet mountain village,",
    "Describe the water cycle step by step.",
    "Here is a recipe for a simple tomato soup:",
]


def sse_events(resp):
    """The JSON objects of an OpenAI server-sent event stream, as they
    arrive, until `[DONE]` or the end."""
    buf = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            return
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)


def one_request(url, model, prompt, max_tokens, timeout_s):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    times = []
    for obj in sse_events(resp):
        ch = obj.get("choices") or []
        if ch and ch[0].get("text"):
            times.append(time.perf_counter())
    conn.close()
    if not times:
        raise RuntimeError("no tokens streamed")
    ttft = times[0] - t0
    itl = [b - a for a, b in zip(times, times[1:])]
    return ttft, itl, time.perf_counter() - t0, len(times)


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--concurrency", type=int, required=True)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default="default")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json")
    a = ap.parse_args()
    ttfts, itls, errors = [], [], []
    tokens = [0]
    lock = threading.Lock()

    def client(i):
        for r in range(a.requests_per_client):
            prompt = PROMPTS[(i + r) % len(PROMPTS)]
            try:
                ttft, itl, _, n = one_request(a.url, a.model, prompt, a.max_tokens, a.timeout)
            except Exception as e:  # noqa: BLE001 - reported, not hidden
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                ttfts.append(ttft)
                itls.extend(itl)
                tokens[0] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    out = {
        "concurrency": a.concurrency,
        "requests": len(ttfts),
        "errors": len(errors),
        "output_tokens": tokens[0],
        "wall_s": wall,
        "agg_tok_s": tokens[0] / wall,
        "ttft_ms_p50": pct(ttfts, 50) * 1e3,
        "ttft_ms_p99": pct(ttfts, 99) * 1e3,
        "itl_ms_p50": pct(itls, 50) * 1e3,
        "itl_ms_p99": pct(itls, 99) * 1e3,
    }
    print(json.dumps(out))
    if errors:
        print("first error:", errors[0])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
