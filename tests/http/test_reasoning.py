"""Reasoning split from the answer (issue 35): a thinking template
(tests/data/templates/r1.jinja, DeepSeek-R1's way: the generation prompt
opens `<think>`) on the default model. Chat answers carry
`reasoning_content` (and vLLM's newer `reasoning`) apart from `content`,
streamed as their own deltas before the answer's; the Responses API gives a
`reasoning` output item before the message, its `reasoning_text` events,
and `reasoning_tokens`; `enable_thinking: false` closes the thought in the
prompt; `--reasoning-parser none` leaves everything in `content`."""

from pathlib import Path

import openai
import pytest
import requests

from conftest import Server, Stream

MODEL = "SmolLM2-135M-Instruct.Q4_1"
R1 = Path(__file__).resolve().parents[1] / "data" / "templates" / "r1.jinja"
# Two worked turns show the model the form: it thinks, closes the thought,
# answers (greedy: the same every run).
FEW_SHOT = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n6"},
    {"role": "user", "content": "5+5?"},
]


@pytest.fixture(scope="module")
def thinking(tmp_root):
    s = Server(["--chat-template", str(R1)], tmp_root, "reasoning")
    yield s
    assert s.terminate() == 0, s.stderr()


def test_chat_splits_the_thought_from_the_answer_streamed_and_not(thinking):
    c = openai.OpenAI(base_url=thinking.url("/v1"), api_key="x", max_retries=0, timeout=120)
    r = c.chat.completions.create(model=MODEL, messages=FEW_SHOT, temperature=0, max_tokens=40)
    m = r.choices[0].message
    assert m.reasoning_content == "Add them.\n", m
    assert m.model_extra["reasoning"] == m.reasoning_content
    assert m.content == "8", m
    assert "<think>" not in m.content and "</think>" not in m.reasoning_content
    # Streamed: reasoning deltas, then content deltas, the same texts.
    kinds, thought, answer = [], "", ""
    for chunk in c.chat.completions.create(model=MODEL, messages=FEW_SHOT, temperature=0,
                                           max_tokens=40, stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        extra = d.model_extra or {}
        if extra.get("reasoning_content"):
            kinds.append("r")
            thought += extra["reasoning_content"]
            assert extra["reasoning"] == extra["reasoning_content"]
        if d.content:
            kinds.append("c")
            answer += d.content
    assert (thought, answer) == ("Add them.\n", "8")
    assert "".join(kinds).rstrip("c").count("c") == 0, kinds  # all thought before answer


def test_enable_thinking_false_closes_the_thought_in_the_prompt(thinking):
    r = requests.post(thinking.url("/v1/chat/completions"), timeout=60, json={
        "model": MODEL, "messages": FEW_SHOT, "temperature": 0, "max_tokens": 20,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    m = r.json()["choices"][0]["message"]
    assert "reasoning_content" not in m and m["content"], m


def test_responses_give_a_reasoning_item_before_the_message(thinking):
    body = {"model": MODEL, "input": FEW_SHOT, "temperature": 0, "max_output_tokens": 40}
    r = requests.post(thinking.url("/v1/responses"), json=body, timeout=60)
    assert r.status_code == 200, r.text
    resp = r.json()
    assert [o["type"] for o in resp["output"]] == ["reasoning", "message"], resp["output"]
    assert resp["output"][0]["content"] == [{"type": "reasoning_text", "text": "Add them.\n"}]
    assert resp["output"][1]["content"][0]["text"] == "8"
    details = resp["usage"]["output_tokens_details"]
    assert 0 < details["reasoning_tokens"] < resp["usage"]["output_tokens"], resp["usage"]
    # The SDK reads it.
    c = openai.OpenAI(base_url=thinking.url("/v1"), api_key="x", max_retries=0, timeout=120)
    sdk = c.responses.create(model=MODEL, input=FEW_SHOT, temperature=0, max_output_tokens=40)
    assert sdk.output_text == "8"
    assert sdk.output[0].type == "reasoning"
    # Streamed: the reasoning item's events, closed before the message opens.
    events = [e for e in Stream(thinking, "/v1/responses", dict(body, stream=True)).json_events()]
    types = [e["type"] for e in events]
    first_msg = next(i for i, e in enumerate(events) if e["type"] == "response.output_item.added"
                     and e["item"]["type"] == "message")
    assert events[first_msg]["output_index"] == 1
    assert types.index("response.reasoning_text.done") < first_msg
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") \
        == "Add them.\n"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "8"
    done = events[-1]["response"]
    assert done["output"] == resp["output"] or [o["type"] for o in done["output"]] == \
        ["reasoning", "message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_reasoning_parser_none_leaves_everything_in_content(tmp_root):
    s = Server(["--chat-template", str(R1), "--reasoning-parser", "none"], tmp_root,
               "reasoning-none")
    try:
        r = requests.post(s.url("/v1/chat/completions"), timeout=60, json={
            "model": MODEL, "messages": FEW_SHOT, "temperature": 0, "max_tokens": 40})
        m = r.json()["choices"][0]["message"]
        assert "reasoning_content" not in m
        assert m["content"] == "Add them.\n</think>\n\n8", m
    finally:
        assert s.terminate() == 0, s.stderr()


def test_schemas_and_tools_apply_after_the_thought(thinking):
    """The grammar holds the answer, not the thought (as vLLM applies
    structured outputs to a thinking model): the model thinks freely, then
    answers under the schema, or calls."""
    import json

    import jsonschema
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"]}
    r = requests.post(thinking.url("/v1/chat/completions"), timeout=60, json={
        "model": MODEL, "messages": FEW_SHOT, "temperature": 0, "max_tokens": 60,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "a", "schema": schema}}})
    ch = r.json()["choices"][0]
    assert ch["message"]["reasoning_content"] == "Add them.\n", ch
    jsonschema.validate(json.loads(ch["message"]["content"]), schema)
    assert ch["finish_reason"] == "stop"
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"]}}}]
    r = requests.post(thinking.url("/v1/chat/completions"), timeout=60, json={
        "model": MODEL, "messages": FEW_SHOT, "temperature": 0, "max_tokens": 80,
        "tools": tools, "tool_choice": "required", "parallel_tool_calls": False})
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "tool_calls", ch
    assert ch["message"]["reasoning_content"] == "Add them.\n", ch
    call = ch["message"]["tool_calls"][0]["function"]
    assert call["name"] == "add"
    jsonschema.validate(json.loads(call["arguments"]), tools[0]["function"]["parameters"])
    # A bad schema is still named as always.
    r = requests.post(thinking.url("/v1/chat/completions"), timeout=60, json={
        "model": MODEL, "messages": FEW_SHOT, "max_tokens": 5,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "schema": {"type": "object", "properties": {"x": {"pattern": "(?<=a)"}}}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
