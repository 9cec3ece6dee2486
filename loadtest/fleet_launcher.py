"""`python -m lmqtt.loadtest.fleet_launcher --ports P,Q [serve flags]`: a small lmqtt fleet on this
host for `lmqtt bench compare --brokers lmqtt-fleet`: one `lmqtt store` and one `lmqtt gateway` per
port, each gateway on its own port (as behind a load
balancer). It is `lmqtt serve --workers N` (gateway/app/workers.py) with a port per gateway instead of
one shared SO_REUSEPORT port, so the benchmark can put publishers and subscribers on different
gateways and measure the cross-gateway path. All processes are children of this one, so the
benchmark's CPU/RSS probe (the launcher's PID and its children) covers the whole fleet.

It runs the product's own supervisor (`gateway/app/workers.py`) over `lmqtt serve`'s flags and
configuration: the one load tool that imports the composition root (`MAY_IMPORT` in
tests/architecture/test_layering.py, docs/internals.md).
"""
from __future__ import annotations

import sys

from lmqtt.gateway.app.config import ConfigError, build_config
from lmqtt.gateway.app.serve_command import parser
from lmqtt.gateway.app.workers import run


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--ports" not in argv:
        print("fleet_launcher: --ports P,Q,... is required", file=sys.stderr)
        return 2
    i = argv.index("--ports")
    ports = [int(p) for p in argv[i + 1].split(",") if p]
    rest = argv[:i] + argv[i + 2:]
    args = parser().parse_args(["--port", str(ports[0]), *rest])
    try:
        cfg = build_config({}, {k: v for k, v in vars(args).items() if k != "config" and v is not None})
    except ConfigError as e:
        print(f"fleet_launcher: {e}", file=sys.stderr)
        return 2
    return run(cfg, ["--port", str(ports[0]), *rest], len(ports), ports)


if __name__ == "__main__":
    sys.exit(main())
