"""A thousand failed logins in a row: each refused with the reason code (and the cause in the
log), while the clients already connected keep being served. Password hashes are slow on
purpose (PBKDF2); the gateway computes them on a small thread pool, off the event loop, so a
flood of wrong passwords costs CPU, not everyone else's latency (gateway/security/auth.py AuthRunner)."""
import statistics
import threading
import time

from lmqtt.gateway.security.auth import hash_password
from lmqtt.gateway.mqtt import packets as P
from tests.support import LmqttServer, Paho, RawMQTT

ATTEMPTS = 1000
ATTACKERS = 50


def _refusals(srv, n, out, errors):
    """`n` CONNECTs with wrong passwords, one after another on fresh connections: CONNACK codes."""
    for i in range(n):
        try:
            r = RawMQTT(srv, version=5, timeout=60)
            r.send(P.Connect(f"bad-{threading.get_ident()}-{i}", 5, True, 30, "alice",
                             f"guess-{threading.get_ident()}-{i}".encode(),
                             None, P.Properties()))
            out.append(r.recv(timeout=60).reason_code)
            r.close()
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(repr(e))


def test_a_thousand_failed_logins_leave_connected_clients_served(tmp_path):
    pw = tmp_path / "passwd"
    # 5,000 PBKDF2 rounds (~4 ms a check here): a real slow hash, cheap enough for 1,000 checks in CI
    pw.write_text(f"alice:{hash_password('wonder', iterations=5_000)}\n")
    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--password-file", str(pw)),
                      log_path=str(tmp_path / "serve.log")).start()
    try:
        def login(cid):
            c = Paho(srv, client_id=cid, version=5, connect=False)
            c.c.username_pw_set("alice", "wonder")
            c.connect()
            return c
        sub, pub = login("watcher"), login("sensor")
        sub.subscribe("flood/t", qos=1)
        codes, errors = [], []
        threads = [threading.Thread(target=_refusals, args=(srv, ATTEMPTS // ATTACKERS, codes, errors))
                   for _ in range(ATTACKERS)]
        for t in threads:
            t.start()
        # meanwhile: a reading every 20 ms from a connected device to a connected subscriber
        latencies, seq = [], 0
        while any(t.is_alive() for t in threads):
            pub.publish("flood/t", f"{seq} {time.monotonic()}".encode(), qos=1)
            seq += 1
            time.sleep(0.02)
        for t in threads:
            t.join(120)
        got = sub.get_n(seq, timeout=30)
        for m in got:
            _n, t0 = m.payload.decode().split()
            latencies.append((m.timestamp - float(t0)) * 1000)
        assert errors == [] and len(codes) == ATTEMPTS
        assert set(codes) == {0x86}                                   # bad user name or password
        assert [int(m.payload.split()[0]) for m in got] == list(range(seq))   # every reading, in order
        log = srv.log_tail(200_000)
        assert "reason_code=0x86" in log and "cause=\"wrong password for user 'alice'\"" in log
        late = login("late-comer")                                    # the right password still works
        late.disconnect()
        lat = sorted(latencies)
        print(f"\n{ATTEMPTS} failed logins; {seq} readings delivered meanwhile, latency p50 "
              f"{statistics.median(lat):.1f} ms, p99 {lat[int(0.99 * (len(lat) - 1))]:.1f} ms, max {lat[-1]:.1f} ms")
        for c in (sub, pub):
            c.disconnect()
    finally:
        srv.stop()


def test_packets_sent_right_after_connect_wait_for_the_password_check(tmp_path):
    """CONNECT, SUBSCRIBE and PUBLISH in one write, with a password whose hash is not computed yet:
    the check runs off the loop, and the rest is handled after the CONNACK, in order."""
    from lmqtt.gateway.mqtt import encode
    pw = tmp_path / "passwd"
    pw.write_text(f"alice:{hash_password('wonder', iterations=50_000)}\n")
    srv = LmqttServer(str(tmp_path / "data"), extra_args=("--password-file", str(pw)),
                      log_path=str(tmp_path / "serve.log")).start()
    try:
        r = RawMQTT(srv, version=5)
        r.send_raw(encode(P.Connect("pipelined", 5, True, 30, "alice", b"wonder", None, P.Properties()), 5)
                   + encode(P.Subscribe(1, [P.SubscriptionRequest("pipe/t", 1)], P.Properties()), 5)
                   + encode(P.Publish("pipe/t", b"hello", 1, False, False, 2, P.Properties()), 5))
        got = [r.recv(timeout=10) for _ in range(4)]
        kinds = [type(p).__name__ for p in got]
        assert kinds[:2] == ["ConnAck", "SubAck"] and got[0].reason_code == 0
        assert sorted(kinds[2:]) == ["PubAck", "Publish"] and [p for p in got if type(p).__name__ == "Publish"][0].payload == b"hello"
        r.close()
    finally:
        srv.stop()
