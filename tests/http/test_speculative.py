"""Speculative decoding over HTTP (issue 37), with the official `openai`
client: Predicted Outputs (`prediction=`) and prompt lookup
(`--speculative ngram`) change the speed, never the answer; usage counts the
prediction's kept and rejected tokens as OpenAI does; what cannot be honoured
is refused with OpenAI's error."""

import openai
import pytest

from conftest import Server, Stream, assert_pool_clean, wait_pool_idle

MODEL = "SmolLM2-135M-Instruct.Q4_1"

# An edit the default 135M model makes by copying: its answer repeats the
# text (it does not reproduce code it is asked to edit, so the document is
# prose).
FILE = ("The rivre rises in the hills, runs through the old town, turns the mill, "
        "and reaches the sea after forty miles. Along its banks grow willows and "
        "alders, and in spring the medows flood.")

EDIT = "Correct the spelling in this text and return the corrected text: " + FILE


@pytest.fixture(scope="module")
def ngram_server(tmp_root):
    s = Server(["--speculative", "ngram", "--num-speculative-tokens", "6"], tmp_root, "ngram")
    yield s
    assert s.terminate() == 0, s.stderr()


def client_of(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0,
                         timeout=120)


def chat(client, content, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=160, **kw)


def spec_counters(server):
    m = server.metrics()
    return (m["isoserve_spec_decode_num_drafts_total"],
            m["isoserve_spec_decode_num_draft_tokens_total"],
            m["isoserve_spec_decode_num_accepted_tokens_total"])


def test_a_prediction_changes_nothing_but_the_usage_it_reports(server):
    c = client_of(server)
    plain = chat(c, EDIT)
    text = plain.choices[0].message.content
    assert "rises in the hills" in text, text
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert plain.usage.completion_tokens_details.rejected_prediction_tokens == 0
    before = spec_counters(server)
    # The exact answer as the prediction: the same answer, most of the
    # prediction kept.
    exact = chat(c, EDIT, prediction={"type": "content", "content": text})
    assert exact.choices[0].message.content == text
    assert exact.choices[0].finish_reason == plain.choices[0].finish_reason
    d = exact.usage.completion_tokens_details
    # (How much is kept depends on the cost model's view of the machine.)
    assert d.accepted_prediction_tokens > 0, exact.usage
    # Rejected prediction tokens are billed as completion tokens (OpenAI).
    assert (exact.usage.completion_tokens
            == plain.usage.completion_tokens + d.rejected_prediction_tokens)
    # The answer with words changed as the prediction, as text parts: kept
    # up to each change, realigned after it.
    changed = text.replace("hills", "valleys").replace("willows", "oaks")
    assert changed != text
    half = len(changed) // 2
    parts = [{"type": "text", "text": changed[:half]}, {"type": "text", "text": changed[half:]}]
    edited = chat(c, EDIT, prediction={"type": "content", "content": parts})
    assert edited.choices[0].message.content == text
    e = edited.usage.completion_tokens_details
    assert e.accepted_prediction_tokens > 0 and e.rejected_prediction_tokens > 0, edited.usage
    # A prediction that is never right: the same answer again.
    wrong = chat(c, EDIT, prediction={"type": "content", "content": "zebra " * 50})
    assert wrong.choices[0].message.content == text
    assert wrong.usage.completion_tokens_details.accepted_prediction_tokens == 0
    after = spec_counters(server)
    assert after[0] > before[0] and after[2] - before[2] >= d.accepted_prediction_tokens
    assert_pool_clean(wait_pool_idle(server))


def test_a_streamed_prediction_streams_the_same_text_and_its_usage(server):
    c = client_of(server)
    text = chat(c, EDIT).choices[0].message.content
    stream = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": EDIT}], temperature=0,
        max_tokens=160, stream=True, stream_options={"include_usage": True},
        prediction={"type": "content", "content": text})
    pieces, usage = [], None
    for chunk in stream:
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == text
    assert usage.completion_tokens_details.accepted_prediction_tokens > 0, usage


def test_seeded_sampling_with_a_prediction_is_the_sampling_without(server):
    c = client_of(server)
    kw = dict(temperature=0.9, seed=1234, max_tokens=60)
    msgs = [{"role": "user", "content": EDIT}]
    plain = c.chat.completions.create(model=MODEL, messages=msgs, **kw)
    text = plain.choices[0].message.content
    again = c.chat.completions.create(model=MODEL, messages=msgs,
                                      prediction={"type": "content", "content": FILE}, **kw)
    assert again.choices[0].message.content == text


@pytest.mark.parametrize("extra,param", [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_a_prediction_is_refused_where_openai_refuses_it(server, extra, param):
    c = client_of(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            prediction={"type": "content", "content": "hello"}, **extra)
    body = e.value.body
    assert body["code"] == "unsupported_parameter" and body["param"] == param, body
    assert body["type"] == "invalid_request_error"


@pytest.mark.parametrize("prediction,param", [
    ("text", "prediction"),
    ({"type": "image", "content": "x"}, "prediction.type"),
    ({"type": "content"}, "prediction.content"),
    ({"type": "content", "content": [{"type": "text", "text": 3}]}, "prediction.content[0].text"),
])
def test_a_malformed_prediction_names_its_field(server, prediction, param):
    c = client_of(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                  max_tokens=4, prediction=prediction)
    assert e.value.body["param"] == param, e.value.body


def test_prompt_lookup_keeps_the_answer_and_drafts_from_the_prompt(server, ngram_server):
    plain = chat(client_of(server), EDIT)
    before = spec_counters(ngram_server)
    fast = chat(client_of(ngram_server), EDIT)
    assert fast.choices[0].message.content == plain.choices[0].message.content
    assert fast.usage.completion_tokens == plain.usage.completion_tokens
    assert fast.usage.prompt_tokens == plain.usage.prompt_tokens
    drafts, drafted, kept = [a - b for a, b in zip(spec_counters(ngram_server), before)]
    # The answer copies the prompt: drafts were made and kept.
    assert drafts > 0 and kept > 0, (drafts, drafted, kept)
    # Streamed, beside other requests (one batch): the same text.
    with Stream(ngram_server, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": EDIT}],
            "temperature": 0, "max_tokens": 160, "stream": True}) as s:
        others = [chat(client_of(ngram_server), f"Count to {i}.") for i in (3, 5)]
        text = "".join(ch["choices"][0]["delta"].get("content") or ""
                       for ch in s.json_events() if ch["choices"])
    assert text == plain.choices[0].message.content
    assert all(o.choices[0].message.content for o in others)
    assert_pool_clean(wait_pool_idle(ngram_server))


def test_disaggregated_decode_speculates_and_answers_as_unified(server, tmp_root):
    """`serve --disaggregated --speculative ngram`: the prediction travels to
    the decode node in the request, which drafts from it and from prompt
    lookup; the answer is the unified server's, the usage crosses the wire."""
    import re
    import requests
    from conftest import parse_metrics
    plain = chat(client_of(server), EDIT)
    text = plain.choices[0].message.content
    s = Server(["--disaggregated", "--speculative", "ngram", "--kv-memory", "256MiB",
                "--max-context", "2048"], tmp_root, "disagg-spec")
    try:
        c = client_of(s)
        r = chat(c, EDIT, prediction={"type": "content", "content": text})
        assert r.choices[0].message.content == text
        d = r.usage.completion_tokens_details
        assert d.accepted_prediction_tokens > 0, r.usage
        assert r.usage.completion_tokens == plain.usage.completion_tokens + d.rejected_prediction_tokens
        assert chat(c, EDIT).choices[0].message.content == text
        urls = dict(re.findall(r"(prefill|decode) node metrics: (http://\S+)", s.stderr()))
        dm = parse_metrics(requests.get(urls["decode"], timeout=10).text)
        assert dm["isoserve_node_decode_spec_accepted_tokens_total"] >= d.accepted_prediction_tokens
        assert re.search(r"^decode-0 config: .*speculative=Ngram", s.stderr(), re.M), s.stderr()
    finally:
        assert s.terminate() == 0, s.stderr()


def test_a_draft_model_answers_as_without_one_and_its_pool_is_whole(server, tmp_root):
    """`--draft-model` with a draft `isoserve make-draft` wrote from the
    default model's first and last four layers: greedy and seeded answers,
    streamed or not, are the server's without a draft; the draft model ran
    and drafted; its pool on /metrics is whole afterwards, no check fired."""
    import subprocess
    from conftest import BIN
    draft = tmp_root / "draft-0-3-26-29.gguf"
    subprocess.run([str(BIN), "make-draft", "--layers", "0-3,26-29", "-o", str(draft)],
                   check=True, capture_output=True, timeout=120)
    s = Server(["--draft-model", str(draft)], tmp_root, "draft-model")
    try:
        c, p = client_of(s), client_of(server)
        for prompt in ("Name three rivers in Europe.", "Write a haiku about the sea."):
            assert chat(c, prompt).choices[0].message.content == \
                chat(p, prompt).choices[0].message.content
            seeded = dict(temperature=0.9, seed=5)
            a = c.chat.completions.create(model=MODEL, max_tokens=60, messages=[
                {"role": "user", "content": prompt}], **seeded)
            b = p.chat.completions.create(model=MODEL, max_tokens=60, messages=[
                {"role": "user", "content": prompt}], **seeded)
            assert a.choices[0].message.content == b.choices[0].message.content
        streamed = c.chat.completions.create(model=MODEL, max_tokens=160, temperature=0,
                                             stream=True, messages=[
                                                 {"role": "user", "content": EDIT}])
        text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
        assert text == chat(p, EDIT).choices[0].message.content
        assert_pool_clean(wait_pool_idle(s))
        m = s.metrics()
        assert m["isoserve_spec_draft_model_passes_total"] > 0, m
        assert m["isoserve_spec_decode_num_draft_tokens_total"] > 0, m
        assert m['isoserve_spec_draft_pool_pages{state="owned"}'] == 0, m
        assert m['isoserve_spec_draft_pool_pages{state="free"}'] > 0, m
        assert sum(v for k, v in m.items()
                   if k.startswith("isoserve_spec_draft_pool_refusals_total")) == 0, m
    finally:
        assert s.terminate() == 0, s.stderr()
