"""`lmqtt bench external`: fan-in measured by Mosquitto's own command-line clients, an independent
check of the generator.

    lmqtt bench external [--brokers lmqtt,mosquitto] [--publishers 100] [--messages 5000]
        [--qos 0] [--size 16] [--rounds 3] [--nice 19] [--out FILE]

Why: a comparison is only as good as its generator. ``lmqtt bench compare`` drives the brokers with
lmqtt's own Python generator, which cannot publish as fast as Mosquitto can take (it measures
Mosquitto's fan-in far below what a C generator does), so its ratios say more about the generator
than about the brokers. Here nothing of lmqtt is on the client side: ``--publishers`` processes of
``mosquitto_pub -q QOS -m PAYLOAD --repeat MESSAGES`` (Debian: mosquitto-clients), each on its own
topic ``ext/<i>``, and one ``mosquitto_sub -t 'ext/#' -N`` whose output bytes are counted (every
payload is ``--size`` bytes). Each round gets a fresh broker per name (``brokers.start``), brokers
alternated between rounds.

Measured per run: messages sent and received (QoS 0 may drop), the delivery rate from the first
publisher's start to the last byte the subscriber read, the broker's CPU seconds (its process and
threads, /proc/PID/stat; for a broker of several processes, ``lmqtt-workers``, every process under
it) and CPU per delivered message, and publishers that exited with an error.

The publishers run at ``--nice`` (default 19). mosquitto_pub polls its socket without sleeping
while the broker does not read it, so once a broker falls behind, a hundred clients competing
with it for the CPU take it from the broker and it falls further behind (a broker started from
the same shell session as the clients was given ~5 % of a core on a 2-core machine, new
connections waited in the listen queue, most mosquitto_pub gave up with "Unknown error"). Two
things prevent it here: each broker runs in a session of its own (with Linux's autogroup
scheduling, a session gets its share of the CPU whatever the other sessions' processes do), and
the publishers are niced, so they use only what the broker leaves. The subscriber and the broker
run at normal priority.

One JSON line per run on stdout (and appended to ``--out``); a summary per broker (medians) on
stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import brokers as B

TOOLS = ("mosquitto_pub", "mosquitto_sub")


def _one_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and all its threads so far (0 once it is gone)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
    """The processes under `pid` (its children's children too), from /proc's children lists."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _cpu_s(pid: int) -> float:
    """CPU seconds of the broker: its process and, for one made of several (``lmqtt-workers``: a
    supervisor, a store and two gateways; ``lmqtt-fleet``), every process under it."""
    return _one_cpu_s(pid) + sum(_one_cpu_s(c) for c in _descendants(pid))


class _Counter(threading.Thread):
    """Reads the subscriber's stdout; `bytes` and the monotonic time of the last byte."""

    def __init__(self, stream) -> None:
        super().__init__(daemon=True)
        self.stream = stream
        self.bytes = 0
        self.last = time.monotonic()

    def run(self) -> None:
        read = self.stream.read1 if hasattr(self.stream, "read1") else self.stream.read
        while True:
            chunk = read(1 << 16)
            if not chunk:
                return
            self.bytes += len(chunk)
            self.last = time.monotonic()


def fanin(host: str, port: int, *, publishers: int, messages: int, qos: int = 0, size: int = 16,
          nice: int = 19, broker_pid: int | None = None, idle_s: float = 5.0,
          timeout_s: float = 300.0) -> dict:
    """One fan-in run against a broker already listening on host:port (see the module docstring)."""
    payload = ("x" * size).encode()
    sub = subprocess.Popen(["mosquitto_sub", "-h", host, "-p", str(port), "-t", "ext/#", "-q", str(qos), "-N"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    counter = _Counter(sub.stdout)
    counter.start()
    procs: list[subprocess.Popen] = []
    try:
        # the subscription is in place once a probe message comes back (mosquitto_sub says nothing)
        deadline = time.monotonic() + 30
        while counter.bytes == 0:
            if sub.poll() is not None or time.monotonic() > deadline:
                err = sub.stderr.read().decode(errors="replace").strip() if sub.poll() is not None else ""
                raise RuntimeError(f"mosquitto_sub never received a probe message from {host}:{port}"
                                   + (f": {err}" if err else ""))
            subprocess.run(["mosquitto_pub", "-h", host, "-p", str(port), "-t", "ext/probe", "-q", "1",
                            "-m", payload], capture_output=True, timeout=10)
            time.sleep(0.2)
        time.sleep(0.5)                  # a second probe in flight lands now, not in the count
        base = counter.bytes
        cpu0 = _cpu_s(broker_pid) if broker_pid else None
        total = publishers * messages
        t0 = time.monotonic()
        for i in range(publishers):
            procs.append(subprocess.Popen(
                ["nice", "-n", str(nice), "mosquitto_pub", "-h", host, "-p", str(port), "-t", f"ext/{i}",
                 "-q", str(qos), "-m", payload, "--repeat", str(messages)],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        end = t0 + timeout_s
        while time.monotonic() < end:
            time.sleep(0.05)
            got = (counter.bytes - base) // size
            if got >= total:
                break
            if all(p.poll() is not None for p in procs) and time.monotonic() - counter.last > idle_s:
                break                    # every publisher is done and nothing arrives any more
        received = (counter.bytes - base) // size
        t1 = max(counter.last, t0 + 1e-6)
        cpu = (_cpu_s(broker_pid) - cpu0) if broker_pid and cpu0 is not None else None
        # every message may be in before a publisher has its last PUBACK and has disconnected:
        # each gets a moment to exit on its own (killed then, it was counted as failing)
        grace = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(max(0.0, grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        killed = set()
        for p in procs:
            if p.poll() is None:
                p.kill()
                killed.add(p)
        errors = []
        for p in procs:
            p.wait(10)
            if p in killed:
                errors.append("did not exit after the run (killed)")
            elif p.returncode:
                errors.append((p.stderr.read() or b"").decode(errors="replace").strip()[:200])
        sub.kill()
        sub.wait(10)
    row = {"publishers": publishers, "messages": messages, "qos": qos, "size": size, "nice": nice,
           "sent": total, "received": received, "delivered_pct": round(100 * received / total, 2),
           "seconds": round(t1 - t0, 3), "rate": round(received / (t1 - t0)),
           "publisher_errors": len(errors), "error_sample": errors[0] if errors else ""}
    if cpu is not None:
        row["broker_cpu_s"] = round(cpu, 3)
        row["cpu_us_per_msg"] = round(1e6 * cpu / received, 2) if received else None
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench external", description=__doc__.split("\n")[0])
    ap.add_argument("--brokers", default="lmqtt,mosquitto",
                    help="comma list (lmqtt, lmqtt-workers, mosquitto, amqtt); lmqtt@DIR runs lmqtt from the "
                         "source tree DIR (lmqtt-workers@DIR too)")
    ap.add_argument("--publishers", type=int, default=100)
    ap.add_argument("--messages", type=int, default=5000, help="per publisher")
    ap.add_argument("--qos", type=int, default=0, choices=(0, 1, 2))
    ap.add_argument("--size", type=int, default=16, help="payload bytes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nice", type=int, default=19, help="the publishers' niceness (see the module docstring)")
    ap.add_argument("--idle-s", type=float, default=5.0, help="a run ends this long after the last byte once "
                                                               "every publisher is done")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    a = ap.parse_args(argv)
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        print(f"lmqtt bench external: {', '.join(missing)} not found (Debian: mosquitto-clients)", file=sys.stderr)
        return 2
    names = [b for b in a.brokers.split(",") if b]
    rows: list[dict] = []
    out = open(a.out, "a") if a.out else None
    with tempfile.TemporaryDirectory(prefix="lmqtt-external-") as tmp:
        for r in range(a.rounds):
            for spec in (names if r % 2 == 0 else names[::-1]):
                name, _, src = spec.partition("@")
                try:
                    rb = B.start(name, Path(tmp) / f"{spec.replace('/', '_')}-{r}", lmqtt_src=src or None)
                except B.BrokerUnavailable as e:
                    row = {"broker": spec, "round": r + 1, "available": False, "reason": str(e)}
                else:
                    try:
                        row = {"broker": spec, "round": r + 1, "version": rb.version,
                               **fanin(rb.host, rb.port, publishers=a.publishers, messages=a.messages, qos=a.qos,
                                       size=a.size, nice=a.nice, broker_pid=rb.pid, idle_s=a.idle_s)}
                    except (RuntimeError, OSError) as e:
                        row = {"broker": spec, "round": r + 1, "error": str(e)}
                    finally:
                        rb.stop()
                line = json.dumps(row)
                print(line, flush=True)
                if out:
                    out.write(line + "\n")
                    out.flush()
                rows.append(row)
    if out:
        out.close()
    for spec in names:
        ok = [x for x in rows if x["broker"] == spec and "rate" in x]
        if not ok:
            print(f"{spec}: no run completed", file=sys.stderr)
            continue
        cpu = [x["cpu_us_per_msg"] for x in ok if x.get("cpu_us_per_msg")]
        print(f"{spec}: {statistics.median(x['rate'] for x in ok):,.0f} msg/s delivered "
              f"({min(x['rate'] for x in ok):,}-{max(x['rate'] for x in ok):,}), "
              f"{statistics.median(x['delivered_pct'] for x in ok)} % of sent, "
              + (f"broker CPU {statistics.median(cpu):.2f} us/msg, " if cpu else "")
              + f"publisher errors {sum(x['publisher_errors'] for x in ok)}", file=sys.stderr)
    return 0 if all("rate" in x for x in rows) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
