"""Delay every packet of an NFQUEUE queue by a fixed time: the `delay` fault of the network bed
(loadtest/chaos/netbed.py), run inside the namespace whose packets it holds.

    python -m lmqtt.loadtest.chaos.nfdelay --queue 7 --delay-ms 200 [--max-seconds 3600]

An iptables rule `-j NFQUEUE --queue-num 7 --queue-bypass` hands packets to this process through
netfilter's queue netlink protocol (nfnetlink_queue: bind the queue, copy metadata only, read
each packet's id, answer a verdict). Each packet is accepted `delay` after it arrived; the delay
is the same for all, so they leave in order and one batch verdict (every id up to N) releases
what is due. Prints `bound` once the queue is bound. On SIGTERM, SIGINT or `--max-seconds` it
accepts everything still held and exits: the bed removes the rule first, so nothing is dropped.

Written against the netlink messages directly (about a hundred lines) rather than with
libnetfilter_queue's Python bindings, which need the C library's headers and a compiler on the
machine; the protocol is the kernel's (include/uapi/linux/netfilter/nfnetlink_queue.h).
"""
from __future__ import annotations

import argparse
import collections
import errno
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
MSG_PACKET, MSG_VERDICT, MSG_CONFIG, MSG_VERDICT_BATCH = 0, 1, 2, 3
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
CFG_CMD, CFG_PARAMS, CFG_QUEUE_MAXLEN, CFG_MASK, CFG_FLAGS = 1, 2, 3, 4, 5
CMD_BIND = 1
COPY_META = 1
F_FAIL_OPEN = 1
ATTR_PACKET_HDR = 1
ATTR_VERDICT_HDR = 2
NF_ACCEPT = 1


def _attr(kind: int, data: bytes) -> bytes:
    n = 4 + len(data)
    return struct.pack("=HH", n, kind) + data + b"\0" * (-n % 4)


def _msg(mtype: int, queue: int, attrs: list[bytes], flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + b"".join(attrs)
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | mtype, flags, seq, 0) + body


class Queue:
    """One bound NFQUEUE queue of this namespace."""

    def __init__(self, queue: int, maxlen: int = 65536) -> None:
        self.queue = queue
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self._ask(1, [_attr(CFG_CMD, struct.pack("=BBH", CMD_BIND, 0, 0))])
        self._ask(2, [_attr(CFG_PARAMS, struct.pack(">IB", 0, COPY_META))])
        self._ask(3, [_attr(CFG_QUEUE_MAXLEN, struct.pack(">I", maxlen))])
        # a full queue lets packets through rather than dropping them: the fault is a delay
        self._ask(4, [_attr(CFG_FLAGS, struct.pack(">I", F_FAIL_OPEN)), _attr(CFG_MASK, struct.pack(">I", F_FAIL_OPEN))])

    def _ask(self, seq: int, attrs: list[bytes]) -> None:
        self.sock.send(_msg(MSG_CONFIG, self.queue, attrs, NLM_F_REQUEST | NLM_F_ACK, seq))
        data = self.sock.recv(8192)
        _ln, typ, _fl, _sq, _pid = struct.unpack_from("=IHHII", data, 0)
        if typ == NLMSG_ERROR:
            err = struct.unpack_from("=i", data, 16)[0]
            if err:
                raise OSError(-err, f"nfqueue config step {seq}: {errno.errorcode.get(-err, err)}")

    def packet_ids(self, data: bytes):
        """The ids of the packets in one datagram from the kernel."""
        off = 0
        want = (NFNL_SUBSYS_QUEUE << 8) | MSG_PACKET
        while off + 16 <= len(data):
            ln, typ = struct.unpack_from("=IH", data, off)
            if ln < 16:
                return
            if typ == want:
                a = off + 20                      # nlmsghdr (16) + nfgenmsg (4)
                while a + 4 <= off + ln:
                    alen, akind = struct.unpack_from("=HH", data, a)
                    if alen < 4:
                        break
                    if akind & 0x7FFF == ATTR_PACKET_HDR:
                        yield struct.unpack_from(">I", data, a + 4)[0]
                    a += (alen + 3) & ~3
            off += (ln + 3) & ~3

    def accept_upto(self, packet_id: int) -> None:
        """Accept every packet held with an id up to `packet_id`."""
        self.sock.send(_msg(MSG_VERDICT_BATCH, self.queue,
                            [_attr(ATTR_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, packet_id))]))


def run(queue: int, delay_s: float, max_seconds: float) -> int:
    q = Queue(queue)
    print("bound", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    held: collections.deque = collections.deque()     # (due, id), in arrival order
    last = None
    end = time.monotonic() + max_seconds
    n = 0
    while not stop and time.monotonic() < end:
        now = time.monotonic()
        due = None
        while held and held[0][0] <= now:
            due = held.popleft()[1]
        if due is not None:
            q.accept_upto(due)
        wait = held[0][0] - now if held else 0.5
        try:
            ready, _, _ = select.select([q.sock], [], [], max(0.0, min(wait, 0.5)))
        except InterruptedError:
            continue
        if not ready:
            continue
        try:
            data = q.sock.recv(1 << 16)
        except OSError:          # ENOBUFS: some ids never read; the next batch verdict covers them
            continue
        t = time.monotonic() + delay_s
        for pid in q.packet_ids(data):
            held.append((t, pid))
            last = pid
            n += 1
    if last is not None:
        q.accept_upto(last)       # let everything held go at once
    print(f"released {n} packets", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lmqtt.loadtest.chaos.nfdelay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--queue", type=int, required=True)
    ap.add_argument("--delay-ms", type=float, required=True)
    ap.add_argument("--max-seconds", type=float, default=3600.0, help="exit after this long (default 3600)")
    a = ap.parse_args(argv)
    return run(a.queue, a.delay_ms / 1000.0, a.max_seconds)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
