"""`isoserve probe` against our own server, from the outside: it must pass
a correct server, unified and disaggregated, with content-level checks
(every check ran and passed, outputs agreed with the idle ones), catch the
test-only `fault-incident` build (the incident's placeholder path: exit 1,
the findings named), and exit 2 with a one-line message when it cannot
run.

The KV pool is kept small (`--kv-pages`) so that the probe's concurrent
long prompts exceed it: the markers check runs while requests queue for
pages and pages are reused across tenants.
"""

import json
import socket
import subprocess

from conftest import BIN, FAULT_BIN, Server, wait_pool_idle, write_tenants

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


def assert_clean(p, report):
    assert p.returncode == 0, p.stdout + p.stderr
    assert "no findings" in p.stdout, p.stdout
    assert report["findings"] == []
    checks = {c["check"]: c["status"] for c in report["checks"]}
    assert checks == {"markers": "passed", "determinism": "passed",
                      "over-length": "passed", "timing": "passed",
                      "tokens": "passed"}, report["checks"]
    # Content, not status: every loaded output equalled its idle output,
    # the window was read from /v1/models, the rate was measured.
    assert report["determinism_agreement"] == 1.0
    assert report["context_window"] == 2048
    assert report["prefill_tokens_per_s"] > 50
    assert report["tenants"] == 2
    # 2 keys + 2 calibration + 3 rate + 6 idle + 12 loaded + 4 window edges.
    assert report["requests_sent"] == 29, report
    over = next(c for c in report["checks"] if c["check"] == "over-length")
    assert "under" in over["summary"] and ": 400" in over["summary"], over


def test_probe_passes_a_unified_server(tmp_root):
    s = Server(SERVE_ARGS + ["--tenants", str(tenants(tmp_root, "unified"))],
               tmp_root, "probe-unified")
    try:
        p, report = run_probe(s.url(""), tmp_root, "unified")
        assert_clean(p, report)
        # The pool was pushed: pages were handed out many times over (to
        # both tenants), no safety check fired, and everything came back.
        m = wait_pool_idle(s)
        assert m["isoserve_kv_pages_total"] == 160
        assert m["isoserve_kv_pages{state=\"free\"}"] == 160, m
        assert m["isoserve_kv_allocs_total"] > 2 * 160, m
        assert m["isoserve_kv_safety_refusals_total"] == 0, m
    finally:
        assert s.terminate() == 0, s.stderr()


def test_probe_passes_a_disaggregated_server(tmp_root):
    s = Server(["--disaggregated"] + SERVE_ARGS +
               ["--tenants", str(tenants(tmp_root, "disagg"))],
               tmp_root, "probe-disagg")
    try:
        p, report = run_probe(s.url(""), tmp_root, "disagg")
        assert_clean(p, report)
    finally:
        assert s.terminate() == 0, s.stderr()


def test_probe_catches_the_fault_incident_build(tmp_root):
    assert FAULT_BIN.exists(), f"{FAULT_BIN} missing: ./scripts/test builds it"
    s = Server(SERVE_ARGS + ["--tenants", str(tenants(tmp_root, "fault"))],
               tmp_root, "probe-fault", binary=FAULT_BIN)
    try:
        assert "FAULT-INCIDENT BUILD" in s.stderr()
        p, report = run_probe(s.url(""), tmp_root, "fault")
        assert p.returncode == 1, p.stdout + p.stderr
        kinds = {f["kind"] for f in report["findings"]}
        # The over-long request was answered 200, faster than its prompt
        # could have been prefilled.
        assert {"over_length_accepted", "answered_faster_than_prefill"} <= kinds, report
        checks = {c["check"]: c["status"] for c in report["checks"]}
        assert checks["over-length"] == "findings" and checks["timing"] == "findings", checks
        assert "FINDINGS" in p.stdout and "over_length_accepted" in p.stdout, p.stdout
    finally:
        s.kill()


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
