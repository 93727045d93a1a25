"""The front door (K13): one client's sockets cannot lock out other clients
or `/health`. Clients come from distinct loopback addresses (127.0.0.2,
127.0.0.3, ...) to the server on 127.0.0.1, so the per-client limit sees
them as different clients; nothing but loopback is contacted."""

import json
import resource
import socket
import time

import pytest

from conftest import Server

ATTACKER = "127.0.0.2"
OTHER = "127.0.0.3"


@pytest.fixture(autouse=True)
def enough_descriptors():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 8192)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 4096, "too few file descriptors"


def silent_sockets(s, n, source=ATTACKER):
    """n connections that never send a byte (bounded: n <= 2048)."""
    assert n <= 2048
    socks = []
    for _ in range(n):
        c = socket.socket()
        c.bind((source, 0))
        c.settimeout(5)
        c.connect((s.host, s.port))
        socks.append(c)
    return socks


def request(s, method, path, body=None, source=OTHER, timeout=10):
    """One HTTP/1.1 request from `source`; (status, json body, seconds)."""
    t0 = time.monotonic()
    c = socket.socket()
    c.bind((source, 0))
    c.settimeout(timeout)
    try:
        c.connect((s.host, s.port))
        data = b"" if body is None else json.dumps(body).encode()
        head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
        out = b""
        try:
            c.sendall(head.encode() + data)
            while True:
                chunk = c.recv(65536)
                if not chunk:
                    break
                out += chunk
        except (ConnectionResetError, BrokenPipeError):
            # Closed unanswered (the overflow lane was full): status 0.
            pass
    finally:
        c.close()
    head, _, rest = out.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    try:
        j = json.loads(rest) if rest else None
    except ValueError:
        j = None
    return status, j, time.monotonic() - t0


def completion(s, source=OTHER):
    return request(s, "POST", "/v1/completions",
                   {"prompt": "Hello", "max_tokens": 2, "temperature": 0}, source=source)


def others_are_served(s):
    """Another address gets /health within a second and a completion."""
    time.sleep(0.3)
    st, j, dt = request(s, "GET", "/health")
    assert st == 200 and j == {"status": "ok"} and dt < 1.0, (st, j, dt)
    st, j, _ = completion(s)
    assert st == 200 and j["usage"]["completion_tokens"] == 2, (st, j)


def test_1024_silent_sockets_from_one_client_do_not_lock_others_out(tmp_root):
    s = Server([], tmp_root, "door-1024")
    socks = []
    try:
        t_open = time.monotonic()
        socks = silent_sockets(s, 1024)
        time.sleep(0.3)
        st, j, dt = request(s, "GET", "/health")
        assert st == 200 and j == {"status": "ok"} and dt < 1.0, (st, j, dt)
        # The attacker's own next connection is over its limit: 429 in
        # OpenAI's shape (or closed, when the overflow lane is full) — while
        # its first silent sockets still hold their slots: on a machine so
        # loaded that opening them took the first-byte timeout (5 s), the
        # first ones were closed and freed their slots (a CI flake, 200).
        st, j, _ = request(s, "GET", "/v1/models", source=ATTACKER)
        held = time.monotonic() - t_open < 4.5
        assert st in (0, 429) or (not held and st == 200), (st, j, time.monotonic() - t_open)
        if st == 429:
            assert j["error"]["code"] == "too_many_connections", j
            m = s.metrics()
            assert m['isoserve_rejections_total{reason="connection_limit"}'] >= 1, m
        st, j, dt = completion(s)
        assert st == 200 and j["usage"]["completion_tokens"] == 2 and dt < 5.0, (st, j, dt)
        # Silent connections are closed after the first-byte timeout (5 s).
        socks[0].settimeout(15)
        t0 = time.monotonic()
        assert socks[0].recv(1) == b""
        assert time.monotonic() - t0 < 10
    finally:
        for c in socks:
            c.close()
        assert s.terminate() == 0, s.stderr()


def test_20_sockets_against_max_connections_20(tmp_root):
    # One client's 20 sockets take its 5 (a quarter of 20): others still
    # get in. Four clients' 20 take them all: others get a clear 503, and
    # /health still answers.
    # A first-byte timeout of 10 s: on a loaded CI machine opening the
    # forty sockets and serving the others took longer than the default 5,
    # and the first silent ones were closed before the 503 was asked for.
    s = Server(["--max-connections", "20", "--first-byte-timeout-s", "10"], tmp_root, "door-20")
    socks = []
    try:
        socks = silent_sockets(s, 20)
        others_are_served(s)
        # The server frees another's slot when that connection's task ends,
        # a moment after the client saw EOF: on a loaded machine the filling
        # sockets came first and one slot came back after them (a CI flake:
        # 200 where 503 was meant). So: a pause, then two more sockets from
        # a fifth address take whatever came back late (or wait in the
        # overflow lane and are closed; either way the server holds 20).
        time.sleep(0.5)
        for i in range(4):
            socks += silent_sockets(s, 5, source=f"127.0.0.{10 + i}")
        time.sleep(0.5)
        socks += silent_sockets(s, 2, source="127.0.0.20")
        time.sleep(0.3)
        st, j, dt = request(s, "GET", "/health")
        assert st == 200 and j == {"status": "ok"} and dt < 1.0, (st, j, dt)
        st, j, _ = completion(s)
        assert st == 503 and j["error"]["code"] == "server_busy", (st, j)
        assert "20 connections" in j["error"]["message"], j
        # Once the silent ones are closed (first-byte timeout), it serves.
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline:
            st, j, _ = completion(s)
            if st == 200:
                break
            time.sleep(0.5)
        assert st == 200, (st, j)
        m = s.metrics()
        assert m['isoserve_rejections_total{reason="connection_limit"}'] >= 1
    finally:
        for c in socks:
            c.close()
        assert s.terminate() == 0, s.stderr()


def test_metrics_want_the_operator_key_or_a_port_of_their_own(tmp_root):
    import requests

    from conftest import OPERATOR_KEY, write_tenants
    key = "sk-door-tenant"
    path = write_tenants(tmp_root / "door-tenants.toml", [{"name": "a", "key": key}])
    s = Server(["--tenants", str(path), "--metrics-port", "0"], tmp_root, "door-metrics")
    try:
        url = s.url("/metrics")
        r = requests.get(url, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        # A tenant's key is not the operator's.
        r = requests.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=10)
        assert r.status_code == 401, r.text
        r = requests.get(url, headers={"Authorization": f"Bearer {OPERATOR_KEY}"}, timeout=10)
        assert r.status_code == 200 and "isoserve_kv_pages_total" in r.text
        # The operations listener: no key, /metrics and /health only.
        import re
        m = re.search(r"isoserve: metrics on (http://[0-9.:]+)/metrics", s.stderr())
        assert m, s.stderr()
        ops = m.group(1)
        assert "isoserve_kv_pages_total" in requests.get(ops + "/metrics", timeout=10).text
        assert requests.get(ops + "/health", timeout=10).json() == {"status": "ok"}
        assert requests.get(ops + "/v1/models", timeout=10).status_code == 404
    finally:
        assert s.terminate() == 0, s.stderr()
    # Without an [operator] section, nobody reads /metrics on the API port.
    path = write_tenants(tmp_root / "door-noop.toml", [{"name": "a", "key": key}], operator=False)
    s = Server(["--tenants", str(path)], tmp_root, "door-noop")
    try:
        r = requests.get(s.url("/metrics"), headers={"Authorization": f"Bearer {key}"},
                         timeout=10)
        assert r.status_code == 403 and "--metrics-port" in r.json()["error"]["message"], r.text
    finally:
        assert s.terminate() == 0, s.stderr()


def test_the_pd_gateway_has_the_same_front_door(tmp_root):
    s = Server(["--disaggregated", "--kv-memory", "256MiB", "--max-context", "2048",
                "--max-connections", "20"], tmp_root, "door-pd")
    socks = []
    try:
        socks = silent_sockets(s, 20)
        others_are_served(s)
        st, j, _ = request(s, "GET", "/v1/models", source=ATTACKER)
        assert st in (0, 429), (st, j)
    finally:
        for c in socks:
            c.close()
        assert s.terminate() == 0, s.stderr()
