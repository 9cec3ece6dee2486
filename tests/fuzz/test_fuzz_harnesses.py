"""The coverage-guided fuzz harnesses of the compiled code that reads bytes from the network or
from disk, each run for a bounded time (the long runs are recorded in BENCHMARKS.md):

* `scan_fuzz.c`: libFuzzer with AddressSanitizer and UBSan over the framing core of
  lmqtt.gateway.mqtt._scan (gateway/mqtt/_scan_core.h), with the frames checked against the bytes;
* `fuzz_decoder.py`: atheris over `Decoder.feed` with its C scan against the decoder without it;
* `fuzz_park.py`: atheris over the parked-socket watcher (gateway/net/_park.c) against
  `PyParker`, both driven by one script of calls and socket events over real socket pairs;
* `fuzz_fastpath.py`: atheris over the store's raw-pull and dispatch loops (store/_fastpath.c:
  cq_runs, check_records, cq_entries, and dispatch_scan through `dispatch_round`) against their
  Python references;
* `fuzz_records.py`: atheris over the SDK's C decode of raw MESSAGES replies
  (store/client/_records.c) against the Python loop of `records_raw`;
* `fuzz_columns.py`: atheris over the Spark reader's C walk of MESSAGES replies
  (store/spark/_columns.c, both layouts) against `columns_py` / `columns_raw_py`;
* `fuzz_pushed.py`: atheris over a gateway's C decode of the records a store pushes
  (store/_append.c `decode_runs`) against `decode_raw_entries_py`;
* `fuzz_produce.py`: atheris over the store's C unpack of a PRODUCE body into Messages
  (store/_produce.c) against `produce_messages_py`, and a gateway's pack against its reference.

The atheris harnesses are differential: the C entry and its Python reference get the same input
and must give the same result or refuse it with the same kind of error (how each compares is in
its docstring); a difference, or an exception the entry's contract does not allow, fails. Their
inputs are read as choices (tests/fuzz/fuzz_input.py), so the seeds below are byte strings that
spell well-formed cases. The C cores of these six are Python extensions reading Python objects,
not standalone like the scan core, so the suite has no libFuzzer+ASan build of them; BENCHMARKS.md
has the command that runs their harnesses over the extensions built with ASan.

A harness whose toolchain is missing (or whose C module is not built) is skipped with the reason
(CI installs clang and atheris: .ci/run, pyproject's test extra); a crash, a sanitizer report or a
difference fails the test with the tool's output.
"""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# seconds of fuzzing per harness in the suite: enough to replay the corpus and explore past it a
# little on every run; the long runs are an hour each, by hand (BENCHMARKS.md)
SECONDS = int(os.environ.get("LMQTT_FUZZ_CI_SECONDS", "5"))


def _seeds(d: Path) -> None:
    """A few well-formed inputs to start from (the harnesses' first three bytes are settings)."""
    d.mkdir()
    pub = b"\x32\x0c\x00\x03a/b\x00\x07hello"
    (d / "publish").write_bytes(b"\x00\x01\x00" + pub * 3 + b"\x40\x02\x00\x07")
    (d / "publish5").write_bytes(b"\x01\x01\x00" + b"\x30\x07\x00\x01t\x00xyz" + b"\x62\x02\x00\x01")
    # acks whose remaining length is padded to a 4-byte varint (both decoders take them)
    (d / "padded_acks").write_bytes(b"\x00\x01\x00" + b"\x40\x82\x80\x80\x00\x00\x07" + b"\x50\x82\x80\x00\x00\x08")


# Seeds of the atheris harnesses, one well-formed case each (the input formats are in the harnesses).
# fuzz_park.py: steps of three bytes (op, a, b), a send's (op 0) followed by its length and bytes;
# the pair is a % 3, the fd role b % 18 (0..2: the pairs' server ends); ops 4 add, 0 send (b % 4:
# bytes, a PINGREQ flood of 1 + 157 a, a flood and a byte, a lone 0xC0), 1 poll, 10 read replies,
# 5 len and pings, 2 remove, 8 shutdown, 11 shrink the send buffer
PARK_SEEDS = {
    "ping": bytes([4, 0, 0, 0, 0, 1, 0, 1, 0, 0, 10, 0, 0, 5, 0, 0, 2, 0, 0]),
    "publish": bytes([4, 0, 0, 0, 0, 0, 7]) + b"\x30\x05\x00\x01tab" + bytes([1, 0, 0, 5, 0, 0]),
    "flood": bytes([4, 1, 1, 0, 61, 1, 0, 1, 0, 0, 1, 0, 0, 10, 1, 0, 0, 1, 3, 0, 1, 0, 0, 0, 1, 1, 0, 1, 0, 0, 5, 0,
                    0]),
    "eof": bytes([4, 2, 2, 0, 2, 3, 0, 1, 0, 0, 8, 2, 0, 1, 0, 0, 4, 0, 0, 11, 0, 0, 0, 0, 1, 0, 1, 0, 0]),
}
# fuzz_fastpath.py: the first byte picks the entry; ints are one byte (v << 2: lo + v; v << 2 | 1: hi - v)
FASTPATH_SEEDS = {
    # five adjacent 74-byte records, one of 100 elsewhere, an unwritten entry; then with a byte limit
    "cq_runs": bytes([0, 0, 1, 0, 0, 0, 0, 0, 7, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 0x0B, 0x40, 0, 0, 0, 0]),
    "cq_runs_limit": bytes([0, 0, 1, 0x0A, 4, 0, 0, 0, 7, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 0x0B, 0x40, 0, 0, 0, 0]),
    # three valid records; two with one byte flipped
    "check_records": bytes([1, 3, 3, 5]) + b"hello" + bytes([0, 3]) + b"abc" + bytes([0, 0]),
    "check_damaged": bytes([1, 3, 2, 5]) + b"hello" + bytes([2]) + b"hi" + bytes([1, 0, 0x0C, 0x10, 0]),
    "cq_entries": bytes([2, 5, 2, 6, 0x40, 1, 3, 0, 0, 0, 1, 0x28, 8]),
    # a run of four records of topic t with a dispatch queue, two keyed ones of a/b, a blank filler
    "dispatch": bytes([3, 2, 3, 255, 1, 6, 0x0A, 0, 1, 0, 0, 4, 0, 5, 0, 1, 5, 0, 1, 5, 0, 1, 5, 0,
                       0x06, 1, 2, 1, 0, 4, 0, 3, 0, 1, 0, 0, 1]),
}
# fuzz_records.py: the ident's kind, then the body (its mode, JSON header, records, count)
_REC1 = bytes([2, 2, 2, 1, 2, 5]) + b"hello" + bytes([0, 4, 8, 12, 16])
_REC3 = bytes([6, 0, 2, 0, 2]) + b"hi" + bytes([0, 8, 12, 16, 20])
RECORDS_SEEDS = {
    "reply": bytes([0, 1, 1, 3]) + _REC1 + bytes([1]) + _REC3 + bytes([0]),      # the second repeats the first
    "long_ident": bytes([3, 100]) + b"x" * 100 + bytes([1, 0, 1]) + _REC1 + bytes([0]),
}
# fuzz_columns.py: the mode (bit 0: raw layout), the ident, the records, the count
_COL = bytes([0, 3]) + b"t/x" + bytes([1]) + b"k" + bytes([2, 1, 2, 4]) + b"body" + bytes([4, 8, 12, 16])
_RAW_COL = bytes([0, 3]) + b"t/x" + bytes([1]) + b"k" + bytes([1]) + b"q" + bytes([2, 1, 2, 4]) + b"body" + \
    bytes([4, 8, 12, 16])
COLUMNS_SEEDS = {
    "plain": bytes([4, 2]) + b"ID" + bytes([2]) + _COL + _COL + bytes([0]),
    "raw": bytes([5, 2]) + b"ID" + bytes([2]) + _RAW_COL + _RAW_COL + bytes([0]),
}

# fuzz_pushed.py: the ident, the first run's offset, one run of two records (a/b "hello" props "p";
# ü/ñ "abc" keyed t), no damage
_PUSH1 = bytes([2, 1, 1]) + b"p" + bytes([5]) + b"hello" + bytes([1, 0, 0, 4, 0, 0])
_PUSH2 = bytes([6, 2, 0, 1, 0, 3]) + b"abc" + bytes([1, 4, 0, 8, 0, 0])
PUSHED_SEEDS = {
    "push": bytes([0, 0, 0, 1, 2]) + _PUSH1 + _PUSH2 + bytes([0, 0, 0]),
    "two_runs": bytes([0, 1, 0, 2, 1]) + _PUSH1 + bytes([0, 1]) + _PUSH2 + bytes([0, 0, 0]),
}

# fuzz_produce.py: a body (producer id "a/b", one message "ü/ñ" props "p" body "hello", the count
# and the id's length as packed, seq 1, no damage), the route on, then one Message to pack
# ("a/b" keyed "t", body "abc")
_PRODUCE_BODY = bytes([1, 1, 1, 0, 1, 2, 1]) + b"p" + bytes([5]) + b"hello" + bytes([0, 0, 0, 1, 4, 0, 1])
PRODUCE_SEEDS = {
    "one": _PRODUCE_BODY + bytes([1, 0, 1, 1, 1, 1, 0, 3]) + b"abc" + bytes([0, 0, 0]),
    "two": bytes([0, 2]) + b"id" + bytes([2, 1, 1, 1, 0, 1]) + b"x" + bytes([0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0])
    + bytes([0, 0, 0, 0, 0, 0, 1, 0]),
}


def _write_seeds(d: Path, seeds: dict) -> None:
    d.mkdir()
    for name, data in seeds.items():
        (d / name).write_bytes(data)


def _tail(out: str) -> str:
    return "\n".join(out.splitlines()[-40:])


@pytest.mark.skipif(shutil.which("clang") is None, reason="clang not installed (Debian: clang, libclang-rt-14-dev)")
def test_libfuzzer_asan_harness_of_the_scan_core(tmp_path):
    exe = tmp_path / "scan_fuzz"
    build = subprocess.run(["clang", "-g", "-O1", "-fsanitize=fuzzer,address,undefined",
                            "-fno-sanitize-recover=undefined", "-I", str(ROOT / "gateway" / "mqtt"),
                            str(HERE / "scan_fuzz.c"), "-o", str(exe)], capture_output=True, text=True)
    if build.returncode != 0 and ("libclang_rt" in build.stderr or "cannot find" in build.stderr):
        pytest.skip(f"clang has no libFuzzer/ASan runtime here: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr
    corpus = tmp_path / "corpus"
    _seeds(corpus)
    run = subprocess.run([str(exe), f"-max_total_time={SECONDS}", "-seed=1", "-timeout=10",
                          f"-artifact_prefix={tmp_path}/", str(corpus)],
                         capture_output=True, text=True, timeout=SECONDS + 120)
    assert run.returncode == 0, _tail(run.stderr)
    assert "Done " in run.stderr


def _atheris(tmp_path, harness: str, corpus: Path) -> None:
    """Run the atheris harness `harness` for SECONDS from `corpus`; fail with its output's tail."""
    run = subprocess.run([sys.executable, str(HERE / harness), f"-max_total_time={SECONDS}", "-seed=1",
                          "-timeout=10", f"-artifact_prefix={tmp_path}/", str(corpus)],
                         capture_output=True, text=True, timeout=SECONDS + 120)
    assert run.returncode == 0, _tail(run.stderr)
    assert "Done " in run.stderr


# The atheris harnesses: (harness, the module holding its C entry, the entry's name there - None
# when not built or LMQTT_PURE_PYTHON is set -, seeds: None for the MQTT frames of `_seeds`)
ATHERIS = [
    pytest.param("fuzz_decoder.py", "lmqtt.gateway.mqtt.decoder", "_scan", None, id="mqtt-decoder-c-scan"),
    pytest.param("fuzz_park.py", "lmqtt.gateway.net.parking", "_park", PARK_SEEDS, id="parked-socket-watcher"),
    pytest.param("fuzz_fastpath.py", "lmqtt.store.fastpath", "_fastpath", FASTPATH_SEEDS,
                 id="store-raw-pull-and-dispatch-loops"),
    pytest.param("fuzz_records.py", "lmqtt.store.client.records", "_C_RECORDS", RECORDS_SEEDS,
                 id="sdk-raw-record-decoder"),
    pytest.param("fuzz_columns.py", "lmqtt.store.spark.columns", "_C", COLUMNS_SEEDS, id="spark-column-walk"),
    pytest.param("fuzz_pushed.py", "lmqtt.store.record", "c_decode_runs", PUSHED_SEEDS,
                 id="gateway-decode-of-pushed-records"),
    pytest.param("fuzz_produce.py", "lmqtt.store.produce", "_produce", PRODUCE_SEEDS,
                 id="store-unpack-of-a-produce-body"),
]


@pytest.mark.parametrize("harness, module, entry, seeds", ATHERIS)
def test_atheris_harness_finds_no_difference_from_the_reference(tmp_path, harness, module, entry, seeds):
    pytest.importorskip("atheris")
    if harness == "fuzz_columns.py":
        pytest.importorskip("pyarrow")
    if getattr(importlib.import_module(module), entry) is None:
        pytest.skip(f"{module}.{entry} not built (or LMQTT_PURE_PYTHON set)")
    corpus = tmp_path / "corpus"
    if seeds is None:
        _seeds(corpus)
    else:
        _write_seeds(corpus, seeds)
    _atheris(tmp_path, harness, corpus)
