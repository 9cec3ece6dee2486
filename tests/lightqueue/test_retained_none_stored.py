"""A metadata store that never held a retained message answers a SUBSCRIBE's retained lookup
without a read (a reconnect storm), and one that holds any - set here, before a restart, or shipped
by a group's primary - still finds them."""
from __future__ import annotations

from lmqtt.lightqueue import MetadataStore
from lmqtt.lightqueue.metadata import P_RETAINED


def _found(md: MetadataStore, flt: str) -> list:
    return [m for batch in md.retained_batches(flt) for m in batch]


def test_no_retained_stored_answers_empty_without_a_read(tmp_path):
    md = MetadataStore(str(tmp_path / "meta"))
    try:
        got = md.retained_batches("st/d/1/+")
        assert got == () and not got          # falsy: the SUBSCRIBE skips its retained step
        assert not md.retained_batches("exact/topic")
        assert md.retained_matching("#") == []
    finally:
        md.close()


def test_retained_set_here_after_restart_and_shipped_are_found(tmp_path):
    p = str(tmp_path / "meta")
    md = MetadataStore(p)
    md.set_retained("a/b", b"hello")
    assert [(t, bytes(v)) for t, v, _ in _found(md, "a/+")] == [("a/b", b"hello")]
    md.set_retained("a/b", b"")                # cleared: an empty range is read, nothing found
    assert _found(md, "a/+") == []
    md.set_retained("c/d", b"kept")
    md.close()

    md = MetadataStore(p)                      # a restart sees the stored one
    try:
        assert [t for t, _, _ in _found(md, "#")] == ["c/d"]
    finally:
        md.close()

    replica = MetadataStore(str(tmp_path / "replica"))
    try:
        assert not replica.retained_batches("x/#")
        replica.apply_replicated([(P_RETAINED + b"x/y", b"\x00\x00\x00\x02hi")])   # u32 length + payload
        assert [(t, bytes(v)) for t, v, _ in _found(replica, "x/#")] == [("x/y", b"hi")]
    finally:
        replica.close()
