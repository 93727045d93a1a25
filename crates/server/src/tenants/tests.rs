use super::*;

fn two() -> Tenants {
    let text = format!(
        "[[tenant]]\nname = \"a\"\napi_key_sha256 = \"{}\"\nmax_concurrent = 2\nmax_tokens_per_minute = 100\n\n\
         [[tenant]]\nname = \"b\"\napi_key_sha256 = \"{}\"\n",
        key_sha256_hex("key-a"),
        key_sha256_hex("key-b").to_uppercase()
    );
    Tenants::from_toml(&text).expect("valid file")
}

#[test]
fn ct_eq_matches_plain_equality() {
    let a = sha256(b"x");
    let mut b = a;
    assert_eq!(ct_eq(&a, &b), 1);
    for i in 0..32 {
        for bit in 0..8 {
            b = a;
            b[i] ^= 1 << bit;
            assert_eq!(ct_eq(&a, &b), 0, "byte {i} bit {bit}");
        }
    }
    assert_eq!(ct_eq(&[0; 32], &[0xff; 32]), 0);
}

#[test]
fn sha256_of_known_input() {
    // SHA-256("test"), the example in the module docs.
    assert_eq!(
        key_sha256_hex("test"),
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    );
}

#[test]
fn keys_map_to_their_tenants_and_ids() {
    let t = two();
    let a = t.authenticate(Some(b"Bearer key-a")).expect("a");
    assert_eq!((a.name.as_str(), a.id), ("a", request::TenantId(1)));
    // Upper-case hex in the file and a lower-case scheme both work.
    let b = t.authenticate(Some(b"bearer  key-b ")).expect("b");
    assert_eq!((b.name.as_str(), b.id), ("b", request::TenantId(2)));
    assert_eq!(b.max_concurrent, MAX_CONCURRENT_DEFAULT);
}

#[test]
fn wrong_or_missing_keys_are_refused() {
    let t = two();
    let e = |h: Option<&[u8]>| t.authenticate(h).err();
    assert_eq!(e(Some(b"Bearer key-c")), Some(AuthError::Wrong));
    assert_eq!(e(Some(b"Bearer ")), Some(AuthError::Missing));
    assert_eq!(e(Some(b"Basic a2V5LWE=")), Some(AuthError::Missing));
    assert_eq!(e(None), Some(AuthError::Missing));
    let long = [b'x'; API_KEY_BYTES_MAX + 10];
    let mut v = b"Bearer ".to_vec();
    v.extend_from_slice(&long);
    assert_eq!(e(Some(&v)), Some(AuthError::TooLong));
}

#[test]
fn anonymous_accepts_anything() {
    let t = Tenants::anonymous();
    assert_eq!(t.authenticate(None).expect("ok").id, request::TenantId(0));
    assert!(t.authenticate(Some(b"Bearer whatever")).is_ok());
}

#[test]
fn invalid_files_are_refused_with_a_reason() {
    assert!(Tenants::from_toml("")
        .unwrap_err()
        .to_string()
        .contains("no [[tenant]]"));
    let bad_hex = "[[tenant]]\nname = \"a\"\napi_key_sha256 = \"xyz\"\n";
    assert!(Tenants::from_toml(bad_hex)
        .unwrap_err()
        .to_string()
        .contains("64 hex"));
    let h = key_sha256_hex("k");
    let dup = format!(
        "[[tenant]]\nname = \"a\"\napi_key_sha256 = \"{h}\"\n[[tenant]]\nname = \"b\"\napi_key_sha256 = \"{h}\"\n"
    );
    assert!(Tenants::from_toml(&dup)
        .unwrap_err()
        .to_string()
        .contains("same api_key"));
    let unknown = format!("[[tenant]]\nname = \"a\"\napi_key_sha256 = \"{h}\"\nfoo = 1\n");
    assert!(Tenants::from_toml(&unknown)
        .unwrap_err()
        .to_string()
        .contains("foo"));
    let zero = format!("[[tenant]]\nname = \"a\"\napi_key_sha256 = \"{h}\"\nmax_concurrent = 0\n");
    assert!(Tenants::from_toml(&zero)
        .unwrap_err()
        .to_string()
        .contains("positive"));
}

#[test]
fn concurrency_limit_and_release_on_drop() {
    let t = two();
    let a = t.authenticate(Some(b"Bearer key-a")).expect("a");
    let now = Instant::now();
    let p1 = t.admit(&a, 1, now).expect("1st");
    let _p2 = t.admit(&a, 1, now).expect("2nd");
    let e = t.admit(&a, 1, now).unwrap_err();
    assert!(matches!(e, LimitError::Concurrency { limit: 2, .. }));
    assert_eq!(e.retry_after(), 1);
    drop(p1);
    assert_eq!(a.running(), 1);
    assert!(t.admit(&a, 1, now).is_ok());
}

/// A request's sequences (`n` choices) are admitted all or none: their
/// sum meets the limits, and a refusal takes nothing.
#[test]
fn a_requests_sequences_are_admitted_all_or_none() {
    let t = two();
    let a = t.authenticate(Some(b"Bearer key-a")).expect("a");
    let t0 = t.epoch;
    // Three sequences against max_concurrent 2: refused, nothing held.
    let e = t.admit_all(&a, &[1, 1, 1], t0).unwrap_err();
    assert!(matches!(e, LimitError::Concurrency { limit: 2, .. }));
    assert_eq!(a.running(), 0);
    // 2 × 60 tokens against 100 a minute: can never fit, though each
    // alone would (not a 429 to retry forever).
    let e = t.admit_all(&a, &[60, 60], t0).unwrap_err();
    assert!(
        matches!(e, LimitError::RequestTooLarge { need: 120, .. }),
        "{e:?}"
    );
    assert_eq!(a.running(), 0);
    let mut ps = t.admit_all(&a, &[30, 40], t0).expect("70 of 100");
    assert_eq!((ps.len(), a.running()), (2, 2));
    // Each permit refunds its own share: 40 back, 30 stay charged.
    ps[1].refund();
    drop(ps);
    assert_eq!(a.running(), 0);
    let e = t.admit(&a, 71, t0).unwrap_err();
    assert!(
        matches!(e, LimitError::TokensPerMinute { used: 30, .. }),
        "{e:?}"
    );
    assert!(t.admit(&a, 70, t0).is_ok(), "the refusals charged nothing");
}

#[test]
fn tokens_per_minute_slide_and_refund() {
    let t = two();
    let a = t.authenticate(Some(b"Bearer key-a")).expect("a");
    let t0 = t.epoch;
    drop(t.admit(&a, 60, t0).expect("60"));
    let later = t0 + Duration::from_secs(10);
    drop(t.admit(&a, 30, later).expect("90"));
    let e = t.admit(&a, 20, later).unwrap_err();
    match &e {
        LimitError::TokensPerMinute {
            used, retry_after, ..
        } => {
            assert_eq!(*used, 90);
            // The 60 tokens of second 0 expire at second 60.
            assert_eq!(*retry_after, 50);
        }
        other => panic!("{other:?}"),
    }
    // After the window slides past second 0, 60 tokens are free again.
    let slid = t0 + Duration::from_secs(61);
    let mut p = t.admit(&a, 60, slid).expect("after slide");
    p.refund();
    drop(p);
    assert!(t.admit(&a, 70, slid).is_ok(), "refund gave the tokens back");
    let big = t.admit(&a, 101, slid).unwrap_err();
    assert!(matches!(big, LimitError::RequestTooLarge { .. }));
    // It can never fit: a 400 that says so, not a 429 to retry.
    let api: ApiError = big.into();
    assert_eq!(api.status.as_u16(), 400);
    assert_eq!(api.code, Some("request_exceeds_tokens_per_minute"));
    assert_eq!(api.retry_after, None);
    assert!(api.message.contains("never fit"), "{}", api.message);
}
