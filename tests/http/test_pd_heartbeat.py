"""Node loss without a connection drop: a decode node that stops (SIGSTOP)
keeps its TCP connections open but sends no heartbeats; the gateway declares
it lost after the heartbeat timeout (5 s), answers 503 meanwhile, and pairs
again once the node runs (SIGCONT) and the connection is re-made. A request
running on the stopped node fails cleanly and prefill frees its pages."""

import os
import signal
import threading

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
    finally:
        gw.terminate()
        d.kill()
        p.kill()
