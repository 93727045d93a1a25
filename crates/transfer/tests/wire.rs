//! Wire format: every message round-trips; no byte string makes the decoder
//! panic, loop or allocate beyond the limits.

use proptest::prelude::*;
use transfer::wire::{
    GenSpec, GrammarSpec, KvLayout, Message, Refusal, WireError, WireLogprobs, WirePage,
    FRAME_BYTES_MAX, WIRE_VERSION,
};
use transfer::{RequestId, Scope, TenantId};

fn page() -> impl Strategy<Value = WirePage> {
    (any::<u32>(), any::<u64>()).prop_map(|(index, epoch)| WirePage { index, epoch })
}

fn grammar() -> impl Strategy<Value = Option<Box<GrammarSpec>>> {
    proptest::option::of(
        prop_oneof![
            Just(GrammarSpec::JsonObject),
            ("[{}\":a-z0-9 ]{0,40}", any::<bool>())
                .prop_map(|(schema, strict)| GrammarSpec::JsonSchema { schema, strict }),
            "[a-z0-9+*()|✓]{0,20}".prop_map(GrammarSpec::Regex),
            proptest::collection::vec("[a-z✓]{1,8}", 0..5).prop_map(GrammarSpec::Choice),
            "[a-z:\" \n]{0,30}".prop_map(GrammarSpec::Lark),
        ]
        .prop_map(Box::new),
    )
}

fn gen() -> impl Strategy<Value = GenSpec> {
    (
        (grammar(), proptest::collection::vec(any::<u32>(), 0..9)),
        any::<(u32, u32, u32, u32, u32, u32, u32, u64)>(),
        any::<bool>(),
        proptest::option::of(any::<u8>()),
        proptest::collection::vec("[a-z\n✓]{0,8}", 0..4),
        proptest::option::of(any::<u64>()),
        (any::<i32>(), 1..=request::WEIGHT_MAX),
        proptest::option::of(any::<([u8; 16], [u8; 8], u8)>()),
        proptest::collection::vec(any::<(u32, u32)>(), 0..6),
    )
        .prop_map(
            |(
                (grammar, prediction),
                (t, k, p, m, r, pr, f, seed),
                ignore_eos,
                logprobs,
                stop,
                cache_scope,
                (priority, weight),
                trace,
                logit_bias,
            )| GenSpec {
                temperature_bits: t,
                top_k: k,
                top_p_bits: p,
                min_p_bits: m,
                repetition_penalty_bits: r,
                presence_penalty_bits: pr,
                frequency_penalty_bits: f,
                seed,
                ignore_eos,
                logprobs,
                stop,
                logit_bias,
                cache_scope: cache_scope.map(Scope),
                priority,
                weight,
                trace: trace.map(|(trace_id, span_id, flags)| {
                    Box::new(request::trace::TraceContext {
                        trace_id,
                        span_id,
                        flags,
                    })
                }),
                grammar,
                prediction: (!prediction.is_empty()).then(|| prediction.into_boxed_slice()),
            },
        )
}

fn logprobs() -> impl Strategy<Value = Option<WireLogprobs>> {
    proptest::option::of(
        (
            any::<u32>(),
            proptest::collection::vec(any::<(u32, u32)>(), 0..5),
        )
            .prop_map(|(logprob_bits, top)| WireLogprobs { logprob_bits, top }),
    )
}

fn refusal() -> impl Strategy<Value = Refusal> {
    (any::<u16>(), "[a-z_]{0,20}", "[a-zA-Z0-9 éü✓]{0,40}").prop_map(|(status, code, message)| {
        Refusal {
            status,
            code,
            message,
        }
    })
}

fn message() -> impl Strategy<Value = Message> {
    let s = "[a-zA-Z0-9 éü✓]{0,40}";
    prop_oneof![
        (
            any::<u8>(),
            s,
            any::<[u8; 32]>(),
            any::<(u32, u8, u32, u32, u32)>(),
            any::<u32>()
        )
            .prop_map(
                |(role, node, fp, (page_size, dtype, layers, kv_heads, head_dim), m)| {
                    Message::Hello {
                        role,
                        node,
                        model_fingerprint: fp,
                        layout: KvLayout {
                            page_size,
                            dtype,
                            layers,
                            kv_heads,
                            head_dim,
                        },
                        max_request_tokens: m,
                    }
                }
            ),
        s.prop_map(|message| Message::Refuse { message }),
        (
            any::<(u64, u64, u32)>(),
            s,
            proptest::collection::vec(any::<u32>(), 0..50),
            gen()
        )
            .prop_map(|((req, tenant, max_tokens), prefill, tokens, gen)| {
                Message::Reserve {
                    req: RequestId(req),
                    tenant: TenantId(tenant),
                    prefill,
                    tokens,
                    max_tokens,
                    gen,
                }
            }),
        (any::<u64>(), proptest::collection::vec(page(), 0..20)).prop_map(|(req, pages)| {
            Message::Reserved {
                req: RequestId(req),
                pages,
            }
        }),
        (any::<u64>(), refusal()).prop_map(|(req, error)| Message::Rejected {
            req: RequestId(req),
            error
        }),
        (
            any::<(u64, u64, u32)>(),
            s,
            proptest::collection::vec(any::<u32>(), 0..50),
            gen(),
            proptest::collection::vec(page(), 0..8)
        )
            .prop_map(|((req, tenant, max_tokens), decode, tokens, gen, pages)| {
                Message::Prefill {
                    req: RequestId(req),
                    tenant: TenantId(tenant),
                    decode,
                    tokens,
                    max_tokens,
                    gen,
                    pages,
                }
            }),
        (
            any::<(u64, u32, u32, u64, u64)>(),
            page(),
            proptest::collection::vec(any::<u8>(), 0..300)
        )
            .prop_map(|((req, position, slots, checksum, canary), dst, bytes)| {
                Message::Page {
                    req: RequestId(req),
                    position,
                    dst,
                    slots,
                    checksum,
                    canary,
                    bytes,
                }
            }),
        (
            any::<(u64, u32, u64, u32, u32, u64)>(),
            any::<u32>(),
            logprobs()
        )
            .prop_map(
                |(
                    (req, first_token, sampler_state, page_count, token_count, digest),
                    cached_tokens,
                    lp,
                )| {
                    Message::Done {
                        req: RequestId(req),
                        first_token,
                        first_logprobs: lp,
                        sampler_state,
                        page_count,
                        token_count,
                        cached_tokens,
                        digest,
                    }
                }
            ),
        (any::<u64>(), refusal()).prop_map(|(req, error)| Message::Abort {
            req: RequestId(req),
            error
        }),
        any::<(u64, u32)>().prop_map(|(req, pages)| Message::Ack {
            req: RequestId(req),
            pages
        }),
        any::<u64>().prop_map(|req| Message::Closed {
            req: RequestId(req)
        }),
        any::<u64>().prop_map(|req| Message::Cancel {
            req: RequestId(req)
        }),
        (any::<(u64, u32, u32)>(), s, logprobs()).prop_map(|((req, index, id), text, logprobs)| {
            Message::Token {
                req: RequestId(req),
                index,
                id,
                text,
                logprobs,
            }
        }),
        (
            any::<(u64, u8, u32, u32, u32, u32)>(),
            any::<(u32, u32)>(),
            s
        )
            .prop_map(
                |(
                    (req, finish, prompt_tokens, cached_tokens, completion_tokens, streamed),
                    (accepted, rejected),
                    tail_text,
                )| {
                    Message::Finished {
                        req: RequestId(req),
                        finish,
                        prompt_tokens,
                        cached_tokens,
                        completion_tokens,
                        streamed,
                        prediction: transfer::wire::PredictionCounts { accepted, rejected },
                        tail_text,
                    }
                }
            ),
        any::<u64>().prop_map(|nonce| Message::Heartbeat { nonce }),
        (any::<u32>(), any::<u32>(), any::<u32>(), any::<u32>()).prop_map(
            |(queued, running, pages_free, pages_total)| Message::Load {
                queued,
                running,
                pages_free,
                pages_total,
            }
        ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn every_message_round_trips(msgs in proptest::collection::vec(message(), 1..6)) {
        let mut buf = Vec::new();
        for m in &msgs {
            m.encode(&mut buf);
        }
        // Decode as a stream, also fed in two pieces at an arbitrary cut.
        let mut off = 0;
        for m in &msgs {
            let (got, used) = Message::decode(&buf[off..]).unwrap().expect("whole frame");
            prop_assert_eq!(&got, m);
            off += used;
        }
        prop_assert_eq!(off, buf.len());
    }

    #[test]
    fn prefixes_are_incomplete_never_errors(m in message()) {
        let mut buf = Vec::new();
        m.encode(&mut buf);
        for cut in 0..buf.len() {
            prop_assert_eq!(Message::decode(&buf[..cut]), Ok(None));
        }
    }

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let _ = Message::decode(&bytes);
    }

    #[test]
    fn corrupted_frames_never_panic(m in message(), flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
        let mut buf = Vec::new();
        m.encode(&mut buf);
        for (at, x) in flips {
            let i = at % buf.len();
            buf[i] ^= x | 1;
        }
        let _ = Message::decode(&buf);
    }
}

#[test]
fn oversized_frame_is_refused_from_its_header() {
    let len = (FRAME_BYTES_MAX as u32 + 1).to_le_bytes();
    assert!(matches!(
        Message::decode(&len),
        Err(WireError::FrameTooLarge { .. })
    ));
}

#[test]
fn hostile_counts_are_refused_before_allocation() {
    // A Reserved frame claiming 2^31 pages in a 20-byte body.
    let mut body = vec![WIRE_VERSION, 3];
    body.extend_from_slice(&7u64.to_le_bytes());
    body.extend_from_slice(&(1u32 << 31).to_le_bytes());
    body.extend_from_slice(&[0; 8]); // the frame check
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    assert!(matches!(
        Message::decode(&frame),
        Err(WireError::TooLong { .. })
    ));
    // A page claiming more bytes than the frame holds.
    let mut buf = Vec::new();
    Message::Page {
        req: RequestId(1),
        position: 0,
        dst: WirePage { index: 0, epoch: 1 },
        slots: 1,
        checksum: 0,
        canary: 0,
        bytes: vec![1; 8],
    }
    .encode(&mut buf);
    let n = buf.len();
    buf[n - 20..n - 16].copy_from_slice(&1000u32.to_le_bytes());
    assert!(matches!(
        Message::decode(&buf),
        Err(WireError::Truncated { .. })
    ));
}

#[test]
fn other_versions_and_kinds_are_refused() {
    let mut buf = Vec::new();
    Message::Cancel { req: RequestId(1) }.encode(&mut buf);
    let mut v2 = buf.clone();
    v2[4] = WIRE_VERSION + 1;
    assert!(matches!(
        Message::decode(&v2),
        Err(WireError::Version { .. })
    ));
    let mut k = buf.clone();
    k[5] = 200;
    assert!(matches!(
        Message::decode(&k),
        Err(WireError::UnknownKind(200))
    ));
    let mut trailing = buf.clone();
    let at = trailing.len() - 8;
    trailing.insert(at, 0);
    let n = (trailing.len() - 4) as u32;
    trailing[..4].copy_from_slice(&n.to_le_bytes());
    assert!(matches!(
        Message::decode(&trailing),
        Err(WireError::Trailing { .. })
    ));
}

#[test]
fn a_weight_outside_one_to_the_maximum_is_refused() {
    for (weight, ok) in [
        (0, false),
        (1, true),
        (request::WEIGHT_MAX, true),
        (request::WEIGHT_MAX + 1, false),
    ] {
        let mut buf = Vec::new();
        Message::Reserve {
            req: RequestId(1),
            tenant: TenantId(2),
            prefill: "p".into(),
            tokens: vec![1, 2],
            max_tokens: 3,
            gen: GenSpec {
                weight,
                priority: -5,
                ..GenSpec::greedy()
            },
        }
        .encode(&mut buf);
        match Message::decode(&buf) {
            Ok(Some((Message::Reserve { gen, .. }, _))) if ok => {
                assert_eq!((gen.weight, gen.priority), (weight, -5));
            }
            Err(WireError::Invalid { what: "weight" }) if !ok => {}
            other => panic!("weight {weight}: {other:?}"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    /// A flipped bit anywhere after the length prefix is an error — never a
    /// different message — except inside a Page's KV bytes, which the page
    /// checksum (K6) covers instead (decode checks it against its
    /// reservation).
    #[test]
    fn a_flipped_bit_is_never_a_different_message(m in message(), at in any::<prop::sample::Index>(), bit in 0u8..8) {
        let mut buf = Vec::new();
        m.encode(&mut buf);
        let i = 4 + at.index(buf.len() - 4);
        buf[i] ^= 1 << bit;
        match Message::decode(&buf) {
            Err(_) => {}
            Ok(None) => prop_assert!(false, "a whole frame became a partial one"),
            Ok(Some((got, _))) => {
                let (Message::Page { bytes: a, .. }, Message::Page { bytes: b, .. }) = (&m, &got) else {
                    return Err(TestCaseError::fail(format!("{} decoded as {:?}", m.kind_name(), got)));
                };
                let mut same = got.clone();
                if let Message::Page { bytes, .. } = &mut same { bytes.clone_from(a); }
                prop_assert_eq!(&same, &m, "only the KV bytes may differ");
                prop_assert_ne!(a, b);
            }
        }
    }
}
