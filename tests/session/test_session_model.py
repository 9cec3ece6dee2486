"""The session machine against a small model of a client, a store and a network, driven by
hypothesis through any sequence of publishes both ways, deliveries, acks, lost connections,
resumes, record writes and restarts (a restart: the session made again from its last record,
with the store's committed offsets, as gateway/clients/session_registry.py does).

What must hold at every step: the packet ids in flight are unique and valid (MQTT-2.2.1-4), never
more in flight than the client's Receive Maximum (MQTT-3.3.4-9), the cursor's offsets in flight are
the window's. And across any sequence: a QoS 2 message reaches the client's application once
(MQTT-4.3.3-10 at the client, the write-ahead of the record at the server), a client's QoS 2
message is stored once (the inbound write-ahead, settled against the store as
lightqueue/records.py `resolve_pending_qos2` does), QoS 1 at least once; once the network stays up
everything is delivered.

The record is written where the drivers write it: before a batch of new QoS 2 PUBLISHes leaves
(`QOS2_SENT`), before a PUBREL / PUBREC / PUBCOMP whose state change must be durable
(`after_record`), before a new inbound QoS 2 message is appended (its key written ahead), when a
session with QoS 2 exchanges is resumed - and at any other time (a SUBSCRIBE, a disconnect)."""
from __future__ import annotations

import json

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lmqtt.gateway.mqtt import Decoder, encode, packets as P
from lmqtt.gateway.session import ACCEPT, DUPLICATE, QOS2_SENT
from lmqtt.lightqueue.records import SessionRecord, resolve_pending_qos2
from tests.session.support import NOW_MS, Out, msg, session

Q = "t/#"


class SessionModel(RuleBasedStateMachine):
    @initialize(receive_max=st.integers(1, 4), version=st.sampled_from([4, 5]))
    def start(self, receive_max: int, version: int) -> None:
        self.version = version
        self.receive_max = receive_max
        self.store: list[int] = []                 # the queue: QoS of the message at each offset
        self.committed = 0                         # the store's committed offset (flushed lazily)
        self.s = session(version=version, subs=[(Q, 2)], receive_max=receive_max, expiry=60)
        self.record = self._record()
        self.online = True
        self.out = Out(version=version)
        self.read = 0                              # frames of `out` the client has read
        # the client: what reached its application, its QoS 2 ids awaiting PUBREL, its packets to send
        self.delivered: dict[int, int] = {}        # offset -> times
        self.c_in2: set[int] = set()
        self.c_send: list[tuple[str, int]] = []
        # the client's own publishes: id -> [qos, message number, "pub" | "rel"]
        self.c_out: dict[int, list] = {}
        self.c_next = 0
        self.c_pid = 1
        self.c_qos: dict[int, int] = {}            # message number -> QoS
        # the server's inbound path: appends asked for, appended and not acknowledged yet; the store
        self.appending: list[tuple[int, int, int, str]] = []
        self.appended: list[tuple[int, int, int, str]] = []
        self.inbound: list[tuple[int, str]] = []   # (message number, key) stored

    # -- the server ---------------------------------------------------------------------------
    def _record(self) -> dict:
        """The session's record as written now (a copy, as the store would keep it)."""
        return json.loads(json.dumps(self.s.snapshot() or {}))

    def _message(self, off: int):
        """The queue's message at `off`, as the store hands it over (its payload: its offset)."""
        return msg(payload=str(off).encode(), qos=self.store[off], off=off)

    def _write(self, frame: bytes) -> None:
        if self.online:
            self.out.write(frame)

    @rule(qos=st.sampled_from([1, 2]))
    def publish_to_the_queue(self, qos: int) -> None:
        self.store.append(qos)

    def deliver(self) -> None:
        cur = self.s.cursors[Q]
        msgs = [self._message(o) for o in range(cur.next_offset, len(self.store))]
        before = len(self.out.frames)
        flags = self.s.offer(Q, msgs, len(self.store), self.out.write, self.out.tally, 1 << 30, None, NOW_MS)
        if flags & QOS2_SENT:
            # the batch waits for the record: nothing of it may reach the client before
            assert self.read <= before
            self.record = self._record()

    @rule()
    def write_the_record(self) -> None:
        self.record = self._record()

    @rule()
    def flush_offsets(self) -> None:
        self.committed = self.s.cursors[Q].committed()

    def store_appends(self) -> None:
        qos, pid, n, key = self.appending.pop(0)
        self.inbound.append((n, key))
        self.appended.append((qos, pid, n, key))

    def store_acknowledges(self) -> None:
        qos, pid, _n, _key = self.appended.pop(0)
        if self.s.publish_stored(qos, pid):
            self.record = self._record()
        self._write(self.s.pubrec(pid) if qos == 2 else encode(P.PubAck(pid), self.version))

    @rule(appends=st.integers(0, 2), acks=st.integers(0, 2), deliver=st.booleans())
    def server_works(self, appends: int, acks: int, deliver: bool) -> None:
        """The store appends some of the client's publishes and acknowledges some appended ones
        (a restart may fall between the two); delivery runs."""
        for _ in range(min(appends, len(self.appending))):
            self.store_appends()
        for _ in range(min(acks, len(self.appended))):
            self.store_acknowledges()
        if deliver and self.online:
            self.deliver()

    @rule()
    def connection_lost(self) -> None:
        """Unread frames and the client's unsent packets are lost; the session waits for its client."""
        if self.online:
            self.s.went_offline()
        self.online = False
        self.read = len(self.out.frames)
        self.c_send.clear()

    @rule()
    def restart(self) -> None:
        """The server dies: the session comes back from its record, its cursor from the store's
        committed offset, its written-ahead inbound QoS 2 ids settled against the store."""
        self.connection_lost()
        self.appending.clear()
        self.appended.clear()
        rec = SessionRecord("dev", extra={"inflight": json.loads(json.dumps(self.record))})
        keys = {k for _n, k in self.inbound}
        resolve_pending_qos2(rec, lambda topic, key, ms: key in keys)
        s = session(version=self.version, subs=[(Q, 2)], receive_max=self.receive_max, expiry=60)
        s.cursors[Q].next_offset = self.committed
        if rec.extra["inflight"]:
            s.restore(rec.extra["inflight"], lambda q, off: self._message(off))
        s.conn = None
        self.s = s

    @precondition(lambda self: not self.online)
    @rule()
    def reconnect(self) -> None:
        """The client comes back (same session): the server resumes, the client sends again what
        it had not had acknowledged."""
        s = self.s
        s.conn = object()
        s.connect(self.version, self.receive_max, None, None, 0, 1000)
        if any(i.qos == 2 for i in s.inflight()):
            self.record = self._record()             # CONNECT resuming QoS 2 exchanges: the record first
        self.online = True
        assert s.resume(self.out.write, self.out.tally, NOW_MS) == []
        for pid, (_qos, _n, state) in self.c_out.items():
            self.c_send.append(("PUBLISH" if state == "pub" else "PUBREL", pid))

    # -- the client ---------------------------------------------------------------------------
    @precondition(lambda self: self.online)
    @rule(sends=st.integers(0, 3))
    def client_works(self, sends: int) -> None:
        """The client reads what reached it, sends `sends` of the packets it has to send, and reads
        the answers."""
        self.client_reads()
        for _ in range(min(sends, len(self.c_send))):
            self.client_sends()
        self.client_reads()

    def client_reads(self) -> None:
        data = b"".join(self.out.frames[self.read:])
        self.read = len(self.out.frames)
        for p in Decoder(version=self.version, server_side=False).feed(data):
            if isinstance(p, P.Publish):
                off = int(p.payload.decode())
                if p.qos == 2:
                    if p.packet_id not in self.c_in2:   # method B: a duplicate is not delivered again
                        self.c_in2.add(p.packet_id)
                        self.delivered[off] = self.delivered.get(off, 0) + 1
                    self.c_send.append(("PUBREC", p.packet_id))
                else:
                    self.delivered[off] = self.delivered.get(off, 0) + 1
                    self.c_send.append(("PUBACK", p.packet_id))
            elif isinstance(p, P.PubRel):
                self.c_in2.discard(p.packet_id)
                self.c_send.append(("PUBCOMP", p.packet_id))
            elif isinstance(p, P.PubAck):
                if p.packet_id in self.c_out and self.c_out[p.packet_id][0] == 1:
                    del self.c_out[p.packet_id]
            elif isinstance(p, P.PubRec):
                if p.packet_id in self.c_out:
                    self.c_out[p.packet_id][2] = "rel"
                    self.c_send.append(("PUBREL", p.packet_id))
            elif isinstance(p, P.PubComp):
                self.c_out.pop(p.packet_id, None)

    @precondition(lambda self: self.online and len(self.c_out) < 3)
    @rule(qos=st.sampled_from([1, 2]))
    def client_publishes(self, qos: int) -> None:
        while self.c_pid in self.c_out:
            self.c_pid = self.c_pid % 65535 + 1
        self.c_out[self.c_pid] = [qos, self.c_next, "pub"]
        self.c_qos[self.c_next] = qos
        self.c_next += 1
        self.c_send.append(("PUBLISH", self.c_pid))
    def client_sends(self) -> None:
        kind, pid = self.c_send.pop(0)
        s = self.s
        if kind == "PUBACK":
            s.puback_received(pid)
        elif kind == "PUBREC":
            frame, _released, after_record = s.pubrec_received(pid)
            if after_record:
                self.record = self._record()
            if frame is not None:
                self._write(frame)
        elif kind == "PUBCOMP":
            s.pubcomp_received(pid)
        elif kind == "PUBREL":
            frame, after_record = s.pubrel_received(pid)
            if after_record:
                self.record = self._record()
            self._write(frame)
        elif pid in self.c_out and self.c_out[pid][2] == "pub":
            qos, n, _ = self.c_out[pid]
            seen = s.publish_received(qos, pid, 100)
            if seen == ACCEPT:
                key = f"k{n}-{len(self.inbound)}-{len(self.appending)}"
                if qos == 2:
                    s.write_ahead(pid, "in", key, 0)
                    self.record = self._record()      # before the append
                self.appending.append((qos, pid, n, key))
            elif seen == DUPLICATE:
                self._write(s.pubrec(pid))

    # -- what must hold -----------------------------------------------------------------------
    @invariant()
    def ids_unique_and_valid_and_within_the_window(self) -> None:
        window = self.s.inflight()
        ids = [i.pid for i in window]
        assert len(ids) == len(set(ids)) and all(1 <= p <= 65535 for p in ids)
        assert len(window) <= self.receive_max
        assert self.s.cursors[Q].held() == {i.offset: i.pid for i in sorted(window, key=lambda i: i.offset)}

    @invariant()
    def qos2_reaches_the_application_at_most_once(self) -> None:
        for off, n in self.delivered.items():
            if self.store[off] == 2:
                assert n == 1, (off, n)
        numbers = [n for n, _k in self.inbound]
        stored_qos2 = [n for n in numbers if self.c_qos[n] == 2]
        assert len(stored_qos2) == len(set(stored_qos2)), numbers

    def teardown(self) -> None:
        """The network stays up from now on: everything is delivered, QoS 2 exactly once."""
        if not hasattr(self, "s"):
            return
        for _ in range(200):
            if not self.online:
                self.reconnect()
            self.deliver()
            while self.appending:
                self.store_appends()
            while self.appended:
                self.store_acknowledges()
            if self.read < len(self.out.frames):
                self.client_reads()
            while self.c_send:
                self.client_sends()
            if (not self.s.inflight() and self.s.cursors[Q].next_offset == len(self.store) and not self.c_out
                    and not self.c_send and self.read == len(self.out.frames) and not self.appending
                    and not self.appended):
                break
        else:
            raise AssertionError("not quiet after 200 rounds with the network up")
        for off, qos in enumerate(self.store):
            got = self.delivered.get(off, 0)
            assert got == 1 if qos == 2 else got >= 1, (off, qos, got)
        assert sorted({n for n, _k in self.inbound}) == list(range(self.c_next))


SessionModel.TestCase.settings = settings(max_examples=500, stateful_step_count=40, deadline=None)
test_session_model = SessionModel.TestCase
