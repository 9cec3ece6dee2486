"""The small files a store reads back at restart survive a power loss, not only a crash.

Each is written by `store.atomic_file.write_atomic`: temp file, fsync of its content, rename,
fsync of the directory. Checked on a real process with strace (the syscalls the kernel saw, in
order): the store id file, the timer's fired.json and the tier manifest's local copy were once
renamed without the directory fsync.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest


STRACE = shutil.which("strace")

_CHILD = r'''
import sys, time
from lmqtt.store import Message, MessageStore, StoreConfig
from lmqtt.store.tier.config import TierConfig
st = MessageStore(StoreConfig(data_dir=sys.argv[1], segment_size=64 << 10, max_message_size=16 << 10,
                              preallocate=False))
st.enable_tier(TierConfig(url="file://" + sys.argv[2], local_retention_ms=0, upload_interval_ms=50,
                          timeout_s=5.0))
st.start()
st.enable_delayed()                                    # writes the timer's fired.json
rs = st.append_batch([Message(topic=f"fresh/{i}", body=b"x" * 1000) for i in range(200)])   # 3 segments
assert st.wait_dispatched(rs[-1].phys_offset + rs[-1].size, 10)
deadline = time.monotonic() + 30
while st.tier_stats()["tier_segments"] == 0:          # an upload writes the manifest's local copy
    assert time.monotonic() < deadline, "no segment uploaded"
    time.sleep(0.05)
st.shutdown()
'''

_CALL = re.compile(r'^(\d+)\s+(\w+)\((.*)')


def _events(trace: str) -> dict[str, list[tuple[str, list[str]]]]:
    """Per thread, (syscall, the paths named in its line) in the order strace saw them (-y: fds
    shown with their paths; a call that failed is left out)."""
    out: dict[str, list[tuple[str, list[str]]]] = {}
    for line in trace.splitlines():
        m = _CALL.match(line)
        if m and not re.search(r"= -1 [A-Z]", line):
            paths = [a or b for a, b in re.findall(r'"([^"]*)"|<(/[^>]*)>', m.group(3))]
            out.setdefault(m.group(1), []).append((m.group(2), paths))
    return out


def _assert_written_durably(threads, path: str, tmp: str | None = None) -> None:
    """On the thread that renames the temp file over `path`: the call before the rename is the
    fsync of the temp file, the two after it open and fsync `path`'s directory."""
    tmp, parent = tmp or path + ".tmp", os.path.dirname(path)
    seen = 0
    for events in threads.values():
        for i, (call, paths) in enumerate(events):
            if not (call.startswith("rename") and paths[:2] == [tmp, path]):
                continue
            seen += 1
            assert i > 0 and events[i - 1][0] in ("fsync", "fdatasync") and events[i - 1][1] == [tmp], \
                f"{tmp} renamed over {path} without an fsync of its content first (before: {events[i - 1:i]})"
            after = [(c, p[-1:]) for c, p in events[i + 1:i + 3]]
            assert after == [("openat", [parent]), ("fsync", [parent])], \
                f"{path}: its directory not fsynced after the rename (then: {after})"
    assert seen, f"no rename of {tmp} over {path}"


@pytest.mark.skipif(STRACE is None, reason="needs strace")
def test_the_small_files_read_back_at_restart_are_fsynced_before_the_rename_and_their_dir_after(tmp_path):
    data, tier = str(tmp_path / "data"), str(tmp_path / "tier")
    threads = _strace(tmp_path, sys.executable, "-c", _CHILD, data, tier)
    for path in [os.path.join(data, "identity"), os.path.join(data, "timer", "fired.json"),
                 os.path.join(data, "tier", "manifest.json")]:
        _assert_written_durably(threads, path)


def _strace(tmp_path, *argv) -> dict:
    out = str(tmp_path / "trace")
    p = subprocess.run([STRACE, "-f", "-y", "-qq", "-e", "signal=none", "-e",
                        "trace=openat,fsync,fdatasync,rename,renameat,renameat2", "-o", out, *argv],
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0 and "ptrace" in p.stderr:
        pytest.skip(f"strace cannot trace here: {p.stderr.strip()[:200]}")
    assert p.returncode == 0, p.stderr[-3000:]
    with open(out) as f:
        return _events(f.read())


@pytest.mark.skipif(STRACE is None, reason="needs strace")
def test_the_gateway_password_file_is_written_as_durably(tmp_path):
    """gateway/security/auth.py cannot import the store (layering): its own four steps."""
    path = str(tmp_path / "passwd")
    code = ("import os, sys; from lmqtt.gateway.security.auth import write_password_file; "
            "print(os.getpid(), flush=True); write_password_file(sys.argv[1], {'u': 'x'})")
    threads = _strace(tmp_path, sys.executable, "-c", code, path)
    tmps = {p[0] for evs in threads.values() for c, p in evs if c.startswith("rename") and p[1:2] == [path]}
    assert len(tmps) == 1, tmps
    _assert_written_durably(threads, path, tmps.pop())
