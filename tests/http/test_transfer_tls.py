"""Mutual TLS on the transfer channel (K14), as processes on 127.0.0.1:

* `isoserve transfer-certs` writes a CA and node certificates; prefill,
  decode and gateway started with them pair and serve, and greedy output
  equals the unified server's.
* A gateway holding a certificate from another CA is refused by the nodes
  during the handshake and counted; it never pairs, and no request reaches
  decode.
* A plaintext peer on a TLS node's port is refused before any frame is read.
* Without TLS, a node or gateway whose transfer address is not loopback
  refuses to start with a one-line error (nothing is bound); three TLS flags
  or none.
"""

import socket
import struct
import subprocess
import time

import pytest

from conftest import BIN
from test_disaggregated import (NODE_ARGS, PROMPTS, Gateway, Node, chat, healthy, pool_free,
                                wait_until)


def certs(tmp, name, nodes):
    out = tmp / name
    r = subprocess.run([str(BIN), "transfer-certs", "--out", str(out), "--nodes", ",".join(nodes)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return out


def tls_args(d, node, ca_dir=None):
    ca_dir = ca_dir or d
    return ["--transfer-tls-cert", str(d / f"{node}.pem"), "--transfer-tls-key",
            str(d / f"{node}.key"), "--transfer-tls-ca", str(ca_dir / "ca.pem")]


@pytest.fixture(scope="module")
def tls_set(tmp_root):
    d = certs(tmp_root, "pki", ["gateway", "prefill-0", "decode-0"])
    dec = Node("decode", tmp_root, "decode-tls", args=NODE_ARGS + tls_args(d, "decode-0"))
    pre = Node("prefill", tmp_root, "prefill-tls", args=NODE_ARGS + tls_args(d, "prefill-0"))
    gw = Gateway(pre.addr, dec.addr, tmp_root, "gateway-tls", extra=tls_args(d, "gateway"))
    wait_until(lambda: healthy(gw), what="the TLS set to pair")
    yield {"pki": d, "prefill": pre, "decode": dec, "gateway": gw}
    gw.terminate()
    for n in (pre, dec):
        assert n.terminate() == 0, n.stderr_path.read_text()


def tls_refused(node):
    return node.metrics()["isoserve_node_transport_tls_handshakes_refused_total"]


def test_tls_set_serves_what_the_unified_server_serves(tls_set, server):
    gw = tls_set["gateway"]
    for prompt in PROMPTS[:3]:
        a, b = chat(server, prompt), chat(gw, prompt)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"], prompt
    m = pool_free(tls_set["decode"])
    assert m["isoserve_node_decode_transfers_completed_total"] >= 3
    assert m["isoserve_node_decode_checksum_failures_total"] == 0
    assert tls_refused(tls_set["decode"]) == 0 and tls_refused(tls_set["prefill"]) == 0


def test_a_gateway_with_another_cas_certificate_is_refused(tls_set, tmp_root):
    rogue_pki = certs(tmp_root, "rogue-pki", ["gateway"])
    dec, pre = tls_set["decode"], tls_set["prefill"]
    before = (tls_refused(dec), tls_refused(pre))
    reserved = dec.metrics()["isoserve_node_decode_reservations_total"]
    # The rogue trusts the real CA (so it accepts the nodes' certificates)
    # but presents one the operator never signed.
    rogue = Gateway(pre.addr, dec.addr, tmp_root, "gateway-rogue",
                    extra=tls_args(rogue_pki, "gateway", ca_dir=tls_set["pki"]))
    try:
        wait_until(lambda: tls_refused(dec) > before[0] and tls_refused(pre) > before[1],
                   what="both nodes to refuse the rogue's handshake")
        assert not healthy(rogue)
        r = chat(rogue, PROMPTS[0])
        assert r.status_code == 503, r.text
        assert dec.metrics()["isoserve_node_decode_reservations_total"] == reserved
    finally:
        rogue.terminate()
    # The real set still serves.
    assert chat(tls_set["gateway"], PROMPTS[1]).status_code == 200


def test_a_plaintext_peer_is_refused_before_any_frame(tls_set):
    dec = tls_set["decode"]
    before = tls_refused(dec)
    bad = dec.metrics()["isoserve_node_transport_bad_frames_total"]
    host, port = dec.addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        # Something frame-shaped: a length prefix and bytes.
        s.sendall(struct.pack("<I", 12) + b"\x03" * 12)
        s.settimeout(5)
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except (ConnectionResetError, socket.timeout):
            pass
        assert len(got) < 64, got
    wait_until(lambda: tls_refused(dec) == before + 1, what="the plaintext peer to be counted")
    # Refused by TLS: the bytes never reached the frame parser.
    assert dec.metrics()["isoserve_node_transport_bad_frames_total"] == bad


def run_cli(args, timeout=60):
    return subprocess.run([str(BIN)] + args, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("cmd", [
    ["decode", "--host", "0.0.0.0", "--port", "0"],
    ["prefill", "--host", "10.1.2.3", "--port", "0"],
    ["gateway", "--prefill", "10.1.2.3:7000", "--decode", "127.0.0.1:7001", "--port", "0"],
])
def test_plaintext_off_loopback_refuses_to_start(cmd):
    t0 = time.monotonic()
    r = run_cli(cmd)
    assert r.returncode != 0
    err = r.stderr.strip().splitlines()
    assert "not a loopback address" in err[-1] and "--insecure-transfer" in err[-1], r.stderr
    assert err[-1].startswith("isoserve: "), r.stderr
    assert time.monotonic() - t0 < 30


def test_tls_flags_come_together(tmp_root):
    d = certs(tmp_root, "pki-partial", ["decode-0"])
    r = run_cli(["decode", "--port", "0", "--transfer-tls-cert", str(d / "decode-0.pem")])
    assert r.returncode != 0
    assert "together" in r.stderr.strip().splitlines()[-1], r.stderr
    r = run_cli(["decode", "--port", "0", "--transfer-tls-cert", str(d / "nope.pem"),
                 "--transfer-tls-key", str(d / "decode-0.key"), "--transfer-tls-ca",
                 str(d / "ca.pem")])
    assert r.returncode != 0
    assert "nope.pem" in r.stderr.strip().splitlines()[-1], r.stderr


def test_transfer_certs_never_overwrites(tmp_root):
    d = certs(tmp_root, "pki-once", ["a"])
    before = (d / "a.key").read_bytes()
    r = run_cli(["transfer-certs", "--out", str(d), "--nodes", "a"])
    assert r.returncode != 0 and "exists" in r.stderr, r.stderr
    assert (d / "a.key").read_bytes() == before
    assert oct((d / "a.key").stat().st_mode & 0o777) == "0o600"
    r = run_cli(["transfer-certs", "--out", str(d), "--nodes", "../evil"])
    assert r.returncode != 0 and "node name" in r.stderr, r.stderr
