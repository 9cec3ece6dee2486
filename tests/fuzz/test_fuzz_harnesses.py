"""The coverage-guided fuzz harnesses of the compiled code that reads client bytes, each run for a
bounded time (the long runs, an hour per entry, are recorded in BENCHMARKS.md):

* `scan_fuzz.c`: libFuzzer with AddressSanitizer and UBSan over the framing core of
  lmqtt.gateway.mqtt._scan (gateway/mqtt/_scan_core.h), with the frames checked against the bytes;
* `fuzz_decoder.py`: atheris over `Decoder.feed` with its C scan against the decoder without it.

A harness whose toolchain is missing is skipped with the reason (CI installs clang and atheris:
.ci/run, pyproject's test extra); a crash, a sanitizer report or a difference fails the test
with the tool's output.
"""
from __future__ import annotations

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


def test_atheris_harness_of_the_decoder_with_its_c_scan(tmp_path):
    pytest.importorskip("atheris")
    from lmqtt.gateway.mqtt import decoder
    if decoder._scan is None:
        pytest.skip("lmqtt.gateway.mqtt._scan not built (or LMQTT_PURE_PYTHON set)")
    corpus = tmp_path / "corpus"
    _seeds(corpus)
    run = subprocess.run([sys.executable, str(HERE / "fuzz_decoder.py"), f"-max_total_time={SECONDS}", "-seed=1",
                          "-timeout=10", f"-artifact_prefix={tmp_path}/", str(corpus)],
                         capture_output=True, text=True, timeout=SECONDS + 120)
    assert run.returncode == 0, _tail(run.stderr)
    assert "Done " in run.stderr
