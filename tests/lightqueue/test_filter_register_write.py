"""Registering a wildcard filter anew (a new persistent session's SUBSCRIBE, a reconnect storm): its
reference count and its epoch go in one metadata write, with no read before it (was: a read, a
count write, an epoch write); both are on disk after a reopen; a failed write leaves the filter
unregistered."""
from __future__ import annotations

import pytest

from lmqtt.lightqueue.errors import MetadataError
from tests.lightqueue.pairs import open_pair, publish


class _Counting:
    """The metadata's RocksDB handle, counting the calls that write or read one key."""

    def __init__(self, db) -> None:
        self._db = db
        self.writes = 0
        self.gets = 0

    def put(self, *a, **kw):
        self.writes += 1
        return self._db.put(*a, **kw)

    def write(self, *a, **kw):
        self.writes += 1
        return self._db.write(*a, **kw)

    def get(self, *a, **kw):
        self.gets += 1
        return self._db.get(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._db, name)


def test_a_new_wildcard_filter_is_one_write_and_survives_a_reopen(tmp_path):
    st, lq = open_pair(tmp_path)
    st.start()
    publish(st, lq, "d/1/x", b"before")               # the log does not start at 0
    md = lq.metadata
    real, md._db = md._db, _Counting(md._db)
    try:
        assert lq.register_filter("d/+/x") == 1
        assert (md._db.writes, md._db.gets) == (1, 0)
        assert lq.register_filter("d/+/x") == 2          # a second holder: the count only
        assert lq.register_filter("plain/topic") == 1
        assert (md._db.writes, md._db.gets) == (3, 0)
    finally:
        md._db = real
    ep = lq.filter_epoch("d/+/x")
    assert ep is not None and ep[0] > 0
    publish(st, lq, "d/2/x", b"after")
    assert [m.body for m in lq.pull("d/+/x", 0).messages] == [b"after"]
    st.shutdown()
    lq.close()

    st, lq = open_pair(tmp_path)
    st.start()
    try:
        assert lq.registry.refcount("d/+/x") == 2 and lq.registry.refcount("plain/topic") == 1
        assert lq.metadata.get_filter_epoch("d/+/x") == ep
        assert lq.register_filter("d/+/x") == 3
        assert lq.unregister_filter("d/+/x") == 2
    finally:
        st.shutdown()
        lq.close()


def test_a_failed_registration_leaves_the_filter_out(pair):
    st, lq = pair
    lq.metadata.close()                                 # every write now refused
    with pytest.raises(MetadataError):
        lq.register_filter("gone/+")
    assert lq.registry.refcount("gone/+") == 0
    assert lq.filter_epoch("gone/+") is None
    assert lq.queues_for_topic("gone/x") == ("gone/x",)
