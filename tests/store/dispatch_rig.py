"""A CommitLog of one mapped segment and a recording dispatcher, to run the store's dispatch loop
(`DispatchService.dispatch_round`) with and without its C scan and compare what each handed over:
tests/store/test_dispatch_scan_accel.py (hypothesis) and tests/fuzz/fuzz_fastpath.py (atheris,
which imports this file by path: it runs as a script)."""
from __future__ import annotations

import mmap

from lmqtt.store.dispatch import DispatchService


class _Seg:
    def __init__(self, data: bytes) -> None:
        self.mm = mmap.mmap(-1, max(len(data), 1))
        self.mm[:len(data)] = data
        self.start_offset = 0
        self.size = self.end_offset = len(data)


class _Mfq:
    def __init__(self, seg: _Seg) -> None:
        self.seg = seg

    def find(self, pos: int):
        return self.seg if pos < self.seg.size else None


class _Clog:
    """What dispatch_round reads of a CommitLog: one mapped segment, committed to its end or to
    `committed` (a replica whose last shipped frame ended there, maybe inside a record)."""

    def __init__(self, seg: _Seg, corrupt: list, committed: int | None = None) -> None:
        self.mfq = _Mfq(seg)
        self.live: list = []
        self.corrupt_ranges = list(corrupt)
        self.committed = seg.size if committed is None else committed


class _Capture:
    name = "capture"

    def __init__(self) -> None:
        self.got: list = []

    def dispatch(self, batch, end_offset: int) -> None:
        chunks = [(list(s), list(a), [tuple(r) for r in runs], k) for s, a, runs, k, _cq in batch.chunks] \
            if batch else []
        self.got.append((chunks, end_offset))


def run_dispatch(data: bytes, corrupt: list, chunk: int, max_batch: int, scan, committed: int | None = None,
                 rounds: int = 10_000, errors: tuple = (RuntimeError, UnicodeDecodeError)):
    """Dispatch the segment `data` (records from offset 0) round after round, with `scan` as the
    C scan (None: the Python loop). Returns (batches handed over, dispatched offset, the error of
    a kind in `errors` as (type, message) or None, the topic cache, the names cache)."""
    seg = _Seg(data)
    cap = _Capture()
    clog = _Clog(seg, corrupt, committed)
    svc = DispatchService(clog, [cap], chunk, 1000, max_batch=max_batch)
    svc.c_scan = scan
    err = None
    try:
        for _ in range(rounds):
            if svc.dispatched >= clog.committed:
                break
            at = svc.dispatched
            svc.dispatch_round()
            if svc.dispatched == at:        # the rest of a record is not committed: it waits
                break
    except errors as e:
        err = (type(e), str(e))
    finally:
        seg.mm.close()
    return cap.got, svc.dispatched, err, dict(svc._topic_cache), dict(svc._names_cache)
