"""The chart's Grafana dashboard and ServiceMonitor: rendered by real Helm (helm-python-sdk), the
dashboard's JSON valid and shipped in a ConfigMap the Grafana sidecar picks up, the ServiceMonitor
pointed at every gateway and store pod's metrics port, and every metric a panel queries present on
the /metrics of real running processes (`lmqtt serve` with the integrations configured, `lmqtt store`)."""
from __future__ import annotations

import json
import os
import re
import urllib.request


from tests.helm.test_chart import CHART, KUBE_VERSION, _by_kind, _render, helm, kv
from tests.support import LmqttServer, LmqttStore, Paho, free_port

DASHBOARD = os.path.join(CHART, "dashboards", "lmqtt.json")


def _dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


def _queries(d: dict) -> list[str]:
    out = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in d["templating"]["list"] if v["type"] == "query"]
    return out


def test_the_dashboard_is_valid_json_in_a_configmap_for_the_grafana_sidecar():
    docs, _ = _render()
    cms = [d for d in _by_kind(docs)["ConfigMap"] if d["metadata"]["name"] == "mqtt-lmqtt-grafana-dashboard"]
    assert len(cms) == 1
    cm = cms[0]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    kv.validate(cm, KUBE_VERSION, strict=True)
    shipped = json.loads(cm["data"]["lmqtt.json"])
    assert shipped == _dashboard()
    assert shipped["uid"] == "lmqtt-overview" and shipped["schemaVersion"] >= 36
    ids = [p["id"] for p in shipped["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [p for p in shipped["panels"] if p["type"] != "row"]
    assert len(graphs) >= 12
    for p in graphs:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert "lmqtt_" in t["expr"], t["expr"]
    # a folder and another label for another Grafana, and none at all
    docs, _ = _render({"metrics": {"grafanaDashboard": {"label": "dash", "labelValue": "yes", "folder": "IoT"}}})
    cm = next(d for d in _by_kind(docs)["ConfigMap"] if d["metadata"]["name"] == "mqtt-lmqtt-grafana-dashboard")
    assert cm["metadata"]["labels"]["dash"] == "yes" and cm["metadata"]["annotations"]["grafana_folder"] == "IoT"
    docs, _ = _render({"metrics": {"grafanaDashboard": {"enabled": False}}})
    assert not [d for d in docs if d["metadata"]["name"].endswith("grafana-dashboard")]


def test_the_service_monitor_scrapes_every_gateway_and_store_pod():
    values = {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}}
    report = helm.lint(CHART, values, strict=True)
    assert report["errors"] == [], report
    docs, _ = _render(values)
    k = _by_kind(docs)
    (sm,) = k["ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["metadata"]["labels"]["release"] == "prom"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics" and sm["spec"]["endpoints"][0]["path"] == "/metrics"
    want = sm["spec"]["selector"]["matchLabels"]
    chosen = [s for s in k["Service"] if all(s["metadata"]["labels"].get(a) == b for a, b in want.items())]
    assert sorted(s["metadata"]["name"] for s in chosen) == ["mqtt-lmqtt-gateway-headless", "mqtt-lmqtt-store-headless"]
    for svc in chosen:
        port = next(p for p in svc["spec"]["ports"] if p["name"] == "metrics")
        pods = next(d for d in k["StatefulSet"] if d["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"])
        c = pods["spec"]["template"]["spec"]["containers"][0]
        cport = next(p for p in c["ports"] if p["name"] == port["targetPort"])
        assert cport["containerPort"] == port["port"]
        assert any(a.startswith("--metrics-port=") and a.endswith(str(port["port"])) for a in c["args"]), c["args"]
        kv.validate(svc, KUBE_VERSION, strict=True)
    assert "ServiceMonitor" not in _by_kind(_render()[0])          # off by default: it needs the operator's CRDs


def _names(url: str) -> set[str]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            names.add(name)
            names |= {name + "_total"} if kind == "counter" else set()
            names |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else set()
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, 1)[0])
    return names


def test_every_metric_the_dashboard_queries_is_on_metrics(tmp_path):
    """`lmqtt serve` with an HTTP auth service, a webhook and a bridge configured (the integrations'
    metrics exist once configured) and `lmqtt store` (a fleet's store pods)."""
    from tests.integrations.support import HttpService
    svc = HttpService(tmp_path)
    svc.set_rules({"users": {"dash": {"password": "pw"}}, "acl_default": "allow"})
    svc.start()
    cfg = tmp_path / "lmqtt.toml"
    cfg.write_text(f'[[bridge]]\nname = "cloud"\naddress = "127.0.0.1:{free_port()}"\ntopics = ["up/# out 1"]\n')
    srv = LmqttServer(str(tmp_path / "serve"), extra_args=("--config", str(cfg), "--auth-http", svc.url,
                                                           "--webhook", svc.url + "/hook", "--sys-interval", "0"),
                      log_path=str(tmp_path / "serve.log")).start()
    store = LmqttStore(str(tmp_path / "store"), ("--metrics-port", str(free_port())),
                       log_path=str(tmp_path / "store.log")).start()
    try:
        c = Paho(srv, client_id="dash-1", connect=False)
        c.c.username_pw_set("dash", "pw")
        c.connect()
        c.subscribe("up/#", 1)
        c.publish("up/1", b"x", qos=1)
        c.get(timeout=10)
        c.disconnect()
        store_metrics = next(a for a in store.extra_args if a.isdigit())
        from tests.support import listening
        for port in (srv.metrics_port, int(store_metrics)):       # they open a moment after the main port
            assert listening("127.0.0.1", port, 30), f"nothing listens on {port}"
        have = _names(srv.metrics_url) | _names(f"http://127.0.0.1:{store_metrics}/metrics")
        asked = {m for q in _queries(_dashboard()) for m in re.findall(r"\blmqtt_[a-z0-9_]+", q)}
        assert len(asked) >= 20, asked
        missing = sorted(asked - have)
        assert not missing, missing
    finally:
        assert srv.stop() == 0, srv.log_tail()
        assert store.stop() == 0, store.log_tail()
        svc.kill()
