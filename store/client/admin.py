"""Admin and queries: topics/queues, offsets, lag per group, store stats, lookups by msg id, by
key within a time range (the key index), first offset at or after a time."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .connection import Connection
from .consumer import Record


def records_of(ident: str | None, res) -> list[Record]:
    """The Records of an admin query's MESSAGES reply (`ident`: the connection's, for msg ids);
    Admin's and AsyncAdmin's."""
    _header, raw = res
    ident = ident or ""
    return [Record(t, b, k, p, qid, qo, po, born, st, f"{ident}{po:016X}")
            for qo, po, born, st, qid, t, k, p, b in raw]


class Admin:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def _msgs(self, res) -> list[Record]:
        return records_of(self.conn.ident, res)

    def topics(self) -> list[dict]:
        """[{topic (first level), queue_id, max_offset}] of every ConsumeQueue."""
        return self.conn.cmd("topics")["queues"]

    def offsets(self, topic: str, queue_id: int = 0) -> tuple[int, int]:
        r = self.conn.cmd("offsets", topic=topic, queue_id=queue_id)
        return r["min_offset"], r["max_offset"]

    def committed(self, group: str, topic: str, queue_id: int = 0) -> int | None:
        return self.conn.cmd("committed", group=group, topic=topic, queue_id=queue_id)["offset"]

    def lag(self, group: str) -> list[dict]:
        return self.conn.cmd("lag", group=group)["queues"]

    def stats(self) -> dict:
        return self.conn.cmd("stats")

    def get_by_msg_id(self, msg_id: str) -> Record | None:
        r = self._msgs(self.conn.cmd("get_by_msg_id", msg_id=msg_id))
        return r[0] if r else None

    def query_by_key(self, topic: str, key: str, begin_ms: int = 0, end_ms: int | None = None,
                     max_count: int = 32) -> list[Record]:
        end_ms = int(time.time() * 1000) + 1000 if end_ms is None else end_ms
        return self._msgs(self.conn.cmd("query_by_key", topic=topic, key=key, begin_ms=begin_ms, end_ms=end_ms,
                                        max_count=max_count))

    def offset_for_time(self, topic: str, ts_ms: int, queue_id: int = 0) -> int:
        return self.conn.cmd("offset_for_time", topic=topic, queue_id=queue_id, ts=ts_ms)["offset"]

    def pop_info(self, group: str, topic: str, queue_id: int = 0) -> dict:
        return self.conn.cmd("pop_info", group=group, topic=topic, queue_id=queue_id)
