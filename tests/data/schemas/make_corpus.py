#!/usr/bin/env python3
"""Writes corpus.json beside this file: the structured-outputs schema corpus
(issue 34), 220 JSON schemas with a prompt each, made deterministically
from the families below. Every family covers keywords the grammar must
honour: nesting, $ref/$defs, anyOf, enums and const, patterns and formats,
numeric and length bounds, additionalProperties false, optional fields,
arrays with item and count bounds. Run it again after a change; the test
(tests/http/test_schema_corpus.py) reads the JSON, not this script.

    python3 tests/data/schemas/make_corpus.py
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).with_name("corpus.json")
rng = random.Random(34)

NOUNS = ["book", "city", "planet", "recipe", "song", "car", "river", "company", "bird",
         "mountain", "movie", "painting", "language", "sport", "tool", "island", "tree",
         "museum", "festival", "bridge"]
FIELDS = ["name", "title", "color", "origin", "category", "owner", "label", "kind", "author",
          "country", "brand", "genre", "material", "style", "region"]
ENUMS = [["red", "green", "blue"], ["small", "medium", "large"], ["low", "high"],
         ["north", "south", "east", "west"], ["draft", "published", "archived"],
         ["cat", "dog", "fish", "bird", "horse"], ["yes", "no", "maybe"]]
PATTERNS = [("^[A-Z]{3}-[0-9]{3}$", "a code like ABC-123"),
            ("^[0-9]{4}-[0-9]{2}-[0-9]{2}$", "a date"),
            ("^#[0-9a-f]{6}$", "a hex colour"),
            ("^[a-z]{1,10}(-[a-z]{1,10}){0,2}$", "a slug"),
            ("^\\+?[0-9]{7,12}$", "a phone number")]
FORMATS = ["date", "time", "date-time", "email", "uuid", "ipv4"]


def short_string(max_len=None):
    return {"type": "string", "maxLength": max_len or rng.choice([8, 16, 24, 32])}


def scalar():
    kind = rng.choice(["str", "int", "num", "bool", "enum"])
    if kind == "str":
        return short_string()
    if kind == "int":
        lo = rng.choice([0, 1, -100, 1900])
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([10, 100, 1000])}
    if kind == "num":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100, 10000])}
    if kind == "bool":
        return {"type": "boolean"}
    return {"type": "string", "enum": rng.choice(ENUMS)}


def obj(props, required=None, closed=True):
    s = {"type": "object", "properties": props,
         "required": list(props) if required is None else required}
    if closed:
        s["additionalProperties"] = False
    return s


def flat(i):
    names = rng.sample(FIELDS, rng.randint(1, 5))
    return obj({n: scalar() for n in names})


def optional_fields(i):
    names = rng.sample(FIELDS, rng.randint(2, 6))
    required = names[: rng.randint(0, len(names) - 1)]
    return obj({n: scalar() for n in names}, required=required)


def nested(i):
    depth = rng.randint(2, 4)
    s = obj({n: scalar() for n in rng.sample(FIELDS, 2)})
    for _ in range(depth - 1):
        s = obj({rng.choice(FIELDS) + "_info": s, "id": {"type": "integer", "minimum": 1,
                                                         "maximum": 9999}})
    return s


def arrays(i):
    item = rng.choice([short_string(12), {"type": "integer", "minimum": 0, "maximum": 99},
                       {"enum": rng.choice(ENUMS)}, obj({"name": short_string(12),
                                                        "count": {"type": "integer",
                                                                  "minimum": 0,
                                                                  "maximum": 50}})])
    lo = rng.randint(0, 2)
    return obj({"items": {"type": "array", "items": item, "minItems": lo,
                          "maxItems": lo + rng.randint(1, 3)},
                "total": {"type": "integer", "minimum": 0, "maximum": 100}})


def refs(i):
    defs = {"Point": obj({"x": {"type": "number", "minimum": -100, "maximum": 100},
                          "y": {"type": "number", "minimum": -100, "maximum": 100}}),
            "Tag": {"type": "string", "enum": rng.choice(ENUMS)},
            "Person": obj({"name": short_string(20),
                           "age": {"type": "integer", "minimum": 0, "maximum": 120}})}
    used = rng.sample(list(defs), rng.randint(1, 3))
    props = {}
    for d in used:
        if rng.random() < 0.5:
            props[d.lower()] = {"$ref": f"#/$defs/{d}"}
        else:
            props[d.lower() + "s"] = {"type": "array", "items": {"$ref": f"#/$defs/{d}"},
                                      "maxItems": 2}
    s = obj(props)
    s["$defs"] = {d: defs[d] for d in used}
    return s


def any_of(i):
    choice = rng.choice([
        {"anyOf": [short_string(16), {"type": "integer", "minimum": 0, "maximum": 1000}]},
        {"anyOf": [short_string(16), {"type": "null"}]},
        {"type": ["integer", "null"], "minimum": 0, "maximum": 10},
        {"anyOf": [obj({"kind": {"const": "circle"}, "radius": {"type": "number",
                                                               "minimum": 0,
                                                               "maximum": 10}}),
                   obj({"kind": {"const": "square"}, "side": {"type": "number",
                                                             "minimum": 0,
                                                             "maximum": 10}})]},
    ])
    return obj({"value": choice, "note": short_string(20)})


def enums_const(i):
    props = {"status": {"enum": rng.choice(ENUMS)},
             "version": {"const": rng.choice([1, 2, "v3"])},
             "flags": {"type": "array", "items": {"enum": rng.choice(ENUMS)}, "maxItems": 3,
                       "uniqueItems": False}}
    if rng.random() < 0.5:
        props["level"] = {"enum": [1, 2, 3, 5, 8]}
    return obj(props)


def patterns(i):
    pat, what = PATTERNS[i % len(PATTERNS)]
    props = {"code": {"type": "string", "pattern": pat}, "label": short_string(16)}
    if rng.random() < 0.6:
        props["when"] = {"type": "string", "format": rng.choice(FORMATS)}
    return obj(props), what


def bounds(i):
    return obj({
        "score": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
        "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": rng.choice([5, 50, 500])},
        "step": {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5},
        "name": {"type": "string", "minLength": rng.randint(1, 3), "maxLength": rng.randint(5, 20)},
    })


def top_level_kinds(i):
    return rng.choice([
        {"type": "array", "items": short_string(12), "minItems": 1, "maxItems": 4},
        {"type": "string", "enum": rng.choice(ENUMS)},
        {"type": "integer", "minimum": 1, "maximum": 10},
        {"type": "boolean"},
        {"type": "array", "prefixItems": [short_string(10), {"type": "integer", "minimum": 0,
                                                             "maximum": 9}],
         "items": False},
    ])


def open_objects(i):
    # additionalProperties left open (JSON Schema's default) or typed.
    s = obj({n: scalar() for n in rng.sample(FIELDS, 2)}, closed=False)
    if rng.random() < 0.5:
        s["additionalProperties"] = {"type": "integer", "minimum": 0, "maximum": 9}
        s["maxProperties"] = 4
    return s


FAMILIES = [flat, optional_fields, nested, arrays, refs, any_of, enums_const, patterns,
            bounds, top_level_kinds, open_objects]


def main():
    corpus = []
    per = 20
    for fam in FAMILIES:
        for i in range(per):
            noun = rng.choice(NOUNS)
            made = fam(i)
            if isinstance(made, tuple):
                schema, hint = made
                prompt = f"Describe a {noun} as JSON, with {hint}."
            else:
                schema = made
                prompt = f"Describe a {noun} as JSON."
            corpus.append({"name": f"{fam.__name__}-{i:02d}", "prompt": prompt,
                           "schema": schema})
    OUT.write_text(json.dumps(corpus, indent=1) + "\n")
    print(f"{len(corpus)} schemas -> {OUT}")


if __name__ == "__main__":
    main()
