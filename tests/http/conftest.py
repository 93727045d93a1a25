"""Fixtures for the HTTP tests: `isoserve serve --port 0` as a subprocess.

Every server listens on 127.0.0.1 with an ephemeral port, read from the one
line it prints to stdout once listening. Servers are module- or
session-scoped (the model loads in about a second) and are stopped with
SIGTERM (then SIGKILL if they do not exit within a bound).
"""

import hashlib
import http.client
import json
import os
import re
import select
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "target" / "release" / "isoserve"
# The test-only build with the incident's bug (scripts/test builds it).
FAULT_BIN = REPO / "target" / "release" / "isoserve-fault-incident"
LISTEN_RE = re.compile(rb"^isoserve: listening on http://([0-9.]+):(\d+)\r?\n$")
START_TIMEOUT_S = 60

# Four tenants for the determinism test, one tightly limited tenant.
TENANT_KEYS = {f"t{i}": f"sk-test-tenant-{i}-key" for i in range(4)}
LIMITED_KEY = "sk-test-limited-key"
# The operator's key: every tenants file the tests write has it, and
# `Server.metrics()` reads /metrics with it (a tenant's key may not).
OPERATOR_KEY = "sk-test-operator-key"


def sha256_hex(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def write_tenants(path: Path, tenants, operator=True):
    """tenants: list of dicts with name, key and optional limits; with the
    operator's key (`[operator]`) unless `operator` is false."""
    lines = []
    for t in tenants:
        lines.append("[[tenant]]")
        lines.append(f'name = "{t["name"]}"')
        lines.append(f'api_key_sha256 = "{sha256_hex(t["key"])}"')
        for k in ("max_concurrent", "max_tokens_per_minute"):
            if k in t:
                lines.append(f"{k} = {t[k]}")
        if "cache_group" in t:
            lines.append(f'cache_group = "{t["cache_group"]}"')
        for k in ("weight", "max_priority"):
            if k in t:
                lines.append(f"{k} = {t[k]}")
        lines.append("")
    if operator:
        lines += ["[operator]", f'api_key_sha256 = "{sha256_hex(OPERATOR_KEY)}"', ""]
    path.write_text("\n".join(lines))
    return path


class Server:
    """A running `isoserve serve` process."""

    def __init__(self, args, tmp: Path, name: str, command: str = "serve", binary: Path = BIN,
                 env_extra=None, host: str = "127.0.0.1", port: int = 0, prefix=()):
        """`prefix`: words before the binary (`ip netns exec NS` for a host
        in a network namespace, listening on its own `host` and `port`)."""
        self.tmp = tmp
        self.stderr_path = tmp / f"{name}.stderr"
        self.request_log = tmp / f"{name}.requests.jsonl"
        cmd = list(prefix) + [str(binary), command, "--host", host, "--port", str(port),
                              "--request-log", str(self.request_log)] + list(args)
        self._stderr = open(self.stderr_path, "wb")
        env = dict(os.environ)
        env.setdefault("ISOSERVE_LOG", "info")
        env.update(env_extra or {})
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._stderr,
                                     stdin=subprocess.DEVNULL, env=env)
        self.host, self.port = self._read_port()
        self.base = f"http://{self.host}:{self.port}"

    def _read_port(self):
        deadline = time.monotonic() + START_TIMEOUT_S
        buf = b""
        fd = self.proc.stdout.fileno()
        while time.monotonic() < deadline:
            r, _, _ = select.select([fd], [], [], 0.2)
            if r:
                chunk = os.read(fd, 4096)
                if not chunk:
                    break
                buf += chunk
                if b"\n" in buf:
                    line = buf[: buf.index(b"\n") + 1]
                    m = LISTEN_RE.match(line)
                    assert m, f"unexpected first stdout line {line!r}"
                    return m.group(1).decode(), int(m.group(2))
            elif self.proc.poll() is not None:
                break
        self.kill()
        raise AssertionError(
            f"server did not start (exit {self.proc.returncode}); stderr:\n{self.stderr()}")

    def url(self, path: str) -> str:
        return self.base + path

    def stderr(self) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")

    def log_records(self):
        if not self.request_log.exists():
            return []
        return [json.loads(l) for l in self.request_log.read_text().splitlines() if l.strip()]

    def metrics(self) -> dict:
        r = requests.get(self.url("/metrics"), timeout=10,
                         headers={"Authorization": f"Bearer {OPERATOR_KEY}"})
        assert r.status_code == 200, r.text
        return parse_metrics(r.text)

    def terminate(self, timeout=40) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError("server did not exit within %ss of SIGTERM" % timeout)
        self._stderr.close()
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def parse_metrics(text: str) -> dict:
    """{'name{labels}': value} for every sample line."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out


def wait_pool_idle(server: Server, timeout=30.0) -> dict:
    """Polls /metrics until no KV page is held (each free, or cached and
    idle) and nothing runs or waits; returns the last metrics (the caller
    asserts)."""
    deadline = time.monotonic() + timeout
    m = server.metrics()
    while time.monotonic() < deadline:
        if (unheld(m) == m["isoserve_kv_pages_total"]
                and m["isoserve_requests_running"] == 0
                and m["isoserve_requests_waiting"] == 0
                and m["isoserve_http_inflight_requests"] == 0):
            return m
        time.sleep(0.1)
        m = server.metrics()
    return m


def unheld(m: dict) -> float:
    """KV pages no request holds: `state="free"` counts idle cached pages
    too (they are taken back on demand)."""
    return m["isoserve_kv_pages{state=\"free\"}"]


def assert_pool_clean(m: dict):
    assert unheld(m) == m["isoserve_kv_pages_total"], m
    assert m["isoserve_kv_pages{state=\"owned\"}"] == 0
    # Whatever is cached is idle.
    assert m["isoserve_kv_pages{state=\"cached\"}"] == m["isoserve_kv_pages{state=\"evictable\"}"]
    assert m["isoserve_kv_pages{state=\"leased\"}"] == 0
    assert m["isoserve_kv_pages{state=\"release_pending\"}"] == 0
    assert m["isoserve_requests_running"] == 0
    refusals = {k: v for k, v in m.items() if k.startswith("isoserve_kv_refusals_total")}
    assert len(refusals) == 16, refusals
    assert all(v == 0 for v in refusals.values()), refusals
    assert m["isoserve_kv_safety_refusals_total"] == 0


def tokenize(text: str, chat: bool):
    """Token ids as `isoserve tokenize` gives them."""
    cmd = [str(BIN), "tokenize", "--text", text] + (["--chat"] if chat else [])
    out = subprocess.run(cmd, check=True, capture_output=True, timeout=60).stdout
    return json.loads(out)


@pytest.fixture(scope="session")
def tmp_root():
    with tempfile.TemporaryDirectory(prefix="isoserve-http-") as d:
        yield Path(d)


@pytest.fixture(scope="session")
def server(tmp_root):
    """The default server: one anonymous tenant."""
    assert BIN.exists(), f"{BIN} missing: cargo build --release -p isoserve"
    s = Server([], tmp_root, "default")
    yield s
    rc = s.terminate()
    assert rc == 0, s.stderr()


@pytest.fixture(scope="session")
def tenant_server(tmp_root):
    """Four ordinary tenants and one limited to 1 concurrent request and 400
    tokens per minute."""
    tenants = [{"name": n, "key": k, "max_concurrent": 16} for n, k in TENANT_KEYS.items()]
    tenants.append({"name": "limited", "key": LIMITED_KEY, "max_concurrent": 1,
                    "max_tokens_per_minute": 400})
    path = write_tenants(tmp_root / "tenants.toml", tenants)
    s = Server(["--tenants", str(path)], tmp_root, "tenants")
    yield s
    rc = s.terminate()
    assert rc == 0, s.stderr()


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def sse_events(resp):
    """Yields each `data:` payload of an SSE response (str), in order."""
    for line in resp.iter_lines(decode_unicode=True):
        if line and line.startswith("data: "):
            yield line[len("data: "):]


class Stream:
    """A streaming POST over its own connection (http.client), so that
    close() really closes the socket (requests/urllib3 may keep it open)."""

    def __init__(self, server, path, body, headers=None, timeout=60):
        self.conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
        h = {"Content-Type": "application/json"}
        h.update(headers or {})
        self.conn.request("POST", path, body=json.dumps(body), headers=h)
        self.resp = self.conn.getresponse()
        self.status = self.resp.status
        self.headers = self.resp.headers

    def events(self):
        """Each `data:` payload (str) until [DONE] (included) or EOF."""
        while True:
            line = self.resp.readline()
            if not line:
                return
            line = line.decode().rstrip("\r\n")
            if line.startswith("data: "):
                payload = line[len("data: "):]
                yield payload
                if payload == "[DONE]":
                    return

    def json_events(self):
        """The chunks as dicts, [DONE] left out."""
        for e in self.events():
            if e != "[DONE]":
                yield json.loads(e)

    def close(self):
        try:
            if self.conn.sock is not None:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
