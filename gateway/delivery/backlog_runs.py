"""A reader's backlog as PUBLISH runs: the pulled records of a single reader encoded straight
into runs of PUBLISH packets, without the per-message objects of the general delivery path.

Why it is separate from `delivery.py`: the delivery engine decides what goes to whom (which
queues to read, one pull per distinct cursor, fan-out, overlapping subscriptions, shared groups)
and sends each message as an `OutboundMessage` with its PUBLISH template and an `InFlight`. This
module is a different job, an encoding fast path for one case: one reader at a cursor (typically
an offline session's backlog on reconnect) whose PUBLISHes need nothing per subscriber but QoS,
retain flag and packet id. Those are encoded from the records as one run
(`encode_publish_run`), each QoS 1 one registered in flight as one `HeldInFlight`; no
OutboundMessage, template or InFlight per message. For a 10,000-message QoS 1 backlog on
reconnect those three objects per message were about half of the broker's time. A run is written
in growing chunks (session.RUN_FLUSH_FIRST ... RUN_FLUSH_MAX messages) so the client reads the
first while the rest are encoded. Any message that needs more (QoS 2, an expiry interval, MQTT 5
properties) goes through the engine's per-message path, in queue order.

The engine hands this module what it shares with it as narrow callables and objects (its props
cache, `_outbound_message`, `_feed_session`, the offsets-moved callback). `feed` applies the same window,
No Local, byte budget and cursor rules as the engine's `_feed_session`, in a loop of its own: a
change to those rules is made in both.
"""
from __future__ import annotations

import time
from typing import Callable

from lmqtt.gateway.mqtt import encode_publish_run
from lmqtt.gateway.model.session import RUN_FLUSH_FIRST, RUN_FLUSH_MAX, HeldInFlight, OutboundMessage, Session


class BacklogRuns:
    """Feeds a single reader's pulled records to its socket as PUBLISH runs (`runnable`, `feed`).

    `metas`/`meta_of`: the engine's cache of decoded props (the dict is shared, never
    replaced); `outbound(m)`: the engine's OutboundMessage for a pulled record; `feed_session(s,
    q, messages, next_offset)`: the engine's per-message path; `session_offsets_moved(s)`: marks the
    session's offsets for the next metadata flush.
    """

    def __init__(self, cfg, metrics, *, metas: dict, meta_of: Callable[[bytes], object],
                 outbound: Callable[[object], OutboundMessage],
                 feed_session: Callable[[Session, str, list, int], bool],
                 session_offsets_moved: Callable[[Session], None]) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self._metas = metas
        self._meta_of = meta_of
        self._outbound = outbound
        self._feed_session = feed_session
        self._session_offsets_moved = session_offsets_moved

    @staticmethod
    def runnable(s: Session, q: str) -> bool:
        """Whether `s` can take queue `q`'s messages as runs: one direct subscription (no overlap
        to resolve per message), no ACL read check on `q`, no per-subscriber MQTT 5 parts (topic
        alias, subscription identifier) and no Maximum Packet Size. Everything else per message
        (the engine's `_feed_session`)."""
        conn = s.conn
        if conn is None or conn.write_blocked or s.custom or s.max_packet or len(s.direct) != 1:
            return False
        rc = conn.read_checks
        return not (rc is not None and q in rc) and q in s.direct

    def feed(self, s: Session, q: str, msgs: list, next_offset: int) -> bool:
        """The engine's `_feed_session` for one reader (`runnable`) over pulled records `msgs`
        (StoredMessages, or the remote store's RemoteMessages): plain messages (QoS 0 or 1 for
        this reader, no Message Expiry Interval, MQTT 3.1.1 or no MQTT 5 properties) go into a
        run; any other goes through `_feed_session` after the run so far is written, so the wire
        order is the queue's. Same window, No Local, byte budget and cursor rules as
        `_feed_session`; True when the byte budget stopped it (the rest at the next run)."""
        conn = s.conn
        cur = s.cursors[q]
        sub = s.direct[q]
        metas = self._metas
        meta_of = self._meta_of
        sub_qos = sub.qos
        no_local = sub.no_local
        rap = sub.retain_as_published
        cid = s.client_id
        v5 = s.version == 5
        outbound = s.outbound
        inflight = cur.inflight
        room = s.receive_max - len(outbound)
        pid = s.next_pid
        nxt = cur.next_offset
        run: list = []
        append = run.append
        chunk = RUN_FLUSH_FIRST
        sent0 = sent1 = 0
        first_ts: list = []
        budget = self.cfg.write_high_water
        complete = True
        over = False
        last_rec = None
        plain = False
        held = tuple.__new__          # HeldInFlight.of, without a call per message
        Held = HeldInFlight
        for m in msgs:
            off = m.queue_offset
            if off < nxt:
                continue
            props = m.props
            rec = metas.get(props)
            if rec is None:
                rec = meta_of(props)
            if rec is not last_rec:
                last_rec = rec
                plain = rec.message_expiry_interval is None and not (v5 and rec.has_app_properties())
            if no_local and rec.client_id == cid:
                nxt = off + 1
                continue
            qos = rec.qos if rec.qos < sub_qos else sub_qos
            if not plain or qos == 2:
                # the per-message path, after what the run holds so far
                if run:
                    _write_run(conn, run, v5)
                s.next_pid = pid
                cur.next_offset = nxt
                if self._feed_session(s, q, [self._outbound(m)], off + 1):
                    over = True
                if cur.next_offset != off + 1:        # the window is full (or the bytes budget)
                    complete = False
                    nxt = cur.next_offset
                    break
                nxt = off + 1
                pid = s.next_pid
                room = s.receive_max - len(outbound)
                if over:
                    break
                continue
            payload = m.body
            retain = rec.retain if rap else False
            if qos:
                if room <= 0:
                    complete = False
                    break
                while pid in outbound:
                    pid = pid % 65535 + 1
                outbound[pid] = held(Held, (pid, retain, q, off, m, rec))
                inflight[off] = pid
                append((m.topic, payload, 1, retain, pid))
                pid = pid % 65535 + 1
                room -= 1
                sent1 += 1
            else:
                append((m.topic, payload, 0, retain, None))
                sent0 += 1
            if m.store_ts:
                first_ts.append(m.store_ts)
            nxt = off + 1
            if len(run) >= chunk:
                _write_run(conn, run, v5)
                conn.flush()
                if chunk < RUN_FLUSH_MAX:
                    chunk *= 2
            budget -= len(payload)
            if budget <= 0:
                over = True       # the rest next run (or after resume_writing)
                break
        if run:
            _write_run(conn, run, v5)
        s.next_pid = pid
        if complete and not over and nxt < next_offset:
            nxt = next_offset
        cur.next_offset = nxt
        mo = self.metrics.msg_out
        mo[0] += sent0
        mo[1] += sent1
        if first_ts:
            now_ms = time.time() * 1000.0
            self.metrics.dispatch_lag.observe_many([max(0.0, (now_ms - ts) / 1000.0) for ts in first_ts])
        if s.expiry_interval:
            self._session_offsets_moved(s)
        return over


def _write_run(conn, run: list, v5: bool) -> None:
    conn.write(encode_publish_run(run, 5 if v5 else 4)[0])
    run.clear()
