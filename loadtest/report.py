"""Turn `lmqtt bench compare` results (JSON lines) into a Markdown report and latency plots.

Kept apart from the runner so a report can be rebuilt from a kept ``results.jsonl`` without
re-running anything (``lmqtt bench report DIR``), e.g. after a broker was re-run.

Tables: one per scenario, rows = metric, columns = broker (median over repetitions, with the
min–max spread when there were several), then lmqtt/peer ratios. A "Targets" table checks the
project's performance goals (ratios from the same run) and says by how much a missed one is missed.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from .histogram import Histogram
from .saturation import verdict

# (label, key path, unit scale, format, higher_is_better)
TRAFFIC_METRICS = [
    ("delivered msg/s", ("delivered_per_s",), 1, "{:,.0f}", True),
    ("published msg/s", ("published_per_s",), 1, "{:,.0f}", True),
    ("latency p50 (ms)", ("latency_us", "p50"), 1e3, "{:,.2f}", False),
    ("latency p90 (ms)", ("latency_us", "p90"), 1e3, "{:,.2f}", False),
    ("latency p99 (ms)", ("latency_us", "p99"), 1e3, "{:,.2f}", False),
    ("latency p99.9 (ms)", ("latency_us", "p99.9"), 1e3, "{:,.2f}", False),
    ("latency max (ms)", ("latency_us", "max"), 1e3, "{:,.2f}", False),
    ("sent", ("sent",), 1, "{:,.0f}", None),
    ("lost", ("lost",), 1, "{:,.0f}", False),
    ("duplicated", ("duplicated",), 1, "{:,.0f}", False),
    ("out of order", ("out_of_order",), 1, "{:,.0f}", False),
    ("broker CPU (cores)", ("broker_cpu_cores",), 1, "{:.2f}", None),
    ("generator CPU (cores)", ("gen_cpu_cores",), 1, "{:.2f}", None),
    ("generator CPU, busiest process (cores)", ("gen_cpu_cores_max_proc",), 1, "{:.2f}", None),
    ("broker CPU per delivered msg (µs)", ("broker_cpu_us_per_msg",), 1, "{:,.1f}", False),
    ("generator CPU per delivered msg (µs)", ("gen_cpu_us_per_msg",), 1, "{:,.1f}", None),
    # fixed rate: reads the paced worker timed by the kernel's arrival time (loadtest/paced.py)
    ("reads timed at kernel arrival (paced generator)", ("gen_rx_kernel_reads",), 1, "{:,.0f}", None),
    ("broker RSS after (MiB)", ("broker_rss_bytes",), 2**20, "{:,.1f}", False),
    ("store reads per published msg (remote gateways)", ("store_reads_per_published_msg",), 1, "{:.2f}", False),
    ("connections", ("connect", "connected"), 1, "{:,.0f}", None),
]
CONN_METRICS = [
    ("connections", ("connect", "connected"), 1, "{:,.0f}", True),
    ("failed", ("connect", "failed"), 1, "{:,.0f}", False),
    ("connect rate (conn/s)", ("connect", "per_s"), 1, "{:,.0f}", True),
    ("RSS per idle connection (KiB)", ("rss_per_conn_bytes",), 1024, "{:,.2f}", False),
    ("broker RSS (MiB)", ("broker_rss_bytes",), 2**20, "{:,.1f}", False),
    ("broker CPU while idle (% of a core)", ("idle_broker_cpu_cores",), 0.01, "{:,.2f}", False),
]
STATE_METRICS = [
    ("messages", ("sent",), 1, "{:,.0f}", None),
    ("time to receive all (ms)", ("elapsed_s",), 1e-3, "{:,.1f}", False),
    ("delivered msg/s", ("delivered_per_s",), 1, "{:,.0f}", True),
    ("lost", ("lost",), 1, "{:,.0f}", False),
    ("duplicated", ("duplicated",), 1, "{:,.0f}", False),
    ("idle client's PINGRESP p99 meanwhile (ms)", ("idle_ping_p99_ms",), 1, "{:,.1f}", False),
    ("idle client's PINGRESP max meanwhile (ms)", ("idle_ping_max_ms",), 1, "{:,.1f}", False),
    ("broker CPU (cores)", ("broker_cpu_cores",), 1, "{:.2f}", None),
]
MILLION_METRICS = [
    ("connections asked for", ("connections_requested",), 1, "{:,.0f}", None),
    ("connections the broker's fd limits allow", ("connections_target",), 1, "{:,.0f}", True),
    ("connections held", ("connected",), 1, "{:,.0f}", True),
    ("still open at the end", ("still_open",), 1, "{:,.0f}", True),
    ("time to connect them all (s)", ("connect_s",), 1, "{:,.1f}", False),
    ("connect rate (conn/s)", ("connect_per_s",), 1, "{:,.0f}", True),
    ("RSS per idle connection (KiB)", ("rss_per_conn_bytes",), 1024, "{:,.2f}", False),
    ("kernel slab growth per connection, both ends, system-wide (KiB)", ("kernel_slab_bytes_per_conn",), 1024,
     "{:,.2f}", False),
    ("broker RSS (MiB)", ("broker_rss_bytes",), 2**20, "{:,.1f}", False),
    ("idle client's PINGRESP p99 while held (ms)", ("idle_ping_p99_ms",), 1, "{:,.2f}", False),
    ("idle client's PINGRESP max while held (ms)", ("idle_ping_max_ms",), 1, "{:,.2f}", False),
    ("PINGRESP p99 on a sample of the held connections (ms)", ("held_ping_p99_ms",), 1, "{:,.2f}", False),
    ("broker CPU while idle (% of a core)", ("idle_broker_cpu_cores",), 0.01, "{:,.2f}", False),
]
SESSIONS_METRICS = [
    ("persistent sessions", ("sessions",), 1, "{:,.0f}", None),
    ("new sessions/s (CONNECT + SUBSCRIBE)", ("new_per_s",), 1, "{:,.0f}", True),
    ("resumed sessions/s (CONNECT + SUBSCRIBE)", ("resume_per_s",), 1, "{:,.0f}", True),
    ("resumed with session present", ("session_present",), 1, "{:,.0f}", True),
    ("idle client's PINGRESP p99 meanwhile (ms)", ("latency_us", "p99"), 1e3, "{:,.1f}", False),
    ("idle client's PINGRESP max meanwhile (ms)", ("latency_us", "max"), 1e3, "{:,.1f}", False),
    ("broker CPU (cores)", ("broker_cpu_cores",), 1, "{:.2f}", None),
]

SCENARIO_TITLES = {
    "fanout": "Fan-out: 1 publisher → N subscribers of one topic",
    "fanin": "Fan-in: N publishers on distinct topics → 1 wildcard subscriber",
    "pairs": "Pairs: N publisher/subscriber pairs on distinct topics",
    "latency": "Latency: pairs at a fixed total rate",
    "conn": "Idle connections: connect rate and broker memory",
    "retained": "Retained: wildcard subscribe over M retained topics",
    "persistent": "Persistent session: offline QoS 1 backlog delivered on reconnect",
    "replay": "Replay: stored messages of a never-subscribed filter ($replay/, lmqtt only)",
    "sessions": "Reconnect storm: persistent sessions connecting and subscribing, 200 at a time",
    "million": "A million idle connections (CONNECT + SUBSCRIBE each): held, memory, PINGRESP",
}


STATE_SCENARIOS = ("retained", "persistent", "replay")


def metrics_for(scenario: str):
    if scenario == "conn":
        return CONN_METRICS
    if scenario == "sessions":
        return SESSIONS_METRICS
    if scenario == "million":
        return MILLION_METRICS
    if scenario in ("retained", "persistent", "replay"):
        return STATE_METRICS
    return TRAFFIC_METRICS


def _get(d: dict, path: tuple[str, ...]):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def load(path: Path) -> list[dict]:
    out = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line:
            out.append(json.loads(line))
    return out


def _median(vals: list[float]) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def _cell(vals: list[float | None], scale: float, fmt: str) -> str:
    vals = [v / scale for v in vals if v is not None]
    if not vals:
        return "–"
    med = statistics.median(vals)
    if len(vals) == 1:
        return fmt.format(med)
    lo, hi = min(vals), max(vals)
    if fmt.format(lo) == fmt.format(hi):
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(lo)}–{fmt.format(hi)})"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "–"
    return f"{a / b:.2f}×"


def group(results: list[dict]) -> dict[str, dict[str, list[dict]]]:
    """scenario -> broker -> list of successful results (one per repetition)."""
    g: dict[str, dict[str, list[dict]]] = {}
    for r in results:
        if r.get("available") is False or r.get("error"):
            continue
        g.setdefault(r["scenario"], {}).setdefault(r["broker"], []).append(r)
    return g


def unavailable(results: list[dict]) -> dict[str, str]:
    out = {}
    for r in results:
        if r.get("available") is False:
            out.setdefault(r["broker"], r.get("reason", "not available"))
    return out


def errors(results: list[dict]) -> list[dict]:
    return [r for r in results if r.get("error")]


def scenario_table(scenario: str, by_broker: dict[str, list[dict]], brokers: list[str]) -> str:
    cols = [b for b in brokers if b in by_broker]
    ours = [b for b in cols if b.startswith("lmqtt")]
    peers = [b for b in cols if not b.startswith("lmqtt")]
    pairs = [(o, p) for o in ours for p in peers]
    head = ["metric"] + cols + [f"{o}/{p}" for o, p in pairs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, path, scale, fmt, _hib in metrics_for(scenario):
        vals = {b: [_get(r, path) for r in by_broker[b]] for b in cols}
        if all(all(v is None for v in vs) for vs in vals.values()):
            continue
        row = [label] + [_cell(vals[b], scale, fmt) for b in cols]
        for o, p in pairs:
            row.append(_ratio(_median(vals[o]), _median(vals[p])))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def process_breakdown(by_broker: dict[str, list[dict]], brokers: list[str]) -> list[str]:
    """Lines giving, for a multi-process broker, the CPU per delivered message of each process
    (median over reps): which process bounds lmqtt-workers / lmqtt-fleet."""
    out = []
    for b in brokers:
        runs = [r.get("broker_cpu_us_per_msg_by_process") for r in by_broker.get(b, [])]
        runs = [r for r in runs if r]
        if not runs:
            continue
        names = sorted({k for r in runs for k in r})
        parts = []
        for k in names:
            m = _median([r.get(k) for r in runs])
            if m is not None and m >= 0.05:
                parts.append(f"{k} {m:,.1f}")
        out.append(f"- {b}: CPU µs per delivered message by process: " + ", ".join(parts))
    return out


def params_line(by_broker: dict[str, list[dict]]) -> str:
    for rs in by_broker.values():
        p = rs[0].get("params", {})
        s = p.get("scenario")
        keys = {"conn": ["connections", "procs"],
                "retained": ["topics", "qos", "size"],
                "persistent": ["backlog", "qos", "size"],
                "replay": ["backlog", "qos", "size"],
                "sessions": ["connections", "qos"],
                "million": ["connections", "hold"]}.get(
            s, ["publishers", "subscribers", "qos", "size", "rate", "duration", "window", "procs"])
        bits = []
        for k in keys:
            v = p.get(k)
            if k == "rate" and v is None:
                bits.append("rate=flat out (closed loop)")
            elif v is not None:
                bits.append(f"{k}={v}")
        return ", ".join(bits) + f", MQTT {'3.1.1' if p.get('version') == 4 else '5'}"
    return ""


# the performance targets: (label, scenario, metric path, comparison)
TARGETS = [  # label, scenario, metric, peer, op, bound
    ("fan-out 1→1,000 QoS 0 delivered msg/s ≥ 0.5× Mosquitto", "fanout", ("delivered_per_s",), "mosquitto", ">=", 0.5),
    ("fan-in 1,000→1 QoS 1 delivered msg/s ≥ 0.3× Mosquitto", "fanin", ("delivered_per_s",), "mosquitto", ">=", 0.3),
    ("fan-in 1,000→1 QoS 1 delivered msg/s ≥ 10× amqtt", "fanin", ("delivered_per_s",), "amqtt", ">=", 10.0),
    ("pairs QoS 1 delivered msg/s ≥ 0.3× Mosquitto", "pairs", ("delivered_per_s",), "mosquitto", ">=", 0.3),
    ("pairs QoS 1 delivered msg/s ≥ 10× amqtt", "pairs", ("delivered_per_s",), "amqtt", ">=", 10.0),
    # the latency targets: p99 and broker CPU per message at 5,000 msg/s (the paced generator, loadtest/paced.py)
    ("p99 latency at 5,000 msg/s QoS 1 ≤ 1.2× Mosquitto", "latency", ("latency_us", "p99"), "mosquitto", "<=", 1.2),
    ("broker CPU per message at 5,000 msg/s QoS 1 ≤ 1.5× Mosquitto", "latency", ("broker_cpu_us_per_msg",),
     "mosquitto", "<=", 1.5),
    ("memory per idle connection ≤ 16 KiB at 10,000 connections", "conn", ("rss_per_conn_bytes",), None, "<=", 16 * 1024),
    # the multi-process modes (lmqtt-workers, lmqtt-fleet): (..., which lmqtt broker)
    ("lmqtt-workers fan-in 1,000→1 QoS 1 delivered msg/s ≥ 1× Mosquitto", "fanin", ("delivered_per_s",),
     "mosquitto", ">=", 1.0, "lmqtt-workers"),
    ("lmqtt-workers pairs QoS 1 delivered msg/s ≥ 1× Mosquitto", "pairs", ("delivered_per_s",),
     "mosquitto", ">=", 1.0, "lmqtt-workers"),
    ("lmqtt-fleet cross-gateway p99 at 5,000 msg/s QoS 1 ≤ 10 ms", "latency", ("latency_us", "p99"),
     None, "<=", 10_000.0, "lmqtt-fleet"),
]


def targets_table(g: dict[str, dict[str, list[dict]]]) -> str:
    lines = ["| target | lmqtt | reference | ratio / value | verdict |", "|---|---|---|---|---|"]
    present = {b for by in g.values() for b in by}
    for label, scen, path, peer, op, bound, *which in TARGETS:
        ours = which[0] if which else "lmqtt"
        if ours != "lmqtt" and ours not in present:
            continue                      # a mode not in this run: no row
        lm = _median([_get(r, path) for r in g.get(scen, {}).get(ours, [])])
        pv = None
        if peer is None:
            val, ref = lm, "–"
            if path[0] == "latency_us":
                shown = "–" if lm is None else f"{lm / 1e3:,.2f} ms (bound {bound / 1e3:g} ms)"
            else:
                shown = "–" if lm is None else f"{lm / 1024:,.2f} KiB (bound 16 KiB)"
        else:
            pv = _median([_get(r, path) for r in g.get(scen, {}).get(peer, [])])
            ref = "–" if pv is None else f"{peer} {pv:,.0f}"
            val = None if lm is None or not pv else lm / pv
            shown = "–" if val is None else f"{val:.2f}×"
        if val is None:
            verdict = "not measured (lmqtt or peer result missing)"
        else:
            ok = val >= bound if op == ">=" else val <= bound
            if ok:
                verdict = "met"
            else:
                by = (bound / val) if op == ">=" and val else (val / bound)
                verdict = f"missed by {by:.1f}×"
        if lm is None:
            lm_s = "–"
        elif path[0] == "latency_us":
            lm_s = f"{lm / 1e3:,.2f} ms"
            ref = ref if pv is None else f"{peer} {pv / 1e3:,.2f} ms"
        elif path[0] == "rss_per_conn_bytes":
            lm_s = f"{lm / 1024:,.2f} KiB"
        elif path[0] == "broker_cpu_us_per_msg":
            lm_s = f"{lm:,.1f} µs/msg"
            ref = ref if pv is None else f"{peer} {pv:,.1f} µs/msg"
        else:
            lm_s = f"{lm:,.0f} msg/s"
            ref = ref if peer is None or pv is None else f"{peer} {pv:,.0f} msg/s"
        if ours != "lmqtt" and lm is not None:
            lm_s = f"{ours}: {lm_s}"
        lines.append(f"| {label} | {lm_s} | {ref} | {shown} | {verdict} |")
    return "\n".join(lines)


def plot_latency(g: dict[str, dict[str, list[dict]]], out_dir: Path, brokers: list[str]) -> list[Path]:
    """One PNG per scenario: latency CDF (all repetitions merged), one line per broker."""
    try:
        import matplotlib  # optional: the bench extra
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional: the bench extra
    except ImportError:
        print("report: matplotlib not installed (pip install 'lmqtt[bench]'); no plots", file=sys.stderr)
        return []
    paths = []
    for scen, by_broker in g.items():
        if scen == "conn":
            continue
        fig, ax = plt.subplots(figsize=(7, 4.2))
        drew = False
        for b in brokers:
            rs = by_broker.get(b)
            if not rs:
                continue
            h = Histogram()
            for r in rs:
                if r.get("histogram"):
                    h.merge(Histogram.from_dict(r["histogram"]))
            if not h.total:
                continue
            pts = h.cdf_points()
            xs = [max(v, 1) / 1e6 for v, _ in pts]  # ns -> ms
            ys = [100 * (1 - f) if f < 1 else 100 / (h.total * 10) for _, f in pts]
            ax.plot(xs, ys, label=f"{b} (p99 {h.percentile(99) / 1e6:.2f} ms)", drawstyle="steps-post")
            drew = True
        if not drew:
            plt.close(fig)
            continue
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("publish → deliver latency (ms)")
        ax.set_ylabel("% of messages slower (log)")
        ax.set_title(SCENARIO_TITLES.get(scen, scen), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / f"latency_{scen}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def render(results: list[dict], out_dir: Path, meta: dict | None = None) -> str:
    meta = meta or {}
    brokers = meta.get("brokers") or sorted({r["broker"] for r in results})
    g = group(results)
    plots = plot_latency(g, out_dir, brokers)
    md = ["# lmqtt bench compare", ""]
    if meta:
        md += [f"- command: `{meta.get('command', '')}`",
               f"- date: {meta.get('date', '')}",
               f"- machine: {meta.get('machine', '')}",
               f"- brokers: {', '.join(meta.get('versions', {}).get(b, b) for b in brokers)}",
               f"- repetitions: {meta.get('repeat', 1)} (cells: median (min–max))", ""]
    na = unavailable(results)
    for b, why in na.items():
        md.append(f"- **{b}: not available** — {why.splitlines()[0] if why else ''}")
    errs = errors(results)
    for e in errs:
        md.append(f"- error: {e['broker']} / {e['scenario']} (rep {e.get('rep')}): {e['error'].splitlines()[0]}")
    if na or errs:
        md.append("")
    for scen in meta.get("scenarios") or list(g):
        if scen not in g:
            continue
        md += [f"## {SCENARIO_TITLES.get(scen, scen)} (`{scen}`)", "", params_line(g[scen]), "",
               scenario_table(scen, g[scen], brokers), ""]
        by_proc = process_breakdown(g[scen], brokers)
        if by_proc:
            md += by_proc + [""]
        if scen not in ("conn", "sessions", "million", *STATE_SCENARIOS):
            md += ["Who was saturated (`loadtest.saturation.verdict`):", ""]
            for b in brokers:
                for r in g[scen].get(b, []):
                    md.append(f"- {b} rep {r.get('rep', 1)}: {verdict(r)}")
            md.append("")
        png = out_dir / f"latency_{scen}.png"
        if png in plots:
            md += [f"![latency {scen}]({png.name})", ""]
    md += ["## Targets (lmqtt, ratios from this run)", "", targets_table(g), ""]
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: lmqtt bench report DIR  (reads DIR/results.jsonl and meta.json of a `bench compare` "
              "run, writes DIR/report.md and its plots)", file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    d = Path(argv[0])
    meta_p = d / "meta.json"
    meta = json.loads(meta_p.read_text()) if meta_p.exists() else {}
    (d / "report.md").write_text(render(load(d / "results.jsonl"), d, meta))
    print(d / "report.md")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
