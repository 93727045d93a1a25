#!/usr/bin/env python3
"""Independent reference forward pass for the GGUF architectures isoserve
runs: llama (incl. Llama 3's rope_freqs), qwen2 (Q/K/V biases), qwen3
(per-head Q/K RMSNorm) and gemma3 (embeddings × √dim, GeGLU, post-norms,
Q/K norm, sliding-window layers with their own rope base).

Reads the GGUF with the `gguf` package, dequantises every tensor with
`gguf.quants.dequantize`, and runs the forward pass in numpy (float64 for
accumulation), sharing no code with the Rust implementation. Used by the
Rust integration tests to check logits.

usage: reference.py MODEL.gguf IDS_JSON OUT_BIN [--q8-activations]
  IDS_JSON: a JSON list of token ids (one sequence).
  OUT_BIN:  written as little-endian f32, shape (len(ids), vocab).
  --q8-activations: round every matmul input to 8-bit blocks of 32
      (d = max|x|/127, q = round-half-even(x/d)), or of 256 when the weight
      is a K-quant (Q4_K/Q5_K/Q6_K), the scheme the engine and llama.cpp
      use, to separate kernel error from quantisation error.
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
    key_len = f"{arch}.attention.key_length"
    head_dim = int(field(r, key_len)) if key_len in r.fields else dim // n_head
    tensors = {t.name: t for t in r.tensors}
    gemma = arch == "gemma3"
    # Gemma 3: sliding-window layers (all but every pattern-th), rope base
    # 10000 there (llama.cpp's default for rope.freq_base_swa).
    sw_key = f"{arch}.attention.sliding_window"
    window = int(field(r, sw_key)) if gemma and sw_key in r.fields else None
    pat_key = f"{arch}.attention.sliding_window_pattern"
    pattern = int(field(r, pat_key)) if pat_key in r.fields else 6
    swa = [window is not None and (l % pattern < pattern - 1) for l in range(n_layer)]
    base_swa = float(field(r, f"{arch}.rope.freq_base_swa")) if f"{arch}.rope.freq_base_swa" in r.fields else 10000.0

    def w(name):
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).astype(np.float64).reshape(
            [int(d) for d in reversed(t.shape)])

    ids = json.load(open(ids_path))
    n = len(ids)
    emb = w("token_embd.weight")
    x = emb[ids]
    if gemma:
        x = x * np.float32(np.sqrt(dim))

    def rmsnorm(v, g):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * g

    pos = np.arange(n)[:, None]
    factors = w("rope_freqs.weight") if "rope_freqs.weight" in tensors else 1.0

    def tables(b):
        inv = b ** (-np.arange(0, head_dim, 2) / head_dim) / factors
        ang = pos * inv[None, :]
        return np.cos(ang), np.sin(ang)

    def rope(t, b):  # t: (n, heads, head_dim)
        cos, sin = tables(b)
        c, s = cos[:, None, :], sin[:, None, :]
        out = np.empty_like(t)
        if arch == "llama":  # GGUF llama: adjacent pairs
            a, bb = t[..., 0::2], t[..., 1::2]
            out[..., 0::2] = a * c - bb * s
            out[..., 1::2] = a * s + bb * c
        else:  # NEOX: halves
            h = head_dim // 2
            a, bb = t[..., :h], t[..., h:]
            out[..., :h] = a * c - bb * s
            out[..., h:] = a * s + bb * c
        return out

    def qa(v, name):  # optional activation quantisation of the input of `name`
        kind = tensors[name].tensor_type.name
        if not q8 or kind in ("F32", "F16"):  # float weights take f32 inputs
            return v
        k_quant = kind in ("Q4_K", "Q5_K", "Q6_K")
        b = v.reshape(v.shape[0], -1, 256 if k_quant else 32).astype(np.float32)
        d = np.abs(b).max(axis=-1, keepdims=True) / 127.0
        inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1), 0).astype(np.float32)
        q = np.clip(np.round(b * inv), -127, 127)
        return (q * d).reshape(v.shape).astype(np.float64)

    causal = np.triu(np.full((n, n), -np.inf), 1)
    # Sliding window: position i sees i - window < j <= i.
    local = causal + (np.tril(np.full((n, n), -np.inf), -window) if window else 0)

    def bias(name):
        return w(name) if name in tensors else 0.0

    def gelu(v):
        return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))

    for l in range(n_layer):
        p = f"blk.{l}."
        b = base_swa if swa[l] else base
        h = rmsnorm(x, w(p + "attn_norm.weight"))
        q = (qa(h, p + "attn_q.weight") @ w(p + "attn_q.weight").T + bias(p + "attn_q.bias")).reshape(n, n_head, head_dim)
        k = (qa(h, p + "attn_k.weight") @ w(p + "attn_k.weight").T + bias(p + "attn_k.bias")).reshape(n, n_kv, head_dim)
        v = (qa(h, p + "attn_v.weight") @ w(p + "attn_v.weight").T + bias(p + "attn_v.bias")).reshape(n, n_kv, head_dim)
        if p + "attn_q_norm.weight" in tensors:
            q = rmsnorm(q, w(p + "attn_q_norm.weight"))
            k = rmsnorm(k, w(p + "attn_k_norm.weight"))
        q, k = rope(q, b), rope(k, b)
        mask = local if swa[l] else causal
        att = np.empty((n, n_head, head_dim))
        for hd in range(n_head):
            kv = hd // (n_head // n_kv)
            s = q[:, hd, :] @ k[:, kv, :].T / np.sqrt(head_dim) + mask
            s = np.exp(s - s.max(axis=1, keepdims=True))
            s /= s.sum(axis=1, keepdims=True)
            att[:, hd, :] = s @ v[:, kv, :]
        o = qa(att.reshape(n, n_head * head_dim), p + "attn_output.weight") @ w(p + "attn_output.weight").T
        if gemma:
            o = rmsnorm(o, w(p + "post_attention_norm.weight"))
        x = x + o
        h = rmsnorm(x, w(p + "ffn_norm.weight"))
        g = qa(h, p + "ffn_gate.weight") @ w(p + "ffn_gate.weight").T
        u = qa(h, p + "ffn_up.weight") @ w(p + "ffn_up.weight").T
        act = gelu(g) if gemma else g / (1 + np.exp(-g))
        o = qa(act * u, p + "ffn_down.weight") @ w(p + "ffn_down.weight").T
        if gemma:
            o = rmsnorm(o, w(p + "post_ffw_norm.weight"))
        x = x + o
    x = rmsnorm(x, w("output_norm.weight"))
    out_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    logits = qa(x, out_name) @ w(out_name).T
    logits.astype("<f4").tofile(out_path)


if __name__ == "__main__":
    main()
