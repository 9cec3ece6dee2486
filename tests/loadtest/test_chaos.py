"""`lmqtt bench chaos`: the loss checker on hand-made histories (each verdict detected, and not
detected where it does not apply), then a short chaos round against real processes (kill -9,
SIGSTOP/SIGCONT, disk full on a tmpfs) asserting nothing acknowledged was lost and no QoS 2
message was delivered twice."""
from __future__ import annotations

import socket
import time

import pytest

from lmqtt.loadtest.chaos.checker import Checker, body, failures, parse


def _row(rows, path, qos):
    [r] = [r for r in rows if (r["path"], r["qos"]) == (path, qos)]
    return r


def _send(ck, pub, seqs, qos=1, path="mqtt", acked=True):
    for s in seqs:
        ck.sent(pub, s, qos, path)
        if acked:
            ck.acked(pub, s)


def test_body_round_trip():
    b = body("mqtt-q2-p0", 1234, 64)
    assert len(b) == 64 and parse(b) == ("mqtt-q2-p0", 1234)
    assert parse(b"garbage") is None and parse(b"a#notanumber#") is None


def test_clean_history_has_no_verdicts():
    ck = Checker()
    ck.receiver("s0", "mqtt", 1)
    ck.receiver("s1", "mqtt", 1)
    _send(ck, "p0", range(1, 6))
    for r in ("s0", "s1"):
        for s in range(1, 6):
            ck.received(r, body("p0", s))
    row = _row(ck.verdict(), "mqtt", 1)
    assert row["sent"] == 5 and row["acked"] == 5 and row["expected"] == 10 and row["received"] == 10
    assert (row["lost"], row["duplicated"], row["reordered"], row["never_sent"], row["unacked_delivered"]) == (0,) * 5
    assert failures([row]) == [] and ck.missing() == 0


def test_acknowledged_but_lost_per_receiver_and_named_fault():
    ck = Checker()
    ck.receiver("s0", "mqtt", 1)
    ck.receiver("s1", "mqtt", 1)
    _send(ck, "p0", [1, 2, 3])
    for s in (1, 2, 3):
        ck.received("s0", body("p0", s))
    ck.received("s1", body("p0", 1))              # s1 misses 2 and 3
    faults = [{"n": 1, "t": -1.0, "kind": "stop", "victim": "x"}, {"n": 2, "t": 1e9, "kind": "kill", "victim": "store"}]
    row = _row(ck.verdict(faults), "mqtt", 1)
    assert row["lost"] == 2 and row["received"] == 4 and ck.missing() == 2
    ex = row["examples"]["lost"]
    assert {(e["receiver"], e["seq"]) for e in ex} == {("s1", 2), ("s1", 3)}
    assert ex[0]["fault_after"] == {"n": 2, "t": 1e9, "kind": "kill", "victim": "store"}
    assert failures([row]) == ["mqtt QoS 1: 2 acknowledged message(s) lost"]


def test_unacknowledged_and_missing_is_not_lost_but_delivered_is_counted():
    ck = Checker()
    ck.receiver("s0", "sdk", 1)
    _send(ck, "p0", [1, 2], path="sdk")
    _send(ck, "p0", [3, 4], path="sdk", acked=False)    # never acknowledged
    for s in (1, 2, 3):                                   # 3 delivered anyway, 4 not
        ck.received("s0", body("p0", s))
    row = _row(ck.verdict(), "sdk", 1)
    assert row["lost"] == 0 and row["unacked_delivered"] == 1 and row["received"] == 3
    assert failures([row]) == []


def test_duplicates_split_by_qos_and_only_qos2_fails():
    ck = Checker()
    ck.receiver("s1", "mqtt", 1)
    ck.receiver("s2", "mqtt", 2)
    _send(ck, "p1", [1, 2], qos=1)
    _send(ck, "p2", [1, 2], qos=2)
    for r, p in (("s1", "p1"), ("s2", "p2")):
        for s in (1, 2, 2):
            ck.received(r, body(p, s))
    rows = ck.verdict()
    q1, q2 = _row(rows, "mqtt", 1), _row(rows, "mqtt", 2)
    assert q1["duplicated"] == 1 and q2["duplicated"] == 1
    assert q1["lost"] == q2["lost"] == 0 and q1["received"] == q2["received"] == 2
    assert q2["examples"]["duplicated"][0]["seq"] == 2
    assert failures(rows) == ["mqtt QoS 2: 1 duplicate(s) at QoS 2"]


def test_duplicates_are_attributed_to_the_fault_before_them():
    ck = Checker()
    ck.receiver("s", "mqtt", 1)
    _send(ck, "p", [1, 2, 3])
    for q in (1, 2, 3, 1):                       # the second 1 comes after the kill below
        ck.received("s", body("p", q))
    t_kill = ck.now() - 10                        # a kill before every delivery, a stop after them
    faults = [{"n": 1, "t": t_kill, "kind": "kill", "victim": "serve"},
              {"n": 2, "t": t_kill + 1e6, "kind": "stop", "victim": "serve"}]
    row = _row(ck.verdict(faults), "mqtt", 1)
    assert row["duplicated_after"] == {"kill": 1}
    assert row["examples"]["duplicated"][0]["fault_before"]["kind"] == "kill"


def test_reordered_within_a_publisher_per_receiver():
    ck = Checker()
    ck.receiver("s0", "mqtt", 1)
    ck.receiver("s1", "mqtt", 1)
    _send(ck, "a", [1, 2, 3])
    _send(ck, "b", [1, 2])
    # s0: a3 before a2 (reordered); b interleaved with a is fine; a redelivered 1 is a duplicate only
    for p, s in (("a", 1), ("b", 1), ("a", 3), ("b", 2), ("a", 2), ("a", 1)):
        ck.received("s0", body(p, s))
    for p, s in (("a", 1), ("a", 2), ("a", 3), ("b", 1), ("b", 2)):
        ck.received("s1", body(p, s))
    row = _row(ck.verdict(), "mqtt", 1)
    assert row["reordered"] == 1 and row["duplicated"] == 1 and row["lost"] == 0
    [ex] = row["examples"]["reordered"]
    assert (ex["receiver"], ex["publisher"], ex["seq"], ex["after"]) == ("s0", "a", 2, 3)


def test_unordered_receiver_is_not_checked_for_order():
    ck = Checker()
    ck.receiver("pop", "pop", 1, ordered=False)
    _send(ck, "p", [1, 2, 3], path="pop")
    for s in (2, 3, 1):
        ck.received("pop", body("p", s))
    row = _row(ck.verdict(), "pop", 1)
    assert row["reordered"] is None and row["lost"] == 0


def test_delivered_but_never_sent():
    ck = Checker()
    ck.receiver("s0", "mqtt", 2)
    ck.receiver("x", "sdk", 1)
    _send(ck, "p", [1], qos=2)
    _send(ck, "q", [1], path="sdk")
    ck.received("s0", body("p", 1))
    ck.received("s0", body("p", 7))            # a sequence p never sent
    ck.received("s0", body("ghost", 1))        # a publisher that does not exist
    ck.received("s0", body("q", 1))            # another stream's message
    ck.received("s0", b"\x00garbled")          # not a body at all
    ck.received("x", body("q", 1))
    rows = ck.verdict()
    row = _row(rows, "mqtt", 2)
    assert row["never_sent"] == 4 and row["received"] == 1 and row["lost"] == 0
    kinds = {(e.get("publisher"), e.get("seq")) for e in row["examples"]["never_sent"]}
    assert {("p", 7), ("ghost", 1), ("q", 1)} <= kinds
    assert _row(rows, "sdk", 1)["never_sent"] == 0
    assert failures(rows) == ["mqtt QoS 2: 4 delivery(ies) of messages never sent"]


def test_receiver_that_got_nothing_loses_everything_acknowledged():
    ck = Checker()
    ck.receiver("s0", "mqtt", 1)
    _send(ck, "p", range(1, 4))
    row = _row(ck.verdict(), "mqtt", 1)
    assert row["lost"] == 3 and row["expected"] == 3 and row["received"] == 0


def test_a_publisher_or_receiver_keeps_its_stream():
    ck = Checker()
    ck.sent("p", 1, 1, "mqtt")
    with pytest.raises(ValueError):
        ck.sent("p", 2, 2, "mqtt")
    ck.receiver("r", "mqtt", 1)
    ck.receiver("r", "mqtt", 1)
    with pytest.raises(ValueError):
        ck.receiver("r", "sdk", 1)


# ------------------------------------------------------------------------------ the command
def test_usage_errors_exit_2_with_one_line(capsys):
    from lmqtt.loadtest.chaos.cli import main
    for argv, says in ((["--target", "nope"], "unknown nope"), (["--kinds", "kill,flood"], "--kinds"),
                       (["--faults", "many"], "not a number"), (["--faults", "serve=3,nope=2"], "unknown target"),
                       (["--qos", "0"], "--qos"), (["--paths", "amqp"], "--paths")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err


def _read_packet(s: socket.socket) -> tuple[int, bytes]:
    first = s.recv(1)
    assert first, "the client closed the connection"
    length, mult = 0, 1
    while True:
        b = s.recv(1)[0]
        length += (b & 127) * mult
        mult *= 128
        if not b & 128:
            break
    body_ = b""
    while len(body_) < length:
        body_ += s.recv(length - len(body_))
    return first[0], body_


def _listen(port: int = 0) -> socket.socket:
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", port))
    ls.listen()
    ls.settimeout(10)
    return ls


def test_the_chaos_clients_resend_pubrel_not_publish_after_a_refused_reconnect():
    """A broker restarting after kill -9 refuses the first reconnect attempts. A QoS 2 exchange
    whose PUBREL was sent must resume with that PUBREL (MQTT-4.3.3), not with the PUBLISH: plain
    paho 2.2.0 sends the PUBLISH again (DUP 0, an id the broker freed) and the broker stores it
    twice, which the chaos round blamed on the broker. The test plays the broker on a socket."""
    pytest.importorskip("paho.mqtt.client")
    from lmqtt.loadtest.chaos.paths import _paho

    ls = _listen()
    port = ls.getsockname()[1]
    c = _paho("pubrel-owed")
    c.reconnect_delay_set(0.1, 0.1)
    c.connect_async("127.0.0.1", port, 10)
    c.loop_start()
    try:
        s, _ = ls.accept()
        s.settimeout(10)
        assert _read_packet(s)[0] >> 4 == 1                     # CONNECT
        s.sendall(bytes([0x20, 2, 0, 0]))                       # CONNACK
        c.publish("t", b"once", qos=2)
        kind, pub = _read_packet(s)
        assert kind >> 4 == 3
        pid = pub[3:5]                                          # after the topic "t"
        s.sendall(bytes([0x50, 2]) + pid)                       # PUBREC
        assert _read_packet(s) == (0x62, pid)                   # PUBREL; PUBCOMP never comes
        s.close()
        ls.close()
        time.sleep(0.6)                                         # several attempts refused
        ls = _listen(port)
        s, _ = ls.accept()
        s.settimeout(10)
        assert _read_packet(s)[0] >> 4 == 1
        s.sendall(bytes([0x20, 2, 1, 0]))                       # session present
        assert _read_packet(s) == (0x62, pid), "the exchange must resume with its PUBREL"
        s.sendall(bytes([0x70, 2]) + pid)                       # PUBCOMP
        s.close()
    finally:
        c.loop_stop()
        ls.close()


def test_faults_per_target():
    from lmqtt.loadtest.chaos.cli import _faults_arg
    assert _faults_arg("600", ["serve", "fleet"]) == {"serve": 600, "fleet": 600}
    assert _faults_arg("serve=600,150", ["serve", "fleet"]) == {"serve": 600, "fleet": 150}
    assert _faults_arg("fleet=5", ["serve", "fleet"]) == {"serve": 0, "fleet": 5}


# ------------------------------------------------------------------------------ a short chaos round
# CI's round: ~10 faults on each lmqtt shape (kill -9, SIGSTOP/SIGCONT, disk full when a tmpfs can
# be mounted), MQTT QoS 1 + QoS 2 persistent sessions, SDK consumer group and POP at once.
ROUND = (("serve", 6), ("workers", 6), ("fleet", 6))   # each kind of fault twice per target


@pytest.fixture(scope="module")
def chaos_round(tmp_path_factory):
    pytest.importorskip("paho.mqtt.client")
    import json

    from lmqtt.loadtest.chaos.cli import main
    out = tmp_path_factory.mktemp("chaos-out")
    work = tmp_path_factory.mktemp("chaos-work")
    faults = ",".join(f"{t}={n}" for t, n in ROUND)
    rc = main(["--target", ",".join(t for t, _ in ROUND), "--faults", faults, "--interval", "1",
               "--drain", "60", "--out", str(out), "--workdir", str(work)])
    results = {t: json.loads((out / f"{t}.json").read_text()) for t, _ in ROUND}
    return rc, results, (out / "summary.md").read_text()


@pytest.mark.slow
def test_chaos_round_loses_no_acknowledged_message(chaos_round):
    rc, results, summary = chaos_round
    assert rc in (0, 1), f"a target did not start or come back (exit {rc}):\n{summary}"
    for (target, n) in ROUND:
        res = results[target]
        assert not res.get("error"), res.get("error")
        assert sum(res["faults_by_kind"].values()) == n
        assert not res["unexpected_exits"], f"{target}: died without our kill: {res['unexpected_exits']}"
        streams = {(r["path"], r["qos"]): r for r in res["rows"]}
        assert set(streams) == {("mqtt", 1), ("mqtt", 2), ("sdk", 1), ("pop", 1)}, streams.keys()
        for (path, qos), r in streams.items():
            where = f"{target} {path} QoS {qos}"
            assert r["acked"] > 0 and r["received"] > 0, f"{where}: nothing went through: {r}"
            assert r["lost"] == 0, f"{where}: {r['lost']} acknowledged message(s) lost: {r['examples'].get('lost')}"
            assert r["never_sent"] == 0, f"{where}: delivered but never sent: {r['examples'].get('never_sent')}"
            assert r["reordered"] in (0, None), f"{where}: reordered: {r['examples'].get('reordered')}"
    # the exit code says whether a verdict failed (here: only QoS 2 duplicates can, see below)
    failed = any(res["failures"] for res in results.values())
    assert rc == (1 if failed else 0)
    assert "| serve | mqtt | 2 |" in summary


@pytest.mark.slow
def test_chaos_round_no_qos2_duplicate(chaos_round):
    """QoS 2 exactly once across kill -9 of serve, a worker, the store or a gateway while the
    clients are connected, SIGSTOP and disk full: their exchanges are written ahead, inbound ids
    before the append as pending (gateway/clients/session_persistence.py, docs/gateway.md 'Known
    limits'); a gateway over a remote store resumes them at the CONNECT with their messages read
    ahead (tests/e2e/test_e2e_qos2_*.py pin each cause)."""
    _rc, results, _summary = chaos_round
    dups = {t: r["duplicated"] for t, res in results.items() for r in res["rows"] if r["qos"] == 2 and r["duplicated"]}
    assert not dups, f"QoS 2 duplicates per target: {dups}"
