"""`isoserve probe` against our own server, from the outside: it must pass
a correct server, unified and disaggregated, with content-level checks
(every check ran and passed, outputs agreed with the idle ones), catch the
test-only `fault-incident` build (the incident's placeholder path: exit 1,
the findings named), and exit 2 with a one-line message when it cannot
run.

The KV pool is kept small (`--kv-pages`) so that the probe's concurrent
long prompts exceed it: the markers check runs while requests queue for
pages and pages are reused across tenants.

`isoserve audit` reads the request log each of these servers wrote: clean
on the correct builds (every rule checked), the incident's signature on
the fault build — from our JSONL and from the same log as another server's
CSV through --map.
"""

import csv
import json
import re
import socket
import subprocess

from conftest import BIN, FAULT_BIN, Server, unheld, wait_pool_idle, write_tenants
from test_disaggregated import Gateway, Node, healthy, wait_until

KEYS = ["sk-probe-tenant-a", "sk-probe-tenant-b"]
# 2048-token window; 160 pages × 16 tokens = 2560 tokens for 8 requests of
# ~530 tokens in flight: they cannot all hold pages at once.
SERVE_ARGS = ["--max-context", "2048", "--kv-pages", "160"]
PROBE_ARGS = ["--deterministic", "--prompts", "3", "--rounds", "2", "--concurrency", "8",
              "--long-prompt-tokens", "512", "--time-budget-s", "400"]


def tenants(tmp_root, name):
    return write_tenants(tmp_root / f"{name}-tenants.toml",
                         [{"name": f"t{i}", "key": k, "max_concurrent": 16}
                          for i, k in enumerate(KEYS)])


def run_probe(url, tmp_root, name):
    report = tmp_root / f"{name}-probe.json"
    cmd = [str(BIN), "probe", "--url", url, "--json", str(report)]
    for k in KEYS:
        cmd += ["--tenant-key", k]
    p = subprocess.run(cmd + PROBE_ARGS, capture_output=True, text=True, timeout=600)
    return p, (json.loads(report.read_text()) if report.exists() else None)


def run_audit(log, tmp_root, name, *extra):
    out = tmp_root / f"{name}-audit.json"
    p = subprocess.run([str(BIN), "audit", "--log", str(log), "--json", str(out), *extra],
                       capture_output=True, text=True, timeout=120)
    return p, (json.loads(out.read_text()) if out.exists() else None)


def as_foreign_csv(records, path):
    """The log as another server might write it: other column names, TTFT
    in seconds, the outcome as an HTTP status."""
    status = {"finished": 200, "cancelled": 499, "rejected": 400, "error": 502}
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["request_id", "user", "finished_at", "http_status", "n_prompt",
                    "ttft_s", "kv_tokens", "max_len", "prefill_tps", "blocks", "err",
                    "cached_prompt"])
        for r in records:
            w.writerow([r["id"], r["tenant"] or "", r["ts"], status[r["outcome"]],
                        r["prompt_tokens"],
                        "" if r["ttft_ms"] is None else r["ttft_ms"] / 1000,
                        r["kv_capacity_tokens"] or "", r["context_window_tokens"],
                        r["prefill_tokens_per_s"] or "",
                        "" if r["pages"] is None else r["pages"], r["error_code"] or "",
                        r.get("cached_tokens", 0)])


FOREIGN_MAP = ["id=request_id", "tenant=user", "ts=finished_at", "outcome=http_status",
               "prompt_tokens=n_prompt", "ttft_ms=ttft_s*1000", "kv_capacity_tokens=kv_tokens",
               "context_window_tokens=max_len", "prefill_tokens_per_s=prefill_tps",
               "pages=blocks", "error_code=err", "output_tokens=", "kv_event=",
               "cached_tokens=cached_prompt"]


def foreign_audit(records, tmp_root, name):
    path = tmp_root / f"{name}-foreign.csv"
    as_foreign_csv(records, path)
    args = [a for m in FOREIGN_MAP for a in ("--map", m)]
    return run_audit(path, tmp_root, f"{name}-foreign", *args)


def assert_clean(p, report, drafts="passed"):
    """`drafts`: the drafts check's status — `passed` against a server that
    drafts from earlier requests (`--speculative suffix`), `skipped`
    against one that does not."""
    assert p.returncode == 0, p.stdout + p.stderr
    assert "no findings" in p.stdout, p.stdout
    assert report["findings"] == []
    checks = {c["check"]: c["status"] for c in report["checks"]}
    assert checks == {"markers": "passed", "determinism": "passed",
                      "over-length": "passed", "prefix-cache": "passed",
                      "grammar-cache": "passed", "drafts": drafts, "timing": "passed",
                      "tokens": "passed"}, report["checks"]
    # Content, not status: every loaded output equalled its idle output,
    # the window was read from /v1/models, the rate was measured.
    assert report["determinism_agreement"] == 1.0
    assert report["context_window"] == 2048
    assert report["prefill_tokens_per_s"] > 50
    assert report["tenants"] == 2
    # 2 keys + 2 calibration + 3 rate + 6 idle + 12 loaded + 20 flood (a
    # sizing prompt, a wave of 8 short ones, 8 near the window, and one
    # alone before each over-recall) + 7 window edges (3 over-recalls,
    # under, at's sizing and at, over) + 9 prefix-cache trials (3 × the
    # first tenant's prompt, the second's copy and its cold twin) + 9
    # grammar-cache trials (the same, with JSON schemas) + 12 drafts trials
    # (4 × a story for the first tenant, the second, the first again).
    # The near-window flood prompts are as many as the measured prefill
    # rate lets finish in time (8 on an idle machine; at least the 2 that
    # cover the window plus a quarter): 14–20 flood requests in all.
    markers = next(c for c in report["checks"] if c["check"] == "markers")
    m = re.search(r"6 secret-bearing prompts and (\d+) flooding", markers["summary"])
    assert m, markers
    flood = int(m.group(1))
    assert 14 <= flood <= 20, markers
    assert report["requests_sent"] == 62 + flood, report
    # 6 idle + 12 loaded + the flood + 6 window edges (3 over-recalls,
    # under, at, over) read; every answer but the four refused over-long
    # ones came with its tokens (logprobs) and was matched on both.
    assert f"{24 + flood} outputs" in markers["summary"], markers
    assert f"{20 + flood} matched on text and tokens" in markers["summary"], markers
    over = next(c for c in report["checks"] if c["check"] == "over-length")
    assert "under" in over["summary"] and ": 400" in over["summary"], over


def test_probe_passes_a_unified_server(tmp_root):
    # With the prefix cache on (the default): the probe finds nothing, and
    # the audit times only what was prefilled (`cached_tokens` in the log),
    # so the "at" prompt's repeat served from the cache is not too fast.
    # Speculation's suffix cache on: the drafts check compares a tenant's
    # repeat with another tenant's copy, and finds each drafted only from
    # its own scope.
    s = Server(SERVE_ARGS + ["--speculative", "suffix",
                             "--tenants", str(tenants(tmp_root, "unified"))],
               tmp_root, "probe-unified")
    try:
        p, report = run_probe(s.url(""), tmp_root, "unified")
        assert_clean(p, report)
        # The pool was pushed: pages were handed out many times over (to
        # both tenants), no safety check fired, and everything came back.
        m = wait_pool_idle(s)
        assert m["isoserve_kv_pages_total"] == 160
        assert unheld(m) == 160, m
        assert m["isoserve_kv_allocs_total"] > 2 * 160, m
        assert m["isoserve_kv_safety_refusals_total"] == 0, m
        # The log records what the audit needs: the pool and window at the
        # time, the measured prefill rate, pages held by refused requests.
        recs = s.log_records()
        assert any(r["cached_tokens"] > 0 for r in recs), "the cache served nothing"
        done = [r for r in recs if r["outcome"] == "finished"]
        assert done and all(r["kv_capacity_tokens"] == 160 * 16 and
                            r["context_window_tokens"] == 2048 and r["pages"] > 0
                            for r in done), done[:3]
        assert any(r["prefill_tokens_per_s"] and r["prefill_tokens_per_s"] > 50 for r in done)
        over = [r for r in recs if r["error_code"] == "context_length_exceeded"]
        # "over" and the three "over-recall"s, refused before any page was
        # allocated.
        assert len(over) == 4 and all(r["pages"] == 0 and r["outcome"] == "rejected" and
                                      r["prompt_tokens"] > 2048 for r in over), over
        a, audit = run_audit(s.request_log, tmp_root, "unified")
        assert a.returncode == 0, a.stdout + a.stderr
        assert audit["records"] == len(recs) and audit["unreadable_total"] == 0, audit
        assert audit["matches_total"] == 0 and audit["unchecked"] == [], audit
        assert audit["checked"]["over_capacity"] == len(recs), audit
        assert audit["checked"]["too_fast"] > len(done) // 2, audit
        # The same log as another server's CSV: the same verdict.
        f, faudit = foreign_audit(recs, tmp_root, "unified")
        assert f.returncode == 0, f.stdout + f.stderr
        assert faudit["records"] == len(recs) and faudit["checked"] == audit["checked"], faudit
    finally:
        assert s.terminate() == 0, s.stderr()


def test_probe_passes_a_disaggregated_server(tmp_root):
    s = Server(["--disaggregated"] + SERVE_ARGS +
               ["--tenants", str(tenants(tmp_root, "disagg"))],
               tmp_root, "probe-disagg")
    try:
        p, report = run_probe(s.url(""), tmp_root, "disagg")
        # No suffix cache here: nothing drafted across requests to compare.
        assert_clean(p, report, drafts="skipped")
        # The gateway has no pool or prefill rate of its own: the window
        # from the log, the rate the probe measured.
        recs = s.log_records()
        assert all(r["kv_capacity_tokens"] is None and r["context_window_tokens"] == 2048
                   for r in recs), recs[:3]
        a, audit = run_audit(s.request_log, tmp_root, "disagg",
                             "--prefill-tokens-per-s", str(report["prefill_tokens_per_s"]))
        assert a.returncode == 0, a.stdout + a.stderr
        assert audit["matches_total"] == 0 and audit["unchecked"] == [], audit
        timed = [r for r in recs if r["ttft_ms"] is not None]
        assert audit["records"] == len(recs) and audit["checked"]["too_fast"] == len(timed), audit
    finally:
        assert s.terminate() == 0, s.stderr()


def test_probe_catches_the_fault_incident_build(tmp_root):
    assert FAULT_BIN.exists(), f"{FAULT_BIN} missing: ./scripts/test builds it"
    # The fault build's second test-only fault: one prefix-cache scope for
    # every tenant (the side channel of the peers' global caches).
    s = Server(SERVE_ARGS + ["--tenants", str(tenants(tmp_root, "fault"))],
               tmp_root, "probe-fault", binary=FAULT_BIN,
               env_extra={"ISOSERVE_FAULT_SHARED_CACHE": "1"})
    try:
        assert "FAULT-INCIDENT BUILD" in s.stderr()
        assert "one prefix-cache scope for every tenant" in s.stderr()
        p, report = run_probe(s.url(""), tmp_root, "fault")
        assert p.returncode == 1, p.stdout + p.stderr
        kinds = {f["kind"] for f in report["findings"]}
        # The over-long request was answered 200, faster than its prompt
        # could have been prefilled, and with the first tenant's secret:
        # the placeholder read the KV the flood left in the pool.
        # (The findings' details name the over-recalls' answers: what the
        # placeholder recited, should it not be the secret.)
        assert {"marker_cross_tenant", "over_length_accepted",
                "answered_faster_than_prefill", "prefix_cache_shared_across_tenants",
                "cached_tokens_across_tenants"} <= kinds, \
            [(f["kind"], f["detail"]) for f in report["findings"]]
        checks = {c["check"]: c["status"] for c in report["checks"]}
        assert checks["over-length"] == "findings" and checks["timing"] == "findings", checks
        assert checks["markers"] == "findings", checks
        assert checks["prefix-cache"] == "findings", checks
        # Grammars are still cached per scope in this build: no finding.
        assert checks["grammar-cache"] == "passed", checks
        leak = next(f for f in report["findings"] if f["kind"] == "marker_cross_tenant")
        # The over-recall (tenant 2, secret-free) recited the flood's secret
        # (tenant 1's fourth).
        assert leak["detail"].startswith("tenant 2's answer to a secret-free prompt"), leak
        assert "from tenant 1's prompt 4" in leak["detail"], leak
        assert "FINDINGS" in p.stdout and "over_length_accepted" in p.stdout, p.stdout
        # The log shows the signature: the over-long prompt answered, its
        # first token faster than prefill allows, under the probe's tenant.
        recs = s.log_records()
        a, audit = run_audit(s.request_log, tmp_root, "fault")
        assert a.returncode == 1, a.stdout + a.stderr
        assert audit["by_rule"].get("over_capacity", 0) >= 1, audit
        assert audit["by_rule"].get("too_fast", 0) >= 1, audit
        over = next(m for m in audit["matches"] if m["rule"] == "over_capacity")
        rec = next(r for r in recs if r["id"] == over["id"])
        assert rec["prompt_tokens"] > 2048 and rec["outcome"] == "finished", rec
        assert over["tenant"] in audit["by_tenant"] and over["tenant"] in ("t0", "t1"), audit
        assert "over_capacity" in a.stdout and over["id"] in a.stdout, a.stdout
        f, faudit = foreign_audit(recs, tmp_root, "fault")
        assert f.returncode == 1, f.stdout + f.stderr
        assert faudit["by_rule"] == audit["by_rule"], (faudit, audit)
    finally:
        s.kill()


def test_probe_catches_the_fault_incident_build_disaggregated(tmp_root):
    """The incident as it happened: disaggregated, the prefill node's pool
    smaller than the decode node's. The fault build's gateway routes an
    over-long prompt on; decode reserves its pages; prefill turns it into
    a one-token placeholder and reports the transfer complete; decode
    starts without checking that every page arrived and reads pages that
    hold the flood's KV.

    The probe's window and timing checks catch it every time. Its markers
    check caught it in 3 of the 4 latest runs by hand (seeds 1, 1, 3; not
    with seed 4), so it is not asserted here: the placeholder's first token
    comes from a one-token prompt ("-"), and this 135M model, decoding from
    that over the flood's stale KV, recites the flood's secret or only its
    words ("-The-Access-Code-The-Access-…"); the unified fault build's
    placeholder (its last token computed in place) recites the secret."""
    assert FAULT_BIN.exists(), f"{FAULT_BIN} missing: ./scripts/test builds it"
    d = Node("decode", tmp_root, "fault-decode", binary=FAULT_BIN,
             args=["--max-context", "4096", "--kv-pages", "320"])
    p = Node("prefill", tmp_root, "fault-prefill", binary=FAULT_BIN, args=SERVE_ARGS)
    gw = Gateway(p.addr, d.addr, tmp_root, "fault-gateway", binary=FAULT_BIN,
                 extra=["--tenants", str(tenants(tmp_root, "fault-pd"))])
    try:
        wait_until(lambda: healthy(gw), what="gateway to pair")
        for n in (d, p):
            assert "FAULT-INCIDENT BUILD" in n.stderr_path.read_text()
        probe, report = run_probe(gw.url(""), tmp_root, "fault-pd")
        assert probe.returncode == 1, probe.stdout + probe.stderr
        # The window is prefill's (the smaller): what the gateway advertises.
        assert report["context_window"] == 2048, report
        kinds = {f["kind"] for f in report["findings"]}
        assert {"over_length_accepted", "answered_faster_than_prefill"} <= kinds, report
        checks = {c["check"]: c["status"] for c in report["checks"]}
        assert checks["over-length"] == "findings" and checks["timing"] == "findings", checks
        # Every over-long prompt (3 over-recalls and over) was answered 200.
        accepted = [f for f in report["findings"] if f["kind"] == "over_length_accepted"]
        assert len(accepted) == 4, accepted
        # Nothing on the nodes noticed: prefill refused no prompt (it made
        # placeholders) and decode counted no incomplete transfer (it did
        # not check), though the over-long prompts' pages were never sent.
        dm, pm = d.metrics(), p.metrics()
        assert pm["isoserve_node_prefill_prefills_refused_total"] == 0, pm
        assert dm["isoserve_node_decode_incomplete_transfers_total"] == 0, dm
        assert dm["isoserve_node_decode_transfers_completed_total"] == \
            pm["isoserve_node_prefill_transfers_done_total"], (dm, pm)
        recs = gw.log_records()
        over = [r for r in recs if r["prompt_tokens"] > 2048]
        assert len(over) == 4 and all(r["outcome"] == "finished" for r in over), over
        a, audit = run_audit(gw.request_log, tmp_root, "fault-pd",
                             "--prefill-tokens-per-s", str(report["prefill_tokens_per_s"]))
        assert a.returncode == 1, a.stdout + a.stderr
        assert audit["by_rule"].get("over_capacity", 0) >= 1, audit
        assert audit["by_rule"].get("too_fast", 0) >= 1, audit
    finally:
        gw.kill()
        p.kill()
        d.kill()


def test_probe_cannot_run_without_a_server(tmp_root):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here now
    p, report = run_probe(f"http://127.0.0.1:{port}", tmp_root, "nothing")
    assert p.returncode == 2, p.stdout + p.stderr
    assert report is None
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not run" in lines[0] and str(port) in lines[0], p.stderr


def test_probe_refuses_a_single_tenant_and_an_https_url(tmp_root):
    p = subprocess.run([str(BIN), "probe", "--url", "http://127.0.0.1:9",
                        "--tenant-key", KEYS[0]], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "two --tenant-key" in p.stderr, p.stderr
    p = subprocess.run([str(BIN), "probe", "--url", "https://example.invalid",
                        "--tenant-key", "a", "--tenant-key", "b"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "http:// URL" in p.stderr, p.stderr


def test_audit_exits_2_with_a_one_line_message_when_it_cannot(tmp_root):
    missing = tmp_root / "no-such.jsonl"
    p, report = run_audit(missing, tmp_root, "missing")
    assert p.returncode == 2 and report is None, p.stdout + p.stderr
    assert p.stderr.count("\n") == 1 and "cannot open" in p.stderr, p.stderr
    junk = tmp_root / "junk.jsonl"
    junk.write_text("{\"unrelated\": true}\nnot a log\n")
    p, report = run_audit(junk, tmp_root, "junk")
    assert p.returncode == 2, p.stdout + p.stderr
    assert report["records"] == 1 and report["unreadable_total"] == 1, report
    assert "no record carries the fields of any rule" in p.stderr, p.stderr
    p, _ = run_audit(junk, tmp_root, "badmap", "--map", "latency=x")
    assert p.returncode == 2 and "unknown field `latency`" in p.stderr, p.stderr


def test_probe_catches_a_grammar_cache_shared_across_tenants(tmp_root):
    """Issue 34: the fault build with ISOSERVE_FAULT_SHARED_GRAMMAR_CACHE=1
    keeps one compiled-grammar cache for every scope; the probe's
    grammar-cache check catches it (a schema another tenant sent answers
    several times faster than a fresh one), and the prefix-cache check,
    whose cache is still per scope here, passes."""
    assert FAULT_BIN.exists(), f"{FAULT_BIN} missing: ./scripts/test builds it"
    s = Server(SERVE_ARGS + ["--tenants", str(tenants(tmp_root, "grammar-fault"))],
               tmp_root, "probe-grammar-fault", binary=FAULT_BIN,
               env_extra={"ISOSERVE_FAULT_SHARED_GRAMMAR_CACHE": "1"})
    try:
        assert "one grammar cache for every scope" in s.stderr()
        p, report = run_probe(s.url(""), tmp_root, "grammar-fault")
        assert p.returncode == 1, p.stdout + p.stderr
        kinds = {f["kind"] for f in report["findings"]}
        assert "grammar_cache_shared_across_tenants" in kinds, report["findings"]
        checks = {c["check"]: c["status"] for c in report["checks"]}
        assert checks["grammar-cache"] == "findings", checks
        assert checks["prefix-cache"] == "passed", checks
        g = next(f for f in report["findings"]
                 if f["kind"] == "grammar_cache_shared_across_tenants")
        assert g["evidence"] == "statistical", g
    finally:
        assert s.terminate() == 0, s.stderr()


def test_probe_catches_drafts_shared_across_tenants(tmp_root):
    """Issue 37: the fault build with ISOSERVE_FAULT_SHARED_DRAFT_POOL=1
    keeps one suffix cache for every scope (`--speculative suffix`); the
    probe's drafts check catches it — another tenant's copy of an answer
    comes at the speed of the first tenant's repeat — while the prefix and
    grammar caches, still per scope here, pass."""
    assert FAULT_BIN.exists(), f"{FAULT_BIN} missing: ./scripts/test builds it"
    s = Server(SERVE_ARGS + ["--speculative", "suffix",
                             "--tenants", str(tenants(tmp_root, "draft-fault"))],
               tmp_root, "probe-draft-fault", binary=FAULT_BIN,
               env_extra={"ISOSERVE_FAULT_SHARED_DRAFT_POOL": "1"})
    try:
        assert "one suffix-cache scope for every tenant" in s.stderr()
        p, report = run_probe(s.url(""), tmp_root, "draft-fault")
        assert p.returncode == 1, p.stdout + p.stderr
        kinds = {f["kind"] for f in report["findings"]}
        # (The build's incident findings come with it, as in every fault
        # test: its over-long placeholder is always on.)
        assert "drafts_shared_across_tenants" in kinds, report["findings"]
        checks = {c["check"]: c["status"] for c in report["checks"]}
        assert checks["drafts"] == "findings", checks
        assert checks["prefix-cache"] == "passed" and checks["grammar-cache"] == "passed", checks
        d = next(f for f in report["findings"] if f["kind"] == "drafts_shared_across_tenants")
        assert d["evidence"] == "statistical" and "ms" in d["detail"], d
    finally:
        assert s.terminate() == 0, s.stderr()
