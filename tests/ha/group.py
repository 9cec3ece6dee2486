"""A store group of real member processes for the tests in tests/ha (docs/ha.md).

Each member uses three consecutive ports (store, Raft, replication): `group_ports` finds bases
whose three ports are all free (and never handed out by free_port before). Only our own PIDs are
signalled (kill -9, SIGSTOP / SIGCONT, SIGTERM)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import warnings

import paho.mqtt.client as mqtt

from lmqtt.loadtest.chaos.checker import Checker, body
from lmqtt.store.client import connect
from tests.support import ROOT


def group_ports(n: int) -> list[int]:
    """n base ports, each with its next two free too (store, Raft, replication), never handed out
    before in this process (loadtest.brokers' reservation, below the ephemeral range)."""
    from lmqtt.loadtest.brokers import free_ports
    return [free_ports(3) for _ in range(n)]


class Member:
    """One member process. `join`: started with `--join` (its node id comes when it is added:
    `node` is then the label of its data dir and log until `joined()` reads it)."""

    def __init__(self, group: "StoreGroup", node: int, port: int, join: bool = False) -> None:
        self.group = group
        self.node = node
        self.port = port
        self.join = join
        self.data_dir = os.path.join(group.root, f"m{node}")
        self.log_path = os.path.join(group.root, f"m{node}.log")
        self.proc: subprocess.Popen | None = None
        from tests.support import free_port
        self.metrics_port = free_port()

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def raft_address(self) -> str:
        """Its Raft address as `status()["raft_leader"]` names it: PORT+1 (docs/ha.md)."""
        return f"127.0.0.1:{self.port + 1}"

    def start(self) -> "Member":
        who = (["--join", self.group.address_list(), "--port", str(self.port)] if self.join else
               ["--node-id", str(self.node), "--peers", self.group.peers])
        cmd = [sys.executable, "-m", "lmqtt.gateway.cli", "store", "--group", self.group.name, *who,
               "--data-dir", self.data_dir, "--segment-mb", "8",
               "--election-timeout-s", str(self.group.election_timeout), "--metrics-port", str(self.metrics_port),
               *self.group.extra]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)
        return self

    def status(self, timeout: float = 2.0) -> dict | None:
        try:
            c = connect(self.address, timeout=timeout, connect_timeout=timeout, reconnect_attempts=1)
        except Exception:  # noqa: BLE001 - not up (or stopped)
            return None
        try:
            return c.cmd("ha_status")
        except Exception:  # noqa: BLE001
            return None
        finally:
            c.close()

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            warnings.warn(f"store member {self.node} did not stop within 20 s of SIGTERM: killed", stacklevel=2)

    def log_text(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""


class StoreGroup:
    def __init__(self, root: str, n: int = 3, name: str = "g1", extra: tuple = (), election_timeout: float = 2.0):
        self.root = str(root)
        self.name = name
        self.extra = tuple(extra)
        self.election_timeout = election_timeout
        ports = group_ports(n)
        self.peers = ",".join(f"127.0.0.1:{p}" for p in ports)
        self.members = [Member(self, i + 1, p) for i, p in enumerate(ports)]

    def start(self) -> "StoreGroup":
        for m in self.members:
            m.start()
        return self

    def address_list(self) -> str:
        """Every current member's address (what a client or a joining member is given)."""
        return ",".join(m.address for m in self.members)

    def joining(self, label: int) -> Member:
        """A new store started with `--join` (not a member until `lmqtt admin --add-member`)."""
        return Member(self, label, group_ports(1)[0], join=True).start()

    def admin(self, *args: str, timeout: float = 150.0) -> subprocess.CompletedProcess:
        """`lmqtt admin --store <every member> ARGS...`, as a user runs it."""
        return subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "admin", "--store", self.address_list(),
                               *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def wait_primary(self, timeout: float = 30.0, exclude=(), in_sync: int | None = None,
                     among=None) -> Member:
        """The member that says it is primary (and, with `in_sync`, has that many in sync)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            for m in among or self.members:
                if m.node in exclude:
                    continue
                st = m.status(1.0)
                last = st or last
                if st and st["role"] == "primary" and st["lease_ok"] and (
                        in_sync is None or len(st["in_sync"]) >= in_sync):
                    return m
            time.sleep(0.2)
        raise AssertionError(f"no primary within {timeout}s (last status {last}); logs:\n" +
                             "\n".join(m.log_text()[-3000:] for m in self.members))

    def wait_status(self, member: Member, pred, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        st = None
        while time.monotonic() < deadline:
            st = member.status(1.0)
            if st and pred(st):
                return st
            time.sleep(0.2)
        raise AssertionError(f"member {member.node}: condition not met within {timeout}s (last {st});\n"
                             f"{member.log_text()[-4000:]}")


def read_all(conn, topic: str, upto_queue_offset: int | None = None) -> list:
    """Every record of `topic`'s ConsumeQueue 0, in order: once the store has dispatched everything
    it had appended when asked (an acknowledged record is visible only after dispatch)."""
    import time as _t
    end = conn.cmd("stats")["max_offset"]
    deadline = _t.monotonic() + 30
    while conn.cmd("stats")["dispatched_offset"] < end and _t.monotonic() < deadline:
        _t.sleep(0.05)
    out = []
    off = 0
    while True:
        r = conn.pull(topic, 0, off, 4096)
        if not r.records:
            return out
        out.extend(r.records)
        off = r.next_offset


def read_back(address, pattern: str, pubs, stream: str) -> list[dict]:
    """The checker's verdict on a filter read of `pattern` from the earliest record: every message
    the publishers `pubs` had acknowledged must be there once (QoS 2 label: a duplicate fails)."""
    rb = Checker()
    total = 0
    for p in pubs:
        for s in range(p.sent):
            rb.sent(p.name, s, 2, stream)
            rb.acked(p.name, s)
        total += p.sent
    rb.receiver("readback", stream, 2)
    conn = connect(address)
    try:
        fc = conn.filter_consumer(pattern, start="earliest")
        n = 0
        deadline = time.monotonic() + 60
        while n < total and time.monotonic() < deadline:
            recs = fc.poll()
            for r in recs:
                rb.received("readback", r.body)
            n += len(recs)
        time.sleep(0.5)                  # anything past the last acknowledged one shows now
        for r in fc.poll():
            rb.received("readback", r.body)
    finally:
        conn.close()
    return rb.verdict()


# ------------------------------------------------------------------ MQTT load through a gateway
def mqtt_client(cid: str, clean: bool) -> mqtt.Client:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cid, clean_session=clean,
                    protocol=mqtt.MQTTv311)
    c.reconnect_delay_set(0.1, 1)
    return c


class MqttPublisher:
    """A paho QoS 1 publisher on one gateway: `ck.sent` before each publish, `ck.acked` on PUBACK."""

    def __init__(self, name: str, gw, ck, topic: str = "hagw/t", stream: str = "mqtt", limit: int = 20_000,
                 seconds: float = 60.0) -> None:
        self.topic, self.stream, self.limit, self.seconds = topic, stream, limit, seconds
        self.name, self.ck = name, ck
        self.c = mqtt_client(name, True)
        self.c.max_inflight_messages_set(50)
        self.lock = threading.Lock()
        self.mids: dict[int, int] = {}
        self.early: set[int] = set()
        self.sent = 0
        self.acked = 0
        self.stop = threading.Event()
        self.c.on_publish = self._on_publish
        self.drops = 0
        self.c.on_disconnect = self._on_disconnect
        self.c.connect(gw.host, gw.port, keepalive=30)
        self.c.loop_start()
        self.t = threading.Thread(target=self._run, daemon=True)

    def _on_publish(self, _c, _u, mid, _rc, _props) -> None:
        with self.lock:
            seq = self.mids.pop(mid, None)
            if seq is None:
                self.early.add(mid)
                return
            self.acked += 1
        self.ck.acked(self.name, seq)

    def _on_disconnect(self, *_a) -> None:
        if not self.stop.is_set():
            self.drops += 1

    def _run(self) -> None:
        seq = 0
        deadline = time.monotonic() + self.seconds
        while not self.stop.is_set() and seq < self.limit and time.monotonic() < deadline:
            self.ck.sent(self.name, seq, 1, self.stream)
            # paho calls on_publish holding its own lock: ours is never held across publish()
            info = self.c.publish(self.topic, body(self.name, seq, 48), qos=1)
            with self.lock:
                if info.mid in self.early:
                    self.early.discard(info.mid)
                    self.acked += 1
                    done = True
                else:
                    self.mids[info.mid] = seq
                    done = False
            if done:
                self.ck.acked(self.name, seq)
            seq += 1
            self.sent = seq
            if seq % 50 == 0:
                time.sleep(0.02)        # a steady stream, not one burst
            while len(self.mids) > 400 and not self.stop.is_set():
                time.sleep(0.01)        # paho's queue stays bounded while the store fails over

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()
