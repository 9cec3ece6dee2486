"""The metadata store knows how many will records it holds (a reconnect storm): with none, a CONNECT's
`void_will` and a disconnect's `pop_will` read nothing (was: a RocksDB read per CONNECT); with some,
they read as before; the count survives a reopen and `take_wills`, and a replica's shipped writes
make it unknown (then every pop reads)."""
from __future__ import annotations

from lmqtt.lightqueue.metadata import P_WILL, MetadataStore
from lmqtt.lightqueue.records import WillRecord
from tests.lightqueue.test_filter_register_write import _Counting


def test_no_will_no_read_and_the_count_follows_puts_pops_reopen_take_and_replication(tmp_path):
    path = str(tmp_path / "md")
    md = MetadataStore(path)
    real, md._db = md._db, _Counting(md._db)
    md.void_will("c1")
    assert md.pop_will("c1") is None
    assert md._db.gets == 0                       # no will anywhere: nothing read
    md.put_will("c1", WillRecord("w/1", b"x"))
    md.put_will("c1", WillRecord("w/1", b"y"))   # replaced, still one
    md.put_will("c2", WillRecord("w/2"))
    gets = md._db.gets
    md.void_will("c3")                            # wills held: read as before
    assert md._db.gets == gets + 1
    assert md.pop_will("c1").payload == b"y"
    md.void_will("c2")
    assert md.get_will("c2") is None
    gets = md._db.gets
    md.void_will("c4")
    assert md._db.gets == gets                    # none left: no read again
    md.put_will("c5", WillRecord("w/5"))
    md._db = real
    md.close()

    md = MetadataStore(path)                      # the will on disk is counted at open
    assert md.pop_will("c6") is None and md.get_will("c5") is not None
    assert [cid for cid, _w in md.take_wills()] == ["c5"]
    real, md._db = md._db, _Counting(md._db)
    md.void_will("c5")
    assert md._db.gets == 0                       # taken: none left
    md._db = real
    md.apply_replicated([(P_WILL + b"c7", WillRecord("w/7").to_bytes())])   # a primary's write
    assert md.pop_will("c7").topic == "w/7"       # not known any more: read
    md.close()
