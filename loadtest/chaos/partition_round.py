"""A round of partition faults under load: `lmqtt bench chaos --partitions` and tests/partitions.

    with NetBed() as bed:
        fleet = PartitionedFleet(bed, workdir).start()
        rnd = PartitionRound(fleet, RoundOptions())
        rnd.start_load()
        row = rnd.fault("primary-split")    # cut, hold, heal, resync: one JSON-able row
        summary = rnd.finish()              # drain, every message judged

The load: MQTT QoS 1 (and/or 2) publishers and subscribers on host c1 through the gateways (each
publisher on the other gateway than its subscriber), an SDK producer, a consumer group and POP
members on host c2 (loadtest/chaos/remote.py runs them there; the chaos Checker judges every
message: lost, duplicated, reordered, never sent).

Per fault (`fault()`): the group is whole first (one primary, every member in sync, logs equal);
the fault is cut, held, healed; then
* `resync_s`: from the heal until the group is whole again: every member answers, one primary
  holds its lease, the same epoch and epoch list everywhere, every member in the in-sync set and
  the members' CommitLog bytes equal up to the shortest log (read from their segment files,
  `LogCompare`); `resynced: false` when that did not happen within `resync_timeout`;
* `failover_s` (when the primary changed): from the cut to the first acknowledgement of an SDK
  send by another member than the old primary; `ack_gap_s`: the longest time without any SDK
  acknowledgement from the cut until the group was whole again;
* `two_primary_acks`: SDK acknowledgements that named a CommitLog offset (the member and its
  epoch are in each acknowledgement) where the group's log holds another message or nothing: an
  acknowledgement by a primary whose log lost to another primary's. Read back from the group,
  incrementally after each fault and all of it at the end (`acked_not_in_log`: acknowledged MQTT
  and SDK messages missing from the group's log).
"""
from __future__ import annotations

import random
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Any

from .checker import Checker, failures
from .netbed import NetBed, NetBedError
from .paths import read_queue
from .partitions import FAULTS, KINDS, LogCompare, PartitionedFleet, inject
from .remote import ClientProcess


@dataclass
class RoundOptions:
    qos: tuple = (1,)
    paths: tuple = ("mqtt", "sdk", "pop")
    rate: float = 20.0
    interval: float = 1.0           # after a fault is over, before the next
    resync_timeout: float = 90.0
    settle: float = 30.0            # at the end: longest wait for the publishers' acknowledgements
    drain: float = 60.0             # then for every acknowledged message to arrive
    quiet: float = 2.0
    seed: int = 1
    max_seconds: float = 4 * 3600   # the clients' own bound


def misplaced_acks(acks: dict, stored: dict, checked: set, reached: int, final: bool) -> list[dict]:
    """The acknowledgements whose CommitLog offset holds another message, or nothing, in the
    group's log as read (`stored`: offset -> (publisher, seq)): each was given by a primary whose
    log lost to another primary's. `acks`: (publisher, seq) -> (t, node, epoch, offset). Only
    acknowledgements below `reached` (the read holds every record of the topics below it) are
    judged, every one when `final`; each once (`checked` is updated)."""
    out = []
    for key, (t, node, epoch, off) in acks.items():
        if key in checked or (not final and off >= reached):
            continue
        checked.add(key)
        got = stored.get(off)
        if got != key:
            out.append({"publisher": key[0], "seq": key[1], "offset": off, "acked_t": t, "by_node": node,
                        "epoch": epoch, "log_has": list(got) if got else None})
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(len(s) * q))], 3)


class PartitionRound:
    def __init__(self, fleet: PartitionedFleet, opts: RoundOptions | None = None, log=print) -> None:
        self.fleet, self.opts, self.log = fleet, opts or RoundOptions(), log
        self.checker = Checker()
        self.tag = "p" + uuid.uuid4().hex[:5]
        self.rng = random.Random(self.opts.seed)
        self.clients: list[ClientProcess] = []
        self._ack_lock = threading.Lock()
        self.sdk_acks: dict[tuple[str, int], tuple] = {}     # (pub, seq) -> (t, node, epoch, offset)
        self.ack_times: list[tuple[float, int | None]] = []  # (t, node) of every SDK acknowledgement
        self.rows: list[dict] = []
        self.turns: dict[str, int] = {}
        self.logs = LogCompare(fleet.group)
        self._read: dict[str, int] = {}                      # SDK topic -> next queue offset to read
        self._hi: dict[str, int] = {}                        # SDK topic -> last CommitLog offset read
        self._stored: dict[int, tuple[str, int]] = {}        # CommitLog offset -> (pub, seq), SDK topics
        self._checked: set = set()                           # SDK acks found at their offset
        self.two_primary: list[dict] = []

    # -------------------------------------------------------------- load
    def _on_ack(self, t, pub, seq, node, epoch, offset) -> None:
        with self._ack_lock:          # the client processes' reader threads call this
            self.sdk_acks[(pub, seq)] = (t, node, epoch, offset)
            self.ack_times.append((t, node))

    def _acks_now(self) -> tuple[dict, list]:
        """A copy of (sdk_acks, ack_times): the reader threads keep adding to them."""
        with self._ack_lock:
            return dict(self.sdk_acks), list(self.ack_times)

    def _specs(self) -> list[tuple[str, dict]]:
        f, o, tag = self.fleet, self.opts, self.tag
        gws = f.gateways
        mqtt: list[dict[str, Any]] = []
        if "mqtt" in o.paths:
            for qos in o.qos:
                for i in range(2):
                    h, p = f.mqtt_address(gws[i % len(gws)])
                    mqtt.append({"kind": "mqtt_sub", "name": f"{tag}-q{qos}-s{i}", "host": h, "port": p,
                                 "filter": f"{tag}/q{qos}/#", "qos": qos})
                for i in range(2):
                    h, p = f.mqtt_address(gws[(i + 1) % len(gws)])
                    name = f"{tag}-q{qos}-p{i}"
                    mqtt.append({"kind": "mqtt_pub", "name": name, "host": h, "port": p,
                                 "topic": f"{tag}/q{qos}/{name}", "qos": qos, "rate": o.rate})
        sdk: list[dict[str, Any]] = []
        addr = f.store_address
        if "sdk" in o.paths:
            sdk.append({"kind": "sdk_group", "name": f"{tag}-sdk-g", "address": addr, "topic": f"{tag}sdk",
                        "group": "chaos"})
            sdk.append({"kind": "sdk_pub", "name": f"{tag}-sdk-p0", "address": addr, "topic": f"{tag}sdk/p0",
                        "rate": o.rate})
        if "pop" in o.paths:
            for i in range(2):
                sdk.append({"kind": "pop", "name": f"{tag}-pop-m{i}", "receiver": f"{tag}-pop", "address": addr,
                            "topic": f"{tag}pop", "group": "chaos"})
            sdk.append({"kind": "sdk_pub", "name": f"{tag}-pop-p0", "address": addr, "topic": f"{tag}pop/p0",
                        "rate": o.rate, "path": "pop"})
        return [(h, {"clients": c, "max_seconds": o.max_seconds}) for h, c in (("c1", mqtt), ("c2", sdk)) if c]

    def start_load(self, timeout: float = 60.0) -> None:
        f = self.fleet
        for host, spec in self._specs():
            self.clients.append(ClientProcess(f.bed, host, spec, self.checker, f.workdir / f"clients-{host}.log",
                                              env=f.env(), on_ack=self._on_ack).start())
        for c in self.clients:
            if not c.wait_subscribed(timeout):
                raise RuntimeError(f"subscribers on {c.host} not subscribed within {timeout:g} s "
                                   f"({sorted(c.subscribers - c.subscribed)}); log {c.log_path}")
        for c in self.clients:
            c.go()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.checker.counts()["acked"] < 10:
            time.sleep(0.1)
        self.log(f"load running: {', '.join(self.opts.paths)}, QoS {self.opts.qos}, {self.opts.rate:g}/s per "
                 f"publisher; {self.checker.counts()}")

    # -------------------------------------------------------------- one fault
    def fault(self, kind: str) -> dict:
        if kind not in FAULTS:
            raise ValueError(f"unknown partition fault {kind!r}; known: {', '.join(KINDS)}")
        f, o, ck = self.fleet, self.opts, self.checker
        n = len(self.rows) + 1
        ok, why = f.wait_healthy(timeout=o.resync_timeout, logs=self.logs)
        before = f.primary()
        sts = f.statuses()
        epoch_before = max((s["epoch"] for s in sts.values() if s), default=None)
        turn = self.turns.get(kind, 0)
        self.turns[kind] = turn + 1
        t_cut = ck.now()
        inj = inject(f, kind, turn, self.rng)
        time.sleep(inj.hold)
        t_heal = ck.now()
        inj.heal()
        t0 = time.monotonic()
        resynced, why_not = f.wait_healthy(timeout=o.resync_timeout, logs=self.logs)
        resync_s = round(time.monotonic() - t0, 3)
        t_whole = ck.now()
        after = f.primary()
        sts = f.statuses()
        epoch_after = max((s["epoch"] for s in sts.values() if s), default=None)
        old = before.node if before else None
        new = after.node if after else None
        failover = None
        _acks, ack_times = self._acks_now()
        if new is not None and new != old:
            firsts = [t for t, node in ack_times if t > t_cut and node is not None and node != old]
            if firsts:
                # a flapping link: counted from the last cut before that acknowledgement
                cuts = [ck.at(c) for c in getattr(inj.faults[0], "cut_times", ())] or [t_cut]
                start = max([c for c in cuts if c <= min(firsts)] or [t_cut])
                failover = round(min(firsts) - start, 3)
        times = sorted([t_cut] + [t for t, _ in ack_times if t_cut < t <= t_whole] + [t_whole])
        gap = round(max(b - a for a, b in zip(times, times[1:], strict=False)), 3) if len(times) > 1 else None
        self._check_acks()
        died = f.check_alive()
        c = ck.counts()
        row = {"fault": n, "kind": kind, "victim": inj.victim, "what": inj.what, "hold_s": inj.hold,
               "t": t_cut, "healed_t": t_heal, "whole_before": ok, **({"not_whole_before": why} if not ok else {}),
               "primary_before": old, "primary_after": new, "epoch_before": epoch_before, "epoch_after": epoch_after,
               "failover_s": failover, "ack_gap_s": gap, "resynced": resynced, "resync_s": resync_s if resynced else None,
               **({"not_resynced": why_not} if not resynced else {}),
               "log_equal_upto": self.logs.upto, "log_crc32": f"{self.logs.upto_crc:08x}",
               "two_primary_acks": len(self.two_primary), "sent": c["sent"], "acked": c["acked"],
               "deliveries": c["deliveries"], **({"died": died} if died else {})}
        if hasattr(inj.faults[0], "cycles"):
            row["flaps"] = inj.faults[0].cycles
        self.rows.append(row)
        time.sleep(o.interval)
        return row

    # -------------------------------------------------------------- acknowledgements vs the log
    def _read_topics(self, conn) -> None:
        """Read the SDK paths' topics (their first level's ConsumeQueue) on from where the last
        read stopped: CommitLog offset -> (publisher, seq)."""
        for level in (f"{self.tag}sdk", f"{self.tag}pop"):
            recs, self._read[level] = read_queue(conn, level, self._read.get(level, 0), 10_000)
            for off, got in recs:
                if got is not None:
                    self._stored[off] = got
                self._hi[level] = max(self._hi.get(level, -1), off)

    def _check_acks(self, final: bool = False) -> None:
        """Every SDK acknowledgement whose offset the group's log has reached must find its own
        message there (`final`: every one, reached or not)."""
        f = self.fleet
        try:
            with f.bed.inside("ctl"):
                conn = f.store_connection(f.group.peers, timeout=10.0)
                try:
                    self._read_topics(conn)
                    end = conn.cmd("stats")["max_offset"]
                finally:
                    conn.close()
        except Exception as e:  # noqa: BLE001 - checked again after the next fault / at the end
            self.log(f"read-back failed (checked later): {e}")
            if not final:
                return
            end = None
        # records are read in log order per topic: below the smallest of the topics' last offsets
        # read, each topic's read holds everything that was stored (and readable) there
        reached = min(self._hi.values(), default=-1)
        if end is not None:
            reached = min(reached, end)
        self.two_primary += misplaced_acks(self._acks_now()[0], self._stored, self._checked, reached, final)

    def _mqtt_in_log(self) -> tuple[int, list]:
        """Acknowledged MQTT messages missing from the group's log (ConsumeQueue of the MQTT
        topics' first level, read whole)."""
        f = self.fleet
        with f.bed.inside("ctl"):
            conn = f.store_connection(f.group.peers, timeout=10.0)
            try:
                seen = {got for _off, got in read_queue(conn, self.tag)[0] if got is not None}
            finally:
                conn.close()
        missing = [k for k in self.checker.acked_ids("mqtt") if k not in seen]
        return len(missing), missing[:10]

    # -------------------------------------------------------------- the end
    def finish(self) -> dict:
        o, f, ck = self.opts, self.fleet, self.checker
        for c in self.clients:
            c.finish()
        t_end = time.monotonic() + o.settle
        while time.monotonic() < t_end and any(c.unacked() for c in self.clients):
            time.sleep(0.1)
        unacked = sum(c.unacked() for c in self.clients)
        t0 = time.monotonic()
        while ck.missing() and time.monotonic() < t0 + o.drain:
            time.sleep(0.25)
        drain_s = round(time.monotonic() - t0, 2)
        time.sleep(o.quiet)
        for c in self.clients:
            c.stop()
        whole, why = f.wait_healthy(timeout=o.resync_timeout)
        logs = LogCompare(f.group)                 # every byte, from 0, with the load stopped
        equal, why_logs = (False, "group not whole") if not whole else logs.compare(
            {n: st["log_end"] for n, st in f.statuses().items() if st})
        self._check_acks(final=True)
        try:
            not_in_log, examples = self._mqtt_in_log() if "mqtt" in o.paths else (0, [])
        except Exception as e:  # noqa: BLE001
            not_in_log, examples = None, [f"could not read the log back: {e}"]
        rows = ck.verdict([{"n": r["fault"], "t": r["t"], "kind": r["kind"], "victim": r["victim"]}
                           for r in self.rows])
        fails = failures(rows)
        fails += [f"{len(self.two_primary)} message(s) acknowledged by a primary whose log lost (two primaries)"
                  for _ in [1] if self.two_primary]
        never = [r["fault"] for r in self.rows if not r["resynced"]]
        if never:
            fails.append(f"faults {never}: the group was not whole again within {o.resync_timeout:g} s")
        if not_in_log:
            fails.append(f"{not_in_log} acknowledged MQTT message(s) not in the group's log")
        if not equal:
            fails.append(f"at the end: {why_logs or why}")
        if f.died:
            fails.append(f"processes died without a fault of ours: {[d['process'] for d in f.died]}")
        fo = [r["failover_s"] for r in self.rows if r["failover_s"] is not None]
        rs = [r["resync_s"] for r in self.rows if r["resync_s"] is not None]
        by_kind = {}
        for k in dict.fromkeys(r["kind"] for r in self.rows):
            ks = [r for r in self.rows if r["kind"] == k]
            kf = [r["failover_s"] for r in ks if r["failover_s"] is not None]
            by_kind[k] = {"faults": len(ks), "failovers": len(kf), "failover_p50_s": _pct(kf, 0.5),
                          "failover_max_s": max(kf) if kf else None,
                          "resync_p50_s": _pct([r["resync_s"] for r in ks if r["resync_s"] is not None], 0.5),
                          "ack_gap_max_s": max((r["ack_gap_s"] or 0) for r in ks)}
        total = {k: sum(r[k] for r in rows) for k in ("sent", "acked", "lost", "duplicated", "never_sent")}
        return {"summary": True, "faults": len(self.rows), "by_kind": by_kind, **total,
                "reordered": sum(r["reordered"] or 0 for r in rows),
                "duplicated_qos2": sum(r["duplicated"] for r in rows if r["qos"] == 2),
                "two_primary_acks": len(self.two_primary), "two_primary_examples": self.two_primary[:10],
                "sdk_acks_checked": len(self._checked), "acked_not_in_log": not_in_log,
                "not_in_log_examples": examples, "failovers": len(fo), "failover_p50_s": _pct(fo, 0.5),
                "failover_p99_s": _pct(fo, 0.99), "failover_max_s": max(fo) if fo else None,
                "resync_p50_s": _pct(rs, 0.5), "resync_p99_s": _pct(rs, 0.99), "resync_max_s": max(rs) if rs else None,
                "never_resynced": never, "log_compared_bytes": logs.upto, "log_crc32": f"{logs.upto_crc:08x}", "logs_equal_at_end": equal,
                "unacked_at_end": unacked, "drain_s": drain_s, "died": f.died,
                "client_errors": [e for c in self.clients for e in c.errors][:10],
                "rows": rows, "failures": fails}

    def stop(self) -> None:
        for c in self.clients:
            try:
                c.stop(10)
            except Exception:  # noqa: BLE001 - the bed stops what is left
                pass


def run(kinds: tuple, faults: int, workdir, opts: RoundOptions, fleet_opts=None, emit=print, log=print,
        max_seconds: float = 0.0) -> tuple[int, dict]:
    """`lmqtt bench chaos --partitions`: a bed, the fleet on it, the load, `faults` faults taking
    turns over `kinds`, then the verdict. `emit(row)` gets each fault's row and the summary.
    -> (exit status: 0 clean, 1 a verdict failed, 3 the bed or the fleet could not be made; summary)."""
    t0 = time.monotonic()
    try:
        bed = NetBed(workdir=workdir, log=log)
    except NetBedError as e:
        return 3, {"summary": True, "error": str(e)}
    summary: dict = {}
    with bed:
        fleet = PartitionedFleet(bed, workdir, fleet_opts, log=log)
        rnd = None
        try:
            fleet.start()
            rnd = PartitionRound(fleet, opts, log=log)
            rnd.start_load()
        except (RuntimeError, OSError, NetBedError) as e:
            summary = {"summary": True, "error": f"{type(e).__name__}: {e}", "faults": 0}
        try:
            error = None
            for n in range(faults if rnd is not None and not summary else 0):
                if max_seconds and time.monotonic() - t0 > max_seconds:
                    log(f"time bound of {max_seconds:g} s reached after {n} faults")
                    break
                assert rnd is not None
                try:
                    row = rnd.fault(kinds[n % len(kinds)])
                except Exception:  # noqa: BLE001 - the harness's own error: what ran so far is still judged
                    error = traceback.format_exc()
                    log(f"fault {n + 1} failed in the harness:\n{error}")
                    break
                emit(row)
                log(f"fault {n + 1}/{faults} {row['kind']} {row['victim']}: primary {row['primary_before']} -> "
                    f"{row['primary_after']}, failover {row['failover_s']} s, resync {row['resync_s']} s, "
                    f"two-primary acks {row['two_primary_acks']} | acked {row['acked']}")
            if rnd is not None and not summary:
                summary = rnd.finish()
                if error:
                    summary["error"] = error
        finally:
            if rnd is not None:
                rnd.stop()
            fleet.stop()
    summary["duration_s"] = round(time.monotonic() - t0, 1)
    summary["kinds"] = list(kinds)
    emit(summary)
    if summary.get("error"):
        return 3, summary
    return (1 if summary["failures"] else 0), summary
