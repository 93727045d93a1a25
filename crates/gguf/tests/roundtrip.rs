mod common;

use common::TempPath;
use gguf::write::{quantize, GgufWriter};
use gguf::{dequantize_row, type_block_size, GgmlType, GgufError, GgufFile, Value};
use testkit::synthetic::{
    synthetic_llama_writer, synthetic_vocab, write_synthetic_llama, SyntheticConfig,
    SMOLLM2_CHAT_TEMPLATE,
};

fn all_values() -> Vec<(&'static str, Value)> {
    vec![
        ("t.u8", Value::U8(250)),
        ("t.i8", Value::I8(-100)),
        ("t.u16", Value::U16(65_000)),
        ("t.i16", Value::I16(-30_000)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.u64", Value::U64(u64::MAX)),
        ("t.i64", Value::I64(i64::MIN)),
        ("t.f32", Value::F32(-1.5e-7)),
        ("t.f64", Value::F64(std::f64::consts::PI)),
        ("t.bool_t", Value::Bool(true)),
        ("t.bool_f", Value::Bool(false)),
        ("t.string", Value::String("héllo, wörld 🦀\n\0tab\t".into())),
        ("t.empty_string", Value::String(String::new())),
        ("t.empty_array", Value::Array(vec![])),
        ("t.u8_array", Value::from(vec![1u8, 2, 3])),
        ("t.i32_array", Value::from(vec![-1i32, 0, 7])),
        ("t.f64_array", Value::from(vec![0.5f64, -2.25])),
        ("t.string_array", Value::from(vec!["a", "", "ĠHello"])),
        ("t.bool_array", Value::from(vec![true, false])),
        (
            "t.nested",
            Value::Array(vec![
                Value::from(vec![1u16, 2]),
                Value::from(vec!["x".to_string()]),
                Value::Array(vec![Value::from(vec![9i64])]),
            ]),
        ),
    ]
}

#[test]
fn metadata_round_trip_every_value_type() {
    for version in [2u32, 3] {
        let mut w = GgufWriter::new();
        w.set_version(version);
        for (k, v) in all_values() {
            w.add_kv(k, v);
        }
        let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
        assert_eq!(f.version(), version);
        assert_eq!(f.metadata().len(), all_values().len());
        for (k, v) in all_values() {
            assert_eq!(f.get(k), Some(&v), "key {k}");
        }
        assert!(f.tensors().is_empty());
    }
}

#[test]
fn typed_getters() {
    let mut w = GgufWriter::new();
    for (k, v) in all_values() {
        w.add_kv(k, v);
    }
    w.add_kv("t.u64_small", Value::U64(12));
    w.add_kv("t.i8_neg", Value::I8(-1));
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    // get_u32 accepts any integer type whose value fits.
    assert_eq!(f.get_u32("t.u8").unwrap(), 250);
    assert_eq!(f.get_u32("t.u16").unwrap(), 65_000);
    assert_eq!(f.get_u32("t.u64_small").unwrap(), 12);
    assert!(matches!(
        f.get_u32("t.i8_neg"),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        f.get_u32("t.u64"),
        Err(GgufError::WrongType { .. })
    ));
    assert_eq!(f.get_u64("t.u64").unwrap(), u64::MAX);
    assert_eq!(f.get_i64("t.i64").unwrap(), i64::MIN);
    assert_eq!(f.get_i32("t.i8").unwrap(), -100);
    assert_eq!(f.get_f32("t.f32").unwrap(), -1.5e-7);
    assert_eq!(f.get_f64("t.f64").unwrap(), std::f64::consts::PI);
    assert!(f.get_bool("t.bool_t").unwrap());
    assert_eq!(f.get_str("t.string").unwrap(), "héllo, wörld 🦀\n\0tab\t");
    assert_eq!(
        f.get_string_array("t.string_array").unwrap(),
        vec!["a", "", "ĠHello"]
    );
    assert_eq!(f.get_i32_array("t.i32_array").unwrap(), vec![-1, 0, 7]);
    assert_eq!(f.get_i32_array("t.u8_array").unwrap(), vec![1, 2, 3]);
    assert_eq!(f.get_u32_array("t.u8_array").unwrap(), vec![1, 2, 3]);
    assert_eq!(f.get_f32_array("t.f64_array").unwrap(), vec![0.5, -2.25]);
    assert!(f.get_string_array("t.empty_array").unwrap().is_empty());

    match f.get_u32("no.such.key") {
        Err(GgufError::MissingKey(k)) => assert_eq!(k, "no.such.key"),
        other => panic!("expected MissingKey, got {other:?}"),
    }
    match f.get_str("t.u32") {
        Err(e @ GgufError::WrongType { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("t.u32") && msg.contains("string"), "{msg}");
        }
        other => panic!("expected WrongType, got {other:?}"),
    }
    assert!(matches!(
        f.get_string_array("t.i32_array"),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        f.get_i32_array("t.string_array"),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        f.get_f32("t.u32"),
        Err(GgufError::WrongType { .. })
    ));
}

#[test]
fn tensors_round_trip_all_types_and_alignments() {
    let cols = 64usize;
    let rows = 3usize;
    let values: Vec<f32> = (0..cols * rows)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
        .collect();
    for align in [None, Some(1u32), Some(64), Some(256)] {
        let mut w = GgufWriter::new();
        if let Some(a) = align {
            w.set_alignment(a);
        }
        w.add_kv("general.architecture", "test");
        let mut expected = Vec::new();
        for t in WRITER_TYPES {
            let name = format!("w.{t}");
            let bytes = quantize(t, &values).unwrap();
            w.add_tensor(&name, &[cols as u64, rows as u64], t, bytes.clone())
                .unwrap();
            expected.push((name, t, bytes));
        }
        // A 1-D and a 3-D tensor.
        w.add_tensor_f32("v.1d", &[32], GgmlType::F32, &values[..32])
            .unwrap();
        w.add_tensor_f32("v.3d", &[32, 2, 3], GgmlType::Q8_0, &values[..192])
            .unwrap();

        let path = TempPath::new(&format!("tensors-{align:?}.gguf"));
        w.write(&path.0).unwrap();
        let f = GgufFile::open(&path.0).unwrap();
        assert_eq!(f.alignment(), u64::from(align.unwrap_or(32)));
        assert_eq!(f.data_offset() % f.alignment(), 0);
        assert_eq!(f.tensors().len(), WRITER_TYPES.len() + 2);
        for (name, t, bytes) in &expected {
            let v = f.tensor(name).unwrap();
            assert_eq!(v.ggml_type(), *t);
            assert_eq!(v.bytes(), &bytes[..], "{name}");
            assert_eq!(v.cols(), cols as u64);
            assert_eq!(v.rows(), rows as u64);
            assert_eq!(v.dims(), &[cols as u64, rows as u64]);
            assert_eq!(v.row_bytes(1).unwrap().len() as u64, v.row_byte_size());
            assert!(v.row_bytes(rows as u64).is_err());
            // Dequantising the whole tensor equals dequantising row by row.
            let all = v.dequantize().unwrap();
            let mut row = vec![0.0f32; cols];
            for r in 0..rows {
                v.dequantize_row(r as u64, &mut row).unwrap();
                assert_eq!(&all[r * cols..(r + 1) * cols], &row[..]);
            }
            // And is close to the input.
            let tol = match t {
                GgmlType::F32 => 0.0,
                GgmlType::F16 => 2e-3,
                GgmlType::Q8_0 => 0.03,
                GgmlType::Q4_0 | GgmlType::Q4_1 => 0.6,
                _ => unreachable!("not a writer type"),
            };
            for (a, b) in all.iter().zip(&values) {
                assert!((a - b).abs() <= tol, "{t}: {a} vs {b}");
            }
        }
        let v1 = f.tensor("v.1d").unwrap();
        assert_eq!((v1.rows(), v1.cols()), (1, 32));
        let v3 = f.tensor("v.3d").unwrap();
        assert_eq!((v3.rows(), v3.cols(), v3.n_elements()), (6, 32, 192));
        assert!(matches!(
            f.tensor("nope"),
            Err(GgufError::TensorNotFound(_))
        ));
    }
}

/// The types the writer quantises itself (the others' quantisers are
/// `kernels::quantize_row`; `quantize` refuses them).
const WRITER_TYPES: [GgmlType; 5] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
];

#[test]
fn the_writer_names_the_types_it_does_not_quantise() {
    for t in GgmlType::ALL
        .into_iter()
        .filter(|t| !WRITER_TYPES.contains(t))
    {
        let e = quantize(t, &[0.0; 256]).unwrap_err().to_string();
        assert!(
            e.contains(t.name()) && e.contains("kernels::quantize_row"),
            "{e}"
        );
    }
}

#[test]
fn block_sizes() {
    assert_eq!(type_block_size(GgmlType::F32), (1, 4));
    assert_eq!(type_block_size(GgmlType::F16), (1, 2));
    assert_eq!(type_block_size(GgmlType::Q4_0), (32, 18));
    assert_eq!(type_block_size(GgmlType::Q4_1), (32, 20));
    assert_eq!(type_block_size(GgmlType::Q8_0), (32, 34));
    assert_eq!(type_block_size(GgmlType::Q5_0), (32, 22));
    assert_eq!(type_block_size(GgmlType::Q5_1), (32, 24));
    assert_eq!(type_block_size(GgmlType::Q4_K), (256, 144));
    assert_eq!(type_block_size(GgmlType::Q5_K), (256, 176));
    assert_eq!(type_block_size(GgmlType::Q6_K), (256, 210));
    for t in GgmlType::ALL {
        assert_eq!(GgmlType::from_type_id(t.type_id()), Some(t));
        assert_eq!(gguf::ggml_type_name(t.type_id()), Some(t.name()));
    }
    assert_eq!(gguf::ggml_type_name(12), Some("Q4_K"));
}

#[test]
fn dequantize_known_blocks() {
    // Q4_1: d = 0.5, m = -1, nibbles: low = j % 16, high = 15 - j % 16.
    let mut b = Vec::new();
    b.extend_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
    b.extend_from_slice(&half::f16::from_f32(-1.0).to_bits().to_le_bytes());
    for j in 0..16u8 {
        b.push(j | ((15 - j) << 4));
    }
    let mut out = [0.0f32; 32];
    dequantize_row(GgmlType::Q4_1, &b, &mut out).unwrap();
    for j in 0..16 {
        assert_eq!(out[j], j as f32 * 0.5 - 1.0);
        assert_eq!(out[j + 16], (15 - j) as f32 * 0.5 - 1.0);
    }
    // Q4_0: d = 2, weights (q - 8) * d.
    let mut b = half::f16::from_f32(2.0).to_bits().to_le_bytes().to_vec();
    for j in 0..16u8 {
        b.push(j | (j << 4));
    }
    dequantize_row(GgmlType::Q4_0, &b, &mut out).unwrap();
    for j in 0..16 {
        assert_eq!(out[j], (j as f32 - 8.0) * 2.0);
        assert_eq!(out[j + 16], out[j]);
    }
    // Q8_0: d = 0.25, q = j - 16.
    let mut b = half::f16::from_f32(0.25).to_bits().to_le_bytes().to_vec();
    for j in 0..32i32 {
        b.push((j - 16) as i8 as u8);
    }
    dequantize_row(GgmlType::Q8_0, &b, &mut out).unwrap();
    for (j, o) in out.iter().enumerate() {
        assert_eq!(*o, (j as f32 - 16.0) * 0.25);
    }
    // Size mismatches are errors, not panics.
    assert!(matches!(
        dequantize_row(GgmlType::Q8_0, &b[..33], &mut out),
        Err(GgufError::SizeMismatch { .. })
    ));
    assert!(matches!(
        dequantize_row(GgmlType::Q8_0, &b, &mut out[..31]),
        Err(GgufError::SizeMismatch { .. })
    ));
    assert!(gguf::write::quantize_row_q4_1(&[0.0; 31]).is_err());
}

#[test]
fn quantize_edge_cases() {
    // All-zero and constant blocks quantise without NaNs.
    for x in [[0.0f32; 32], [3.0f32; 32], [-3.0f32; 32]] {
        for t in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            let q = quantize(t, &x).unwrap();
            assert_eq!(q.len(), type_block_size(t).1);
            let mut out = [0.0f32; 32];
            dequantize_row(t, &q, &mut out).unwrap();
            for (a, b) in out.iter().zip(&x) {
                assert!((a - b).abs() <= 0.5, "{t}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn synthetic_llama_round_trip() {
    let cfg = SyntheticConfig::default();
    let path = TempPath::new("synthetic.gguf");
    write_synthetic_llama(&path.0, cfg.clone(), 42).unwrap();
    let f = GgufFile::open(&path.0).unwrap();
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 2);
    assert_eq!(f.get_u32("llama.embedding_length").unwrap(), 64);
    assert_eq!(f.get_u32("llama.feed_forward_length").unwrap(), 128);
    assert_eq!(f.get_u32("llama.attention.head_count").unwrap(), 4);
    assert_eq!(f.get_u32("llama.attention.head_count_kv").unwrap(), 2);
    assert_eq!(f.get_u32("llama.rope.dimension_count").unwrap(), 16);
    assert_eq!(f.get_u32("llama.context_length").unwrap(), 256);
    assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), 10000.0);
    assert_eq!(
        f.get_f32("llama.attention.layer_norm_rms_epsilon").unwrap(),
        1e-5
    );
    let (tokens, types, merges) = synthetic_vocab();
    assert_eq!(
        f.get_u32("llama.vocab_size").unwrap() as usize,
        tokens.len()
    );
    assert_eq!(f.get_string_array("tokenizer.ggml.tokens").unwrap(), tokens);
    assert_eq!(f.get_i32_array("tokenizer.ggml.token_type").unwrap(), types);
    assert_eq!(f.get_string_array("tokenizer.ggml.merges").unwrap(), merges);
    assert_eq!(
        &tokens[..3],
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    );
    assert_eq!(tokens[3 + b' ' as usize], "Ġ");
    assert_eq!(tokens[3 + b'\n' as usize], "Ċ");
    assert_eq!(tokens[3 + b'A' as usize], "A");
    assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(f.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    assert_eq!(
        f.get_str("tokenizer.chat_template").unwrap(),
        SMOLLM2_CHAT_TEMPLATE
    );
    assert_eq!(f.get_u32("tokenizer.ggml.bos_token_id").unwrap(), 1);
    assert_eq!(f.get_u32("tokenizer.ggml.eos_token_id").unwrap(), 2);

    // Same tensor names, order and types as the real file.
    let mut names = vec![(
        "token_embd.weight".to_string(),
        GgmlType::Q8_0,
        vec![64, tokens.len() as u64],
    )];
    for l in 0..2 {
        for (t, ty, dims) in [
            ("attn_norm", GgmlType::F32, vec![64]),
            ("ffn_down", GgmlType::Q4_1, vec![128, 64]),
            ("ffn_gate", GgmlType::Q4_1, vec![64, 128]),
            ("ffn_up", GgmlType::Q4_1, vec![64, 128]),
            ("ffn_norm", GgmlType::F32, vec![64]),
            ("attn_k", GgmlType::Q4_1, vec![64, 32]),
            ("attn_output", GgmlType::Q4_1, vec![64, 64]),
            ("attn_q", GgmlType::Q4_1, vec![64, 64]),
            ("attn_v", GgmlType::Q4_1, vec![64, 32]),
        ] {
            names.push((format!("blk.{l}.{t}.weight"), ty, dims));
        }
    }
    names.push(("output_norm.weight".to_string(), GgmlType::F32, vec![64]));
    let got: Vec<_> = f
        .tensors()
        .iter()
        .map(|t| (t.name.clone(), t.ggml_type, t.dims.clone()))
        .collect();
    assert_eq!(got, names);
    assert!(f.tensor_info("output.weight").is_none());

    // Deterministic in the seed; different seeds differ.
    let a = synthetic_llama_writer(&cfg, 42)
        .unwrap()
        .to_bytes()
        .unwrap();
    let on_disk = std::fs::read(&path.0).unwrap();
    assert_eq!(a, on_disk);
    let b = synthetic_llama_writer(&cfg, 43)
        .unwrap()
        .to_bytes()
        .unwrap();
    assert_ne!(a, b);

    // Untied variant has output.weight.
    let untied = SyntheticConfig {
        tied_embeddings: false,
        ..cfg.clone()
    };
    let f = GgufFile::from_bytes(
        synthetic_llama_writer(&untied, 1)
            .unwrap()
            .to_bytes()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        f.tensor("output.weight").unwrap().ggml_type(),
        GgmlType::Q4_1
    );

    // Bad configs are errors.
    let bad = SyntheticConfig { dim: 48, ..cfg };
    assert!(matches!(
        synthetic_llama_writer(&bad, 1),
        Err(GgufError::InvalidArgument(_))
    ));
}

#[test]
fn writer_rejects_bad_input() {
    let mut w = GgufWriter::new();
    assert!(matches!(
        w.add_tensor("x", &[32], GgmlType::Q4_1, vec![0; 19]),
        Err(GgufError::SizeMismatch { .. })
    ));
    assert!(w
        .add_tensor("x", &[31], GgmlType::Q4_1, vec![0; 20])
        .is_err());
    w.add_kv("mixed", Value::Array(vec![Value::U8(1), Value::I8(1)]));
    assert!(matches!(w.to_bytes(), Err(GgufError::InvalidArgument(_))));
}

#[test]
fn file_and_views_are_send_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<GgufFile>();
    assert_send_sync::<gguf::TensorView<'static>>();
    assert_send_sync::<GgufError>();
}

/// `select_layers` (self-speculation drafts): the kept blocks renumbered
/// from 0, the rest dropped, the block count set; where Gemma 3's period
/// of sliding-window layers would give a kept layer another role after
/// renumbering, the roles are written out; bad selections are refused.
#[test]
fn select_layers_keeps_renumbers_and_keeps_each_layers_role() {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", Value::String("gemma3".into()));
    w.add_kv("gemma3.block_count", Value::U32(12));
    w.add_kv("gemma3.attention.sliding_window", Value::U32(512));
    for l in 0..12u64 {
        w.add_tensor_f32(
            format!("blk.{l}.attn_norm.weight"),
            &[4],
            GgmlType::F32,
            &[l as f32; 4],
        )
        .unwrap();
    }
    w.add_tensor_f32("output_norm.weight", &[4], GgmlType::F32, &[9.0; 4])
        .unwrap();
    let file = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    // Layers 0, 5 (global: every 6th) and 6: renumbered 0, 1, 2, the
    // period would make the new layer 1 local, so the roles are written.
    let d = GgufFile::from_bytes(
        gguf::write::select_layers(&file, &[0, 5, 6])
            .unwrap()
            .to_bytes()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(d.get_u64("gemma3.block_count").unwrap(), 3);
    let norm = |f: &GgufFile, n: &str| f.tensor(n).unwrap().dequantize().unwrap()[0];
    assert_eq!(norm(&d, "blk.1.attn_norm.weight"), 5.0);
    assert_eq!(norm(&d, "blk.2.attn_norm.weight"), 6.0);
    assert!(d.tensor_info("blk.3.attn_norm.weight").is_none());
    assert_eq!(norm(&d, "output_norm.weight"), 9.0);
    assert_eq!(
        d.get("gemma3.attention.sliding_window_pattern"),
        Some(&Value::Array(vec![
            Value::Bool(true),
            Value::Bool(false),
            Value::Bool(true)
        ]))
    );
    // The first and last three: the period still says each layer's role.
    let d = GgufFile::from_bytes(
        gguf::write::select_layers(&file, &[0, 1, 2, 9, 10, 11])
            .unwrap()
            .to_bytes()
            .unwrap(),
    )
    .unwrap();
    assert!(d.get("gemma3.attention.sliding_window_pattern").is_none());
    for bad in [&[][..], &[12], &[3, 1], &[2, 2]] {
        assert!(gguf::write::select_layers(&file, bad).is_err(), "{bad:?}");
    }
}
