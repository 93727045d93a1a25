"""The schema corpus (tests/data/schemas/corpus.json, 220 schemas made by
make_corpus.py beside it): every schema answered greedy and sampled, 16
requests at a time, and every output validated by Python's `jsonschema`
against the schema as sent. 100%: a constrained output that does not
validate, or that did not finish by its grammar, fails the test."""

import concurrent.futures as cf
import json
from pathlib import Path

import jsonschema
import pytest
import requests

from conftest import assert_pool_clean, wait_pool_idle

CORPUS = json.loads((Path(__file__).resolve().parents[1] / "data" / "schemas"
                     / "corpus.json").read_text())
STREAMS = 16
MAX_TOKENS = 400


def ask(server, entry, sampling):
    body = {"messages": [{"role": "user", "content": entry["prompt"]}],
            "max_tokens": MAX_TOKENS,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "corpus", "schema": entry["schema"], "strict": True}}}
    body.update(sampling)
    r = requests.post(server.url("/v1/chat/completions"), json=body, timeout=600)
    return entry, sampling, r


def test_corpus_has_the_keywords_it_claims():
    text = json.dumps([e["schema"] for e in CORPUS])
    assert len(CORPUS) >= 200
    for kw in ["$ref", "$defs", "anyOf", "enum", "const", "pattern", "format", "minimum",
               "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
               "maxLength", "minItems", "maxItems", "prefixItems", "additionalProperties",
               "maxProperties", "required"]:
        assert f'"{kw}"' in text, kw
    # Optional fields: some object leaves a property out of `required`.
    assert any(set(s.get("properties", {})) - set(s.get("required", []))
               for s in (e["schema"] for e in CORPUS))


def test_every_output_of_the_corpus_validates(server):
    jobs = [(e, s) for e in CORPUS
            for s in ({"temperature": 0}, {"temperature": 0.8, "seed": 34})]
    failures = []
    stops = 0
    with cf.ThreadPoolExecutor(STREAMS) as ex:
        for entry, sampling, r in ex.map(lambda j: ask(server, *j), jobs):
            where = f'{entry["name"]} {sampling}'
            if r.status_code != 200:
                failures.append(f"{where}: HTTP {r.status_code} {r.text[:200]}")
                continue
            c = r.json()["choices"][0]
            text = c["message"]["content"]
            if c["finish_reason"] != "stop":
                failures.append(f"{where}: finished by {c['finish_reason']}: {text[:120]}")
                continue
            stops += 1
            try:
                V = jsonschema.Draft202012Validator
                V(entry["schema"], format_checker=V.FORMAT_CHECKER).validate(json.loads(text))
            except (ValueError, jsonschema.ValidationError) as e:
                failures.append(f"{where}: {text[:200]} -> {str(e)[:200]}")
    assert not failures, f"{len(failures)} of {len(jobs)}:\n" + "\n".join(failures[:40])
    assert stops == len(jobs)
    assert_pool_clean(wait_pool_idle(server))
