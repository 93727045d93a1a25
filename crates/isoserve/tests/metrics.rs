//! Metrics as data: each source declares its families once, in a table
//! (`server::metrics::SERVER_FAMILIES`, `gateway::GATEWAY_FAMILIES`,
//! `pd::node::NODE_METRICS`, `gateway::nodes::NODE_SCRAPE_FAMILIES`).
//! These tests fail when a source exports a family its table does not
//! declare (or declares it unlike it exports it), and when a name is
//! declared twice across the tables (a gateway's `/metrics` shows them
//! all at once).

use std::collections::BTreeSet;
use std::sync::Arc;

use request::{EngineStats, MetricKind, MetricSample, PoolStats};
use telemetry::metrics::{check, Family};
use transfer::gateway::{Gateway, GatewayConfig};
use transfer::wire::{KvLayout, ROLE_DECODE, ROLE_PREFILL};
use transfer::Identity;
use transport::{Transport, TransportConfig};

fn tables() -> Vec<Vec<Family>> {
    vec![
        server::metrics::SERVER_FAMILIES.to_vec(),
        gateway::GATEWAY_FAMILIES.to_vec(),
        pd::node::node_families(),
        gateway::nodes::NODE_SCRAPE_FAMILIES.to_vec(),
    ]
}

fn with_tables<T>(f: impl FnOnce(&[&[Family]]) -> T) -> T {
    let t = tables();
    let refs: Vec<&[Family]> = t.iter().map(Vec::as_slice).collect();
    f(&refs)
}

/// A transport with nothing connected (its counters are what is read).
fn transport(rt: &tokio::runtime::Runtime) -> Arc<Transport> {
    let (tx, _rx) = tokio::sync::mpsc::channel(8);
    Transport::new(TransportConfig::default(), rt.handle().clone(), tx)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn identity(node: &str) -> Identity {
    Identity {
        node: node.into(),
        fingerprint: [7; 32],
        layout: KvLayout {
            layers: 2,
            kv_heads: 1,
            head_dim: 4,
            page_size: 4,
            dtype: 0,
        },
        max_request_tokens: 1000,
    }
}

/// A gateway paired with one node of each role, each of which reported
/// its load and limit: every family it can export is exported.
fn gateway_samples() -> Vec<MetricSample> {
    let rt = runtime();
    let t = transport(&rt);
    let mut gw = Gateway::new(GatewayConfig {
        identity: identity("gw"),
        model_window_tokens: 1000,
        requests_max: 64,
        prefill: vec!["p0:1".into()],
        decode: vec!["d0:1".into()],
        placements_max: 1,
    });
    let mut out = Vec::new();
    for (node, conn, name, role) in [(0, 10, "p0", ROLE_PREFILL), (1, 20, "d0", ROLE_DECODE)] {
        gw.connected(node, conn, &mut out);
        gw.message(conn, identity(name).hello(role), &mut out);
        gw.message(
            conn,
            transfer::wire::Message::Load {
                queued: 1,
                running: 2,
                pages_free: 3,
                pages_total: 4,
            },
            &mut out,
        );
    }
    gateway::gateway_samples(&gw, &t, 0)
}

/// A node's samples, with both roles' counters present (and a draft
/// model's).
fn node_samples() -> Vec<MetricSample> {
    let rt = runtime();
    let t = transport(&rt);
    let stats = pd::role::PdStats {
        prefill: Some(Default::default()),
        decode: Some(Default::default()),
        engine: EngineStats {
            draft_pool: Some(PoolStats::default()),
            ..Default::default()
        },
        ..Default::default()
    };
    pd::node::node_samples(&stats, &t)
}

/// Every declared family, pinned: a family dropped from a table (its
/// samples with it) fails here, where "exports equal declarations" cannot
/// see it. The node's and the gateway's were checked equal, name, kind
/// and help, to what they exported before the tables (issue 33).
#[test]
fn the_declared_families_are_as_recorded() {
    let mut out = String::new();
    for (source, table) in ["server", "gateway", "node", "gateway's nodes"]
        .into_iter()
        .zip(tables())
    {
        out += &format!("## {source}\n");
        for f in table {
            out += &format!("{} {:?} {:?}: {}\n", f.name, f.kind, f.labels, f.help);
        }
    }
    expect_test::expect_file!["golden/metric-families.txt"].assert_eq(&out);
}

#[test]
fn no_family_is_declared_twice_across_the_sources() {
    with_tables(|t| check(t, &[])).expect("one declaration per name");
}

#[test]
fn a_node_exports_exactly_its_declared_families() {
    let samples = node_samples();
    check(&[&pd::node::node_families()], &samples).expect("declared");
    let names: BTreeSet<&str> = samples.iter().map(|s| s.name.as_str()).collect();
    let declared: BTreeSet<&str> = pd::node::node_families().iter().map(|f| f.name).collect();
    assert_eq!(names, declared, "a declared family no node exports");
}

#[test]
fn a_gateway_exports_exactly_its_declared_families() {
    let samples = gateway_samples();
    check(&[gateway::GATEWAY_FAMILIES], &samples).expect("declared");
    let names: BTreeSet<&str> = samples.iter().map(|s| s.name.as_str()).collect();
    let declared: BTreeSet<&str> = gateway::GATEWAY_FAMILIES.iter().map(|f| f.name).collect();
    // Retired and draining nodes' gauges appear only for such nodes.
    let missing: Vec<&&str> = declared.difference(&names).collect();
    assert_eq!(
        missing,
        [
            &"isoserve_gateway_node_draining",
            &"isoserve_gateway_node_retired"
        ],
        "declared families the gateway never exports"
    );
}

/// The HTTP layer's `/metrics` over a PD gateway with node scraping: the
/// server's own families, the engine's, the gateway's and the nodes'
/// (under `node`). Every `# TYPE` line names a declared family of that
/// kind, and every declared family of the server appears.
#[test]
fn every_family_on_a_gateways_metrics_page_is_declared() {
    let m = server::metrics::Metrics::new();
    m.tenant_finished("alice", &request::Usage::default(), 0.1);
    let stats = EngineStats {
        pool: PoolStats {
            pages_total: 8,
            pages_free: 8,
            ..Default::default()
        },
        // With a draft model (--draft-model): its pool's families too.
        draft_pool: Some(PoolStats {
            pages_total: 8,
            pages_free: 8,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut backend = gateway_samples();
    backend.extend(
        node_samples()
            .into_iter()
            .map(|s| s.label("node", "d0".to_string())),
    );
    backend.push(gateway::nodes::SCRAPE_OK.sample(1.0).label("node", "d0"));
    backend.extend([
        tenant_sample("isoserve_tenant_requests", "alice").label("state", "running"),
        tenant_sample("isoserve_tenant_weight", "alice"),
        tenant_sample("isoserve_tenant_service", "alice"),
    ]);
    with_tables(|t| check(t, &backend)).expect("the backend's samples are declared");
    let text = m.render(stats, Default::default(), backend);
    let mut exported = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
        let kind = match kind {
            "counter" => MetricKind::Counter,
            "gauge" => MetricKind::Gauge,
            "histogram" => MetricKind::Histogram,
            other => panic!("{name}: type {other}"),
        };
        let declared = tables()
            .into_iter()
            .flatten()
            .find(|f| f.name == name)
            .unwrap_or_else(|| panic!("{name} is exported but not declared"));
        assert_eq!(declared.kind, kind, "{name}");
        exported.insert(name.to_string());
    }
    for f in server::metrics::SERVER_FAMILIES {
        assert!(
            exported.contains(f.name),
            "{} is declared, never exported",
            f.name
        );
    }
}

/// A tenant sample as the server makes it (its families are private to
/// the server; the test reads them from the table by name).
fn tenant_sample(name: &str, tenant: &str) -> MetricSample {
    let f = server::metrics::SERVER_FAMILIES
        .iter()
        .find(|f| f.name == name)
        .expect("declared");
    f.sample(1.0).label("tenant", tenant)
}
