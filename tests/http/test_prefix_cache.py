"""The prefix cache over HTTP (K11): a tenant's repeated prefix is served
from its cache (`usage.prompt_tokens_details.cached_tokens`), never another
tenant's — unless the operator put both in one `cache_group` — and a
request's `cache_salt` / `prompt_cache_key` only narrows its scope. Answers
are the same cached or not (K12)."""

import pytest
import requests

from conftest import Server, assert_pool_clean, auth, wait_pool_idle, write_tenants

KEYS = {"a": "sk-cache-a", "b": "sk-cache-b", "c": "sk-cache-c", "d": "sk-cache-d"}
# Long enough for several 16-token pages beyond the chat template's own.
DOC = ("The lighthouse keeper kept a ledger of every ship that passed the cape, "
       "with its flag, its cargo and the hour it cleared the reef. ") * 6


def start(tmp_root, name, extra=()):
    tenants = [{"name": n, "key": k} for n, k in KEYS.items()]
    tenants[2]["cache_group"] = "g"
    tenants[3]["cache_group"] = "g"
    path = write_tenants(tmp_root / f"{name}-tenants.toml", tenants)
    return Server(["--tenants", str(path), *extra], tmp_root, name)


@pytest.fixture(scope="module")
def unified_server(tmp_root):
    s = start(tmp_root, "prefix-cache")
    yield s
    assert s.terminate() == 0, s.stderr()


@pytest.fixture(scope="module")
def pd_server(tmp_root):
    """`serve --disaggregated`: the gateway derives the scope, the prefill
    node looks it up and publishes, decode receives every page."""
    s = start(tmp_root, "prefix-cache-pd",
              ["--disaggregated", "--kv-memory", "256MiB", "--max-context", "2048"])
    yield s
    assert s.terminate() == 0, s.stderr()


@pytest.fixture(params=["unified", "disaggregated"])
def cache_server(request):
    return request.getfixturevalue({"unified": "unified_server",
                                    "disaggregated": "pd_server"}[request.param])


def ask(s, tenant, question, **extra):
    body = {"messages": [{"role": "user", "content": DOC + question}],
            "temperature": 0, "max_tokens": 12, **extra}
    r = requests.post(s.url("/v1/chat/completions"), json=body, headers=auth(KEYS[tenant]),
                      timeout=120)
    assert r.status_code == 200, r.text
    j = r.json()
    return j["choices"][0]["message"]["content"], j["usage"]


def cached(usage):
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_a_tenant_reuses_its_own_prefix_and_no_one_elses(cache_server):
    s = cache_server
    first, u1 = ask(s, "a", "Who kept the ledger?")
    again, u2 = ask(s, "a", "Who kept the ledger?")
    assert again == first  # K12: cached or not, the same answer
    # All but the last page's worth of the prompt came from the cache.
    assert cached(u2) >= u2["prompt_tokens"] - 16 and cached(u2) % 16 == 0, u2
    # Another tenant's identical prompt: nothing of a's is reused.
    other, ub = ask(s, "b", "Who kept the ledger?")
    assert other == first and cached(ub) == 0, ub
    # A different question after the shared document: the document's pages.
    _, u3 = ask(s, "a", "What did the ledger record?")
    assert 0 < cached(u3) < u3["prompt_tokens"], u3


def test_a_cache_group_shares_and_salts_only_narrow(cache_server):
    s = cache_server
    q = "How many ships passed?"
    plain, uc = ask(s, "c", q)
    assert cached(uc) == 0, uc
    # d is in c's group: c's pages serve it.
    _, ud = ask(s, "d", q)
    assert cached(ud) > 0, ud
    # A salt narrows even inside the group: a new scope, cold the first time
    # and warm the second; the other field name is another scope again.
    salted, us1 = ask(s, "d", q, cache_salt="x")
    _, us2 = ask(s, "d", q, cache_salt="x")
    assert salted == plain
    assert cached(us1) == 0 and cached(us2) > 0, (us1, us2)
    _, uk = ask(s, "d", q, prompt_cache_key="x")
    assert cached(uk) == 0, uk
    # No salt reaches another tenant's scope: b salted like a's scope name.
    _, ub = ask(s, "b", q, cache_salt="c")
    assert cached(ub) == 0, ub


def test_cache_counters_and_a_clean_pool(unified_server):
    s = unified_server
    # The startup capacity line says what the cache does to capacity.
    assert "| prefix cache per tenant, in the pool (idle cached pages are evicted" in s.stderr()
    ask(s, "a", "Name the cape.")
    ask(s, "a", "Name the cape.")
    m = wait_pool_idle(s)
    assert_pool_clean(m)
    assert m["isoserve_prefix_cache_hit_tokens_total"] > 0
    assert m["isoserve_prefix_cache_queries_total"] >= 2
    assert m['isoserve_kv_pages{state="cached"}'] > 0
    assert m['isoserve_kv_refusals_total{kind="foreign_scope"}'] == 0
    # Per tenant: a's cached tokens counted under a, none under b.
    assert m['isoserve_tenant_prompt_tokens_cached_total{tenant="a"}'] > 0
    assert m['isoserve_tenant_prompt_tokens_cached_total{tenant="b"}'] == 0
    assert m['isoserve_tenant_prompt_tokens_total{tenant="b"}'] > 0


@pytest.mark.parametrize("field,value", [("cache_salt", ""), ("cache_salt", 5),
                                         ("prompt_cache_key", "x" * 257)])
def test_bad_salts_are_refused_with_the_field_named(unified_server, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, field: value}
    r = requests.post(unified_server.url("/v1/chat/completions"), json=body,
                      headers=auth(KEYS["a"]), timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_the_prefill_node_counts_its_cache_and_keeps_no_page_held(pd_server):
    s = pd_server
    ask(s, "a", "Name the reef.")
    _, u = ask(s, "a", "Name the reef.")
    assert cached(u) > 0, u
    gm = s.metrics()
    node = '{node="prefill-0"}'
    assert gm["isoserve_node_prefill_prefix_cache_hit_tokens_total" + node] >= cached(u)
    assert gm["isoserve_node_prefill_prefix_cache_queries_total" + node] >= 2
    assert gm["isoserve_node_kv_pages_cached" + node] > 0
    # Decode received every page (no reuse there) and caches nothing.
    assert gm['isoserve_node_kv_pages_cached{node="decode-0"}'] == 0
    assert gm['isoserve_node_kv_safety_refusals_total{node="prefill-0"}'] == 0
    assert gm['isoserve_node_decode_checksum_failures_total{node="decode-0"}'] == 0


def test_prefix_cache_off_reuses_nothing(tmp_root):
    path = write_tenants(tmp_root / "cache-off-tenants.toml",
                         [{"name": "a", "key": KEYS["a"]}])
    s = Server(["--tenants", str(path), "--prefix-cache", "off"], tmp_root, "prefix-cache-off")
    try:
        assert "prefix_cache=Off" in s.stderr()
        assert "| prefix cache off" in s.stderr()
        for _ in range(2):
            _, u = ask(s, "a", "Who kept the ledger?")
            assert cached(u) == 0, u
        m = wait_pool_idle(s)
        assert m['isoserve_kv_pages{state="cached"}'] == 0
        assert m["isoserve_prefix_cache_queries_total"] == 0
    finally:
        assert s.terminate() == 0, s.stderr()
