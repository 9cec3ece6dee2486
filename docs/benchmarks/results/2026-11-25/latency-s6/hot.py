"""In-process hot path: 50 QoS 1 pairs, one PUBLISH per loop turn, CPU per message (no sockets)."""
import asyncio, sys, time, tempfile, gc
import os
SRC = os.environ.get("SRC", "/tmp/cpu/base")
sys.path.insert(0, SRC)
sys.path.insert(1, SRC + "/lmqtt")
import uvloop
from lmqtt.gateway.app.config import build_config
from lmqtt.gateway.net.connection import MQTTConnection
from lmqtt.gateway.mqtt import Decoder, encode, packets as P
from lmqtt.gateway.app.gateway import Gateway
from tests.fakes import FakeTransport
import lmqtt.store.commitlog as _cl; assert _cl.__file__.startswith(SRC), _cl.__file__

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
PAIRS = 50

class C:
    def __init__(self, gw):
        self.conn = MQTTConnection(gw.broker)
        self.tr = FakeTransport(self.conn)
        self.conn.connection_made(self.tr)
    def send(self, data): self.conn.data_received(data)

async def main(tmp):
    cfg = build_config({}, {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "data_dir": tmp + "/data",
                            "max_inflight": 65535})
    gw = Gateway(cfg); await gw.start()
    subs, pubs = [], []
    for i in range(PAIRS):
        s, p = C(gw), C(gw)
        s.send(encode(P.Connect(client_id=f"s{i}", protocol_level=4), 4))
        p.send(encode(P.Connect(client_id=f"p{i}", protocol_level=4), 4))
        await asyncio.sleep(0.002)
        s.send(encode(P.Subscribe(1, [P.SubscriptionRequest(f"t/{i}", qos=1)]), 4))
        subs.append(s); pubs.append(p)
    await asyncio.sleep(0.2)
    for c in subs + pubs: c.tr.take()
    pkts = [[encode(P.Publish(f"t/{i}", b"x" * 64, qos=1, packet_id=pid), 4) for pid in range(1, 11)] for i in range(PAIRS)]
    gc.collect(); gc.freeze()
    async def one(k):
        i = k % PAIRS
        pubs[i].send(pkts[i][(k // PAIRS) % 10])
        await asyncio.sleep(0)
        out = subs[i].tr.take()
        if out:
            # PUBLISH -> PUBACK with its packet id (3.1.1, one-byte remaining length: after the topic)
            at = 4 + ((out[2] << 8) | out[3])
            subs[i].send(b"\x40\x02" + out[at:at + 2])
        await asyncio.sleep(0)
        pubs[i].tr.take()
    for k in range(2000): await one(k)
    import os
    prof = None
    if os.environ.get("HOTPROF"):
        import cProfile; prof = cProfile.Profile(time.process_time); prof.enable()
    c0 = time.process_time(); t0 = time.perf_counter()
    chunks = []
    K = N // 20
    for j in range(20):
        a = time.thread_time()
        for k in range(2000 + j * K, 2000 + (j + 1) * K): await one(k)
        chunks.append((time.thread_time() - a) / K * 1e6)
    c1 = time.process_time(); t1 = time.perf_counter()
    chunks.sort()
    global CH
    CH = chunks
    if prof:
        prof.disable(); prof.dump_stats(os.environ["HOTPROF"])
    await gw.stop()
    return (c1 - c0) / N * 1e6, (t1 - t0) / N * 1e6

uvloop.install()
with tempfile.TemporaryDirectory() as tmp:
    cpu, wall = asyncio.run(main(tmp))
print(f"loopmin {CH[0]:.1f} loopq25 {CH[5]:.1f} cpu {cpu:.1f} us/msg wall {wall:.1f} us/msg (includes the driver's decode)")
