"""At most one record per (topic, first key): the rule of a PRODUCE sent with `F_UNIQUE_KEYS`
(docs/protocol.md "Unique keys").

Why: a fleet gateway writes an inbound QoS 2 message's packet id to the session record BEFORE the
append, with a unique key the message carries (gateway/broker/broker.py `_qos2_ahead`). If that
gateway stalls (SIGSTOP, a VM freeze, a long pause) after the record and before its PRODUCE has
left, the client's session moves to another gateway, which reads the record, finds no message
with that key in the log and takes the client's PUBLISH sent again - with the same key
(lightqueue/records.py `resolve_pending_qos2` keeps it). When the stalled gateway wakes, its
PRODUCE reaches the store late. Without this rule the message was stored twice (`lmqtt bench
chaos` found it: a QoS 2 duplicate 1 s after a SIGSTOP of a gateway); with it the second PRODUCE
of that key, whichever comes second, is answered with the first's offsets and writes nothing.

What is looked at: the messages appended here since the dispatch stage last caught up (`_recent`:
the key index is built by dispatch, so a record just appended is not in it yet), then the key
index (store/index_file.py) over the last `WINDOW_MS`. A later append of the same key is stored
again: the pause this guards against is bounded by the store connection's life, far below it.
"""
from __future__ import annotations

import time

WINDOW_MS = 3_600_000      # how far back the key index is searched for an earlier record of a key


class UniqueKeys:
    """The store side of `F_UNIQUE_KEYS` over one MessageStore (StoreServer.produce calls it)."""

    def __init__(self, store) -> None:
        self.store = store
        # (topic, key) -> (physical offset, queue offset) of records appended under the rule and
        # perhaps not dispatched yet; insertion order is log order (one appender), so the oldest
        # are dropped from the front once dispatch has passed them
        self._recent: dict[tuple[str, str], tuple[int, int]] = {}
        self.duplicates = 0        # messages answered from an earlier record (counter)

    def find(self, topic: str, key: str) -> tuple[int, int] | None:
        """(physical offset, queue offset) of a record of `topic` carrying `key`, or None."""
        hit = self._recent.get((topic, key))
        if hit is not None:
            return hit
        now = int(time.time() * 1000)
        got = self.store.query_by_key(topic, key, now - WINDOW_MS, now + 60_000, 1)
        return (got[0].phys_offset, got[0].queue_offset) if got else None

    def split(self, msgs: list, always=()) -> tuple[list, dict[int, tuple[int, int] | int]]:
        """-> (the messages to append, {index in `msgs`: the stored record's (physical offset,
        queue offset), or the index of an earlier message of this batch with the same key}).
        Messages without keys, and those at the indexes `always` (delayed messages parked in the
        timer wheel), are always appended."""
        dups: dict[int, tuple[int, int] | int] = {}
        firsts: dict[tuple[str, str], int] = {}
        keep = []
        for i, m in enumerate(msgs):
            if m.keys and i not in always:
                k = (m.topic, m.keys[0])
                j = firsts.get(k)
                if j is not None:
                    dups[i] = j
                    continue
                hit = self.find(*k)
                if hit is not None:
                    dups[i] = hit
                    continue
                firsts[k] = i
            keep.append(m)
        self.duplicates += len(dups)
        return keep, dups

    def appended(self, msgs: list, offsets: list[tuple[int, int]]) -> None:
        """`msgs` were appended at `offsets`: their keys are known from now on."""
        recent = self._recent
        for m, off in zip(msgs, offsets):
            if m.keys:
                recent[(m.topic, m.keys[0])] = off
        visible = self.store.dispatch.dispatched
        while recent:
            first = next(iter(recent))
            if recent[first][0] >= visible:
                break
            del recent[first]

    @staticmethod
    def merge(n: int, appended: list[tuple[int, int]], dups: dict) -> list[tuple[int, int]]:
        """The reply's offsets for a batch of `n` messages, in its order: the appended ones' and
        the duplicates'."""
        out: list[tuple[int, int]] = []
        it = iter(appended)
        for i in range(n):
            d = dups.get(i)
            if d is None:
                out.append(next(it))
            else:
                out.append(out[d] if isinstance(d, int) else d)
        return out
