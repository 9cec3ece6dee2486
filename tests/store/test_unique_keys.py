"""PRODUCE with F_UNIQUE_KEYS (store/unique_keys.py): at most one record per (topic, first key),
on a real MessageStore and StoreServer. The gateway sends an inbound QoS 2 message's key this way,
so that a stalled gateway's late append and the client's PUBLISH sent again to another gateway
store the message once (the end-to-end case: tests/e2e/test_e2e_qos2_inbound_crash.py)."""
from __future__ import annotations

import time

import pytest

from lmqtt.store import MessageStore, StoreConfig, protocol as W


@pytest.fixture(params=["async", "sync"])
def server(tmp_path, request):
    from lmqtt.store.server import StoreServer
    cfg = StoreConfig(data_dir=str(tmp_path / "store"), segment_size=1 << 20, max_message_size=64 << 10, preallocate=False,
                      flush_mode=request.param)
    with MessageStore(cfg) as st:
        srv = StoreServer(st, str(tmp_path / "meta"))
        try:
            yield srv
        finally:
            srv.meta.close()


def body(items, pid="", seq=0):
    return W.encode_produce(pid, seq, len(items), W.encode_messages_for_produce(
        [(t, b, k, b"", 0, 0) for t, b, k in items]))


def bodies(st, topic):
    st.wait_dispatched(st.clog.wrote, 10)
    return [m.body for m in st.read_consume_queue(topic, 0, 0, 100)]


def test_a_key_stored_already_is_answered_with_its_offsets_and_not_written(server):
    st = server.store
    first, _d, dup = server.produce(body([("qa", b"one", ("mqtt-qos2:k1",))]), W.F_UNIQUE_KEYS)
    assert not dup
    wrote = st.clog.wrote
    # at once (before dispatch caught up: the server's own list) and after (the key index)
    again, durable, dup = server.produce(body([("qa", b"one", ("mqtt-qos2:k1",))]), W.F_UNIQUE_KEYS)
    assert dup and again == first and st.clog.wrote == wrote
    if durable is not None:                     # sync: answered once the first record is durable
        durable.result(10)
    assert st.wait_dispatched(st.clog.wrote, 10)
    server.unique._recent.clear()               # as after a restart: only the index knows it
    assert server.produce(body([("qa", b"one", ("mqtt-qos2:k1",))]), W.F_UNIQUE_KEYS)[0] == first
    assert bodies(st, "qa") == [b"one"] and server.unique.duplicates == 2


def test_a_batch_mixing_new_stored_and_repeated_keys_answers_every_message_in_order(server):
    st = server.store
    server.produce(body([("qb", b"old", ("mqtt-qos2:old",))]), W.F_UNIQUE_KEYS)
    old = st.consume_queue_offsets("qb", 0)
    out, _d, dup = server.produce(body([("qb", b"plain", ()), ("qb", b"old", ("mqtt-qos2:old",)),
                                        ("qb", b"new", ("mqtt-qos2:new",)), ("qb", b"new", ("mqtt-qos2:new",)),
                                        ("qc", b"old", ("mqtt-qos2:old",))]), W.F_UNIQUE_KEYS)
    got = W.decode_produced(out)
    assert not dup and len(got) == 5
    assert got[1][1] == old[0] and got[3] == got[2]      # the stored one's offsets; the batch's first
    assert bodies(st, "qb") == [b"old", b"plain", b"new"]
    assert bodies(st, "qc") == [b"old"]                  # a key is unique per topic


def test_without_the_flag_keys_are_not_looked_at(server):
    st = server.store
    items = [("qd", b"x", ("k",))]
    server.produce(body(items), W.F_UNIQUE_KEYS)
    server.produce(body(items))
    assert bodies(st, "qd") == [b"x", b"x"]


def test_a_delayed_message_in_a_unique_batch_keeps_its_timer(server):
    """Parked messages (F_DELAYED) are always appended; a duplicate dropped before them does not
    shift which results their timers are armed with."""
    st = server.store
    st.enable_delayed(lambda t: (), None)
    server.produce(body([("qe", b"dup", ("mqtt-qos2:e",))]), W.F_UNIQUE_KEYS)
    due = int(time.time() * 1000) + 500
    b = body([("qe", b"dup", ("mqtt-qos2:e",)), ("qe", b"later", ())]) + W.encode_due_trailer([0, due])
    out, _d, _dup = server.produce(b, W.F_UNIQUE_KEYS | W.F_DELAYED)
    got = W.decode_produced(out)
    assert st.wait_dispatched(st.clog.wrote, 10) and st.read(got[1][0]).topic == "$timer"
    deadline = time.monotonic() + 10
    while bodies(st, "qe") != [b"dup", b"later"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert bodies(st, "qe") == [b"dup", b"later"]


class _RememberFails:
    """The real producer metadata, but remembering a batch's result fails as on a full disk
    (rocksdict's error text), once; everything else is the real RocksDB."""

    def __init__(self, meta) -> None:
        self._real, self.failures = meta, 1

    def __getattr__(self, name):
        return getattr(self._real, name)

    def remember(self, pid, seq, out):
        if self.failures:
            self.failures -= 1
            raise Exception("IO error: No space left on device: While appending to file: meta/000012.log")
        self._real.remember(pid, seq, out)


def test_a_unique_batch_stored_while_its_result_cannot_be_remembered_is_answered_stored(server):
    """A full metadata disk after the append: the reply still says stored (it is), the episode is
    reported, and the producer's retry is answered from the log, not stored again."""
    st = server.store
    real = server.meta
    server.meta = _RememberFails(real)
    try:
        msg = body([("qm", b"m", ("mqtt-qos2:km",))], pid="gw-1", seq=7)
        out, durable, _dup = server.produce(msg, W.F_UNIQUE_KEYS)
        if durable is not None:
            durable.result(10)
        [(_phys, qoff)] = W.decode_produced(out)
        assert qoff == 0
        assert server.meta_full and "SDK metadata" in (st.clog.disk.reason or "")
        again, _d, dup = server.produce(msg, W.F_UNIQUE_KEYS)      # the retry: same producer and seq
        assert dup and W.decode_produced(again) == W.decode_produced(out)
        assert not server.meta_full                                # remembered this time: episode over
        assert bodies(st, "qm") == [b"m"]
    finally:
        server.meta = real
