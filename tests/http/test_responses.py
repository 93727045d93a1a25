"""OpenAI's Responses API (`/v1/responses`) through the official `openai`
client: the same tokens as chat completions for the same conversation,
streamed events in their order with sequence numbers, `incomplete` at
`max_output_tokens`, log-probabilities on request, and refusals (in
OpenAI's error shape) for what a stateless server cannot do."""

import json

import openai
import pytest
import requests

from conftest import Stream, assert_pool_clean, wait_pool_idle

MODEL = "SmolLM2-135M-Instruct.Q4_1"
QUESTION = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


def test_a_response_is_the_chat_answer_of_the_same_conversation(client):
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": "You are brief."},
                  {"role": "user", "content": QUESTION}])
    r = client.responses.create(model=MODEL, temperature=0, max_output_tokens=24,
                                instructions="You are brief.", input=QUESTION)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.instructions == "You are brief." and r.temperature == 0 and r.top_p == 1
    assert r.status == "completed" and r.incomplete_details is None
    assert r.output_text == chat.choices[0].message.content
    assert "Paris" in r.output_text
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.content[0].type == "output_text"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # Messages as items, with typed content parts: the same prompt.
    r2 = client.responses.create(
        model=MODEL, temperature=0, max_output_tokens=24,
        input=[{"role": "developer", "content": "You are brief."},
               {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": QUESTION}]}])
    assert r2.output_text == r.output_text
    assert r2.usage.input_tokens == r.usage.input_tokens


def test_a_streamed_response_sends_every_event_in_order(client):
    full = client.responses.create(model=MODEL, temperature=0, max_output_tokens=6,
                                   input="Write a long story about a lighthouse.")
    warm = client.responses.create(model=MODEL, temperature=0.7, top_p=0.9,
                                   max_output_tokens=2, input="Hi")
    assert (warm.temperature, warm.top_p) == (0.7, 0.9), "as sent, not as f32"
    assert full.status == "incomplete"
    assert full.incomplete_details.reason == "max_output_tokens"
    assert full.usage.output_tokens == 6
    events = list(client.responses.create(model=MODEL, temperature=0, max_output_tokens=6,
                                          input="Write a long story about a lighthouse.",
                                          stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == full.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.output_text == full.output_text and done.usage.output_tokens == 6
    assert events[-4].text == full.output_text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {done.output[0].id}


def test_logprobs_come_with_the_text_when_included(client):
    r = client.responses.create(model=MODEL, temperature=0, max_output_tokens=5,
                                input=QUESTION, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    lp = r.output[0].content[0].logprobs
    assert "".join(t.token for t in lp) == r.output_text
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp)
    plain = client.responses.create(model=MODEL, temperature=0, max_output_tokens=5,
                                    input=QUESTION)
    assert plain.output[0].content[0].logprobs == []


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "two words", "parameters": {}}]},
     "tools[0].function.name"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
     "input[0].arguments"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input[0].type"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]"),
    ({"n": 2}, "n"),
])
def test_what_a_stateless_server_cannot_do_is_refused(server, extra, param):
    body = {"model": MODEL, "input": "hi", **extra}
    r = requests.post(server.url("/v1/responses"), data=json.dumps(body), timeout=60,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    body = {"model": MODEL}
    r = requests.post(server.url("/v1/responses"), data=json.dumps(body), timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_a_dropped_response_stream_frees_its_pages(server):
    body = {"model": MODEL, "input": "Write a long story.", "max_output_tokens": 500,
            "stream": True}
    with Stream(server, "/v1/responses", body) as s:
        assert s.status == 200
        n = 0
        for e in s.json_events():
            n += e["type"] == "response.output_text.delta"
            if n == 3:
                break
        assert n == 3
    assert_pool_clean(wait_pool_idle(server))
