"""The PRODUCE body's per-message codec: a fleet gateway's batch of Messages packed into a PRODUCE,
the store server's unpacking of it into Messages (whoever sent it: a gateway or an SDK producer,
which packs its own tuples with `protocol.encode_messages_for_produce`), and the PRODUCED answer
built from the append's columns. Each is the C loop of store/_produce.c when built, beside the Python reference
here that tests compare it with (tests/store/test_produce_accel.py; the decoder, which reads a
peer's bytes, is fuzzed against its reference by tests/fuzz/fuzz_produce.py):

* `encode_within(messages, limit)`  Messages -> the packed messages of a PRODUCE body, or None
  when C cannot pack them (not built, a field of another type or range, or a message whose topic,
  props and body pass `limit` bytes: the caller checks and packs with the reference); reference: `protocol.encode_messages_for_produce` of (topic, body, keys, props, queue_id, born_ts).
* `produce_messages(body, route, now)`  PRODUCE body -> (producer id, sequence, [Message]);
  reference: `produce_messages_py`, itself `protocol.decode_produce` + one `Message(...)` per item.
* `produced_body(results)`  append results -> PRODUCED body; reference: `protocol.encode_produced`.

Why: under `serve --workers 2` every message crosses this body twice, once packed by the gateway
that received it and once unpacked by the store, and each batch's answer is built per run of
records (per record in a fan-in of many topics). py-spy put the store's two loops at ~16 % of its
main thread and the gateway's packing at 4-8 % of a gateway's (`bench external --brokers
lmqtt-workers`); in Python they cost ~0.6-0.8 us (unpack), ~0.4 us (pack, with the tuple per
message) and ~0.17 us (answer) per message.

Why a module of its own: the pack runs on fleet gateways, the unpack and the answer in the store
server; what they share is the body's layout (store/protocol.py MSG_HEAD, PRODUCE_HEAD)
and the Message type, which the C loops read and write by slot (configured at import: a changed
layout or Message is refused by name, store/accel.py).
"""
from __future__ import annotations

import sys
from array import array
from itertools import accumulate

from . import accel, protocol as W
from .message import CHUNK_RUNS, CHUNK_SIZES, CHUNK_STARTS, DR_PHYS, DR_QUEUE_OFFSET, DispatchRequest, Message

_MSG_NEW = object.__new__
_HEAD = W.MSG_HEAD
_U16 = W.struct.Struct(">H")
_U32 = W.struct.Struct(">I")
_BIG_ENDIAN = sys.byteorder == "big"


def encode_produce_messages_py(messages) -> bytes:
    """The packed messages of a PRODUCE body for these Messages (the reference of the C pack)."""
    return W.encode_messages_for_produce([(m.topic, m.body, m.keys, m.props, m.queue_id, m.born_ts)
                                          for m in messages])


def produce_messages_py(body: bytes, route, now: int):
    """-> (producer_id, seq, [Message]) exactly as `decode_produce` + `Message(topic, body, qid, 0,
    props, keys, born or now, route(topic))` would give; ProtocolError on the same inputs.

    Items of one batch that share topic, keys and props share their decoded objects (one decode,
    one `route` call per distinct topic in the batch; routes are never cached across batches, since
    a filter registered between two batches changes them)."""
    try:
        (plen,) = _U16.unpack_from(body, 0)
        pos = 2 + plen
        pid = body[2:pos].decode()
        seq, count = W.PRODUCE_HEAD.unpack_from(body, pos)
        pos += W.PRODUCE_HEAD.size
        n = len(body)
        unpack = _HEAD.unpack_from
        hs = _HEAD.size
        out = []
        append = out.append
        shapes: dict[tuple, tuple] = {}     # (topic len, keys len, topic + keys + props) -> (topic, keys, props, dq)
        routes: dict[str, tuple] = {}
        new = _MSG_NEW
        M = Message
        for _ in range(count):
            tl, kl, pl, bl, qid, born = unpack(body, pos)
            pos += hs
            meta_end = pos + tl + kl + pl
            end = meta_end + bl
            if end > n:
                raise W.ProtocolError(W.E_BAD_FRAME, "PRODUCE body truncated inside a message")
            # keyed by the lengths too: "a/b" with props b"c" and "a/bc" without are other shapes
            key = (tl, kl, body[pos:meta_end])
            shape = shapes.get(key)
            if shape is None:
                raw = key[2]
                topic = raw[:tl].decode()
                keys = tuple(raw[tl:tl + kl].decode().split("\x00")) if kl else ()
                dq = routes.get(topic)
                if dq is None:
                    dq = routes[topic] = tuple(route(topic)) if route is not None else ()
                shape = shapes[key] = (topic, keys, raw[tl + kl:], dq)
            m = new(M)
            m.topic = shape[0]
            m.body = body[meta_end:end]
            m.queue_id = qid
            m.flags = 0
            m.props = shape[2]
            m.keys = shape[1]
            m.born_ts = born or now
            m.dispatch_queues = shape[3]
            append(m)
            pos = end
        if pos != n:
            raise W.ProtocolError(W.E_BAD_FRAME, f"PRODUCE body has {n - pos} bytes after its {count} messages")
        return pid, seq, out
    except W.struct.error:
        raise W.ProtocolError(W.E_BAD_FRAME, "PRODUCE body truncated") from None
    except UnicodeDecodeError:
        raise W.ProtocolError(W.E_BAD_FRAME, "PRODUCE topic/key/producer id is not UTF-8") from None


def produced_body_py(sizes: list, starts: list, runs: list) -> bytes:
    """The PRODUCED body of one append's columns (store/message.py chunk: record sizes, each run's
    first record index, each run's first DispatchRequest): physical offsets are the running sum
    of sizes from the run's first record, queue offsets count up by one. The reference of the C
    `produced_body`; byte-identical to `encode_produced([(r.phys_offset, r.queue_offset) for r in
    results])` of the AppendResults they come from."""
    phys_at, qoff_at = DR_PHYS, DR_QUEUE_OFFSET      # locals: read once per run below
    n = len(sizes)
    flat = array("Q", bytes(16 * n))
    nr = len(runs)
    for k in range(nr):
        r = runs[k]
        i0 = starts[k]
        i1 = starts[k + 1] if k + 1 < nr else n
        if i1 - i0 == 1:
            flat[2 * i0] = r[phys_at]
            flat[2 * i0 + 1] = r[qoff_at]
            continue
        flat[2 * i0:2 * i1:2] = array("Q", accumulate(sizes[i0:i1 - 1], initial=r[phys_at]))
        qoff = r[qoff_at]
        flat[2 * i0 + 1:2 * i1:2] = array("Q", range(qoff, qoff + i1 - i0))
    if not _BIG_ENDIAN:
        flat.byteswap()
    return _U32.pack(n) + flat.tobytes()



# What the C loops read and write, from the one Python definition of each, handed over at import;
# store/_produce.c checks it against the offsets and slots it was written for and refuses to run
# until it has accepted it (a ValueError here names what differs: rebuild the extension).
C_LAYOUT = {
    "msg_head_format": W.MSG_HEAD.format,
    "produce_head_format": W.PRODUCE_HEAD.format,
    "message": Message,
    "dispatch_request": DispatchRequest,
    "protocol_error": W.ProtocolError,
    "e_bad_frame": W.E_BAD_FRAME,
}

_produce = accel.load("lmqtt.store._produce")
if _produce is not None:
    _produce.configure(C_LAYOUT)
    _c_encode = _produce.encode_messages
    _c_body = _produce.produced_body
    produce_messages = _produce.produce_messages
else:
    _c_encode = None
    produce_messages = produce_messages_py
    _c_body = produced_body_py


def encode_within(messages, limit: int) -> bytes | None:
    """The packed messages of a PRODUCE body, packed in C, or None: when C is not built, when a
    message's topic, props and body bytes pass `limit` (0: none), or when a field is of another
    type or range. On None the caller checks its limits (refusing a message by name before
    anything is sent) and packs with `encode_produce_messages_py`, which raises where it always did."""
    return None if _c_encode is None else _c_encode(messages, limit)


def produced_body(results) -> bytes:
    """PRODUCED body for the results of one `append_batch`, byte-identical to
    `encode_produced([(r.phys_offset, r.queue_offset) for r in results])`: from the store's
    columnar `AppendResults` (store/message.py) when it has them, without building a tuple per
    record."""
    chunk = getattr(results, "_chunk", None)
    if chunk is None or getattr(results, "_items", None) is not None:
        return W.encode_produced([(r.phys_offset, r.queue_offset) for r in results])
    return _c_body(chunk[CHUNK_SIZES], chunk[CHUNK_STARTS], chunk[CHUNK_RUNS])
