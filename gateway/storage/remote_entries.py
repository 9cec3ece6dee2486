"""What the store sends a gateway, as the messages its delivery engine reads: the entries of a
`gw_pull` or `gw_replay_read` reply (a MESSAGES frame, store/node/protocol.py) and of a PUSH_RAW
frame (CommitLog records as the store wrote them, checked and decoded here), for
gateway/storage/remote_store.py's mirrors (docs/protocol.md)."""
from __future__ import annotations

from typing import NamedTuple

from lmqtt.store.message import StoredMessage
from lmqtt.store.node.protocol import PullReply, ReplayReadReply
from lmqtt.store.record import c_decode_many, decode_many


class RemotePull(NamedTuple):
    messages: list
    next_offset: int
    min_offset: int
    max_offset: int


def entries(reply: PullReply | ReplayReadReply) -> list:
    """A `gw_pull` or `gw_replay_read` reply's entries as RemoteMessages (with a pull's dispatch
    queues; a history entry has none)."""
    msgs = reply.messages
    if isinstance(reply, PullReply) and reply.dq:
        return [RemoteMessage(t, d) for t, d in zip(msgs, reply.dq)]
    return [RemoteMessage(t, ()) for t in msgs]


class RemoteMessage:
    """A light-queue entry as the delivery engine reads it (StoredMessage's fields it uses)."""

    __slots__ = ("topic", "body", "props", "queue_offset", "phys_offset", "dispatch_queues", "store_ts",
                 "born_ts", "keys", "queue_id")

    def __init__(self, t: tuple, dq) -> None:
        (self.queue_offset, self.phys_offset, self.born_ts, self.store_ts, self.queue_id, self.topic,
         self.keys, self.props, self.body) = t
        self.dispatch_queues = tuple(dq)


def decode_raw_entries(body, runs, sizes, first: int, ident: str) -> list | None:
    """The records of an OP_PUSH_RAW queue (`runs` and `sizes` as `decode_push_raw` gives them,
    `body` a memoryview of the frame body) as StoredMessages carrying the light queue's offsets
    first, first + 1, ... (a StoredMessage reads like a RemoteMessage: the same field names).
    None if a record fails its framing or CRC check."""
    out: list = []
    k = 0
    for phys, count, start, end in runs:
        wanted = []
        p = phys
        for size in sizes[k:k + count]:
            wanted.append((p, size))
            p += size
        k += count
        got: list = []
        if _decode_many(body[start:end], phys, wanted, 0, ident, got) != count:
            return None
        out += got
    for m in out:
        if isinstance(m, Exception):
            return None
    new = tuple.__new__
    return [new(StoredMessage, m[:5] + (first + i,) + m[6:]) for i, m in enumerate(out)]


_decode_many = c_decode_many or decode_many      # the C decoder when built (store/_append.c)
