"""POP consumption (as RocketMQ 5's POP consumers): store-side load balancing for SDK consumer
groups.

Many stateless consumers share a group without rebalancing: each `pop` hands out messages of a
ConsumeQueue that no other member holds, invisible to the others for `invisible_ms`. `ack` removes
one for good; one not acked by then becomes visible again and is handed out once more (its
attempt count grows); at `max_attempts` it is re-written to the group's dead-letter topic
`%DLQ%<group>` instead (an ordinary topic: consume it like any other) and dropped from the queue.

State per (group, topic, queue id), in memory and persisted in `SdkMetadata` (JSON, written at most
every `persist_interval` by the server's timer and at shutdown):
    next      first queue offset never handed out
    inflight  {queue offset: [visible-again-at ms, attempts so far]}
A crash loses at most the last interval of state; that can only hand a message out again
(at-least-once), never lose one: `next` and acks are re-applied from the previous snapshot.
On a store group member (`eager`, set by store/node/ha_member.py) every change is written at once,
in the call that made it (a pop, an ack, a change of invisible time), so the write is shipped to
the replicas and the call answers once they have it (docs/ha.md): an acknowledged message is not
popped again by the next primary.
After a recovery that cut the log (store/recovery.py), a state whose `next` lies beyond its
queue's end at the cut is brought back to it (its in-flight offsets at/after the end dropped: they
would name the new messages appended there), as are the group offsets, when the manager is made.

Receipts are the queue offsets themselves (RocketMQ uses receipt handles carrying the pop time so a
late ack of an already re-delivered message is refused; here a late ack still removes it).
"""
from __future__ import annotations

import time

from .fastpath import RawRecord, read_raw_records
from .message import Message
from .sdk_meta import SdkMetadata, cq_key, queue_label


def _now_ms() -> int:
    return int(time.time() * 1000)


def dlq_topic(group: str) -> str:
    return f"%DLQ%{group}"


class PopManager:
    def __init__(self, store, meta: SdkMetadata) -> None:
        self.store = store
        self.meta = meta
        self._states: dict[tuple[str, str, int], dict] = {}
        self._dirty: set[tuple[str, str, int]] = set()
        # write each change in the call that made it, not at the next persist (a group member)
        self.eager = False
        # fn() called when the first change after a persist is made (the server arms its persist
        # timer then, instead of waking every interval for nothing)
        self.on_dirty = None
        self._check_after_recovery()

    def forget_memory(self) -> None:
        """Drop the states held in memory and their unwritten changes: a group member changing
        role reads the shipped state again (a new primary) or must not write its stale state over
        it (a replica)."""
        self._states.clear()
        self._dirty.clear()

    @property
    def dirty(self) -> bool:
        """Changes made since the last persist are still unwritten."""
        return bool(self._dirty)

    def state_keys(self) -> set[tuple[str, str, int]]:
        """(group, topic, queue id) of every POP state held in memory."""
        return set(self._states)

    def _check_after_recovery(self) -> None:
        """If the store's log was cut since the SDK metadata was last checked (its recoveries newer
        than the generation kept there), bring group offsets and POP states beyond their queue's
        end at the cut back to it. Runs before any client can be served (the StoreServer makes
        this manager when it is made)."""
        recoveries = getattr(self.store, "recoveries", None)
        if recoveries is None:
            return
        meta = self.meta
        checked = meta.recovery_checked()
        if checked == recoveries.generation:
            return
        cut = recoveries.cut_since(checked)
        if cut is not None:
            meta.reset_offsets_beyond(self.store, cut)
            for key in meta.keys_with_prefix("s\0"):
                parts = key.split("\0")      # s, group, topic, queue id
                group, topic, qid = parts[1], "\0".join(parts[2:-1]), parts[-1]
                st = meta.get_json(key)
                if st is None:
                    continue
                qk = cq_key(topic, int(qid))
                end = self.store.queue_end_at("cq", qk[3:], cut)
                if end is None or st["next"] <= end:
                    continue
                self.store.offset_reset(f"group {group} (POP)", queue_label(qk), st["next"], end)
                st["next"] = end
                st["inflight"] = {o: e for o, e in st["inflight"].items() if int(o) < end}
                meta.put_json(key, st)
        meta.set_recovery_checked(recoveries.generation)

    def _key(self, k) -> str:
        return f"s\0{k[0]}\0{k[1]}\0{k[2]}"

    def _state(self, group: str, topic: str, qid: int) -> dict:
        k = (group, topic, qid)
        st = self._states.get(k)
        if st is None:
            st = self.meta.get_json(self._key(k))
            if st is None:
                lo, _hi = self.store.consume_queue_offsets(topic, qid)
                st = {"next": lo, "inflight": {}}
            else:
                st["inflight"] = {int(o): v for o, v in st["inflight"].items()}
            self._states[k] = st
        return st

    def _read(self, topic: str, qid: int, off: int, n: int, raw: bool) -> list:
        if raw:
            recs = read_raw_records(self.store, topic, qid, off, n)
            if recs is not None:
                return recs
        return self.store.read_consume_queue(topic, qid, off, n)

    def pop(self, group: str, topic: str, qid: int, max_count: int, invisible_ms: int,
            max_attempts: int, raw: bool = False) -> tuple[list, list[int], int]:
        """-> (messages, attempts per message, dead-lettered count).

        `raw`: messages are `RawRecord`s (the CommitLog bytes, CRC-checked, not decoded) where the
        store can serve them so (store/fastpath.py), StoredMessages where it cannot; the caller
        answers in the raw layout only when all are raw."""
        st = self._state(group, topic, qid)
        now = _now_ms()
        inflight = st["inflight"]
        out, attempts = [], []
        dead = 0
        due = sorted(o for o, (vis, _a) in inflight.items() if vis <= now)
        for off in due:
            if len(out) >= max_count:
                break
            vis, att = inflight[off]
            msgs = self._read(topic, qid, off, 1, raw)
            if not msgs or msgs[0].queue_offset != off:   # gone (retention): forget it
                del inflight[off]
                continue
            m = msgs[0]
            if att >= max_attempts:
                if isinstance(m, RawRecord):
                    m = m.message(self.store.ident)
                self.store.append(Message(dlq_topic(group), m.body, 0, m.flags, m.props, m.keys, m.born_ts))
                del inflight[off]
                dead += 1
                continue
            inflight[off] = [now + invisible_ms, att + 1]
            out.append(m)
            attempts.append(att + 1)
        if len(out) < max_count:
            lo, _hi = self.store.consume_queue_offsets(topic, qid)
            if st["next"] < lo:
                st["next"] = lo
            fresh = self._read(topic, qid, st["next"], max_count - len(out), raw)
            vis = now + invisible_ms
            for m in fresh:
                inflight[m.queue_offset] = [vis, 1]
                out.append(m)
                attempts.append(1)
            if fresh:
                st["next"] = fresh[-1].queue_offset + 1
        if out or dead:
            self._changed((group, topic, qid))
        return out, attempts, dead

    def ack(self, group: str, topic: str, qid: int, offsets) -> int:
        st = self._state(group, topic, qid)
        inflight = st["inflight"]
        n = 0
        for o in offsets:
            if inflight.pop(int(o), None) is not None:
                n += 1
        if n:
            self._changed((group, topic, qid))
        return n

    def change_invisible_time(self, group: str, topic: str, qid: int, offset: int, invisible_ms: int) -> bool:
        st = self._state(group, topic, qid)
        e = st["inflight"].get(int(offset))
        if e is None:
            return False
        e[0] = _now_ms() + invisible_ms
        self._changed((group, topic, qid))
        return True

    def info(self, group: str, topic: str, qid: int) -> dict:
        st = self._state(group, topic, qid)
        _lo, hi = self.store.consume_queue_offsets(topic, qid)
        return {"next": st["next"], "inflight": len(st["inflight"]), "backlog": max(0, hi - st["next"])}

    def _changed(self, k: tuple[str, str, int]) -> None:
        if self.eager:
            self._dirty.discard(k)
            self._write(k)
        else:
            first = not self._dirty
            self._dirty.add(k)
            if first and self.on_dirty is not None:
                self.on_dirty()

    def _write(self, k: tuple[str, str, int]) -> None:
        st = self._states[k]
        self.meta.put_json(self._key(k), {"next": st["next"],
                                          "inflight": {str(o): v for o, v in st["inflight"].items()}})

    def persist(self) -> None:
        for k in list(self._dirty):
            self._write(k)
        self._dirty.clear()
