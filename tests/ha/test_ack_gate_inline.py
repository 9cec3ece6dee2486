"""The ack gate answers the appends' rounds a replica's acknowledgement completes on the thread
that read it (AckGate.replica_acked), without a hop to the gate's thread - under the same rule as
the gate's own round (store/ha/ack_gate.py): the primary's flush, every member of the acknowledging
set, the lease."""
from __future__ import annotations

import threading
import types

from lmqtt.store.ha.ack_gate import AckGate


def _gate_without_thread(clog, acked: dict, lease: list) -> AckGate:
    gate = AckGate(clog, True, 1, lambda: lease[0], lambda: tuple(acked), lambda n: acked[n])
    gate._stop = True            # its thread ends: only replica_acked() can answer now
    gate._ev.set()
    gate._thread.join(5)
    assert not gate._thread.is_alive()
    gate._stop = False
    return gate


def test_an_acknowledgement_answers_the_rounds_it_completes_on_its_own_thread():
    clog = types.SimpleNamespace(committed=0, flushed=0, lock=threading.Lock())
    acked = {2: 0, 3: 0}
    lease = [True]
    gate = _gate_without_thread(clog, acked, lease)
    first = gate.current
    clog.committed = clog.flushed = 100
    gate.evaluate()              # the gate's round on the append's wake-up: takes the round up to 100
    assert not first.done() and [t for t, _ in gate.waiting] == [100]
    second = gate.current
    clog.committed = 250
    acked[2] = 100
    gate.replica_acked()
    assert not first.done()      # replica 3 has not acknowledged 100
    acked[3] = 180
    gate.replica_acked()
    assert first.result(0) == 100 and gate.committed == 100
    assert not second.done()     # 250: not flushed on the primary yet, nor on the replicas
    clog.flushed = 250
    acked[2] = acked[3] = 250
    lease[0] = False
    gate.replica_acked()
    assert not second.done()     # no lease: nothing is acknowledged
    lease[0] = True
    gate.replica_acked()
    assert second.result(0) == 250 and gate.committed == 250


def test_a_stopped_gate_answers_no_acknowledgement():
    clog = types.SimpleNamespace(committed=0, flushed=0, lock=threading.Lock())
    acked = {2: 0}
    gate = _gate_without_thread(clog, acked, [True])
    fut = gate.current
    clog.committed = clog.flushed = 10
    gate.evaluate()
    gate.stop(RuntimeError("deposed"))
    acked[2] = 10
    gate.replica_acked()
    assert isinstance(fut.exception(0), RuntimeError)
