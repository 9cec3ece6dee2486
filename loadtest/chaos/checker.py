"""The loss checker of `lmqtt bench chaos`, independent of how the messages travel.

Publishers record every message they try to send, `sent(publisher, seq, qos, path)` BEFORE it
leaves, and `acked(publisher, seq)` once the broker (or store) acknowledged it: PUBACK, PUBCOMP,
an SDK send's PRODUCED. The body of each message carries the publisher id and the sequence
(`body()`), so a receiver records a delivery with `received(receiver, body)` without knowing
anything else. A receiver is declared once with the stream it expects, `receiver(name, path, qos)`:
it should get every acknowledged message of every publisher of the same (path, qos). For several
processes sharing the work (POP consumers of one group) use one receiver name for all of them.

Verdicts, per stream (path, QoS) and counted per receiver (two subscribers of a stream expect
each acknowledged message twice):

* **lost** (acknowledged-but-lost): acknowledged, never delivered to a receiver of its stream;
* **duplicated**: a message delivered more than once to the same receiver (QoS 1 allows it,
  QoS 2 must not; the streams keep their QoS apart);
* **reordered**: within one publisher, a receiver got a message for the first time after it had
  already got a later one of the same publisher (receivers declared `ordered=False`, such as POP,
  whose un-acked messages come back later by design, are not checked);
* **never-sent** (delivered-but-never-sent): a delivery that no publisher of the receiver's stream
  recorded (unknown publisher or sequence, another stream's message, a body that does not parse);
* **unacked-delivered**: sent, never acknowledged, delivered anyway (fine: the broker had it but
  the ack was cut off; counted).

Thread-safe: every method takes one lock. Memory: a set of sequence numbers per (receiver,
publisher) and a small record per sent message.
"""
from __future__ import annotations

import threading
import time
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

SEP = b"#"
EXAMPLES = 10           # examples kept per verdict and stream


def body(publisher: str, seq: int, size: int = 0) -> bytes:
    """The payload of message `seq` of `publisher`: `publisher#seq#` padded with `.` to `size`."""
    head = f"{publisher}#{seq}#".encode()
    return head + b"." * max(0, size - len(head))


def parse(payload: bytes) -> tuple[str, int] | None:
    """(publisher, seq) from a payload made by `body()`, or None if it is not one."""
    try:
        pub, seq, _rest = bytes(payload).split(SEP, 2)
        return pub.decode(), int(seq)
    except (ValueError, UnicodeDecodeError):
        return None


@dataclass(slots=True)
class _Msg:
    sent_t: float
    acked_t: float | None = None


@dataclass(slots=True)
class _Publisher:
    path: str
    qos: int
    msgs: dict = field(default_factory=dict)          # seq -> _Msg


@dataclass(slots=True)
class _Seen:
    """What one receiver got of one publisher."""
    seqs: set = field(default_factory=set)
    hi: int = -1                     # highest seq received so far
    duplicates: int = 0
    reordered: int = 0
    dup_examples: list = field(default_factory=list)      # (seq, t)
    dup_times: list = field(default_factory=list)         # t of every duplicate delivery
    reorder_examples: list = field(default_factory=list)  # (seq, hi before, t)


@dataclass(slots=True)
class _Receiver:
    path: str
    qos: int
    ordered: bool
    per_pub: dict = field(default_factory=dict)      # publisher -> _Seen
    alien: int = 0                                   # deliveries of unknown / foreign messages
    alien_examples: list = field(default_factory=list)


class Checker:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._t0 = clock()
        self._lock = threading.Lock()
        self._pubs: dict[str, _Publisher] = {}
        self._recv: dict[str, _Receiver] = {}
        self._n = {"sent": 0, "acked": 0, "deliveries": 0}     # running totals (progress lines)

    def now(self) -> float:
        """Seconds since the checker was made (the time axis of every timestamp it keeps)."""
        return round(self._clock() - self._t0, 3)

    def at(self, clock_value: float) -> float:
        """A reading of the checker's clock (time.monotonic by default: the same in every process
        of the machine) on its time axis: for events another process recorded (`t=`)."""
        return round(clock_value - self._t0, 3)

    # ------------------------------------------------------------------ recording
    def receiver(self, name: str, path: str, qos: int, ordered: bool = True) -> None:
        """Declare a receiver of the stream (path, qos); again with the same stream is a no-op."""
        with self._lock:
            r = self._recv.get(name)
            if r is None:
                self._recv[name] = _Receiver(path, qos, ordered)
            elif (r.path, r.qos) != (path, qos):
                raise ValueError(f"receiver {name!r} already receives ({r.path}, QoS {r.qos})")

    def sent(self, publisher: str, seq: int, qos: int, path: str, t: float | None = None) -> None:
        """Record a send attempt; call it before the message leaves. A publisher keeps one stream.
        `t` (here and below): when it happened, on this checker's time axis (default: now)."""
        t = self.now() if t is None else t
        with self._lock:
            p = self._pubs.get(publisher)
            if p is None:
                p = self._pubs[publisher] = _Publisher(path, qos)
            elif (p.path, p.qos) != (path, qos):
                raise ValueError(f"publisher {publisher!r} sends ({p.path}, QoS {p.qos}), not ({path}, QoS {qos})")
            if seq not in p.msgs:
                p.msgs[seq] = _Msg(t)
                self._n["sent"] += 1

    def acked(self, publisher: str, seq: int, t: float | None = None) -> None:
        t = self.now() if t is None else t
        with self._lock:
            m = self._pubs[publisher].msgs[seq]
            if m.acked_t is None:
                m.acked_t = t
                self._n["acked"] += 1

    def received(self, receiver: str, payload: bytes, t: float | None = None) -> None:
        """Record a delivery of `payload` (a `body()`) to `receiver`, in arrival order."""
        got = parse(payload)
        if got is None:
            t = self.now() if t is None else t
            with self._lock:
                r = self._recv[receiver]
                r.alien += 1
                self._n["deliveries"] += 1
                if len(r.alien_examples) < EXAMPLES:
                    r.alien_examples.append({"body": bytes(payload[:40]).decode("latin-1"), "t": t})
            return
        self.received_id(receiver, *got, t=t)

    def received_id(self, receiver: str, publisher: str, seq: int, t: float | None = None) -> None:
        t = self.now() if t is None else t
        with self._lock:
            self._n["deliveries"] += 1
            r = self._recv[receiver]
            s = r.per_pub.get(publisher)
            if s is None:
                s = r.per_pub[publisher] = _Seen()
            if seq in s.seqs:
                s.duplicates += 1
                s.dup_times.append(t)
                if len(s.dup_examples) < EXAMPLES:
                    s.dup_examples.append((seq, t))
                return
            s.seqs.add(seq)
            if seq < s.hi:
                s.reordered += 1
                if len(s.reorder_examples) < EXAMPLES:
                    s.reorder_examples.append((seq, s.hi, t))
            else:
                s.hi = seq

    # ------------------------------------------------------------------ queries
    def counts(self) -> dict:
        """Running totals (cheap, for progress lines): messages sent, acknowledged, deliveries."""
        with self._lock:
            return dict(self._n)

    def acked_ids(self, path: str) -> list[tuple[str, int]]:
        """(publisher, seq) of every acknowledged message of the publishers of `path`."""
        with self._lock:
            return [(n, q) for n, p in self._pubs.items() if p.path == path
                    for q, m in p.msgs.items() if m.acked_t is not None]

    def missing(self) -> int:
        """Acknowledged messages not yet delivered, counted per receiver (the drain waits for 0)."""
        with self._lock:
            n = 0
            for r in self._recv.values():
                for name, p in self._pubs.items():
                    if (p.path, p.qos) != (r.path, r.qos):
                        continue
                    s = r.per_pub.get(name)
                    seen = s.seqs if s is not None else ()
                    n += sum(1 for q, m in p.msgs.items() if m.acked_t is not None and q not in seen)
            return n

    def verdict(self, faults: list[dict] | None = None) -> list[dict]:
        """One row per stream (path, qos), sorted: the counts and up to EXAMPLES examples of each
        verdict. `faults` (dicts with `t`, `kind`, `victim`, on this checker's time axis) lets each
        lost example name the first fault after its ack and each duplicate the last fault before it."""
        with self._lock:
            streams = sorted({(p.path, p.qos) for p in self._pubs.values()}
                             | {(r.path, r.qos) for r in self._recv.values()})
            fl = _Faults(sorted(faults or [], key=lambda f: f["t"]))
            rows = [self._row(path, qos, fl) for path, qos in streams]
        return rows

    def _row(self, path: str, qos: int, faults: "_Faults") -> dict:
        pubs = {n: p for n, p in self._pubs.items() if (p.path, p.qos) == (path, qos)}
        recvs = {n: r for n, r in self._recv.items() if (r.path, r.qos) == (path, qos)}
        sent = sum(len(p.msgs) for p in pubs.values())
        acked = sum(1 for p in pubs.values() for m in p.msgs.values() if m.acked_t is not None)
        row = {"path": path, "qos": qos, "publishers": len(pubs), "publisher_names": sorted(pubs),
               "receivers": len(recvs), "sent": sent,
               "acked": acked, "expected": acked * len(recvs), "received": 0, "lost": 0, "duplicated": 0,
               "reordered": 0 if any(r.ordered for r in recvs.values()) else None, "never_sent": 0,
               "unacked_delivered": 0, "duplicated_after": {}}
        ex = {"lost": [], "duplicated": [], "reordered": [], "never_sent": []}
        per: dict[str, dict] = {}
        for rname, r in sorted(recvs.items()):
            before = {k: row[k] for k in ("received", "lost", "duplicated", "never_sent")}
            row["never_sent"] += r.alien
            ex["never_sent"].extend({"receiver": rname, **e} for e in r.alien_examples)
            for pname, s in sorted(r.per_pub.items()):
                p = pubs.get(pname)
                unknown = s.seqs if p is None else s.seqs - p.msgs.keys()
                if unknown:
                    row["never_sent"] += len(unknown)
                    for q in sorted(unknown)[:EXAMPLES]:
                        ex["never_sent"].append({"receiver": rname, "publisher": pname, "seq": q})
                known = len(s.seqs) - len(unknown)
                row["received"] += known
                row["duplicated"] += s.duplicates
                after = row["duplicated_after"]
                for t in s.dup_times:
                    f = faults.before(t)
                    k = f["kind"] if f else "none"
                    after[k] = after.get(k, 0) + 1
                for q, t in s.dup_examples:
                    ex["duplicated"].append({"receiver": rname, "publisher": pname, "seq": q, "t": t,
                                             "fault_before": faults.before(t)})
                if r.ordered:
                    row["reordered"] += s.reordered
                    for q, hi, t in s.reorder_examples:
                        ex["reordered"].append({"receiver": rname, "publisher": pname, "seq": q,
                                                "after": hi, "t": t, "fault_before": faults.before(t)})
                if p is not None:
                    row["unacked_delivered"] += sum(1 for q in s.seqs if q in p.msgs and p.msgs[q].acked_t is None)
            for pname, p in sorted(pubs.items()):
                s = r.per_pub.get(pname)
                seen = s.seqs if s is not None else ()
                for q in sorted(p.msgs):
                    m = p.msgs[q]
                    if m.acked_t is not None and q not in seen:
                        row["lost"] += 1
                        if len(ex["lost"]) < EXAMPLES:
                            ex["lost"].append({"receiver": rname, "publisher": pname, "seq": q, "sent_t": m.sent_t,
                                               "acked_t": m.acked_t, "fault_after": faults.after(m.acked_t)})
            per[rname] = {k: row[k] - v for k, v in before.items()}
        row["by_receiver"] = per
        row["examples"] = {k: v[:EXAMPLES] for k, v in ex.items() if v}
        return row


def _pick(f: dict) -> dict:
    return {k: f[k] for k in ("n", "t", "kind", "victim") if k in f}


class _Faults:
    """The run's faults (in time order) and their start times, for "which fault came next / last"."""

    def __init__(self, faults: list[dict]) -> None:
        self.faults = faults
        self.times = [f["t"] for f in faults]

    def after(self, t: float) -> dict | None:
        """The first fault at or after `t`."""
        i = bisect_left(self.times, t)
        return _pick(self.faults[i]) if i < len(self.faults) else None

    def before(self, t: float) -> dict | None:
        """The last fault at or before `t`."""
        i = bisect_right(self.times, t)
        return _pick(self.faults[i - 1]) if i else None


def failures(rows: list[dict]) -> list[str]:
    """What makes a run fail, one line each: acknowledged messages lost, QoS 2 duplicates,
    deliveries of messages never sent."""
    out = []
    for r in rows:
        where = f"{r['path']} QoS {r['qos']}"
        if r["lost"]:
            out.append(f"{where}: {r['lost']} acknowledged message(s) lost")
        if r["qos"] == 2 and r["duplicated"]:
            out.append(f"{where}: {r['duplicated']} duplicate(s) at QoS 2")
        if r["never_sent"]:
            out.append(f"{where}: {r['never_sent']} delivery(ies) of messages never sent")
    return out
