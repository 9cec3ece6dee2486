"""QoS 2 exactly once when the session record cannot be written (a full disk) and then a crash
(kill -9) of `lmqtt serve`: a subscriber's PUBREC whose state change could not be
written closes its connection; when it reconnects while the disk is still full, the server must
not send the PUBREL from the state it holds in memory (never written), else a crash before the
next write sends the message again as PUBLISH from the older record and the client delivers it a
second time. The CONNECT's record write failing drops that connection before anything leaves
(gateway/broker/broker.py `_save_session(qos2_resumed=True)`); the exchange is resumed once the
record can be written."""
from __future__ import annotations

import signal
import socket

import pytest

from lmqtt.gateway.mqtt import packets as P
from lmqtt.loadtest.chaos.disk import SmallDisk, can_mount_tmpfs
from tests.e2e.test_e2e_qos2_crash import Receiver
from tests.support import LmqttServer, RawMQTT

pytestmark = pytest.mark.skipif(not can_mount_tmpfs(), reason="needs root to mount a tmpfs (mount -t tmpfs)")


def _try_resume(sub: Receiver) -> bool:
    """Connect (disk still full) and answer what the server sends until it is quiet or closes:
    True when the server accepted the connection."""
    sub.c = RawMQTT(sub.server)
    try:
        ack = sub.c.connect(sub.client_id, clean=False)
    except (ConnectionResetError, BrokenPipeError):
        ack = None
    if not isinstance(ack, P.ConnAck):
        sub.c.close()
        return False
    try:
        while True:
            pkt = sub.c.recv(timeout=1.5)
            if pkt is None:
                break
            sub.handle(pkt)
    except (socket.timeout, ConnectionResetError, BrokenPipeError):
        pass
    sub.c.close()
    return True


def _until_metadata_writes_fail(srv) -> None:
    """The filesystem is full, but the metadata DB's write-ahead log still has room in the page
    it writes to: another persistent client subscribes until a session record write fails (a
    SUBSCRIBE's one write failing drops the connection before its SUBACK; a later record write
    failing is logged after it)."""
    c = RawMQTT(srv)
    assert isinstance(c.connect("filler", clean=False), P.ConnAck)
    for i in range(400):
        c.send(P.Subscribe(1 + i % 60000, [P.SubscriptionRequest(f"f/{i}/{'x' * 200}", qos=1)]))
        ack = c.recv(timeout=10.0)
        log = srv.log_tail(20000)
        if ack is None:
            assert "event=subscribe_write_failed client_id=filler" in log, log
            c.close()
            return
        assert isinstance(ack, P.SubAck)
        if "save_session_failed client_id=filler" in log:
            c.close()
            return
    raise AssertionError("the metadata writes never failed on the full disk")


def test_qos2_pubrel_not_resent_from_an_unwritten_state_then_kill9(tmp_path):
    disk = SmallDisk(str(tmp_path / "disk"), 64).mount()
    srv = LmqttServer(str(tmp_path / "disk" / "data"), extra_args=("--segment-mb", "8"),
                      log_path=str(tmp_path / "serve.log")).start()
    try:
        sub = Receiver(srv, "dev")
        assert sub.connect() is False
        sub.c.send(P.Subscribe(1, [P.SubscriptionRequest("t/#", qos=2)]))
        assert isinstance(sub.c.recv(timeout=10.0), P.SubAck)
        pub = RawMQTT(srv)
        assert isinstance(pub.connect("pub", clean=False), P.ConnAck)
        pub.send(P.Publish("t/a", b"m0", qos=2, packet_id=10))
        assert isinstance(pub.recv(timeout=10.0), P.PubRec)
        pub.send(P.PubRel(10))
        assert isinstance(pub.recv(timeout=10.0), P.PubComp)
        pub.close()
        m0 = sub.recv(answer=False)                  # delivered here (held until its PUBREL)
        assert isinstance(m0, P.Publish) and m0.payload == b"m0"

        disk.fill(0)
        _until_metadata_writes_fail(srv)
        sub.c.send(P.PubRec(m0.packet_id))           # its state change cannot be written
        assert sub.c.closed_by_server(timeout=10.0), srv.log_tail()
        sub.c.close()
        _try_resume(sub)                             # the disk still full
        srv.stop(signal.SIGKILL)                     # crash before anything more is written
        disk.free()
        srv.start()

        assert sub.connect() is True
        sub.run_until_quiet()
        assert dict(sub.delivered) == {b"m0": 1}, srv.log_tail()
        assert sub.held == set()
        sub.c.close()
    finally:
        srv.stop()
        disk.umount()
