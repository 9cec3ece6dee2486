"""atheris harness for the parked-socket watcher (gateway/net/_park.c `Parker`, which reads the
bytes idle MQTT clients send) against its pure-Python reference (`parking.PyParker`): one
fuzzer-chosen script of calls and socket events, played on each over its own three real socket
pairs. Every call's result (handed-back data, EOF, pending 0xC0, owners, counts, PINGRESPs the
clients got) or the kind of error it raised must be the same, and so must what is left unread in
the sockets at the end; fds are compared by role (which pair's end), not by number. The script
may park and unpark sockets, send PINGREQ floods past the 4 KiB read buffer and the 16 reads of
one poll, split PINGREQs, shut down or close the client, shrink a send buffer (a PINGRESP that
does not fit), park the client end or a file, and pass fds out of the C int range. Run for a
bounded time by tests/fuzz/test_fuzz_harnesses.py; the long run's command and result are in
BENCHMARKS.md.

    python3 tests/fuzz/fuzz_park.py -max_total_time=600 [CORPUS_DIR]
"""
from __future__ import annotations

import reprlib
import resource
import socket
import sys
import tempfile

import atheris

with atheris.instrument_imports(include=["lmqtt"]):
    from lmqtt.gateway.net import parking

C = parking._park
if C is None:
    sys.exit("lmqtt.gateway.net._park is not built (or LMQTT_PURE_PYTHON is set): nothing to fuzz")

# a Parker sizes its slot array by the fd it is given: should it ever grow it for a huge fd, the
# address-space limit turns that into a MemoryError here instead of gigabytes of a shared machine
_soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
if _soft == resource.RLIM_INFINITY or _soft > 4 << 30:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, _hard))

PAIRS = 3
PING = b"\xc0\x00"
# a regular file: epoll refuses it (EPERM) in both
_FILE = tempfile.TemporaryFile()
# fds by role; the out-of-range ones are offsets from the first server end's fd
ROLES = ["s0", "s1", "s2", "c0", "c1", "c2", "file", "self", -1, "+2**32", "-2**32", 2 ** 31 - 1, 2 ** 31,
         -2 ** 31 - 1, 2 ** 63, -2 ** 63 - 1, 2 ** 70, 10 ** 6]
MAX_EVENTS = [256, 1, 2, 0, -5, 1024, 1025, 2 ** 31 - 1, -2 ** 31, 2 ** 31, 2 ** 40, -2 ** 40]


def _drain(sock: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            d = sock.recv(65536)
        except BlockingIOError:
            return out
        except OSError as e:
            return out + f"<{type(e).__name__}>".encode()
        if not d:
            return out
        out += d


def first_difference(got, want) -> str:
    """The first place two results differ, shortened (a PINGREQ flood's bytes run to kilobytes)."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = 200
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)) and len(got) == len(want):
        for i, (g, w) in enumerate(zip(got, want)):
            if g != w:
                return f"at [{i}]: " + first_difference(g, w)
    return f"C:  {short.repr(got)}\nPy: {short.repr(want)}"


def _err(e: BaseException) -> str:
    """The kind of an error: its type (messages may differ between C and Python)."""
    return type(e).__name__


class _World:
    """One implementation's Parker over its own socket pairs."""

    def __init__(self, impl) -> None:
        self.pairs = [socket.socketpair() for _ in range(PAIRS)]
        for c, s in self.pairs:
            c.setblocking(False)
            s.setblocking(False)
        self.closed = [False] * PAIRS
        self.p = impl()
        self.p_closed = False
        self.names = {}
        for k, (c, s) in enumerate(self.pairs):
            self.names[s.fileno()] = f"s{k}"
            self.names[c.fileno()] = f"c{k}"

    def fd(self, role):
        if isinstance(role, int):
            return role
        if role == "file":
            return _FILE.fileno()
        if role == "self":
            return -1 if self.p_closed else self.p.fileno()
        base = self.pairs[0][1].fileno()
        if role == "+2**32":
            return base + 2 ** 32
        if role == "-2**32":
            return base - 2 ** 32
        k = int(role[1])
        c, s = self.pairs[k]
        if self.closed[k] and role[0] == "c":
            return -1               # a closed client end: its number may be taken by anything
        return (s if role[0] == "s" else c).fileno()

    def name(self, fd: int):
        return self.names.get(fd, fd)

    def close(self) -> None:
        try:
            self.p.close()
        finally:
            for c, s in self.pairs:
                c.close()
                s.close()


# the functions that turn the input into choices are instrumented too (@atheris.instrument_func): their
# branches guide the fuzzer to every kind of input, not only to new paths of the reference
@atheris.instrument_func
def _step(w: _World, op: int, a: int, b: int, data: bytes):
    p = w.p
    k = a % PAIRS
    client, server = w.pairs[k]
    try:
        if op == 0:                       # the client sends
            if w.closed[k]:
                return "closed"
            kind = b % 4
            payload = data if kind == 0 else PING * (1 + a * 157) + (data[:1] if kind == 2 else b"")    # up to 80 KiB
            if kind == 3:
                payload = b"\xc0"
            try:
                return ("sent", client.send(payload))
            except OSError as e:
                return ("send", _err(e))
        if op == 1:
            got = p.poll(MAX_EVENTS[b % len(MAX_EVENTS)])
            return ("poll", [(owner, w.name(fd), d, eof) for owner, fd, d, eof in got])
        if op == 2:
            r = p.remove(w.fd(ROLES[b % len(ROLES)]))
            return ("remove", r)
        if op == 3:
            t = p.idle(w.fd(ROLES[b % len(ROLES)]))
            return ("idle", type(t).__name__, 0 <= t < 3600)
        if op == 4:
            return ("add", p.add(w.fd(ROLES[b % len(ROLES)]), f"owner{a % 5}"))
        if op == 5:
            return ("len", len(p), "pings", p.pings)
        if op == 6:
            w.p_closed = True
            return ("close", p.close())
        if op == 7:
            return ("fileno", type(p.fileno()).__name__)
        if op == 8:                       # EOF from the client
            if w.closed[k]:
                return "closed"
            client.shutdown(socket.SHUT_WR)
            return "shut"
        if op == 9:                       # the client goes away (its unread PINGRESPs with it)
            if w.closed[k]:
                return "closed"
            client.close()
            w.closed[k] = True
            return "gone"
        if op == 10:
            return ("replies", b"" if w.closed[k] else _drain(client))
        # else: a send buffer too small for a PINGREQ flood's answers
        server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 + a * 97)
        return "sndbuf"
    except Exception as e:    # noqa: BLE001 - compared by kind below
        return ("raised", op, _err(e))


def _play(impl, script):
    w = _World(impl)
    try:
        out = [_step(w, *s) for s in script]
        left = [_drain(s) for _c, s in w.pairs]                     # what the parker did not read
        replies = [b"" if w.closed[k] else _drain(c) for k, (c, _s) in enumerate(w.pairs)]
        return out, left, replies, len(w.p), w.p.pings
    finally:
        w.close()


@atheris.instrument_func
def script_of(data: bytes) -> list:
    """The input as up to 24 steps of three bytes (op, a, b), a send's followed by its length (a
    byte, at most 64) and its bytes."""
    script = []
    i = 0
    while i + 3 <= len(data) and len(script) < 24:
        op, a, b = data[i] % 12, data[i + 1], data[i + 2]
        i += 3
        payload = b""
        if op == 0 and i < len(data):
            n = data[i] % 65
            payload = data[i + 1:i + 1 + n]
            i += 1 + n
        script.append((op, a, b, payload))
    return script


def TestOneInput(data: bytes) -> None:
    script = script_of(data)
    got = _play(C.Parker, script)
    want = _play(parking.PyParker, script)
    if got != want:
        raise AssertionError(f"C Parker and PyParker differ on {data!r}\nscript {script}\n{first_difference(got, want)}")


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
