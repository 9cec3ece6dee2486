"""`lmqtt bench compare`: the same scenarios against lmqtt, Mosquitto and amqtt, side by side.

Each (repetition, broker, scenario) gets a *fresh* broker process on a free loopback port,
started by its own command (``brokers.start``) and stopped by PID afterwards, so one scenario's
leftovers (queues, memory high-water marks, retained messages) never colour the next. The
scenario itself is ``mqtt_bench.run`` with the same parameters for every broker, MQTT 3.1.1
(amqtt speaks nothing newer).

Outputs: one JSON line per result on stdout and in ``OUT/results.jsonl`` (histograms included,
so ``lmqtt bench report OUT`` can rebuild the report), ``OUT/report.md`` and
``OUT/latency_<scenario>.png``. Progress goes to stderr. A broker that cannot start is recorded
as ``{"available": false, "reason": ...}`` and shown as "not available"; a scenario that fails
is recorded with its error and the run goes on.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import platform
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import brokers as B, mqtt_bench, report, selfcheck
from .saturation import verdict
from .scenarios import ALL, ScenarioConfig, defaults_for

DEFAULT_SCENARIOS = "fanout,fanin,pairs,latency,conn"


def _log(msg: str) -> None:
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


def machine() -> str:
    try:
        import psutil  # optional: the bench extra
        mem = f"{psutil.virtual_memory().total / 2**30:.0f} GiB"
    except ImportError:
        mem = "?"
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()} cores ({cpu}), {mem} RAM, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def scenario_config(name: str, a: argparse.Namespace, host: str, port: int) -> ScenarioConfig:
    cfg = ScenarioConfig(scenario=name, host=host, port=port, version=4, size=a.size,
                         duration=a.duration, procs=a.procs, window=a.window, drain_max=a.drain_max)
    for k, v in defaults_for(name).items():
        setattr(cfg, k, v)
    if name == "conn":
        cfg.connections = a.connections
    if name == "million" and a.million_connections:
        cfg.connections = a.million_connections
    if name == "fanout" and a.subscribers:
        cfg.subscribers = a.subscribers
    if name == "fanin" and a.publishers:
        cfg.publishers = a.publishers
    if name == "pairs" and a.pairs:
        cfg.publishers = cfg.subscribers = a.pairs
    if name == "latency" and a.latency_rate:
        cfg.rate = a.latency_rate
    if getattr(a, "qos", None) is not None:
        cfg.qos = a.qos
    sec = getattr(a, "security", None)
    if sec is not None:
        cfg.tls_ca, cfg.username, cfg.password = sec.ca, sec.username, sec.password
    return cfg


def run_one(broker: str, scen: str, rep: int, a: argparse.Namespace, work: Path,
            versions: dict[str, str]) -> dict:
    wd = work / f"{broker}-{scen}-{rep}"
    try:
        rb = B.start(broker, wd, ready_timeout=a.start_timeout, lmqtt_src=a.lmqtt_src,
                     security=getattr(a, "security", None))
    except B.BrokerUnavailable as e:
        return {"broker": broker, "scenario": scen, "rep": rep, "available": False, "reason": str(e)}
    versions[broker] = rb.version
    try:
        time.sleep(0.3)  # let the broker settle before the RSS baseline
        cfg = scenario_config(scen, a, rb.host, rb.port)
        cfg.ports = tuple(rb.extra_ports)
        reads0 = rb.store_reads()
        res = mqtt_bench.run(cfg, rb.pid, broker=broker, quiet=a.quiet)
        reads1 = rb.store_reads()
        if reads0 is not None and reads1 is not None and res.get("sent"):
            # remote gateways: light-queue pulls per published message (each gateway should read
            # a message once, however many of its sessions get it)
            res["store_reads"] = reads1 - reads0
            res["store_reads_per_published_msg"] = round((reads1 - reads0) / res["sent"], 3)
        res["rep"] = rep
        if not rb.alive():
            res["error"] = f"{broker} exited during the run (code {rb.proc.returncode}): {rb.log_tail(5)}"
        return res
    except (OSError, TimeoutError, RuntimeError, ValueError) as e:
        tail = rb.log_tail(5)
        return {"broker": broker, "scenario": scen, "rep": rep,
                "error": f"{type(e).__name__}: {e}" + (f"\nbroker log: {tail}" if tail else "")}
    finally:
        rb.stop()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lmqtt bench compare", description=__doc__.split("\n")[0])
    ap.add_argument("--brokers", default="lmqtt,mosquitto,amqtt")
    ap.add_argument("--scenarios", default=DEFAULT_SCENARIOS, help=f"comma list of {', '.join(ALL)}")
    ap.add_argument("--duration", type=float, default=10.0, help="publish phase per scenario (s)")
    ap.add_argument("--out", required=True, help="directory for report.md, results.jsonl, PNGs")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--procs", type=int, default=2, help="generator worker processes")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--connections", type=int, default=10000, help="conn scenario")
    ap.add_argument("--million-connections", type=int, default=None,
                    help="million scenario: idle connections asked for (default 1,000,000; held: as many as "
                         "the broker's open-files limits allow, see loadtest/million_bench.py)")
    ap.add_argument("--subscribers", type=int, default=None, help="fanout subscribers (default 1000)")
    ap.add_argument("--publishers", type=int, default=None, help="fanin publishers (default 1000)")
    ap.add_argument("--pairs", type=int, default=None, help="pairs (default 100)")
    ap.add_argument("--latency-rate", type=float, default=None, help="latency scenario msg/s (5000)")
    ap.add_argument("--drain-max", type=float, default=60.0,
                    help="max wait for the last deliveries after publishing stops (s); slow brokers "
                         "with 10,000 messages in flight need tens of seconds")
    ap.add_argument("--lmqtt-src", default=None,
                    help="run `lmqtt serve` from this source tree (e.g. a `git archive HEAD` "
                         "snapshot) instead of the installed package")
    ap.add_argument("--start-timeout", type=float, default=30.0)
    ap.add_argument("--tls", action="store_true",
                    help="lmqtt and mosquitto serve the measured port over TLS (certificates from trustme, "
                         "made for this run); the generator connects with TLS")
    ap.add_argument("--password", action="store_true",
                    help="lmqtt and mosquitto require a user name and password (one password file written "
                         "by mosquitto_passwd, read by both); the generator logs in")
    ap.add_argument("--lmqtt-args", default="",
                    help="further `lmqtt serve` flags, e.g. \"--acl-file acl.txt\" (shell-quoted)")
    ap.add_argument("--qos", type=int, choices=(0, 1, 2), default=None,
                    help="QoS of every scenario (default: each scenario's own)")
    ap.add_argument("--quiet", action="store_true", help="no per-scenario progress bars")
    ap.add_argument("--selfcheck", action="store_true",
                    help="check the generator itself against Mosquitto instead: QoS 1 at a moderate "
                         "rate must lose/duplicate nothing, and flat out the broker must be saturated "
                         "with the generator below it (writes OUT/selfcheck.jsonl and selfcheck.txt)")
    ap.add_argument("--selfcheck-rate", type=float, default=10000.0,
                    help="msg/s of the self-check's QoS 1 correctness run (100 pairs)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    if a.selfcheck:
        B.raise_nofile()
        return selfcheck.run(a)
    brokers = [b.strip() for b in a.brokers.split(",") if b.strip()]
    scenarios = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    bad = [b for b in brokers if b not in B.KNOWN] + [s for s in scenarios if s not in ALL]
    if bad:
        print(f"lmqtt bench compare: unknown broker/scenario {bad}; brokers: {', '.join(B.KNOWN)}; "
              f"scenarios: {', '.join(ALL)}", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    B.raise_nofile()
    try:
        a.security = _security(a, out)
    except (RuntimeError, OSError) as e:
        print(f"lmqtt bench compare: {e}", file=sys.stderr)
        return 2
    meta = {"command": "lmqtt bench compare " + " ".join(shlex.quote(x) for x in argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
            "brokers": brokers, "scenarios": scenarios, "repeat": a.repeat, "versions": {}}
    results: list[dict] = []
    skip: dict[str, str] = {}
    started: set[str] = set()
    total = a.repeat * len(brokers) * len(scenarios)
    step = 0
    with open(out / "results.jsonl", "w") as jl, tempfile.TemporaryDirectory(prefix="lmqtt-compare-") as tmp:
        for rep in range(1, a.repeat + 1):
            for broker in brokers:
                for scen in scenarios:
                    step += 1
                    if broker in skip:
                        continue
                    _log(f"[{step}/{total}] rep {rep}/{a.repeat}  {broker:<9} {scen}")
                    res = run_one(broker, scen, rep, a, Path(tmp), meta["versions"])
                    if res.get("available") is False and broker in started:
                        # it ran before: a failure to start now is this scenario's error
                        res = {"broker": broker, "scenario": scen, "rep": rep,
                               "error": f"broker failed to start: {res['reason']}"}
                    if res.get("available") is False:
                        skip[broker] = res["reason"]
                        _log(f"{broker}: not available: {res['reason'].splitlines()[0]}")
                    elif res.get("error"):
                        _log(f"{broker} {scen}: {res['error'].splitlines()[0]}")
                    else:
                        _log(f"{broker} {scen}: " + _headline(res))
                    if res.get("available") is not False:
                        started.add(broker)
                    line = mqtt_bench.to_json(res)
                    results.append(json.loads(line))
                    jl.write(line + "\n")
                    jl.flush()
                    print(line, flush=True)
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    (out / "report.md").write_text(report.render(results, out, meta))
    _log(f"report: {out / 'report.md'}")
    return 0


def _security(a: argparse.Namespace, out: Path) -> "B.Security | None":
    """The TLS certificates and password file of `--tls` / `--password` (under OUT/security/)."""
    if not (a.tls or a.password or a.lmqtt_args):
        return None
    sec = B.Security(lmqtt_args=tuple(shlex.split(a.lmqtt_args)))
    d = out / "security"
    d.mkdir(exist_ok=True)
    if a.tls:
        try:
            import trustme  # optional: the test extra
        except ImportError:
            raise RuntimeError("--tls needs trustme (pip install trustme)") from None
        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1", "localhost")
        sec.ca, sec.cert, sec.key = str(d / "ca.pem"), str(d / "server.pem"), str(d / "server.key")
        ca.cert_pem.write_to_path(sec.ca)
        cert.private_key_and_cert_chain_pem.write_to_path(sec.cert)
        cert.private_key_pem.write_to_path(sec.key)
        for p in (sec.cert, sec.key):
            os.chmod(p, 0o644)      # Mosquitto may drop privileges before reading it
    if a.password:
        sec.username, sec.password, sec.password_file = "bench", "bench-secret", str(d / "passwd")
        exe = B.shutil.which("mosquitto_passwd")
        if exe:
            Path(sec.password_file).unlink(missing_ok=True)
            subprocess.run([exe, "-b", "-c", sec.password_file, sec.username, sec.password], check=True,
                           capture_output=True, timeout=30)
        else:
            Path(sec.password_file).write_text(f"{sec.username}:{mosquitto_hash(sec.password)}\n")
        os.chmod(sec.password_file, 0o644)
    return sec


def mosquitto_hash(password: str, iterations: int = 101) -> str:
    """A password file line's hash in Mosquitto 2's `$7$` form (PBKDF2-HMAC-SHA512, base64 salt and
    hash), with mosquitto_passwd's iteration count, so a login costs what it costs on Mosquitto:
    what `--password` writes when mosquitto_passwd is not installed. Both brokers read it (lmqtt's
    check: gateway/security/auth.py `verify_password`; tests/loadtest/test_compare_password.py)."""
    salt = secrets.token_bytes(12)
    dk = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(dk).decode()}"


def _headline(r: dict) -> str:
    if r["scenario"] == "sessions":
        lat = r.get("latency_us", {})
        return (f"{r.get('sessions')} persistent sessions: new {r.get('new_per_s', 0):,.0f}/s, resumed "
                f"{r.get('resume_per_s', 0):,.0f}/s ({r.get('session_present')} present); an idle client's "
                f"PINGRESP p99 {lat.get('p99', 0) / 1e3:.1f} ms, max {lat.get('max', 0) / 1e3:.1f} ms")
    if r["scenario"] == "million":
        per = r.get("rss_per_conn_bytes")
        return (f"{r.get('connected', 0):,} of {r.get('connections_requested', 0):,} held (target "
                f"{r.get('connections_target', 0):,}), connected in {r.get('connect_s')} s, "
                f"{'?' if per is None else f'{per / 1024:.2f}'} KiB/conn, PINGRESP p99 {r.get('idle_ping_p99_ms')} ms"
                f"{'; bound: ' + r['bound'] if r.get('bound') else ''}")
    if r["scenario"] == "conn":
        c = r.get("connect", {})
        per = r.get("rss_per_conn_bytes")
        idle = r.get("idle_broker_cpu_cores")
        return (f"{c.get('connected')} connected at {c.get('per_s')}/s, "
                f"{'?' if per is None else f'{per / 1024:.2f}'} KiB/conn, "
                f"{'?' if idle is None else f'{idle * 100:.2f}'} % of a core while idle")
    lat = r.get("latency_us", {})
    p99 = lat.get("p99")
    return (f"{r.get('delivered_per_s', 0):,.0f} msg/s delivered, p99 "
            f"{'?' if p99 is None else f'{p99 / 1e3:.2f}'} ms, lost {r.get('lost')}, dup "
            f"{r.get('duplicated')}; {verdict(r)}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
