"""Builds the optional C accelerators: `store._append` (the CommitLog's per-record encoding loop,
and its per-record decode for reads: same layout and CRC, so one module),
`lightqueue._take` (the light-queue index's per-record dispatch loop) and `store.spark._columns`
(pull replies -> Arrow column buffers for the Spark reader), `store.client._records` (the SDK's
decode of raw MESSAGES replies into Records), `store._fastpath` (the store server's raw pull:
ConsumeQueue entries -> runs of records, and their CRC check, with zlib's crc32), `store._produce`
(the PRODUCE body's per-message codec: a gateway's pack, the store's unpack into Messages, PRODUCED),
`lightqueue._retained` (the metadata's retained scan: RocksDB pairs -> (topic, payload, props)),
`lightqueue._history` (a filter's history: ConsumeQueue entries -> the records matching the filter)
`gateway.mqtt._run` (the codec's runs of PUBLISHes: retained messages, backlogs, histories),
`gateway.mqtt._scan` (the decoder's steady state: runs of PUBLISHes and two-byte acks framed in C),
`gateway.session._offer` (the session machine's `offer` for one plain subscription)
and `gateway.net._park` (parked idle MQTT sockets on an epoll of their own: PINGREQ answered in C).

Everything else is in pyproject.toml. `optional=True`: without a C compiler the install still
succeeds and all run their pure-Python loops (same results, slower; docs/store.md). All are
imported through `lmqtt.store.accel.load`, which also honours LMQTT_PURE_PYTHON=1.
"""
from setuptools import Extension, setup

# the layout checks four store modules share, with the CommitLog record head they read (their
# configure() compares Python's struct formats and field names with the offsets they read)
LAYOUT = ["store/_layout.h"]

setup(ext_modules=[
    Extension("lmqtt.store._append", ["store/_append.c"], depends=LAYOUT, optional=True, extra_compile_args=["-O2"]),
    Extension("lmqtt.lightqueue._take", ["lightqueue/_take.c"], optional=True, extra_compile_args=["-O2"]),
    Extension("lmqtt.store.client._records", ["store/client/_records.c"], depends=LAYOUT, optional=True, extra_compile_args=["-O2"]),
    Extension("lmqtt.store.spark._columns", ["store/spark/_columns.c"], depends=LAYOUT, optional=True, extra_compile_args=["-O2"]),
    Extension("lmqtt.store._fastpath", ["store/_fastpath.c"], depends=LAYOUT, optional=True, extra_compile_args=["-O2"],
              libraries=["z"]),
    Extension("lmqtt.store._produce", ["store/_produce.c"], depends=LAYOUT, optional=True, extra_compile_args=["-O2"]),
    Extension("lmqtt.lightqueue._history", ["lightqueue/_history.c"], depends=LAYOUT, optional=True,
              extra_compile_args=["-O2"], libraries=["z"]),
    Extension("lmqtt.lightqueue._retained", ["lightqueue/_retained.c"], optional=True, extra_compile_args=["-O2"]),
    Extension("lmqtt.gateway.mqtt._run", ["gateway/mqtt/_run.c"], optional=True, extra_compile_args=["-O2"]),
    Extension("lmqtt.gateway.mqtt._scan", ["gateway/mqtt/_scan.c"], depends=["gateway/mqtt/_scan_core.h"],
              optional=True, extra_compile_args=["-O2"]),
    Extension("lmqtt.gateway.session._offer", ["gateway/session/_offer.c"], optional=True, extra_compile_args=["-O2"]),
    Extension("lmqtt.gateway.net._park", ["gateway/net/_park.c"], optional=True, extra_compile_args=["-O2"]),
])
