"""Tracing across the PD set (issue 19): a W3C `traceparent` accepted at the
gateway travels on the wire to prefill and decode; each process logs its
spans and exports them over OTLP/HTTP (`--otlp-endpoint`) to an in-process
receiver. One request is one trace: the gateway's `request` span under the
caller's span; prefill's `queue` and `prefill`, decode's `queue`,
`transfer` and `decode`, each under the gateway's span, in order, with the
request id. Without a header (or with a malformed one) the gateway starts a
trace of its own. Spans carry no prompt text. The decode node exports
protobuf, the others JSON: both encodings reach the receiver.

(The same path over three hosts in network namespaces: test_multihost.py.)
"""

import os

import pytest
import requests

from otlp import Receiver
from test_disaggregated import MODEL, NODE_ARGS, Gateway, Node, healthy, pool_free, wait_until

SECRET = "zebra-quartz-4471"


@pytest.fixture(scope="module")
def traced(tmp_root):
    rec = Receiver()
    otlp = ["--otlp-endpoint", rec.url, "--otlp-protocol", "http/json"]
    d = Node("decode", tmp_root, "decode-tr",
             args=NODE_ARGS + ["--otlp-endpoint", rec.url, "--otlp-protocol", "http/protobuf"])
    p = Node("prefill", tmp_root, "prefill-tr", args=NODE_ARGS + otlp)
    gw = Gateway(p.addr, d.addr, tmp_root, "gateway-tr", extra=otlp)
    wait_until(lambda: healthy(gw), what="the traced set to pair")
    yield {"rec": rec, "gw": gw, "p": p, "d": d}
    gw.terminate()
    for n in (p, d):
        assert n.terminate() == 0, n.stderr_path.read_text()
    rec.close()


def ask(gw, traceparent=None, content=f"Repeat after me: {SECRET}"):
    h = {"traceparent": traceparent} if traceparent else {}
    body = {"model": MODEL, "temperature": 0, "max_tokens": 6,
            "messages": [{"role": "user", "content": content}]}
    r = requests.post(gw.url("/v1/chat/completions"), json=body, headers=h, timeout=120)
    assert r.status_code == 200, r.text
    return r


def by_name(spans, service):
    return {s["name"]: s for s in spans if s["service"] == service}


def test_one_request_is_one_trace_across_gateway_prefill_and_decode(traced):
    rec, gw, d = traced["rec"], traced["gw"], traced["d"]
    trace_id, parent = os.urandom(16).hex(), os.urandom(8).hex()
    ask(gw, f"00-{trace_id}-{parent}-01")
    # Gateway and prefill export JSON (decoded here); decode protobuf.
    spans = rec.trace(trace_id, lambda s: len(s) >= 3)
    g = by_name(spans, "isoserve-gateway")
    p = by_name(spans, "isoserve-prefill")
    assert set(g) == {"request"} and set(p) == {"queue", "prefill"}, spans
    root = g["request"]
    assert root["parentSpanId"].lower() == parent
    assert root["kind"] in (2, "SPAN_KIND_SERVER")
    req_id = root["attrs"]["isoserve.request_id"]
    for s in p.values():
        assert s["parentSpanId"].lower() == root["spanId"].lower()
        # The node knows the request by the gateway's id for it.
        assert s["attrs"]["isoserve.request_id"] == req_id
    q, pf = p["queue"], p["prefill"]
    assert int(q["endTimeUnixNano"]) <= int(pf["startTimeUnixNano"]) + 1
    assert int(root["startTimeUnixNano"]) <= int(q["startTimeUnixNano"])
    assert int(pf["endTimeUnixNano"]) <= int(root["endTimeUnixNano"])
    assert int(pf["attrs"]["isoserve.prompt_tokens"]) > 0
    # Decode's spans came as protobuf: the trace id's bytes and the gateway
    # span's id are in an export, as are its span names.
    tid, gid = bytes.fromhex(trace_id), bytes.fromhex(root["spanId"])

    names = (b"queue", b"transfer", b"decode")

    def decode_exported():
        # The node's batch exporter may send its spans in more than one
        # export: wait for all of them (bounded), then check.
        blob = b"".join(b for c, b in rec.raw() if "protobuf" in c and tid in b)
        return blob if all(n in blob for n in names) else None

    try:
        blob = wait_until(decode_exported, timeout=20, what="decode's protobuf spans")
    except AssertionError:
        blob = b"".join(b for c, b in rec.raw() if "protobuf" in c and tid in b)
        missing = [n for n in names if n not in blob]
        raise AssertionError(f"decode's spans {missing} not exported within 20 s") from None
    assert gid in blob
    assert b"isoserve-decode" in blob
    # Each node also logged its spans with the trace id.
    assert trace_id in d.stderr_path.read_text()
    # No prompt text in any export.
    assert not any(SECRET.encode() in b for _, b in rec.raw())


def test_without_a_usable_traceparent_the_gateway_starts_a_trace(traced):
    rec, gw = traced["rec"], traced["gw"]
    known = {s["traceId"] for s in rec.spans()}
    for header in (None, "00-not-a-trace", "00-" + "0" * 32 + "-" + "1" * 16 + "-01"):
        ask(gw, header, content=f"Say hello {header}")

        def fresh():
            new = [s for s in rec.spans() if s["traceId"] not in known]
            roots = [s for s in new if s["name"] == "request"]
            nodes = [s for s in new if s["service"] == "isoserve-prefill"]
            return (roots, nodes) if roots and len(nodes) >= 2 else None

        roots, nodes = wait_until(fresh, timeout=20, what="a new trace")
        assert len(roots) == 1 and not roots[0].get("parentSpanId")
        assert all(n["traceId"] == roots[0]["traceId"] and
                   n["parentSpanId"] == roots[0]["spanId"] for n in nodes)
        known |= {s["traceId"] for s in rec.spans()}


def test_an_unsampled_trace_is_logged_but_not_exported(traced):
    rec, gw, p = traced["rec"], traced["gw"], traced["p"]
    trace_id = os.urandom(16).hex()
    ask(gw, f"00-{trace_id}-{os.urandom(8).hex()}-00")
    # Logged on the node (its log has every span) ...
    wait_until(lambda: trace_id in p.stderr_path.read_text(), timeout=20,
               what="prefill to log the span")
    # ... but the caller asked not to record it: nothing is exported.
    import time
    time.sleep(1.5)
    assert not [s for s in rec.spans() if s["traceId"].lower() == trace_id]
    assert not any(bytes.fromhex(trace_id) in b for _, b in rec.raw())
    pool_free(p)
    pool_free(traced["d"])
