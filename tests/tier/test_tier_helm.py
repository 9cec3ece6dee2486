"""The Helm chart's tier values (helm/lmqtt values.yaml `store.tier`), rendered by real Helm: the
store gets the tier flags, and S3 credentials from an existing Secret; off by default."""
from __future__ import annotations

import pytest

pytest.importorskip("helm_python", reason="helm-python-sdk is in the test extras")

from tests.helm.test_chart import _by_kind, _render  # noqa: E402


def _store(values):
    docs, _ = _render(values)
    sts = next(d for d in _by_kind(docs)["StatefulSet"] if d["metadata"]["name"].endswith("-store"))
    return sts["spec"]["template"]["spec"]["containers"][0]


def test_tier_is_off_by_default():
    c = _store({})
    assert not any(a.startswith("--tier") for a in c["args"])
    assert [e["name"] for e in c["env"]] == ["LMQTT_STORE_TOKEN"]


def test_tier_values_give_the_store_its_flags_and_credentials_from_a_secret():
    c = _store({"store": {"tier": {"url": "s3://history/lmqtt", "endpoint": "http://minio:9000",
                                   "localRetention": "6h", "tierRetention": "90d",
                                   "credentialsSecret": "lmqtt-s3"}}})
    assert {"--tier=s3://history/lmqtt", "--tier-endpoint=http://minio:9000", "--local-retention=6h",
            "--tier-retention=90d", "--tier-cache-mb=256"} <= set(c["args"])
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    assert env["AWS_ACCESS_KEY_ID"] == {"name": "lmqtt-s3", "key": "AWS_ACCESS_KEY_ID"}
    assert env["AWS_SECRET_ACCESS_KEY"] == {"name": "lmqtt-s3", "key": "AWS_SECRET_ACCESS_KEY"}
    # the rendered flags are ones lmqtt store accepts
    from lmqtt.store.node.config import NodeConfig  # noqa: F401 - the same check the node makes
    from lmqtt.store.tier.config import check_tier
    check_tier("s3://history/lmqtt", "http://minio:9000", "6h", "90d")
