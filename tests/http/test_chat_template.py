"""`--chat-template FILE` (vLLM's and llama.cpp's flag) in place of the
model's template, and `chat_template_kwargs` reaching it: the prompt a
chat request sends is what /tokenize shows, with Qwen 3's thinking switch
off and on; a template that does not compile stops the server with a
one-line error."""

import subprocess
from pathlib import Path

import pytest
import requests

from conftest import BIN, Server

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "templates" / "thinking.jinja"
MSGS = [{"role": "user", "content": "Is it raining?"}]


@pytest.fixture(scope="module")
def templated(tmp_root):
    s = Server(["--chat-template", str(TEMPLATE), "--log-prompts"], tmp_root, "chat-template")
    yield s
    assert s.terminate() == 0, s.stderr()


def tokens(server, kwargs=None):
    body = {"messages": MSGS}
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    r = requests.post(server.url("/tokenize"), json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_the_template_file_and_its_kwargs_make_the_prompt(templated):
    plain = tokens(templated)
    off = tokens(templated, {"enable_thinking": False})
    # Unknown keys pass through; thinking on is the template's default.
    assert tokens(templated, {"enable_thinking": True, "anything": {"else": [1]}}) == plain
    assert len(off) > len(plain)
    # A chat request renders the same prompt: its usage counts it, and the
    # request log (--log-prompts) shows the text the template made.
    for kwargs, want in [({"enable_thinking": False}, off), (None, plain)]:
        body = {"messages": MSGS, "max_tokens": 1}
        if kwargs is not None:
            body["chat_template_kwargs"] = kwargs
        r = requests.post(templated.url("/v1/chat/completions"), timeout=60, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(want)
    logged = [rec["prompt"] for rec in templated.log_records() if rec.get("prompt")]
    assert logged[-2] == ("<|im_start|>user\nIs it raining?<|im_end|>\n"
                          "<|im_start|>assistant\n<think>\n\n</think>\n\n"), logged[-2]
    assert logged[-1] == ("<|im_start|>user\nIs it raining?<|im_end|>\n"
                          "<|im_start|>assistant\n"), logged[-1]


def test_a_template_that_does_not_compile_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    p = subprocess.run([str(BIN), "serve", "--port", "0", "--chat-template", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    errors = [l for l in p.stderr.splitlines() if l.startswith("isoserve: ")]
    assert len(errors) == 1 and "bad.jinja" in errors[0], p.stderr
    assert "panicked" not in p.stderr
    missing = subprocess.run([str(BIN), "serve", "--port", "0", "--chat-template",
                              str(tmp_path / "none.jinja")], capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode != 0 and "none.jinja" in missing.stderr, missing.stderr
