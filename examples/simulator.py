"""A device simulator: N devices publish JSON telemetry over MQTT (paho) to `telemetry/{device}`.

    python3 -m lmqtt.examples.simulator --host 127.0.0.1 --port 1883 --devices 20 --seconds 60

Each device has its own base temperature and drifts (random walk) with noise; humidity and
battery go with it. `--anomaly-rate` makes a device spike now and then (the job flags it);
`--silent` devices stop after a third of the run (the job reports them as gone silent).
Payload: {"device": "dev-3", "ts": 1732320000123, "temp": 21.7, "humidity": 48.2, "battery": 3.91, "seq": 17}
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt simulate", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="MQTT broker address")
    ap.add_argument("--port", type=int, default=1883, help="MQTT broker port")
    ap.add_argument("--devices", type=int, default=20, help="simulated devices, one topic each")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to run")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between readings of one device")
    ap.add_argument("--anomaly-rate", type=float, default=0.01, help="share of readings that spike (0..1)")
    ap.add_argument("--silent", type=int, default=2, help="devices that stop after a third of the run")
    ap.add_argument("--qos", type=int, default=1, choices=(0, 1, 2), help="QoS of the publishes")
    ap.add_argument("--username", default=None, help="MQTT user name (a server with --password-file)")
    ap.add_argument("--password", default=None, help="MQTT password")
    ap.add_argument("--seed", type=int, default=None,
                    help="random seed, for a repeatable run (default: %(default)s = a new one each run)")
    a = ap.parse_args(argv)

    try:
        import paho.mqtt.client as mqtt  # optional: the bench and spark extras
    except ImportError:
        print("lmqtt simulate: needs paho-mqtt: python3 -m pip install -e '.[spark]'", file=sys.stderr)
        return 2
    rnd = random.Random(a.seed)
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"simulator-{rnd.randrange(1 << 30)}")
    if a.username is not None:
        c.username_pw_set(a.username, a.password)
    connack: list = []              # the CONNACK's reason code; None: closed without one
    c.on_connect = lambda _c, _u, _f, reason, _p: connack.append(reason)
    c.on_disconnect = lambda *_: connack.append(None)
    try:
        c.connect(a.host, a.port, 30)
    except OSError as e:
        print(f"lmqtt simulate: cannot reach the MQTT broker at {a.host}:{a.port}: "
              f"{e.strerror or e} (is `lmqtt serve` running?)", file=sys.stderr)
        return 3
    c.loop_start()
    deadline = time.monotonic() + 10
    while not connack and time.monotonic() < deadline:
        time.sleep(0.02)
    if not connack or connack[0] is None or connack[0].is_failure:
        c.on_disconnect = None
        c.loop_stop()
        if connack and connack[0] is not None:
            why = f"refused the connection: {connack[0]}"
            if a.username is None and connack[0].value in (0x86, 0x87):     # bad credentials / not authorized
                why += " (give --username and --password)"
        else:
            why = "did not answer the MQTT CONNECT (is it an MQTT port? `lmqtt serve --port`, default 1883)"
        print(f"lmqtt simulate: the MQTT broker at {a.host}:{a.port} {why}", file=sys.stderr)
        return 3
    devs = [{"id": f"dev-{i}", "temp": rnd.uniform(18, 26), "hum": rnd.uniform(35, 60),
             "bat": rnd.uniform(3.7, 4.2), "seq": 0} for i in range(a.devices)]
    silent = {d["id"] for d in devs[:a.silent]}
    t0 = time.monotonic()
    # Ctrl-C sets a flag the loop reads between readings. A KeyboardInterrupt raised inside paho
    # (in publish or while waiting for an ack) can leave its client mid-operation, and then
    # stopping it hangs. A process started with SIGINT ignored keeps ignoring it.
    stop = threading.Event()
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        rc = _run(a, rnd, c, devs, silent, t0, stop)
    finally:
        c.loop_stop()
        c.disconnect()
    if stop.is_set():                     # Ctrl-C: the run stops early, not an error
        print(f"lmqtt simulate: interrupted after {time.monotonic() - t0:.0f} s", file=sys.stderr)
        return 0
    return rc


def _acked(info, stop: threading.Event, seconds: float) -> bool:
    """Waits for one publish's acknowledgement in short slices, so Ctrl-C is answered at once."""
    deadline = time.monotonic() + seconds
    while not stop.is_set() and time.monotonic() < deadline:
        info.wait_for_publish(0.2)
        if info.is_published():
            return True
    return info.is_published()


def _run(a, rnd, c, devs, silent, t0, stop: threading.Event) -> int:
    sent = 0
    while time.monotonic() - t0 < a.seconds and not stop.is_set():
        tick = time.monotonic()
        for d in devs:
            if d["id"] in silent and tick - t0 > a.seconds / 3:
                continue
            d["temp"] += rnd.gauss(0, 0.15)
            d["hum"] = min(100, max(0, d["hum"] + rnd.gauss(0, 0.3)))
            d["bat"] = max(3.0, d["bat"] - rnd.uniform(0, 0.0005))
            temp = d["temp"] + (rnd.choice((-1, 1)) * rnd.uniform(15, 30) if rnd.random() < a.anomaly_rate else 0)
            d["seq"] += 1
            msg = {"device": d["id"], "ts": int(time.time() * 1000), "temp": round(temp, 2),
                   "humidity": round(d["hum"], 1), "battery": round(d["bat"], 3), "seq": d["seq"]}
            if stop.is_set():
                return 0
            info = c.publish(f"telemetry/{d['id']}", json.dumps(msg), qos=a.qos)
            try:
                acked = _acked(info, stop, 10)
            except (RuntimeError, ValueError) as e:      # paho: not connected, queue full
                print(f"lmqtt simulate: lost the MQTT broker at {a.host}:{a.port} after {sent} readings: {e}",
                      file=sys.stderr)
                return 3
            if stop.is_set():
                return 0
            if not acked:
                print(f"lmqtt simulate: lost the MQTT broker at {a.host}:{a.port} after {sent} readings: "
                      "a reading was not acknowledged within 10 s", file=sys.stderr)
                return 3
            sent += 1
        stop.wait(max(0.0, a.interval - (time.monotonic() - tick)))
    if stop.is_set():
        return 0
    print(f"simulator: {sent} readings from {a.devices} devices ({len(silent)} went silent)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
