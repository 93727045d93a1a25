"""The operator console in a real browser: Debian's Chromium (headless),
driven by playwright's Python package against the system browser (no
browser download; scripts/test installs both).

* Unified: a long request's pages turn to its tenant's colour within a
  second of its first token, and are freed (poisoned) within seconds of its
  cancellation; no safety counter moves.
* Fault build (`ISOSERVE_FAULT_STALE_READ=1`, the test-only
  `isoserve-fault-incident` binary): a finished request's freed page is
  read again; the pool refuses it and the `stale_handle` tile lights up.
* `serve --disaggregated`: both nodes' pools are drawn, a request's KV shows
  on the decode node in its tenant's colour, and a transfer in flight is
  reported with its tenant.
* Every case: no console error, no page error, no request leaves the
  server's origin; a screenshot of each is kept in target/test-artifacts/.

Servers listen on 127.0.0.1 with ephemeral ports; every wait is bounded.
"""

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests
from playwright.sync_api import sync_playwright

from conftest import (BIN, FAULT_BIN, OPERATOR_KEY, REPO, Server, Stream, write_tenants)

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / "target" / "test-artifacts"
ALICE_KEY = "sk-console-alice"
BOB_KEY = "sk-console-bob"
NODE_ARGS = ["--kv-memory", "256MiB", "--max-context", "2048"]
# The pages must show within this long of the request's first token (the
# page polls at 2 Hz; a snapshot waits at most 300 ms for a fresh map).
SHOW_WITHIN_S = 1.0


def tenants_file(tmp: Path) -> Path:
    return write_tenants(tmp / "console-tenants.toml", [
        {"name": "alice", "key": ALICE_KEY},
        {"name": "bob", "key": BOB_KEY, "weight": 2},
    ])


def snapshot(server) -> dict:
    r = requests.get(server.url("/console/snapshot"), timeout=10,
                     headers={"Authorization": f"Bearer {OPERATOR_KEY}"})
    assert r.status_code == 200, r.text
    return r.json()


@contextmanager
def console(server):
    """The console page open in headless Chromium with the operator's key
    as Basic credentials (what a browser's own prompt sends). Yields the
    page and the list of problems seen (console errors and warnings, page
    errors, failed requests, requests to another origin)."""
    assert CHROMIUM.exists(), "Debian's chromium is missing: scripts/test installs it"
    problems = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM),
                                    args=["--no-sandbox", "--disable-gpu"])
        ctx = browser.new_context(
            http_credentials={"username": "operator", "password": OPERATOR_KEY},
            viewport={"width": 1300, "height": 1000})
        page = ctx.new_page()
        page.on("console", lambda m: m.type in ("error", "warning")
                and problems.append(f"console {m.type}: {m.text}"))
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
        page.on("request", lambda r: r.url.startswith(server.base + "/")
                or problems.append(f"request off the origin: {r.url}"))
        page.goto(server.url("/console"))
        page.wait_for_function("() => document.body.dataset.updated !== undefined", timeout=10_000)
        try:
            yield page, problems
        finally:
            browser.close()


def shoot(page, name: str):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)


def cells(page, node_role: str, label: str, state: str) -> int:
    return page.locator(
        f'.node[data-role="{node_role}"] .cell[data-label="{label}"][data-state="{state}"]').count()


def tile(page, counter: str, node: str):
    return page.locator(f'.tile[data-counter="{counter}"][data-node="{node}"]')


def swatch_colour(page, tenant: str) -> str:
    # The tenants table is redrawn on every poll: find the swatch and read its
    # style in one script turn, so the row cannot be replaced in between (a
    # detached element's computed colour is '', which failed a CI run).
    colour = page.evaluate(
        """t => { const e = document.querySelector(`tr[data-tenant="${t}"] .swatch`);
                  return e ? getComputedStyle(e).backgroundColor : null; }""", tenant)
    assert colour, f"no swatch colour for {tenant}: {colour!r}"
    return colour


def wait_first_token(stream: Stream):
    events = stream.json_events()
    first = next(events)
    assert first["choices"][0]["text"] is not None
    return events


def test_console_shows_a_requests_pages_in_its_tenants_colour_and_frees_them(tmp_root):
    s = Server(["--tenants", str(tenants_file(tmp_root))], tmp_root, "console")
    try:
        with console(s) as (page, problems):
            assert page.title() == "isoserve console"
            assert tile(page, "stale_handle", "engine").count() == 1
            assert page.locator(".tile.moved").count() == 0
            assert page.locator(".node .cell").count() == snapshot(s)["nodes"][0]["pages_total"]
            alice = swatch_colour(page, "alice")
            assert alice != swatch_colour(page, "bob")
            # Bob's finished request leaves its full pages cached in his
            # scope (K11) and the rest freed (poisoned).
            r = requests.post(s.url("/v1/completions"), timeout=60,
                              headers={"Authorization": f"Bearer {BOB_KEY}"},
                              json={"prompt": "The lighthouse stood on the rocks. " * 8,
                                    "max_tokens": 40, "ignore_eos": True})
            assert r.status_code == 200, r.text
            page.wait_for_function(
                '() => document.querySelectorAll(\'.cell[data-label="bob"][data-state="cached"]\')'
                '.length > 0 && document.querySelectorAll(\'.cell[data-state="poisoned"]\').length > 0',
                timeout=5_000)
            bob_cached = page.locator('.cell[data-label="bob"][data-state="cached"]').count()
            # Every full page of what was computed: the prompt and the
            # answer but its last token (never fed back).
            u = r.json()["usage"]
            assert bob_cached == (u["prompt_tokens"] + u["completion_tokens"] - 1) // 16, bob_cached

            body = {"prompt": "Write a very long story about a lighthouse keeper.",
                    "max_tokens": 1500, "ignore_eos": True, "stream": True}
            stream = Stream(s, "/v1/completions", body,
                            headers={"Authorization": f"Bearer {ALICE_KEY}"})
            assert stream.status == 200
            wait_first_token(stream)
            t0 = time.monotonic()
            page.wait_for_function(
                '() => document.querySelectorAll(\'.cell[data-label="alice"][data-state="private"]\')'
                '.length > 0', timeout=5_000, polling=20)
            shown_s = time.monotonic() - t0
            assert shown_s <= SHOW_WITHIN_S, f"pages showed {shown_s:.2f} s after the first token"
            mine = page.locator('.cell[data-label="alice"][data-state="private"]')
            # 1500 + prompt tokens reserved at admission: 16 tokens a page.
            assert mine.count() >= 1500 // 16, mine.count()
            colours = set(mine.evaluate_all("cs => cs.map(c => getComputedStyle(c).backgroundColor)"))
            assert colours == {alice}, colours
            # The tenant's held pages, counted over the pool, are its cells.
            assert page.locator('tr[data-tenant="alice"] .pages').text_content() == str(mine.count())
            title = mine.first.get_attribute("title")
            assert "alice" in title and "request" in title and "epoch" in title, title
            page.wait_for_function(
                '() => Number(document.querySelector(\'tr[data-tenant="alice"] .in-flight\').textContent) === 1',
                timeout=3_000)
            shoot(page, "console-unified.png")

            stream.close()
            t0 = time.monotonic()
            page.wait_for_function(
                '() => document.querySelectorAll(\'.cell[data-label="alice"]\').length === 0',
                timeout=5_000, polling=50)
            freed_s = time.monotonic() - t0
            assert cells(page, "unified", "", "poisoned") >= 1500 // 16
            # Bob's cached pages stay cached.
            assert page.locator('.cell[data-label="bob"][data-state="cached"]').count() == bob_cached
            # Cancelling trips no check.
            assert page.locator(".tile.moved").count() == 0
            assert tile(page, "stale_handle", "engine").get_attribute("data-value") == "0"
            assert problems == [], problems
            print(f"pages shown {shown_s:.2f} s after the first token, freed {freed_s:.2f} s "
                  "after the cancel")
        snap = snapshot(s)
        assert snap["nodes"][0]["counts"]["private"] == 0
        assert all(c["value"] == 0 for c in snap["safety"]), snap["safety"]
    finally:
        s.terminate()


def test_console_highlights_a_safety_check_that_fired(tmp_root):
    assert FAULT_BIN.exists(), f"{FAULT_BIN} missing: scripts/test builds it"
    s = Server(["--tenants", str(tenants_file(tmp_root))], tmp_root, "console-fault",
               binary=FAULT_BIN, env_extra={"ISOSERVE_FAULT_STALE_READ": "1"})
    try:
        with console(s) as (page, problems):
            stale = tile(page, "stale_handle", "engine")
            assert stale.get_attribute("data-value") == "0"
            assert "moved" not in stale.get_attribute("class")
            r = requests.post(s.url("/v1/completions"), timeout=60,
                              headers={"Authorization": f"Bearer {BOB_KEY}"},
                              json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200, r.text
            page.wait_for_function(
                '() => document.querySelector(\'.tile[data-counter="stale_handle"]\')'
                '.classList.contains("moved")', timeout=5_000)
            assert stale.get_attribute("data-value") == "1"
            # Only the check that fired is lit.
            assert page.locator(".tile.moved").count() == 1
            shoot(page, "console-fault.png")
            assert problems == [], problems
        snap = snapshot(s)
        fired = {c["name"]: c for c in snap["safety"] if c["value"]}
        assert list(fired) == ["stale_handle"], snap["safety"]
        assert fired["stale_handle"]["moved"]
        assert fired["stale_handle"]["history"][-1] == 1
    finally:
        s.terminate()


def test_console_disaggregated_shows_both_nodes_and_transfers(tmp_root):
    s = Server(["--disaggregated", "--tenants", str(tenants_file(tmp_root))] + NODE_ARGS,
               tmp_root, "console-disagg")
    try:
        snap = snapshot(s)
        assert snap["mode"] == "disaggregated"
        roles = {n["name"]: n["role"] for n in snap["nodes"]}
        assert roles == {"prefill-0": "prefill", "decode-0": "decode"}, roles
        names = {(c["node"], c["name"]) for c in snap["safety"]}
        for counter in ("transfer_checksum", "transfer_canary", "transfer_fenced_pages",
                        "transfer_late_pages", "transfer_incomplete"):
            assert ("decode-0", counter) in names, names
        assert ("prefill-0", "stale_handle") in names

        # A transfer in flight: the decode node reserves the pages while
        # prefill computes a long prompt. Watch the JSON at 20 Hz.
        seen = []
        stop = threading.Event()

        def watch():
            deadline = time.monotonic() + 60
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    for n in snapshot(s)["nodes"]:
                        seen.extend(n["transfers"])
                except (requests.RequestException, AssertionError):
                    return
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        long_prompt = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog."
                               for i in range(90))
        with console(s) as (page, problems):
            assert page.locator('.node[data-role="prefill"]').count() == 1
            assert page.locator('.node[data-role="decode"]').count() == 1
            body = {"prompt": long_prompt, "max_tokens": 300, "ignore_eos": True,
                    "stream": True}
            try:
                stream = Stream(s, "/v1/completions", body,
                                headers={"Authorization": f"Bearer {ALICE_KEY}"})
                assert stream.status == 200, stream.resp.read()
                wait_first_token(stream)
            finally:
                stop.set()
                watcher.join(timeout=30)
            page.wait_for_function(
                '() => document.querySelectorAll(\'.node[data-role="decode"] '
                '.cell[data-label="alice"][data-state="private"]\').length > 0',
                timeout=5_000, polling=20)
            shoot(page, "console-disaggregated.png")
            stream.close()
            page.wait_for_function(
                '() => document.querySelectorAll(\'.node[data-role="decode"] '
                '.cell[data-label="alice"]\').length === 0', timeout=10_000)
            assert page.locator(".tile.moved").count() == 0
            assert problems == [], problems
        assert seen, "no transfer seen in flight"
        t = seen[0]
        assert t["tenant"] == "alice", t
        assert t["to"] == "decode-0" or t["from"] == "prefill-0", t
        assert 0 < t["pages_total"] and t["pages_done"] <= t["pages_total"], t
        text = json.dumps(snapshot(s))
        assert "quick brown fox" not in text and ALICE_KEY not in text
    finally:
        s.terminate()


def test_console_of_a_standalone_gateway_gathers_the_nodes_named_to_it(tmp_root):
    from test_disaggregated import Gateway, Node
    # Pools of more than one map slice (8192 pages of 2 tokens): an idle
    # node takes its map a slice at a time and still serves it whole.
    # (Both nodes: a pair must agree on the page size.)
    big_pool = ["--kv-memory", "512MiB", "--page-size", "2", "--max-context", "2048"]
    p = Node("prefill", tmp_root, "pf-a", args=big_pool)
    d = Node("decode", tmp_root, "dc-a", args=big_pool)
    gw = None
    try:
        metrics = lambda n: n.metrics_url.removeprefix("http://").removesuffix("/metrics")
        gw = Gateway(p.addr, d.addr, tmp_root, "gw-console",
                     extra=["--tenants", str(tenants_file(tmp_root)),
                            "--node-metrics", f"pf-a={metrics(p)}",
                            "--node-metrics", f"dc-a={metrics(d)}",
                            "--node-metrics", "gone=127.0.0.1:1"])
        snap = snapshot(gw)
        roles = {n["name"]: n["role"] for n in snap["nodes"]}
        big = [n for n in snap["nodes"] if n["name"] == "dc-a"][0]
        assert big["pages_total"] > 8192, big["pages_total"]
        assert sum(big["counts"].values()) == big["pages_total"], big["counts"]
        # A node that does not answer is listed, not hidden.
        assert roles == {"pf-a": "prefill", "dc-a": "decode", "gone": "unreachable"}, roles
        r = requests.post(gw.url("/v1/completions"), timeout=60,
                          headers={"Authorization": f"Bearer {BOB_KEY}"},
                          json={"prompt": "Hello there, how are you today? " * 4,
                                "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200, r.text
        snap = snapshot(gw)
        bob = [t for t in snap["tenants"] if t["name"] == "bob"][0]
        assert bob["finished"] == 1 and bob["tokens_generated"] == 8, bob
        # The request's pages are freed (poisoned) on decode (a map taken
        # while it ran may still be served young: ask again, bounded).
        deadline = time.monotonic() + 10
        while True:
            decode = [n for n in snapshot(gw)["nodes"] if n["name"] == "dc-a"][0]
            c = decode["counts"]
            if (c["private"] == 0 and c["poisoned"] > 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert c["private"] == 0 and c["poisoned"] > 0, c
    finally:
        for x in (gw, p, d):
            if x is not None:
                x.terminate()
