"""Drain (issue 19), as processes on 127.0.0.1: one prefill, two decode
nodes and a gateway. SIGTERM on a decode node while requests stream: it
refuses new requests (the gateway places them on the other decode node),
finishes every request it holds, reports `draining` on /ready and
/metrics, and exits 0; no request is lost and every answer equals the
unified server's; the other nodes' pools are free after.
"""

import signal
import threading
import time

import requests

from conftest import parse_metrics

from test_disaggregated import NODE_ARGS, PROMPTS, Gateway, Node, chat, healthy, pool_free, \
    wait_until


def test_sigterm_drains_a_decode_node_without_losing_a_request(tmp_root, server):
    d_a = Node("decode", tmp_root, "decode-a")
    d_b = Node("decode", tmp_root, "decode-b")
    p = Node("prefill", tmp_root, "prefill-d")
    gw = Gateway(p.addr, d_a.addr, tmp_root, "gateway-drain", extra=["--decode", d_b.addr])
    try:
        wait_until(lambda: healthy(gw), what="the set to pair")
        want = {q: chat(server, q, max_tokens=48).json()["choices"][0]["message"]["content"]
                for q in PROMPTS}
        results, errors = [], []

        def client(i):
            # Each client sends its prompts back to back for a while.
            deadline = time.monotonic() + 8
            k = i
            while time.monotonic() < deadline and k < i + 6:
                q = PROMPTS[k % len(PROMPTS)]
                try:
                    r = chat(gw, q, max_tokens=48, timeout=120)
                except requests.RequestException as e:
                    errors.append(repr(e))
                    return
                if r.status_code != 200:
                    errors.append(r.text)
                else:
                    results.append((q, r.json()["choices"][0]["message"]["content"]))
                k += 1

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        # Let requests reach both decode nodes, then drain A.
        wait_until(lambda: d_a.metrics()["isoserve_node_requests"] > 0, timeout=30,
                   what="decode-a to hold a request")
        d_a.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: d_a.proc.poll() is not None or
                   d_a.metrics()["isoserve_node_draining"] == 1, timeout=10,
                   what="decode-a to report draining")
        for t in threads:
            t.join(timeout=180)
        assert d_a.proc.wait(timeout=60) == 0, d_a.stderr_path.read_text()
        log = d_a.stderr_path.read_text()
        assert "draining" in log and "drained in" in log, log
        assert not errors, errors
        assert len(results) >= 8, len(results)
        for q, got in results:
            assert got == want[q], (q, got, want[q])
        # After the drain everything goes to B, and still works.
        r = chat(gw, PROMPTS[0], max_tokens=48)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == \
            want[PROMPTS[0]]
        gm = parse_metrics(requests.get(gw.url("/metrics"), timeout=10).text)
        # Whether a request was placed on A in the moment between its drain
        # and its exit (then refused as draining and placed again) depends
        # on timing: on a loaded CI machine none was (a flake). The replace
        # path itself is pinned by crates/transfer/tests/drain.rs; here no
        # request may fail for it.
        assert gm['isoserve_requests_total{outcome="error"}'] == 0, gm
        assert gm["isoserve_gateway_replaced_draining_total"] <= len(results) + 1, gm
        mb = pool_free(d_b)
        assert mb["isoserve_node_draining"] == 0
        pool_free(p)
    finally:
        gw.terminate()
        for n in (d_a, d_b, p):
            n.terminate()


def test_a_gateway_finds_its_decode_node_by_dns_name(tmp_root, server):
    """`--decode dns:localhost:PORT`: the gateway resolves the name (at start
    and every 5 s) and pairs with what it finds; a malformed `dns:` address
    is a one-line error."""
    d = Node("decode", tmp_root, "decode-dns")
    p = Node("prefill", tmp_root, "prefill-dns")
    gw = Gateway(p.addr, f"dns:localhost:{d.port}", tmp_root, "gateway-dns")
    try:
        wait_until(lambda: healthy(gw), what="the gateway to find decode by name")
        want = chat(server, PROMPTS[2], max_tokens=24).json()["choices"][0]["message"]
        r = chat(gw, PROMPTS[2], max_tokens=24)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"] == want
        assert "node joined" in gw.stderr(), gw.stderr()
    finally:
        gw.terminate()
        d.terminate()
        p.terminate()
    import subprocess
    from conftest import BIN
    bad = subprocess.run([str(BIN), "gateway", "--prefill", "127.0.0.1:1", "--decode", "dns:nope",
                          "--port", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    assert "expected dns:NAME:PORT" in bad.stderr.strip().splitlines()[-1], bad.stderr
