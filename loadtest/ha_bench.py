"""`lmqtt bench ha`: a replicated store group (docs/ha.md) of real `lmqtt store --group` processes on
loopback, one JSON object per result on stdout.

Cases:
* append-replicated  `--messages` messages of `--size` bytes through an AutoBatch producer into a
                     single `lmqtt store`, then into a group of 3 with --ack-replicas 1 and 2, per
                     flush mode of `--flush-modes`, in the same run: msgs/s and the ratio to the
                     single node of the same flush mode; `cpu_s`: the CPU seconds (user + system)
                     each process used during the sends (store or primary, each replica, the
                     producer) and the wall seconds, so a figure says what bounds it
* failover           a group of 3 under a sync producer's load; `--kills` faults of the primary,
                     kill -9 and SIGSTOP alternated (`--faults`): the time from the fault to the
                     first acknowledged write on the new primary (p50/p99/max over the faults); the
                     victim comes back (restarted / SIGCONT) and catches up before the next fault;
                     at the end every acknowledged message is read back from the last primary and
                     checked by the chaos checker (lost / duplicated). Figures over all faults and
                     per kind (`by_kind`); `--max-seconds` bounds the run (no fault started after)
* append-groups      several store groups in one deployment (docs/groups.md): `--messages` through one
                     AutoBatch producer into one group of 3, then through the SDK's grouped AutoBatch
                     into two groups of 3 (the same messages over two first-level topics, one owned
                     by each group), per flush mode, in the same run: msgs/s of each, the ratio of
                     the two groups' aggregate to one group's, and the CPU seconds of every process
* mqtt-groups        the same over MQTT: `lmqtt gateway --store` over one group of 3, then over two
                     groups of 3, in the same run, 50 QoS 1 pairs flat out for `--seconds` (the
                     project's MQTT generator, `lmqtt bench mqtt --scenario pairs`), the pairs'
                     topics over two first levels, one owned by each group: delivered msgs/s of
                     each, their ratio, the CPU seconds of the gateway and every member and their
                     CPU per message; `--rounds N`: N such pairs of runs alternated, then the
                     median ratio
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

from lmqtt.loadtest.brokers import free_ports
from lmqtt.loadtest import mqtt_bench
from lmqtt.loadtest.chaos.checker import Checker, body, failures
from lmqtt.loadtest.proc_stats import cpu_seconds as proc_cpu
from lmqtt.loadtest.scenarios import ScenarioConfig
from lmqtt.store.client import connect
from lmqtt.store.client.groups import rendezvous

TOPIC = "bench/ha"


class GroupMember:
    def __init__(self, root: str, group: "StoreGroup", node: int, port: int) -> None:
        self.node, self.port, self.group = node, port, group
        self.data_dir = os.path.join(root, f"m{node}")
        self.log = os.path.join(root, f"m{node}.log")
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        g = self.group
        cmd = [sys.executable, "-m", "lmqtt.gateway.cli", "store", "--group", g.name, "--node-id", str(self.node),
               "--peers", g.peers, "--data-dir", self.data_dir, "--flush-mode", g.flush_mode,
               "--segment-mb", "64", "--election-timeout-s", str(g.election_timeout)]
        if g.ack_replicas is not None:
            cmd += ["--ack-replicas", str(g.ack_replicas)]
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)

    def status(self) -> dict | None:
        try:
            c = connect(self.address, timeout=1.0, connect_timeout=1.0, reconnect_attempts=1)
        except Exception:  # noqa: BLE001
            return None
        try:
            return c.cmd("ha_status")
        except Exception:  # noqa: BLE001
            return None
        finally:
            c.close()

    def signal(self, sig) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            if sig == signal.SIGKILL:
                self.proc.wait(10)

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


class StoreGroup:
    def __init__(self, root: str, flush_mode: str, ack_replicas: int | None, election_timeout: float,
                 name: str = "bench") -> None:
        self.flush_mode, self.ack_replicas, self.election_timeout = flush_mode, ack_replicas, election_timeout
        self.name = name
        ports = [free_ports(3) for _ in range(3)]
        self.peers = ",".join(f"127.0.0.1:{p}" for p in ports)
        self.members = [GroupMember(root, self, i + 1, p) for i, p in enumerate(ports)]

    def start(self) -> "StoreGroup":
        for m in self.members:
            m.start()
        return self

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def primary(self, timeout: float = 60.0, exclude=(), in_sync: int = 0) -> GroupMember:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.members:
                if m.node in exclude:
                    continue
                st = m.status()
                if st and st["role"] == "primary" and st["lease_ok"] and len(st["in_sync"]) >= in_sync:
                    return m
            time.sleep(0.1)
        raise RuntimeError(f"no primary within {timeout} s (logs: {self.members[0].log} ...)")


def _quiesce() -> None:
    """Start every measured run from the same state: what the runs before it left dirty (their
    ConsumeQueues, RocksDB files, logs) written back first, so that writeback takes no CPU or disk
    from this run (with `_drop_data`: BENCHMARKS.md "Replicated store group")."""
    os.sync()
    time.sleep(0.5)


def _drop_data(path: str) -> None:
    """A measured run's data, removed once its figures are out (its log stays): on the development
    VM each run's gigabyte or so left behind made the next ones slower, the fifth group run of an
    invocation ~0.1x below the first with the same flags (BENCHMARKS.md "Replicated store group")."""
    shutil.rmtree(path, ignore_errors=True)


def _autobatch_rate(address: str, n: int, size: int, watch: dict | None = None,
                    topics: tuple[str, ...] = (TOPIC,)) -> tuple[float, dict]:
    """-> (msgs/s, CPU seconds per process during the sends: `watch` {name: pid} and "producer",
    this process). `topics`: sent to in turn (several store groups: one owned by each)."""
    _quiesce()
    c = connect(address, timeout=120)
    ab = c.auto_batch_producer()
    payload = b"x" * size
    watch = watch or {}
    k = len(topics)
    for t in topics:                 # a new first-level topic's owner is claimed before the clock
        ab.send(t, payload)
    ab.flush(60)
    before = {k: proc_cpu(pid) for k, pid in watch.items()}
    t0 = os.times()
    t = time.perf_counter()
    for i in range(n):
        ab.send(topics[i % k], payload)
    ab.flush(300)
    dt = time.perf_counter() - t
    t1 = os.times()
    cpu = {k: round(proc_cpu(pid) - before[k], 2) for k, pid in watch.items()}
    cpu["producer"] = round((t1.user - t0.user) + (t1.system - t0.system), 2)
    cpu["wall"] = round(dt, 2)
    c.close()
    return n / dt, cpu


def case_append(root: str, modes: list[str], n: int, size: int, out) -> None:
    for mode in modes:
        d = os.path.join(root, f"single-{mode.replace('+', '_')}")
        os.makedirs(d, exist_ok=True)
        port = free_ports(1)
        with open(os.path.join(root, f"single-{mode}.log"), "ab") as f:
            p = subprocess.Popen([sys.executable, "-m", "lmqtt.gateway.cli", "store", "--port", str(port),
                                  "--data-dir", d, "--flush-mode", mode, "--segment-mb", "64"], stdout=f,
                                 stderr=subprocess.STDOUT)
        try:
            wait_port(port)
            single, cpu = _autobatch_rate(f"127.0.0.1:{port}", n, size, {"store": p.pid})
        finally:
            p.terminate()
            p.wait(30)
            _drop_data(d)
        out({"case": "append-replicated", "flush_mode": mode, "shape": "single", "messages": n, "size": size,
             "msgs_per_s": round(single), "cpu_s": cpu})
        for k in (1, 2):
            gd = os.path.join(root, f"group-{mode.replace('+', '_')}-{k}")
            os.makedirs(gd, exist_ok=True)
            g = StoreGroup(gd, mode, k, 2.5).start()
            try:
                prim = g.primary(in_sync=3)
                watch = {"primary": prim.proc.pid}
                watch.update({f"replica{m.node}": m.proc.pid for m in g.members if m is not prim})
                rate, cpu = _autobatch_rate(g.peers, n, size, watch)
            finally:
                g.stop()
                for m in g.members:
                    _drop_data(m.data_dir)
            out({"case": "append-replicated", "flush_mode": mode, "shape": "group of 3", "ack_replicas": k,
                 "messages": n, "size": size, "msgs_per_s": round(rate), "vs_single": round(rate / single, 2),
                 "cpu_s": cpu})


def _members(groups: list) -> dict:
    """{name: pid} of every member of `groups` (primary / replica<node>, prefixed by the group's
    name when there are several), once each group has its primary and both replicas in sync."""
    watch = {}
    for g in groups:
        pre = f"{g.name}." if len(groups) > 1 else ""
        prim = g.primary(in_sync=3)
        watch[f"{pre}primary"] = prim.proc.pid
        watch.update({f"{pre}replica{m.node}": m.proc.pid for m in g.members if m is not prim})
    return watch


def _owned(groups: list, prefix: str) -> tuple[str, ...]:
    """A new first-level topic owned by each group, in order (the SDK's rendezvous over names)."""
    names = [g.name for g in groups]
    return tuple(next(t for t in (f"{prefix}{k}" for k in range(10_000)) if rendezvous(t, names) == i)
                 for i in range(len(groups)))


def _stop(groups: list) -> None:
    for g in groups:
        g.stop()
        for m in g.members:
            _drop_data(m.data_dir)


def _one_then_two(root: str, mode: str, prefix: str, measure: Callable[[str, dict, tuple | None], Any]) -> tuple:
    """`measure(address, members' pids, first levels)` over one group of 3, then over two groups of
    3 (first levels: one owned by each group; None for the one group), in the same run."""
    tag = f"{prefix}-{mode.replace('+', '_')}"
    dirs = [os.path.join(root, f"{tag}-{x}") for x in ("one", "two-a", "two-b")]
    for d in dirs:
        os.makedirs(d, exist_ok=True)
    one = StoreGroup(dirs[0], mode, None, 2.5, name="bench-a").start()
    try:
        single = measure(one.peers, _members([one]), None)
    finally:
        _stop([one])
    groups = [StoreGroup(d, mode, None, 2.5, name=f"bench-{x}").start() for d, x in zip(dirs[1:], ("a", "b"))]
    try:
        two = measure(";".join(g.peers for g in groups), _members(groups), _owned(groups, prefix))
    finally:
        _stop(groups)
    return single, two


def case_groups(root: str, modes: list[str], n: int, size: int, out) -> None:
    """One group of 3, then two groups of 3 (docs/groups.md), the same messages, the same run."""
    for mode in modes:
        (single, cpu1), (rate, cpu) = _one_then_two(
            root, mode, "bench", lambda address, watch, firsts: _autobatch_rate(
                address, n, size, watch, topics=firsts or (TOPIC,)))
        out({"case": "append-groups", "flush_mode": mode, "shape": "1 group of 3", "messages": n, "size": size,
             "msgs_per_s": round(single), "cpu_s": cpu1})
        out({"case": "append-groups", "flush_mode": mode, "shape": "2 groups of 3", "messages": n, "size": size,
             "msgs_per_s": round(rate), "vs_one_group": round(rate / single, 2), "cpu_s": cpu})


def _gateway_pairs(root: str, store: str, roots: tuple[str, ...], seconds: float, watch: dict) -> dict:
    """`lmqtt gateway --store store` and 50 QoS 1 pairs flat out through it: the generator's row,
    with the CPU seconds of the gateway and of `watch` {name: pid} while it ran."""
    port, mport = free_ports(1), free_ports(1)
    with open(os.path.join(root, f"gateway-{port}.log"), "ab") as f:
        gw = subprocess.Popen([sys.executable, "-m", "lmqtt.gateway.cli", "gateway", "--store", store,
                               "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(mport),
                               "--gateway-id", f"bench-{port}"], stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_port(port, 60)
        _quiesce()
        watch = {"gateway": gw.pid, **watch}
        before = {k: proc_cpu(pid) for k, pid in watch.items()}
        cfg = ScenarioConfig(scenario="pairs", port=port, publishers=50, subscribers=50, qos=1,
                             duration=seconds, procs=2, roots=roots)
        row = mqtt_bench.run(cfg, gw.pid, broker="lmqtt gateway", quiet=True)
        cpu = {k: round(proc_cpu(pid) - before[k], 2) for k, pid in watch.items()}
    finally:
        gw.terminate()
        gw.wait(30)
    return {"delivered_per_s": row["delivered_per_s"], "sent": row["sent"], "lost": row["lost"],
            "duplicated": row["duplicated"], "p99_ms": round(row["latency_us"]["p99"] / 1000, 2), "cpu_s": cpu}


def case_mqtt_groups(root: str, modes: list[str], seconds: float, out, rounds: int = 1) -> None:
    """A gateway over one group of 3, then over two groups of 3: the same MQTT load, the same run;
    `rounds` times, alternated, then the median of the rounds' ratios (one 10-s run of either shape
    moves by a fifth between runs on this VM: one ratio alone says little)."""
    for mode in modes:
        ratios = []
        for r in range(rounds):
            single, two = _one_then_two(root, mode, "lb", lambda address, watch, firsts: _gateway_pairs(
                root, address, firsts or ("lb",), seconds, watch))
            ratio = round(two["delivered_per_s"] / single["delivered_per_s"], 2)
            ratios.append(ratio)
            tag = {"round": r + 1} if rounds > 1 else {}
            out({"case": "mqtt-groups", "flush_mode": mode, "shape": "gateway over 1 group of 3", "seconds": seconds,
                 **tag, **single, "cpu_us_per_msg": _us_per_msg(single)})
            out({"case": "mqtt-groups", "flush_mode": mode, "shape": "gateway over 2 groups of 3", "seconds": seconds,
                 **tag, **two, "cpu_us_per_msg": _us_per_msg(two), "vs_one_group": ratio})
        if rounds > 1:
            ratios.sort()
            k = len(ratios)
            med = ratios[k // 2] if k % 2 else round((ratios[k // 2 - 1] + ratios[k // 2]) / 2, 3)
            out({"case": "mqtt-groups", "flush_mode": mode, "rounds": rounds, "vs_one_group": ratios,
                 "median": med})


def _us_per_msg(row: dict) -> dict:
    """CPU microseconds per message sent (and delivered: 0 lost): the gateway's, all members' together."""
    n = max(1, row["sent"])
    cpu = row["cpu_s"]
    members = sum(v for k, v in cpu.items() if k != "gateway")
    return {"gateway": round(cpu["gateway"] / n * 1e6, 1), "members": round(members / n * 1e6, 1)}


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def _pct(times: list[float], q: float) -> float:
    """The q-quantile of `times` (nearest rank, as the figures in BENCHMARKS.md)."""
    t = sorted(times)
    return round(t[min(len(t) - 1, int(len(t) * q))], 3)


def _figures(times: list[float]) -> dict:
    return {"faults": len(times), "p50_s": _pct(times, 0.5), "p99_s": _pct(times, 0.99),
            "max_s": round(max(times), 3)} if times else {"faults": 0}


def case_failover(root: str, mode: str, kills: int, faults: list[str], size: int, timeout: float, out,
                  max_seconds: float = 0.0) -> None:
    g = StoreGroup(root, mode, None, timeout).start()
    ck = Checker()
    acks: list[float] = []          # ack times (monotonic), appended by the producer
    stop = threading.Event()
    errors: list[str] = []
    try:
        g.primary(in_sync=3)
        conn = connect(g.peers, timeout=60.0)
        p = conn.producer("ha-bench")

        def produce():
            seq = 0
            while not stop.is_set():
                ck.sent("ha-bench", seq, 2, "sdk")
                try:
                    p.send(TOPIC, body("ha-bench", seq, size))
                except Exception as e:  # noqa: BLE001 - counted; a send is not retried here
                    errors.append(repr(e))
                else:
                    ck.acked("ha-bench", seq)
                    acks.append(time.monotonic())
                seq += 1
        t = threading.Thread(target=produce, daemon=True)
        t.start()
        times = []
        by_kind: dict[str, list[float]] = {}
        fault_log: list = []
        started = time.monotonic()
        for i in range(kills):
            if max_seconds and time.monotonic() - started > max_seconds:
                print(f"time bound of {max_seconds:g} s reached after {i} faults", file=sys.stderr, flush=True)
                break
            prim = g.primary(in_sync=3, timeout=120)
            kind = faults[i % len(faults)]
            time.sleep(0.5)                      # some load on this primary first
            t0 = time.monotonic()
            prim.signal(signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            new = g.primary(exclude=(prim.node,), timeout=60)
            # the first acknowledgement after the fault (a send in flight then is retried on the new one)
            deadline = time.monotonic() + 60
            first = None
            while first is None and time.monotonic() < deadline:
                later = [a for a in acks[-2000:] if a > t0 + 0.02]
                first = later[0] if later else None
                if first is None:
                    time.sleep(0.01)
            if first is None:
                raise RuntimeError(f"no acknowledgement within 60 s after fault {i}")
            times.append(first - t0)
            by_kind.setdefault(kind, []).append(first - t0)
            fault_log.append({"n": i + 1, "t": round(t0, 3), "kind": kind, "victim": prim.node, "new": new.node,
                              "s": round(first - t0, 3)})
            if kind == "kill":
                prim.start()
            else:
                prim.signal(signal.SIGCONT)
            print(f"fault {i + 1}/{kills}: {kind} of node {prim.node} -> node {new.node} primary, "
                  f"first ack after {first - t0:.2f} s", file=sys.stderr, flush=True)
        g.primary(in_sync=3, timeout=120)
        stop.set()
        t.join(60)
        last = g.primary()
        reader = connect(last.address, timeout=60)
        end = reader.cmd("stats")["max_offset"]
        while reader.cmd("stats")["dispatched_offset"] < end:
            time.sleep(0.05)
        ck.receiver("readback", "sdk", 2)
        off = 0
        while True:
            r = reader.pull(TOPIC, 0, off, 4096)
            if not r.records:
                break
            for rec in r.records:
                ck.received("readback", rec.body)
            off = r.next_offset
        reader.close()
        conn.close()
        row = ck.verdict()[0]
        out({"case": "failover", "flush_mode": mode, "faults": len(times), "kinds": faults,
             "election_timeout_s": timeout, **{k: v for k, v in _figures(times).items() if k != "faults"},
             "by_kind": {k: _figures(v) for k, v in by_kind.items()},
             "seconds": round(time.monotonic() - started, 1),
             "acked": row["acked"], "lost": row["lost"], "duplicated": row["duplicated"],
             "never_sent": row["never_sent"], "send_errors": len(errors), "verdict": failures([row]) or "ok",
             "lost_examples": (row.get("examples") or {}).get("lost", []),
             "fault_times": fault_log})
    finally:
        stop.set()
        g.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench ha", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="append-replicated,failover")
    ap.add_argument("--flush-modes", default="sync", help="flush modes of append-replicated (default sync)")
    ap.add_argument("--messages", type=int, default=100_000, help="messages per append-replicated run")
    ap.add_argument("--size", type=int, default=100, help="message size in bytes (default 100)")
    ap.add_argument("--kills", type=int, default=20, help="faults of the primary in the failover case (default 20)")
    ap.add_argument("--faults", default="kill,stop", help="kill (kill -9) and/or stop (SIGSTOP), alternated")
    ap.add_argument("--election-timeout-s", type=float, default=2.5)
    ap.add_argument("--max-seconds", type=float, default=0.0,
                    help="failover case: start no fault after this many seconds (0: no bound); the figures "
                         "say how many faults ran")
    ap.add_argument("--seconds", type=float, default=10.0, help="mqtt-groups: seconds of load per shape (default 10)")
    ap.add_argument("--rounds", type=int, default=1, help="mqtt-groups: rounds of both shapes, alternated, and the "
                                                          "median of their ratios (default 1)")
    ap.add_argument("--data-dir", default=None)
    a = ap.parse_args(argv)
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in ("append-replicated", "failover", "append-groups", "mqtt-groups")]
    faults = [f.strip() for f in a.faults.split(",") if f.strip()]
    if unknown or not cases or not faults or any(f not in ("kill", "stop") for f in faults):
        print(f"lmqtt bench ha: cases are append-replicated, failover, append-groups, mqtt-groups; faults kill, stop "
              f"(got {a.cases!r}, "
              f"{a.faults!r})", file=sys.stderr)
        return 2
    base = a.data_dir or tempfile.mkdtemp(prefix="lmqtt-ha-bench-")
    os.makedirs(base, exist_ok=True)

    def out(obj: dict) -> None:
        print(json.dumps(obj), flush=True)
    try:
        if "append-replicated" in cases:
            case_append(os.path.join(base, "append"), [m.strip() for m in a.flush_modes.split(",") if m.strip()],
                        a.messages, a.size, out)
        if "append-groups" in cases:
            case_groups(os.path.join(base, "groups"), [m.strip() for m in a.flush_modes.split(",") if m.strip()],
                        a.messages, a.size, out)
        if "mqtt-groups" in cases:
            case_mqtt_groups(os.path.join(base, "groups"), [m.strip() for m in a.flush_modes.split(",") if m.strip()],
                             a.seconds, out, max(1, a.rounds))
        if "failover" in cases:
            d = os.path.join(base, "failover")
            os.makedirs(d, exist_ok=True)
            case_failover(d, a.flush_modes.split(",")[0].strip(), a.kills, faults, a.size, a.election_timeout_s, out,
                          a.max_seconds)
    except KeyboardInterrupt:
        return 130
    finally:
        if a.data_dir is None:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
