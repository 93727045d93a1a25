use std::sync::Arc;
use std::time::{Duration, Instant};

use request::TenantId;

use super::*;

const EOS: u32 = 256;

/// Every byte a token, a few multi-byte tokens, a control token and EOS.
fn vocab() -> Vocabulary {
    let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    words.push(b"<eos>".to_vec()); // 256
    words.push(b"<|im_start|>".to_vec()); // 257, control
    for w in [
        "{\"", "\": ", "true", "false", "name", "\"}", ", \"", "yes", "no",
    ] {
        words.push(w.as_bytes().to_vec());
    }
    words.push(Vec::new()); // an empty token: never allowed
    Vocabulary::from_words(words, &[EOS, 257], &[EOS]).unwrap()
}

fn compiler() -> Compiler {
    Compiler::new(vocab(), Limits::default()).unwrap()
}

fn scope(t: u64) -> Scope {
    Scope::tenant(TenantId(t))
}

/// Greedy over a fixed preference: at each step the first allowed token of
/// `prefer` (bytes of a target text, then EOS); returns the text.
fn drive(m: &mut Matcher, target: &[u8], max_steps: usize) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    for _ in 0..max_steps {
        let mask = m.mask().unwrap();
        let next = target.get(out.len()).copied().map(u32::from);
        match next {
            Some(b) if mask.allows(b) => {
                m.consume(b).unwrap();
                out.push(b as u8);
            }
            _ => {
                return (out, mask.allows(EOS));
            }
        }
        if m.is_stopped() {
            return (out, true);
        }
    }
    (out, false)
}

#[test]
fn a_schema_allows_its_documents_and_nothing_else() {
    let c = compiler();
    let spec = GrammarSpec::JsonSchema {
        schema: r#"{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"],"additionalProperties":false}"#.into(),
        strict: true,
    };
    let g = c.compile(scope(1), &spec).unwrap();
    let mut m = g.matcher();
    let first = m.mask().unwrap();
    assert!(first.allows(b'{' as u32));
    assert!(first.allows(258)); // `{"`
    assert!(!first.allows(b' ' as u32) && !first.allows(b'[' as u32));
    assert!(!first.allows(EOS) && !first.allows(257) && !first.allows(267));
    let (out, ended) = drive(&mut m, br#"{"ok": true}"#, 64);
    assert_eq!(out, br#"{"ok": true}"#);
    assert!(ended && m.is_stopped());
    // Once ended, only EOS.
    let last = m.mask().unwrap();
    assert_eq!(last.count(), 1);
    assert!(last.allows(EOS));
    // A document with another key is cut where it leaves the schema.
    let mut m = g.matcher();
    let (out, _) = drive(&mut m, br#"{"no": 1}"#, 64);
    assert_eq!(out, br#"{""#);
}

#[test]
fn json_object_regex_choice_and_lark_constrain() {
    let c = compiler();
    let cases: Vec<(GrammarSpec, &[u8], &[u8])> = vec![
        (
            GrammarSpec::JsonObject,
            br#"{"a": [1, 2]}"#,
            br#"{"a": [1, 2]}"#,
        ),
        (GrammarSpec::JsonObject, b"[1]", b""),
        (GrammarSpec::Regex("[0-9]{3}-x".into()), b"123-x", b"123-x"),
        (GrammarSpec::Regex("[0-9]{3}-x".into()), b"12a", b"12"),
        (
            GrammarSpec::Choice(vec!["yes".into(), "no".into()]),
            b"nope",
            b"no",
        ),
        (
            GrammarSpec::Lark("start: \"a\" b\nb: \"b\"+".into()),
            b"abbbc",
            b"abbb",
        ),
    ];
    for (spec, target, want) in cases {
        let g = c.compile(scope(1), &spec).unwrap();
        let mut m = g.matcher();
        let (out, _) = drive(&mut m, target, 64);
        assert_eq!(out, want, "{spec:?}");
    }
}

#[test]
fn eos_is_allowed_exactly_where_the_grammar_may_end() {
    let c = compiler();
    let g = c
        .compile(scope(1), &GrammarSpec::Regex("a+".into()))
        .unwrap();
    let mut m = g.matcher();
    assert!(!m.mask().unwrap().allows(EOS));
    m.consume(b'a' as u32).unwrap();
    let mask = m.mask().unwrap();
    assert!(mask.allows(EOS) && mask.allows(b'a' as u32));
    assert!(!m.is_stopped());
}

#[test]
fn bad_grammars_are_refused_with_what_is_wrong() {
    let c = compiler();
    let bad = [
        (
            GrammarSpec::JsonSchema {
                schema: "{not json".into(),
                strict: false,
            },
            "not JSON",
        ),
        (
            GrammarSpec::JsonSchema {
                schema: "[1]".into(),
                strict: false,
            },
            "array",
        ),
        (
            GrammarSpec::JsonSchema {
                schema: r#"{"type":"object","x-guidance":{}}"#.into(),
                strict: false,
            },
            "x-guidance",
        ),
        (
            GrammarSpec::JsonSchema {
                schema: r#"{"type":"string","format":"no-such-format"}"#.into(),
                strict: true,
            },
            "format",
        ),
        (GrammarSpec::Regex("(".into()), "regex"),
        (
            GrammarSpec::JsonSchema {
                schema: r#"{"type":"number","multipleOf":1e-12}"#.into(),
                strict: false,
            },
            "multipleOf",
        ),
        // llguidance's arithmetic overflows on this range and step: the
        // panic is caught (overflow checks are on for it in release builds
        // too) and is a refusal, never a wrong grammar.
        (
            GrammarSpec::JsonSchema {
                schema: r#"{"type":"number","multipleOf":1e-9,"maximum":1e12}"#.into(),
                strict: false,
            },
            "overflow",
        ),
        (GrammarSpec::Lark("start: nothing_defined".into()), ""),
        (GrammarSpec::Choice(vec![]), "choice"),
    ];
    for (spec, says) in bad {
        let e = c.compile(scope(1), &spec).unwrap_err();
        assert!(
            e.to_string().to_lowercase().contains(&says.to_lowercase()),
            "{spec:?}: {e}"
        );
    }
    // Nothing was cached for them.
    assert_eq!(c.cache_stats().entries, 0);
}

#[test]
fn the_cache_is_per_scope() {
    let c = compiler();
    let spec = GrammarSpec::Regex("[a-z]{2,5}".into());
    let a1 = c.compile(scope(1), &spec).unwrap();
    let a2 = c.compile(scope(1), &spec).unwrap();
    let b = c.compile(scope(2), &spec).unwrap();
    assert!(Arc::ptr_eq(&a1, &a2), "one scope shares its compile");
    assert!(!Arc::ptr_eq(&a1, &b), "another scope compiles its own");
    let s = c.cache_stats();
    assert_eq!((s.scopes, s.entries, s.hits_total), (2, 2, 1));
    // The counters the metrics read: one hit, two cold compiles timed.
    let st = c.stats();
    assert_eq!((st.cache_hits, st.cache_misses), (1, 2));
    assert_eq!(st.compiles.count(), 2);
    assert_eq!(st.masks.count(), 0);
    let mut m = a1.matcher();
    m.mask().unwrap();
    assert_eq!(c.stats().masks.count(), 1);
}

#[test]
fn a_sequences_matcher_is_its_own() {
    let c = compiler();
    let g = c
        .compile(
            scope(1),
            &GrammarSpec::Choice(vec!["yes".into(), "no".into()]),
        )
        .unwrap();
    let (mut m1, mut m2) = (g.matcher(), g.matcher());
    m1.consume(b'y' as u32).unwrap();
    // m2 is still at the start.
    let mask = m2.mask().unwrap();
    assert!(mask.allows(b'n' as u32));
    assert!(!m1.mask().unwrap().allows(b'n' as u32));
}

#[test]
fn mask_apply_bans_every_other_token_and_the_tail() {
    let c = compiler();
    let g = c
        .compile(scope(1), &GrammarSpec::Regex("b".into()))
        .unwrap();
    let mask = g.matcher().mask().unwrap();
    // Logits longer than the vocabulary (a padded output layer).
    let mut logits = vec![1.0f32; 300];
    mask.apply(&mut logits);
    for (i, l) in logits.iter().enumerate() {
        assert_eq!(l.is_finite(), i == b'b' as usize, "token {i}");
    }
}

#[test]
fn pathological_inputs_end_in_bounded_time() {
    let c = compiler();
    let deep = format!(
        "{}{{\"type\":\"integer\"}}{}",
        r#"{"type":"array","items":"#.repeat(200),
        "}".repeat(200)
    );
    let huge_enum = format!(
        r#"{{"enum":[{}]}}"#,
        (0..5000)
            .map(|i| format!("\"value-{i}\""))
            .collect::<Vec<_>>()
            .join(",")
    );
    let specs = [
        GrammarSpec::JsonSchema {
            schema: deep,
            strict: false,
        },
        GrammarSpec::JsonSchema {
            schema: huge_enum,
            strict: false,
        },
        GrammarSpec::Regex("(a*)*b".into()),
        GrammarSpec::Regex("(x+x+)+y".into()),
        GrammarSpec::Regex("[a-z]{1,1000}[0-9]{1,1000}".into()),
        GrammarSpec::Lark("start: start \"a\" | \"a\"".into()),
    ];
    for spec in specs {
        let t = Instant::now();
        let r = c.compile_cold(&spec);
        let took = t.elapsed();
        assert!(
            took < Duration::from_secs(5),
            "{:?} took {took:?}",
            spec.kind()
        );
        if let Ok(g) = r {
            // A step's mask is bounded too.
            let mut m = g.matcher();
            let t = Instant::now();
            let _ = m.mask();
            assert!(t.elapsed() < Duration::from_secs(2));
        }
    }
}

#[test]
fn unbounded_numbers_are_generated_with_bounded_digits() {
    let c = compiler();
    let schema = r#"{"type":"object","properties":{
        "f":{"type":"number"},"i":{"type":["integer","null"]},
        "k":{"type":"number","multipleOf":0.5},"big":{"type":"integer","minimum":1e12},
        "e":{"enum":[{"type":"number"}]}},"required":["f","i","k","big"],
        "additionalProperties":false}"#;
    let g = c
        .compile(
            scope(1),
            &GrammarSpec::JsonSchema {
                schema: schema.into(),
                strict: false,
            },
        )
        .unwrap();
    let doc = format!(
        r#"{{"f": 0.{}, "i": {}, "k": 2.5, "big": 1000000000000}}"#,
        "1".repeat(30),
        "9".repeat(30)
    );
    let (out, _) = drive(&mut g.matcher(), doc.as_bytes(), 400);
    // Eight fraction digits, then the number must end.
    assert_eq!(String::from_utf8_lossy(&out), r#"{"f": 0.11111111"#);
    let doc = format!(r#"{{"f": 1.5, "i": {}"#, "9".repeat(30));
    let (out, _) = drive(&mut g.matcher(), doc.as_bytes(), 400);
    // At most 16 integer digits (≤ 1e15).
    assert_eq!(
        String::from_utf8_lossy(&out),
        format!(r#"{{"f": 1.5, "i": {}"#, "9".repeat(15))
    );
    // The schema's own bounds and steps are kept: 2.5 is a multiple of
    // 0.5, and a minimum of 1e12 leaves room above it.
    let doc = r#"{"f": 1.5, "i": null, "k": 2.5, "big": 1000000000000000}"#;
    let (out, ended) = drive(&mut g.matcher(), doc.as_bytes(), 400);
    assert_eq!(out, doc.as_bytes());
    assert!(ended);
}

#[test]
fn strict_closes_objects_and_formats_are_bounded() {
    let c = compiler();
    let schema = r#"{"type":"object","properties":{"a":{"type":"boolean"}},"required":["a"]}"#;
    let doc = br#"{"a": true, "b": 1}"#;
    // Strict: the object must end after `a`; not strict: `b` may follow.
    for (strict, want) in [(true, &br#"{"a": true"#[..]), (false, &doc[..])] {
        let g = c
            .compile(
                scope(1),
                &GrammarSpec::JsonSchema {
                    schema: schema.into(),
                    strict,
                },
            )
            .unwrap();
        let (out, _) = drive(&mut g.matcher(), doc, 64);
        assert_eq!(out, want, "strict {strict}");
    }
    // A time's fraction digits end where no RFC 3339 time is longer; the
    // time can still end there.
    let g = c
        .compile(
            scope(1),
            &GrammarSpec::JsonSchema {
                schema: r#"{"type":"string","format":"time","uniqueItems":false}"#.into(),
                strict: false,
            },
        )
        .unwrap();
    let t = format!("\"20:00:00.{}Z\"", "0".repeat(40));
    let (out, _) = drive(&mut g.matcher(), t.as_bytes(), 64);
    assert_eq!(out.len(), 1 + 23, "{}", String::from_utf8_lossy(&out));
    let mut m = g.matcher();
    for b in &out {
        m.consume(*b as u32).unwrap();
    }
    assert!(m.mask().unwrap().allows(b'Z' as u32));
}
