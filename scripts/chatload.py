#!/usr/bin/env python3
"""Multi-turn chat workload for any OpenAI-compatible /v1/chat/completions:
the prefix-cache benchmark (issue 16).

T tenants, each with its own ~500-token system prompt; C conversations run
at once, spread over the tenants; each conversation has N turns, every turn
sending the whole conversation so far (system prompt, earlier questions and
the answers the server gave) plus a new question. Greedy, streaming,
`max_tokens` per answer. Reports TTFT p50/p99 (all turns, and turns after
the first), output tok/s and the prompt tokens the server reported cached.

usage: chatload.py URL [--tenants 4] [--conversations 8] [--turns 4]
                   [--max-tokens 48] [--key-prefix sk-] [--json OUT]
Keys: `--key-prefix P` sends tenant i's requests with `Bearer P<i>` (a
server without tenants ignores them). Only the URL given is contacted.
Standard library only.
"""
import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse

from loadgen import pct, sse_events

TOPICS = ["lighthouses", "beekeeping", "glassblowing", "orchards"]
FACTS = ("Keep every answer short and factual. You advise the staff of a small "
         "museum about {topic}. The museum opens at nine and closes at five; its "
         "archive holds letters, ledgers and drawings collected over two centuries. ")
QUESTIONS = [
    "What should a first-time visitor see?",
    "Which object needs the most careful handling, and why?",
    "Suggest a title for a new exhibition.",
    "Summarise our conversation in one sentence.",
]


def system_prompt(tenant: int, words: int = 380) -> str:
    topic = TOPICS[tenant % len(TOPICS)]
    base = FACTS.format(topic=topic)
    text = f"Tenant {tenant} house rules. "
    while len(text.split()) < words:
        text += base
    return text


def chat_turn(url, key, messages, max_tokens, timeout_s=300):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    ttft, text, usage = None, "", None
    for j in sse_events(resp):
        if j.get("usage"):
            usage = j["usage"]
        for c in j.get("choices", []):
            piece = c.get("delta", {}).get("content") or ""
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text += piece
    conn.close()
    return ttft if ttft is not None else time.perf_counter() - t0, text, usage or {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--key-prefix", default="sk-bench-")
    ap.add_argument("--json")
    a = ap.parse_args()
    results, lock = [], threading.Lock()

    def conversation(c):
        tenant = c % a.tenants
        key = f"{a.key_prefix}{tenant}"
        messages = [{"role": "system", "content": system_prompt(tenant)}]
        for turn in range(a.turns):
            messages.append({"role": "user", "content": f"(conversation {c}) {QUESTIONS[turn % len(QUESTIONS)]}"})
            ttft, text, usage = chat_turn(a.url, key, messages, a.max_tokens)
            messages.append({"role": "assistant", "content": text})
            details = usage.get("prompt_tokens_details") or {}
            with lock:
                results.append({"turn": turn, "ttft_s": ttft,
                                "prompt_tokens": usage.get("prompt_tokens", 0),
                                "cached_tokens": details.get("cached_tokens", 0),
                                "completion_tokens": usage.get("completion_tokens", 0)})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=conversation, args=(c,)) for c in range(a.conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r["ttft_s"] for r in results]
    later = [r["ttft_s"] for r in results if r["turn"] > 0]
    out = {
        "requests": len(results),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": pct(ttft, 99),
        "ttft_later_turns_p50_s": statistics.median(later) if later else None,
        "output_tok_per_s": sum(r["completion_tokens"] for r in results) / wall,
        "prompt_tokens": sum(r["prompt_tokens"] for r in results),
        "cached_tokens": sum(r["cached_tokens"] for r in results),
        "wall_s": wall,
    }
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": out, "requests": results}, f, indent=1)


if __name__ == "__main__":
    main()
