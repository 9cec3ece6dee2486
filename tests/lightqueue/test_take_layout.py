"""The C dispatch loop (lightqueue/_take.c) takes its positions and entry format from
lightqueue/take.py at import and refuses ones it cannot honour; the positions it receives are
the ones it uses (a moved slot changes what it reads)."""
from __future__ import annotations

import pytest

from lmqtt.lightqueue import take as lqtake
from lmqtt.store import DispatchRequest
from lmqtt.store.message import DR_BORN_TS

pytestmark = pytest.mark.skipif(lqtake._ctake is None, reason="C loop not built or LMQTT_PURE_PYTHON set")


@pytest.fixture
def take():
    yield lqtake._ctake
    lqtake._ctake.configure(lqtake.TAKE_LAYOUT)   # leave it as configured at import


class FakeIndex:
    def __init__(self, resolved):
        self.resolved = resolved

    def resolve(self, qs, phys):   # pragma: no cover - every tuple is resolved in these tests
        raise AssertionError("not resolved")


def take_one(take, r):
    tail = bytearray()
    qs = r.dispatch_queues
    idx = FakeIndex({qs: [tail, (), qs[0], None, qs[1:]]})
    take.take_requests(idx, [r], 0, [], [], object())
    return bytes(tail)


@pytest.mark.parametrize("change,words", [
    ({"entry_format": "<QIQ"}, ">QIQ"),
    ({"entry_format": ">QQQ"}, ">QIQ"),
    ({"dr_store_ts": 11}, "past"),
    ({"res_len": 3}, "past"),
])
def test_take_refuses_a_layout_it_cannot_honour(take, change, words):
    with pytest.raises(ValueError, match=words):
        take.configure({**lqtake.TAKE_LAYOUT, **change})
    with pytest.raises(RuntimeError, match="configure"):
        take.take_requests(FakeIndex({}), [], 0, [], [], object())


def test_take_reads_the_positions_it_is_given(take):
    r = DispatchRequest(1000, 90, "t", 0, 0, 0, 777, 555, 0, (), ("t",))
    assert take_one(take, r) == lqtake.ENTRY.pack(1000, 90, 555)
    take.configure({**lqtake.TAKE_LAYOUT, "dr_store_ts": DR_BORN_TS})
    assert take_one(take, r) == lqtake.ENTRY.pack(1000, 90, 777)
