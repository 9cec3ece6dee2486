"""`lmqtt bench chaos`: kill -9, SIGSTOP/SIGCONT and disk full injected into lmqtt (serve, serve
--workers 2, a fleet) and Mosquitto under mixed MQTT / SDK / POP load, every message checked.

    lmqtt bench chaos --target all --faults 600 --out DIR
    lmqtt bench chaos --target serve,fleet --faults serve=600,fleet=150 --kinds kill,stop

Per target, path and QoS: faults injected by kind, messages sent, acknowledged, received, lost
(acknowledged, never delivered), duplicated, reordered within a publisher, delivered but never sent.
`--out DIR`: `<target>.json` per target and `summary.md` (a table of every target's JSON in DIR).

    lmqtt bench chaos --partitions --faults 200 [--kinds primary-split,asym-in,...]

`--partitions`: a store group of 3, two gateways, Redis and the clients each on its own host made
of network namespaces (root only), and network faults cut between them: a JSON line per fault and
a summary line (acknowledged, lost, duplicated, acknowledged by two primaries, failover p50/p99,
time to resync); loadtest/chaos/partition_round.py.

Exit status: 0 when no lmqtt target lost an acknowledged message, delivered a QoS 2 message twice
or delivered a message never sent (Mosquitto's figures are reported beside, not judged); 1 when
one did; 2 for a usage error; 3 when a target could not be started or brought back.
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from .partition_round import RoundOptions, run as run_round
from .partitions import KINDS as PKINDS, FleetOptions
from .runner import KINDS, PATHS, Options, run_target
from .targets import TARGETS, TargetError, lmqtt_env

ALL = ("serve", "workers", "fleet", "mosquitto")


def _faults_arg(text: str, targets: list[str]) -> dict[str, int]:
    """`600` (every target) or `serve=600,fleet=150` (others: the plain number if also given, else 0)."""
    out: dict[str, int] = {}
    default = None
    for part in [p.strip() for p in text.split(",") if p.strip()]:
        name, eq, n = part.partition("=")
        try:
            if eq:
                if name not in TARGETS:
                    raise ValueError(f"unknown target {name!r} in --faults")
                out[name] = int(n)
            else:
                default = int(part)
        except ValueError as e:
            raise ValueError(str(e) if "target" in str(e) else f"--faults: {part!r} is not a number") from None
    for t in targets:
        out.setdefault(t, default if default is not None else 0)
    if any(v < 0 for v in out.values()):
        raise ValueError("--faults must be >= 0")
    return {t: out[t] for t in targets}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lmqtt bench chaos", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--partitions", action="store_true",
                    help="network partitions of a store group and a fleet on namespace hosts (root); "
                         "--kinds then takes " + ",".join(PKINDS))
    ap.add_argument("--election-timeout-s", type=float, default=2.5,
                    help="--partitions: the store group's election timeout (default 2.5)")
    ap.add_argument("--max-seconds", type=float, default=0.0,
                    help="--partitions: start no fault after this many seconds (0: no bound)")
    ap.add_argument("--target", default="serve",
                    help="serve, workers, fleet, mosquitto, a comma list, or all (default serve)")
    ap.add_argument("--faults", default="10",
                    help="faults per target: N, or TARGET=N,... (default 10)")
    ap.add_argument("--interval", type=float, default=1.5,
                    help="seconds between the end of one fault and the next (default 1.5)")
    ap.add_argument("--kinds", default=None, help="fault kinds, taking turns (default kill,stop,diskfull; "
                                                  "with --partitions every partition fault)")
    ap.add_argument("--qos", default=None, help="MQTT QoS levels of the MQTT paths (default 1,2; --partitions: 1)")
    ap.add_argument("--paths", default=",".join(PATHS), help="mqtt, sdk, pop (default all; Mosquitto: mqtt only)")
    ap.add_argument("--rate", type=float, default=20.0, help="messages per second per publisher (default 20)")
    ap.add_argument("--pause", type=float, default=1.0,
                    help="SIGSTOP length in seconds, mean of a uniform [pause/2, 3*pause/2] (default 1)")
    ap.add_argument("--full-s", type=float, default=1.5, help="seconds the disk stays full (default 1.5)")
    ap.add_argument("--drain", type=float, default=60.0,
                    help="longest wait after the last fault for every acknowledged message (default 60)")
    ap.add_argument("--disk-mb", type=int, default=256, help="size of the data tmpfs (default 256)")
    ap.add_argument("--flush-mode", default="async", choices=("sync", "async", "async+buffer"),
                    help="lmqtt's flush mode (default async: a process crash loses nothing)")
    ap.add_argument("--notify", default="auto", choices=("auto", "redis", "native"),
                    help="the fleet's notify: Redis when redis-server is installed (auto), or forced")
    ap.add_argument("--lmqtt-src", help="run lmqtt from this source tree (e.g. a `git archive` snapshot with its C "
                    "modules built in place), so edits to the working tree do not reach a long run")
    ap.add_argument("--seed", type=int, default=1, help="victim choice and pause lengths (default 1)")
    ap.add_argument("--out", help="directory for <target>.json and summary.md")
    ap.add_argument("--workdir", help="where data and logs go (default: a temporary directory, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, data)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.partitions:
        return _partitions(ap, args)
    args.kinds = args.kinds or ",".join(KINDS)
    args.qos = args.qos or "1,2"
    targets = list(ALL) if args.target == "all" else [t.strip() for t in args.target.split(",") if t.strip()]
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets:
        ap.error(f"--target: unknown {', '.join(bad) or '(none)'}; known: {', '.join(ALL)}, all")
    try:
        faults = _faults_arg(args.faults, targets)
    except ValueError as e:
        ap.error(str(e))
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds: choose from {', '.join(KINDS)}")
    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    if not paths or any(p not in PATHS for p in paths):
        ap.error(f"--paths: choose from {', '.join(PATHS)}")
    try:
        qos = tuple(sorted({int(q) for q in args.qos.split(",") if q.strip()}))
    except ValueError:
        ap.error("--qos: 1, 2 or 1,2")
    if not qos or any(q not in (1, 2) for q in qos):
        ap.error("--qos: 1, 2 or 1,2 (QoS 0 promises nothing to check)")
    for name in ("interval", "rate", "pause", "full_s", "drain"):
        if getattr(args, name) < 0 or (name == "rate" and args.rate <= 0):
            ap.error(f"--{name.replace('_', '-')} must be positive")
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    base = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="lmqtt-chaos-"))
    results = []
    code = 0
    try:
        for t in targets:
            if faults[t] == 0 and len(targets) > 1:
                continue
            opts = Options(faults=faults[t], interval=args.interval, kinds=kinds, qos=qos,
                           paths=("mqtt",) if t == "mosquitto" else paths, rate=args.rate, pause=args.pause,
                           full_s=args.full_s, drain=args.drain, disk_mb=args.disk_mb, flush_mode=args.flush_mode,
                           notify=args.notify, seed=args.seed, lmqtt_src=args.lmqtt_src)
            res = run_target(t, opts, base / t, log=lambda m: print(m, file=sys.stderr, flush=True))
            res["time_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
            results.append(res)
            if out:
                (out / f"{t}.json").write_text(json.dumps(res, indent=1) + "\n")
            print(table([res]), flush=True)
            if res.get("error"):
                code = max(code, 3)
            elif res.get("failures") and TARGETS[t].lmqtt:
                code = max(code, 1)
        if out:
            (out / "summary.md").write_text(summary(out, " ".join(["lmqtt bench chaos", *(argv or sys.argv[3:])])))
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(base, ignore_errors=True)
        elif args.keep:
            print(f"work directory kept: {base}", file=sys.stderr)
    for r in results:
        for line in r.get("failures", []):
            print(f"{r['target']}: {line}", file=sys.stderr)
        if r.get("error"):
            print(f"{r['target']}: {r['error']}", file=sys.stderr)
    return code


def _partitions(ap: argparse.ArgumentParser, args) -> int:
    """`--partitions`: one round on a network bed (loadtest/chaos/partition_round.py)."""
    try:
        faults = int(args.faults)
    except ValueError:
        ap.error("--faults: with --partitions, a number of faults")
    kinds = tuple(k.strip() for k in (args.kinds or ",".join(PKINDS)).split(",") if k.strip())
    if not kinds or any(k not in PKINDS for k in kinds):
        ap.error(f"--kinds: with --partitions choose from {', '.join(PKINDS)}")
    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    if not paths or any(p not in PATHS for p in paths):
        ap.error(f"--paths: choose from {', '.join(PATHS)}")
    try:
        qos = tuple(sorted({int(q) for q in (args.qos or "1").split(",") if q.strip()}))
    except ValueError:
        ap.error("--qos: 1, 2 or 1,2")
    if faults < 0 or not qos or any(q not in (1, 2) for q in qos) or args.rate <= 0:
        ap.error("--faults >= 0, --qos 1 and/or 2, --rate > 0")
    base = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="lmqtt-partitions-"))
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def emit(obj: dict) -> None:
        line = json.dumps(obj)
        lines.append(line)
        print(line, flush=True)
    try:
        env = lmqtt_env(args.lmqtt_src, base) if args.lmqtt_src else None
    except TargetError as e:
        ap.error(str(e))

    def _term(*_):                 # `timeout` / kill: the bed's finally blocks stop and remove everything
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _term)
    try:
        code, summary = run_round(kinds, faults, base, RoundOptions(qos=qos, paths=paths, rate=args.rate,
                                                                   interval=args.interval, drain=args.drain,
                                                                   seed=args.seed),
                                  FleetOptions(election_timeout=args.election_timeout_s, flush_mode=args.flush_mode,
                                               lmqtt_env=env),
                                  emit=emit, log=lambda m: print(m, file=sys.stderr, flush=True),
                                  max_seconds=args.max_seconds)
    finally:
        if out:
            (out / "partitions.jsonl").write_text("\n".join(lines) + "\n")
        if not args.keep and not args.workdir:
            shutil.rmtree(base, ignore_errors=True)
        elif args.keep:
            print(f"work directory kept: {base}", file=sys.stderr)
    for line in summary.get("failures", []):
        print(f"partitions: {line}", file=sys.stderr)
    if summary.get("error"):
        print(f"partitions: {summary['error']}", file=sys.stderr)
    return code


COLS = ("target", "path", "QoS", "faults (kill / stop / diskfull)", "sent", "acked", "received", "lost",
        "duplicated", "reordered", "never sent", "unacked delivered")


def _faults_cell(res: dict) -> str:
    by = res.get("faults_by_kind", {})
    return " / ".join(str(by.get(k, "–")) for k in KINDS)


def table(results: list[dict]) -> str:
    """The verdict table of some results (Markdown)."""
    lines = ["| " + " | ".join(COLS) + " |", "|" + " --- |" * len(COLS)]
    for res in results:
        if res.get("error"):
            lines.append(f"| {res['target']} | error: {res['error'].splitlines()[0]} |" + " |" * (len(COLS) - 2))
            continue
        for r in res.get("rows", []):
            reo = "n/a" if r["reordered"] is None else r["reordered"]
            lines.append(f"| {res['target']} | {r['path']} | {r['qos']} | {_faults_cell(res)} | {r['sent']} | "
                         f"{r['acked']} | {r['received']} / {r['expected']} | {r['lost']} | {r['duplicated']} | "
                         f"{reo} | {r['never_sent']} | {r['unacked_delivered']} |")
    return "\n".join(lines)


def summary(out: Path, command: str) -> str:
    """summary.md of every <target>.json in `out` (runs of several commands into one folder add up)."""
    results = []
    for t in ALL:
        p = out / f"{t}.json"
        if p.exists():
            results.append(json.loads(p.read_text()))
    parts = ["# lmqtt bench chaos", "", f"Last command: `{command}`", "",
             "`received` is counted per receiver against `expected` = acknowledged × receivers of the "
             "stream (two MQTT subscribers per QoS, one SDK consumer group, one POP group); "
             "`lost` = acknowledged and never delivered to a receiver; `unacked delivered` = never "
             "acknowledged to its publisher but delivered (allowed).", "", table(results), ""]
    for res in results:
        parts.append(f"## {res['target']}: {res.get('version', '')}")
        parts.append("")
        if res.get("error"):
            parts += ["```", res["error"], "```", ""]
            continue
        parts.append(f"{sum(res.get('faults_by_kind', {}).values())} faults in {res.get('duration_s')} s "
                     f"({res.get('time_utc', '')} UTC), kinds {', '.join(res.get('kinds', []))}"
                     + (f"; skipped: {res['skipped_kinds']}" if res.get("skipped_kinds") else "")
                     + f"; drain {res.get('drain_s')} s, {res.get('unacked_at_end')} message(s) never acknowledged.")
        if res.get("unexpected_exits"):
            parts.append(f"Processes that died without a kill of ours: "
                         f"{', '.join(e['victim'] + ' (status ' + str(e['status']) + ')' for e in res['unexpected_exits'])}.")
        for line in res.get("failures", []):
            parts.append(f"- **{line}**")
        for r in res.get("rows", []):
            notes = []
            if r.get("duplicated_after"):
                notes.append("duplicates after " + ", ".join(f"{k} {n}" for k, n in sorted(r["duplicated_after"].items())))
            if r.get("stored_twice") is not None and r["duplicated"]:
                notes.append(f"{r['stored_twice']} message(s) stored twice (publish side: a duplicate at every "
                             f"receiver), the other duplicates delivered again (delivery side)")
            if notes:
                parts.append(f"- {r['path']} QoS {r['qos']}: " + "; ".join(notes))
            for kind, ex in r.get("examples", {}).items():
                parts.append(f"- {r['path']} QoS {r['qos']} {kind}, first examples: `{json.dumps(ex[:3])}`")
        parts.append("")
    return "\n".join(parts)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
