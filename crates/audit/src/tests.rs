use super::*;
use crate::read::{parse_rfc3339_ms, read_csv, read_jsonl};

fn audit_jsonl(log: &str, sig: Signature) -> Report {
    let mut a = Auditor::new(sig);
    read_jsonl(log.as_bytes(), &Mapping::ours(), |r| a.push(r)).expect("read");
    a.finish()
}

fn finished(prompt: u64, ttft_ms: f64) -> Record {
    Record {
        line: 1,
        outcome: Outcome::Finished,
        prompt_tokens: Some(prompt),
        output_tokens: Some(4),
        ttft_ms: Some(ttft_ms),
        kv_capacity_tokens: Some(4096),
        context_window_tokens: Some(2048),
        prefill_tokens_per_s: Some(1000.0),
        pages: Some(8),
        ..Record::default()
    }
}

fn rules(r: &Record) -> Vec<Rule> {
    check(r, &Signature::default())
        .0
        .into_iter()
        .map(|(r, _)| r)
        .collect()
}

#[test]
fn a_normal_request_matches_nothing_and_is_checked_by_every_rule() {
    let r = finished(1000, 700.0);
    let (found, checked) = check(&r, &Signature::default());
    assert!(found.is_empty(), "{found:?}");
    assert_eq!(checked, Rule::ALL.to_vec());
}

#[test]
fn over_capacity_is_the_smaller_of_pool_and_window_and_only_when_answered() {
    // 2049 > the window of 2048 (the pool holds 4096): a finding.
    let r = Record {
        ttft_ms: Some(5000.0),
        ..finished(2049, 0.0)
    };
    assert_eq!(rules(&r), vec![Rule::OverCapacity]);
    // At the limit: none.
    assert!(rules(&Record {
        ttft_ms: Some(5000.0),
        ..finished(2048, 0.0)
    })
    .is_empty());
    // Refused (what a correct server does): none.
    let refused = Record {
        outcome: Outcome::Rejected,
        output_tokens: Some(0),
        pages: Some(0),
        error_code: Some("context_length_exceeded".into()),
        ..r.clone()
    };
    assert!(rules(&refused).is_empty());
    // Only the pool's capacity known.
    let pool_only = Record {
        context_window_tokens: None,
        ..r
    };
    assert!(rules(&pool_only).is_empty());
    assert_eq!(
        rules(&Record {
            prompt_tokens: Some(4097),
            ..pool_only
        }),
        vec![Rule::OverCapacity]
    );
}

#[test]
fn too_fast_is_ttft_below_half_what_the_prefill_rate_needs() {
    // 1000 tokens at 1000 tokens/s need 1000 ms; under 500 ms is a finding.
    assert_eq!(rules(&finished(1000, 499.0)), vec![Rule::TooFast]);
    // A prefix cache served 900 of the 1000 tokens: 100 to prefill, 100 ms
    // at 1000 tokens/s — 60 ms is not too fast, 40 ms is.
    let cached = |ttft| Record {
        cached_tokens: Some(900),
        ..finished(1000, ttft)
    };
    let p = Signature {
        too_fast_prompt_tokens_min: 1,
        ..Signature::default()
    };
    assert!(check(&cached(60.0), &p).0.is_empty());
    assert_eq!(check(&cached(40.0), &p).0[0].0, Rule::TooFast);
    assert!(rules(&finished(1000, 500.0)).is_empty());
    // Short prompts are not judged.
    assert!(rules(&finished(255, 1.0)).is_empty());
    // Without a rate in the record, the configured one; without either,
    // the rule is not checked.
    let no_rate = Record {
        prefill_tokens_per_s: None,
        ..finished(1000, 100.0)
    };
    let (found, checked) = check(&no_rate, &Signature::default());
    assert!(found.is_empty() && !checked.contains(&Rule::TooFast));
    let sig = Signature {
        prefill_tokens_per_s: Some(5000.0),
        ..Signature::default()
    };
    // 1000 tokens at 5000/s need 200 ms: 100 ms is exactly half, no finding;
    // 99 ms is.
    assert!(check(&no_rate, &sig).0.is_empty());
    let r = Record {
        ttft_ms: Some(99.0),
        ..no_rate
    };
    assert_eq!(check(&r, &sig).0[0].0, Rule::TooFast);
}

#[test]
fn rejected_after_allocation_needs_pages_held_at_the_refusal() {
    let refused = |pages| Record {
        outcome: Outcome::Rejected,
        output_tokens: Some(0),
        ttft_ms: None,
        pages: Some(pages),
        error_code: Some("prefill_lost".into()),
        ..finished(100, 0.0)
    };
    assert_eq!(rules(&refused(3)), vec![Rule::RejectedAfterAllocation]);
    assert!(rules(&refused(0)).is_empty());
    let failed = Record {
        outcome: Outcome::Error,
        ..refused(1)
    };
    assert_eq!(rules(&failed), vec![Rule::RejectedAfterAllocation]);
    // A finished request holds pages: fine.
    assert!(rules(&finished(100, 50.0)).is_empty());
}

#[test]
fn kv_safety_events_by_code_or_by_event_field() {
    let failed = |code: &str| Record {
        outcome: Outcome::Error,
        pages: Some(0),
        error_code: Some(code.into()),
        ..finished(100, 0.0)
    };
    for code in SAFETY_CODES {
        assert_eq!(rules(&failed(code)), vec![Rule::KvSafetyEvent], "{code}");
    }
    assert!(rules(&failed("prefill_lost")).is_empty());
    assert!(rules(&failed("queue_full")).is_empty());
    let event = Record {
        kv_event: Some("canary".into()),
        ..finished(100, 60.0)
    };
    assert_eq!(rules(&event), vec![Rule::KvSafetyEvent]);
}

#[test]
fn our_log_counts_per_tenant_and_window() {
    let log = r#"
{"id":"r1","endpoint":"chat","tenant":"acme","prompt_tokens":3000,"output_tokens":5,"ttft_ms":15.0,"total_ms":40.0,"pages":0,"outcome":"finished","finish_reason":"length","error_kind":null,"ts":"2026-12-04T02:10:00.000Z","kv_capacity_tokens":2048,"context_window_tokens":2048,"prefill_tokens_per_s":1200.0}
{"id":"r2","endpoint":"chat","tenant":"acme","prompt_tokens":300,"output_tokens":5,"ttft_ms":250.0,"total_ms":400.0,"pages":3,"outcome":"finished","ts":"2026-12-04T02:20:00.000Z","kv_capacity_tokens":2048,"context_window_tokens":2048,"prefill_tokens_per_s":1200.0}
{"id":"r3","endpoint":"chat","tenant":"zeta","prompt_tokens":30,"output_tokens":0,"ttft_ms":null,"total_ms":4.0,"pages":2,"outcome":"error","error_kind":"upstream_error","error_code":"checksum_mismatch","ts":"2026-12-04T03:05:00.000Z","kv_capacity_tokens":2048,"context_window_tokens":2048,"prefill_tokens_per_s":1200.0}
not json
{"id":"r4","tenant":"zeta","outcome":"sideways","ts":"2026-12-04T03:05:00Z"}
"#;
    let rep = audit_jsonl(log, Signature::default());
    assert_eq!(rep.records, 3);
    assert_eq!(rep.unreadable_total, 2);
    assert_eq!(rep.unreadable[0].line, 5);
    assert!(
        rep.unreadable[1].why.contains("unknown outcome `sideways`"),
        "{rep:?}"
    );
    // r1: over capacity and too fast; r3: rejected after allocation and a
    // safety event.
    assert_eq!(rep.matches_total, 4);
    assert_eq!(rep.by_tenant["acme"][&Rule::OverCapacity], 1);
    assert_eq!(rep.by_tenant["acme"][&Rule::TooFast], 1);
    assert_eq!(rep.by_tenant["zeta"][&Rule::RejectedAfterAllocation], 1);
    assert_eq!(rep.by_tenant["zeta"][&Rule::KvSafetyEvent], 1);
    assert_eq!(
        rep.by_window["2026-12-04T02:00:00Z"].values().sum::<u64>(),
        2
    );
    assert_eq!(
        rep.by_window["2026-12-04T03:00:00Z"].values().sum::<u64>(),
        2
    );
    assert_eq!(rep.matches[0].id.as_deref(), Some("r1"));
    assert_eq!(rep.matches[0].line, 2);
    assert_eq!(rep.exit_code(), 1);
    let text = rep.render("log.jsonl");
    assert!(text.contains("4 match the incident's signature"), "{text}");
    assert!(text.contains("line 5: not JSON"), "{text}");
    // JSON report.
    let v = serde_json::to_value(&rep).expect("json");
    assert_eq!(v["by_tenant"]["zeta"]["kv_safety_event"], 1);
    assert_eq!(v["matches"][0]["rule"], "over_capacity");
}

#[test]
fn a_clean_log_exits_0_and_one_without_any_rule_inputs_exits_2() {
    let clean = r#"{"tenant":"a","outcome":"finished","prompt_tokens":10,"ttft_ms":5,"pages":1,"kv_capacity_tokens":100}"#;
    let rep = audit_jsonl(clean, Signature::default());
    assert_eq!((rep.matches_total, rep.exit_code()), (0, 0));
    assert_eq!(rep.unchecked, vec![Rule::TooFast]);
    let empty = audit_jsonl("", Signature::default());
    assert_eq!(empty.exit_code(), 2);
    let nothing = audit_jsonl(r#"{"foo": 1}"#, Signature::default());
    assert_eq!((nothing.records, nothing.exit_code()), (1, 2));
}

#[test]
fn a_generic_csv_log_through_a_mapping() {
    // Another server's access log: TTFT in seconds, HTTP status, unix time.
    let csv = "request_id,user,time,status,n_prompt,ttft_s,note\n\
               a1,alice,1764813600,200,5000,0.010,\"says \"\"hi\"\", twice\"\n\
               a2,bob,1764813601,200,800,0.9,\n\
               a3,bob,1764817300,500,10,,\n";
    let mut m = Mapping::ours();
    for spec in [
        "id=request_id",
        "tenant=user",
        "ts=time",
        "outcome=status",
        "prompt_tokens=n_prompt",
        "ttft_ms=ttft_s*1000",
    ] {
        m.set(spec).expect(spec);
    }
    for f in [
        "output_tokens=",
        "kv_capacity_tokens=",
        "context_window_tokens=",
        "prefill_tokens_per_s=",
        "pages=",
        "error_code=",
        "kv_event=",
    ] {
        m.set(f).expect(f);
    }
    let sig = Signature {
        prefill_tokens_per_s: Some(1000.0),
        ..Signature::default()
    };
    let mut a = Auditor::new(sig);
    read_csv(csv.as_bytes(), &m, true, |r| a.push(r)).expect("read");
    let rep = a.finish();
    assert_eq!((rep.records, rep.unreadable_total), (3, 0));
    // a1: 5000 tokens in 10 ms at 1000 tokens/s.
    assert_eq!(rep.matches_total, 1, "{rep:?}");
    assert_eq!(rep.matches[0].id.as_deref(), Some("a1"));
    assert_eq!(rep.matches[0].rule, Rule::TooFast);
    assert_eq!(rep.matches[0].ts.as_deref(), Some("2025-12-04T02:00:00Z"));
    assert_eq!(rep.by_tenant["alice"][&Rule::TooFast], 1);
    assert_eq!(rep.checked[&Rule::TooFast], 2);
    assert_eq!(rep.checked[&Rule::KvSafetyEvent], 3);
    assert_eq!(
        rep.unchecked,
        vec![Rule::OverCapacity, Rule::RejectedAfterAllocation]
    );
    // A mapped column that is not in the header is an error, not silence.
    let mut bad = m.clone();
    bad.set("pages=held_pages").expect("spec");
    let e = read_csv(csv.as_bytes(), &bad, true, |_| {}).expect_err("missing column");
    assert!(e.to_string().contains("no column `held_pages`"), "{e}");
}

#[test]
fn mapping_specs_are_checked() {
    let mut m = Mapping::ours();
    assert!(m.set("ttft_ms=t/1000").is_ok());
    assert_eq!(m.source(Field::TtftMs).map(|s| s.factor), Some(0.001));
    for bad in [
        "ttft_ms",
        "nope=x",
        "ttft_ms=x*zero",
        "ttft_ms=x*0",
        "ttft_ms=*2",
    ] {
        let e = m.set(bad).expect_err(bad);
        assert!(e.to_string().contains(bad), "{e}");
    }
}

#[test]
fn outcomes_and_times_in_their_common_spellings() {
    assert_eq!(Outcome::parse("200"), Some(Outcome::Finished));
    assert_eq!(Outcome::parse("499"), Some(Outcome::Cancelled));
    assert_eq!(Outcome::parse("413"), Some(Outcome::Rejected));
    assert_eq!(Outcome::parse("503"), Some(Outcome::Error));
    assert_eq!(Outcome::parse("Canceled"), Some(Outcome::Cancelled));
    assert_eq!(Outcome::parse("302"), None);
    assert_eq!(
        parse_rfc3339_ms("2026-12-04T02:08:37.123Z"),
        Some(1_796_350_117_123)
    );
    assert_eq!(
        parse_rfc3339_ms("2026-12-04T03:08:37.123+01:00"),
        Some(1_796_350_117_123)
    );
    assert_eq!(parse_rfc3339_ms("yesterday"), None);
    // A number where a count belongs is required.
    let rep = audit_jsonl(
        r#"{"outcome":"finished","prompt_tokens":"many"}"#,
        Signature::default(),
    );
    assert_eq!(rep.unreadable_total, 1);
    assert!(rep.unreadable[0].why.contains("`prompt_tokens`"), "{rep:?}");
}

#[test]
fn listing_and_grouping_are_bounded_but_counting_is_not() {
    let sig = Signature {
        matches_listed_max: 3,
        groups_max: 2,
        ..Signature::default()
    };
    let mut a = Auditor::new(sig);
    for i in 0..10u64 {
        a.push(Ok(Record {
            line: i as usize + 1,
            tenant: Some(format!("t{i}")),
            ts_ms: Some(i as i64 * 7_200_000),
            error_code: Some("canary_mismatch".into()),
            outcome: Outcome::Error,
            ..Record::default()
        }));
    }
    let rep = a.finish();
    assert_eq!(rep.matches_total, 10);
    assert_eq!(rep.matches.len(), 3);
    assert_eq!(rep.by_tenant.len(), 3);
    assert_eq!(rep.by_tenant["(other)"][&Rule::KvSafetyEvent], 8);
    assert_eq!(rep.by_window["(other)"][&Rule::KvSafetyEvent], 8);
    assert!(rep.render("x").contains("7 more (all are counted above)"));
}
