"""The tool-calling corpus (tests/data/tools/corpus.json, 120 cases made
by make_corpus.py beside it): one to four tools a case (nested objects,
optional arguments, enums, bounds, arrays, $ref, anyOf, no arguments),
`required` or a named tool, one call or parallel ones, greedy or sampled,
16 requests at a time. 100%: every call names a declared tool (the named
one, when named) and its arguments validate against that tool's schema,
by Python's `jsonschema`; every answer ends by its calls."""

import concurrent.futures as cf
import json
from pathlib import Path

import jsonschema

from conftest import assert_pool_clean, wait_pool_idle

CORPUS = json.loads((Path(__file__).resolve().parents[1] / "data" / "tools"
                     / "corpus.json").read_text())
STREAMS = 16


def ask(server, case):
    import requests
    body = {"messages": [{"role": "user", "content": case["prompt"]}], "tools": case["tools"],
            "tool_choice": case["tool_choice"],
            "parallel_tool_calls": case["parallel_tool_calls"],
            # Room for the grammar's 16 calls when parallel.
            "max_tokens": 1600 if case["parallel_tool_calls"] else 400}
    body.update(case["sampling"])
    return case, requests.post(server.url("/v1/chat/completions"), json=body, timeout=600)


def test_corpus_covers_what_it_claims():
    assert len(CORPUS) >= 100
    text = json.dumps(CORPUS)
    for kw in ["$ref", "anyOf", "enum", "const", "pattern", "minimum", "maxItems", '"boolean"']:
        assert kw in text, kw
    assert any(len(c["tools"]) >= 3 for c in CORPUS)
    assert any(c["parallel_tool_calls"] for c in CORPUS)
    assert any(isinstance(c["tool_choice"], dict) for c in CORPUS)


def test_every_call_of_the_corpus_names_a_declared_tool_and_validates(server):
    failures, calls_total = [], 0
    with cf.ThreadPoolExecutor(STREAMS) as ex:
        for case, r in ex.map(lambda c: ask(server, c), CORPUS):
            where = case["name"]
            if r.status_code != 200:
                failures.append(f"{where}: HTTP {r.status_code} {r.text[:200]}")
                continue
            ch = r.json()["choices"][0]
            calls = ch["message"].get("tool_calls") or []
            if ch["finish_reason"] != "tool_calls" or not calls:
                failures.append(f"{where}: {ch['finish_reason']}, {len(calls)} calls")
                continue
            if not case["parallel_tool_calls"] and len(calls) != 1:
                failures.append(f"{where}: {len(calls)} calls without parallel_tool_calls")
            schemas = {t["function"]["name"]: t["function"]["parameters"] for t in case["tools"]}
            named = case["tool_choice"]["function"]["name"] \
                if isinstance(case["tool_choice"], dict) else None
            for call in calls:
                calls_total += 1
                name = call["function"]["name"]
                if name not in schemas or (named and name != named):
                    failures.append(f"{where}: called {name!r}")
                    continue
                try:
                    jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
                except (ValueError, jsonschema.ValidationError) as e:
                    failures.append(f"{where}: {name} arguments: {str(e)[:200]}")
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} failures)"
    assert calls_total >= len(CORPUS)
    assert_pool_clean(wait_pool_idle(server))
