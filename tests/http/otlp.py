"""An in-process OTLP/HTTP receiver for tests: a thread serving POST
/v1/traces on the address given (loopback, or the test's own address on a
network-namespace bridge), keeping every export. JSON exports are decoded
into spans; protobuf ones are kept raw (a test can still find a trace id's
16 bytes in them)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

EXPORT_BYTES_MAX = 16 << 20


class Receiver:
    def __init__(self, host="127.0.0.1"):
        self.lock = threading.Lock()
        self.exports = []  # (content-type, body bytes)
        rec = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                n = int(self.headers.get("Content-Length", "0"))
                if self.path != "/v1/traces" or n > EXPORT_BYTES_MAX:
                    self.send_response(404)
                    self.end_headers()
                    return
                body = self.rfile.read(n)
                with rec.lock:
                    rec.exports.append((self.headers.get("Content-Type", ""), body))
                ctype = self.headers.get("Content-Type", "")
                self.send_response(200)
                self.send_header("Content-Type", ctype or "application/json")
                reply = b"{}" if "json" in ctype else b""
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def raw(self):
        with self.lock:
            return list(self.exports)

    def spans(self):
        """Every span of the JSON exports, flattened, with its service."""
        out = []
        for ctype, body in self.raw():
            if "json" not in ctype:
                continue
            doc = json.loads(body)
            for rs in doc.get("resourceSpans", []):
                attrs = {a["key"]: a["value"] for a in rs.get("resource", {}).get("attributes", [])}
                service = attrs.get("service.name", {}).get("stringValue")
                instance = attrs.get("service.instance.id", {}).get("stringValue")
                for ss in rs.get("scopeSpans", []):
                    for s in ss.get("spans", []):
                        s = dict(s)
                        s["service"] = service
                        s["instance"] = instance
                        s["attrs"] = {a["key"]: next(iter(a["value"].values()))
                                      for a in s.get("attributes", [])}
                        out.append(s)
        return out

    def trace(self, trace_id, want, timeout=20.0):
        """The spans of `trace_id` once `want(spans)` holds (bounded wait)."""
        deadline = time.monotonic() + timeout
        got = []
        while time.monotonic() < deadline:
            got = [s for s in self.spans() if s.get("traceId", "").lower() == trace_id]
            if want(got):
                return got
            time.sleep(0.1)
        raise AssertionError(f"trace {trace_id}: only {[(s['service'], s['name']) for s in got]}")
