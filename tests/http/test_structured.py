"""Structured outputs (issue 34): JSON schemas, `json_object`, regexes,
choices and Lark grammars, valid by construction, through the official
OpenAI SDK's `parse` helpers and vLLM's `structured_outputs`; the stop
reasons; the 400s for bad and malicious grammars; greedy output the same
solo, batched and on a cache hit (K12); log-probabilities of the model's
own distribution."""

import concurrent.futures as cf
import json
import re
import time
from pathlib import Path
from typing import Annotated, List, Literal, Optional

import jsonschema
import openai
import pydantic
import pytest
import requests

from conftest import assert_pool_clean, wait_pool_idle

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)
    population_millions: float


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    age: int = pydantic.Field(ge=0, le=130)
    role: Literal["engineer", "doctor", "teacher", "artist"]
    languages: List[Annotated[str, pydantic.Field(max_length=20)]] = pydantic.Field(max_length=3)
    manager: Optional[str] = None


def chat(server, body, key=None, timeout=120):
    h = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(server.url("/v1/chat/completions"), json=body, headers=h, timeout=timeout)


def msgs(text):
    return [{"role": "user", "content": text}]


# ---- the official SDK ------------------------------------------------------


def test_sdk_chat_parse_returns_a_valid_parsed_object(client):
    for model_cls, ask in [(City, "Describe Paris as JSON."), (Person, "Invent a person.")]:
        r = client.chat.completions.parse(
            model=MODEL, messages=msgs(ask), response_format=model_cls, temperature=0,
            max_tokens=200)
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        parsed = c.message.parsed
        assert isinstance(parsed, model_cls)
        # The text is the object, validated again by the schema the SDK sent.
        jsonschema.validate(json.loads(c.message.content), model_cls.model_json_schema())
        assert model_cls.model_validate_json(c.message.content) == parsed


def test_sdk_chat_stream_helper_parses_the_streamed_object(client):
    with client.chat.completions.stream(
            model=MODEL, messages=msgs("Describe Tokyo as JSON."), response_format=City,
            temperature=0, max_tokens=200) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    parsed = final.choices[0].message.parsed
    assert isinstance(parsed, City)
    assert "".join(deltas) == final.choices[0].message.content
    # The same tokens as the whole answer (K12).
    whole = client.chat.completions.parse(
        model=MODEL, messages=msgs("Describe Tokyo as JSON."), response_format=City,
        temperature=0, max_tokens=200)
    assert whole.choices[0].message.content == final.choices[0].message.content


def test_sdk_responses_parse_streamed_and_not(client):
    r = client.responses.parse(model=MODEL, input="Describe Rome as JSON.", text_format=City,
                               temperature=0, max_output_tokens=200)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, City)
    # The format is echoed as sent.
    assert r.text.format.type == "json_schema" and r.text.format.name == "City"
    with client.responses.stream(model=MODEL, input="Describe Rome as JSON.", text_format=City,
                                 temperature=0, max_output_tokens=200) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_parsed == r.output_parsed
    assert final.output_text == r.output_text


# ---- every kind of constraint ------------------------------------------------


@pytest.mark.parametrize("so,check", [
    ({"regex": "[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{3}-[0-9]{4}", t)),
    ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ({"grammar": 'start: "The answer is " NUM "."\nNUM: /[0-9]+/'},
     lambda t: re.fullmatch(r"The answer is [0-9]+\.", t)),
    ({"json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
               "required": ["ok"], "additionalProperties": False}},
     lambda t: isinstance(json.loads(t)["ok"], bool) and len(json.loads(t)) == 1),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
])
def test_structured_outputs_kinds_are_followed(server, so, check):
    for temperature in (0, 1.0):
        r = chat(server, {"messages": msgs("What is 2+2? Pick one."), "structured_outputs": so,
                          "temperature": temperature, "seed": 7, "max_tokens": 120})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "stop", c
        assert check(c["message"]["content"]), c["message"]["content"]


def test_vllm_guided_fields_and_completions_response_format(server):
    r = chat(server, {"messages": msgs("Pick a colour."), "guided_choice": ["cyan", "magenta"],
                      "temperature": 0, "max_tokens": 10})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ("cyan", "magenta")
    r = requests.post(server.url("/v1/completions"), json={
        "prompt": "A JSON object describing a cat:", "temperature": 0, "max_tokens": 80,
        "response_format": {"type": "json_object"}}, timeout=120)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop"
    assert isinstance(json.loads(c["text"]), dict)
    # llama.cpp's form: a schema inside json_object.
    r = chat(server, {"messages": msgs("Yes or no?"), "temperature": 0, "max_tokens": 20,
                      "response_format": {"type": "json_object",
                                          "schema": {"type": "object",
                                                     "properties": {"a": {"enum": ["yes", "no"]}},
                                                     "required": ["a"],
                                                     "additionalProperties": False}}})
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["message"]["content"])["a"] in ("yes", "no")


def test_stop_reason_is_length_when_the_budget_runs_out(server):
    so = {"json": {"type": "object", "properties": {
        "story": {"type": "string", "minLength": 200}}, "required": ["story"]}}
    r = chat(server, {"messages": msgs("Tell a story as JSON."), "structured_outputs": so,
                      "temperature": 0, "max_tokens": 8})
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 8
    assert c["message"]["content"].startswith('{"story": "')
    # Streamed: the same finish in the last chunk.
    r = chat(server, {"messages": msgs("Tell a story as JSON."), "structured_outputs": so,
                      "temperature": 0, "max_tokens": 8, "stream": True})
    finishes = [json.loads(l[6:])["choices"][0]["finish_reason"]
                for l in r.text.splitlines() if l.startswith("data: {")
                and json.loads(l[6:])["choices"]]
    assert finishes[-1] == "length"


def test_logprobs_are_the_models_own_distribution(server):
    """The first token's top alternatives are what the model gives without
    the grammar: the mask changes the choice, not the reported numbers."""
    body = {"messages": msgs("Pick a colour."), "temperature": 0, "max_tokens": 3,
            "logprobs": True, "top_logprobs": 5}
    free = chat(server, body).json()["choices"][0]["logprobs"]["content"][0]
    so = {"choice": ["zebra", "zucchini"]}
    bound = chat(server, dict(body, structured_outputs=so)).json()
    first = bound["choices"][0]["logprobs"]["content"][0]
    assert first["top_logprobs"] == free["top_logprobs"]
    assert bound["choices"][0]["message"]["content"] in ("zebra", "zucchini")
    # The token chosen under the mask is not the model's favourite, and its
    # reported logprob is the model's own (lower than the top one).
    assert first["token"] != free["top_logprobs"][0]["token"]
    assert first["logprob"] < free["top_logprobs"][0]["logprob"]


# ---- determinism (K12) ---------------------------------------------------------


def test_constrained_greedy_is_the_same_solo_batched_and_cached(server):
    body = {"messages": msgs("Invent a person."), "temperature": 0, "max_tokens": 150,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "Person", "schema": Person.model_json_schema(), "strict": True}}}
    solo = chat(server, body).json()
    text = solo["choices"][0]["message"]["content"]
    Person.model_validate_json(text)
    before = server.metrics()
    # Again: the prompt's pages now come from the prefix cache, the grammar
    # from the scope's grammar cache.
    again = chat(server, body).json()
    after = server.metrics()
    hit = 'isoserve_grammar_cache_lookups_total{result="hit"}'
    miss = 'isoserve_grammar_cache_lookups_total{result="miss"}'
    assert after[hit] == before[hit] + 1 and after[miss] == before[miss]
    # A mask a step, each timed; none failed.
    masks = after["isoserve_grammar_mask_seconds_count"] - \
        before["isoserve_grammar_mask_seconds_count"]
    assert masks == again["usage"]["completion_tokens"], masks
    assert after["isoserve_grammar_mask_failures_total"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["message"]["content"] == text
    # Beside seven other requests, constrained and not.
    others = [
        {"messages": msgs(f"Write about the number {i}."), "temperature": 0.8, "seed": i,
         "max_tokens": 60} for i in range(4)
    ] + [
        {"messages": msgs(f"Name {i} colours."), "temperature": 0, "max_tokens": 60,
         "structured_outputs": {"json": {"type": "array", "items": {"type": "string",
                                                                  "maxLength": 12},
                                         "maxItems": 4}}} for i in range(3)
    ]
    with cf.ThreadPoolExecutor(8) as ex:
        futs = [ex.submit(chat, server, b) for b in others]
        mine = ex.submit(chat, server, body)
        batched = mine.result().json()
        for f in futs:
            assert f.result().status_code == 200
    assert batched["choices"][0]["message"]["content"] == text
    assert_pool_clean(wait_pool_idle(server))


# ---- bad and malicious grammars ------------------------------------------------


def bad(server, body, param, says):
    t = time.monotonic()
    r = chat(server, dict({"messages": msgs("x"), "max_tokens": 5}, **body))
    took = time.monotonic() - t
    assert r.status_code == 400, (body, r.text)
    e = r.json()["error"]
    assert e["type"] == "invalid_request_error"
    assert e["param"] == param, e
    assert says.lower() in e["message"].lower(), e
    return took


def test_bad_schemas_and_grammars_are_400s_naming_the_problem(server):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "strin"}}}}, "response_format", "strin"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "format": "credit-card"}}}},
         "response_format", "format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "missing"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "has space", "schema": {}}}}, "response_format.json_schema.name", "64"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "regex"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs",
         "undefined_rule"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
         "only one"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
         "not supported"),
        ({"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}},
         "structured_outputs", "only one"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not json"),
    ]
    for body, param, says in cases:
        bad(server, body, param, says)


def test_malicious_grammars_get_a_400_or_an_answer_in_bounded_time(server):
    deep = {"type": "integer"}
    for _ in range(300):
        deep = {"type": "array", "items": deep}
    huge_enum = {"enum": [f"value-{i:05d}" for i in range(8000)]}
    big = {"type": "object", "properties": {
        f"field_{i}": {"type": "string", "description": "x" * 40} for i in range(1100)}}
    assert 100_000 < len(json.dumps(big)) < 128 << 10
    cases = [
        {"structured_outputs": {"json": deep}},
        {"structured_outputs": {"json": huge_enum}},
        {"structured_outputs": {"json": big}},
        {"structured_outputs": {"regex": "(a*)*b"}},
        {"structured_outputs": {"regex": "((x+x+)+y)|" * 50 + "z"}},
        {"structured_outputs": {"regex": "[a-z]{1,5000}[0-9]{1,5000}"}},
        {"structured_outputs": {"grammar": "start: start \"a\" | \"a\""}},
        {"structured_outputs": {"json": {"type": "string", "pattern": "^(a|a?)+$"}}},
        {"structured_outputs": {"regex": "x" * (130 << 10)}},
    ]
    for body in cases:
        t = time.monotonic()
        r = chat(server, dict({"messages": msgs("Go."), "max_tokens": 16}, **body))
        took = time.monotonic() - t
        assert took < 20, (list(body["structured_outputs"].keys()), took)
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            e = r.json()["error"]
            # Refused at compile (naming the field), past the body parser's
            # nesting bound, or past a step's bound mid-output.
            assert (e["param"] or "").startswith("structured_outputs") or \
                e["code"] in ("invalid_json", "grammar_error"), e
        else:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    # The engine is still serving, and nothing is held.
    r = chat(server, {"messages": msgs("Say hi."), "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200
    assert_pool_clean(wait_pool_idle(server))


# ---- SentencePiece: Gemma 3's vocabulary -----------------------------------------


@pytest.fixture(scope="module")
def gemma_server(tmp_root):
    from conftest import Server
    s = Server(["--model", "gemma3-270m"], tmp_root, "structured-gemma")
    yield s
    assert s.terminate() == 0, s.stderr()


def test_a_sentencepiece_vocabulary_is_constrained_too(gemma_server):
    """Gemma 3 (SentencePiece, `▁` for spaces, byte tokens): the grammar's
    token environment is built from each id's bytes, so a schema, a regex
    and a choice hold exactly as on the BPE model."""
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "rank": {"type": "integer", "minimum": 1, "maximum": 10},
        "coastal": {"type": "boolean"}},
        "required": ["city", "rank", "coastal"], "additionalProperties": False}
    for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 3}):
        r = chat(gemma_server, dict({"messages": msgs("Name a city as JSON."), "max_tokens": 80,
                                     "response_format": {"type": "json_schema", "json_schema": {
                                         "name": "c", "schema": schema, "strict": True}}},
                                    **sampling))
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), schema)
        r = chat(gemma_server, dict({"messages": msgs("A date?"), "max_tokens": 20,
                                     "structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}},
                                    **sampling))
        c = r.json()["choices"][0]
        assert re.fullmatch("[0-9]{4}-[0-9]{2}-[0-9]{2}", c["message"]["content"]), c
        r = chat(gemma_server, dict({"messages": msgs("Yes or no?"), "max_tokens": 8,
                                     "structured_outputs": {"choice": ["oui", "non", "peut-être"]}},
                                    **sampling))
        assert r.json()["choices"][0]["message"]["content"] in ("oui", "non", "peut-être")


def test_http_threads_yield_to_the_engine(server):
    """The HTTP runtime's threads (parsing, tokenising, compiling grammars:
    one request's own costs) run at nice 10; the engine thread and its
    kernel workers, which every tenant's decode waits on, at 0."""
    nice = {}
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        stat = (task / "stat").read_text()
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        nice.setdefault(comm, set()).add(int(fields[16]))
    assert nice["isoserve-http"] == {10}, nice
    assert nice["isoserve-engine"] == {0} and nice["isoserve-worker"] == {0}, nice
