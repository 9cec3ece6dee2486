"""The Helm chart in helm/lmqtt, rendered by real Helm (helm-python-sdk bundles Helm's Go SDK),
linted, and every manifest validated against the Kubernetes schemas (kubernetes-validate)."""
from __future__ import annotations

import os

import pytest

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is in the test extras")
kv = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")

from tests.support import ROOT  # noqa: E402

CHART = os.path.join(ROOT, "helm", "lmqtt")
KUBE_VERSION = "1.31.0"


def _render(values=None, name="mqtt", namespace="iot"):
    chart = helm.Chart.load(CHART)
    out = chart.render(values or {}, name=name, namespace=namespace, is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.append(doc)
    return docs, out


def _production_values():
    with open(os.path.join(CHART, "values-production.yaml")) as f:
        return yaml.safe_load(f)


def _by_kind(docs):
    out: dict[str, list] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


@pytest.mark.parametrize("which", ["default", "production"])
def test_every_manifest_validates_against_the_kubernetes_schemas(which):
    values = {} if which == "default" else _production_values()
    docs, _ = _render(values)
    kinds = _by_kind(docs)
    assert {"StatefulSet", "Service", "ConfigMap"} <= set(kinds)
    for d in docs:
        kv.validate(d, KUBE_VERSION, strict=True)


def test_the_chart_lints_clean():
    for values in ({}, _production_values()):
        report = helm.lint(CHART, values, strict=True)
        assert report["errors"] == [], report
        assert not [m for m in report["messages"] if m["severity"] >= 2], report["messages"]


def test_default_install_runs_a_store_gateways_and_redis_wired_together():
    docs, out = _render()
    k = _by_kind(docs)
    sts = next(d for d in k["StatefulSet"] if d["metadata"]["name"] == "mqtt-lmqtt-store")
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "20Gi"
    store_args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert store_args[0] == "store" and "--flush-mode=sync" in store_args and "--host=0.0.0.0" in store_args
    gw = next(d for d in k["StatefulSet"] if d["metadata"]["name"] == "mqtt-lmqtt-gateway")
    c = gw["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][0] == "gateway"
    members = ",".join(f"mqtt-lmqtt-store-{i}.mqtt-lmqtt-store-headless.iot.svc:10911" for i in range(3))
    assert f"--store={members}" in c["args"]           # a group of 3 by default: every member
    assert "--redis=redis://mqtt-lmqtt-redis.iot.svc:6379/0" in c["args"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "replicas" not in gw["spec"]                      # the HPA owns the count
    hpa = k["HorizontalPodAutoscaler"][0]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "mqtt-lmqtt-gateway" and hpa["spec"]["minReplicas"] == 2
    pdbs = {d["metadata"]["name"]: d["spec"]["minAvailable"] for d in k["PodDisruptionBudget"]}
    assert pdbs == {"mqtt-lmqtt-gateway": 1, "mqtt-lmqtt-store": 2}
    svc = next(d for d in k["Service"] if d["metadata"]["name"] == "mqtt-lmqtt")
    assert svc["spec"]["ports"][0]["port"] == 1883
    assert any(d["metadata"]["name"] == "mqtt-lmqtt-redis" for d in k["Deployment"])
    token = k["Secret"][0]["data"]["store-token"]
    assert token and all(e["valueFrom"]["secretKeyRef"]["key"] == "store-token"
                         for e in c["env"] if e["name"] == "LMQTT_STORE_TOKEN")
    assert "kubectl port-forward" in out["lmqtt/templates/NOTES.txt"]


def test_gateways_keep_their_ids_across_rollouts():
    """The store keeps wildcard filter holds per gateway id; a gateway that comes back under the
    same id reconciles its own. Gateways are a StatefulSet whose pod name (stable: ...-gateway-0,
    -1, ...) is passed as --gateway-id, so a rollout or a rescheduled pod leaves no holds under
    ids that never return; the HPA scales that StatefulSet."""
    docs, _ = _render()
    k = _by_kind(docs)
    assert not any(d["metadata"]["name"] == "mqtt-lmqtt-gateway" for d in k.get("Deployment", []))
    gw = next(d for d in k["StatefulSet"] if d["metadata"]["name"] == "mqtt-lmqtt-gateway")
    assert gw["spec"]["podManagementPolicy"] == "Parallel"
    assert "volumeClaimTemplates" not in gw["spec"]
    headless = next(d for d in k["Service"] if d["metadata"]["name"] == gw["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == gw["spec"]["selector"]["matchLabels"]
    c = gw["spec"]["template"]["spec"]["containers"][0]
    assert "--gateway-id=$(POD_NAME)" in c["args"]
    pod_name = next(e for e in c["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    hpa = k["HorizontalPodAutoscaler"][0]["spec"]["scaleTargetRef"]
    assert (hpa["kind"], hpa["name"]) == ("StatefulSet", "mqtt-lmqtt-gateway")


def test_every_pod_runs_non_root_with_requests_and_scrape_annotations():
    docs, _ = _render()
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = d["spec"]["template"]
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True, d["metadata"]["name"]
        for c in pod["spec"]["containers"]:
            assert c["resources"]["requests"], (d["metadata"]["name"], c["name"])
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        if "redis" not in d["metadata"]["name"]:
            ann = pod["metadata"]["annotations"]
            assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"]


def test_external_redis_and_existing_secret_replace_the_in_chart_ones():
    docs, _ = _render(_production_values())
    k = _by_kind(docs)
    assert "Deployment" not in k                              # no in-chart Redis
    assert "Secret" not in k
    gw = next(d for d in k["StatefulSet"] if d["metadata"]["name"] == "mqtt-lmqtt-gateway")
    gw = gw["spec"]["template"]["spec"]["containers"][0]
    assert "--redis=redis://redis.prod.svc:6379/0" in gw["args"] and "--notify-mode=precise" in gw["args"]
    token = next(e for e in gw["env"] if e["name"] == "LMQTT_STORE_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["name"] == "lmqtt-store-token"
    svc = next(d for d in k["Service"] if d["metadata"]["name"] == "mqtt-lmqtt")
    assert svc["spec"]["type"] == "LoadBalancer"
    cm = k["ConfigMap"][0]["data"]["lmqtt.toml"]
    assert "max_inflight = 1000" in cm


def test_external_redis_without_a_url_is_refused_with_the_reason():
    with pytest.raises(helm.HelmError, match="redis.url is required when redis.enabled is false"):
        _render({"redis": {"enabled": False}})


def test_native_notify_runs_no_redis_at_all():
    """notify.mode=native: the store pushes new-data events and relays client id claims on the
    gateways' store connections, so nothing of Redis is rendered or passed, even with
    redis.enabled=false and no url (which Redis modes refuse); an unknown mode is refused by name."""
    for values in ({"notify": {"mode": "native"}}, {"notify": {"mode": "native"}, "redis": {"enabled": False}}):
        docs, out = _render(values)
        k = _by_kind(docs)
        assert "Deployment" not in k                              # no in-chart Redis
        for sts in k["StatefulSet"]:
            args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
            assert not [a for a in args if a.startswith("--redis")], args
        gw = next(d for d in k["StatefulSet"] if d["metadata"]["name"] == "mqtt-lmqtt-gateway")
        assert "--notify-mode=native" in gw["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "no Redis" in out["lmqtt/templates/NOTES.txt"]
        for d in docs:
            kv.validate(d, KUBE_VERSION, strict=True)
    report = helm.lint(CHART, {"notify": {"mode": "native"}}, strict=True)
    assert report["errors"] == [], report
    with pytest.raises(helm.HelmError, match="notify.mode must be broadcast, precise or native"):
        _render({"notify": {"mode": "redis"}})


def test_every_value_is_documented():
    """Every leaf of values.yaml has a `# --` comment on the line above it or above a parent key."""
    with open(os.path.join(CHART, "values.yaml")) as f:
        lines = f.read().splitlines()
    stack: list[tuple[int, bool]] = []          # (indent, documented) of the enclosing mappings
    undocumented = []
    for i, line in enumerate(lines):
        s = line.strip()
        if not s or s.startswith("#") or s.startswith("- ") or ":" not in s:
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --"):
            j -= 1                                 # a comment may run over several lines
        documented = (j >= 0 and lines[j].strip().startswith("# --")) or any(d for _i, d in stack)
        key, _, rest = s.partition(":")
        if rest.strip():
            if not documented:
                undocumented.append(key)
        else:
            stack.append((indent, documented))
    assert not undocumented, f"values without a `# --` comment: {undocumented}"


def test_config_values_render_as_toml_the_gateway_accepts(tmp_path):
    """`config:` values become lmqtt.toml, read strictly by lmqtt serve/gateway/store: a whole number
    must stay an integer (Go would print 1000000 as 1e+06, a float an integer key refuses)."""
    import tomllib

    from lmqtt.gateway.app.config import build_config, load_toml

    values = {"config": {"max_packet_size": 1000000, "max_inflight": 200, "allow_anonymous": False,
                         "sys_interval": 2.5, "log_level": "info"}}
    _docs, out = _render(values)
    cm = next(yaml.safe_load(t) for p, t in out.items() if p.endswith("configmap.yaml"))
    text = cm["data"]["lmqtt.toml"]
    parsed = tomllib.loads(text)
    assert parsed["max_packet_size"] == 1000000 and type(parsed["max_packet_size"]) is int, text
    assert parsed["allow_anonymous"] is False and parsed["sys_interval"] == 2.5, text
    f = tmp_path / "lmqtt.toml"
    f.write_text(text)
    cfg = build_config(load_toml(f))
    assert cfg.max_packet_size == 1000000 and cfg.max_inflight == 200 and cfg.allow_anonymous is False


def _store(values):
    docs, out = _render(values)
    k = _by_kind(docs)
    sts = next(d for d in k["StatefulSet"] if d["metadata"]["name"] == "mqtt-lmqtt-store")
    gw = next(d for d in k["StatefulSet"] if d["metadata"]["name"] == "mqtt-lmqtt-gateway")
    return docs, k, sts, gw["spec"]["template"]["spec"]["containers"][0]["args"], out


@pytest.mark.parametrize("n", [1, 3, 5])
def test_store_replicas_render_a_group_with_its_flags_pdb_and_anti_affinity(n):
    """store.replicas 3 (default) / 5: a store group (docs/ha.md) - --group, --peers naming every
    member by its stable DNS name in ordinal order, the three ports in the headless Service, pods
    started in parallel (the first election waits for all), a PodDisruptionBudget keeping a
    majority, one member per node; gateways get every member. 1: a single store as before (no
    group flags, no store PDB, no anti-affinity)."""
    docs, k, sts, gw_args, out = _store({"store": {"replicas": n}})
    for d in docs:
        kv.validate(d, KUBE_VERSION, strict=True)
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    members = [f"mqtt-lmqtt-store-{i}.mqtt-lmqtt-store-headless.iot.svc:10911" for i in range(n)]
    assert f"--store={','.join(members)}" in gw_args
    headless = next(d for d in k["Service"] if d["metadata"]["name"] == "mqtt-lmqtt-store-headless")
    ports = {p["name"]: p["port"] for p in headless["spec"]["ports"]}
    store_pdb = [d for d in k["PodDisruptionBudget"] if d["metadata"]["name"] == "mqtt-lmqtt-store"]
    if n == 1:
        assert not [a for a in c["args"] if a.startswith(("--group", "--peers", "--node-id"))], c["args"]
        assert "command" not in c and sts["spec"]["podManagementPolicy"] == "OrderedReady"
        assert ports == {"store": 10911, "metrics": 9884} and store_pdb == [] and "affinity" not in pod
        return
    assert c["args"][0] == "store"
    assert "--group=mqtt-lmqtt" in c["args"] and f"--peers={','.join(members)}" in c["command"][2]
    assert "--election-timeout-s=2.5" in c["args"]
    assert not [a for a in c["args"] if a.startswith("--ack-replicas")]   # the store's default
    assert sts["spec"]["replicas"] == n and sts["spec"]["podManagementPolicy"] == "Parallel"
    assert ports == {"store": 10911, "raft": 10912, "replication": 10913, "metrics": 9884}
    assert {p["name"] for p in c["ports"]} == {"store", "raft", "replication", "metrics"}
    assert store_pdb[0]["spec"]["minAvailable"] == n // 2 + 1
    assert store_pdb[0]["spec"]["selector"] == sts["spec"]["selector"]
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"] == sts["spec"]["template"]["metadata"]["labels"]
    assert "every member" in out["lmqtt/templates/NOTES.txt"]
    report = helm.lint(CHART, {"store": {"replicas": n}}, strict=True)
    assert report["errors"] == [], report


def _run_member_command(tmp_path, sts, ordinal: int) -> list[str]:
    """The member's command, as Kubernetes runs it ($$ unescaped to $) by a real /bin/sh with the
    pod's HOSTNAME: the arguments `lmqtt` (a stand-in printing them) gets."""
    import subprocess
    c = sts["spec"]["template"]["spec"]["containers"][0]
    fake = tmp_path / "lmqtt"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    cmd = [part.replace("$$", "$") for part in c["command"]] + c["args"]
    r = subprocess.run(cmd, env={"PATH": f"{tmp_path}:/usr/bin:/bin", "HOSTNAME": f"{sts['metadata']['name']}-{ordinal}"},
                       capture_output=True, text=True, timeout=10, check=True)
    return r.stdout.splitlines()


def _members(n: int) -> str:
    return ",".join(f"mqtt-lmqtt-store-{i}.mqtt-lmqtt-store-headless.iot.svc:10911" for i in range(n))


def test_each_member_gets_its_ordinal_plus_one_as_node_id(tmp_path):
    """Every rendered arg, then --node-id = ordinal + 1 (its position in --peers) and --peers."""
    _docs, _k, sts, _gw, _out = _store({"store": {"replicas": 5}})
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    for ordinal in (0, 4):
        assert _run_member_command(tmp_path, sts, ordinal) == args + [f"--node-id={ordinal + 1}",
                                                                      f"--peers={_members(5)}"]


def test_with_seed_replicas_set_scaling_changes_no_pod_template_and_new_pods_join(tmp_path):
    """store.group.seedReplicas 3 (the installed group): --peers names those three whatever
    store.replicas is, so scaling 3 -> 5 -> 7 -> 3 changes the StatefulSet's replicas and the
    PodDisruptionBudget, never the pod template nor the gateways' (no pod is restarted; the
    gateways learn the current members from the store's HELLO_OK). Pods 0-2 start as the seed
    (--node-id, --peers), pods 3 and up with --join of the seed, to be added with `lmqtt admin
    --add-member`; a pod scaled away takes its PVC with it (whenScaled: Delete)."""
    rendered = {}
    for n in (3, 5, 7):
        docs, k, sts, gw_args, out = _store({"store": {"replicas": n, "group": {"seedReplicas": 3}}})
        for d in docs:
            kv.validate(d, KUBE_VERSION, strict=True)
        rendered[n] = (sts, gw_args, k)
        assert sts["spec"]["replicas"] == n
        assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Delete"}
        pdb = next(d for d in k["PodDisruptionBudget"] if d["metadata"]["name"] == "mqtt-lmqtt-store")
        assert pdb["spec"]["minAvailable"] == n // 2 + 1
        assert f"--store={_members(3)}" in gw_args
        assert "give clients the 3 seed members" in out["lmqtt/templates/NOTES.txt"]
    templates = {n: r[0]["spec"]["template"] for n, r in rendered.items()}
    assert templates[3] == templates[5] == templates[7]
    assert rendered[3][1] == rendered[5][1] == rendered[7][1]
    sts = rendered[7][0]
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    for ordinal in (0, 2):
        assert _run_member_command(tmp_path, sts, ordinal) == args + [f"--node-id={ordinal + 1}",
                                                                      f"--peers={_members(3)}"]
    for ordinal in (3, 6):
        assert _run_member_command(tmp_path, sts, ordinal) == args + [f"--join={_members(3)}"]
    # unset: every member is the seed, as before, and a scaled-away pod's PVC is kept
    _docs, _k, sts, _gw, _out = _store({"store": {"replicas": 5}})
    assert "persistentVolumeClaimRetentionPolicy" not in sts["spec"]
    assert helm.lint(CHART, {"store": {"replicas": 5, "group": {"seedReplicas": 3}}}, strict=True)["errors"] == []
    with pytest.raises(helm.HelmError, match="store.group.seedReplicas must be at least 2"):
        _render({"store": {"replicas": 3, "group": {"seedReplicas": 1}}})


def test_store_group_values_ack_replicas_soft_anti_affinity_and_own_affinity():
    _docs, _k, sts, _gw, _out = _store({"store": {"replicas": 5, "antiAffinity": "soft",
                                                  "group": {"ackReplicas": 3, "name": "g1", "electionTimeoutSeconds": 4}}})
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert {"--ack-replicas=3", "--group=g1", "--election-timeout-s=4"} <= set(c["args"])
    pref = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref[0]["weight"] == 100
    own = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "podAffinityTerm": {"topologyKey": "zone", "labelSelector": {"matchLabels": {"a": "b"}}}}]}}
    _docs, _k, sts, _gw, _out = _store({"store": {"affinity": own}})
    assert sts["spec"]["template"]["spec"]["affinity"] == own      # the user's wins
    _docs, _k, sts, _gw, _out = _store({"store": {"antiAffinity": "off"}})
    assert "affinity" not in sts["spec"]["template"]["spec"]
    with pytest.raises(helm.HelmError, match="store.antiAffinity must be hard, soft or off"):
        _render({"store": {"antiAffinity": "always"}})
    with pytest.raises(helm.HelmError, match="store.replicas must be at least 1"):
        _render({"store": {"replicas": 0}})


@pytest.mark.parametrize("groups,members", [(2, 3), (3, 1)])
def test_store_groups_render_n_groups_of_m_members(groups, members):
    """store.groups N (docs/groups.md): one StatefulSet per group (<fullname>-store-g<i>), each its
    own --group name, --peers naming its own members only, its own PDB and anti-affinity; the
    gateways are given every group, ';'-separated, in group order."""
    values = {"store": {"groups": groups, "replicas": members}, "notify": {"mode": "native"}}
    docs, out = _render(values)
    for d in docs:
        kv.validate(d, KUBE_VERSION, strict=True)
    k = _by_kind(docs)
    sets = {d["metadata"]["name"]: d for d in k["StatefulSet"] if "-store" in d["metadata"]["name"]}
    assert sorted(sets) == [f"mqtt-lmqtt-store-g{i}" for i in range(groups)]
    lists = []
    for i in range(groups):
        sts = sets[f"mqtt-lmqtt-store-g{i}"]
        members_i = [f"mqtt-lmqtt-store-g{i}-{m}.mqtt-lmqtt-store-headless.iot.svc:10911" for m in range(members)]
        lists.append(",".join(members_i))
        c = sts["spec"]["template"]["spec"]["containers"][0]
        assert sts["spec"]["replicas"] == members
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert labels["lmqtt.io/store-group"] == f"mqtt-lmqtt-g{i}"
        assert sts["spec"]["selector"]["matchLabels"]["lmqtt.io/store-group"] == f"mqtt-lmqtt-g{i}"
        if members > 1:
            assert f"--group=mqtt-lmqtt-g{i}" in c["args"] and f"--peers={lists[-1]}" in c["command"][2]
            anti = sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
            term = anti["requiredDuringSchedulingIgnoredDuringExecution"][0]
            assert term["labelSelector"]["matchLabels"]["lmqtt.io/store-group"] == f"mqtt-lmqtt-g{i}"
        else:
            assert not [a for a in c["args"] if a.startswith(("--group", "--peers"))]
    gw = next(d for d in k["StatefulSet"] if d["metadata"]["name"] == "mqtt-lmqtt-gateway")
    assert f"--store={';'.join(lists)}" in gw["spec"]["template"]["spec"]["containers"][0]["args"]
    pdbs = sorted(d["metadata"]["name"] for d in k.get("PodDisruptionBudget", []) if "-store" in d["metadata"]["name"])
    assert pdbs == ([f"mqtt-lmqtt-store-g{i}" for i in range(groups)] if members > 1 else [])
    assert ";".join(lists) in out["lmqtt/templates/NOTES.txt"]
    report = helm.lint(CHART, values, strict=True)
    assert report["errors"] == [], report
    with pytest.raises(helm.HelmError, match="store.groups must be at least 1"):
        _render({"store": {"groups": 0}})
    # the gateways hear several groups' events from the stores only (the Redis modes name the
    # queues of one store): refused with the reason, not a gateway that exits at start
    with pytest.raises(helm.HelmError, match="store.groups above 1 needs notify.mode=native"):
        _render({"store": {"groups": groups, "replicas": members}})
