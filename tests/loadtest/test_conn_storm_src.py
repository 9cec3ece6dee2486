"""`lmqtt bench storm --lmqtt-src DIR` with a directory that holds no lmqtt tree: one line naming
it, exit status 1, no traceback, no round started."""
from __future__ import annotations

import subprocess
import sys


def test_a_wrong_lmqtt_src_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "bench", "storm", "--lmqtt-src", str(tmp_path),
                        "--sessions", "10", "--rounds", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert r.stderr.strip().splitlines() == [f"lmqtt bench storm: --lmqtt-src {tmp_path}: no lmqtt tree there "
                                             "(no gateway/app/serve_command.py nor gateway/serve.py)"]
