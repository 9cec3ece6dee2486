"""`python3 benchmarks/ab.py`: two versions of lmqtt measured in one run, before against after.

A developer's tool, run from a checkout (it unpacks git revisions of the repository): it is not
installed with the package, which has no git history to unpack; the benchmarks it runs are the
installed `lmqtt bench store`, `bench lightqueue` and `bench compare`.

A change that should not cost speed (a restructuring, a new seam) is checked by running the same
benchmarks on the code before and after it, alternately, on the same machine in the same hour:
one run of each tells little on a shared 2-core machine, where the same code moves 10–30 %
between runs. Benches: `store`, `lightqueue`, `sdk` (each tree's own `lmqtt bench ...`) and
`compare`. Each round runs every benchmark on both trees, in alternating order (before first in
odd rounds, after first in even ones) so a drift of the machine does not favour one side; the
report gives each figure's median with its range, the after/before ratio of the medians and the
CPU per message, so a ratio can be read against the spread.

The trees: a git revision of the repository (`--repo`, default the one holding the current
directory), unpacked with `git archive` and its C modules built in place, or a directory holding a
source tree. `store` and `lightqueue` run each tree's own `lmqtt bench store` / `bench lightqueue`
in a subprocess that imports that tree (checked before the first round: the run stops if the
tree's `store` package is not the one imported). `compare` runs this installation's `lmqtt bench
compare` (one load generator for both sides) with `--lmqtt-src TREE`, so its Mosquitto rows show
how much the machine alone moved between the two sides' runs.

Outputs under `--out`: each run's raw JSON lines (`<side>-<bench>-<round>.jsonl`, compare's own
folders), `summary.json` and `report.md`. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lmqtt.loadtest.brokers import BrokerUnavailable, source_path

BENCHES = ("store", "lightqueue", "compare", "sdk")
DEFAULT_ARGS = {
    "store": "--duration 5 --sizes 100 --no-baseline --modes async,sync",
    "lightqueue": "--duration 5 --cases publish",
    "compare": "--brokers lmqtt,mosquitto --scenarios fanin,pairs --duration 10 --repeat 1 --quiet",
    "sdk": "--duration 3 --sizes 100 --cases single,batch,autobatch,aio-autobatch,pull,group,pop",
}
RUN_TIMEOUT_S = 1800.0       # one benchmark run of one tree; a hung run is stopped and reported


def _log(msg: str) -> None:
    print(f"[ab] {msg}", file=sys.stderr, flush=True)


@dataclass
class Tree:
    """One side of the comparison: where its source is and how to run it."""
    label: str          # "before" / "after"
    spec: str           # what the user gave: a revision or a directory
    path: Path          # the source tree
    rev: str            # the commit (short) or the directory's name

    def env_and_module(self, work: Path) -> tuple[dict[str, str], str]:
        pythonpath, module = source_path(str(self.path), work / f"ns-{self.label}")
        env = dict(os.environ, PYTHONPATH=pythonpath)
        env.pop("LMQTT_PURE_PYTHON", None)
        return env, module


def _git(repo: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, **kw)


def prepare_tree(label: str, spec: str, repo: Path, work: Path) -> Tree:
    """A directory is used as it is; anything else is a git revision of `repo`, unpacked into
    `work` and its C modules built in place (`setup.py build_ext --inplace`), as an install would."""
    d = Path(spec)
    if d.is_dir():
        return Tree(label, spec, d.resolve(), d.resolve().name)
    try:
        rev = _git(repo, "rev-parse", "--short", f"{spec}^{{commit}}", text=True).stdout.strip()
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"ab.py: --{label} {spec!r} is neither a directory nor a revision of "
                         f"{repo}: {e.stderr.strip() if isinstance(e.stderr, str) else e.stderr}")
    dest = work / f"tree-{label}-{rev}"
    if not dest.exists():
        _log(f"{label}: unpacking {spec} ({rev}) and building its C modules")
        dest.mkdir(parents=True)
        archive = work / f"{rev}.tar"
        with open(archive, "wb") as f:
            subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", rev], stdout=f, check=True)
        with tarfile.open(archive) as t:
            t.extractall(dest, filter="data")
        archive.unlink()
        if (dest / "setup.py").exists():
            r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=dest,
                               capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
            if r.returncode != 0:
                raise SystemExit(f"ab.py: building {rev}'s C modules failed:\n{r.stderr[-2000:]}")
    return Tree(label, spec, dest, rev)


def check_imports(tree: Tree, work: Path) -> str:
    """The file the tree's subprocess really imports its store from: an A/B that measured the
    installed package twice would say nothing, so a tree shadowed by an installed lmqtt stops the run."""
    env, module = tree.env_and_module(work)
    pkg = "lmqtt." if module.startswith("lmqtt.") else ""
    r = subprocess.run([sys.executable, "-c", f"import {pkg}store.commitlog as c; print(c.__file__)"],
                       env=env, cwd=work, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"ab.py: {tree.label} tree {tree.path} does not import: {r.stderr[-1500:]}")
    found = Path(r.stdout.strip().splitlines()[-1]).resolve()
    if not found.is_relative_to(tree.path):
        raise SystemExit(f"ab.py: {tree.label}: the subprocess imported {found}, not the tree "
                         f"{tree.path} (an installed lmqtt shadows it)")
    return str(found)


def run_bench(tree: Tree, bench: str, args: str, rnd: int, out: Path, work: Path) -> Path:
    raw = out / f"{tree.label}-{bench}-{rnd}.jsonl"
    if bench == "compare":
        cdir = out / f"{tree.label}-compare-{rnd}"
        argv = [sys.executable, "-m", "lmqtt.gateway.cli", "bench", "compare", *shlex.split(args),
                "--lmqtt-src", str(tree.path), "--out", str(cdir)]
        env, cwd = dict(os.environ), None
    else:
        env, module = tree.env_and_module(work)
        argv = [sys.executable, "-m", module, "bench", bench, *shlex.split(args)]
        cwd = work
    _log(f"round {rnd}: {tree.label} ({tree.rev}) bench {bench}")
    t0 = time.monotonic()
    with open(raw, "w") as f:
        try:
            r = subprocess.run(argv, env=env, cwd=cwd, stdout=f, stderr=subprocess.PIPE, text=True,
                               timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"ab.py: {tree.label} bench {bench} ran past {RUN_TIMEOUT_S:.0f} s; stopped")
    if r.returncode != 0:
        raise SystemExit(f"ab.py: {tree.label} ({tree.rev}) bench {bench} failed "
                         f"(exit {r.returncode}):\n{r.stderr[-2000:]}")
    _log(f"round {rnd}: {tree.label} bench {bench} done in {time.monotonic() - t0:.0f} s")
    return raw


# ------------------------------------------------------------------------------------ reading
def figures(bench: str, line: dict) -> tuple[str, float, float | None] | None:
    """(row name, throughput, CPU µs per message) of one result line, or None for lines that are
    not a measured case (baselines, errors, brokers not available)."""
    if bench == "store" and "msgs_per_s" in line and not line["mode"].startswith("baseline"):
        who = f"{line['writers']} writers" if line.get("writers", 1) > 1 else f"batch {line['batch']}"
        return (f"store {line['mode']} {line['size']} B, {who}", line["msgs_per_s"], line.get("cpu_us_per_msg"))
    if bench == "lightqueue" and "records_per_s" in line:
        cpu = line.get("cpu_us_per_record")
        cpu = cpu.get("process") if isinstance(cpu, dict) else cpu
        name = f"light queues {line['case']}" + (f", fan-out {line['fanout']}" if "fanout" in line else "")
        return (name, line["records_per_s"], cpu)
    if bench == "sdk" and "msgs_per_s" in line and not str(line.get("case", "")).startswith(("redis", "vs-")):
        # the client's CPU per message: what the SDK itself spends (the server's is the store's)
        return (f"SDK {line['case']} {line['size']} B", line["msgs_per_s"], line.get("client_cpu_us_per_msg"))
    if bench == "compare" and "delivered_per_s" in line and not line.get("error"):
        return (f"MQTT {line['scenario']} ({line['broker']})", line["delivered_per_s"],
                line.get("broker_cpu_us_per_msg"))
    return None


def read_run(bench: str, raw: Path) -> tuple[dict[str, tuple[float, float | None]], set[str]]:
    """The run's figures by row, and the record encoders its lines name ("c" or "python"): one side
    measured without its C modules would make the ratio a comparison of languages."""
    out, encs = {}, set()
    for text in raw.read_text().splitlines():
        text = text.strip()
        if not text.startswith("{"):
            continue
        try:
            line = json.loads(text)
            f = figures(bench, line)
        except (ValueError, KeyError, TypeError):
            continue
        if f is not None:
            out[f[0]] = (f[1], f[2])
            if isinstance(line.get("encoder"), str):
                encs.add(line["encoder"])
    return out, encs


def encoders(runs: list[dict], side: str) -> set[str]:
    return set().union(*(r["encoders"] for r in runs if r["side"] == side))


def summarize(runs: list[dict]) -> list[dict]:
    """runs: {"side", "bench", "round", "figures": {row: (rate, cpu)}} -> one row per figure."""
    rows: dict[str, dict] = {}
    for r in runs:
        for name, (rate, cpu) in r["figures"].items():
            row = rows.setdefault(name, {"row": name, "bench": r["bench"], "before": [], "after": [],
                                         "cpu_before": [], "cpu_after": []})
            row[r["side"]].append(rate)
            if cpu is not None:
                row["cpu_" + r["side"]].append(cpu)
    out = []
    for row in rows.values():
        b, a = row["before"], row["after"]
        med = {k: statistics.median(row[k]) if row[k] else None for k in ("before", "after", "cpu_before", "cpu_after")}
        ratio = med["after"] / med["before"] if med["before"] and med["after"] is not None else None
        out.append({**row, "median_before": med["before"], "median_after": med["after"],
                    "ratio": round(ratio, 3) if ratio is not None else None,
                    "cpu_median_before": med["cpu_before"], "cpu_median_after": med["cpu_after"],
                    "range_before": [min(b), max(b)] if b else None, "range_after": [min(a), max(a)] if a else None})
    return out


def _n(x: float | None) -> str:
    return "–" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def report_md(rows: list[dict], trees: dict[str, Tree], rounds: int, argv: list[str], loads: list[float]) -> str:
    lines = [f"# ab.py: {trees['before'].rev} (before) vs {trees['after'].rev} (after)", "",
             f"Command: `python3 benchmarks/ab.py {' '.join(shlex.quote(x) for x in argv)}`", "",
             f"{rounds} round(s), sides alternated; median (min–max) of the rounds. Throughput in "
             f"messages (store, MQTT deliveries) or records (light queues) per second; CPU in µs per "
             f"message of the process measured (the broker for MQTT rows). 1-minute load average at "
             f"the start of each run: {', '.join(f'{x:.2f}' for x in loads)}.", "",
             "| benchmark | before | after | after/before | CPU µs/msg before → after |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        rb = f"{_n(r['median_before'])} ({_n(r['range_before'][0])}–{_n(r['range_before'][1])})" if r["before"] else "–"
        ra = f"{_n(r['median_after'])} ({_n(r['range_after'][0])}–{_n(r['range_after'][1])})" if r["after"] else "–"
        ratio = f"{r['ratio']:.2f}×" if r["ratio"] is not None else "–"
        lines.append(f"| {r['row']} | {rb} | {ra} | {ratio} | {_n(r['cpu_median_before'])} → {_n(r['cpu_median_after'])} |")
    if any("mosquitto" in r["row"] for r in rows):
        lines += ["", "The Mosquitto rows ran the same Mosquitto in both sides' runs: their after/before "
                      "is the machine's own drift, the band an lmqtt ratio is read against."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 benchmarks/ab.py", description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="git revision or source directory of the code before")
    ap.add_argument("--after", default="HEAD", help="git revision or source directory of the code after (default HEAD)")
    ap.add_argument("--repo", default=None, help="git repository the revisions are of (default: the current one)")
    ap.add_argument("--benches", default="store,lightqueue,compare", help=f"comma list of {', '.join(BENCHES)}")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each running every bench on both sides (default 3)")
    for b in BENCHES:
        ap.add_argument(f"--{b}-args", default=DEFAULT_ARGS[b], help=f"arguments of `lmqtt bench {b}` (default: %(default)s)")
    ap.add_argument("--out", required=True, help="directory for the raw runs, summary.json and report.md")
    ap.add_argument("--work-dir", default=None, help="where trees and data go (default: a temp dir, removed after)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    benches = [b for b in a.benches.split(",") if b]
    unknown = [b for b in benches if b not in BENCHES]
    if unknown or not benches:
        print(f"ab.py: unknown bench(es) {unknown}; choose from {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    if a.rounds < 1:
        print("ab.py: --rounds must be at least 1", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    own_work = a.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="lmqtt-ab-") if own_work else a.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        repo = Path(a.repo or _git(Path.cwd(), "rev-parse", "--show-toplevel", text=True).stdout.strip()) \
            if not (Path(a.before).is_dir() and Path(a.after).is_dir()) else Path.cwd()
    except (subprocess.CalledProcessError, FileNotFoundError):
        print("ab.py: revisions need a git repository: run it inside one or pass --repo", file=sys.stderr)
        return 2
    try:
        trees = {side: prepare_tree(side, spec, repo, work) for side, spec in (("before", a.before), ("after", a.after))}
        imports = {side: check_imports(t, work) for side, t in trees.items()}
        for side, found in imports.items():
            _log(f"{side}: {trees[side].rev} imports {found}")
        runs, loads = [], []
        for rnd in range(1, a.rounds + 1):
            order = ("before", "after") if rnd % 2 else ("after", "before")
            for bench in benches:
                for side in order:
                    loads.append(os.getloadavg()[0])
                    raw = run_bench(trees[side], bench, getattr(a, f"{bench}_args"), rnd, out, work)
                    if bench == "compare":
                        raw = out / f"{side}-compare-{rnd}" / "results.jsonl"
                    figs, encs = read_run(bench, raw)
                    runs.append({"side": side, "bench": bench, "round": rnd, "figures": figs, "encoders": encs})
        rows = summarize(runs)
        meta = {"argv": argv, "trees": {s: {"spec": t.spec, "rev": t.rev, "imports": imports[s],
                               "encoders": sorted(encoders(runs, s))} for s, t in trees.items()},
                "rounds": a.rounds, "load_avg_1m": loads, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (out / "summary.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        md = report_md(rows, trees, a.rounds, argv, loads)
        if encoders(runs, "before") != encoders(runs, "after"):
            md += (f"\n**The sides ran different record encoders** (before {sorted(encoders(runs, 'before'))}, "
                   f"after {sorted(encoders(runs, 'after'))}): a C module did not build on one side.\n")
        (out / "report.md").write_text(md)
        print(md)
        return 0
    except BrokerUnavailable as e:
        print(f"ab.py: {e}", file=sys.stderr)
        return 2
    finally:
        if own_work:
            subprocess.run(["rm", "-rf", str(work)], check=False)


if __name__ == "__main__":
    raise SystemExit(main())
