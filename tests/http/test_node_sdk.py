"""The official OpenAI Node SDK with zod (tests/node, installed by
scripts/test with `npm ci`): structured outputs through
`zodResponseFormat` and `zodTextFormat` parse into the zod schema's
objects, streamed and not, and a bad schema is the SDK's BadRequestError."""

import json
import shutil
import subprocess
from pathlib import Path

NODE_DIR = Path(__file__).resolve().parents[1] / "node"


def test_node_sdk_parses_zod_schemas(server):
    node = shutil.which("node")
    assert node, "node missing: scripts/test installs it"
    assert (NODE_DIR / "node_modules" / "openai").exists(), \
        "tests/node is not installed: npm ci --prefix tests/node"
    r = subprocess.run([node, str(NODE_DIR / "structured.mjs"), server.url("/v1")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    chat = out["chat"]
    assert chat["finish"] == "stop"
    city = chat["parsed"]
    assert json.loads(chat["content"]) == city
    assert set(city) == {"name", "country", "population_millions", "rivers", "capital"}
    assert isinstance(city["capital"], bool) and len(city["rivers"]) <= 3
    # Streamed: the deltas are the whole object, parsed the same (K12).
    assert out["stream"]["parsed"] == city
    assert out["stream"]["deltas"] == chat["content"]
    assert out["responses"]["status"] == "completed"
    assert out["responses"]["parsed"] == city
    assert out["bad"] == {"status": 400, "param": "response_format",
                          "name": "BadRequestError"}


def test_node_sdk_run_tools_calls_zod_functions(server):
    """`runTools` with `zodFunction`: the runner assembles the call
    (streamed too), zod parses its arguments, the function's result goes
    back as a `tool` message answering the call's id; under `auto` the
    model is asked again with the result, up to the runner's bound."""
    node = shutil.which("node")
    assert node, "node missing: scripts/test installs it"
    r = subprocess.run([node, str(NODE_DIR / "tools.mjs"), server.url("/v1")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for mode in ("whole", "stream"):
        run = out[mode]
        assert len(run["calls"]) == 1, run
        call = run["calls"][0]
        assert call["unit"] in ("celsius", "fahrenheit") and 0 < len(call["city"]) <= 40
        assert run["roles"] == ["user", "assistant", "tool"], run
        assert run["tool_call_ids"] == run["tool_result_ids"], run
        assert run["tool_call_ids"][0].startswith("call_")
        assert json.loads(run["tool_result"])["sky"] == "clear"
    # K12: streamed and not, the same call.
    assert out["whole"]["calls"] == out["stream"]["calls"]
    auto = out["auto"]
    assert auto["calls"], auto
    assert auto["roles"][:3] == ["user", "assistant", "tool"], auto
    assert 2 <= auto["completions"] <= 3, auto
