"""The parked-socket watcher (gateway/net/_park.c) against its pure-Python reference
(`parking.PyParker`) over real socket pairs: packet sequences split at random boundaries, sent
chunk by chunk with a poll after each. Both must answer exactly the leading PINGREQs (one PINGRESP
each), hand the socket back at the first other byte with every byte after the answered PINGREQs
intact and in order (what they did not read stays in the socket), keep a PINGREQ split across
reads, report EOF, and note the time of the last byte."""
from __future__ import annotations

import os
import socket
import time

import pytest
from hypothesis import given, settings, strategies as st

from lmqtt.gateway.net import parking

_C = parking._park
needs_c = pytest.mark.skipif(_C is None, reason="lmqtt.gateway.net._park not built (or LMQTT_PURE_PYTHON set)")
IMPLS = [parking.PyParker] + ([_C.Parker] if _C is not None else [])

PING = b"\xc0\x00"


@pytest.mark.skipif(os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0"),
                    reason="LMQTT_PURE_PYTHON is set: the C module is off on purpose")
def test_the_c_module_is_built_and_used():
    assert _C is not None, "lmqtt.gateway.net._park was not built: `pip install -e .` needs a C compiler"
    assert parking.Parker is _C.Parker


def _drain(sock: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            d = sock.recv(65536)
        except BlockingIOError:
            return out
        if not d:
            return out
        out += d


def run(impl, chunks: list[bytes], close: bool):
    """Send `chunks` one by one (a poll after each), then maybe close: what the client got back,
    what was handed back (data, eof) or None, and what stayed in the socket unread."""
    client, server = socket.socketpair()
    client.setblocking(False)
    server.setblocking(False)
    p = impl()
    owner = object()
    p.add(server.fileno(), owner)
    handed = None
    try:
        for ch in chunks:
            client.sendall(ch)
            if handed is not None:
                continue                 # handed back: the rest stays in the socket, unread
            got = p.poll()
            if got:
                assert len(got) == 1 and got[0][0] is owner and got[0][1] == server.fileno()
                handed = (got[0][2], got[0][3])
        if handed is None and close:
            client.shutdown(socket.SHUT_WR)
            got = p.poll()
            assert len(got) == 1 and got[0][0] is owner
            handed = (got[0][2], got[0][3])
        pending = b""
        if handed is None:
            assert len(p) == 1
            r = p.remove(server.fileno())
            assert r[0] is owner
            pending = r[1]
        assert len(p) == 0
        time.sleep(0)
        replies = _drain(client)
        left = _drain(server)
        return replies, handed, pending, left, p.pings
    finally:
        p.close()
        client.close()
        server.close()


packets = st.one_of(
    st.just(PING),
    st.just(b"\xe0\x00"),                                      # DISCONNECT
    st.just(b"\x30\x05\x00\x01tab"),                           # PUBLISH QoS 0
    st.just(b"\xc0\x01\x00"),                                  # a malformed PINGREQ
    st.binary(min_size=1, max_size=20))


@settings(max_examples=300, deadline=None)
@given(seq=st.lists(packets, max_size=12), cuts=st.lists(st.integers(0, 200), max_size=8), close=st.booleans())
def test_c_equals_reference_and_the_model(seq, cuts, close):
    stream = b"".join(seq)
    bounds = sorted({0, len(stream), *[c % (len(stream) + 1) for c in cuts]})
    chunks = [stream[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    results = [run(impl, chunks, close) for impl in IMPLS]
    for r in results[1:]:
        assert r == results[0]
    replies, handed, pending, left, pings = results[0]
    k = 0
    while stream[2 * k:2 * k + 2] == PING:
        k += 1
    rest = stream[2 * k:]
    assert replies == b"\xd0\x00" * k and pings == k
    if handed is None:
        # only PINGREQs (and maybe the first byte of one more) arrived, and no EOF
        assert not close and rest in (b"", b"\xc0") and pending == rest and left == b""
    else:
        data, eof = handed
        assert data + left == rest          # intact, in order: what was read, then what was not
        assert eof == (close and rest in (b"", b"\xc0"))
        if not eof:
            assert data and not (data == b"\xc0")


@pytest.mark.parametrize("impl", IMPLS)
def test_a_split_pingreq_is_answered_once_whole(impl):
    client, server = socket.socketpair()
    client.setblocking(False)
    server.setblocking(False)
    p = impl()
    p.add(server.fileno(), "x")
    try:
        client.sendall(b"\xc0")
        assert p.poll() == [] and _drain(client) == b""
        client.sendall(b"\x00\xc0")
        assert p.poll() == [] and _drain(client) == b"\xd0\x00"
        client.sendall(b"\x00")
        assert p.poll() == [] and _drain(client) == b"\xd0\x00"
        assert p.pings == 2
        time.sleep(0.2)
        assert p.idle(server.fileno()) >= 0.15
        client.sendall(PING)
        p.poll()
        assert p.idle(server.fileno()) < 0.15
        with pytest.raises(ValueError):
            p.add(server.fileno(), "y")
        assert p.remove(server.fileno()) == ("x", b"")
        assert p.remove(server.fileno()) is None
        with pytest.raises(KeyError):
            p.idle(server.fileno())
    finally:
        p.close()
        client.close()
        server.close()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_reset_is_reported_as_eof(impl):
    lst = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(lst.getsockname())
    server, _ = lst.accept()
    server.setblocking(False)
    p = impl()
    p.add(server.fileno(), "x")
    try:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        client.close()                       # linger 0: RST
        deadline = time.monotonic() + 5
        got = []
        while not got and time.monotonic() < deadline:
            got = p.poll()
            time.sleep(0.01)
        assert got == [("x", server.fileno(), b"", True)]
        assert len(p) == 0
    finally:
        p.close()
        server.close()
        lst.close()


@pytest.mark.parametrize("impl", IMPLS)
def test_an_fd_that_is_not_an_int_is_refused_with_type_error(impl):
    """A float (or any non-integer) is no fd: `add`, `remove` and `idle` raise TypeError in both
    implementations, and nothing is parked; the Python reference used to answer `remove(3.0)` with
    None and `idle(3.0)` with KeyError, where the C Parker raised TypeError."""
    client, server = socket.socketpair()
    p = impl()
    try:
        fd = float(server.fileno())
        with pytest.raises(TypeError):
            p.add(fd, "x")
        assert len(p) == 0
        p.add(server.fileno(), "x")
        for call in (lambda: p.remove(fd), lambda: p.idle(fd), lambda: p.remove("3")):
            with pytest.raises(TypeError):
                call()
        assert len(p) == 1
    finally:
        p.close()
        client.close()
        server.close()


@pytest.mark.parametrize("impl", IMPLS)
def test_fd_arguments_outside_the_c_int_range_name_no_parked_socket(impl):
    """An int that is no fd (past the C int range, either side) is not parked: `remove` gives None
    and `idle` KeyError, never the socket whose fd its low 32 bits are; `add` refuses a negative
    one with ValueError and a too large one with OverflowError; `poll` clamps any max_events."""
    client, server = socket.socketpair()
    client.setblocking(False)
    server.setblocking(False)
    p = impl()
    p.add(server.fileno(), "x")
    try:
        for alias in (server.fileno() + 2 ** 32, server.fileno() - 2 ** 32, 2 ** 70, -2 ** 70):
            assert p.remove(alias) is None
            with pytest.raises(KeyError):
                p.idle(alias)
        assert len(p) == 1
        for bad in (-1, -2 ** 32, -2 ** 70):
            with pytest.raises(ValueError):
                p.add(bad, "y")
        for big in (2 ** 31, 2 ** 40, 2 ** 70):
            with pytest.raises(OverflowError):
                p.add(big, "y")
        client.sendall(PING)
        assert p.poll(2 ** 40) == [] and p.poll(-2 ** 40) == [] and p.pings == 1
        client.sendall(b"\xe0\x00")
        assert p.poll(2 ** 70) == [("x", server.fileno(), b"\xe0\x00", False)]
    finally:
        p.close()
        client.close()
        server.close()


_REFUSED_FD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
from lmqtt.gateway.net import parking
impl = parking._park.Parker if sys.argv[1] == "c" else parking.PyParker
p = impl()
for fd in (2 ** 31 - 1, 1 << 20):
    try:
        p.add(fd, "x")
    except OSError as e:
        print(e.errno, end=" ")
print(len(p))
"""


@pytest.mark.parametrize("impl", ["c", "python"])
def test_an_fd_the_kernel_refuses_is_refused_before_any_slot_is_made_for_it(impl):
    """`add` of an int that is no open fd raises the kernel's EBADF, as PyParker does; the C
    Parker once grew its slot array to that fd's number first (2**31 - 1: a 48 GiB allocation,
    a MemoryError). Run in a child process with 1 GiB of address space, so a regression fails
    there and cannot take a machine's memory."""
    import errno
    import subprocess
    import sys
    if impl == "c" and _C is None:
        pytest.skip("lmqtt.gateway.net._park not built (or LMQTT_PURE_PYTHON set)")
    out = subprocess.run([sys.executable, "-c", _REFUSED_FD, impl], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(errno.EBADF), str(errno.EBADF), "0"]
