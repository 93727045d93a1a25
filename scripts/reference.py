#!/usr/bin/env python3
"""Independent reference forward pass for LLaMA-family GGUF models.

Reads the GGUF with the `gguf` package, dequantises every tensor with
`gguf.quants.dequantize`, and runs the forward pass in numpy (float64 for
accumulation), sharing no code with the Rust implementation. Used by the
Rust integration tests to check logits.

usage: reference.py MODEL.gguf IDS_JSON OUT_BIN [--q8-activations]
  IDS_JSON: a JSON list of token ids (one sequence).
  OUT_BIN:  written as little-endian f32, shape (len(ids), vocab).
  --q8-activations: round every matmul input to 8-bit blocks of 32
      (d = max|x|/127, q = round-half-even(x/d)), the scheme the engine and
      llama.cpp use, to separate kernel error from quantisation error.
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def field(reader, key):
    f = reader.fields[key]
    return f.contents()


def main():
    model, ids_path, out_path = sys.argv[1:4]
    q8 = "--q8-activations" in sys.argv[4:]
    r = GGUFReader(model)
    arch = field(r, "general.architecture")
    n_layer = int(field(r, f"{arch}.block_count"))
    n_head = int(field(r, f"{arch}.attention.head_count"))
    n_kv = int(field(r, f"{arch}.attention.head_count_kv"))
    dim = int(field(r, f"{arch}.embedding_length"))
    eps = float(field(r, f"{arch}.attention.layer_norm_rms_epsilon"))
    base = float(field(r, f"{arch}.rope.freq_base")) if f"{arch}.rope.freq_base" in r.fields else 10000.0
    head_dim = dim // n_head
    tensors = {t.name: t for t in r.tensors}

    def w(name):
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).astype(np.float64).reshape(
            [int(d) for d in reversed(t.shape)])

    ids = json.load(open(ids_path))
    n = len(ids)
    emb = w("token_embd.weight")
    x = emb[ids]

    def rmsnorm(v, g):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * g

    pos = np.arange(n)[:, None]
    inv = base ** (-np.arange(0, head_dim, 2) / head_dim)
    ang = pos * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(t):  # t: (n, heads, head_dim); GGUF llama: adjacent pairs
        a, b = t[..., 0::2], t[..., 1::2]
        c, s = cos[:, None, :], sin[:, None, :]
        out = np.empty_like(t)
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
        return out

    def qa(v):  # optional activation quantisation, per row, blocks of 32
        if not q8:
            return v
        b = v.reshape(v.shape[0], -1, 32).astype(np.float32)
        d = np.abs(b).max(axis=-1, keepdims=True) / 127.0
        inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1), 0).astype(np.float32)
        q = np.clip(np.round(b * inv), -127, 127)
        return (q * d).reshape(v.shape).astype(np.float64)

    mask = np.triu(np.full((n, n), -np.inf), 1)
    for l in range(n_layer):
        p = f"blk.{l}."
        h = rmsnorm(x, w(p + "attn_norm.weight"))
        q = rope((qa(h) @ w(p + "attn_q.weight").T).reshape(n, n_head, head_dim))
        k = rope((qa(h) @ w(p + "attn_k.weight").T).reshape(n, n_kv, head_dim))
        v = (qa(h) @ w(p + "attn_v.weight").T).reshape(n, n_kv, head_dim)
        att = np.empty((n, n_head, head_dim))
        for hd in range(n_head):
            kv = hd // (n_head // n_kv)
            s = q[:, hd, :] @ k[:, kv, :].T / np.sqrt(head_dim) + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            att[:, hd, :] = s @ v[:, kv, :]
        x = x + qa(att.reshape(n, dim)) @ w(p + "attn_output.weight").T
        h = rmsnorm(x, w(p + "ffn_norm.weight"))
        g = qa(h) @ w(p + "ffn_gate.weight").T
        u = qa(h) @ w(p + "ffn_up.weight").T
        x = x + qa((g / (1 + np.exp(-g))) * u) @ w(p + "ffn_down.weight").T
    x = rmsnorm(x, w("output_norm.weight"))
    out_w = w("output.weight") if "output.weight" in tensors else emb
    logits = qa(x) @ out_w.T
    logits.astype("<f4").tofile(out_path)


if __name__ == "__main__":
    main()
