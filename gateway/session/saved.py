"""What a persistent session saves of its exchanges and how it takes them back: the snapshot kept
in its record (gateway/clients/session_persistence.py writes it, `extra["inflight"]`).

Why the exchanges are kept (MQTT-4.1.0-1, §4.4): a restart resumes them as MQTT asks of a session -
the same packet ids, PUBLISH again with DUP or PUBREL for those past PUBREC, inbound QoS 2 ids
awaiting PUBREL still known. Without them a restarted server would send its unacknowledged
messages again as new ones, and a QoS 2 message the client had already received would reach its
application twice.

The snapshot: `{"out": [[pid, queue, offset, qos, retain, state, sub_ids], ...] in send order,
"next": {queue: next offset to deliver}, "in2": [inbound QoS 2 ids], "pid": next packet id}` and
"in2p": [[id, topic, key, ms], ...], inbound QoS 2 ids written ahead of their append, which the
store settles when the record is read (lightqueue/records.py `resolve_pending_qos2`, which reads
the same two keys). Only messages read from a light queue are kept (retained messages, a shared
group's and a history's were never kept across a restart). "next" says where delivery stood:
whatever below it is not in "out" was done, so the committed offsets may follow lazily.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from lmqtt.gateway.session.messages import InFlight

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.session.machine import MqttSession

OUT, NEXT, IN2, IN2_PENDING, PID = "out", "next", "in2", "in2p", "pid"
MAX_SAVED_INFLIGHT = 4096     # more exchanges in flight: not kept (delivered again from the committed offsets, as new)


class Saved:
    """The persistent part of `MqttSession` (a mixin: the fields are the session's slots)."""

    __slots__ = ()

    def snapshot(self: "MqttSession") -> dict | None:
        """The session's exchanges as its record keeps them (see the module), or None when there is
        nothing to keep. A state restored without its messages and not resumed yet (`keep_saved`)
        is kept as it was read."""
        if self._saved is not None:
            return self._saved
        out = []
        cursors = self.cursors
        # every queue's: what is below it and not in "out" was done (the offsets may lag behind)
        nxt = {q: cur.next_offset for q, cur in cursors.items()}
        for inf in self._window.values():
            q, off = inf[3], inf[4]
            if inf[5] is not None or q is None or off is None or q not in cursors:
                continue
            out.append([inf[0], q, off, inf[1], inf[2], inf[7], list(inf[6]) if inf[6] else None])
        keys = self._in_keys
        in2 = self._in2 or ()
        if len(out) > MAX_SAVED_INFLIGHT or not (out or in2 or nxt or keys):
            return None
        state: dict[str, Any] = {OUT: out, NEXT: nxt, IN2: sorted(in2), PID: self.next_pid}
        if keys:
            state[IN2_PENDING] = [[pid, topic, key, ms] for pid, (topic, key, ms) in keys.items()]
        return state

    def plain_snapshot_pid(self: "MqttSession") -> int | None:
        """The next packet id when the snapshot holds nothing but it and "next" (nothing in flight
        either way, nothing written ahead, no state kept as read): the record writer's template
        case; None otherwise (it then writes `snapshot()`)."""
        if self._saved is None and not self._window and not self._in_keys and not self._in2:
            return self.next_pid
        return None

    def change_mark(self: "MqttSession") -> tuple[int, int]:
        """What of the exchanges a record would show differently once changed: (messages in
        flight, next packet id)."""
        return len(self._window), self.next_pid

    def restore(self: "MqttSession", state: dict, message_at: Callable[[str, int], Any],
                requeued: list | None = None) -> int:
        """Put the exchanges a snapshot kept back into a session just restored from its record (its
        cursors at the committed offsets); `message_at(queue, offset)` reads a message again (an
        OutboundMessage, or None when it cannot: deleted by retention, or not read ahead by a fleet
        gateway). All of a queue's exchanges are resumed or none: a queue with one missing is
        delivered again from its committed offset, as new messages, never past one. Returns how
        many outbound were resumed; `requeued` (if given) gets (queue, offset, why) of each queue
        delivered again from its committed offset instead (the caller logs it: those of its
        messages the client had completed since its committed offset are delivered twice)."""
        per_queue: dict[str, list] = {}
        for entry in state.get(OUT, ()):
            per_queue.setdefault(entry[1], []).append(entry)
        window = self._window
        resumed: list[InFlight] = []
        moved: dict[str, int] = {}
        nxt = state.get(NEXT, {})
        for q, entries in per_queue.items():
            cur = self.cursors.get(q)
            if cur is None or q not in self.direct:
                continue                    # unsubscribed since
            if cur.busy():                  # already delivering (not a state this restore made)
                if requeued is not None:
                    requeued.append((q, entries[0][2], "its cursor has messages in flight already"))
                continue
            mine: list[InFlight] | None = []
            for pid, _q, off, qos, retain, st, ids in entries:
                if off < cur.next_offset:
                    continue                # below the committed offset: acknowledged since the snapshot
                if pid in window:
                    mine = None             # the record is not this state
                    if requeued is not None:
                        requeued.append((q, off, f"packet id {pid} in flight twice"))
                    break
                it = message_at(q, off)
                if it is None:
                    mine = None
                    if requeued is not None:
                        requeued.append((q, off, "message not readable"))
                    break
                mine.append(InFlight.of(pid, qos, retain, q, off, None, tuple(ids) if ids else None, it,
                                        it.record, st))
            if mine is not None:
                # everything below the snapshot's "next" not among its exchanges was done: not again
                resumed += mine
                moved[q] = max([int(nxt.get(q, 0))] + [inf[4] + 1 for inf in mine])
        for q, n in nxt.items():            # queues with nothing in flight: where delivery stood
            cur = self.cursors.get(q)
            if q not in per_queue and cur is not None and q in self.direct and not cur.busy():
                moved[q] = int(n)
        order = {e[0]: i for i, e in enumerate(state.get(OUT, ()))}
        resumed.sort(key=lambda inf: order[inf[0]])
        for inf in resumed:                 # in send order, as they go out again
            window[inf[0]] = inf
        for inf in sorted(resumed, key=lambda inf: inf[4]):
            self.cursors[inf[3]].hold(inf[4], inf[0])     # a cursor's in-flight: offset order
        for q, n in moved.items():
            cur = self.cursors[q]
            cur.next_offset = max(cur.next_offset, n)
        in2 = [int(p) for p in state.get(IN2, ())]
        if in2:
            if self._in2 is None:
                self._in2 = set()
            self._in2.update(in2)
        for entry in state.get(IN2_PENDING, ()):
            # not found in the log when the record was read: the client's PUBLISH sent again
            # carries the same key (broker.py `_qos2_ahead`), stored at most once
            try:
                pid, topic, key, ms = entry
                self.write_ahead(int(pid), str(topic), str(key), int(ms))
            except (TypeError, ValueError):
                continue
        self.next_pid = int(state.get(PID) or 1)
        return len(resumed)

    def keep_saved(self: "MqttSession", state: dict) -> None:
        """Keep a record's exchanges as read, unchanged (a gateway over a remote store restores its
        sessions at start without their messages): written back as they are until `resume_saved`."""
        self._saved = state

    def has_saved(self: "MqttSession") -> bool:
        return self._saved is not None

    def resume_saved(self: "MqttSession", message_at: Callable[[str, int], Any],
                     requeued: list | None = None) -> int:
        """The exchanges kept by `keep_saved` put back (`restore`) with the messages `message_at`
        reads now; returns how many outbound were resumed (what cannot be read is delivered again
        as new: at least once, never lost). Nothing kept: 0."""
        state, self._saved = self._saved, None
        return 0 if state is None else self.restore(state, message_at, requeued)

    def exchanges_text(self: "MqttSession", most: int = 8) -> str:
        """The exchanges in flight for a log line, at most `most` of each kind: outbound as
        `pid:queue@offset/state`, the inbound QoS 2 ids stored (awaiting PUBREL) and those written
        ahead with their keys. Why: what a restart resumed (a PUBLISH answered as a duplicate, an
        offset resumed or skipped) is read from these when a delivery goes missing."""
        out = [f"{inf[0]}:{inf[3]}@{inf[4]}/{inf[7]}" for inf in list(self._window.values())[:most]]
        in2 = sorted(self._in2 or ())[:most]
        ahead = [f"{pid}:{key}" for pid, (_t, key, _ms) in list((self._in_keys or {}).items())[:most]]
        return f"out={out} in2={in2} in2_ahead={ahead}"

    def saved_counts(self: "MqttSession") -> tuple[int, int]:
        """(outbound, inbound QoS 2) exchanges of the state kept as read, for logs."""
        st = self._saved or {}
        return len(st.get(OUT, ())), len(st.get(IN2, ()))
