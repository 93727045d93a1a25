//! Fair share of a PD node's pages between tenants (K13), on the
//! production state machines: when pages free up, the waiting request of
//! the tenant holding the fewest pages per weight gets them, not the
//! oldest; a tenant's own requests go by priority. Replacing
//! `transfer::fair::next` with "the first in line" (FIFO, what the nodes
//! did before) fails every test here.

use kv::{Pool, PoolOptions};
use testkit::world::{identity, shape, VOCAB};
use transfer::decode::{DecodeAction, DecodeConfig, DecodeNode};
use transfer::prefill::{PrefillAction, PrefillConfig, PrefillNode};
use transfer::wire::{GenSpec, Message, WirePage, ROLE_GATEWAY};
use transfer::ConnId;
use transfer::{RequestId, TenantId};

const PAGE_TOKENS: u32 = 4;
const POOL_PAGES: u64 = 16;
const GATEWAY: ConnId = 1;

fn gen(priority: i32, weight: u32) -> GenSpec {
    GenSpec {
        priority,
        weight,
        ..GenSpec::greedy()
    }
}

/// A prompt of `pages` whole pages.
fn prompt(pages: u32) -> Vec<u32> {
    (0..pages * PAGE_TOKENS).map(|i| i % VOCAB).collect()
}

fn decode_node() -> (DecodeNode, Pool) {
    let pool = Pool::new(shape(PAGE_TOKENS), POOL_PAGES, PoolOptions::default()).expect("pool");
    let mut node = DecodeNode::new(DecodeConfig {
        identity: identity("decode-0", PAGE_TOKENS, 1024),
        vocab: VOCAB,
        requests_max: 32,
        waiting_max: 32,
        ack_every_pages: 4,
    });
    let mut out = Vec::new();
    node.connected(GATEWAY, &mut out);
    let mut pool = pool;
    let hello = identity("gateway", PAGE_TOKENS, 0).hello(ROLE_GATEWAY);
    node.message(&mut pool, GATEWAY, hello, &mut out);
    (node, pool)
}

/// Requests decode answered `Reserved` in `out`, in order.
fn reserved(out: &[DecodeAction]) -> Vec<u64> {
    out.iter()
        .filter_map(|a| match a {
            DecodeAction::Send {
                msg: Message::Reserved { req, .. },
                ..
            } => Some(req.0),
            _ => None,
        })
        .collect()
}

/// Reserves a request of 8 pages (4 of prompt, 16 tokens to generate).
fn reserve(node: &mut DecodeNode, pool: &mut Pool, req: u64, tenant: u64, g: GenSpec) -> Vec<u64> {
    reserve_pages(node, pool, req, tenant, g, 8)
}

/// Reserves a request of `pages` pages (half of them prompt).
fn reserve_pages(
    node: &mut DecodeNode,
    pool: &mut Pool,
    req: u64,
    tenant: u64,
    g: GenSpec,
    pages: u32,
) -> Vec<u64> {
    let mut out = Vec::new();
    let msg = Message::Reserve {
        req: RequestId(req),
        tenant: TenantId(tenant),
        prefill: "prefill-0".into(),
        tokens: prompt(pages / 2),
        max_tokens: pages / 2 * PAGE_TOKENS,
        gen: g,
    };
    node.message(pool, GATEWAY, msg, &mut out);
    reserved(&out)
}

fn cancel_decode(node: &mut DecodeNode, pool: &mut Pool, req: u64) -> Vec<u64> {
    let mut out = Vec::new();
    node.message(
        pool,
        GATEWAY,
        Message::Cancel {
            req: RequestId(req),
        },
        &mut out,
    );
    reserved(&out)
}

#[test]
fn decode_gives_freed_pages_to_the_tenant_holding_fewest_not_to_the_oldest_waiter() {
    let (mut node, mut pool) = decode_node();
    // Tenant 1 fills the pool (2 × 8 pages) and queues two more.
    assert_eq!(reserve(&mut node, &mut pool, 1, 1, gen(0, 1)), [1]);
    assert_eq!(reserve(&mut node, &mut pool, 2, 1, gen(0, 1)), [2]);
    assert_eq!(reserve(&mut node, &mut pool, 3, 1, gen(0, 1)), []);
    assert_eq!(reserve(&mut node, &mut pool, 4, 1, gen(0, 1)), []);
    // Tenant 2 arrives last.
    assert_eq!(reserve(&mut node, &mut pool, 5, 2, gen(0, 1)), []);
    assert_eq!(pool.pages_available(), 0);
    // Pages free up: tenant 2 (holding none) gets them, not request 3.
    assert_eq!(cancel_decode(&mut node, &mut pool, 1), [5]);
    // Tenant 1's next request arrives at a better priority than its
    // queued ones; it goes first among tenant 1's once tenant 1 is the
    // one holding fewer pages (8 each: the earlier arrival, tenant 1's
    // best request).
    assert_eq!(reserve(&mut node, &mut pool, 6, 1, gen(-1, 1)), []);
    assert_eq!(cancel_decode(&mut node, &mut pool, 2), [6]);
    assert_eq!(pool.pages_available(), 0);
    assert_eq!(
        pool.stats().pages_leased,
        8,
        "two prompts' pages are leased"
    );
}

#[test]
fn decode_weights_pages_by_the_tenants_weight() {
    let (mut node, mut pool) = decode_node();
    let (n, p) = (&mut node, &mut pool);
    // Tenant 1 (weight 4) holds 8 pages; tenant 2 (weight 1) holds 2 × 4.
    assert_eq!(reserve_pages(n, p, 1, 1, gen(0, 4), 8), [1]);
    assert_eq!(reserve_pages(n, p, 2, 2, gen(0, 1), 4), [2]);
    assert_eq!(reserve_pages(n, p, 3, 2, gen(0, 1), 4), [3]);
    assert_eq!(reserve_pages(n, p, 4, 2, gen(0, 1), 4), []);
    assert_eq!(reserve_pages(n, p, 5, 1, gen(0, 4), 4), []);
    // Freed: tenant 1 holds 8 per weight 4 = 2, tenant 2 holds 4 per
    // weight 1 → tenant 1's request, though tenant 2's waited longer.
    assert_eq!(cancel_decode(n, p, 3), [5]);
    assert_eq!(cancel_decode(n, p, 2), [4]);
}

fn prefill_node() -> (PrefillNode, Pool) {
    let mut pool = Pool::new(shape(PAGE_TOKENS), POOL_PAGES, PoolOptions::default()).expect("pool");
    let mut node = PrefillNode::new(PrefillConfig {
        identity: identity("prefill-0", PAGE_TOKENS, 1024),
        vocab: VOCAB,
        requests_max: 32,
        queue_max: 32,
        window_pages: 4,
        tombstones_max: 64,
        prefix_keys: None,
    });
    let mut out = Vec::new();
    node.accepted(GATEWAY, &mut out);
    let hello = identity("gateway", PAGE_TOKENS, 0).hello(ROLE_GATEWAY);
    node.message(&mut pool, GATEWAY, hello, &mut out);
    (node, pool)
}

fn computing(out: &[PrefillAction]) -> Vec<u64> {
    out.iter()
        .filter_map(|a| match a {
            PrefillAction::Compute(job) => Some(job.req.0),
            _ => None,
        })
        .collect()
}

/// A prompt of 8 pages to compute.
fn prefill(node: &mut PrefillNode, pool: &mut Pool, req: u64, tenant: u64, g: GenSpec) -> Vec<u64> {
    let mut out = Vec::new();
    let pages = (0..8).map(|i| WirePage { index: i, epoch: 1 }).collect();
    let msg = Message::Prefill {
        req: RequestId(req),
        tenant: TenantId(tenant),
        decode: "decode-0:7001".into(),
        tokens: prompt(8),
        max_tokens: 1,
        gen: g,
        pages,
    };
    node.message(pool, GATEWAY, msg, &mut out);
    computing(&out)
}

fn cancel_prefill(node: &mut PrefillNode, pool: &mut Pool, req: u64) -> Vec<u64> {
    let mut out = Vec::new();
    node.message(
        pool,
        GATEWAY,
        Message::Cancel {
            req: RequestId(req),
        },
        &mut out,
    );
    computing(&out)
}

#[test]
fn prefill_gives_freed_pages_to_the_tenant_holding_fewest_not_to_the_oldest_waiter() {
    let (mut node, mut pool) = prefill_node();
    assert_eq!(prefill(&mut node, &mut pool, 1, 1, gen(0, 1)), [1]);
    assert_eq!(prefill(&mut node, &mut pool, 2, 1, gen(0, 1)), [2]);
    assert_eq!(prefill(&mut node, &mut pool, 3, 1, gen(0, 1)), []);
    assert_eq!(prefill(&mut node, &mut pool, 4, 2, gen(0, 1)), []);
    assert_eq!(pool.pages_available(), 0);
    assert_eq!(cancel_prefill(&mut node, &mut pool, 1), [4]);
    // Tenant 1's better-priority newcomer passes its own older request.
    assert_eq!(prefill(&mut node, &mut pool, 5, 1, gen(-7, 1)), []);
    assert_eq!(cancel_prefill(&mut node, &mut pool, 2), [5]);
    assert_eq!(pool.pages_available(), 0);
}
