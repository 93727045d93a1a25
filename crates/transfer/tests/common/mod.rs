//! What the gateway-machine tests share: a node identity and a gateway over
//! prefill p0, p1 (nodes 0, 1; conns 10, 11) and decode d0, d1 (nodes 2,
//! 3; conns 20, 21), every link up.

use transfer::gateway::{Gateway, GatewayAction, GatewayConfig};
use transfer::wire::{KvLayout, Message, ROLE_DECODE, ROLE_GATEWAY, ROLE_PREFILL};
use transfer::Identity;

pub const LAYOUT: KvLayout = KvLayout {
    page_size: 16,
    dtype: 1,
    layers: 2,
    kv_heads: 1,
    head_dim: 32,
};

pub fn identity(node: &str) -> Identity {
    Identity {
        node: node.into(),
        fingerprint: [7; 32],
        layout: LAYOUT,
        max_request_tokens: 1000,
    }
}

pub fn gateway() -> Gateway {
    let mut gw = Gateway::new(GatewayConfig {
        identity: identity("gw"),
        model_window_tokens: 1000,
        requests_max: 64,
        prefill: vec!["p0:1".into(), "p1:1".into()],
        decode: vec!["d0:1".into(), "d1:1".into()],
        placements_max: transfer::gateway::PLACEMENTS_MAX,
    });
    let mut out = Vec::new();
    for (node, conn, name, role) in [
        (0, 10, "p0", ROLE_PREFILL),
        (1, 11, "p1", ROLE_PREFILL),
        (2, 20, "d0", ROLE_DECODE),
        (3, 21, "d1", ROLE_DECODE),
    ] {
        gw.connected(node, conn, &mut out);
        gw.message(conn, identity(name).hello(role), &mut out);
    }
    // The gateway said only its own Hello on each link.
    assert!(out.iter().all(|a| matches!(
        a,
        GatewayAction::Send {
            msg: Message::Hello {
                role: ROLE_GATEWAY,
                ..
            },
            ..
        }
    )));
    assert!(gw.ready());
    gw
}
