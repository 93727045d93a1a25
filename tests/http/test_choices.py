"""`n` choices of one prompt: each a sequence of its own in the engine.
Greedy choices equal the single answer (K12: a choice does not depend on the
choices beside it), seeded choice i is what `n = 1` gives with seed + i,
streaming equals non-streaming per index, usage counts the prompt once, a
dropped stream frees every choice's pages, and `n` is bounded by the limit
and by the tenant's `max_concurrent`."""

import json

import openai
import pytest
import requests

from conftest import (Server, Stream, assert_pool_clean, auth, wait_pool_idle,
                      write_tenants)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
STORY = [{"role": "user", "content": "Tell me a story about a fox."}]


def tokenize_prompt(server, text):
    r = requests.post(server.url("/tokenize"), json={"prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


def test_greedy_choices_all_equal_the_single_answer(client):
    one = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                         max_tokens=16, logprobs=True, top_logprobs=2)
    four = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                          max_tokens=16, logprobs=True, top_logprobs=2, n=4)
    assert "Paris" in one.choices[0].message.content
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    for c in four.choices:
        assert c.message.content == one.choices[0].message.content
        assert c.finish_reason == one.choices[0].finish_reason
        assert ([t.token for t in c.logprobs.content]
                == [t.token for t in one.choices[0].logprobs.content])
        assert ([t.logprob for t in c.logprobs.content]
                == [t.logprob for t in one.choices[0].logprobs.content])
    # The prompt once, every choice's completion.
    assert four.usage.prompt_tokens == one.usage.prompt_tokens
    assert four.usage.completion_tokens == 4 * one.usage.completion_tokens
    assert four.usage.total_tokens == four.usage.prompt_tokens + four.usage.completion_tokens


def test_seeded_choice_i_is_the_single_answer_with_seed_plus_i(client):
    kw = dict(model=MODEL, messages=STORY, temperature=1.0, max_tokens=12)
    three = client.chat.completions.create(n=3, seed=40, **kw)
    singles = [client.chat.completions.create(seed=40 + i, **kw).choices[0].message.content
               for i in range(3)]
    texts = [c.message.content for c in three.choices]
    assert texts == singles
    assert len(set(texts)) > 1, texts
    # Streamed: the same text per index, each choice finished once, usage last.
    stream = client.chat.completions.create(n=3, seed=40, stream=True,
                                            stream_options={"include_usage": True}, **kw)
    got, finishes, usage = ["", "", ""], {}, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            got[c.index] += c.delta.content or ""
            if c.finish_reason:
                assert c.index not in finishes
                finishes[c.index] = c.finish_reason
    assert got == texts
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage.completion_tokens == three.usage.completion_tokens == 36


def test_completion_choices_with_logprobs_and_stop(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10,
                                  temperature=0.9, seed=3, n=2, logprobs=1, stop=["."])
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert "".join(c.logprobs.tokens).startswith(c.text)
        assert "." not in c.text
        assert c.logprobs.text_offset[0] == 0
    assert r.usage.prompt_tokens == 4


def test_a_batch_of_prompts_answers_each_as_alone(client, server):
    prompts = ["Once upon a time", "The capital of France is", "def fib(n):"]
    ids = tokenize_prompt(server, prompts[1])
    batch = client.completions.create(model=MODEL, prompt=[prompts[0], ids, prompts[2]],
                                      max_tokens=8, temperature=0.8, seed=5, n=2)
    assert [c.index for c in batch.choices] == list(range(6))
    alone_prompt_tokens = alone_completion_tokens = 0
    for p, prompt in enumerate(prompts):
        for j in range(2):
            one = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                            temperature=0.8, seed=5 + j)
            assert batch.choices[2 * p + j].text == one.choices[0].text, (p, j)
            assert batch.choices[2 * p + j].finish_reason == one.choices[0].finish_reason
            alone_completion_tokens += one.usage.completion_tokens
        alone_prompt_tokens += one.usage.prompt_tokens
    # Each prompt counted once; every choice's completion.
    assert batch.usage.prompt_tokens == alone_prompt_tokens
    assert batch.usage.completion_tokens == alone_completion_tokens
    # One request-log line for the whole batch, with its sums.
    [rec] = [r for r in server.log_records() if r["id"] == batch.id]
    assert (rec["sequences"], rec["outcome"]) == (6, "finished"), rec
    assert rec["prompt_tokens"] == alone_prompt_tokens
    assert rec["output_tokens"] == alone_completion_tokens
    # Streamed: the same text per index.
    stream = client.completions.create(model=MODEL, prompt=[prompts[0], ids, prompts[2]],
                                       max_tokens=8, temperature=0.8, seed=5, n=2, stream=True)
    got = [""] * 6
    for chunk in stream:
        for c in chunk.choices:
            got[c.index] += c.text
    assert got == [c.text for c in batch.choices]
    # A bad prompt anywhere in the batch refuses the whole request, naming it.
    r = requests.post(server.url("/v1/completions"), timeout=60,
                      json={"model": MODEL, "prompt": ["a", [1, 99999999]], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert_pool_clean(wait_pool_idle(server))


def test_a_dropped_stream_frees_every_choice(server):
    body = {"model": MODEL, "messages": STORY, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0.8, "n": 4, "stream": True}
    before = server.metrics()
    with Stream(server, "/v1/chat/completions", body) as s:
        assert s.status == 200
        seen = set()
        for e in s.json_events():
            seen.update(c["index"] for c in e["choices"] if c["delta"].get("content"))
            if len(seen) == 4:
                break
        assert seen == {0, 1, 2, 3}
    m = wait_pool_idle(server)
    assert_pool_clean(m)
    key = 'isoserve_requests_total{outcome="cancelled"}'
    assert m.get(key, 0) - before.get(key, 0) == 1, "one HTTP request, cancelled once"


def test_n_is_bounded_by_the_limit_and_the_tenants_max_concurrent(tmp_root):
    key = "sk-test-choices-two"
    tenants = write_tenants(tmp_root / "choices-tenants.toml",
                            [{"name": "two", "key": key, "max_concurrent": 2}])
    s = Server(["--tenants", str(tenants)], tmp_root, "choices")
    try:
        url = s.url("/v1/completions")

        def post(**kw):
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0, **kw}
            return requests.post(url, data=json.dumps(body), headers=auth(key), timeout=60)

        r = post(n=2)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 2
        for kw, param in (({"n": 3}, "n"), ({"n": 17}, "n"), ({"n": 0}, "n"),
                          ({"best_of": 2}, "best_of")):
            r = post(**kw)
            assert r.status_code == 400, (kw, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error", err
        assert "max_concurrent 2" in post(n=3).json()["error"]["message"]
        assert_pool_clean(wait_pool_idle(s))
    finally:
        assert s.terminate() == 0, s.stderr()
