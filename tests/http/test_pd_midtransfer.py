"""kill -9 exactly mid-transfer: a throttling proxy in front of the decode node
delays every Page frame, so the transfer of a long prompt takes seconds and
the kill lands after decode received some pages and before the transfer
completed (both read from decode's /metrics first).

* prefill killed mid-transfer: decode sees the link end, fails the request
  (the client gets 502, no tokens), and frees every reserved page.
* decode killed mid-transfer: prefill sees the link end and frees its pages.
* Either way the restarted node re-pairs and the set serves again.
Loopback only; every wait is bounded.
"""

import socket
import threading
import time

from test_disaggregated import (PROMPTS, Gateway, Node, chat, healthy, long_prompt, pool_free,
                                wait_until)

PAGE_KIND = 6
PAGE_DELAY_S = 0.03


class SlowProxy:
    """Forwards 127.0.0.1:port → the decode node, delaying Page frames."""

    def __init__(self, target_port):
        self.target = target_port
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.addr = "127.0.0.1:%d" % self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            try:
                s = socket.create_connection(("127.0.0.1", self.target), timeout=5)
                s.settimeout(None)
            except OSError:
                c.close()
                continue
            threading.Thread(target=self._pump, args=(c, s, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(s, c, False), daemon=True).start()

    @staticmethod
    def _pump(src, dst, slow):
        buf = b""
        try:
            while True:
                chunk = src.recv(1 << 16)
                if not chunk:
                    break
                if not slow:
                    dst.sendall(chunk)
                    continue
                buf += chunk
                while len(buf) >= 6:
                    n = int.from_bytes(buf[:4], "little")
                    if len(buf) < 4 + n:
                        break
                    frame, buf = buf[:4 + n], buf[4 + n:]
                    if frame[5] == PAGE_KIND:
                        time.sleep(PAGE_DELAY_S)
                    dst.sendall(frame)
        except OSError:
            pass
        for x in (src, dst):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            x.close()


def mid_transfer(d):
    m = d.metrics()
    return (m["isoserve_node_decode_pages_received_total"] > mid_transfer.base_pages
            and m["isoserve_node_decode_transfers_completed_total"] == mid_transfer.base_done)


def test_kill9_mid_transfer_either_node(tmp_root):
    d = Node("decode", tmp_root, "decode-mt")
    px = SlowProxy(d.port)
    p = Node("prefill", tmp_root, "prefill-mt")
    gw = Gateway(p.addr, px.addr, tmp_root, "gateway-mt")
    try:
        wait_until(lambda: healthy(gw), what="gateway to pair")

        # 1. prefill dies mid-transfer.
        m0 = d.metrics()
        mid_transfer.base_pages = m0["isoserve_node_decode_pages_received_total"]
        mid_transfer.base_done = m0["isoserve_node_decode_transfers_completed_total"]
        result = {}
        t = threading.Thread(target=lambda: result.update(r=chat(gw, long_prompt(), max_tokens=32)))
        t.start()
        wait_until(lambda: mid_transfer(d), timeout=90, what="decode to be mid-transfer")
        p.kill()
        t.join(timeout=60)
        r = result["r"]
        assert r.status_code == 502, r.text
        m = pool_free(d)
        received = m["isoserve_node_decode_pages_received_total"] - mid_transfer.base_pages
        assert 0 < received < 100, received  # a partial transfer (the prompt has ≈107 pages)
        assert m["isoserve_node_decode_transfers_completed_total"] == mid_transfer.base_done
        p = Node("prefill", tmp_root, "prefill-mt", port=p.port)
        wait_until(lambda: healthy(gw), what="gateway to pair again")
        ok = chat(gw, PROMPTS[0])
        assert ok.status_code == 200 and "Paris" in ok.json()["choices"][0]["message"]["content"], ok.text

        # 2. decode dies mid-transfer.
        m0 = d.metrics()
        mid_transfer.base_pages = m0["isoserve_node_decode_pages_received_total"]
        mid_transfer.base_done = m0["isoserve_node_decode_transfers_completed_total"]
        result = {}
        t = threading.Thread(target=lambda: result.update(r=chat(gw, long_prompt(), max_tokens=32)))
        t.start()
        wait_until(lambda: mid_transfer(d), timeout=90, what="decode to be mid-transfer")
        d.kill()
        t.join(timeout=60)
        assert result["r"].status_code == 502, result["r"].text
        pool_free(p)
        d = Node("decode", tmp_root, "decode-mt", port=d.port)
        wait_until(lambda: healthy(gw), what="gateway to pair again")
        ok = chat(gw, PROMPTS[0])
        assert ok.status_code == 200 and "Paris" in ok.json()["choices"][0]["message"]["content"], ok.text
        pool_free(d)
        pool_free(p)
    finally:
        gw.terminate()
        for n in (p, d):
            n.kill()
