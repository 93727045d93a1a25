#!/usr/bin/env python3
"""Long prompts beside short streams, against any OpenAI-compatible
/v1/completions (issue 18's serving-at-long-context mix).

L long clients each send R_long streaming greedy requests of a ~T-token
prompt (unique text: a nonce leads, so no prefix cache serves it) for 32
tokens; S short clients send short prompts for 64 tokens back to back
until every long client is done (at most R_short each). Reports TTFT and
inter-token latency p50/p99 per class; the short streams' inter-token
latency while long prompts prefill is what chunked prefill must bound.

usage: longmix.py URL [--long 4] [--short 16] [--long-tokens 3000]
                      [--long-requests 2] [--short-requests 40] [--json OUT]
Only the URL given is contacted. Standard library only.
"""
import argparse
import json
import threading
import time

from loadgen import PROMPTS, one_request, pct

WORDS = ("river stone garden lantern copper meadow harbor violet thunder "
         "orchard candle marble falcon willow ember glacier").split()


def long_prompt(nonce, tokens):
    # A word with its number is about 2.96 tokens on SmolLM2's tokenizer
    # (measured: 2,307 such words made 6,838 tokens); numbers keep words
    # apart, so no two prompts share a run of tokens.
    n = int(tokens / 2.96)
    body = " ".join(f"{WORDS[(nonce * 7 + i) % len(WORDS)]}{i % 97}" for i in range(n))
    return f"Note {nonce}: {body}. Summarise the note:"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--long", type=int, default=4)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long-tokens", type=int, default=3000)
    ap.add_argument("--long-requests", type=int, default=2)
    ap.add_argument("--short-requests", type=int, default=40)
    ap.add_argument("--model", default="default")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json")
    a = ap.parse_args()
    lock = threading.Lock()
    res = {"long": {"ttft": [], "itl": [], "n": 0}, "short": {"ttft": [], "itl": [], "n": 0}}
    errors = []
    longs_left = [a.long]

    def record(kind, fn):
        try:
            ttft, itl, _, n = fn()
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            with lock:
                errors.append(f"{kind}: {e}")
            return
        with lock:
            res[kind]["ttft"].append(ttft)
            res[kind]["itl"].extend(itl)
            res[kind]["n"] += 1

    def long_client(i):
        for r in range(a.long_requests):
            p = long_prompt(1000 + i * 100 + r, a.long_tokens)
            record("long", lambda: one_request(a.url, a.model, p, 32, a.timeout))
        with lock:
            longs_left[0] -= 1

    def short_client(i):
        for r in range(a.short_requests):
            with lock:
                if longs_left[0] == 0:
                    return
            p = PROMPTS[(i + r) % len(PROMPTS)]
            record("short", lambda: one_request(a.url, a.model, p, 64, a.timeout))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=short_client, args=(i,)) for i in range(a.short)]
    threads += [threading.Thread(target=long_client, args=(i,)) for i in range(a.long)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {"wall_s": time.perf_counter() - t0, "errors": len(errors)}
    for kind, r in res.items():
        out[kind] = {
            "requests": r["n"],
            "ttft_ms_p50": pct(r["ttft"], 50) * 1e3,
            "ttft_ms_p99": pct(r["ttft"], 99) * 1e3,
            "itl_ms_p50": pct(r["itl"], 50) * 1e3,
            "itl_ms_p99": pct(r["itl"], 99) * 1e3,
            "itl_ms_max": max(r["itl"], default=float("nan")) * 1e3,
        }
    print(json.dumps(out))
    if errors:
        print("first error:", errors[0])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
