"""The metadata of a real `lmqtt store` on a full disk: the directory of one of its RocksDBs is a
tmpfs of its own, filled, so that its writes fail while the rest of the store's do not.

A gateway's hold on a wildcard filter and the light-queue registry's count of it are two writes in
two RocksDBs (the SDK metadata, the light-queue metadata); what subscribers rely on: a filter some
gateway still holds stays indexed, after a restart too, and a count that disagrees with the holds
is repaired at start. The POP state, written every tick, is logged once per failing episode. A
refusal names the database that is full, and RocksDB's refusals after a failed write are answered
as store errors, not internal ones."""
from __future__ import annotations

import os
import time

import pytest

from lmqtt.loadtest.chaos.disk import SmallDisk, can_mount_tmpfs
from lmqtt.store.client import StoreClientError, connect
from tests.support import LmqttStore

pytestmark = pytest.mark.skipif(not can_mount_tmpfs(), reason="needs root to mount a tmpfs (mount -t tmpfs)")


def _max(c, q: str) -> int:
    return c.cmd("gw_max_offsets", queues=[q])["max_offsets"][q]


def _until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _fill(disk, c) -> None:
    """Fill the disk, then write SDK metadata (another gateway's hold, taken and let go) until
    RocksDB finds no room: its WAL's last page took the first writes."""
    disk.fill(0)
    for _ in range(20_000):
        try:
            c.cmd("gw_register", gateway="filler", filter="z/#")
            c.cmd("gw_unregister", gateway="filler", filter="z/#")
        except StoreClientError as e:
            assert "disk full" in str(e), e
            return
    raise AssertionError("the SDK metadata never ran out of space")


def _free(disk, c) -> None:
    """Free the disk and wait until the SDK metadata takes writes again (its RocksDB resumes by
    itself once space is back)."""
    disk.free()

    def writable() -> bool:
        try:
            c.cmd("gw_register", gateway="filler", filter="z/#")
            return True
        except StoreClientError:
            return False
    _until(writable, 30, "the SDK metadata to take writes again")


@pytest.fixture
def store_with_small_sdk_meta(tmp_path):
    """An `lmqtt store` whose `sdk-meta` directory is a 16 MiB tmpfs (`disk.fill()` fills it)."""
    data = tmp_path / "data"
    os.makedirs(data / "sdk-meta")
    disk = SmallDisk(str(data / "sdk-meta"), 16).mount()
    # a filter no holder is left with is dropped at once, not after the default linger: the
    # tests below check that a refused registration leaves nothing indexed
    store = LmqttStore(str(data), ("--filter-linger-s", "0"), log_path=str(tmp_path / "store.log"))
    try:
        yield store.start(), disk
    finally:
        store.stop()
        disk.umount()


def test_a_hold_let_go_while_the_disk_is_full_keeps_its_filter_indexed_for_the_other_holders(store_with_small_sdk_meta):
    store, disk = store_with_small_sdk_meta
    with connect(store.address) as c:
        assert c.cmd("gw_register", gateway="gw1", filter="h/#")["count"] == 1
        assert c.cmd("gw_register", gateway="gw2", filter="h/#")["count"] == 1
        _fill(disk, c)
        with pytest.raises(StoreClientError, match="disk full"):
            c.cmd("gw_unregister", gateway="gw1", filter="h/#")
        assert c.cmd("gw_filters", gateway="gw1")["filters"] == {"h/#": 1}    # refused: nothing changed
    store.kill9()
    disk.free()
    store.start()
    with connect(store.address) as c:
        assert c.cmd("gw_unregister", gateway="gw1", filter="h/#")["count"] == 0
        c.producer().send("h/x", b"1")
        # gw2 holds it still: its subscribers get the message
        _until(lambda: _max(c, "h/#") == 1, 10, "h/# to index h/x")
        assert c.cmd("gw_unregister", gateway="gw2", filter="h/#")["count"] == 0


def test_a_first_hold_refused_on_a_full_disk_leaves_its_filter_unregistered(store_with_small_sdk_meta):
    store, disk = store_with_small_sdk_meta
    with connect(store.address) as c:
        _fill(disk, c)
        with pytest.raises(StoreClientError, match="disk full"):
            c.cmd("gw_register", gateway="gw3", filter="r/#")
        _free(disk, c)
        assert c.cmd("gw_filters", gateway="gw3")["filters"] == {}
        p = c.producer()
        p.send("r/x", b"while refused")
        p.send("other/r", b"flush")
        _until(lambda: _max(c, "other/r") == 1, 10, "dispatch past a topic of no filter")
        assert _max(c, "r/#") == 0            # held by nobody: not indexed
        assert c.cmd("gw_register", gateway="gw3", filter="r/#")["count"] == 1
        p.send("r/x", b"held")
        _until(lambda: _max(c, "r/#") == 1, 10, "r/# to index r/x")


def test_an_sdk_subscribe_refused_on_a_full_disk_leaves_its_filter_unregistered(store_with_small_sdk_meta):
    store, disk = store_with_small_sdk_meta
    with connect(store.address) as c:
        _fill(disk, c)
        for _ in range(3):                    # the consumer retries
            with pytest.raises(StoreClientError, match="disk full"):
                c.cmd("subscribe", filter="s/#")
        _free(disk, c)
        p = c.producer()
        p.send("s/x", b"while refused")
        p.send("other/s", b"flush")
        _until(lambda: _max(c, "other/s") == 1, 10, "dispatch past a topic of no filter")
        assert _max(c, "s/#") == 0            # registered by nobody: not indexed
        c.cmd("subscribe", filter="s/#")
        assert c.cmd("unsubscribe", filter="s/#")["ok"] is True
        p.send("s/x", b"after")
        p.send("other/s", b"flush again")
        _until(lambda: _max(c, "other/s") == 2, 10, "dispatch past a topic of no filter")
        assert _max(c, "s/#") == 0            # let go by its one holder: not indexed


def test_registry_counts_that_disagree_with_the_holds_are_repaired_at_start(tmp_path):
    from lmqtt.lightqueue.metadata import MetadataStore

    store = LmqttStore(str(tmp_path / "data"), log_path=str(tmp_path / "store.log")).start()
    try:
        with connect(store.address) as c:
            c.cmd("gw_register", gateway="gw1", filter="k/#")
            c.cmd("gw_register", gateway="gw2", filter="k/#")
            c.cmd("subscribe", filter="k/#")              # an SDK consumer's registration: a third holder
        store.stop()
        # what a crash between a hold's write and the count's leaves: a count below its holders
        md = MetadataStore(str(tmp_path / "data" / "lightqueue" / "meta"))
        assert md.filters() == {"k/#": 3}
        md.set_filter_refs({"k/#": 1})
        md.close()
        store.start()
        assert "event=filter_count_repaired filter='k/#' count=1 holders=3" in store.log_tail()
        with connect(store.address) as c:
            assert c.cmd("gw_unregister", gateway="gw1", filter="k/#")["count"] == 0
            assert c.cmd("gw_unregister", gateway="gw2", filter="k/#")["count"] == 0
            c.producer().send("k/x", b"1")
            _until(lambda: c.cmd("filter_offsets", filter="k/#")["max_offset"] == 1, 10,
                   "k/# to index k/x for the SDK consumer")
    finally:
        store.stop()


def test_pop_state_that_cannot_be_written_is_logged_once_and_written_once_space_returns(store_with_small_sdk_meta):
    store, disk = store_with_small_sdk_meta
    with connect(store.address) as c:
        p = c.producer()
        for i in range(4):
            p.send("pq", b"%d" % i)
        _fill(disk, c)
        popped = c.cmd("pop", group="g", topic="pq", queue_id=0, max_count=2, invisible_ms=60000)
        assert len(popped[1]) == 2, popped
        # the state is written every 0.1 s and fails each time while the disk is full
        _until(lambda: "event=pop_persist_failed" in store.log_tail(100_000), 10, "the failure logged")
        time.sleep(1.0)
        assert store.log_tail(100_000).count("event=pop_persist_failed") == 1
        disk.free()
        _until(lambda: "event=pop_persist_resumed" in store.log_tail(100_000), 30, "the state written")
        assert c.admin().pop_info("g", "pq", 0)["inflight"] == 2
    store.kill9()
    store.start()
    with connect(store.address) as c:
        info = c.admin().pop_info("g", "pq", 0)       # as written once space was back
        assert (info["next"], info["inflight"]) == (2, 2), info


def test_a_full_light_queue_metadata_is_named_and_its_later_refusals_are_store_errors(tmp_path):
    data = tmp_path / "data"
    os.makedirs(data / "lightqueue" / "meta")
    disk = SmallDisk(str(data / "lightqueue" / "meta"), 16).mount()
    store = LmqttStore(str(data), log_path=str(tmp_path / "store.log")).start()
    try:
        with connect(store.address) as c:
            disk.fill(0)
            for i in range(20_000):            # registrations until RocksDB finds no room
                try:
                    c.cmd("gw_register", gateway="g", filter=f"z{i}/#")
                except StoreClientError as e:
                    assert "disk full: cannot write the light-queue metadata" in str(e), e
                    break
            else:
                raise AssertionError("the light-queue metadata never ran out of space")
            # RocksDB refuses every write after the failed one ("Writer has previous error")
            with pytest.raises(StoreClientError, match="store: metadata write refused: .*an earlier write failed"):
                c.cmd("gw_flush")
        assert "handler_failed" not in store.log_tail(100_000)
    finally:
        store.stop()
        disk.umount()
