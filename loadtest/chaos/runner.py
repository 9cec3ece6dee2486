"""One chaos round against one target: start it (data on a SmallDisk when disk-full faults are
asked for and a tmpfs can be mounted), start the clients of every path it has, inject `faults`
faults `interval` seconds apart, stop publishing, drain, and hand the checker's verdict back.

Fault kinds:
* `kill`: kill -9 of one victim (chosen at random among the target's), then the victim is started
  again on the same ports and data dir (for a worker of `serve --workers`, its supervisor does it);
* `stop`: SIGSTOP of one victim, SIGCONT after a pause (uniform in [pause/2, pause*3/2]);
* `diskfull`: the data disk filled to its last byte for `full_s` seconds, then freed.

The kinds take turns in the order given; for each kind the victims take turns too, in an order
shuffled with `seed` every round, so each victim gets its share of each kind. Every wait is bounded.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from . import disk as disk_mod
from .checker import Checker, failures
from .paths import (MqttPublisher, MqttSubscriber, PopMember, SdkGroupConsumer, SdkProducer, read_queue, sdk_connect,
                    sdk_errors)
from .targets import TARGETS, TargetError, pid_alive

KINDS = ("kill", "stop", "diskfull")
PATHS = ("mqtt", "sdk", "pop")


@dataclass
class Options:
    faults: int = 10
    interval: float = 1.5          # seconds between the end of one fault and the start of the next
    kinds: tuple = KINDS
    qos: tuple = (1, 2)
    paths: tuple = PATHS
    rate: float = 20.0             # messages per second per publisher
    window: int = 50               # unacknowledged MQTT messages per publisher at most
    pause: float = 1.0             # SIGSTOP length (mean)
    full_s: float = 1.5            # disk-full length
    warmup: float = 2.0
    settle: float = 30.0           # after the last fault: longest wait for the publishers' acks
    drain: float = 60.0            # then: longest wait for every acknowledged message to arrive
    quiet: float = 2.0             # and a last look for late duplicates
    seed: int = 1
    disk_mb: int = 256
    flush_mode: str = "async"
    notify: str = "auto"
    lmqtt_src: str | None = None   # run lmqtt from this source tree (a snapshot) instead of the installed one
    extra: dict = field(default_factory=dict)


def _say(log, target: str, msg: str) -> None:
    log(f"[chaos {target}] {msg}")


def run_target(name: str, opts: Options, workdir: Path, log=print) -> dict:
    """Run one round against target `name`; returns the result dict (JSON-able)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{opts.seed}-{name}")
    kinds = list(opts.kinds)
    skipped: dict[str, str] = {}
    disk = None
    data_root = workdir / "data"
    if "diskfull" in kinds:
        if disk_mod.can_mount_tmpfs():
            disk = disk_mod.SmallDisk(str(workdir / "disk"), opts.disk_mb).mount()
            data_root = Path(disk.path)
        else:
            kinds.remove("diskfull")
            skipped["diskfull"] = "cannot mount a tmpfs here (needs root); disk-full faults skipped"
    data_root.mkdir(parents=True, exist_ok=True)
    result: dict = {"target": name, "faults_asked": opts.faults, "kinds": kinds, "skipped_kinds": skipped,
                    "params": {k: v for k, v in opts.__dict__.items() if k != "extra"}}
    target = None
    clients: list = []
    t_start = time.monotonic()
    try:
        try:
            target = TARGETS[name](workdir, data_root, opts.flush_mode, opts.lmqtt_src, **(
                {"notify": opts.notify} if name == "fleet" else {}))
            target.start()
        except TargetError as e:
            result["error"] = str(e)
            _say(log, name, f"cannot start: {e}")
            return result
        result["version"] = target.version
        checker = Checker()
        tag = "c" + uuid.uuid4().hex[:6]
        hard_deadline = time.monotonic() + opts.faults * (opts.interval + opts.pause * 1.5 + opts.full_s + 100) \
            + opts.warmup + opts.settle + opts.drain + 600
        pubs, subs, consumers = _clients(target, opts, checker, tag, hard_deadline)
        clients = subs + consumers + pubs
        for s in subs:
            s.start()
        deadline = time.monotonic() + 30
        for s in subs:
            if not s.subscribed.wait(max(0.1, deadline - time.monotonic())):
                raise TargetError(f"{name}: subscriber {s.name} not subscribed within 30 s ({s.last_error})")
        for c in consumers + pubs:
            c.start()
        _say(log, name, f"{target.version}: {len(pubs)} publishers, {len(subs)} MQTT subscribers, "
                        f"{len(consumers)} SDK/POP consumers; {opts.faults} faults ({', '.join(kinds)}) "
                        f"every {opts.interval:g} s")
        time.sleep(opts.warmup)

        fault_log: list[dict] = []
        for n in range(1, opts.faults + 1):
            if not kinds:
                break
            kind = kinds[(n - 1) % len(kinds)]
            f = _inject(target, kind, rng, opts, disk, checker, n)
            fault_log.append(f)
            died = target.check()
            if died:
                f["died"] = died
            c = checker.counts()
            _say(log, name, f"fault {n}/{opts.faults} {kind} {f['victim']}"
                            f"{' pid ' + str(f['pid']) if f.get('pid') else ''} {f['duration_s']:.2f} s"
                            f"{' back in %.2f s' % f['back_s'] if 'back_s' in f else ''}"
                            f"{' NOTE ' + f['note'] if f.get('note') else ''}"
                            f"{' DIED: ' + ', '.join(died) if died else ''}"
                            f" | sent {c['sent']} acked {c['acked']} deliveries {c['deliveries']}")
            if n < opts.faults:
                time.sleep(opts.interval)
        result["faults"] = fault_log
        result["faults_by_kind"] = {k: sum(1 for f in fault_log if f["kind"] == k) for k in kinds}

        # stop making messages; wait for the acks of those in flight, then for the deliveries
        time.sleep(opts.interval)
        for p in pubs:
            p.finish()
        t_end = time.monotonic() + opts.settle
        while time.monotonic() < t_end and any(p.unacked() for p in pubs):
            time.sleep(0.1)
        result["unacked_at_end"] = sum(p.unacked() for p in pubs)
        t0 = time.monotonic()
        t_end = t0 + opts.drain
        missing = checker.missing()
        while missing and time.monotonic() < t_end:
            time.sleep(0.25)
            missing = checker.missing()
        result["drain_s"] = round(time.monotonic() - t0, 2)
        time.sleep(opts.quiet)
        result["missing_after_drain"] = checker.missing()
        _say(log, name, f"drained in {result['drain_s']} s; {result['missing_after_drain']} acknowledged "
                        f"deliveries missing; {result['unacked_at_end']} never acknowledged")
        for c in clients:
            c.stop()
        for c in clients:
            c.join(15)
        result["clients"] = [c.stats() for c in clients]
        result["rows"] = checker.verdict(fault_log)
        if target.store_address:
            _stored_copies(result["rows"], target.store_address, [tag, f"{tag}sdk", f"{tag}pop"])
        result["failures"] = failures(result["rows"])
        result["unexpected_exits"] = target.unexpected_exits
    except TargetError as e:
        result["error"] = str(e)
        _say(log, name, f"aborted: {e}")
    finally:
        for c in clients:
            c.stop()
        if target is not None:
            result["stop_status"] = target.stop()
            result["logs"] = target.logs()
        if disk is not None:
            disk.free()
            disk.umount()
        result["duration_s"] = round(time.monotonic() - t_start, 1)
    return result


def _clients(target, opts: Options, checker: Checker, tag: str, deadline: float):
    pubs, subs, consumers = [], [], []
    ports = target.mqtt_ports
    if "mqtt" in opts.paths:
        for qos in opts.qos:
            for i in range(2):
                subs.append(MqttSubscriber(checker, f"{tag}-mqtt-q{qos}-s{i}", "127.0.0.1", ports[i % len(ports)],
                                           f"{tag}/q{qos}/#", qos, deadline))
            for i in range(2):
                name = f"{tag}-mqtt-q{qos}-p{i}"
                # publisher i on the other gateway than subscriber i (a fleet: cross-gateway)
                pubs.append(MqttPublisher(checker, name, "127.0.0.1", ports[(i + 1) % len(ports)],
                                          f"{tag}/q{qos}/{name}", qos, deadline, opts.rate, opts.window))
    if target.store_address and ("sdk" in opts.paths or "pop" in opts.paths):
        sdk_errors()                  # imports the SDK here, before its threads start
        if "sdk" in opts.paths:
            consumers.append(SdkGroupConsumer(checker, f"{tag}-sdk-g", target.store_address, f"{tag}sdk",
                                              "chaos", deadline))
            pubs.append(SdkProducer(checker, f"{tag}-sdk-p0", target.store_address, f"{tag}sdk/p0", deadline,
                                    opts.rate))
        if "pop" in opts.paths:
            for i in range(2):
                consumers.append(PopMember(checker, f"{tag}-pop-m{i}", f"{tag}-pop", target.store_address,
                                           f"{tag}pop", "chaos", deadline))
            pubs.append(SdkProducer(checker, f"{tag}-pop-p0", target.store_address, f"{tag}pop/p0", deadline,
                                    opts.rate, path="pop"))
    return pubs, subs, consumers


def _stored_copies(rows: list[dict], address: str, first_levels: list[str]) -> None:
    """lmqtt only: read back every record the run stored (the ConsumeQueues of its topics' first
    levels) and add to each row `stored_twice`: messages stored more than once, i.e. duplicated on
    the publish side (a retried PUBLISH or PRODUCE stored again), as opposed to delivered twice."""
    copies: Counter = Counter()
    try:
        c = sdk_connect(address)
        try:
            for level in first_levels:
                copies.update(got for _off, got in read_queue(c, level)[0] if got is not None)
        finally:
            c.close()
    except Exception as e:  # noqa: BLE001 - a diagnostic; the verdict stands without it
        for row in rows:
            row["stored_twice"] = None
            row["stored_note"] = f"could not read the store back: {e}"
        return
    twice: Counter = Counter()
    for (pub, _seq), n in copies.items():
        if n > 1:
            twice[pub] += 1
    for row in rows:
        row["stored_twice"] = sum(n for pub, n in twice.items() if pub in row.get("publisher_names", ()))


_turns: dict[tuple, list] = {}


def _inject(target, kind: str, rng: random.Random, opts: Options, disk, checker: Checker, n: int) -> dict:
    f: dict = {"n": n, "t": checker.now(), "kind": kind,
               "utc": time.strftime("%H:%M:%S", time.gmtime()) + f"{time.time() % 1:.3f}"[1:]}   # as in the logs
    t0 = time.monotonic()
    if kind == "diskfull":
        f["victim"] = "disk"
        disk.fill(leave_bytes=0)
        f["free_bytes"] = disk.free_bytes()
        time.sleep(opts.full_s)
        disk.free()
        f["duration_s"] = round(time.monotonic() - t0, 3)
        return f
    turn = _turns.setdefault((id(target), kind), [])
    if not turn:                      # every victim once per round of this kind, in a random order
        turn.extend(target.victims())
        rng.shuffle(turn)
    victim = turn.pop()
    f["victim"] = victim
    pid = target.pid(victim)
    if pid is None:
        f["note"] = f"{victim} not running (skipped)"
        f["duration_s"] = 0.0
        return f
    f["pid"] = pid
    if kind == "kill":
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        f["duration_s"] = round(time.monotonic() - t0, 3)
        f["back_s"] = round(target.recover(victim), 3)
    elif kind == "stop":
        os.kill(pid, signal.SIGSTOP)
        time.sleep(rng.uniform(opts.pause / 2, opts.pause * 1.5))
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            f["note"] = "gone before SIGCONT"
        f["duration_s"] = round(time.monotonic() - t0, 3)
    else:
        raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(KINDS)}")
    return f


def clean(workdir: Path) -> None:
    shutil.rmtree(workdir, ignore_errors=True)
