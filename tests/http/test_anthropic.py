"""Anthropic's Messages API (issue 35) through the official `anthropic`
Python SDK: text with a system prompt, the streamed event sequence equal to
the whole answer (K12), stop sequences and max_tokens, `tool_use` under
`tool_choice: any` and the stream helper's assembly of it, the
`tool_result` round trip into the prompt, thinking blocks from a thinking
template, count_tokens equal to the usage, `x-api-key` against tenants,
and errors in Anthropic's shape. The SDK sends no sampling fields; greedy
output is asked for with `extra_body`."""

import json
from pathlib import Path

import anthropic
import jsonschema
import pytest
import requests

from conftest import TENANT_KEYS, Server, Stream, assert_pool_clean, wait_pool_idle

MODEL = "SmolLM2-135M-Instruct.Q4_1"
GREEDY = {"temperature": 0}
R1 = Path(__file__).resolve().parents[1] / "data" / "templates" / "r1.jinja"
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 40},
               "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}


@pytest.fixture(scope="module")
def logged(tmp_root):
    s = Server(["--log-prompts"], tmp_root, "anthropic")
    yield s
    assert s.terminate() == 0, s.stderr()


def client(server, key="unused"):
    return anthropic.Anthropic(base_url=server.url(""), api_key=key, max_retries=0, timeout=120)


def test_messages_answer_text_and_stream_the_same(logged):
    c = client(logged)
    body = dict(model=MODEL, max_tokens=30, system="Be brief.", extra_body=GREEDY,
                messages=[{"role": "user", "content": "What is the capital of France?"}])
    m = c.messages.create(**body)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert "Paris" in m.content[0].text
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    count = c.messages.count_tokens(model=MODEL, system="Be brief.",
                                    messages=body["messages"]).input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count
    assert 0 < m.usage.output_tokens <= 30
    # The raw event sequence, then the SDK's accumulation of it.
    events = list(c.messages.create(**body, stream=True))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"], types
    assert types.count("content_block_start") == types.count("content_block_stop") == 1
    assert events[0].message.usage.input_tokens == count
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == m.content[0].text
    assert events[-2].delta.stop_reason == "end_turn"
    assert events[-2].usage.output_tokens == m.usage.output_tokens
    with c.messages.stream(**body) as s:
        final = s.get_final_message()
    assert final.content[0].text == m.content[0].text


def test_stop_sequences_and_max_tokens(logged):
    c = client(logged)
    msgs = [{"role": "user", "content": "Count from one to ten in words."}]
    full = c.messages.create(model=MODEL, max_tokens=40, messages=msgs, extra_body=GREEDY)
    text = full.content[0].text
    # A word from the middle of the answer (greedy: the same every run).
    words = text.split()
    assert len(words) >= 4, text
    word = words[len(words) // 2]
    cut = c.messages.create(model=MODEL, max_tokens=40, messages=msgs, extra_body=GREEDY,
                            stop_sequences=[word])
    assert cut.content[0].text == text[: text.index(word)]
    # The engine says which stop sequence ended it.
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", word), cut
    two = c.messages.create(model=MODEL, max_tokens=40, messages=msgs, extra_body=GREEDY,
                            stop_sequences=["zzz-never", word])
    assert (two.stop_reason, two.stop_sequence) == ("stop_sequence", word)
    events = list(c.messages.create(model=MODEL, max_tokens=40, messages=msgs, stream=True,
                                    extra_body=GREEDY, stop_sequences=[word]))
    delta = next(e for e in events if e.type == "message_delta")
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("stop_sequence", word)
    short = c.messages.create(model=MODEL, max_tokens=3, messages=msgs, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_tool_use_and_tool_result_round_trip(logged):
    c = client(logged)
    msgs = [{"role": "user", "content": "What is the weather in Oslo?"}]
    m = c.messages.create(model=MODEL, max_tokens=120, messages=msgs, tools=[WEATHER],
                          tool_choice={"type": "any", "disable_parallel_tool_use": True},
                          extra_body=GREEDY)
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    # The stream helper assembles the same input from input_json_delta.
    with c.messages.stream(model=MODEL, max_tokens=120, messages=msgs, tools=[WEATHER],
                           tool_choice={"type": "tool", "name": "get_weather"},
                           extra_body=dict(GREEDY, parallel_tool_calls=False)) as s:
        kinds = {e.type for e in s}
        final = s.get_final_message()
    assert "input_json" in kinds, kinds
    assert [b.input for b in final.content if b.type == "tool_use"] == [uses[0].input]
    # The result goes back in a user turn's tool_result block.
    history = msgs + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "Snow, -3 degrees"}]}]
    r = c.messages.create(model=MODEL, max_tokens=20, messages=history, tools=[WEATHER],
                          extra_body=GREEDY)
    assert r.stop_reason in ("end_turn", "max_tokens", "tool_use")
    prompt = [rec["prompt"] for rec in logged.log_records() if rec.get("prompt")][-1]
    assert "Snow, -3 degrees" in prompt and uses[0].id in prompt, prompt
    assert_pool_clean(wait_pool_idle(logged))


def test_thinking_blocks_from_a_thinking_template(tmp_root):
    s = Server(["--chat-template", str(R1)], tmp_root, "anthropic-thinking")
    try:
        c = client(s)
        shots = [{"role": "user", "content": "2+2?"},
                 {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
                 {"role": "user", "content": "3+3?"},
                 {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n6"},
                 {"role": "user", "content": "5+5?"}]
        m = c.messages.create(model=MODEL, max_tokens=40, messages=shots, extra_body=GREEDY,
                              thinking={"type": "enabled", "budget_tokens": 40})
        assert [b.type for b in m.content] == ["thinking", "text"], m.content
        assert m.content[0].thinking == "Add them.\n" and m.content[1].text == "8"
        with c.messages.stream(model=MODEL, max_tokens=40, messages=shots,
                               extra_body=GREEDY) as st:
            kinds = [e.type for e in st]
            final = st.get_final_message()
        assert "thinking" in kinds and "text" in kinds, kinds
        assert [b.type for b in final.content] == ["thinking", "text"]
        assert final.content[0].thinking == "Add them.\n"
        # A budget the server would not enforce (below max_tokens) is
        # refused, as is an effort level.
        for extra, field in [
            ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),
            ({"output_config": {"effort": "high"}}, "output_config.effort"),
        ]:
            r = requests.post(s.url("/v1/messages"), timeout=30, json=dict(
                {"model": MODEL, "max_tokens": 2000, "messages": shots}, **extra))
            assert r.status_code == 400, r.text
            assert field in r.json()["error"]["message"], r.text
    finally:
        assert s.terminate() == 0, s.stderr()


def test_x_api_key_authenticates_and_errors_come_in_anthropics_shape(tenant_server):
    key = TENANT_KEYS["t0"]
    ok = client(tenant_server, key).messages.create(
        model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert ok.usage.output_tokens == 3
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(tenant_server, "sk-wrong").messages.create(
            model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    c = client(tenant_server, key)
    bad = [
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AA=="}}]}]}, "messages.0.content.0.type"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
          "stop_sequences": [""]}, "stop_sequences"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
          "tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ]
    for extra, field in bad:
        r = requests.post(tenant_server.url("/v1/messages"), timeout=30,
                          headers={"x-api-key": key}, json=dict({"model": MODEL}, **extra))
        assert r.status_code == 400, r.text
        body = r.json()
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error"
        assert field in body["error"]["message"], (field, body)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-opus-4", max_tokens=3,
                          messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    # count_tokens wants a key too.
    r = requests.post(tenant_server.url("/v1/messages/count_tokens"), timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
