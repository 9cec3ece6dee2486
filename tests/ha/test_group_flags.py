"""`lmqtt store --group`: settings that cannot work are refused in one line before the data dir is touched."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support import ROOT


@pytest.mark.parametrize("args, says", [
    (["--group", "g"], "needs --peers"),
    (["--group", "g", "--node-id", "4", "--peers", "127.0.0.1:20000,127.0.0.1:20010,127.0.0.1:20020"],
     "node_id must be this member's position in --peers, 1..3, got 4"),
    (["--group", "g", "--node-id", "1", "--peers", "127.0.0.1:20000,127.0.0.1"], "needs HOST:PORT"),
    (["--group", "g", "--node-id", "1", "--peers", "127.0.0.1:20000,127.0.0.1:20010", "--ack-replicas", "2"],
     "ack_replicas must be 0..1 for a group of 2"),
    (["--node-id", "1"], "node_id is set but group is not"),
    (["--group", "g", "--node-id", "1", "--peers", "127.0.0.1:20000", "--port", "20005"],
     "differ from this member's entry 127.0.0.1:20000"),
])
def test_bad_group_settings_are_one_line(tmp_path, args, says):
    data = tmp_path / "d"
    p = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "store", "--data-dir", str(data), *args],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in p.stderr, p.stderr
    assert not os.path.exists(data)


def test_a_group_member_without_the_ha_extra_names_the_pip_install_before_creating_anything(tmp_path):
    """pysyncobj is the `[ha]` extra: a Python without it (here: a package of that name that fails to
    import as an absent one does, first on the path) gets one line naming the install, and no data dir."""
    shadow = tmp_path / "no-ha"
    (shadow / "pysyncobj").mkdir(parents=True)
    (shadow / "pysyncobj" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'pysyncobj'\", name='pysyncobj')\n")
    data = tmp_path / "d"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "store", "--data-dir", str(data), "--group", "g",
                        "--node-id", "1", "--peers", "127.0.0.1:20000,127.0.0.1:20010,127.0.0.1:20020"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=env, check=False)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'lmqtt[ha]'" in lines[0] and "Traceback" not in p.stderr, p.stderr
    assert not os.path.exists(data)
