#!/usr/bin/env python3
"""Closed-loop load of streaming chat requests, constrained by a JSON schema
or not, against any OpenAI-compatible /v1/chat/completions (issue 34's
benchmark: isoserve and llama-server on the same GGUF).

Each of C clients sends R streaming greedy requests back to back. With
--schema, every request carries `response_format: json_schema` with one of
SCHEMAS (client i uses schema i mod 8); every schema is an array of at
least 40 objects, so no request can finish by its grammar before
--max-tokens: constrained and unconstrained requests (the latter with
ignore_eos) generate the same number of tokens, and tok/s compare. Reports
aggregate output tok/s, TTFT and inter-token latency p50/p99, and whether
every constrained output is a prefix of a document of its schema (checked
by the caller with `--check`).

usage: structload.py URL --concurrency C [--requests-per-client R]
                     [--max-tokens N] [--schema] [--key KEY] [--json OUT]
Only the URL given is contacted. Standard library only.
"""
import argparse
import http.client
import json
import threading
import time
import urllib.parse

from loadgen import sse_events  # the same SSE reader (scripts/ is on sys.path)

PROMPTS = [
    "List some cities of Europe as JSON.",
    "List some animals as JSON.",
    "List some books as JSON.",
    "List some planets as JSON.",
    "List some rivers as JSON.",
    "List some songs as JSON.",
    "List some tools as JSON.",
    "List some fruits as JSON.",
]


def item(props):
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


ITEMS = [
    item({"name": {"type": "string", "maxLength": 20},
          "country": {"type": "string", "maxLength": 20}}),
    item({"name": {"type": "string", "maxLength": 16},
          "legs": {"type": "integer", "minimum": 0, "maximum": 8}}),
    item({"title": {"type": "string", "maxLength": 24},
          "year": {"type": "integer", "minimum": 1500, "maximum": 2030}}),
    item({"name": {"type": "string", "maxLength": 12},
          "moons": {"type": "integer", "minimum": 0, "maximum": 200},
          "gas": {"type": "boolean"}}),
    item({"name": {"type": "string", "maxLength": 16},
          "length_km": {"type": "number", "minimum": 0, "maximum": 7000}}),
    item({"title": {"type": "string", "maxLength": 24},
          "genre": {"enum": ["pop", "rock", "jazz", "folk", "classical"]}}),
    item({"name": {"type": "string", "maxLength": 16},
          "kind": {"enum": ["hand", "power", "garden"]}}),
    item({"name": {"type": "string", "maxLength": 12},
          "color": {"type": "string", "pattern": "^[a-z]{3,10}$"}}),
]
SCHEMAS = [{"type": "array", "items": it, "minItems": 40} for it in ITEMS]


def one_request(url, k, max_tokens, schema, key, timeout_s):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "list", "schema": SCHEMAS[k % len(SCHEMAS)], "strict": True}}
    else:
        body["ignore_eos"] = True
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    t0 = time.perf_counter()
    conn.request("POST", u.path.rstrip("/") + "/v1/chat/completions", json.dumps(body), headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    times, text, usage, finish = [], [], None, None
    for ev in sse_events(resp):
        if ev.get("usage"):
            usage = ev["usage"]
        for c in ev.get("choices") or []:
            piece = (c.get("delta") or {}).get("content")
            if piece:
                times.append(time.perf_counter())
                text.append(piece)
            finish = c.get("finish_reason") or finish
    conn.close()
    return {"start": t0, "times": times, "text": "".join(text),
            "tokens": (usage or {}).get("completion_tokens", len(times)), "finish": finish}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--concurrency", type=int, required=True)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--schema", action="store_true")
    ap.add_argument("--key")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json")
    a = ap.parse_args()
    results, errors = [], []
    lock = threading.Lock()

    def client(i):
        for r in range(a.requests_per_client):
            try:
                res = one_request(a.url, i + r, a.max_tokens, a.schema, a.key, a.timeout)
                res["schema"] = (i + r) % len(SCHEMAS) if a.schema else None
                with lock:
                    results.append(res)
            except Exception as e:  # noqa: BLE001 - reported, not hidden
                with lock:
                    errors.append(str(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} requests failed: {errors[:3]}")
    tokens = sum(r["tokens"] for r in results)
    ttft = [(r["times"][0] - r["start"]) * 1e3 for r in results if r["times"]]
    itl = [(b - a_) * 1e3 for r in results for a_, b in zip(r["times"], r["times"][1:])]
    out = {
        "concurrency": a.concurrency, "requests": len(results), "schema": a.schema,
        "tokens": tokens, "wall_s": wall, "agg_tok_s": tokens / wall,
        "ttft_ms_p50": pct(ttft, 0.5), "ttft_ms_p99": pct(ttft, 0.99),
        "itl_ms_p50": pct(itl, 0.5), "itl_ms_p99": pct(itl, 0.99),
        "finishes": sorted({str(r["finish"]) for r in results}),
        "outputs": [{"schema": r["schema"], "text": r["text"], "finish": r["finish"]}
                    for r in results],
    }
    print(f"{'json_schema' if a.schema else 'free'} c={a.concurrency}: {tokens} tokens in "
          f"{wall:.1f} s = {out['agg_tok_s']:.1f} tok/s, TTFT p50 {out['ttft_ms_p50']:.0f} ms, "
          f"ITL p50/p99 {out['itl_ms_p50']:.1f}/{out['itl_ms_p99']:.1f} ms, "
          f"finishes {out['finishes']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
