"""The network bed itself (loadtest/chaos/netbed.py), with plain sockets made on its hosts: hosts
reach each other; a cut stops that and its heal brings it back; a one-way cut drops one direction
only; loss drops about its share; a delay holds every packet; everything the bed made is gone
after it, also when the test body raised."""
from __future__ import annotations

import socket
import subprocess
import time

import pytest

from lmqtt.loadtest.chaos import netbed

WHY = netbed.available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no network namespaces here: {WHY}")


@pytest.fixture
def bed(tmp_path):
    with netbed.NetBed(workdir=tmp_path) as b:
        for name in ("a", "b", "c"):
            b.add_host(name)
        yield b


def _udp_server(bed, host: str):
    with bed.inside(host):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((bed.addr(host), 0))
    s.settimeout(0.05)
    return s


def _send_udp(bed, src: str, dst_sock, n: int) -> int:
    """Send n datagrams from host `src` to `dst_sock` (read as they come: a socket buffer holds
    a few hundred); how many arrived."""
    with bed.inside(src):
        c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    got = 0
    dst_sock.setblocking(False)
    try:
        for i in range(n):
            c.sendto(b"%d" % i, dst_sock.getsockname())
            if i % 50 == 49:
                time.sleep(0.002)
                got += _drain(dst_sock)
        dst_sock.settimeout(0.3)
        while True:
            try:
                dst_sock.recv(64)
                got += 1
            except socket.timeout:
                return got
    finally:
        c.close()


def _drain(s) -> int:
    n = 0
    while True:
        try:
            s.recv(64)
            n += 1
        except BlockingIOError:
            return n


def _tcp_reach(bed, src: str, dst: str, timeout: float = 1.0) -> float | None:
    """Round trip of a TCP echo from `src` to a listener on `dst`, or None when it fails."""
    with bed.inside(dst):
        srv = socket.create_server((bed.addr(dst), 0))
    with bed.inside(src):
        c = socket.socket()
    c.settimeout(timeout)
    try:
        t0 = time.monotonic()
        c.connect(srv.getsockname())
        conn, _ = srv.accept()
        c.sendall(b"x")
        conn.sendall(conn.recv(1))
        c.recv(1)
        conn.close()
        return time.monotonic() - t0
    except OSError:
        return None
    finally:
        c.close()
        srv.close()


def test_hosts_reach_each_other_and_a_cut_stops_it_until_healed(bed):
    assert _tcp_reach(bed, "a", "b") is not None
    f = bed.cut("a", "b")
    assert _tcp_reach(bed, "a", "b", 0.5) is None and _tcp_reach(bed, "b", "a", 0.5) is None
    assert _tcp_reach(bed, "a", "c") is not None and _tcp_reach(bed, "c", "b") is not None, "only a<->b is cut"
    f.heal()
    f.heal()                                   # idempotent
    assert _tcp_reach(bed, "a", "b") is not None and _tcp_reach(bed, "b", "a") is not None


def test_a_one_way_cut_drops_one_direction_only(bed):
    at_b, at_a = _udp_server(bed, "b"), _udp_server(bed, "a")
    f = bed.cut("a", "b", direction="out")
    assert _send_udp(bed, "a", at_b, 20) == 0
    assert _send_udp(bed, "b", at_a, 20) == 20
    f.heal()
    f = bed.cut("a", "b", direction="in")
    assert _send_udp(bed, "a", at_b, 20) == 20
    assert _send_udp(bed, "b", at_a, 20) == 0
    f.heal()
    assert _send_udp(bed, "b", at_a, 20) == 20


def test_loss_drops_about_its_share(bed):
    at_b = _udp_server(bed, "b")
    f = bed.loss("a", 10)
    got = _send_udp(bed, "a", at_b, 2000)
    f.heal()
    assert 1500 < got < 1950, f"10 % loss let {got} of 2000 through"
    assert _send_udp(bed, "a", at_b, 200) == 200


def test_delay_holds_every_packet_and_keeps_their_order(bed):
    f = bed.delay("a", 200)
    rtt = _tcp_reach(bed, "a", "b", 3.0)
    assert rtt is not None and rtt >= 0.2 * 2, f"connect + echo with 200 ms on every packet a sends: {rtt}"
    at_b = _udp_server(bed, "b")
    with bed.inside("a"):
        c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for i in range(50):
        c.sendto(b"%d" % i, at_b.getsockname())
    c.close()
    got = []
    deadline = time.monotonic() + 3
    while len(got) < 50 and time.monotonic() < deadline:
        try:
            got.append(int(at_b.recv(64)))
        except socket.timeout:
            pass
    assert got == list(range(50))
    f.heal()
    rtt = _tcp_reach(bed, "a", "b")
    assert rtt is not None and rtt < 0.2


def test_everything_is_removed_even_when_the_body_fails(tmp_path):
    names = []
    procs = []
    with pytest.raises(RuntimeError, match="boom"):
        with netbed.NetBed(workdir=tmp_path) as b:
            b.add_host("a")
            b.add_host("b")
            b.cut("a", "b")
            procs.append(b.run("a", ["sleep", "60"], tmp_path / "sleep.log"))
            names = b.namespaces()
            raise RuntimeError("boom")
    assert len(names) == 3                                # two hosts and the switch
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
    assert procs[0].poll() is not None, "the process started on the bed was not stopped"


def test_host_names_and_addresses_are_checked(bed):
    with pytest.raises(ValueError):
        bed.add_host("a")
    with pytest.raises(ValueError):
        bed.add_host("Bad_Name")
    with pytest.raises(ValueError):
        bed.add_host("d", last_octet=bed.hosts["a"].addr.rsplit(".", 1)[1] and int(bed.addr("a").rsplit(".", 1)[1]))
