//! The transport's limit on live connections: one past it is closed
//! unread and counted, the ones within it stay up. Loopback only.

use std::io::Read;
use std::sync::atomic::Ordering;
use std::time::Duration;

use transfer::node::NetEvent;
use transport::{Transport, TransportConfig};

/// A node's transport on 127.0.0.1 that hands its first `accepts`
/// connections to `Transport::accepted`: (runtime, transport, its events,
/// its address).
fn node(
    cfg: TransportConfig,
    accepts: usize,
) -> (
    tokio::runtime::Runtime,
    std::sync::Arc<Transport>,
    tokio::sync::mpsc::Receiver<NetEvent>,
    std::net::SocketAddr,
) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let t = Transport::new(cfg, rt.handle().clone(), tx);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let acc = t.clone();
    rt.spawn(async move {
        for _ in 0..accepts {
            let (s, _) = listener.accept().await.unwrap();
            acc.accepted(s).await;
        }
    });
    (rt, t, rx, addr)
}

#[test]
fn a_connection_past_the_limit_is_closed_unread_and_counted() {
    let cfg = TransportConfig {
        connections_max: 2,
        ..TransportConfig::default()
    };
    let (rt, t, mut rx, addr) = node(cfg, 3);
    let mut clients = Vec::new();
    for _ in 0..3 {
        let c = std::net::TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        clients.push(c);
        // One at a time, so the third is the one past the limit.
        std::thread::sleep(Duration::from_millis(200));
    }
    // The third sees its connection end without a byte.
    let mut buf = [0u8; 16];
    assert_eq!(clients[2].read(&mut buf).unwrap(), 0);
    assert_eq!(t.stats.connections_refused_total.load(Ordering::Relaxed), 1);
    assert_eq!(t.stats.connections_total.load(Ordering::Relaxed), 2);
    let accepted = rt.block_on(async {
        let mut n = 0;
        while let Ok(Some(ev)) = tokio::time::timeout(Duration::from_millis(300), rx.recv()).await {
            n += usize::from(matches!(ev, NetEvent::Accepted { .. }));
        }
        n
    });
    assert_eq!(accepted, 2);
    // The first two are still open: a heartbeat arrives within a second.
    clients[0]
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    assert!(clients[0].read(&mut buf).unwrap() > 0);
}

/// One peer address cannot take every slot of a node (K13): past its own
/// limit its connections are closed unread and counted, while another
/// address still gets in. Clients bind distinct loopback addresses.
#[test]
fn one_peer_past_its_limit_is_refused_while_another_gets_in() {
    let cfg = TransportConfig {
        connections_per_peer_max: 3,
        ..TransportConfig::default()
    };
    let (rt, t, mut rx, addr) = node(cfg, 6);
    let from = |ip: &str| {
        let s = socket2_connect(ip, addr);
        std::thread::sleep(Duration::from_millis(100));
        s
    };
    let mut noisy: Vec<_> = (0..5).map(|_| from("127.0.0.2")).collect();
    let other = from("127.0.0.3");
    let mut buf = [0u8; 16];
    // The fourth and fifth of 127.0.0.2 end without a byte.
    for c in &mut noisy[3..] {
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(c.read(&mut buf).unwrap(), 0);
    }
    assert_eq!(t.stats.connections_refused_total.load(Ordering::Relaxed), 2);
    let accepted = rt.block_on(async {
        let mut n = 0;
        while let Ok(Some(ev)) = tokio::time::timeout(Duration::from_millis(300), rx.recv()).await {
            n += usize::from(matches!(ev, NetEvent::Accepted { .. }));
        }
        n
    });
    assert_eq!(accepted, 4, "three of 127.0.0.2, one of 127.0.0.3");
    drop(other);
}

/// A TCP connection to `addr` from the loopback address `ip`.
fn socket2_connect(ip: &str, addr: std::net::SocketAddr) -> std::net::TcpStream {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind(format!("{ip}:0").parse().unwrap()).unwrap();
        let std = s.connect(addr).await.unwrap().into_std().unwrap();
        // tokio's sockets are non-blocking; the test reads blocking.
        std.set_nonblocking(false).unwrap();
        std
    })
}
