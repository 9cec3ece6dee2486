"""Admin and queries: topics/queues, offsets, lag per group, store stats, lookups by msg id, by
key within a time range (the key index), first offset at or after a time.

Written once over the command layer (commands.py): each method sends one command with
`conn.execute`, so on the sync `Connection` it returns the value and on the `AsyncConnection` a
coroutine of it (`AsyncAdmin` in aio_api.py is this class).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .commands import Committed, GetByMsgId, Lag, OffsetForTime, Offsets, PopInfo, QueryByKey, Stats, Topics, records_in
from .records import Record

if TYPE_CHECKING:
    from .connection import Connection


def records_of(ident: str | None, res) -> list[Record]:
    """The Records of an admin query's MESSAGES reply (`ident`: the connection's, for msg ids)."""
    return records_in(res, ident)


class Admin:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def topics(self):
        """[{topic (first level), queue_id, max_offset}] of every ConsumeQueue."""
        return self.conn.execute(Topics())

    def offsets(self, topic: str, queue_id: int = 0):
        """(min offset, max offset) of a ConsumeQueue."""
        return self.conn.execute(Offsets(topic, queue_id))

    def committed(self, group: str, topic: str, queue_id: int = 0):
        return self.conn.execute(Committed(group, topic, queue_id))

    def lag(self, group: str):
        return self.conn.execute(Lag(group))

    def stats(self):
        return self.conn.execute(Stats())

    def get_by_msg_id(self, msg_id: str):
        """The Record of `msg_id`, or None."""
        return self.conn.execute(GetByMsgId(msg_id))

    def query_by_key(self, topic: str, key: str, begin_ms: int = 0, end_ms: int | None = None, max_count: int = 32):
        """Records of `topic` with `key` stored in [begin_ms, end_ms) (default: until now)."""
        if end_ms is None:
            return self.conn.execute(QueryByKey(topic, key, begin_ms, max_count=max_count))
        return self.conn.execute(QueryByKey(topic, key, begin_ms, end_ms, max_count))

    def offset_for_time(self, topic: str, ts_ms: int, queue_id: int = 0):
        return self.conn.execute(OffsetForTime(topic, queue_id, ts_ms))

    def pop_info(self, group: str, topic: str, queue_id: int = 0):
        return self.conn.execute(PopInfo(group, topic, queue_id))
