"""Node loss without a connection drop: a decode node that stops (SIGSTOP)
keeps its TCP connections open but sends no heartbeats; the gateway declares
it lost after the heartbeat timeout (5 s), answers 503 meanwhile, and pairs
again once the node runs (SIGCONT) and the connection is re-made. A request
running on the stopped node fails cleanly and prefill frees its pages;
`isoserve audit` lists it as refused after allocation (decode had reserved
its pages), from the gateway's request log."""

import json
import os
import signal
import subprocess
import threading

from conftest import BIN

from test_disaggregated import (PROMPTS, Gateway, Node, chat, healthy, long_prompt, pool_free,
                                wait_until)


def test_heartbeat_timeout_fails_requests_and_recovers(tmp_root):
    d = Node("decode", tmp_root, "decode-hb")
    p = Node("prefill", tmp_root, "prefill-hb")
    gw = Gateway(p.addr, d.addr, tmp_root, "gateway-hb")
    try:
        wait_until(lambda: healthy(gw), what="gateway to pair")
        result = {}
        t = threading.Thread(target=lambda: result.update(r=chat(gw, long_prompt(), max_tokens=16)))
        t.start()
        wait_until(lambda: p.metrics()["isoserve_node_requests"] > 0, what="prefill to hold the request")
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: not healthy(gw), timeout=20, what="the gateway to declare decode lost")
            t.join(timeout=60)
            assert result["r"].status_code == 502, result["r"].text
            pool_free(p)
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        wait_until(lambda: healthy(gw), timeout=30, what="the gateway to pair again")
        ok = chat(gw, PROMPTS[0])
        assert ok.status_code == 200 and "Paris" in ok.json()["choices"][0]["message"]["content"], ok.text
        pool_free(d)
        pool_free(p)
        recs = gw.log_records()
        lost = [r for r in recs if r["outcome"] == "error"]
        assert len(lost) == 1 and lost[0]["error_code"] in ("decode_lost", "prefill_lost"), recs
        # Decode's prompt pages had gone to prefill: the request held them.
        assert lost[0]["pages"] > 0 and lost[0]["output_tokens"] == 0, lost
        out = tmp_root / "hb-audit.json"
        a = subprocess.run([str(BIN), "audit", "--log", str(gw.request_log), "--json", str(out)],
                           capture_output=True, text=True, timeout=60)
        assert a.returncode == 1, a.stdout + a.stderr
        audit = json.loads(out.read_text())
        assert audit["by_rule"] == {"rejected_after_allocation": 1}, audit
        assert audit["matches"][0]["id"] == lost[0]["id"], audit
    finally:
        gw.terminate()
        d.kill()
        p.kill()
