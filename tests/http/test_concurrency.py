"""K12 over HTTP: 32 concurrent greedy requests from 4 tenants each give
exactly the output (text, finish reason, usage, token logprobs' tokens) the
same prompt gives alone."""

import threading
from concurrent.futures import ThreadPoolExecutor

import requests

from conftest import TENANT_KEYS, assert_pool_clean, auth, wait_pool_idle

MODEL = "SmolLM2-135M-Instruct.Q4_1"

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one word.",
    "Write a haiku about the sea.",
    "List three colours.",
    "Explain what a CPU does in one sentence.",
]
COMPLETION_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colours are",
]


def requests_for_all_prompts():
    out = []
    for p in CHAT_PROMPTS:
        out.append(("/v1/chat/completions",
                    {"model": MODEL, "messages": [{"role": "user", "content": p}],
                     "temperature": 0, "max_tokens": 40, "logprobs": True}))
    for p in COMPLETION_PROMPTS:
        out.append(("/v1/completions",
                    {"model": MODEL, "prompt": p, "temperature": 0, "max_tokens": 40,
                     "logprobs": 0}))
    return out


def outcome(server, path, body, key):
    r = requests.post(server.url(path), json=body, headers=auth(key), timeout=120)
    assert r.status_code == 200, r.text
    j = r.json()
    c = j["choices"][0]
    if "message" in c:
        text = c["message"]["content"]
        tokens = [e["token"] for e in c["logprobs"]["content"]]
    else:
        text = c["text"]
        tokens = c["logprobs"]["tokens"]
    # What was served from the prefix cache depends on what ran before;
    # the answer must not (K12).
    usage = dict(j["usage"])
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]
    assert 0 <= cached < usage["prompt_tokens"], j["usage"]
    return text, c["finish_reason"], usage, tokens


def test_32_concurrent_requests_from_4_tenants_match_solo_runs(tenant_server):
    reqs = requests_for_all_prompts()
    keys = list(TENANT_KEYS.values())
    # Alone, one at a time.
    solo = [outcome(tenant_server, path, body, keys[0]) for path, body in reqs]
    assert any("Paris" in s[0] for s in solo)
    # 4 tenants x 8 prompts, all at once.
    jobs = [(t, i) for t in range(4) for i in range(len(reqs))]
    barrier = threading.Barrier(len(jobs), timeout=60)

    def run(job):
        t, i = job
        barrier.wait()
        path, body = reqs[i]
        return outcome(tenant_server, path, body, keys[t])

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(run, jobs, timeout=300))
    assert len(results) == 32
    # Tenant 0's repeats found its own cached prefixes; the other tenants'
    # found nothing of tenant 0's (K11; checked on the counters below).
    for (t, i), got in zip(jobs, results):
        assert got == solo[i], f"tenant t{t}, prompt #{i}: {got!r} != {solo[i]!r}"
    m = wait_pool_idle(tenant_server)
    assert_pool_clean(m)
    # Every tenant's requests are in the log as finished.
    recs = tenant_server.log_records()
    for name in TENANT_KEYS:
        assert sum(1 for r in recs if r["tenant"] == name and r["outcome"] == "finished") >= 8
