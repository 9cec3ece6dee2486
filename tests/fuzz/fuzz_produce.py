"""atheris harness for the store server's C unpack of a PRODUCE body into Messages (store/_produce.c
`produce_messages`, which reads the bytes a gateway or an SDK producer sent) against its reference,
store/produce.py `produce_messages_py`: the same producer id, sequence and Messages (field by
field, of type Message) or the same ProtocolError (code and message); nothing else may escape
either. Bodies are packed from the input (producer ids, topics and keys not always UTF-8, lengths
near the fields' limits, counts that lie) and then cut, extended or flipped. The same input's
messages are also packed by the C `encode_messages` against its reference (fields sometimes out of
the head's range or of another type: C must leave those to the reference), and a packed body must
unpack to the messages packed.

Run for a bounded time by tests/fuzz/test_fuzz_harnesses.py; the long run's command and result
are in BENCHMARKS.md.

    python3 tests/fuzz/fuzz_produce.py -max_total_time=600 [CORPUS_DIR]
"""
from __future__ import annotations

import sys

import atheris
from fuzz_input import Reader

with atheris.instrument_imports(include=["lmqtt"]):
    from lmqtt.store import protocol as W
    from lmqtt.store.message import Message
    from lmqtt.store.produce import _produce as C, encode_produce_messages_py, produce_messages_py

if C is None:
    sys.exit("lmqtt.store._produce is not built (or LMQTT_PURE_PYTHON is set): nothing to fuzz")

U32, U64 = 2 ** 32 - 1, 2 ** 64 - 1
_TEXT = [b"t", b"a/b", "ü/ñ".encode(), b"t\xffx", b"", b"k1\x00k2", b"\x00", b"\xed\xa0\x80"]


def route(topic: str) -> tuple:
    return (topic, topic[:1] + "/#") if "/" in topic else ()


def _text(r: Reader) -> bytes:
    return _TEXT[r.byte() % len(_TEXT)] if r.byte() & 1 else r.take(r.byte() % 8)


@atheris.instrument_func
def _body(r: Reader) -> bytes:
    pid = _text(r)
    parts = []
    n = r.byte() % 6
    for _ in range(n):
        f = r.byte()
        topic = _text(r)
        keys = _text(r) if f & 1 else b""
        props = r.take(r.byte() % 5)
        body = r.take(r.byte() % 20)
        lens = [len(topic), len(keys), len(props), len(body)]
        if f & 2:                           # a length that lies
            i = r.byte() % 4
            lens[i] = r.num(0, 0xFFFF if i < 3 else U32)
        parts.append(W.MSG_HEAD.pack(*lens, r.num(0, U32), r.num(0, U64)) + topic + keys + props + body)
    count = n if not r.byte() & 1 else r.num(0, U32)
    out = W.struct.pack(">H", len(pid) if r.byte() else r.num(0, 0xFFFF)) + pid + \
        W.PRODUCE_HEAD.pack(r.num(0, U64), count) + b"".join(parts)
    k = r.byte()
    if k & 1:
        out = out[:r.num(0, len(out))]
    if k & 2:
        out += r.take(r.byte() % 5)
    if k & 4 and out:
        b = bytearray(out)
        for _ in range(1 + r.byte() % 3):
            b[r.num(0, len(b) - 1)] ^= r.byte() | 1
        out = bytes(b)
    return out


def _unpack(fn, body: bytes, route_fn):
    try:
        pid, seq, msgs = fn(body, route_fn, 99)
    except W.ProtocolError as e:
        return ("error", e.code, str(e))
    assert all(type(m) is Message for m in msgs), msgs
    return pid, seq, [(m.topic, m.body, m.queue_id, m.flags, m.props, m.keys, m.born_ts, m.dispatch_queues)
                      for m in msgs]


@atheris.instrument_func
def _messages(r: Reader) -> list:
    out = []
    for _ in range(r.byte() % 5):
        f = r.byte()
        topic = _text(r).decode("utf-8", "surrogateescape")
        keys = tuple(_text(r).decode("utf-8", "surrogateescape") for _ in range(r.byte() % 3))
        m = Message(topic, r.take(r.byte() % 10), r.num(0, U32), 0, r.take(r.byte() % 4), keys, r.num(0, U64))
        if f & 1:                           # out of the head's range, or of another type
            which = r.byte() % 6
            if which == 0:
                m.topic = "x" * r.num(0xFFF0, 0x10010)
            elif which == 1:
                m.queue_id = r.num(0, U32) + (U32 + 1 if r.byte() & 1 else -(U32 + 1))
            elif which == 2:
                m.born_ts = -1 - r.num(0, 5)
            elif which == 3:
                m.body = bytearray(m.body)
            elif which == 4:
                m.keys = list(m.keys)
            else:
                m.props = b"p" * r.num(0xFFF0, 0x10010)
        out.append(m)
    return out


def _pack(fn, msgs):
    try:
        return fn(msgs)
    except Exception as e:  # noqa: BLE001 - compared by type with the reference's
        return type(e)


def TestOneInput(data: bytes) -> None:
    r = Reader(data)
    body = _body(r)
    route_fn = route if r.byte() & 1 else None
    got, want = _unpack(C.produce_messages, body, route_fn), _unpack(produce_messages_py, body, route_fn)
    if got != want:
        raise AssertionError(f"produce_messages and produce_messages_py differ on {body!r:.2000}:\n"
                             f"C:  {got!r:.2000}\nPy: {want!r:.2000}")
    msgs = _messages(r)
    limit = 0 if r.byte() & 1 else r.num(0, 70000)
    packed, ref = _pack(lambda ms: C.encode_messages(ms, limit), msgs), _pack(encode_produce_messages_py, msgs)
    if packed is not None and packed != ref:
        raise AssertionError(f"encode_messages and its reference differ on {msgs!r:.2000}:\n"
                             f"C:  {packed!r:.2000}\nPy: {ref!r:.2000}")
    if packed is not None and limit:        # packed only when every message is within the limit
        assert all(len(m.topic.encode()) + len(m.props) + len(m.body) <= limit for m in msgs), (limit, msgs)
    if type(packed) is bytes:               # what was packed unpacks to the messages packed
        # (keys compared as packed, joined by NUL: a key holding a NUL, or keys ("",), cannot come
        # back as they went; the protocol carries the joined string)
        _pid, _seq, back = C.produce_messages(W.encode_produce("p", 1, len(msgs), packed), None, 0)
        got = [(m.topic, m.body, m.props, "\x00".join(m.keys), m.queue_id) for m in back]
        sent = [(m.topic, bytes(m.body), m.props, "\x00".join(m.keys), m.queue_id) for m in msgs]
        if got != sent:
            raise AssertionError(f"packed and unpacked differ:\nsent {sent!r:.2000}\ngot  {got!r:.2000}")


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
