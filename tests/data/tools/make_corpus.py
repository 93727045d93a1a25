#!/usr/bin/env python3
"""Writes corpus.json beside this file: the tool-calling corpus (issue 35),
120 cases made deterministically from the families below. Each case is a
user prompt, a list of tools (OpenAI's shape) and a tool_choice:
`required`, or one tool by name. The families cover what agents send:
one tool and several, nested objects, optional arguments, enums and
consts, integer and number bounds, booleans, arrays with item bounds,
$defs/$ref, anyOf, and parallel calls. Run it again after a change; the
test (tests/http/test_tool_corpus.py) reads the JSON, not this script.

    python3 tests/data/tools/make_corpus.py
"""

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "corpus.json"
rng = random.Random(35)

CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Perth", "Dakar", "Riga", "Hanoi"]
THINGS = ["a table", "a taxi", "a flight", "a hotel room", "a concert ticket", "a doctor visit"]


def s(max_len=30, **kw):
    return dict({"type": "string", "maxLength": max_len}, **kw)


def tool(name, desc, props, required=None):
    return {"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": props,
                       "required": list(props) if required is None else required}}}


def weather():
    return tool("get_weather", "Current weather in a city",
                {"city": s(), "unit": {"enum": ["celsius", "fahrenheit"]}})


def book():
    return tool("book", "Book something for some people",
                {"what": s(), "people": {"type": "integer", "minimum": 1, "maximum": 12},
                 "date": s(10, pattern="^[0-9]{4}-[0-9]{2}-[0-9]{2}$")},
                required=["what", "people"])


def address():
    return tool("ship", "Ship a parcel to an address",
                {"to": {"type": "object", "properties": {
                    "name": s(), "street": s(), "city": s(),
                    "zip": s(10, pattern="^[0-9]{5}$")},
                    "required": ["name", "city", "zip"]},
                 "express": {"type": "boolean"},
                 "weight_kg": {"type": "number", "minimum": 0.1, "maximum": 50}},
                required=["to", "weight_kg"])


def search():
    return tool("search", "Search the web",
                {"query": s(60), "max_results": {"type": "integer", "minimum": 1, "maximum": 10},
                 "sites": {"type": "array", "items": s(30), "maxItems": 3}},
                required=["query"])


def calendar():
    return tool("add_event", "Add a calendar event",
                {"title": s(), "start": s(5, pattern="^[0-2][0-9]:[0-5][0-9]$"),
                 "minutes": {"type": "integer", "enum": [15, 30, 45, 60, 90]},
                 "attendees": {"type": "array", "items": {"type": "object", "properties": {
                     "name": s(20), "optional": {"type": "boolean"}}, "required": ["name"]},
                     "minItems": 1, "maxItems": 3}},
                required=["title", "start", "minutes"])


def convert():
    return tool("convert", "Convert an amount between currencies",
                {"amount": {"type": "number", "minimum": 0, "maximum": 1000000},
                 "from": {"enum": ["EUR", "USD", "JPY", "GBP"]},
                 "to": {"enum": ["EUR", "USD", "JPY", "GBP"]}})


def refs():
    return {"type": "function", "function": {
        "name": "order", "description": "Order items from a shop",
        "parameters": {
            "type": "object",
            "$defs": {"item": {"type": "object", "properties": {
                "sku": s(8, pattern="^[A-Z]{3}[0-9]{3}$"),
                "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"]}},
            "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                     "minItems": 1, "maxItems": 3},
                           "note": s(40)},
            "required": ["items"]}}}


def anyof():
    return tool("notify", "Notify someone by email or by phone",
                {"target": {"anyOf": [
                    {"type": "object", "properties": {"email": s(40)}, "required": ["email"]},
                    {"type": "object", "properties": {"phone": s(15, pattern="^[0-9+]{6,15}$")},
                     "required": ["phone"]}]},
                 "message": s(60), "urgent": {"const": True}},
                required=["target", "message"])


def noargs():
    return tool("now", "The current time", {}, required=[])


FAMILIES = [
    (weather, lambda: f"What is the weather in {rng.choice(CITIES)}?"),
    (book, lambda: f"Book {rng.choice(THINGS)} for {rng.randint(1, 6)} people."),
    (address, lambda: f"Send my parcel to Ana in {rng.choice(CITIES)}."),
    (search, lambda: f"Find news about {rng.choice(CITIES)}."),
    (calendar, lambda: f"Add a meeting at {rng.randint(8, 17)}:00 with Bo."),
    (convert, lambda: f"Convert {rng.randint(1, 900)} euros to dollars."),
    (refs, lambda: "Order two ABC123 and one XYZ999."),
    (anyof, lambda: "Tell Kim the build is broken."),
    (noargs, lambda: "What time is it?"),
]


def main():
    cases = []
    for i in range(120):
        k = rng.randint(1, 4)
        fams = rng.sample(FAMILIES, k)
        tools = [f() for f, _ in fams]
        prompt = fams[0][1]()
        named = i % 3 == 2
        parallel = i % 5 == 4
        choice = ({"type": "function", "function": {"name": tools[-1]["function"]["name"]}}
                  if named else "required")
        cases.append({"name": f"case-{i:03d}", "prompt": prompt, "tools": tools,
                      "tool_choice": choice, "parallel_tool_calls": parallel,
                      "sampling": {"temperature": 0} if i % 2 == 0
                      else {"temperature": 0.8, "seed": i}})
    OUT.write_text(json.dumps(cases, indent=1) + "\n")
    print(f"{len(cases)} cases -> {OUT}")


if __name__ == "__main__":
    main()
