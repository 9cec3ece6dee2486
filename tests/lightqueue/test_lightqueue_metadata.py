"""MetadataStore: offsets, sessions, retained messages, wills and filters survive restarts."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings, strategies as st

from lmqtt.lightqueue import (InvalidTopicFilter, MetadataStore, SessionRecord, Subscription,
                              WillRecord)
from lmqtt.lightqueue.registry import FilterRegistry
from tests.support import ROOT


def test_offsets_sessions_wills_survive_restart(tmp_path):
    p = str(tmp_path / "meta")
    md = MetadataStore(p)
    md.set_offsets("c1", {"a/b": 5, "a/+": 7})
    md.set_offsets("c2", {"a/b": 1})
    sess = SessionRecord("c1", protocol_version=5, expiry_interval=3600, last_disconnect_ms=123,
                         subscriptions=[Subscription("a/+", qos=1, no_local=True, subscription_id=9),
                                        Subscription("x/#", qos=2, share_group="g")],
                         extra={"inflight": [1, 2]})
    md.put_session("c1", sess)
    md.put_session("c2", SessionRecord("c2"))
    md.put_will("c1", WillRecord("dead/c1", b"\x00bye\xff", qos=1, retain=True, props=b"\x01\x02",
                                 delay_interval=5, created_ms=42))
    md.close()

    md = MetadataStore(p)
    assert md.get_offset("c1", "a/+") == 7
    assert md.get_offset("c1", "nope") is None
    assert md.get_offsets("c1") == {"a/b": 5, "a/+": 7}
    assert md.get_session("c1") == sess
    assert {s.client_id for s in md.list_sessions()} == {"c1", "c2"}
    assert [s.client_id for s in md.list_sessions(limit=1)] == ["c1"]        # pages, in client id order
    assert [s.client_id for s in md.list_sessions(after="c1", limit=1)] == ["c2"]
    assert md.list_sessions(after="c2") == []
    assert [(r.client_id, o) for r, o in md.sessions_with_offsets()] == [("c1", {"a/b": 5, "a/+": 7}), ("c2", {"a/b": 1})]
    w = md.get_will("c1")
    assert (w.topic, w.payload, w.props, w.qos, w.retain, w.delay_interval) == \
        ("dead/c1", b"\x00bye\xff", b"\x01\x02", 1, True, 5)
    assert [cid for cid, _ in md.list_wills()] == ["c1"]
    assert md.pop_will("c1") == w
    assert md.pop_will("c1") is None
    assert md.delete_session("c1") is True
    assert md.get_session("c1") is None
    assert md.get_offsets("c1") == {}            # a deleted session's offsets go with it
    assert md.get_offsets("c2") == {"a/b": 1}    # and nobody else's
    assert md.delete_session("c1") is False
    md.close()


def test_retained_lookup_by_filter(tmp_path):
    md = MetadataStore(str(tmp_path / "meta"))
    topics = ["a", "a/b", "a/b/c", "a/c", "ab/c", "b/b/c", "$SYS/load", "a//c"]
    for i, t in enumerate(topics):
        md.set_retained(t, f"p{i}".encode(), b"props")

    def m(f):
        return sorted(t for t, _, _ in md.retained_matching(f))

    assert m("a/#") == ["a", "a//c", "a/b", "a/b/c", "a/c"]     # not "ab/c", includes parent
    assert m("a/+") == ["a/b", "a/c"]
    assert m("+/b/c") == ["a/b/c", "b/b/c"]
    assert m("#") == sorted(t for t in topics if not t.startswith("$"))
    assert m("$SYS/#") == ["$SYS/load"]
    assert m("a/b") == ["a/b"]
    assert m("a/+/c") == ["a//c", "a/b/c"]
    assert md.retained_matching("a/b/c") == [("a/b/c", b"p2", b"props")]
    md.set_retained("a/b", b"")                                  # empty payload clears
    assert m("a/+") == ["a/c"]
    assert md.get_retained("a/b") is None
    with pytest.raises(InvalidTopicFilter):
        md.retained_matching("a/#/b")
    md.close()


def test_filter_registry_refcounts_persist(tmp_path):
    p = str(tmp_path / "meta")
    md = MetadataStore(p)
    reg = FilterRegistry(md)
    assert reg.register("a/+") == 1
    assert reg.register("a/+") == 2
    assert reg.register("a/#") == 1
    assert reg.register("a/b") == 1          # exact filter: counted, no extra queue
    qs = reg.queues_for_topic("a/b")
    assert qs[0] == "a/b" and sorted(qs[1:]) == ["a/#", "a/+"]   # exact topic queue first
    assert reg.unregister("a/#") == 0
    assert reg.queues_for_topic("a/b") == ("a/b", "a/+")    # result cache was invalidated
    with pytest.raises(InvalidTopicFilter):
        reg.register("a/#/b")
    md.close()
    md = MetadataStore(p)
    reg = FilterRegistry(md)
    assert reg.filters() == {"a/+": 2, "a/b": 1}
    assert reg.queues_for_topic("a/x") == ("a/x", "a/+")
    assert reg.unregister("a/+") == 1 and reg.unregister("a/+") == 0
    assert reg.queues_for_topic("a/x") == ("a/x",)
    md.close()


WRITER = r"""
import sys
from lmqtt.lightqueue import MetadataStore
md = MetadataStore(sys.argv[1])
i = 0
while True:
    md.set_offsets("c", {"q": i})
    md.set_retained(f"t/{i}", b"x" * 10)
    print(i, flush=True)
    i += 1
"""


@pytest.mark.slow
def test_acknowledged_metadata_survives_kill_9(tmp_path):
    """A write that returned is never lost, even if the process dies right after (WAL on)."""
    p = str(tmp_path / "meta")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, p], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
    last = -1
    deadline = time.monotonic() + 30
    try:
        for line in proc.stdout:
            last = int(line)
            if last >= 3000 or time.monotonic() > deadline:
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert last > 100
    md = MetadataStore(p)
    assert md.get_offset("c", "q") >= last
    assert all(md.get_retained(f"t/{i}") == (b"x" * 10, b"") for i in range(last + 1))
    md.close()


def test_retained_matching_equals_brute_force(tmp_path):
    """Prefix-narrowed scans return exactly what checking every retained topic would."""
    import random

    from lmqtt.lightqueue import topic_matches
    rnd = random.Random(11)
    words = ["a", "b", "ab", "", "$s", "é"]
    md = MetadataStore(str(tmp_path / "meta"))
    topics = set()
    for _ in range(300):
        t = "/".join(rnd.choice(words) for _ in range(rnd.randint(1, 4)))
        if t:
            topics.add(t)
            md.set_retained(t, t.encode() or b"-")
    filters = {"#", "+", "+/#", "a/#", "a", "ab/+", "a/+/b", "$s/#", "/#", "//+", "é/#", "a/b/#"}
    for _ in range(100):
        lv = [rnd.choice(words + ["+"]) for _ in range(rnd.randint(1, 4))]
        if rnd.random() < 0.4:
            lv[-1] = "#"
        f = "/".join(lv)
        if f:
            filters.add(f)
    for f in filters:
        got = sorted(t for t, _, _ in md.retained_matching(f))
        assert got == sorted(t for t in topics if topic_matches(f, t)), f
    md.close()


_text = st.text(max_size=12)
_subscriptions = st.builds(Subscription, filter=_text, qos=st.integers(0, 2), no_local=st.booleans(),
                           retain_as_published=st.booleans(), retain_handling=st.integers(0, 2),
                           subscription_id=st.none() | st.integers(1, 268435455),
                           share_group=st.none() | _text)


@settings(max_examples=200, deadline=None)
@given(st.builds(SessionRecord, client_id=_text, protocol_version=st.sampled_from([3, 4, 5]),
                 expiry_interval=st.integers(0, 0xFFFFFFFF), last_disconnect_ms=st.none() | st.integers(0, 2**53),
                 subscriptions=st.lists(_subscriptions, max_size=4),
                 extra=st.dictionaries(_text, st.integers() | _text | st.lists(st.integers(), max_size=3), max_size=3)))
def test_a_session_record_is_written_as_the_generic_dataclass_encoding_and_reads_back(rec):
    """The hand-built encoding is byte for byte what `dataclasses.asdict` + JSON gave (records
    written by earlier versions and by this one are the same), and it reads back equal."""
    import dataclasses
    import json
    old = json.dumps({**dataclasses.asdict(rec), "v": 1}, separators=(",", ":"), ensure_ascii=False).encode()
    assert rec.to_bytes() == old
    assert SessionRecord.from_bytes(rec.to_bytes()) == rec


def test_a_retained_message_is_cleared_only_if_it_is_still_the_one_found_expired(tmp_path):
    """`clear_retained_if`: the message found past its expiry is deleted; one that replaced it
    meanwhile (other properties) is kept."""
    md = MetadataStore(str(tmp_path / "md"))
    md.set_retained("r/t", b"old", b"props-1")
    md.set_retained("r/u", b"new", b"props-3")
    assert md.clear_retained_if("r/t", b"props-1") is True
    assert md.get_retained("r/t") is None
    assert md.clear_retained_if("r/u", b"props-2") is False      # replaced since: kept
    assert md.get_retained("r/u") == (b"new", b"props-3")
    assert md.clear_retained_if("r/none", b"x") is False
    md.close()
