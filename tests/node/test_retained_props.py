"""The expiry a retained value carries in front of its props is written by the store node too (the
retained will of a gateway that is gone; store/node/command.py hands `retained_props` of the record
props codec, store/client/props.py, to the wills service): the gateway reads what the node wrote."""
from __future__ import annotations

from lmqtt.gateway.storage import record_props as G
from lmqtt.gateway.mqtt import packets as P
from lmqtt.store.client import props as S


def test_the_node_writes_the_retained_expiry_the_gateway_reads():
    props = G.encode(1, True, "dev-1", P.Properties(message_expiry_interval=30))
    value = S.retained_props(props, 1_000)
    assert G.split_retained(value) == (props, 31_000)
    assert G.safe_decode(G.split_retained(value)[0]).message_expiry_interval == 30
    assert G.retained_props is S.retained_props and G.RETAINED_DEADLINE == S.RETAINED_DEADLINE


def test_props_without_expiry_or_of_another_format_are_kept_as_they_are():
    plain = G.encode(0, True, "dev-1")
    assert S.retained_props(plain, 1_000) == plain and S.split_retained(plain) == (plain, None)
    foreign = b"\x07not-ours"
    assert S.retained_props(foreign, 1_000) == foreign
    assert S.retained_props(b"", 1_000) == b""
