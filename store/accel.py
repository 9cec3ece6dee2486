"""One loader for the optional C accelerators, all twelve of them (setup.py builds each; the module
that loads it holds its Python reference):

* `lmqtt.store._append` (store/_append.c): the CommitLog's record encoder and decoder
  (store/encoding.py, store/record.py), and a fleet gateway's decode of the records a store
  pushes (gateway/storage/remote_entries.py);
* `lmqtt.store._fastpath` (store/_fastpath.c): the store server's raw pull, ConsumeQueue entries
  into runs of adjacent records and their CRC check (store/fastpath.py); the dispatch round's
  record scan (store/dispatch.py) and a run's ConsumeQueue entries (store/consume_queue_entries.py);
* `lmqtt.store._produce` (store/_produce.c): the PRODUCE body's per-message codec, a gateway's or
  SDK producer's pack of Messages, the store server's unpack into Messages and its PRODUCED answer
  (store/produce.py);
* `lmqtt.store.client._records` (store/client/_records.c): the SDK's decode of raw MESSAGES
  replies into Records (store/client/records.py);
* `lmqtt.store.spark._columns` (store/spark/_columns.c): pull replies into Arrow column buffers
  for the Spark reader (store/spark/columns.py);
* `lmqtt.lightqueue._take` (lightqueue/_take.c): the light-queue index's per-record dispatch
  loop and a run's entries (lightqueue/take.py);
* `lmqtt.lightqueue._retained` (lightqueue/_retained.c): the retained-message scan's per-entry
  loop (lightqueue/metadata.py);
* `lmqtt.lightqueue._history` (lightqueue/_history.c): a filter's history read, the scan of its
  first-level topics' ConsumeQueue entries with the topic match (lightqueue/history.py);
* `lmqtt.gateway.mqtt._run` (gateway/mqtt/_run.c): a run of PUBLISH packets encoded at once
  (gateway/mqtt/encoder.py);
* `lmqtt.gateway.mqtt._scan` (gateway/mqtt/_scan.c over _scan_core.h): the decoder's steady
  state, runs of PUBLISHes and two-byte acks (gateway/mqtt/decoder.py);
* `lmqtt.gateway.session._offer` (gateway/session/_offer.c): the session machine's `offer` for
  one plain subscription (gateway/session/outbound.py);
* `lmqtt.gateway.net._park` (gateway/net/_park.c): the parked idle sockets' epoll, answering
  PINGREQ (gateway/net/parking.py).

Each accelerator is a C loop beside a pure-Python reference that produces the same results; the
extensions are built by setup.py with `optional=True`, so an install without a C compiler still
works and runs the Python loops. `LMQTT_PURE_PYTHON=1` forces the Python loops even when the
extensions are built (equivalence tests, debugging, profiling the reference).

Why the layouts are handed over: the C loops read and write formats defined in Python (the
record header, the ConsumeQueue entry, the MESSAGES record head, the order of shared tuples such
as DispatchRequest or Record). They do not repeat them: the module that loads `_append`,
`_fastpath`, `_produce`, `_records`, `_columns` or `_take` passes the Python definitions to its
`configure(...)` (`_append`'s decoder: `configure_reader(...)`) right after `load`; the C side
checks them against the offsets it was written for, raises ValueError naming what differs, and
refuses to run (RuntimeError) until configured. A layout change in Python thus fails loudly at
import instead of producing wrong data. (`_retained` is given its key and value lengths on each
call; `_run` writes only MQTT's own packet format.)

    from lmqtt.store import accel
    _take = accel.load("lmqtt.lightqueue._take")   # the module, or None
    if _take is not None:
        _take.configure(TAKE_LAYOUT)

Only a missing module (ImportError) means "not built"; any other error while importing a built
extension is a bug and propagates.
"""
from __future__ import annotations

import importlib
import os


def pure_python() -> bool:
    """True when LMQTT_PURE_PYTHON asks for the Python loops (any value but empty or "0")."""
    return os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0")


def load(name: str):
    """The accelerator module `name` (absolute, e.g. "lmqtt.store._append"), or None when it was not
    built or LMQTT_PURE_PYTHON is set."""
    if pure_python():
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
