//! Mutual TLS on the transfer channel (K14), over loopback: peers with the
//! operator's CA talk; a peer with a certificate from another CA, with no
//! certificate, or speaking plaintext is refused in the handshake — no
//! frame of it is ever delivered — and counted; a dialling node refuses a
//! server from another CA or without the agreed name; handshakes in
//! progress count against the connection limit.
//!
//! Mutation: `a_node_without_client_auth_lets_a_certificateless_peer_in`
//! runs the no-certificate scenario against an acceptor built without the
//! client-certificate check and shows it then gets in — so removing the
//! check fails `a_peer_without_a_certificate_is_refused_unread_and_counted`.

use std::io::{Read, Write};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use transfer::RequestId;

use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair};
use transfer::node::NetEvent;
use transfer::wire::Message;
use transport::tls::DEFAULT_SERVER_NAME;
use transport::{Transport, TransportConfig, TransportTls};

/// A CA and what it signs.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        Ca {
            cert: p.self_signed(&key).unwrap(),
            key,
        }
    }

    /// (certificate PEM, key PEM) of a node certificate naming `san`.
    fn node(&self, san: &str) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(vec![san.to_string()]).unwrap();
        p.distinguished_name.push(DnType::CommonName, "node");
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn pem(&self) -> String {
        self.cert.pem()
    }

    /// A node's TLS: its certificate from `self`, trusting `trust`.
    fn tls(&self, trust: &Ca, san: &str, server_name: &str) -> TransportTls {
        let (c, k) = self.node(san);
        TransportTls::from_pem(
            c.as_bytes(),
            k.as_bytes(),
            trust.pem().as_bytes(),
            server_name,
        )
        .unwrap()
    }
}

struct Node {
    rt: tokio::runtime::Runtime,
    t: Arc<Transport>,
    rx: tokio::sync::mpsc::Receiver<NetEvent>,
    addr: std::net::SocketAddr,
}

/// A transport on 127.0.0.1 accepting every connection.
fn node(cfg: TransportConfig) -> Node {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    let t = Transport::new(cfg, rt.handle().clone(), tx);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let acc = t.clone();
    rt.spawn(async move {
        for _ in 0..64 {
            let Ok((s, _)) = listener.accept().await else {
                return;
            };
            acc.accepted(s).await;
        }
    });
    Node { rt, t, rx, addr }
}

fn tls_cfg(tls: TransportTls) -> TransportConfig {
    TransportConfig {
        tls: Some(tls),
        handshake_timeout: Duration::from_secs(2),
        ..TransportConfig::default()
    }
}

/// Every event within `wait`.
fn events(n: &mut Node, wait: Duration) -> Vec<NetEvent> {
    let rx = &mut n.rx;
    n.rt.block_on(async {
        let mut out = Vec::new();
        while let Ok(Some(ev)) = tokio::time::timeout(wait, rx.recv()).await {
            out.push(ev);
        }
        out
    })
}

fn refused(n: &Node) -> u64 {
    n.t.stats
        .tls_handshakes_refused_total
        .load(Ordering::Relaxed)
}

fn frame(msg: &Message) -> Vec<u8> {
    let mut f = Vec::new();
    msg.encode(&mut f);
    f
}

/// `client` dials `server` and sends a Cancel: what `server` saw.
fn exchange(server: &mut Node, client: &Node) -> Result<Vec<NetEvent>, String> {
    let addr = server.addr.to_string();
    let conn = client
        .rt
        .block_on(client.t.dial_wait(&addr, |conn| NetEvent::Dialled {
            conn,
            addr: addr.clone(),
        }))
        .map_err(|e| e.to_string())?;
    client.t.send(conn, &Message::Cancel { req: RequestId(7) });
    Ok(events(server, Duration::from_millis(700)))
}

fn got_cancel(evs: &[NetEvent]) -> bool {
    evs.iter().any(|e| {
        matches!(
            e,
            NetEvent::Message {
                msg: Message::Cancel { req: RequestId(7) },
                ..
            }
        )
    })
}

#[test]
fn peers_with_the_operators_ca_talk_over_tls() {
    let ca = Ca::new("operator");
    let name = DEFAULT_SERVER_NAME;
    let mut a = node(tls_cfg(ca.tls(&ca, name, name)));
    let b = node(tls_cfg(ca.tls(&ca, name, name)));
    let evs = exchange(&mut a, &b).unwrap();
    assert!(matches!(evs[0], NetEvent::Accepted { .. }), "{evs:?}");
    assert!(got_cancel(&evs), "{evs:?}");
    assert_eq!((refused(&a), refused(&b)), (0, 0));
    // The bytes on the wire are not the frame: a Cancel's encoding does
    // not appear in what the server received (it counted TLS records).
    assert!(a.t.stats.bytes_received_total.load(Ordering::Relaxed) > 0);
}

#[test]
fn a_peer_with_a_certificate_from_another_ca_is_refused_unread_and_counted() {
    let ca = Ca::new("operator");
    let other = Ca::new("stranger");
    let name = DEFAULT_SERVER_NAME;
    let mut a = node(tls_cfg(ca.tls(&ca, name, name)));
    // The stranger trusts the operator's CA (so it accepts the server) but
    // presents a certificate the operator never signed.
    let b = node(tls_cfg(other.tls(&ca, name, name)));
    let evs = exchange(&mut a, &b).unwrap_or_default();
    assert!(evs.is_empty(), "a foreign peer reached the node: {evs:?}");
    assert_eq!(refused(&a), 1);
    assert_eq!(a.t.stats.frames_received_total.load(Ordering::Relaxed), 0);
}

/// A TLS client that presents no certificate: does its Cancel get through?
fn scenario_no_certificate(server_tls: TransportTls, ca: &Ca) -> Result<(), String> {
    let mut a = node(tls_cfg(server_tls));
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    roots
        .add(
            rustls_pki_der(&ca.pem()), // the client trusts the operator's CA
        )
        .unwrap();
    #[allow(deprecated)] // as the transport's own provider (tls.rs)
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let cfg = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let addr = a.addr;
    let sent = a.rt.block_on(async move {
        let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
        let name = tokio_rustls::rustls::pki_types::ServerName::try_from(DEFAULT_SERVER_NAME)
            .unwrap()
            .to_owned();
        let mut s = connector.connect(name, tcp).await.ok()?;
        use tokio::io::AsyncWriteExt;
        s.write_all(&frame(&Message::Cancel { req: RequestId(7) }))
            .await
            .ok()?;
        s.flush().await.ok()?;
        // Keep the stream open while the node reads.
        tokio::time::sleep(Duration::from_millis(300)).await;
        Some(())
    });
    let evs = events(&mut a, Duration::from_millis(500));
    if got_cancel(&evs) || evs.iter().any(|e| matches!(e, NetEvent::Accepted { .. })) {
        return Err(format!(
            "a certificateless peer got in (sent: {sent:?}): {evs:?}"
        ));
    }
    if refused(&a) != 1 {
        return Err(format!("refusals counted: {}", refused(&a)));
    }
    Ok(())
}

fn rustls_pki_der(pem: &str) -> tokio_rustls::rustls::pki_types::CertificateDer<'static> {
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    tokio_rustls::rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
}

#[test]
fn a_peer_without_a_certificate_is_refused_unread_and_counted() {
    let ca = Ca::new("operator");
    let name = DEFAULT_SERVER_NAME;
    scenario_no_certificate(ca.tls(&ca, name, name), &ca).unwrap();
}

#[test]
fn a_node_without_client_auth_lets_a_certificateless_peer_in() {
    let ca = Ca::new("operator");
    let (c, k) = ca.node(DEFAULT_SERVER_NAME);
    let open = TransportTls::without_client_auth_for_tests(
        c.as_bytes(),
        k.as_bytes(),
        ca.pem().as_bytes(),
        DEFAULT_SERVER_NAME,
    )
    .unwrap();
    assert!(scenario_no_certificate(open, &ca).is_err());
}

#[test]
fn a_plaintext_peer_is_refused_before_any_frame_is_read() {
    let ca = Ca::new("operator");
    let name = DEFAULT_SERVER_NAME;
    let mut a = node(tls_cfg(ca.tls(&ca, name, name)));
    let mut s = std::net::TcpStream::connect(a.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&frame(&Message::Cancel { req: RequestId(7) }))
        .unwrap();
    // The node ends the connection (an alert at most, never a frame).
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    assert!(buf.len() < 64, "{} bytes came back", buf.len());
    let evs = events(&mut a, Duration::from_millis(300));
    assert!(evs.is_empty(), "{evs:?}");
    assert_eq!(refused(&a), 1);
    assert_eq!(a.t.stats.frames_received_total.load(Ordering::Relaxed), 0);
}

#[test]
fn a_dialler_refuses_a_server_from_another_ca_or_without_the_name() {
    let ca = Ca::new("operator");
    let other = Ca::new("stranger");
    let name = DEFAULT_SERVER_NAME;
    // A server whose certificate the operator never signed.
    let mut rogue = node(tls_cfg(other.tls(&other, name, name)));
    let b = node(tls_cfg(ca.tls(&ca, name, name)));
    let err = exchange(&mut rogue, &b).unwrap_err();
    assert!(err.contains("TLS handshake"), "{err}");
    assert_eq!(refused(&b), 1);
    // A server from the right CA whose certificate names something else.
    let mut misnamed = node(tls_cfg(ca.tls(&ca, "some-other-service", name)));
    let err = exchange(&mut misnamed, &b).unwrap_err();
    assert!(err.contains("TLS handshake"), "{err}");
    assert_eq!(refused(&b), 2);
    assert!(events(&mut rogue, Duration::from_millis(100))
        .iter()
        .all(|e| !matches!(e, NetEvent::Message { .. })));
}

#[test]
fn a_silent_handshake_holds_a_slot_until_its_timeout() {
    let ca = Ca::new("operator");
    let name = DEFAULT_SERVER_NAME;
    let cfg = TransportConfig {
        connections_max: 1,
        ..tls_cfg(ca.tls(&ca, name, name))
    };
    let mut a = node(cfg);
    // Connects and says nothing: the handshake waits, holding the slot.
    let silent = std::net::TcpStream::connect(a.addr).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mut second = std::net::TcpStream::connect(a.addr).unwrap();
    second
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut buf = [0u8; 8];
    assert_eq!(second.read(&mut buf).unwrap(), 0, "closed unread");
    assert_eq!(
        a.t.stats.connections_refused_total.load(Ordering::Relaxed),
        1
    );
    // After the handshake timeout (2 s) the silent one is refused too and
    // its slot is free: a real peer gets in.
    std::thread::sleep(Duration::from_millis(2300));
    assert_eq!(refused(&a), 1);
    drop(silent);
    let b = node(tls_cfg(ca.tls(&ca, name, name)));
    let evs = exchange(&mut a, &b).unwrap();
    assert!(got_cancel(&evs), "{evs:?}");
}
