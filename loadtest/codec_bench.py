"""Micro-benchmark of the sans-IO MQTT codec (`lmqtt bench codec`).

Why: the decoder runs on every byte of every connection and `PublishTemplate` on every delivery, so
their packets/s bound the gateway's throughput per core. Single process, no sockets: it measures
only the codec. Results are noisy on a shared machine; run it twice and quote the better figure.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from lmqtt.gateway.mqtt import Decoder, PublishTemplate, encode, encode_publish, packets as P


def _rate(fn, n: int) -> float:
    t0 = time.perf_counter()
    fn(n)
    return n / (time.perf_counter() - t0)


def bench(n: int, payload_size: int) -> dict:
    payload = b"x" * payload_size
    out: dict = {"packets": n, "payload_bytes": payload_size}
    for v in (4, 5):
        props = P.Properties(user_property=[("k", "v")]) if v == 5 else None
        pub1 = encode_publish("sensors/room-1/temp", payload, 1, False, False, 1, props, v)
        pub0 = encode_publish("sensors/room-1/temp", payload, 0, False, False, None, props, v)
        connect = encode(P.Connect("bench", v), v)

        def decode_stream(k: int, wire=pub1 * 100) -> None:
            d = Decoder()
            d.feed(connect)
            for _ in range(k // 100):
                d.feed(wire)

        def decode_single(k: int) -> None:
            d = Decoder()
            d.feed(connect)
            for _ in range(k):
                d.feed(pub0)

        def encode_plain(k: int) -> None:
            for i in range(k):
                encode_publish("sensors/room-1/temp", payload, 1, False, False, (i & 0xFFFF) or 1, props, v)

        def encode_obj(k: int) -> None:
            p = P.Publish("sensors/room-1/temp", payload, 1, packet_id=1, properties=props or P.Properties())
            for _ in range(k):
                encode(p, v)

        def fanout(k: int) -> None:
            t = PublishTemplate("sensors/room-1/temp", payload, 1, False, props, v)
            for i in range(k):
                t.for_packet_id((i & 0xFFFF) or 1)

        def acks(k: int) -> None:
            d = Decoder(v, server_side=False)
            wire = encode(P.PubAck(7), v) * 100
            for _ in range(k // 100):
                d.feed(wire)

        out[f"v{v}"] = {
            "decode_publish_qos1_100_per_feed": round(_rate(decode_stream, n)),
            "decode_publish_qos0_1_per_feed": round(_rate(decode_single, n)),
            "decode_puback_100_per_feed": round(_rate(acks, n)),
            "encode_publish_function": round(_rate(encode_plain, n)),
            "encode_publish_object": round(_rate(encode_obj, n)),
            "publish_template_for_packet_id": round(_rate(fanout, n)),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmqtt bench codec", description=__doc__.split("\n")[0])
    ap.add_argument("--packets", type=int, default=200_000)
    ap.add_argument("--payload", type=int, default=64)
    a = ap.parse_args(argv)
    print(json.dumps(bench(a.packets, a.payload), indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
