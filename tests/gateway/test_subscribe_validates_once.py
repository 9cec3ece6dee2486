"""A SUBSCRIBE's filters are validated once by the gateway (a reconnect storm): `prepare` parses and
validates each filter while it asks the store ahead, and the decision takes its parse instead of
validating the filter again. Invalid filters are still refused (SUBACK 0x80), shared and
`$replay/` ones still parsed.

In-process gateway (real store), the client on the connection's in-memory transport."""
from __future__ import annotations

import asyncio
import collections

from lmqtt.gateway.mqtt import Decoder, encode, packets as P
from lmqtt.lightqueue import topics as T
from tests.fakes import fake_connection, started_gateway


def test_each_valid_filter_validated_once_and_invalid_ones_refused(tmp_path, monkeypatch):
    async def run():
        gw = await started_gateway(tmp_path, "d")
        try:
            conn, tr = fake_connection(gw)
            dec = Decoder(version=4, server_side=False)
            conn.data_received(encode(P.Connect(client_id="v1", protocol_level=4, clean_start=False), 4))
            await asyncio.sleep(0.01)
            assert isinstance(dec.feed(tr.take())[0], P.ConnAck)
            calls: collections.Counter = collections.Counter()
            real = T.validate_filter

            def counting(flt, real=real):
                calls[flt] += 1
                return real(flt)
            monkeypatch.setattr(T, "validate_filter", counting)
            conn.data_received(encode(P.Subscribe(1, [
                P.SubscriptionRequest("a/+/c", qos=1), P.SubscriptionRequest("$share/g/s/#", qos=1),
                P.SubscriptionRequest("bad/#/x", qos=1), P.SubscriptionRequest("plain/t", qos=0)]), 4))
            await asyncio.sleep(0.05)
            acks = [p for p in dec.feed(tr.take()) if isinstance(p, P.SubAck)]
            monkeypatch.setattr(T, "validate_filter", real)
            assert acks and acks[0].reason_codes == [1, 1, 0x80, 0]
            # (a shared filter's inner one is validated by `parse_shared` itself too: 2, was 4)
            assert calls["a/+/c"] == 1 and calls["s/#"] == 2 and calls["plain/t"] == 1, calls
            assert set(gw.broker.sessions.get("v1").subs) == {"a/+/c", "$share/g/s/#", "plain/t"}
        finally:
            await gw.stop()
    asyncio.run(run())


def test_a_subscribe_again_writes_the_record_only_when_a_subscription_changed(tmp_path):
    """The decision compares a plain subscription with the one the session has by its fields
    (no `__eq__`): the same again writes nothing, another QoS or an option writes the record."""
    async def run():
        gw = await started_gateway(tmp_path, "d")
        try:
            conn, tr = fake_connection(gw)
            dec = Decoder(version=5, server_side=False)
            conn.data_received(encode(P.Connect(client_id="v2", protocol_level=5, clean_start=False,
                                                properties=P.Properties(session_expiry_interval=600)), 5))
            await asyncio.sleep(0.01)
            metrics = gw.broker.persist.metrics
            records = gw.broker.persist.sessions

            async def subscribe(pid, req):
                before = metrics.session_record_writes
                conn.data_received(encode(P.Subscribe(pid, [req]), 5))
                await asyncio.sleep(0.02)
                assert [p for p in dec.feed(tr.take()) if isinstance(p, P.SubAck)]
                return metrics.session_record_writes - before
            assert await subscribe(1, P.SubscriptionRequest("a/+", qos=1)) == 1
            assert await subscribe(2, P.SubscriptionRequest("a/+", qos=1)) == 0
            assert await subscribe(3, P.SubscriptionRequest("a/+", qos=0)) == 1
            assert records.get("v2").wait().subscriptions[0].qos == 0
            assert await subscribe(4, P.SubscriptionRequest("a/+", qos=0, no_local=True)) == 1
            assert records.get("v2").wait().subscriptions[0].no_local is True
            assert await subscribe(5, P.SubscriptionRequest("a/+", qos=0, no_local=True)) == 0
            assert await subscribe(6, P.SubscriptionRequest("a/+", qos=0)) == 1
            assert records.get("v2").wait().subscriptions[0].no_local is False
        finally:
            await gw.stop()
    asyncio.run(run())
