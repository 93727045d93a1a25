#!/usr/bin/env python3
"""Fair-share workloads for isoserve's K13 benchmark (issue 17); any
OpenAI-compatible /v1/completions with tenants' keys `<key-prefix><i>`.

* `noisy`: tenant 0 opens --streams streams of --tokens tokens at once;
  meanwhile tenant 1 sends --probes 4-token requests one after another.
  Reports tenant 1's latency idle (before the storm) and under it
  (p50/p99/max), and how long the storm took.
* `mix`: --tenants tenants, each --streams-per-tenant closed-loop streams
  of --tokens-token requests, for --seconds; reports each tenant's
  generated tokens and share (set the weights in the server's
  tenants.toml: this script only measures).

usage: fairload.py URL noisy|mix [options] [--json OUT]
Only the URL given is contacted. Standard library only.
"""
import argparse
import http.client
import json
import threading
import time
import urllib.parse

from loadgen import pct

PROMPT = "Write a long story about a lighthouse keeper and the ships he saw."


def complete(url, key, prompt, max_tokens, timeout_s=600):
    """One greedy completion: (seconds, completion tokens)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    resp = conn.getresponse()
    data = resp.read()
    dt = time.perf_counter() - t0
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
    return dt, json.loads(data)["usage"]["completion_tokens"]


def noisy(a):
    key = lambda i: f"{a.key_prefix}{i}"  # noqa: E731
    idle = [complete(a.url, key(1), "Say hello.", 4)[0] for _ in range(5)]
    done = []

    def stream():
        done.append(complete(a.url, key(0), PROMPT, a.tokens)[1])

    threads = [threading.Thread(target=stream) for _ in range(a.streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(1.0)  # the storm fills the batch
    busy = []
    for _ in range(a.probes):
        if len(done) == a.streams:
            break
        busy.append(complete(a.url, key(1), "Say hello.", 4)[0])
    for t in threads:
        t.join()
    storm_s = time.perf_counter() - t0
    return {
        "streams": a.streams, "tokens": a.tokens,
        "b_idle_p50_s": pct(idle, 50), "b_busy_p50_s": pct(busy, 50),
        "b_busy_p99_s": pct(busy, 99), "b_busy_max_s": max(busy) if busy else None,
        "b_probes_under_storm": len(busy), "storm_s": storm_s,
        "storm_tokens": sum(done),
    }


def mix(a):
    tokens = [0] * a.tenants
    lock = threading.Lock()
    stop = time.perf_counter() + a.seconds

    def client(i):
        while time.perf_counter() < stop:
            _, n = complete(a.url, f"{a.key_prefix}{i}", PROMPT, a.tokens)
            if time.perf_counter() <= stop:
                with lock:
                    tokens[i] += n

    threads = [threading.Thread(target=client, args=(i,))
               for i in range(a.tenants) for _ in range(a.streams_per_tenant)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(tokens) or 1
    return {"seconds": a.seconds, "tokens": tokens,
            "share": [round(t / total, 4) for t in tokens]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("workload", choices=["noisy", "mix"])
    p.add_argument("--key-prefix", default="sk-bench-")
    p.add_argument("--streams", type=int, default=40)
    p.add_argument("--tokens", type=int, default=150)
    p.add_argument("--probes", type=int, default=20)
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--streams-per-tenant", type=int, default=16)
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--json")
    a = p.parse_args()
    out = noisy(a) if a.workload == "noisy" else mix(a)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
