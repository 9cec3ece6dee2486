"""The chaos clients (loadtest/chaos/paths.py) in a process of their own, on a host of the network
bed, reporting to the Checker of the process that started them.

    child:  python -m lmqtt.loadtest.chaos.remote '<spec JSON>'      (on a bed host: NetBed.popen)
    parent: ClientProcess(bed, host, spec, checker).start() ... .finish() ... .stop()

The child builds the clients of its spec with a `LineChecker` in place of the Checker: every
call becomes one line on its stdout (tab-separated, with the time.monotonic() of the event, which
every process of the machine shares), and the parent's reader thread replays the lines into the
real Checker at those times. Subscribers start at once; each says `Y name` once subscribed;
publishers and consumers start when the parent writes `go`. `finish` stops making messages (the
publishers still wait for their acknowledgements; `U n` lines say how many are open), `stop`
stops everything and the child prints `X [stats...]` and exits.

Lines (child -> parent):
    D name path qos ordered        a receiver
    S pub seq qos path t           a message is about to leave
    A pub seq t [node epoch offset]  acknowledged (an SDK send: the store member that answered)
    R recv pub seq t               a delivery; `R recv - hexpayload t` for a body that does not parse
    Y name                         subscribed
    U n                            messages sent and not acknowledged yet, over the child's publishers
    X json                         the clients' stats, last line
    E text                         an error of the child
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

from . import paths
from .checker import parse
from .paths import sdk_errors


# ---------------------------------------------------------------------------------------- child
class LineChecker:
    """The Checker calls the clients make, written as lines to `out`."""

    def __init__(self, out) -> None:
        self._out = out
        self._lock = threading.Lock()

    def _w(self, *parts) -> None:
        line = "\t".join(str(p) for p in parts) + "\n"
        with self._lock:
            self._out.write(line)
            self._out.flush()

    def receiver(self, name: str, path: str, qos: int, ordered: bool = True) -> None:
        self._w("D", name, path, qos, int(ordered))

    def sent(self, publisher: str, seq: int, qos: int, path: str) -> None:
        self._w("S", publisher, seq, qos, path, f"{time.monotonic():.4f}")

    def acked(self, publisher: str, seq: int, extra: tuple = ()) -> None:
        self._w("A", publisher, seq, f"{time.monotonic():.4f}", *extra)

    def received(self, receiver: str, payload: bytes) -> None:
        got = parse(payload)
        t = f"{time.monotonic():.4f}"
        if got is None:
            self._w("R", receiver, "-", bytes(payload[:64]).hex(), t)
        else:
            self._w("R", receiver, got[0], got[1], t)

    def note(self, *parts) -> None:
        self._w(*parts)


def _build(spec: dict, line_checker: LineChecker, deadline: float):
    class GroupSdkProducer(paths.SdkProducer):
        """An SdkProducer whose acknowledgements name the member that gave them (node and epoch
        of its HELLO) and the CommitLog offset it named: the two-primaries check."""

        def on_ack(self, seq: int, results: list) -> None:
            info = getattr(self.conn, "server_info", None) or {}
            off = results[0].offset if results else -1
            ck.acked(self.name, seq, (info.get("node", ""), info.get("epoch", ""), off))

    ck: Any = line_checker        # the clients take it for a Checker: the calls they make are the same
    subs: list[Any] = []
    others: list[Any] = []
    pubs: list[Any] = []
    for c in spec["clients"]:
        k = c["kind"]
        if k == "mqtt_sub":
            subs.append(paths.MqttSubscriber(ck, c["name"], c["host"], c["port"], c["filter"], c["qos"], deadline))
        elif k == "mqtt_pub":
            pubs.append(paths.MqttPublisher(ck, c["name"], c["host"], c["port"], c["topic"], c["qos"], deadline,
                                            c["rate"], c.get("window", 50)))
        elif k == "sdk_pub":
            pubs.append(GroupSdkProducer(ck, c["name"], c["address"], c["topic"], deadline, c["rate"],
                                         path=c.get("path", "sdk")))
        elif k == "sdk_group":
            others.append(paths.SdkGroupConsumer(ck, c["name"], c["address"], c["topic"], c["group"], deadline))
        elif k == "pop":
            others.append(paths.PopMember(ck, c["name"], c["receiver"], c["address"], c["topic"], c["group"],
                                           deadline))
        else:
            raise ValueError(f"unknown client kind {k!r}")
    return subs, others, pubs


def child_main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    ck = LineChecker(sys.stdout)
    deadline = time.monotonic() + float(spec.get("max_seconds", 3600))
    if any(c["kind"] in ("sdk_pub", "sdk_group", "pop") for c in spec["clients"]):
        sdk_errors()
    subs, others, pubs = _build(spec, ck, deadline)
    everyone = subs + others + pubs
    for s in subs:
        s.start()

    def announce():
        for s in subs:
            if s.subscribed.wait(max(0.0, deadline - time.monotonic())):
                ck.note("Y", s.name)
    threading.Thread(target=announce, daemon=True).start()

    def report():
        while time.monotonic() < deadline:
            ck.note("U", sum(p.unacked() for p in pubs))
            time.sleep(0.25)
    threading.Thread(target=report, daemon=True).start()
    for line in sys.stdin:                      # the parent's commands; EOF = stop
        cmd = line.strip()
        if cmd == "go":
            for c in others + pubs:
                c.start()
        elif cmd == "finish":
            for p in pubs:
                p.finish()
        elif cmd == "stop":
            break
    for c in everyone:
        c.stop()
    for c in everyone:
        c.join(15)
    ck.note("U", sum(p.unacked() for p in pubs))
    ck.note("X", json.dumps([c.stats() for c in everyone]))
    return 0


# ---------------------------------------------------------------------------------------- parent
class ClientProcess:
    """A child on bed host `host` running `spec`'s clients; its lines go into `checker`.
    `acks` collects (t, publisher, node, epoch, offset) of the acknowledgements that name their
    member (SDK sends); `on_ack(t, pub, seq, node, epoch, offset)` is called for each too."""

    def __init__(self, bed, host: str, spec: dict, checker, log_path, env: dict | None = None, on_ack=None) -> None:
        self.bed, self.host, self.spec, self.checker = bed, host, spec, checker
        self.log_path = log_path
        self.env = env
        self.on_ack = on_ack
        self.subscribers = {c["name"] for c in spec["clients"] if c["kind"] == "mqtt_sub"}
        self.subscribed: set[str] = set()
        self.open = 0
        self.stats: list = []
        self.errors: list[str] = []
        self.p: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._ready = threading.Condition()

    def start(self) -> "ClientProcess":
        env = dict(os.environ if self.env is None else self.env)
        env["PYTHONUNBUFFERED"] = "1"
        self._log = open(self.log_path, "ab")
        self.p = self.bed.popen(self.host, [sys.executable, "-m", "lmqtt.loadtest.chaos.remote",
                                            json.dumps(self.spec)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env)
        self._reader = threading.Thread(target=self._read, name=f"chaos-remote-{self.host}", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        ck = self.checker
        assert self.p is not None and self.p.stdout is not None
        for raw in self.p.stdout:
            f = raw.decode(errors="replace").rstrip("\n").split("\t")
            try:
                k = f[0]
                if k == "S":
                    ck.sent(f[1], int(f[2]), int(f[3]), f[4], t=ck.at(float(f[5])))
                elif k == "A":
                    t = ck.at(float(f[3]))
                    ck.acked(f[1], int(f[2]), t=t)
                    if len(f) > 4 and self.on_ack is not None:
                        node = int(f[4]) if f[4] else None
                        epoch = int(f[5]) if f[5] else None
                        self.on_ack(t, f[1], int(f[2]), node, epoch, int(f[6]))
                elif k == "R":
                    t = ck.at(float(f[4]))
                    if f[2] == "-":
                        ck.received(f[1], bytes.fromhex(f[3]), t=t)
                    else:
                        ck.received_id(f[1], f[2], int(f[3]), t=t)
                elif k == "D":
                    ck.receiver(f[1], f[2], int(f[3]), bool(int(f[4])))
                elif k == "Y":
                    with self._ready:
                        self.subscribed.add(f[1])
                        self._ready.notify_all()
                elif k == "U":
                    self.open = int(f[1])
                elif k == "X":
                    self.stats = json.loads(f[1])
                else:
                    self.errors.append("\t".join(f)[:300])
            except (ValueError, IndexError, KeyError) as e:
                self.errors.append(f"bad line {raw[:200]!r}: {e}")

    def wait_subscribed(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._ready:
            while self.subscribed != self.subscribers and time.monotonic() < deadline:
                self._ready.wait(0.2)
            return self.subscribed == self.subscribers

    def _cmd(self, text: str) -> None:
        try:
            assert self.p is not None and self.p.stdin is not None
            self.p.stdin.write(text.encode() + b"\n")
            self.p.stdin.flush()
        except (BrokenPipeError, ValueError, OSError) as e:
            self.errors.append(f"{text}: {e}")

    def go(self) -> None:
        self._cmd("go")

    def finish(self) -> None:
        self._cmd("finish")

    def unacked(self) -> int:
        return self.open

    def stop(self, timeout: float = 40.0) -> None:
        if self.p is None:
            return
        self._cmd("stop")
        try:
            if self.p.stdin is not None:
                self.p.stdin.close()
        except OSError:
            pass
        if self._reader is not None:
            self._reader.join(timeout)
        self.bed.stop(self.p, 10)
        self._log.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(child_main(sys.argv[1:]))
