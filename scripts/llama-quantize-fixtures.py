#!/usr/bin/env python3
"""Regenerates crates/kernels/tests/fixtures/llama-quantize/: eight rows of
256 f32 weights of varied character (gaussian, heavy-tailed with an
outlier, all positive, all negative, partly zero, tiny, all zero) written as
one tensor of a tiny llama GGUF, quantised by llama.cpp's own
`llama-quantize --pure` to each type, and the raw blocks extracted. The
kernels crate's quantiser must reproduce them bit for bit
(tests/matmul.rs: quantiser_matches_llama_quantize).

Needs llama-quantize (scripts/build-llama-cpp) and the `gguf` package.
Usage: scripts/llama-quantize-fixtures.py
"""
import pathlib
import subprocess
import tempfile

import gguf
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "crates/kernels/tests/fixtures/llama-quantize"
QUANTIZE = ROOT / "target/peers/llama.cpp/build/bin/llama-quantize"
TYPES = ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"]
NAME = "blk.0.attn_q.weight"


def rows():
    rng = np.random.default_rng(20)
    out = [rng.standard_normal(256) * 0.02, rng.standard_t(3, 256) * 0.05,
           np.abs(rng.standard_normal(256)) * 0.1]
    r = rng.standard_normal(256) * 0.03
    r[:64] = 0
    out.append(r)
    out.append(rng.uniform(-1, 1, 256) * 1e-4)
    r = rng.standard_normal(256)
    r[17] = 40.0
    out.append(r)
    out.append(-np.abs(rng.standard_normal(256)) * 0.2)
    out.append(np.zeros(256))
    return np.stack(out).astype(np.float32)


def tensor(path):
    r = gguf.GGUFReader(str(path))
    return next(t for t in r.tensors if t.name == NAME)


def main():
    m = rows()
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "f32.gguf"
        w = gguf.GGUFWriter(str(src), "llama")
        w.add_context_length(64)
        w.add_embedding_length(256)
        w.add_block_count(1)
        w.add_feed_forward_length(256)
        w.add_head_count(4)
        w.add_head_count_kv(4)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_dimension_count(64)
        w.add_tensor(NAME, m)
        w.add_tensor("blk.0.attn_norm.weight", np.ones(256, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "input.f32").write_bytes(m.astype("<f4").tobytes())
        for t in TYPES:
            dst = pathlib.Path(tmp) / f"{t}.gguf"
            subprocess.run([str(QUANTIZE), "--pure", str(src), str(dst), t, "1"],
                           check=True, capture_output=True)
            q = tensor(dst)
            assert q.tensor_type.name == t, (t, q.tensor_type.name)
            (OUT / f"{t}.bin").write_bytes(np.asarray(q.data).tobytes())
            print(t, q.data.nbytes, "bytes")


if __name__ == "__main__":
    main()
