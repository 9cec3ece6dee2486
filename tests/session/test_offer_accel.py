"""The session machine's `offer` in C (gateway/session/_offer.c) against the Python `offer`, its
reference: random sessions (MQTT 3.1.1 and 5, subscription QoS, No Local, Retain As Published, a
small Receive Maximum, messages already in flight, the cursor part-way) offered random batches
(every QoS, retain, the session's own messages, offsets behind the cursor, messages sent before
to someone else, with and without a store time, a Message Expiry Interval that sends the batch
to the reference) under byte budgets from tiny to none, several offers in a row with acks in
between: the same frames, flags, window, cursor, packet-id allocator and counts."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings, strategies as st

from lmqtt.gateway.session import ClientSubscription, Counts, Cursor, MqttSession, OutboundMessage
from lmqtt.gateway.session import outbound
from lmqtt.gateway.storage.record_props import RecordMeta

_C = outbound._offer_c
needs_c = pytest.mark.skipif(_C is None, reason="lmqtt.gateway.session._offer not built (or LMQTT_PURE_PYTHON set)")
Q = "t/+"


@pytest.mark.skipif(os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0"),
                    reason="LMQTT_PURE_PYTHON is set: the C offer is off on purpose")
def test_the_c_offer_is_built_and_used():
    assert _C is not None, "lmqtt.gateway.session._offer was not built: `pip install -e .` needs a C compiler"


def _session(version, sub_qos, no_local, rap, receive_max, offset, next_pid) -> MqttSession:
    s = MqttSession("dev")
    cs = ClientSubscription(Q, Q, sub_qos, no_local=no_local, retain_as_published=rap)
    if cs.__class__ is not ClientSubscription:
        s.split_direct()
    s.subs[Q] = s.direct[Q] = cs
    s.cursors[Q] = Cursor(offset)
    s.connect(version, receive_max, None, None, 100, 1000)
    s.conn = object()
    s.next_pid = next_pid
    return s


msg_spec = st.tuples(st.sampled_from([0, 1, 2]), st.booleans(), st.sampled_from(["pub", "dev"]),
                     st.sampled_from([b"", b"x", b"y" * 50, b"z" * 300]), st.booleans(), st.sampled_from([0, 1234]),
                     st.integers(0, 40) .map(lambda n: n == 0))   # the last: a Message Expiry Interval (1 in 41)

batch = st.tuples(st.lists(msg_spec, max_size=12), st.integers(0, 4),         # messages, offsets skipped first
                  st.sampled_from([1, 30, 200, 1 << 20]), st.integers(0, 3))  # budget, acks after it


def _messages(specs, first_off: int, topic_n: int) -> list[OutboundMessage]:
    out = []
    for k, (qos, retain, pub, payload, sent, ts, expiring) in enumerate(specs):
        rec = RecordMeta(qos=qos, retain=retain, client_id=pub, message_expiry_interval=60 if expiring else None)
        it = OutboundMessage(f"t/{topic_n + k % 3}", payload, rec, first_off + k, -1, (Q,), ts)
        it.sent = sent
        out.append(it)
    return out


def _state(s: MqttSession, out: list, tally: Counts, flags: list):
    cur = s.cursors[Q]
    window = {pid: (inf[:8], inf[8].topic, inf[8].queue_offset, inf[9]) for pid, inf in s._window.items()}
    return (b"".join(out), flags, window, cur.next_offset, dict(cur._inflight or {}), s.next_pid,
            tally.msg_out, tally.first, tally.drops)


def _play(params, batches, c):
    saved = outbound._offer_c
    outbound._offer_c = c
    try:
        s = _session(*params)
        out: list[bytes] = []
        tally = Counts()
        flags = []
        off = params[5]
        for n, (specs, skip, budget, acks) in enumerate(batches):
            msgs = _messages(specs, max(0, off - skip), n)
            flags.append(s.offer(Q, msgs, max(0, off - skip) + len(msgs), out.append, tally, budget,
                                 None, 1_700_000_000_000.0))
            off = s.cursors[Q].next_offset
            for pid in list(s._window)[:acks]:          # the client acknowledges the oldest few
                inf = s._window[pid]
                if inf[1] == 1:
                    s.puback_received(pid)
                else:
                    s.pubrec_received(pid)
                    s.pubcomp_received(pid)
            for it in msgs:                              # what the encodings hold, per message
                out.append(repr(sorted(it.encodings)).encode())
        return _state(s, out, tally, flags)
    finally:
        outbound._offer_c = saved


@needs_c
@settings(max_examples=600, deadline=None)
@given(params=st.tuples(st.sampled_from([4, 5]), st.sampled_from([0, 1, 2]), st.booleans(), st.booleans(),
                        st.sampled_from([None, 1, 3, 20]), st.integers(0, 5), st.sampled_from([1, 65534, 65535, 300])),
       batches=st.lists(batch, min_size=1, max_size=4))
def test_c_offer_equals_the_python_offer(params, batches):
    assert _play(params, batches, _C) == _play(params, batches, None)


@needs_c
def test_a_batch_with_an_expiring_message_is_left_to_the_reference():
    s = _session(5, 1, False, False, None, 0, 1)
    msgs = _messages([(1, False, "pub", b"a", False, 0, False), (1, False, "pub", b"b", False, 0, True)], 0, 0)
    assert _C(s, Q, msgs, 2, [].append, Counts(), 1 << 20) is None
    assert not s._window and s.cursors[Q].next_offset == 0     # nothing done


@needs_c
def test_one_write_per_offer_with_the_frames_joined():
    s = _session(4, 1, False, False, None, 0, 1)
    writes: list[bytes] = []
    msgs = _messages([(1, False, "pub", b"p%d" % i, False, 5, False) for i in range(10)], 0, 0)
    assert s.offer(Q, msgs, 10, writes.append, Counts(), 1 << 20) == 0
    assert len(writes) == 1 and writes[0].count(b"\x32") >= 10
    assert sorted(s._window) == list(range(1, 11)) and s.cursors[Q].next_offset == 10
