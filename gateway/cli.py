"""The `lmqtt` command.

Sub-commands are resolved lazily (module path + function) so that `lmqtt bench store` does not
import the gateway's asyncio server, and a newcomer can find each command's code by its name.
Each target is `main(argv: list[str]) -> int`, or `module:function` for a module holding several.
"""
from __future__ import annotations

import importlib
import sys

from lmqtt.store.allocator import AllocatorError, one_arena, use_jemalloc

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("lmqtt.gateway.app.serve_command", "Run gateway + store + notify in one process (embedded default)"),
    "store": ("lmqtt.store.node.command", "Run the store node serving the native protocol (SDK, remote gateways)"),
    "gateway": ("lmqtt.gateway.app.gateway_command", "Run an MQTT gateway over a remote `lmqtt store` (scale-out fleet)"),
    "produce": ("lmqtt.store.client.tools:produce_main", "Send stdin lines to a store topic (console producer)"),
    "consume": ("lmqtt.store.client.tools:consume_main", "Print messages of an MQTT filter or topic (console consumer)"),
    "admin": ("lmqtt.store.client.tools:admin_main", "Topics, queues, groups and their lag, store stats"),
    "passwd": ("lmqtt.gateway.security.passwd", "Manage a password file (mosquitto_passwd-compatible)"),
    "simulate": ("lmqtt.examples.simulator", "Simulated devices publishing JSON telemetry over MQTT"),
    "spark-iot": ("lmqtt.examples.iot_analytics", "The IoT analytics Spark job: window stats, anomalies, alerts"),
}

# the long-running processes: started on jemalloc with LMQTT_MALLOC=jemalloc (store/allocator.py)
STORE_PROCESSES = ("serve", "store", "gateway")

BENCH: dict[str, tuple[str, str]] = {
    "store": ("lmqtt.loadtest.store_bench", "CommitLog append/dispatch throughput and lag per flush mode"),
    "lightqueue": ("lmqtt.loadtest.lightqueue_bench", "Light-queue fan-out indexing and filter matching"),
    "mqtt": ("lmqtt.loadtest.mqtt_bench", "One MQTT load scenario against a running broker"),
    "compare": ("lmqtt.loadtest.compare", "Same scenarios against lmqtt, Mosquitto and amqtt; Markdown report"),
    "report": ("lmqtt.loadtest.report", "Rebuild a `bench compare` report (report.md, plots) from its results.jsonl"),
    "fuzz": ("lmqtt.loadtest.mqtt_fuzz", "Random/mutated MQTT packets at a live broker, then check it still serves"),
    "timer": ("lmqtt.loadtest.timer_bench", "Delayed messages: timer enqueue, firing error, a million pending timers"),
    "sdk": ("lmqtt.loadtest.sdk_bench", "SDK produce/pull/POP vs Redis Streams; SDK -> MQTT latency"),
    "tier": ("lmqtt.loadtest.tier_bench", "Tiered storage: upload rate vs append rate, a 100,000-message backlog from the tier vs local"),
    "spark": ("lmqtt.loadtest.spark_bench", "Spark over the store: batch read vs Parquet/JSON, publish -> alert latency"),
    "restart": ("lmqtt.loadtest.restart_bench", "Time to be back after a restart with N persistent sessions (vs Mosquitto)"),
    "fuzz-store": ("lmqtt.loadtest.store_fuzz", "Random/mutated native-protocol frames at a live store, then check it"),
    "chaos": ("lmqtt.loadtest.chaos.cli", "kill -9 / SIGSTOP / disk full under mixed load; lost, duplicated, reordered"),
    "soak": ("lmqtt.loadtest.soak_bench", "Hours at a steady rate with churn and retention: memory, files, maps, disk, latency over time"),
    "topics": ("lmqtt.loadtest.topics_bench", "Many first-level topics: publish, restart, read back; open files, maps, RSS, disk"),
    "ha": ("lmqtt.loadtest.ha_bench", "A replicated store group: replicated append vs one node, failover time, nothing lost"),
    "ha-pop": ("lmqtt.loadtest.ha_pop_bench", "POP consumers on a store group of 3 vs a single store: msg/s, pop/ack latency"),
    "storm": ("lmqtt.loadtest.conn_storm", "Broker CPU per persistent session of a reconnect storm (CONNECT+SUBSCRIBE+DISCONNECT)"),
    "idle": ("lmqtt.loadtest.idle_bench", "What an idle broker costs: wake-ups per second per thread, CPU per minute"),
    "conn-memory": ("lmqtt.loadtest.conn_profile", "Where the memory of an idle MQTT connection goes on `lmqtt serve`"),
    "shared": ("lmqtt.loadtest.shared_bench", "One $share group of 4 QoS 1 members: serve, a fleet and Mosquitto"),
    "codec": ("lmqtt.loadtest.codec_bench", "The sans-IO MQTT codec alone: decode/encode packets/s"),
    "paho-latency": ("lmqtt.loadtest.paho_latency", "The latency scenario written with paho-mqtt: an independent check of the generator"),
    "external": ("lmqtt.loadtest.external_gen", "Fan-in measured by mosquitto_pub/mosquitto_sub: an independent check of the generator"),
    "cost": ("lmqtt.loadtest.cost_bench", "A broker's syscalls, context switches and CPU per delivered message, brokers alternated"),
}


def _usage() -> str:
    lines = ["usage: lmqtt COMMAND [ARGS...]    (lmqtt COMMAND --help: its flags; lmqtt --version)", "",
             "commands:"]
    for name, (_, desc) in COMMANDS.items():
        lines.append(f"  {name:<19} {desc}")
    for name, (_, desc) in BENCH.items():
        lines.append(f"  bench {name:<13} {desc}")
    return "\n".join(lines)


def _bench_usage() -> str:
    lines = ["usage: lmqtt bench BENCHMARK [ARGS...]    (lmqtt bench BENCHMARK --help: its flags)", "",
             "benchmarks:"]
    for name, (_, desc) in BENCH.items():
        lines.append(f"  {name:<13} {desc}")
    return "\n".join(lines)


def _unknown(what: str, name: str, known) -> str:
    import difflib  # only for a mistyped name (~6 ms of every start otherwise)
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"unknown {what} {name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def version() -> str:
    """`lmqtt 0.1.0`: the installed package's version (pyproject.toml)."""
    from importlib.metadata import (  # only --version and the banners (~8 ms of every start otherwise)
        PackageNotFoundError,
        version as dist_version,
    )
    try:
        return f"lmqtt {dist_version('lmqtt')}"
    except PackageNotFoundError:
        return "lmqtt (version unknown: the package is not installed; pip install -e .)"


# the optional packages of pyproject.toml's extras: a command that needs one that is not installed
# names the install instead of a traceback (commands check their own settings first when they can,
# e.g. `--group` and `--tier`, so nothing is created before)
EXTRAS: dict[str, str] = {"pysyncobj": "ha", "fsspec": "tier", "s3fs": "tier", "pyspark": "spark",
                          "pyarrow": "spark", "paho": "bench", "amqtt": "bench", "psutil": "bench",
                          "matplotlib": "bench", "hiredis": "bench"}


def _run(module: str, argv: list[str], prog: str = "lmqtt") -> int:
    module, _, func = module.partition(":")
    try:
        mod = importlib.import_module(module)
        return int(getattr(mod, func or "main")(argv) or 0)
    except ModuleNotFoundError as e:
        extra = EXTRAS.get((e.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"{prog}: needs {e.name}, which is not installed: pip install 'lmqtt[{extra}]'", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    called_as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version", "version"):
        print(version())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if rest and rest[0] in ("-h", "--help", "help"):
            print(_bench_usage())
            return 0
        if not rest:
            print(f"lmqtt bench: name a benchmark\n\n{_bench_usage()}", file=sys.stderr)
            return 2
        if rest[0] not in BENCH:
            print(f"lmqtt bench: {_unknown('benchmark', rest[0], BENCH)}\n\n{_bench_usage()}", file=sys.stderr)
            return 2
        return _run(BENCH[rest[0]][0], rest[1:], f"lmqtt bench {rest[0]}")
    if cmd in COMMANDS:
        if cmd in STORE_PROCESSES and called_as_program:
            try:
                use_jemalloc(f"lmqtt {cmd}")     # returns unless it executes this process again
            except AllocatorError as e:
                print(f"lmqtt {cmd}: {e}", file=sys.stderr)
                return 2
            one_arena()                          # one malloc arena, before any thread starts
        return _run(COMMANDS[cmd][0], rest, f"lmqtt {cmd}")
    print(f"lmqtt: {_unknown('command', cmd, list(COMMANDS) + ['bench'])}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
