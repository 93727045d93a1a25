#!/usr/bin/env python3
"""Speculative decoding's workloads (issue 37), against any OpenAI-compatible
server: editing (a ~1,000-token document to correct, answer = the document
with small changes), quoting (a retrieval answer that quotes its source), no
match (free-form text), repeating (one tenant's batch job: 20 requests from
one template), the editing workload on 16 streams at once, and editing and
no match at depth (a ~2,300-token document in the prompt).

Single-stream decode speed is measured by the client from the stream: tokens
after the first over the time from the first to the last token (prefill is
not in it). Every request is greedy; the script prints one JSON line per
workload with the answer's hash, so two servers (or two modes of one) are
seen to answer the same.

    python3 scripts/specload.py --url http://127.0.0.1:8080 --workload editing
    python3 scripts/specload.py --url ... --workload editing --prediction
"""

import argparse
import concurrent.futures
import hashlib
import json
import pathlib
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[1]
TEXT = (REPO / "tests" / "data" / "perplexity.txt").read_text()

# Misspellings put into the editing document (the answer corrects them, or
# copies them: either way it repeats the document).
TYPOS = [("dangerous", "dangerus"), ("forgiving", "forgivng"), ("surface", "surfce"),
         ("season", "seasn"), ("happening", "happenning"), ("building", "bulding")]


def editing_doc(chars):
    doc = TEXT[:chars]
    doc = doc[: doc.rfind(". ") + 1]
    for right, wrong in TYPOS:
        doc = doc.replace(right, wrong, 1)
    return doc


def editing(chars=4600):
    doc = editing_doc(chars)
    # From the first paragraph on (a title line sends small models off
    # repeating it).
    doc = doc[doc.index("For most"):]
    prompt = "Repeat this text exactly, but with its spelling mistakes corrected:\n\n" + doc
    return prompt, doc, 1000


def quoting():
    """A retrieved source and an answer that quotes it, then explains."""
    source = [p for p in TEXT.split("\n\n") if len(p) > 300][1]
    prompt = "Quote the first two sentences of this text, then explain them.\n\n" + source
    return prompt, None, 400


def no_match():
    prompt = "Write a short story about a cat who lives in a lighthouse and dreams of the sea."
    return prompt, None, 400


def editing_deep():
    """The editing workload at depth: the whole ~2,300-token text to
    correct, up to 1,800 tokens of answer (contexts of 2.3k to 4.1k)."""
    prompt, doc, _ = editing(len(TEXT))
    return prompt, doc, 1800


def no_match_deep():
    """Free text after a long document (~2,300 tokens): no draft source
    matches, and every row's attention reads the whole context."""
    doc = editing_doc(len(TEXT))
    prompt = (doc + "\n\nForget the text above. Write a short story about a cat who lives "
              "in a lighthouse and dreams of the sea.")
    return prompt, None, 400


def repeating(i):
    """One batch job, twenty customers: the same request but for the
    details. The template is not in the prompt: only the suffix cache
    (earlier answers of the same tenant) can draft the answer."""
    names = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun",
             "Kai", "Lea", "Max", "Nia", "Oto", "Pia", "Rui", "Sol", "Tam", "Uma"]
    prompt = (f"Write a short order confirmation email to {names[i]} for order number "
              f"{1000 + 17 * i}: a blue lamp and a wool blanket, delivered on Tuesday.")
    return prompt, None, 200


def post_stream(url, body, key=None, timeout=600):
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    t0 = time.perf_counter()
    first = last = None
    pieces, usage, n = [], None, 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            if ch.get("usage"):
                usage = ch["usage"]
            for c in ch.get("choices", []):
                piece = (c.get("delta") or {}).get("content") or ""
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    n += 1
                    pieces.append(piece)
    text = "".join(pieces)
    tokens = usage["completion_tokens"] if usage else n
    details = (usage or {}).get("completion_tokens_details") or {}
    rejected = details.get("rejected_prediction_tokens") or 0
    # Rejected prediction tokens are billed in completion_tokens (OpenAI):
    # they are not output.
    out_tokens = tokens - rejected
    decode_s = (last - first) if first and last and last > first else float("nan")
    return {
        "ttft_s": (first - t0) if first else float("nan"),
        "total_s": time.perf_counter() - t0,
        "tokens": out_tokens,
        "decode_tok_s": (out_tokens - 1) / decode_s if decode_s == decode_s else float("nan"),
        "accepted_prediction": details.get("accepted_prediction_tokens") or 0,
        "rejected_prediction": rejected,
        "sha": hashlib.sha256(text.encode()).hexdigest()[:12],
        "text": text,
    }


def body_of(prompt, max_tokens, prediction=None, model=None):
    b = {"messages": [{"role": "user", "content": prompt}], "temperature": 0,
         "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        b["model"] = model
    if prediction is not None:
        b["prediction"] = {"type": "content", "content": prediction}
    return b


def summarize(path):
    """Medians per (model, configuration, workload) and the ratios the
    issue asks for, as the Markdown table BENCHMARKS.md holds."""
    import statistics
    rows = [json.loads(line) for line in open(path) if line.strip()]
    runs = {}
    for r in rows:
        model, label = r["label"].split(" ", 1)
        if r.get("prediction"):
            label += "+prediction"
        key = (model, r["workload"], label)
        if r["workload"] == "editing-16":
            v = r["aggregate_tok_s"]
        elif r["workload"] == "repeating":
            v = r["decode_tok_s_tenth"]
        else:
            v = r["decode_tok_s"]
        runs.setdefault(key, []).append((v, r.get("sha")))
    med = {k: statistics.median(v for v, _ in vs) for k, vs in runs.items()}
    same = {k: len({json.dumps(s) for _, s in vs}) == 1 for k, vs in runs.items()}
    print("| model | workload | isoserve off | prompt lookup | × | prediction | × | "
          "llama-server | its lookup | × | ours / theirs (lookup) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    models = sorted({k[0] for k in med})
    for m in models:
        for w in ["editing", "quoting", "no-match", "editing-16", "editing-deep",
                  "no-match-deep"]:
            g = lambda lab: med.get((m, w, lab))
            off, ng, pr = g("off"), g("ngram"), g("off+prediction")
            lo, ln = g("llama-off"), g("llama-ngram")
            if off is None:
                continue
            f = lambda x: f"{x:.0f}" if x else "–"
            r = lambda a, b: f"{a / b:.2f}" if a and b else "–"
            print(f"| {m} | {w} | {f(off)} | {f(ng)} | {r(ng, off)} | {f(pr)} | {r(pr, off)} | "
                  f"{f(lo)} | {f(ln)} | {r(ln, lo)} | {r(ng, ln)} |")
    print("\n| model | repeating: request | isoserve off | prompt lookup | suffix cache | × "
          "| llama-server | its lookup |")
    print("|---|---|---|---|---|---|---|---|")
    for m in models:
        for which, field in (("1st", "decode_tok_s_first"), ("10th", "decode_tok_s_tenth"),
                             ("11th–20th", "decode_tok_s_last10")):
            v = {}
            for r in rows:
                model, label = r["label"].split(" ", 1)
                if model == m and r["workload"] == "repeating":
                    v.setdefault(label, []).append(r[field])
            g = lambda lab: statistics.median(v[lab]) if lab in v else None
            f = lambda x: f"{x:.0f}" if x else "–"
            off, suf = g("off"), g("suffix")
            ratio = f"{suf / off:.2f}" if off and suf else "–"
            print(f"| {m} | {which} | {f(off)} | {f(g('ngram'))} | {f(suf)} | {ratio} | "
                  f"{f(g('llama-off'))} | {f(g('llama-ngram'))} |")
    print("\n| model | workload | isoserve off | draft model | × | llama-server | with the draft "
          "| × |")
    print("|---|---|---|---|---|---|---|---|")
    for m in models:
        for w in ["editing", "quoting", "no-match", "editing-deep", "no-match-deep"]:
            g = lambda lab: med.get((m, w, lab))
            off, dr, lo, ld = g("off"), g("draft"), g("llama-off"), g("llama-draft")
            if off is None or dr is None:
                continue
            f = lambda x: f"{x:.0f}" if x else "–"
            r = lambda a, b: f"{a / b:.2f}" if a and b else "–"
            print(f"| {m} | {w} | {f(off)} | {f(dr)} | {r(dr, off)} | {f(lo)} | {f(ld)} | "
                  f"{r(ld, lo)} |")
    for m in models:
        answers = {k[2]: {json.dumps(s) for _, s in vs} for k, vs in runs.items()
                   if k[0] == m and k[1] == "editing" and not k[2].startswith("llama")}
        print(f"\n{m}: isoserve's editing answers, by configuration: "
              + ", ".join(f"{lab} {sorted(a)}" for lab, a in sorted(answers.items())))
    if not all(same.values()):
        print("\nconfigurations whose answer changed between repetitions:",
              [k for k, v in same.items() if not v])


def main():
    if len(__import__("sys").argv) == 3 and __import__("sys").argv[1] == "--summarize":
        summarize(__import__("sys").argv[2])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--workload", required=True,
                    choices=["editing", "quoting", "no-match", "repeating", "editing-16",
                             "editing-deep", "no-match-deep"])
    ap.add_argument("--prediction", action="store_true",
                    help="send the editing document as `prediction` (Predicted Outputs)")
    ap.add_argument("--runs", type=int, default=2, help="runs of a single-stream workload "
                    "(the best is kept; the first also warms the prefix cache)")
    ap.add_argument("--key", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    out = {"label": a.label, "workload": a.workload, "prediction": a.prediction}
    if a.workload == "repeating":
        rates = []
        for i in range(20):
            p, _, mt = repeating(i)
            rates.append(post_stream(a.url, body_of(p, mt, model=a.model), a.key))
        out["decode_tok_s_each"] = [round(r["decode_tok_s"], 1) for r in rates]
        out["decode_tok_s_first"] = rates[0]["decode_tok_s"]
        out["decode_tok_s_tenth"] = rates[9]["decode_tok_s"]
        out["decode_tok_s_last10"] = sum(r["decode_tok_s"] for r in rates[10:]) / 10
        out["sha"] = hashlib.sha256("".join(r["sha"] for r in rates).encode()).hexdigest()[:12]
    elif a.workload == "editing-16":
        p, doc, mt = editing()
        body = body_of(p, mt, doc if a.prediction else None, a.model)
        post_stream(a.url, body, a.key)  # warm the prefix cache
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(16) as ex:
            rs = list(ex.map(lambda _: post_stream(a.url, body, a.key), range(16)))
        wall = time.perf_counter() - t0
        out["aggregate_tok_s"] = sum(r["tokens"] for r in rs) / wall
        out["wall_s"] = wall
        out["tokens"] = sum(r["tokens"] for r in rs)
        out["sha"] = sorted({r["sha"] for r in rs})
    else:
        p, doc, mt = {"editing": editing, "quoting": quoting, "no-match": no_match,
                      "editing-deep": editing_deep,
                      "no-match-deep": no_match_deep}[a.workload]()
        body = body_of(p, mt, doc if a.prediction else None, a.model)
        best = None
        for _ in range(a.runs):
            r = post_stream(a.url, body, a.key)
            if best is None or r["decode_tok_s"] > best["decode_tok_s"]:
                best = r
        out.update({k: v for k, v in best.items() if k != "text"})
        out["answer_head"] = best["text"][:80]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
