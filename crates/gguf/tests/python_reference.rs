//! Cross-checks against the `gguf` Python package (the llama.cpp project's
//! reference reader/quantiser). These tests FAIL, never skip, when python3,
//! numpy, gguf or the real model file are missing.

mod common;

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use common::{model_path, TempPath};
use gguf::write::quantize;
use gguf::{dequantize_row, GgmlType, GgufFile, Value};

fn python(script: &str, args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run python3 ({e}): these reference tests need python3 with numpy and gguf (pip install gguf numpy)")
        });
    assert!(
        out.status.success(),
        "python3 reference script failed (needs numpy and the gguf package: pip install gguf numpy):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("python output is UTF-8")
}

fn read_f32s(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(bytes.len() % 4, 0);
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

const DEQUANT_SCRIPT: &str = r#"
import sys, numpy as np, gguf
from gguf import quants
path, out = sys.argv[1], sys.argv[2]
r = gguf.GGUFReader(path)
tensors = {t.name: t for t in r.tensors}
chunks = []
for spec in sys.argv[3:]:
    name, rows = spec.split(':')
    t = tensors[name]
    raw = np.asarray(t.data).view(np.uint8).reshape(-1)
    bs, ts = gguf.GGML_QUANT_SIZES[t.tensor_type]
    rb = int(t.shape[0]) // bs * ts
    for row in map(int, rows.split(',')):
        chunks.append(np.asarray(quants.dequantize(raw[row*rb:(row+1)*rb], t.tensor_type), dtype=np.float32).reshape(-1))
np.concatenate(chunks).astype('<f4').tofile(out)
"#;

#[test]
fn dequantize_matches_python_on_real_tensors() {
    let model = model_path();
    let f = GgufFile::open(&model).unwrap();
    let specs: &[(&str, &[u64])] = &[
        ("blk.0.attn_q.weight", &[0, 1, 2, 3, 288, 575]),
        ("blk.29.ffn_down.weight", &[0, 575]),
        ("blk.7.attn_k.weight", &[0, 191]),
        ("token_embd.weight", &[0, 1, 2, 504, 19556, 49151]),
        ("blk.0.attn_norm.weight", &[0]),
        ("output_norm.weight", &[0]),
    ];
    let args: Vec<String> = specs
        .iter()
        .map(|(n, rows)| {
            let rows: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
            format!("{n}:{}", rows.join(","))
        })
        .collect();
    let out = TempPath::new("dequant-ref.f32");
    let mut argv = vec![model.to_str().unwrap(), out.0.to_str().unwrap()];
    argv.extend(args.iter().map(String::as_str));
    python(DEQUANT_SCRIPT, &argv);
    let reference = read_f32s(&out.0);

    let mut ours = Vec::new();
    let mut types = Vec::new();
    for (name, rows) in specs {
        let v = f.tensor(name).unwrap();
        types.push(v.ggml_type());
        for &r in *rows {
            let mut row = vec![0.0f32; v.cols() as usize];
            v.dequantize_row(r, &mut row).unwrap();
            ours.extend(row);
        }
    }
    assert!(
        types.contains(&GgmlType::Q4_1)
            && types.contains(&GgmlType::Q8_0)
            && types.contains(&GgmlType::F32)
    );
    assert_eq!(ours.len(), reference.len());
    for (i, (a, b)) in ours.iter().zip(&reference).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "element {i}: ours {a} vs python {b}"
        );
    }
}

const TENSORS_SCRIPT: &str = r#"
import sys, gguf
r = gguf.GGUFReader(sys.argv[1])
print(len(r.tensors), r.data_offset)
for t in r.tensors:
    print(t.name, int(t.tensor_type), ','.join(str(int(d)) for d in t.shape), int(t.data_offset), int(t.n_bytes))
"#;

#[test]
fn tensor_table_matches_python() {
    let model = model_path();
    let f = GgufFile::open(&model).unwrap();
    let mut ours = format!("{} {}\n", f.tensors().len(), f.data_offset());
    for t in f.tensors() {
        let dims: Vec<String> = t.dims.iter().map(|d| d.to_string()).collect();
        writeln!(
            ours,
            "{} {} {} {} {}",
            t.name,
            t.ggml_type.type_id(),
            dims.join(","),
            f.data_offset() + t.offset,
            t.byte_size()
        )
        .unwrap();
        // The zero-copy view is exactly that range.
        let v = f.tensor(&t.name).unwrap();
        assert_eq!(v.bytes().len() as u64, t.byte_size());
    }
    let reference = python(TENSORS_SCRIPT, &[model.to_str().unwrap()]);
    assert_eq!(ours, reference);
    assert_eq!(f.tensors().len(), 272);
    let count = |t: GgmlType| f.tensors().iter().filter(|i| i.ggml_type == t).count();
    assert_eq!(
        (
            count(GgmlType::Q4_1),
            count(GgmlType::F32),
            count(GgmlType::Q8_0)
        ),
        (210, 61, 1)
    );
}

const METADATA_SCRIPT: &str = r#"
import sys, json, struct, gguf
from gguf import GGUFValueType as T
r = gguf.GGUFReader(sys.argv[1])
def conv(v, t):
    if t == T.FLOAT32: return struct.unpack('<I', struct.pack('<f', v))[0]
    if t == T.FLOAT64: return struct.unpack('<Q', struct.pack('<d', v))[0]
    return v
for k, f in r.fields.items():
    if k.startswith('GGUF.'): continue
    v = f.contents()
    if f.types[0] == T.ARRAY:
        v = [conv(x, f.types[-1]) for x in v]
    else:
        v = conv(v, f.types[0])
    sys.stdout.write(k + '\t' + json.dumps(v, ensure_ascii=True) + '\n')
"#;

/// JSON exactly as Python's `json.dumps(..., ensure_ascii=True)` writes it,
/// floats as their IEEE bits.
fn py_json(v: &Value, out: &mut String) {
    match v {
        Value::F32(x) => write!(out, "{}", x.to_bits()).unwrap(),
        Value::F64(x) => write!(out, "{}", x.to_bits()).unwrap(),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::String(s) => {
            out.push('"');
            for c in s.chars() {
                match c {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    '\u{8}' => out.push_str("\\b"),
                    '\u{c}' => out.push_str("\\f"),
                    c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                        let mut buf = [0u16; 2];
                        for u in c.encode_utf16(&mut buf) {
                            write!(out, "\\u{u:04x}").unwrap();
                        }
                    }
                    c => out.push(c),
                }
            }
            out.push('"');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_json(x, out);
            }
            out.push(']');
        }
        other => write!(out, "{}", other.as_i128().unwrap()).unwrap(),
    }
}

#[test]
fn metadata_matches_python() {
    let model = model_path();
    let f = GgufFile::open(&model).unwrap();
    let reference = python(METADATA_SCRIPT, &[model.to_str().unwrap()]);
    let mut n = 0;
    for line in reference.lines() {
        let (key, json) = line.split_once('\t').unwrap();
        let v = f.get(key).unwrap_or_else(|| panic!("key {key} missing"));
        let mut ours = String::new();
        py_json(v, &mut ours);
        // DEL (0x7f) is plain ASCII for Python; match that.
        let ours = ours.replace("\\u007f", "\u{7f}");
        assert!(
            ours == json,
            "key {key}: ours {} vs python {}",
            &ours[..ours.len().min(200)],
            &json[..json.len().min(200)]
        );
        n += 1;
    }
    assert_eq!(n, f.metadata().len());
    assert_eq!(n, 33);
    assert_eq!(
        f.get_string_array("tokenizer.ggml.tokens").unwrap().len(),
        49152
    );
    assert_eq!(
        f.get_string_array("tokenizer.ggml.merges").unwrap().len(),
        48900
    );
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
}

const QUANT_SCRIPT: &str = r#"
import sys, numpy as np, gguf
from gguf import quants
from gguf import GGMLQuantizationType as Q
x = np.fromfile(sys.argv[1], dtype='<f4').reshape(-1, 64)
with open(sys.argv[2], 'wb') as out:
    for name in sys.argv[3:]:
        q = np.asarray(quants.quantize(x, Q[name]))
        b = q.view(np.uint8).reshape(-1)
        out.write(b.tobytes())
        out.write(np.asarray(quants.dequantize(b.reshape(x.shape[0], -1), Q[name]), dtype='<f4').reshape(-1).tobytes())
"#;

#[test]
fn quantizers_match_python() {
    // Deterministic test data: a mix of scales, signs, constant blocks, zeros.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut uniform = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let mut x = Vec::new();
    for row in 0..64 {
        let scale = [1e-3f32, 0.02, 1.0, 30.0, 1000.0][row % 5];
        for col in 0..64 {
            let v = match row {
                0 => 0.0,
                1 => 0.75,
                2 => -2.5,
                3 => {
                    if col % 2 == 0 {
                        1.0
                    } else {
                        -1.0
                    }
                }
                4 => col as f32 - 32.0,
                _ => uniform() * scale,
            };
            x.push(v);
        }
    }
    let input = TempPath::new("quant-in.f32");
    let output = TempPath::new("quant-out.bin");
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&input.0, bytes).unwrap();
    let types = [
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
    ];
    let names: Vec<&str> = types.iter().map(|t| t.name()).collect();
    let mut argv = vec![input.0.to_str().unwrap(), output.0.to_str().unwrap()];
    argv.extend(names.iter().copied());
    python(QUANT_SCRIPT, &argv);
    let reference = std::fs::read(&output.0).unwrap();

    let mut pos = 0;
    for t in types {
        let ours = quantize(t, &x).unwrap();
        let theirs = &reference[pos..pos + ours.len()];
        pos += ours.len();
        if let Some(i) = ours.iter().zip(theirs).position(|(a, b)| a != b) {
            panic!("{t}: quantised bytes differ first at byte {i}");
        }
        let theirs_deq: Vec<f32> = reference[pos..pos + x.len() * 4]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        pos += x.len() * 4;
        let mut ours_deq = vec![0.0f32; x.len()];
        dequantize_row(t, &ours, &mut ours_deq).unwrap();
        for (i, (a, b)) in ours_deq.iter().zip(&theirs_deq).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{t}: dequantised element {i}: {a} vs {b}"
            );
        }
    }
    assert_eq!(pos, reference.len());
}
