//! Transfer channel throughput over loopback, plaintext and mutual TLS:
//! one connection, `Page` frames of a SmolLM2 f16 page (30 layers × 16
//! slots × 192 values × 2 bytes × K and V = 368,640 bytes), as a prefill
//! node sends them; the receiver counts delivered `Page` messages.
//!
//! `cargo bench -p transport --bench throughput` (env `TRANSFER_BENCH_MB`,
//! default 1024 MB a run, 3 runs each).

use std::time::{Duration, Instant};
use transfer::RequestId;

use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, KeyPair};
use transfer::node::NetEvent;
use transfer::wire::{Message, WirePage};
use transport::tls::DEFAULT_SERVER_NAME;
use transport::{Transport, TransportConfig, TransportTls};

const PAGE_BYTES: usize = 30 * 16 * 192 * 2 * 2;

fn pki() -> (TransportTls, TransportTls) {
    let ca_key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = p.self_signed(&ca_key).unwrap();
    let node = || {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(vec![DEFAULT_SERVER_NAME.to_string()]).unwrap();
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let c = p.signed_by(&key, &ca, &ca_key).unwrap();
        TransportTls::from_pem(
            c.pem().as_bytes(),
            key.serialize_pem().as_bytes(),
            ca.pem().as_bytes(),
            DEFAULT_SERVER_NAME,
        )
        .unwrap()
    };
    (node(), node())
}

/// Seconds to move `pages` pages from a dialling transport to an accepting
/// one.
fn run(
    rt: &tokio::runtime::Runtime,
    tls: Option<(TransportTls, TransportTls)>,
    pages: usize,
) -> f64 {
    let (a_tls, b_tls) = match tls {
        Some((a, b)) => (Some(a), Some(b)),
        None => (None, None),
    };
    let cfg = |tls| TransportConfig {
        tls,
        queue_frames_max: 64,
        heartbeat_timeout: Duration::from_secs(30),
        ..TransportConfig::default()
    };
    let (atx, mut arx) = tokio::sync::mpsc::channel(1024);
    let (btx, _brx) = tokio::sync::mpsc::channel(1024);
    let a = Transport::new(cfg(a_tls), rt.handle().clone(), atx);
    let b = Transport::new(cfg(b_tls), rt.handle().clone(), btx);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let acc = a.clone();
    rt.spawn(async move {
        let (s, _) = listener.accept().await.unwrap();
        acc.accepted(s).await;
    });
    let conn = rt
        .block_on(b.dial_wait(&addr, |conn| NetEvent::Dialled {
            conn,
            addr: addr.clone(),
        }))
        .unwrap();
    let bytes = vec![0x5Au8; PAGE_BYTES];
    let start = Instant::now();
    let sender = {
        let b = b.clone();
        std::thread::spawn(move || {
            for i in 0..pages {
                let msg = Message::Page {
                    req: RequestId(1),
                    position: i as u32,
                    dst: WirePage {
                        index: i as u32,
                        epoch: 1,
                    },
                    slots: 16,
                    checksum: 0,
                    canary: 0,
                    bytes: bytes.clone(),
                };
                // The queue is bounded (64 frames); wait while it is near
                // full rather than overflow it (a real sender is windowed).
                while b.queued(conn) >= 48 {
                    std::thread::sleep(Duration::from_micros(50));
                }
                b.send(conn, &msg);
            }
        })
    };
    let got = rt.block_on(async {
        let mut n = 0;
        while n < pages {
            match tokio::time::timeout(Duration::from_secs(30), arx.recv()).await {
                Ok(Some(NetEvent::Message {
                    msg: Message::Page { .. },
                    ..
                })) => n += 1,
                Ok(Some(_)) => {}
                _ => break,
            }
        }
        n
    });
    let secs = start.elapsed().as_secs_f64();
    sender.join().unwrap();
    assert_eq!(got, pages, "every page arrives");
    a.close_all();
    b.close_all();
    secs
}

fn main() {
    let mb: usize = std::env::var("TRANSFER_BENCH_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024);
    let pages = (mb << 20) / PAGE_BYTES;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let keys = pki();
    for (name, tls) in [("plaintext", None), ("mutual TLS 1.3", Some(keys))] {
        let mut rates = Vec::new();
        for _ in 0..3 {
            let s = run(&rt, tls.clone(), pages);
            rates.push((pages * PAGE_BYTES) as f64 / s / 1e6);
        }
        rates.sort_by(f64::total_cmp);
        println!(
            "{name:>15}: {pages} pages of {PAGE_BYTES} B: {:.0} MB/s median ({:.0}–{:.0})",
            rates[1], rates[0], rates[2]
        );
    }
}
