"""The shipped IoT analytics job (lmqtt.examples.iot_analytics) end to end: telemetry published
over MQTT (paho), the first window's readings before the job starts -> the job's two streaming
queries -> window statistics in Parquet that equal a pure-Python computation of the same
readings, a late reading dropped by the watermark, and the anomaly alert back over MQTT."""
import json
import math
import random
import statistics
import time
from collections import defaultdict

from tests.support import Paho

WINDOW_S = 10


def _readings(base_ms: int):
    """3 devices, one reading per second for 30 s (three 10 s windows), deterministic; one spike."""
    rnd = random.Random(7)
    out = []
    for d in range(3):
        temp, hum, bat = 20.0 + d, 50.0 - d, 4.1
        for i in range(30):
            temp += rnd.gauss(0, 0.2)
            hum += rnd.gauss(0, 0.3)
            bat -= rnd.uniform(0, 0.001)
            t = round(temp, 2)
            if d == 1 and i == 17:
                t = 80.0                                   # above --max-temp: an anomaly
            out.append({"device": f"iot-{d}", "ts": base_ms + i * 1000 + d * 7, "temp": t,
                        "humidity": round(hum, 1), "battery": round(bat, 4), "seq": i})
    return out


def _expected(readings):
    """What the job must compute, in plain Python: per (device, window start) the count, avg/min/
    max/sample stddev of temp, avg humidity, min battery."""
    groups = defaultdict(list)
    for r in readings:
        groups[(r["device"], r["ts"] // 1000 // WINDOW_S * WINDOW_S)].append(r)
    exp = {}
    for key, rs in groups.items():
        temps = [r["temp"] for r in rs]
        exp[key] = {"n": len(rs), "avg_temp": statistics.fmean(temps), "min_temp": min(temps),
                    "max_temp": max(temps), "std_temp": statistics.stdev(temps) if len(temps) > 1 else None,
                    "avg_humidity": statistics.fmean(r["humidity"] for r in rs),
                    "min_battery": min(r["battery"] for r in rs)}
    return exp


def _stats(spark, out):
    import os
    path = f"{out}/stats"
    if not os.path.isdir(path) or not any(f.endswith(".parquet") for f in os.listdir(path)):
        return {}
    rows = spark.read.parquet(path).collect()
    return {(r.device, int(r.window_start.timestamp())): r.asDict() for r in rows}


def test_job_window_stats_equal_pure_python_and_alerts_arrive_over_mqtt(spark, server, tmp_path):
    from lmqtt.examples.iot_analytics import build, parse_args
    out = str(tmp_path / "iot")
    args = parse_args(["--store", server.store_address, "--filter", "iotjob/+", "--out", out,
                       "--window", f"{WINDOW_S} seconds", "--watermark", "5 seconds",
                       "--trigger", "1 second", "--stats-trigger", "1 second", "--silence", "3600", "--job-id", "iot-test"])
    alerts = Paho(server, client_id="iot-alerts", version=5)
    alerts.subscribe("alerts/#", qos=1)
    now_s = int(time.time())
    base_ms = (now_s - 600) // WINDOW_S * WINDOW_S * 1000   # event time 10 min ago, window-aligned
    readings = _readings(base_ms)
    pub = Paho(server, client_id="iot-devices", version=5)
    # the first window's readings are stored before the job starts, with no subscriber of the job's
    # filter ever: its first batch reads them as the filter's history, the later ones
    # arrive live
    early = [r for r in readings if r["ts"] < base_ms + WINDOW_S * 1000]
    for r in early:
        pub.publish(f"iotjob/{r['device']}", json.dumps(r), qos=1)
    qs = build(spark, args)
    try:
        deadline = time.monotonic() + 60
        while not all(q.lastProgress for q in qs):          # both queries planned (filter registered)
            assert time.monotonic() < deadline, "the job's queries did not start"
            time.sleep(0.2)
        for r in sorted(readings, key=lambda r: r["ts"]):       # event-time order: the watermark drops none
            if r["ts"] < base_ms + WINDOW_S * 1000:
                continue                                     # stored before the job started
            pub.publish(f"iotjob/{r['device']}", json.dumps(r), qos=1)
        # one reading per device far ahead in event time moves the watermark past every window
        for d in range(3):
            pub.publish(f"iotjob/iot-{d}", json.dumps({"device": f"iot-{d}", "ts": base_ms + 300_000,
                                                        "temp": 21.0, "humidity": 50.0, "battery": 4.0}), qos=1)
        expected = _expected(readings)
        got = {}
        deadline = time.monotonic() + 90
        while set(got) != set(expected) and time.monotonic() < deadline:
            time.sleep(1.0)
            got = {k: v for k, v in _stats(spark, out).items() if k in expected}
        assert set(got) == set(expected), f"windows written: {sorted(got)}; expected {sorted(expected)}"
        for key, e in expected.items():
            g = got[key]
            assert g["n"] == e["n"], key
            for col in ("avg_temp", "min_temp", "max_temp", "std_temp", "avg_humidity", "min_battery"):
                assert math.isclose(g[col], e[col], rel_tol=1e-9, abs_tol=1e-9), (key, col, g[col], e[col])

        # a reading for a window the watermark has closed is dropped, not counted into it
        late_key = ("iot-0", base_ms // 1000)
        pub.publish("iotjob/iot-0", json.dumps({"device": "iot-0", "ts": base_ms + 1500, "temp": -5.0,
                                                "humidity": 10.0, "battery": 3.0}), qos=1)
        def read_up_to(q):           # the job's offset in iotjob's ConsumeQueue, from its progress
            src = (q.lastProgress or {}).get("sources") or [{}]
            end = src[0].get("endOffset") or "{}"
            return (json.loads(end) if isinstance(end, str) else end).get("iotjob:0", -1)
        before = [read_up_to(q) for q in qs]
        deadline = time.monotonic() + 60
        while not all(read_up_to(q) > b for q, b in zip(qs, before)):
            assert time.monotonic() < deadline, "the late reading was never read"
            time.sleep(0.3)
        time.sleep(2.0)                                          # a trigger to write whatever it would
        rows = [r.asDict() for r in spark.read.parquet(f"{out}/stats").collect()
                if (r.device, int(r.window_start.timestamp())) == late_key]
        assert len(rows) == 1 and rows[0]["n"] == expected[late_key]["n"] and rows[0]["min_temp"] != -5.0

        # the spike came back over MQTT as an anomaly alert for its device
        got_alerts = alerts.get_n(1, timeout=30)
        got_alerts += alerts.drain(2.0)
        kinds = [(m.topic, json.loads(m.payload)) for m in got_alerts]
        assert ("alerts/iot-1", "anomaly", 80.0) in [(t, p["kind"], p.get("temp")) for t, p in kinds], kinds
        # the other devices stayed in range and near their mean: no anomaly for them
        assert all(t == "alerts/iot-1" for t, p in kinds if p["kind"] == "anomaly"), kinds
        pub.disconnect()
    finally:
        for q in qs:
            q.stop()
        alerts.disconnect()
