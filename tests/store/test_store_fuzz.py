"""`lmqtt bench fuzz-store` against a real `lmqtt store` (small count), and its checker can fail."""
from __future__ import annotations

import json
import subprocess
import sys

from lmqtt.loadtest import store_fuzz as F
from lmqtt.store.client import connect
from tests.support import ROOT


def test_fuzz_store_small_run_store_survives(lmqtt_store):
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "bench", "fuzz-store", "--store",
                        lmqtt_store.address, "--frames", "4000", "--seed", "7", "--workers", "4"],
                       capture_output=True, cwd=ROOT, timeout=240)
    out = r.stdout.decode()
    assert r.returncode == 0, (out, r.stderr.decode()[-3000:])
    res = json.loads(out.strip().splitlines()[-1])
    assert res["ok"] and res["problems"] == [] and res["frames"] == 4000
    assert set(res["kinds"]) == {"valid", "truncate", "bitflip", "bodyflip", "length", "oversized", "opcode",
                                 "splice", "random"}
    assert res["stored_records"] > res["controls"] > 0      # fuzzed PRODUCEs got stored too
    assert res["left_open"] == 0 and res["hung_workers"] == 0
    assert lmqtt_store.proc.poll() is None
    # and it still restarts cleanly on the fuzzed data (recovery reads every record's CRC)
    lmqtt_store.restart()
    assert F.verify(lmqtt_store.address, set(), [])["stored_records"] == res["stored_records"] + 1


def test_checker_reports_foreign_and_missing_records(lmqtt_store):
    with connect(lmqtt_store.address) as c:
        r = c.producer().send("fzctl/0", b"real")
    # a record the fuzzer never sent is foreign; a control whose bytes differ is missing
    known: set = set()      # verify() adds its own round-trip message to the set it is given
    res = F.verify(lmqtt_store.address, known, [("fzctl/0", b"other", r.msg_id)])
    text = " ".join(res["problems"])
    assert "were never sent" in text and "missing or altered" in text, res
    known.add(F._key("fzctl/0", b"real"))
    ok = F.verify(lmqtt_store.address, known, [("fzctl/0", b"real", r.msg_id)])
    assert ok["problems"] == [], ok


def test_possible_messages_follows_reframing():
    g = F.Gen(__import__("random").Random(1), 1 << 20)
    good = g.produce()
    _pid, _seq, msgs = F.W.decode_produce(good[F.W.HEADER_SIZE:])
    keys = {F._key(m[0], m[1]) for m in msgs}
    assert set(F.possible_messages(good, 1 << 20)) == keys
    # a frame whose length swallows the next one: the PRODUCE is not parseable
    junk = bytearray(g.hello())
    F.struct.pack_into(">I", junk, 0, len(junk) - 4 + len(good))
    assert F.possible_messages(bytes(junk) + good, 1 << 20) == []
    # an oversized header closes the stream: nothing after it counts
    big = bytearray(g.hello())
    F.struct.pack_into(">I", big, 0, (1 << 20) + 1)
    assert F.possible_messages(good + bytes(big) + good, 1 << 20) == list(F.possible_messages(good, 1 << 20))
