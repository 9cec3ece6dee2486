"""What the store sends a gateway, as the messages its delivery engine reads: the entries of a
`gw_pull` or `gw_replay_read` reply (a MESSAGES frame, store/node/protocol.py) and of a PUSH_RAW
frame (CommitLog records as the store wrote them, checked and decoded here), for
gateway/storage/remote_store.py's mirrors (docs/protocol.md)."""
from __future__ import annotations

from typing import NamedTuple

from lmqtt.store.message import StoredMessage
from lmqtt.store.node.protocol import PullReply, ReplayReadReply
from lmqtt.store.record import c_decode_runs, decode_many


class RemotePull(NamedTuple):
    messages: list
    next_offset: int
    min_offset: int
    max_offset: int


class RawPullReply(NamedTuple):
    """A raw `gw_pull`'s answer (a PUSH_RAW frame of the queue): its records decoded, with the
    light queue's offsets. The frame carries no min offset: the mirror keeps the one it knew."""
    messages: list
    next_offset: int
    min_offset: int | None = None


class BadPushedRecord(Exception):
    """A record of a raw answer failed its framing or CRC check (the decoded pull reports and skips it)."""


def entries(reply: PullReply | ReplayReadReply | RawPullReply) -> list:
    """A `gw_pull` or `gw_replay_read` reply's entries as RemoteMessages (with a pull's dispatch
    queues; a history entry has none); a raw pull's are StoredMessages already."""
    if isinstance(reply, RawPullReply):
        return reply.messages
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


# A run with records starting past this offset is refused (8 EiB of log: never written; the C
# decoder keeps every offset of a run within a long long)
MAX_RUN_PHYS = 2 ** 63 - 2 ** 33


def decode_raw_entries_py(body, runs, sizes, first: int, ident: str) -> list | None:
    """The records of an OP_PUSH_RAW queue (`runs` and `sizes` as `decode_push_raw` gives them,
    `body` a memoryview of the frame body) as StoredMessages carrying the light queue's offsets
    first, first + 1, ... (a StoredMessage reads like a RemoteMessage: the same field names).
    None if a record fails its framing or CRC check.

    The reference for `decode_raw_entries` in C (store/_append.c `decode_runs`), which the
    gateway runs when it is built: tests/gateway/test_remote_entries_accel.py and the fuzz harness
    tests/fuzz/fuzz_pushed.py compare the two."""
    out: list = []
    k = 0
    for phys, count, start, end in runs:
        if count and not 0 <= phys <= MAX_RUN_PHYS:
            return None
        wanted = []
        p = phys
        for size in sizes[k:k + count]:
            wanted.append((p, size))
            p += size
        k += count
        got: list = []
        if decode_many(body[start:end], phys, wanted, 0, ident, got) != count:
            return None
        out += got
    for m in out:
        if isinstance(m, Exception):
            return None
    new = tuple.__new__
    return [new(StoredMessage, m[:5] + (first + i,) + m[6:]) for i, m in enumerate(out)]


decode_raw_entries = c_decode_runs or decode_raw_entries_py      # the C one when built (store/_append.c)
