//! The K-quant reference against an independent one: the Python `gguf`
//! package's numpy dequantisers (a test dependency, scripts/requirements.txt),
//! on random blocks with finite scales. Bit for bit. Fails (never skips)
//! without python3 and gguf.

use std::io::Write;
use std::process::{Command, Stdio};

use gguf::kquants::{
    dequantize_q4_k, dequantize_q5_k, dequantize_q6_k, Q4_K_BLOCK_BYTES, Q5_K_BLOCK_BYTES,
    Q6_K_BLOCK_BYTES, QK_K,
};

const SCRIPT: &str = r#"
import sys, numpy as np
from gguf import quants, GGMLQuantizationType as T
qtype = getattr(T, sys.argv[1])
raw = np.frombuffer(sys.stdin.buffer.read(), dtype=np.uint8)
out = quants.dequantize(raw, qtype).astype(np.float32)
sys.stdout.buffer.write(out.tobytes())
"#;

fn python(qtype: &str, bytes: &[u8]) -> Vec<f32> {
    let mut child = Command::new("python3")
        .args(["-c", SCRIPT, qtype])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 (scripts/test installs the gguf package)");
    child.stdin.take().unwrap().write_all(bytes).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "python gguf failed for {qtype}");
    out.stdout
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// xorshift: reproducible bytes without a dependency.
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 24) as u8
        })
        .collect()
}

/// A finite f16 of moderate size (no NaN or infinity to compare).
fn set_f16(b: &mut [u8], at: usize, seed: u8) {
    let v = half::f16::from_f32((f32::from(seed) - 128.0) / 977.0);
    b[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
}

fn check(qtype: &str, block_bytes: usize, fix: impl Fn(&mut [u8]), ours: fn(&[u8], &mut [f32])) {
    let blocks = 64;
    let mut raw = bytes(block_bytes as u64, blocks * block_bytes);
    for b in raw.chunks_exact_mut(block_bytes) {
        fix(b);
    }
    let want = python(qtype, &raw);
    assert_eq!(want.len(), blocks * QK_K);
    let mut got = vec![0f32; blocks * QK_K];
    for (b, o) in raw
        .chunks_exact(block_bytes)
        .zip(got.chunks_exact_mut(QK_K))
    {
        ours(b, o);
    }
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{qtype} weight {i}: ours {g}, gguf {w}"
        );
    }
}

#[test]
fn q4_k_matches_the_python_gguf_reference() {
    check(
        "Q4_K",
        Q4_K_BLOCK_BYTES,
        |b| {
            let (s0, s1) = (b[0], b[1]);
            set_f16(b, 0, s0);
            set_f16(b, 2, s1);
        },
        dequantize_q4_k,
    );
}

#[test]
fn q5_k_matches_the_python_gguf_reference() {
    check(
        "Q5_K",
        Q5_K_BLOCK_BYTES,
        |b| {
            let (s0, s1) = (b[0], b[1]);
            set_f16(b, 0, s0);
            set_f16(b, 2, s1);
        },
        dequantize_q5_k,
    );
}

#[test]
fn q6_k_matches_the_python_gguf_reference() {
    check(
        "Q6_K",
        Q6_K_BLOCK_BYTES,
        |b| {
            let s = b[208];
            set_f16(b, 208, s);
        },
        dequantize_q6_k,
    );
}
