#!/usr/bin/env python3
"""Batched decode at depth against any OpenAI-compatible /v1/completions
(issue 36): S streams, each a distinct prompt of exactly D tokens (sent as
token ids, so both servers see the same context), decode N tokens at once.

Each prompt is sent once first for one token (warm-up: isoserve's prefix
cache and llama-server's slot cache then hold it, so the measured round
prefills next to nothing). Then all S stream at once, greedy, end of text
ignored. The aggregate decode rate is counted in the window where every
stream is decoding: from the last stream's first token to the first
stream's last token, the tokens that arrived in it over its length.

usage: batchdepth.py URL [--streams 16] [--depth 2048] [--tokens 128]
                         [--json OUT]
Only the URL given is contacted. Standard library only.
"""
import argparse
import json
import threading
import time
import urllib.error
import urllib.request

WORDS = ("river stone garden lantern copper meadow harbor violet thunder "
         "orchard candle marble falcon willow ember glacier").split()


def post(url, body, timeout):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def tokenize(base, text):
    # isoserve's /tokenize takes `prompt`; llama-server's takes `content`
    # (and answers no tokens to a body without it).
    for body in ({"prompt": text}, {"content": text}):
        try:
            with post(base + "/tokenize", body, 60) as r:
                ids = json.load(r)["tokens"]
        except urllib.error.HTTPError:
            continue
        if ids:
            return ids
    raise SystemExit("the server's /tokenize answered neither form")


def stream(base, ids, n, times, errors, model):
    body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "stream": True}
    try:
        with post(base + "/v1/completions", body, 900) as r:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                ev = json.loads(line[5:])
                if ev.get("choices") and ev["choices"][0].get("text") is not None:
                    times.append(time.monotonic())
    except Exception as e:  # noqa: BLE001 - reported, counted
        errors.append(repr(e))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--depth", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--model", default="default")
    ap.add_argument("--json")
    a = ap.parse_args()
    base = a.url.rstrip("/")
    prompts = []
    for s in range(a.streams):
        words = " ".join(f"{WORDS[(s * 7 + i) % len(WORDS)]}{(i * 13 + s) % 97}"
                         for i in range(a.depth))
        ids = tokenize(base, f"Note {s}: {words}")
        assert len(ids) >= a.depth, len(ids)
        prompts.append(ids[:a.depth])

    def round_(n):
        times = [[] for _ in prompts]
        errors = []
        threads = [threading.Thread(target=stream, args=(base, p, n, t, errors, a.model))
                   for p, t in zip(prompts, times)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return times, errors, time.monotonic() - t0

    _, errors, warm_s = round_(1)
    times, errors2, wall_s = round_(a.tokens)
    errors += errors2
    start = max(t[0] for t in times if t)
    end = min(t[-1] for t in times if t)
    inside = sum(1 for ts in times for x in ts if start < x <= end)
    out = {
        "streams": a.streams, "depth": a.depth, "tokens": a.tokens,
        "errors": errors, "warm_s": warm_s, "wall_s": wall_s,
        "tokens_received": sum(len(t) for t in times),
        "window_s": end - start, "tokens_in_window": inside,
        "aggregate_tok_s": inside / (end - start) if end > start else 0.0,
    }
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
