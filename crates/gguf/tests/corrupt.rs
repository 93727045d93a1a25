//! Malformed input must give a typed error, never a panic.

mod common;

use common::TempPath;
use gguf::write::GgufWriter;
use gguf::{GgmlType, GgufError, GgufFile, Value};
use testkit::synthetic::{synthetic_llama_writer, SyntheticConfig};

/// A small (few-KB) but complete file: metadata of every kind and tensors.
fn small_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "llama")
        .add_kv("a.u32", 7u32)
        .add_kv("a.f32", 0.5f32)
        .add_kv("a.bool", true)
        .add_kv("a.strs", vec!["x", "yy", "zzz"])
        .add_kv(
            "a.nested",
            Value::Array(vec![Value::from(vec![1i16, 2]), Value::from(vec![3i16])]),
        )
        .add_kv("a.i64", -5i64)
        .add_kv(
            "a.vocab",
            (0..200).map(|i| format!("tok{i}")).collect::<Vec<_>>(),
        );
    let vals: Vec<f32> = (0..64).map(|i| i as f32 / 10.0 - 3.0).collect();
    for t in GgmlType::ALL {
        match t.block_size().0 {
            // K-quant super-blocks: raw bytes of one block.
            256 => {
                w.add_tensor(format!("t.{t}"), &[256], t, vec![0; t.block_size().1])
                    .unwrap();
            }
            _ if gguf::write::quantize(t, &vals).is_ok() => {
                w.add_tensor_f32(format!("t.{t}"), &[32, 2], t, &vals)
                    .unwrap();
            }
            _ => {
                w.add_tensor(format!("t.{t}"), &[32, 2], t, vec![0; 2 * t.block_size().1])
                    .unwrap();
            }
        }
    }
    // End on a tensor whose size is a multiple of the alignment, so the file
    // has no trailing padding and every strict prefix is incomplete.
    w.add_tensor_f32("t.last", &[32], GgmlType::F32, &vals[..32])
        .unwrap();
    w.to_bytes().unwrap()
}

#[test]
fn every_truncation_is_an_error() {
    let full = small_file();
    assert!(full.len() > 3000, "{}", full.len());
    GgufFile::from_bytes(full.clone()).expect("the full file parses");
    for len in 0..full.len() {
        let r = GgufFile::from_bytes(full[..len].to_vec());
        assert!(r.is_err(), "prefix of {len}/{} bytes parsed", full.len());
    }
}

#[test]
fn every_truncation_of_the_synthetic_model_is_an_error() {
    // The synthetic model with a smaller vocab-bearing header; check every
    // prefix through the metadata and tensor infos, then a stride over data.
    let full = synthetic_llama_writer(&SyntheticConfig::default(), 3)
        .unwrap()
        .to_bytes()
        .unwrap();
    let f = GgufFile::from_bytes(full.clone()).unwrap();
    let header_end = f.data_offset() as usize;
    let lens = (0..header_end + 64).chain((header_end + 64..full.len()).step_by(97));
    for len in lens {
        assert!(
            GgufFile::from_bytes(full[..len].to_vec()).is_err(),
            "prefix {len}"
        );
    }
}

#[test]
fn truncated_files_on_disk() {
    let full = small_file();
    let path = TempPath::new("truncated.gguf");
    for len in [0usize, 3, 4, 8, 23, 24, 100, full.len() - 1] {
        std::fs::write(&path.0, &full[..len]).unwrap();
        match GgufFile::open(&path.0) {
            Err(GgufError::Truncated { .. }) | Err(GgufError::TensorOutOfBounds { .. }) => {}
            other => panic!("len {len}: expected truncation error, got {other:?}"),
        }
    }
    match GgufFile::open("/nonexistent/x.gguf") {
        Err(GgufError::Io { path, .. }) => assert_eq!(path.to_str(), Some("/nonexistent/x.gguf")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_magic_and_version() {
    let mut b = small_file();
    b[0] = b'X';
    match GgufFile::from_bytes(b) {
        Err(GgufError::BadMagic { found }) => assert_eq!(&found, b"XGUF"),
        other => panic!("{other:?}"),
    }
    for v in [0u32, 1, 4, 0x0300_0000] {
        let mut b = small_file();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        match GgufFile::from_bytes(b) {
            Err(GgufError::UnsupportedVersion(got)) => assert_eq!(got, v),
            other => panic!("{other:?}"),
        }
    }
}

/// Header + one kv whose bytes follow.
fn one_kv(key: &str, type_id: u32, value: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(&(key.len() as u64).to_le_bytes());
    b.extend_from_slice(key.as_bytes());
    b.extend_from_slice(&type_id.to_le_bytes());
    b.extend_from_slice(value);
    b
}

#[test]
fn absurd_counts_and_lengths() {
    // Array length u64::MAX, and one just past the bytes left.
    for count in [u64::MAX, 1 << 40, gguf::MAX_ARRAY_LEN + 1, 1000] {
        let mut v = 4u32.to_le_bytes().to_vec(); // u32 elements
        v.extend_from_slice(&count.to_le_bytes());
        v.extend_from_slice(&[0u8; 16]);
        let r = GgufFile::from_bytes(one_kv("k", 9, &v));
        assert!(
            matches!(
                r,
                Err(GgufError::LimitExceeded { .. }) | Err(GgufError::Truncated { .. })
            ),
            "count {count}: {r:?}"
        );
    }
    // Array of strings claiming many elements.
    let mut v = 8u32.to_le_bytes().to_vec();
    v.extend_from_slice(&(1u64 << 21).to_le_bytes());
    assert!(matches!(
        GgufFile::from_bytes(one_kv("k", 9, &v)),
        Err(GgufError::Truncated { .. })
    ));
    // Huge string length.
    let r = GgufFile::from_bytes(one_kv("k", 8, &u64::MAX.to_le_bytes()));
    assert!(matches!(r, Err(GgufError::LimitExceeded { .. })), "{r:?}");
    let r = GgufFile::from_bytes(one_kv("k", 8, &1000u64.to_le_bytes()));
    assert!(matches!(r, Err(GgufError::Truncated { .. })), "{r:?}");
    // Huge key length.
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes());
    b.extend_from_slice(&(u64::MAX - 3).to_le_bytes());
    b.extend_from_slice(&[0u8; 64]);
    assert!(matches!(
        GgufFile::from_bytes(b),
        Err(GgufError::LimitExceeded { .. })
    ));
    // Huge tensor and kv counts.
    for (tc, kc) in [(u64::MAX, 0u64), (0, u64::MAX), (1 << 19, 0), (0, 1 << 19)] {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&tc.to_le_bytes());
        b.extend_from_slice(&kc.to_le_bytes());
        b.extend_from_slice(&[0u8; 256]);
        let r = GgufFile::from_bytes(b);
        assert!(
            matches!(
                r,
                Err(GgufError::LimitExceeded { .. }) | Err(GgufError::Truncated { .. })
            ),
            "{tc} {kc}: {r:?}"
        );
    }
}

#[test]
fn deeply_nested_arrays_are_refused() {
    // 1000 levels of array-of-array, each of length 1.
    let mut v = Vec::new();
    for _ in 0..1000 {
        v.extend_from_slice(&9u32.to_le_bytes());
        v.extend_from_slice(&1u64.to_le_bytes());
    }
    v.extend_from_slice(&[0u8; 16]);
    let r = GgufFile::from_bytes(one_kv("k", 9, &v));
    assert!(
        matches!(
            r,
            Err(GgufError::LimitExceeded {
                what: "array nesting depth",
                ..
            })
        ),
        "{r:?}"
    );
}

#[test]
fn invalid_value_types_utf8_and_duplicates() {
    let r = GgufFile::from_bytes(one_kv("k", 13, &[0; 8]));
    assert!(
        matches!(r, Err(GgufError::InvalidValueType { type_id: 13, .. })),
        "{r:?}"
    );
    let r = GgufFile::from_bytes(one_kv("k", 7, &[2]));
    assert!(
        matches!(r, Err(GgufError::InvalidBool { value: 2, .. })),
        "{r:?}"
    );
    let mut s = 2u64.to_le_bytes().to_vec();
    s.extend_from_slice(&[0xFF, 0xFE]);
    let r = GgufFile::from_bytes(one_kv("k", 8, &s));
    assert!(matches!(r, Err(GgufError::InvalidUtf8 { .. })), "{r:?}");
    let r = GgufFile::from_bytes(one_kv("k\u{0}\u{7f}", 4, &[1, 0, 0, 0]));
    assert!(r.is_ok(), "odd but valid UTF-8 keys are fine: {r:?}");

    // Duplicate keys: patch the second key of a two-key file.
    let mut w = GgufWriter::new();
    w.add_kv("aa", 1u32).add_kv("ab", 2u32);
    let mut b = w.to_bytes().unwrap();
    let pos = b.windows(2).rposition(|x| x == b"ab").unwrap();
    b[pos + 1] = b'a';
    assert!(matches!(GgufFile::from_bytes(b), Err(GgufError::DuplicateKey(k)) if k == "aa"));

    // Duplicate tensor names.
    let mut w = GgufWriter::new();
    w.add_tensor_f32("t", &[4], GgmlType::F32, &[0.0; 4])
        .unwrap();
    w.add_tensor_f32("t", &[4], GgmlType::F32, &[0.0; 4])
        .unwrap();
    assert!(matches!(
        GgufFile::from_bytes(w.to_bytes().unwrap()),
        Err(GgufError::DuplicateTensor(_))
    ));
}

#[test]
fn bad_alignment() {
    for (a, ok) in [
        (0u32, false),
        (3, false),
        (48, false),
        (1, true),
        (16, true),
        (1 << 24, false),
    ] {
        let r = GgufFile::from_bytes(one_kv("general.alignment", 4, &a.to_le_bytes()));
        assert_eq!(r.is_ok(), ok, "alignment {a}: {r:?}");
        if !ok {
            assert!(matches!(r, Err(GgufError::BadAlignment(_))), "{r:?}");
        }
    }
    let mut b = one_kv("general.alignment", 8, &2u64.to_le_bytes());
    b.extend_from_slice(b"32");
    let r = GgufFile::from_bytes(b);
    assert!(matches!(r, Err(GgufError::WrongType { .. })), "{r:?}");
}

#[test]
fn tensor_past_eof() {
    let mut w = GgufWriter::new();
    w.add_tensor_f32("a", &[32], GgmlType::F32, &[1.0; 32])
        .unwrap();
    w.add_tensor_f32("b", &[32], GgmlType::F32, &[2.0; 32])
        .unwrap();
    let full = w.to_bytes().unwrap();
    // Cutting the last tensor's final byte.
    match GgufFile::from_bytes(full[..full.len() - 1].to_vec()) {
        Err(GgufError::TensorOutOfBounds { name, .. }) => assert_eq!(name, "b"),
        other => panic!("{other:?}"),
    }
    // An offset far past the end, and one that overflows u64.
    for off in [1u64 << 40, u64::MAX - 31] {
        let mut w = GgufWriter::new();
        w.add_tensor_f32("a", &[32], GgmlType::F32, &[1.0; 32])
            .unwrap();
        let mut b = w.to_bytes().unwrap();
        // The offset is the 8 bytes before the header padding; find it as the
        // first u64 zero after the type id 0 following dims [32].
        let mut pat = 1u32.to_le_bytes().to_vec();
        pat.extend_from_slice(&32u64.to_le_bytes());
        pat.extend_from_slice(&0u32.to_le_bytes());
        let p = b.windows(pat.len()).position(|x| x == pat).unwrap() + pat.len();
        b[p..p + 8].copy_from_slice(&off.to_le_bytes());
        let r = GgufFile::from_bytes(b);
        assert!(
            matches!(r, Err(GgufError::TensorOutOfBounds { .. })),
            "{off}: {r:?}"
        );
    }
}

fn with_tensor(dims: &[u64], type_id: u32, data: Vec<u8>) -> Result<GgufFile, GgufError> {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "llama");
    w.add_tensor_unchecked("blk.0.attn_q.weight", dims, type_id, data);
    GgufFile::from_bytes(w.to_bytes().unwrap())
}

#[test]
fn unsupported_tensor_types_are_named() {
    match with_tensor(&[256, 1], 11, vec![0; 110]) {
        Err(e @ GgufError::UnsupportedTensorType { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("Q3_K") && msg.contains("11") && msg.contains("blk.0.attn_q.weight"),
                "{msg}"
            );
            match e {
                GgufError::UnsupportedTensorType {
                    name,
                    type_id,
                    type_name,
                } => {
                    assert_eq!(
                        (name.as_str(), type_id, type_name),
                        ("blk.0.attn_q.weight", 11, Some("Q3_K"))
                    );
                }
                _ => unreachable!(),
            }
        }
        other => panic!("{other:?}"),
    }
    for (id, name) in [
        (23u32, Some("IQ4_XS")),
        (30, Some("BF16")),
        (9, Some("Q8_1")),
        (9999, None),
    ] {
        match with_tensor(&[256], id, vec![0; 1024]) {
            Err(GgufError::UnsupportedTensorType {
                type_id, type_name, ..
            }) => {
                assert_eq!((type_id, type_name), (id, name));
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn malformed_tensor_shapes() {
    // Five dimensions.
    let r = with_tensor(&[1, 1, 1, 1, 1], 0, vec![0; 4]);
    assert!(matches!(r, Err(GgufError::InvalidTensor { .. })), "{r:?}");
    // Product overflows u64.
    let r = with_tensor(&[1 << 32, 1 << 32, 2], 0, vec![]);
    assert!(matches!(r, Err(GgufError::InvalidTensor { .. })), "{r:?}");
    // Product fits u64 but bytes overflow.
    let r = with_tensor(&[1 << 31, 1 << 31], 0, vec![]);
    assert!(matches!(r, Err(GgufError::InvalidTensor { .. })), "{r:?}");
    // A dim above i64::MAX.
    let r = with_tensor(&[u64::MAX], 0, vec![]);
    assert!(matches!(r, Err(GgufError::InvalidTensor { .. })), "{r:?}");
    // Quantised row not a whole number of blocks.
    let r = with_tensor(&[48, 2], 3, vec![0; 60]);
    assert!(matches!(r, Err(GgufError::InvalidTensor { .. })), "{r:?}");
    // Huge but consistent shape: out of bounds, not an allocation.
    let r = with_tensor(&[1 << 20, 1 << 20], 8, vec![0; 34]);
    assert!(
        matches!(r, Err(GgufError::TensorOutOfBounds { .. })),
        "{r:?}"
    );
    // Zero-sized and zero-dimensional tensors are fine.
    let f = with_tensor(&[32, 0], 8, vec![]).unwrap();
    let v = f.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!((v.rows(), v.bytes().len()), (0, 0));
    let f = with_tensor(&[], 0, vec![0; 4]).unwrap();
    let v = f.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!((v.rows(), v.cols(), v.n_elements()), (1, 1, 1));
}

#[test]
fn misaligned_tensor_offset() {
    let mut w = GgufWriter::new();
    w.add_tensor_f32("a", &[32], GgmlType::F32, &[1.0; 32])
        .unwrap();
    let mut b = w.to_bytes().unwrap();
    let mut pat = 1u32.to_le_bytes().to_vec();
    pat.extend_from_slice(&32u64.to_le_bytes());
    pat.extend_from_slice(&0u32.to_le_bytes());
    let p = b.windows(pat.len()).position(|x| x == pat).unwrap() + pat.len();
    b[p..p + 8].copy_from_slice(&4u64.to_le_bytes());
    let r = GgufFile::from_bytes(b);
    assert!(matches!(r, Err(GgufError::InvalidTensor { .. })), "{r:?}");
}

/// Random byte flips over the synthetic model: any result, but no panic.
#[test]
fn random_corruption_never_panics() {
    let full = synthetic_llama_writer(&SyntheticConfig::default(), 9)
        .unwrap()
        .to_bytes()
        .unwrap();
    let header_end = GgufFile::from_bytes(full.clone()).unwrap().data_offset() as usize;
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..300 {
        let mut b = full[..header_end].to_vec();
        for _ in 0..1 + next() % 4 {
            let i = (next() % b.len() as u64) as usize;
            b[i] = next() as u8;
        }
        if let Ok(f) = GgufFile::from_bytes(b) {
            // Whatever parsed must be self-consistent: every tensor view works.
            for t in f.tensors() {
                let _ = f.tensor(&t.name);
            }
        }
    }
}
