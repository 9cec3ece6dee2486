"""The publish path of `lmqtt gateway` over the store's native protocol (docs/fleet.md): the
append methods of `RemoteStore`'s `QueueStore` (gateway/storage/facades.py) call this one's.

  * append_batch   one PRODUCE frame written, returns at once; the batch's `.durable` future is
                   resolved by the store's reply (PRODUCED after the flush mode's durability).
  (`RemoteStore.queues_for_topic` answers (): the store computes the dispatch queues itself, its
  router sees the topic; `all_visible()` False: delivery never assumes it saw every append, other
  gateways append too.)

Over a store group (the link has several members, docs/fleet.md): every PRODUCE carries this
gateway's producer id and a sequence, and one that fails because the primary went away
(ConnectionLost, or ERROR not_primary from a deposed primary) is kept and re-sent, the same bytes,
once the link is connected to the new primary, for up to the link's `failover_timeout` after
the first failure: the
store's dedup (its markers are shipped to the replicas, docs/ha.md) answers a batch the old primary
had with its original offsets and stores a batch it did not have once. The publishers' PUBACKs
wait meanwhile, so nothing PUBACKed is lost and nothing is stored twice. With one store the
PRODUCE carries no producer id (no dedup write on the store) and a lost connection fails the batch
(the publish path closes / NACKs, the client re-sends), as before.

A batch carrying an inbound QoS 2 message's key (gateway/broker/broker.py `_qos2_ahead`) is sent
with F_UNIQUE_KEYS: the store keeps one record per key (store/unique_keys.py), so that the append
of a gateway that stalled and the client's PUBLISH sent again through another gateway store the
message once.

Why apart from remote_store.py: that module's job is the mirrors of the queues this gateway
reads; appending shares nothing with them but the store connection, which is passed in.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

from lmqtt.gateway.storage.store_link import ConnectionLost, LoopConnection
from lmqtt.store import protocol as W
from lmqtt.store.client.connection import is_not_primary
from lmqtt.store.errors import MessageTooLarge
from lmqtt.store.produce import encode_produce_messages_py, encode_within
from lmqtt.store.record import HEADER_SIZE as _RECORD_HEADER

log = logging.getLogger("lmqtt.gateway.remote")


class AppendResult:
    """What append/append_batch return: only `.durable` is read (the QueueStore contract)."""

    __slots__ = ("durable",)

    def __init__(self, durable) -> None:
        self.durable = durable


class RemoteProducer:
    """Appends through one store connection (the one the gateway's other requests use, so the
    store sees them in order)."""

    # the store's default record limit (StoreConfig.max_message_size); `lmqtt store` has no flag for it
    max_message_size = 4 << 20

    def __init__(self, link: LoopConnection, loop: asyncio.AbstractEventLoop, gateway_id: str = "") -> None:
        self.link = link
        self.loop = loop
        # a store group: PRODUCEs carry (producer id, sequence) and are re-sent across a failover
        self.group = bool(getattr(link, "group", False))
        self.producer_id = f"gw:{gateway_id}:{uuid.uuid4().hex[:12]}" if self.group else ""
        # sequences grow across restarts too (a new id each start anyway)
        self._seq = itertools.count(time.time_ns() // 1000)
        self._waiting: list = []       # [seq, op flags, body, durable, deadline, last error], to re-send
        self.resent = 0                # PRODUCEs re-sent after a failover (counter)
        if self.group:
            link.on_reconnect(self._resend)

    def check(self, messages) -> None:
        """MessageTooLarge for a message that cannot fit a record (nothing is sent)."""
        limit = self.max_message_size - _RECORD_HEADER
        for m in messages:
            n = len(m.body) + len(m.props) + len(m.topic)
            if n > limit:
                raise MessageTooLarge(f"record of at least {n + _RECORD_HEADER} bytes is above "
                                      f"max_message_size={self.max_message_size}; nothing was written")

    def append_batch(self, messages, due_ms=None) -> list:
        """One PRODUCE for the batch. A message that cannot fit a record is refused here, before
        anything is sent, as the embedded store does: the publish pipeline then appends the others
        one by one and only that publisher gets the error (the store would refuse the whole batch).
        `due_ms` (append_batch_delayed): due times travel in the F_DELAYED trailer."""
        packed = encode_within(messages, self.max_message_size - _RECORD_HEADER)
        if packed is None:      # C did not pack them: one may be too large (refused by name here)
            self.check(messages)
            packed = encode_produce_messages_py(messages)
        flags = 0
        for m in messages:
            if m.keys:      # an inbound QoS 2 message's key (broker.py `_qos2_ahead`): stored once
                flags = W.F_UNIQUE_KEYS
                break
        seq = next(self._seq) if self.group else 0
        body = W.encode_produce(self.producer_id, seq, len(messages), packed)
        if due_ms is not None:
            body, flags = body + W.encode_due_trailer(due_ms), flags | W.F_DELAYED
        if self.group:
            durable = self.loop.create_future()
            # [seq, flags, body, durable, re-send until (set at the first failure), first failure]
            self._send([seq, flags, body, durable, None, None])
            return [AppendResult(durable)]
        reply = self.link.request(W.OP_PRODUCE, body, flags)
        durable = self.loop.create_future()

        def done(f):
            e = f.exception()
            if e is not None:
                durable.set_exception(e)
            else:
                durable.set_result(None)
        reply.add_done_callback(done)
        return [AppendResult(durable)]

    # ------------------------------------------------------------------ a store group
    def _send(self, entry: list) -> None:
        reply = self.link.request(W.OP_PRODUCE, entry[2], entry[1])
        reply.add_done_callback(lambda f, entry=entry: self._answered(entry, f))

    def _answered(self, entry: list, f: asyncio.Future) -> None:
        durable = entry[3]
        if durable.done():
            return
        e = f.exception()
        if e is None:
            durable.set_result(None)
            return
        if entry[4] is None:           # failover_timeout counts from the first failure
            entry[4] = time.monotonic() + self.link.failover_timeout
        if not (isinstance(e, ConnectionLost) or is_not_primary(e)) or self.link.closed \
                or time.monotonic() >= entry[4]:
            durable.set_exception(e if entry[5] is None or not isinstance(e, ConnectionLost)
                                  else ConnectionLost(f"{e} (re-sent across a failover since: {entry[5]})"))
            return
        # the primary went away: the same bytes again once the link has the new one
        entry[5] = entry[5] or str(e)
        if self.link.connected:
            self.resent += 1
            self._send(entry)
        else:
            self._waiting.append(entry)
            self.loop.call_later(max(0.0, entry[4] - time.monotonic()), self._expire, entry)

    def _expire(self, entry: list) -> None:
        """No primary came back within failover_timeout: the batch fails (nothing PUBACKed)."""
        if entry in self._waiting:
            self._waiting.remove(entry)
        if not entry[3].done():
            entry[3].set_exception(ConnectionLost(
                f"no primary of the store group {getattr(self.link, 'members', self.link.address)} within "
                f"{self.link.failover_timeout:g} s (first: {entry[5]})"))

    def _resend(self) -> None:
        """On the link's reconnect (to the new primary): every PRODUCE in flight again, in the
        order first sent (the store's dedup window is per producer and ordered)."""
        if not self._waiting:
            return
        waiting, self._waiting = sorted(self._waiting, key=lambda x: x[0]), []
        log.warning("event=produce_resent_after_failover batches=%d store=%s", len(waiting), self.link.address)
        for entry in waiting:
            if not entry[3].done():
                self.resent += 1
                self._send(entry)
