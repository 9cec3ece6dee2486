"""The publish path of `lmqtt gateway` over the store's native protocol (docs/fleet.md): the
append methods of `RemoteStore`'s `QueueStore` (gateway/storage/facades.py) call this one's.

  * append_batch   one PRODUCE frame written, returns at once; the batch's `.durable` future is
                   resolved by the store's reply (PRODUCED after the flush mode's durability).
  (`RemoteStore.queues_for_topic` answers (): the store computes the dispatch queues itself, its
  router sees the topic; `all_visible()` False: delivery never assumes it saw every append, other
  gateways append too.)

Why apart from remote_store.py: that module's job is the mirrors of the queues this gateway
reads; appending shares nothing with them but the store connection, which is passed in.
"""
from __future__ import annotations

import asyncio

from lmqtt.store import protocol as W
from lmqtt.store.errors import MessageTooLarge
from lmqtt.store.client.aio import LoopConnection
from lmqtt.store.record import HEADER_SIZE as _RECORD_HEADER


class _Result:
    """What append/append_batch return: only `.durable` is read (the QueueStore contract)."""

    __slots__ = ("durable",)

    def __init__(self, durable) -> None:
        self.durable = durable


class RemoteProducer:
    """Appends through one store connection (the one the gateway's other requests use, so the
    store sees them in order)."""

    # the store's default record limit (StoreConfig.max_message_size); `lmqtt store` has no flag for it
    max_message_size = 4 << 20

    def __init__(self, link: LoopConnection, loop: asyncio.AbstractEventLoop) -> None:
        self.link = link
        self.loop = loop

    def append_batch(self, messages, due_ms=None) -> list:
        """One PRODUCE for the batch. A message that cannot fit a record is refused here, before
        anything is sent, as the embedded store does: the publish pipeline then appends the others
        one by one and only that publisher gets the error (the store would refuse the whole batch).
        `due_ms` (append_batch_delayed): due times travel in the F_DELAYED trailer."""
        limit = self.max_message_size - _RECORD_HEADER
        for m in messages:
            n = len(m.body) + len(m.props) + len(m.topic)
            if n > limit:
                raise MessageTooLarge(f"record of at least {n + _RECORD_HEADER} bytes is above "
                                      f"max_message_size={self.max_message_size}; nothing was written")
        body = W.encode_produce("", 0, len(messages), W.encode_messages_for_produce(
            [(m.topic, m.body, m.keys, m.props, m.queue_id, m.born_ts) for m in messages]))
        if due_ms is None:
            reply = self.link.request(W.OP_PRODUCE, body)
        else:
            reply = self.link.request(W.OP_PRODUCE, body + W.encode_due_trailer(due_ms), W.F_DELAYED)
        durable = self.loop.create_future()

        def done(f):
            e = f.exception()
            if e is not None:
                durable.set_exception(e)
            else:
                durable.set_result(None)
        reply.add_done_callback(done)
        return [_Result(durable)]
