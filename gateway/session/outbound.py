"""The session machine's outbound side: messages offered for delivery -> PUBLISH frames and the
in-flight window; the client's PUBACK / PUBREC / PUBCOMP -> what is released.

Inputs come in batches, as delivery reads them: `offer` takes a pulled batch of one queue (the
general path: overlapping subscriptions, an ACL read rule, MQTT 5 per-subscriber parts, expiry),
`offer_records` a single reader's run of stored records straight from the store (encoded as one
run of PUBLISHes, `encode_publish_run`, with an `InFlight` per QoS 1 message and no
`OutboundMessage` in between: an offline session's backlog on reconnect), `offer_retained` the
retained messages of a SUBSCRIBE, `send` one message (a shared group's, a history's, `$SYS`).
Outputs go to what the driver hands in, never to a socket: `write(frame)` (the connection's
coalesced output: frames of one batch are joined by it), `flush()` (a long run's chunk goes out
now, so the client starts reading while the rest is encoded) and `tally` (the counters: PUBLISHes
sent by QoS, drops by reason, the store times of messages sent for the first time: `Tally`). The
cursor moves and the window are the machine's own state; the return value says what the driver
must do next (`OVER`: the byte budget stopped the batch, the rest next run; `QOS2_SENT`: new QoS 2
PUBLISHes are queued, a persistent session's record goes ahead of them).

The packet-id allocator is `_take_ids`: every path that sends QoS 1/2 takes a run of free ids at
once from `next_pid`, and moves `next_pid` past the last one it used.
"""
from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Protocol

from lmqtt.store.accel import load as load_accel
from lmqtt.gateway.mqtt import (ReasonCode as RC, encode, encode_publish_run, encode_publish_v5_parts,
                                message_expiry_prop, packets as P, subscription_identifier_props, topic_alias_prop)
from lmqtt.gateway.session.messages import (EXPIRED, RUN_FLUSH_FIRST, RUN_FLUSH_MAX, TOO_LARGE, WAIT_ACK, WAIT_COMP,
                                            InFlight, OutboundMessage, RetainedMessage)

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.session.machine import MqttSession

# what an offer asks of its driver (bits of the returned int)
OVER = 1          # the byte budget stopped it: the rest at the next run (or after the socket drains)
QOS2_SENT = 2     # new QoS 2 PUBLISHes were queued: a persistent session's record is written ahead of them

_new = tuple.__new__

# `offer`'s steady state in C (gateway/session/_offer.c): one queue's batch to a session reading it
# through one plain subscription, without an ACL read rule, MQTT 5 per-subscriber parts or a
# Maximum Packet Size; it gives back None (nothing done) for what it does not take, and uses this
# machine's `_take_ids` and `_close_offer`. tests/session/test_offer_accel.py compares the two.
_offer_mod = load_accel("lmqtt.gateway.session._offer")
if _offer_mod is not None:
    _offer_mod.configure(OutboundMessage, InFlight, OVER, QOS2_SENT, WAIT_ACK)
_offer_c = _offer_mod.offer if _offer_mod is not None else None


class Tally(Protocol):
    """Where the machine counts what it sent and dropped (the gateway's metrics, `GatewayMetrics`;
    `Counts` in tests)."""

    msg_out: list[int]                 # PUBLISH packets sent, by QoS

    def dropped(self, why: int) -> None:
        """A message not sent to a client: EXPIRED or TOO_LARGE."""

    def first_sent(self, store_ts: list[int]) -> None:
        """Messages sent for the first time (to anyone), by their store time (the dispatch lag)."""


class Counts:
    """A `Tally` that only counts (tests, tools): `msg_out`, `drops` {why: n}, `first` store times."""

    def __init__(self) -> None:
        self.msg_out = [0, 0, 0]
        self.drops: dict[int, int] = {}
        self.first: list[int] = []

    def dropped(self, why: int) -> None:
        self.drops[why] = self.drops.get(why, 0) + 1

    def first_sent(self, store_ts: list[int]) -> None:
        self.first += store_ts


class Outbound:
    """The outbound half of `MqttSession` (a mixin: the fields are the session's slots)."""

    __slots__ = ()

    # -- the window ---------------------------------------------------------------------------
    def window_room(self: "MqttSession") -> int:
        """QoS 1/2 messages the client's Receive Maximum lets us send now."""
        return self._receive_max - len(self._window)

    def window_open(self: "MqttSession") -> bool:
        return len(self._window) < self._receive_max

    def inflight_count(self: "MqttSession") -> int:
        return len(self._window)

    def inflight(self: "MqttSession") -> tuple[InFlight, ...]:
        """The messages in flight, in send order (a copy, for readers: the console, tests)."""
        return tuple(self._window.values())

    def _take_ids(self: "MqttSession", n: int) -> list[int]:
        """`n` free packet identifiers, in allocation order from `next_pid` (MQTT-2.2.1-3: unused
        by any exchange in flight); not registered: the caller puts each it uses in the window and
        moves `next_pid` past the last one (`_used`)."""
        window = self._window
        if n > 65535 - len(window):
            raise RuntimeError(f"no {n} free packet identifiers ({len(window)} messages in flight)")
        pid = self.next_pid
        out = []
        append = out.append
        for _ in range(n):
            while pid in window:
                pid = pid % 65535 + 1
            append(pid)
            pid = pid % 65535 + 1
        return out

    def _used(self: "MqttSession", pid: int) -> None:
        """`pid` was the last id taken and used: the next search starts after it."""
        self.next_pid = pid % 65535 + 1

    def _release_cursor(self: "MqttSession", inf: InFlight) -> None:
        q = inf[3]
        if q is not None and inf[5] is None:
            cur = self.cursors.get(q)
            if cur is not None:
                d = cur._inflight
                if d:
                    d.pop(inf[4], None)

    # -- what the client acknowledges ---------------------------------------------------------
    def puback_received(self: "MqttSession", pid: int) -> InFlight | None:
        """PUBACK: the QoS 1 message released (its cursor's offset too), or None for an id not in
        flight at QoS 1 (a late ack after a reconnect: ignored)."""
        window = self._window
        inf = window.get(pid)
        if inf is None or inf[1] != 1:
            return None
        del window[pid]
        self._release_cursor(inf)
        return inf

    def pubrec_received(self: "MqttSession", pid: int,
                        reason_code: int = 0) -> tuple[bytes | None, InFlight | None, bool]:
        """PUBREC: (frame to send, message released, after_record).
        - in flight at QoS 2: (PUBREL, None, True for a persistent session) - the exchange now waits
          for PUBCOMP (MQTT-4.3.3-4), and a persistent session's PUBREL leaves only once its record
          holds that (exactly once across a crash);
        - an error code (MQTT 5, >= 0x80): (None, the message, False) - it is dropped (MQTT 5 §4.3.3);
        - an id not in flight at QoS 2: (PUBREL 0x92 for MQTT 5, None, False)."""
        window = self._window
        inf = window.get(pid)
        if inf is None or inf[1] != 2:
            return (encode(P.PubRel(pid, RC.PACKET_IDENTIFIER_NOT_FOUND if self.version == 5 else 0), self.version),
                    None, False)
        if reason_code >= RC.UNSPECIFIED_ERROR:
            del window[pid]
            self._release_cursor(inf)
            return None, inf, False
        window[pid] = inf.acknowledged()
        return encode(P.PubRel(pid), self.version), None, self.expiry_interval > 0

    def pubcomp_received(self: "MqttSession", pid: int) -> InFlight | None:
        """PUBCOMP: the QoS 2 message released (MQTT-4.3.3-5), or None for an id with no PUBREL
        sent (not in flight, or still awaiting its PUBREC): ignored."""
        window = self._window
        inf = window.get(pid)
        if inf is None or inf[7] != WAIT_COMP:
            return None
        del window[pid]
        self._release_cursor(inf)
        return inf

    def after_record(self: "MqttSession") -> bool:
        """Whether a QoS 2 packet that depends on a state change (PUBREL, PUBREC, PUBCOMP, a batch
        of new QoS 2 PUBLISHes) leaves only once the session's record holds the change: a
        persistent session's does (exactly once across a crash); another's goes at once."""
        return self.expiry_interval > 0

    # -- per-subscriber encoding --------------------------------------------------------------
    def publish_bytes(self: "MqttSession", message: OutboundMessage, qos: int, retain: bool, pid: int | None,
                      dup: bool = False, sub_ids=None, now_ms: float | None = None, resend: bool = False):
        """The PUBLISH for this client with everything MQTT 5 makes per-subscriber: remaining
        message expiry, subscription identifiers, topic alias; checked against the client's
        Maximum Packet Size. Returns bytes, or EXPIRED / TOO_LARGE (not sent: the caller drops it
        for this client). A `resend` (in flight before a reconnect) is not dropped for expiry:
        onward delivery had started (§3.3.2.3.3)."""
        left = message.expiry_left(time.time() * 1000.0 if now_ms is None else now_ms)
        if left == 0:
            if not resend:
                return EXPIRED
            left = 1
        maxp = self._max_packet
        if self.version != 5:
            data = message.encode(qos, retain, self.version, pid, dup)
        elif not sub_ids and not self._alias_max:
            data = (message.encode(qos, retain, 5, pid, dup) if left is None
                    else message.encode_with_expiry(qos, retain, pid, dup, left))
        else:
            extra = message.properties_body()
            if left is not None:
                extra += message_expiry_prop(left)
            if sub_ids:
                extra += subscription_identifier_props(sub_ids)
            topic: str | None = message.topic
            new_alias = False
            evicted = None
            if self._alias_max:
                aliases = self._aliases            # topic -> alias, least recently used first
                alias = aliases.pop(topic, None)
                if alias is not None:
                    aliases[topic] = alias         # now the most recently used
                    extra += topic_alias_prop(alias)
                    topic = None           # the client knows the alias: empty topic name
                else:
                    if len(aliases) < self._alias_max:
                        alias = len(aliases) + 1
                    else:
                        # all in use: the least recently used alias now names this topic; the
                        # client re-maps it on this PUBLISH (topic and alias, §3.3.2.3.4)
                        evicted = next(iter(aliases))
                        alias = aliases.pop(evicted)
                    aliases[topic] = alias
                    extra += topic_alias_prop(alias)   # topic and alias: the client records it
                    new_alias = True
            data = encode_publish_v5_parts(topic, message.payload, qos, retain, dup, pid, extra)
            if new_alias and maxp and len(data) > maxp:
                # not sent: the client never learnt this mapping, and still has the one it replaced
                alias = self._aliases.pop(message.topic)
                if evicted is not None:
                    self._aliases[evicted] = alias
        if maxp and len(data) > maxp:
            return TOO_LARGE
        return data

    def count_drop(self: "MqttSession", why: int, tally: Tally) -> None:
        """A message not sent to this client (`why`: EXPIRED or TOO_LARGE), counted here and in `tally`."""
        if why == EXPIRED:
            self.dropped_expired += 1
        else:
            self.dropped_too_large += 1
        tally.dropped(why)

    def owner_of(self: "MqttSession", it: OutboundMessage, q: str) -> tuple[str, int]:
        """Overlapping subscriptions (a message in several queues this session reads): the queue it
        is delivered from - the matching subscription with the highest QoS, ties: the smallest
        queue name - and that QoS (MQTT 3.1.1 §3.3.5; MQTT 5 §3.3.4 allows the same)."""
        direct = self.direct
        best_q, best_qos = q, direct[q].qos
        own = it.record.client_id == self.client_id
        for dq in it.dispatch_queues:
            if dq == q:
                continue
            sub = direct.get(dq)
            if sub is None or (own and sub.no_local):    # No Local: that subscription does not match
                continue
            if sub.qos > best_qos or (sub.qos == best_qos and dq < best_q):
                best_q, best_qos = dq, sub.qos
        return best_q, best_qos

    def takes_runs(self: "MqttSession", q: str) -> bool:
        """Whether queue `q`'s records can go to this client as runs (`offer_records`): one direct
        subscription (no overlap to resolve per message), no per-subscriber MQTT 5 parts (topic
        alias, subscription identifier) and no Maximum Packet Size. The driver checks its own part
        (the socket, an ACL read rule)."""
        return not self._custom and not self._max_packet and len(self.direct) == 1 and q in self.direct

    def takes_plain(self: "MqttSession", sub_ids) -> bool:
        """Whether a PUBLISH without properties can go to this client as it is (no topic alias or
        subscription identifier to add; a Maximum Packet Size is checked by the run's encoder)."""
        return self.version != 5 or (not sub_ids and not self._alias_max)

    @property
    def max_packet_size(self: "MqttSession") -> int:
        """The client's Maximum Packet Size (0: none)."""
        return self._max_packet

    # -- messages offered ---------------------------------------------------------------------
    def send(self: "MqttSession", message: OutboundMessage, qos: int, retain: bool, write: Callable[[bytes], Any],
             tally: Tally, group: Any = None, sub_ids=None, now_ms: float | None = None) -> int | None | bool:
        """One PUBLISH (the window has room, checked by the caller for QoS 1/2): the packet id for
        QoS 1/2, None for QoS 0, or False when the message was dropped for this client (expired,
        or over its Maximum Packet Size; counted). `group`: the shared group that handed it out
        (its offset is the group's to release)."""
        pid = self._take_ids(1)[0] if qos else None
        data = self.publish_bytes(message, qos, retain, pid, False, sub_ids, now_ms)
        if type(data) is not bytes:
            self.count_drop(data, tally)
            return False
        if pid is None:
            write(data)
            tally.msg_out[0] += 1
            return None
        self._window[pid] = _new(InFlight, (pid, qos, retain, None, message.queue_offset, group, sub_ids,
                                            WAIT_ACK, message, message.record))
        self._used(pid)
        write(data)
        tally.msg_out[qos] += 1
        return pid

    def offer(self: "MqttSession", q: str, messages: list[OutboundMessage], next_offset: int,
              write: Callable[[bytes], Any], tally: Tally, budget: int,
              can_read: Callable[[str], bool] | None = None, now_ms: float | None = None) -> int:
        """Send what this session can take of `messages` (one pulled batch of queue `q`, which it
        reads through a direct subscription; `next_offset`: the offset after the batch). Stops at
        the first QoS 1/2 message the window has no room for, so per-queue order is kept and the
        cursor stays on that message; `budget`: payload bytes this call may queue (the socket's
        high-water mark: writes are coalesced until the end of the loop iteration, so a client
        that never reads must not get window x payload queued at once). `can_read(topic)`: the
        ACL's read rule, when it applies to `q`; `now_ms`: the time a Message Expiry Interval is
        counted to (None: the clock, read when a message has one). Returns OVER | QOS2_SENT bits.

        The hot loop of fan-out: everything per-session is hoisted out of it."""
        direct = self.direct
        if (_offer_c is not None and can_read is None and len(direct) == 1 and not self._custom
                and not self._max_packet and messages.__class__ is list):
            flags = _offer_c(self, q, messages, next_offset, write, tally, budget)
            if flags is not None:
                return flags
        cur = self.cursors[q]
        sub = direct[q]
        multi = len(direct) > 1
        window = self._window
        room = self._receive_max - len(window)
        sub_qos = sub.qos
        no_local = sub.no_local
        rap = sub.retain_as_published
        cid = self.client_id
        version = self.version
        # MQTT 5 per-subscriber parts (topic alias, subscription identifiers) or a message with an
        # expiry interval take `publish_bytes`; everything else the shared template variant
        custom = self._custom
        maxp = self._max_packet
        one_ids = (sub.subscription_id,) if sub.subscription_id else None
        inflight = cur._inflight
        nxt = cur.next_offset
        sent0 = sent1 = sent2 = 0
        first_ts = None           # store timestamps of messages sent here for the first time
        complete = True
        over = False
        ids = None                # packet ids taken for this batch (`_take_ids`), `used` of them so far
        used = 0
        for it in messages:
            off = it.queue_offset
            if off < nxt:
                continue
            qos = sub_qos
            rec = it.record
            if no_local and rec.client_id == cid:
                nxt = off + 1
                continue
            if multi:
                owner, qos = self.owner_of(it, q)
                if owner != q:
                    nxt = off + 1
                    continue
            if can_read is not None and not can_read(it.topic):
                nxt = off + 1
                continue
            if rec.qos < qos:
                qos = rec.qos
            if qos:
                if room <= 0:
                    complete = False
                    break
                if ids is None:
                    ids = self._take_ids(room if room < len(messages) else len(messages))
                pid = ids[used]
            else:
                pid = None
            retain = rec.retain if rap else False
            sids = None
            if custom or rec.message_expiry_interval is not None:
                if custom:
                    sids = self.sub_ids_for(it, q) if multi else one_ids
                if now_ms is None:
                    now_ms = time.time() * 1000.0
                data = self.publish_bytes(it, qos, retain, pid, False, sids, now_ms)
                if type(data) is not bytes:
                    self.count_drop(data, tally)      # expired, or over the client's Maximum Packet Size
                    nxt = off + 1
                    continue
            else:
                data = it.encode(qos, retain, version, pid)
                if maxp and len(data) > maxp:
                    self.count_drop(TOO_LARGE, tally)
                    nxt = off + 1
                    continue
            if not it.sent:
                it.sent = True
                if it.store_ts:
                    if first_ts is None:
                        first_ts = [it.store_ts]
                    else:
                        first_ts.append(it.store_ts)
            if pid is None:
                write(data)
                sent0 += 1
            else:
                used += 1
                window[pid] = _new(InFlight, (pid, qos, retain, q, off, None, sids, WAIT_ACK, it, rec))
                write(data)
                if inflight is None:
                    inflight = cur._inflight = {}
                inflight[off] = pid
                room -= 1
                if qos == 1:
                    sent1 += 1
                else:
                    sent2 += 1
            nxt = off + 1
            budget -= len(it.payload)
            if budget <= 0:
                over = True       # the rest next run (or after the socket drained)
                break
        self._close_offer(cur, nxt, next_offset, complete and not over, ids, used, tally, sent0, sent1, sent2,
                          first_ts)
        return (OVER if over else 0) | (QOS2_SENT if sent2 else 0)

    def offer_records(self: "MqttSession", q: str, msgs: list, next_offset: int, write: Callable[[bytes], Any],
                      flush: Callable[[], Any], tally: Tally, budget: int, metas: dict,
                      meta_of: Callable[[bytes], Any], outbound: Callable[[Any], OutboundMessage],
                      now_ms: float | None = None) -> int:
        """`offer` for a single reader (`takes_runs`) over pulled records `msgs` (StoredMessages, or
        the remote store's RemoteMessages, read by name): plain messages (QoS 0 or 1 for this
        reader, no Message Expiry Interval, MQTT 3.1.1 or no MQTT 5 properties) go into a run,
        written in growing chunks (`flush` after each: the client reads the first while the rest
        are encoded); any other goes through `offer` (as `outbound(record)`, the driver's
        OutboundMessage of it) after the run so far is written, so the wire order is the queue's.
        Same window, No Local, byte budget and cursor rules as `offer`. `metas`/`meta_of`: the
        driver's cache of decoded props. Returns OVER | QOS2_SENT bits.

        Why: for a 10,000-message QoS 1 backlog on reconnect an OutboundMessage, a PUBLISH
        template and an in-flight object per message were about half of the broker's time."""
        cur = self.cursors[q]
        sub = self.direct[q]
        sub_qos = sub.qos
        no_local = sub.no_local
        rap = sub.retain_as_published
        cid = self.client_id
        version = 5 if self.version == 5 else 4
        v5 = version == 5
        window = self._window
        room = self._receive_max - len(window)
        inflight = cur._inflight
        nxt = cur.next_offset
        run: list = []
        append = run.append
        chunk = RUN_FLUSH_FIRST
        sent0 = sent1 = 0
        first_ts: list = []
        complete = True
        over = False
        flags = 0
        last_rec = None
        plain = False
        ids = None
        used = 0
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
                # the general path, after what the run holds so far
                if run:
                    write(encode_publish_run(run, version)[0])
                    run.clear()
                if used:
                    self._used(ids[used - 1])
                ids = None
                used = 0
                cur.next_offset = nxt
                flags |= self.offer(q, [outbound(m)], off + 1, write, tally, budget, None, now_ms)
                if flags & OVER:
                    over = True
                if cur.next_offset != off + 1:        # the window is full (or the bytes budget)
                    complete = False
                    nxt = cur.next_offset
                    break
                nxt = off + 1
                room = self._receive_max - len(window)
                inflight = cur._inflight
                if over:
                    break
                continue
            payload = m.body
            retain = rec.retain if rap else False
            if qos:
                if room <= 0:
                    complete = False
                    break
                if ids is None:
                    ids = self._take_ids(room if room < len(msgs) else len(msgs))
                pid = ids[used]
                used += 1
                window[pid] = _new(InFlight, (pid, 1, retain, q, off, None, None, WAIT_ACK, m, rec))
                if inflight is None:
                    inflight = cur._inflight = {}
                inflight[off] = pid
                append((m.topic, payload, 1, retain, pid))
                room -= 1
                sent1 += 1
            else:
                append((m.topic, payload, 0, retain, None))
                sent0 += 1
            if m.store_ts:
                first_ts.append(m.store_ts)
            nxt = off + 1
            if len(run) >= chunk:
                write(encode_publish_run(run, version)[0])
                run.clear()
                flush()
                if chunk < RUN_FLUSH_MAX:
                    chunk *= 2
            budget -= len(payload)
            if budget <= 0:
                over = True       # the rest next run (or after the socket drained)
                break
        if run:
            write(encode_publish_run(run, version)[0])
        self._close_offer(cur, nxt, next_offset, complete and not over, ids, used, tally, sent0, sent1, 0,
                          first_ts or None)
        return flags | (OVER if over else 0)

    def _close_offer(self: "MqttSession", cur, nxt: int, next_offset: int, whole: bool, ids: list[int] | None,
                     used: int, tally: Tally, sent0: int, sent1: int, sent2: int, first_ts: list[int] | None) -> None:
        """An offer's end: the allocator past the last of its ids used, the cursor past what it
        handled (the batch's end when it handled all of it: `whole`), the counts."""
        if used:
            self._used(ids[used - 1])
        if whole and nxt < next_offset:
            nxt = next_offset
        cur.next_offset = nxt
        mo = tally.msg_out
        mo[0] += sent0
        mo[1] += sent1
        mo[2] += sent2
        if first_ts is not None:
            tally.first_sent(first_ts)

    def offer_retained(self: "MqttSession", items, sub_qos: int, sub_ids, write: Callable[[bytes], Any],
                       flush: Callable[[], Any], tally: Tally, chunk: int = RUN_FLUSH_FIRST) -> int:
        """The retained messages of a SUBSCRIBE (MQTT-3.3.1-6: sent with RETAIN 1), in the order
        of `items`: [(topic, payload, (record, store_ts, plain))], the driver's lookup after its ACL,
        No Local and expiry checks (`store_ts`: what the remaining expiry counts from; `plain`: no
        expiry and, for MQTT 5, no properties to forward). Plain QoS 0/1 messages for a client
        that takes them as they are go out as runs (written in chunks of `chunk`, doubling, with a
        `flush` after each); the others one by one (`send`) after the run so far, so the wire order
        is the lookup's. QoS 1/2 messages the window has no room for wait (`drain_retained` sends
        them as acks open it). Returns the next chunk size (a lookup read in batches calls this per
        batch)."""
        version = 5 if self.version == 5 else 4
        takes_plain = not self._max_packet and (version != 5 or (sub_ids is None and not self._alias_max))
        window = self._window
        room = self._receive_max - len(window)
        waiting = self._retained_wait
        run: list = []       # (topic, payload, qos, retain, packet id) of plain messages not written yet
        append = run.append
        ids = None
        used = 0
        mo = tally.msg_out
        for topic, payload, kind in items:
            record, store_ts, plain = kind
            qos = sub_qos if sub_qos < record.qos else record.qos
            if plain and takes_plain and qos < 2 and not waiting:
                if qos:
                    if room <= 0:
                        waiting = self._wait_retained((OutboundMessage(topic, payload, record), qos, sub_ids))
                        continue
                    if ids is None:
                        ids = self._take_ids(room if room < len(items) else len(items))
                    pid = ids[used]
                    used += 1
                    # one InFlight, no OutboundMessage: built only for a resend
                    window[pid] = _new(InFlight, (pid, 1, True, None, None, None, None, WAIT_ACK,
                                                  _new(RetainedMessage, (topic, payload, 0)), record))
                    append((topic, payload, 1, True, pid))
                    room -= 1
                else:
                    append((topic, payload, 0, True, None))
                if len(run) >= chunk:
                    write(encode_publish_run(run, version)[0])
                    for m in run:
                        mo[m[2]] += 1
                    run.clear()
                    flush()
                    chunk = min(chunk * 2, RUN_FLUSH_MAX)
                continue
            # the general path: expiry, MQTT 5 properties, QoS 2, a full window
            message = OutboundMessage(topic, payload, record, store_ts=store_ts)
            if qos and (waiting or room <= 0):
                waiting = self._wait_retained((message, qos, sub_ids))    # sent as acks open the window
                continue
            if run:
                write(encode_publish_run(run, version)[0])
                for m in run:
                    mo[m[2]] += 1
                run.clear()
            if used:
                self._used(ids[used - 1])
            ids = None
            used = 0
            self.send(message, qos, True, write, tally, sub_ids=sub_ids)
            room = self._receive_max - len(window)
        if run:
            write(encode_publish_run(run, version)[0])
            for m in run:
                mo[m[2]] += 1
        if used:
            self._used(ids[used - 1])
        return chunk

    def _wait_retained(self: "MqttSession", entry: tuple) -> deque:
        """Queue a retained message (message, qos, subscription identifiers) behind the QoS 1/2
        window; returns the queue."""
        bl = self._retained_wait
        if type(bl) is not deque:
            bl = self._retained_wait = deque()
        bl.append(entry)
        return bl

    def retained_waiting(self: "MqttSession") -> bool:
        return bool(self._retained_wait)

    def drain_retained(self: "MqttSession", write: Callable[[bytes], Any], tally: Tally) -> None:
        """Send the retained messages that waited for the QoS 1/2 window, as far as it is open now."""
        bl = self._retained_wait
        while bl and len(self._window) < self._receive_max:
            it, qos, ids = bl.popleft()
            self.send(it, qos, True, write, tally, sub_ids=ids)

    def resume(self: "MqttSession", write: Callable[[bytes], Any], tally: Tally,
               now_ms: float | None = None) -> list[InFlight]:
        """After a reconnect (MQTT-4.4.0-1): every exchange in flight again, in send order, with
        its packet id: PUBLISH with DUP=1 (MQTT-3.3.1-1) for those awaiting PUBACK/PUBREC, PUBREL
        for those past PUBREC. Returns the messages that no longer fit the client's Maximum Packet
        Size (the new connection may have a smaller one): released here (their cursors too), the
        driver releases what it holds of them (a shared group's offset) as dropped."""
        window = self._window
        dropped = []
        for inf in window.values():
            if inf[7] == WAIT_ACK:
                data = self.publish_bytes(inf.message, inf[1], inf[2], inf[0], True, inf[6], now_ms, resend=True)
                if type(data) is not bytes:
                    self.count_drop(data, tally)
                    dropped.append(inf)
                    continue
                write(data)
            else:
                write(encode(P.PubRel(inf[0]), self.version))
        for inf in dropped:
            del window[inf[0]]
            self._release_cursor(inf)
        return dropped

    def take_group_inflight(self: "MqttSession") -> list[InFlight]:
        """The shared-group messages in flight, taken out of the window (the connection is gone:
        each goes back to its group, which offers it to another member)."""
        window = self._window
        out = [inf for inf in window.values() if inf[5] is not None]
        for inf in out:
            del window[inf[0]]
        return out


__all__ = ["OVER", "QOS2_SENT", "Tally", "Counts", "Outbound", "WAIT_ACK", "WAIT_COMP"]
