"""What the session machine's table tests share: a session in a given state, messages to offer,
an output that records frames (decoded by a client-side codec), and a view of the machine's state
to compare with the row's expected new state. No event loop, no store, no socket."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmqtt.gateway.mqtt import Decoder, ProtocolError, packets as P
from lmqtt.gateway.session import ClientSubscription, Counts, Cursor, MqttSession, OutboundMessage
from lmqtt.gateway.storage.record_props import RecordMeta

NOW_MS = 1_700_000_000_000.0


def session(version: int = 5, subs=(("t/#", 1),), receive_max: int | None = None, max_packet: int | None = None,
            alias_max: int | None = None, expiry: int = 0, cap: int = 1000, offset: int = 0,
            client_id: str = "dev") -> MqttSession:
    """A connected session: `subs` (filter, qos[, subscription identifier], or a ClientSubscription) as direct subscriptions,
    each with a cursor at `offset`, and the client's limits from its CONNECT."""
    s = MqttSession(client_id)
    s.expiry_interval = expiry
    for sub in subs:
        if isinstance(sub, ClientSubscription):
            cs, flt = sub, sub.queue
        else:
            flt, qos = sub[0], sub[1]
            cs = ClientSubscription(flt, flt, qos, subscription_id=sub[2] if len(sub) > 2 else None)
        if cs.__class__ is not ClientSubscription:
            s.split_direct()
        s.subs[flt] = cs
        s.direct[flt] = cs
        s.cursors[flt] = Cursor(offset)
    s.connect(version, receive_max, max_packet, alias_max, 100, cap)
    s.conn = object()          # online: the machine never uses it
    return s


def msg(topic: str = "t/1", payload: bytes = b"m", qos: int = 1, off: int = 0, retain: bool = False,
        expiry: int | None = None, store_ts: float = NOW_MS, publisher: str = "pub",
        queues: tuple[str, ...] = (), **props) -> OutboundMessage:
    rec = RecordMeta(qos=qos, retain=retain, client_id=publisher, message_expiry_interval=expiry, **props)
    return OutboundMessage(topic, payload, rec, off, off + 1000, queues, int(store_ts))


@dataclass
class Stored:
    """A record as the store hands it over (what `offer_records` reads by name); `props` the key of
    its decoded props in the driver's cache (`records`)."""

    topic: str
    body: bytes
    queue_offset: int
    props: bytes
    store_ts: int = 0


def records(*specs) -> tuple[list[Stored], dict[bytes, RecordMeta]]:
    """Stored records from (topic, qos, offset[, expiry]) and the driver's props cache for them."""
    metas: dict[bytes, RecordMeta] = {}
    out = []
    for spec in specs:
        topic, qos, off = spec[:3]
        expiry = spec[3] if len(spec) > 3 else None
        key = f"{qos}/{expiry}".encode()
        metas[key] = RecordMeta(qos=qos, client_id="pub", message_expiry_interval=expiry)
        out.append(Stored(topic, b"r%d" % off, off, key, int(NOW_MS)))
    return out, metas


@dataclass
class Out:
    """A driver's sinks: the frames written (and where `flush` was called), the counts."""

    version: int = 5
    frames: list[bytes] = field(default_factory=list)
    flushes: list[int] = field(default_factory=list)
    tally: Counts = field(default_factory=Counts)

    def write(self, data: bytes) -> None:
        self.frames.append(data)

    def flush(self) -> None:
        self.flushes.append(len(self.frames))

    def packets(self) -> list:
        return Decoder(version=self.version, server_side=False).feed(b"".join(self.frames))

    def summary(self) -> list[tuple]:
        """Each packet as a short tuple: PUBLISH (topic, qos, pid, dup, retain), acks (name, pid, rc)."""
        out = []
        for p in self.packets():
            if isinstance(p, P.Publish):
                out.append(("PUBLISH", p.topic, p.qos, p.packet_id, p.dup, p.retain))
            else:
                out.append((type(p).__name__.upper(), p.packet_id, getattr(p, "reason_code", 0)))
        return out


def decode(frame: bytes, version: int = 5):
    """The one packet `frame` holds."""
    p, = Decoder(version=version, server_side=False).feed(frame)
    return p


def view(s: MqttSession) -> dict:
    """The machine's state as a row states it."""
    in_wait, in2 = s.inbound_ids()
    return {
        "window": [(i.pid, i.qos, i.state, i.queue, i.offset) for i in s.inflight()],
        "next_pid": s.change_mark()[1],
        "in_wait": set(in_wait), "in2": set(in2),
        "cursors": {q: (c.next_offset, c.held()) for q, c in s.cursors.items()},
    }


@dataclass
class Row:
    """One row of a table: the rules it checks (normative statement ids, docs/session.md), the
    state it starts from (`given`), the input (`when(session, out)`, its value is the machine's
    answer), and what must follow: the answer, the packets written, the new state (the keys of
    `view` the row states)."""

    rules: str
    what: str
    given: Any
    when: Any
    answer: Any = None
    packets: list | None = None
    state: dict = field(default_factory=dict)
    version: int = 5

    @property
    def id(self) -> str:
        return f"{self.rules}: {self.what}"


ANY = object()


def check(row: Row) -> None:
    """Run `row` and compare everything it states."""
    s = row.given()
    out = Out(version=s.version)
    got = row.when(s, out)
    if row.answer is not ANY:
        assert got == row.answer, f"answer {got!r}, want {row.answer!r}"
    if row.packets is not None:
        assert out.summary() == row.packets
    v = view(s)
    for k, want in row.state.items():
        assert v[k] == want, f"{k}: {v[k]!r}, want {want!r}"


def offered(*msgs, q: str = "t/#", budget: int = 1 << 30, can_read=None):
    """The input `offer` of `msgs` (one pulled batch of queue `q`), as a row's `when`."""
    nxt = msgs[-1].queue_offset + 1 if msgs else 0
    return lambda s, out: s.offer(q, list(msgs), nxt, out.write, out.tally, budget, can_read, NOW_MS)


def sent(s: MqttSession, *msgs, q: str = "t/#") -> MqttSession:
    """`s` after `msgs` were offered and sent (what it wrote is not kept)."""
    out = Out(version=s.version)
    s.offer(q, list(msgs), msgs[-1].queue_offset + 1, out.write, out.tally, 1 << 30, None, NOW_MS)
    return s


def resumed_at(s: MqttSession, next_pid: int, inflight=(), q: str = "t/#") -> MqttSession:
    """`s` restored from a record whose exchanges are `inflight` [(pid, qos, offset, state)] and
    whose allocator stood at `next_pid` (the way a session gets such a state: a restart)."""
    out = [[pid, q, off, qos, False, st, None] for pid, qos, off, st in inflight]
    nxt = max([off + 1 for _p, _q, off, _s in inflight], default=0)
    s.restore({"out": out, "next": {q: nxt}, "in2": [], "pid": next_pid}, lambda q, off: msg(qos=2, off=off))
    return s


def after(s: MqttSession, *steps) -> MqttSession:
    """`s` after each of `steps` (a function of the session) was applied, in order."""
    for step in steps:
        step(s)
    return s


def raises(fn) -> int | None:
    """The reason code of the ProtocolError `fn()` raises (None: it returned)."""
    try:
        fn()
    except ProtocolError as e:
        return e.reason_code
    return None
