"""`lmqtt store`'s settings are one dataclass, `NodeConfig` (store/node/config.py): a field is a
flag, a config-file key with its type, and its checks, in one place. The refusals through the real
command are in tests/gateway/test_config_strict.py and tests/gateway/test_cli_errors.py."""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from lmqtt.store.node.command import _parser
from lmqtt.store.node.config import ConfigError, NodeConfig, setting
from tests.support import ROOT


def test_every_setting_is_a_documented_flag_and_key():
    flags = {a.dest: a for a in _parser()._actions if a.option_strings}
    for f in dataclasses.fields(NodeConfig):
        assert f.metadata["help"], f"{f.name} has no doc"
        if f.metadata["flag"]:
            a = flags[f.name]
            assert a.option_strings == ["--" + f.name.replace("_", "-")]
            # --help adds "(default: none)" where the doc names no default (store/node/command.py)
            assert a.help in (f.metadata["help"], f.metadata["help"] + " (default: none)")
    # config-file only: not flags
    assert "metrics_host" not in flags and "dispatch_inline" not in flags
    assert set(NodeConfig.keys()) == {f.name for f in dataclasses.fields(NodeConfig)}


def test_a_new_field_is_a_flag_and_a_strict_key(tmp_path):
    """What the replicated store's and the tiered storage's flags rely on: adding a field is all."""
    @dataclasses.dataclass
    class Extended(NodeConfig):
        group_peers: str | None = setting(None, "peers of the replication group")
        group_size: int = setting(3, "members", low=1, high=9)
        group_sync: bool = setting(False, "wait for a quorum")

    p = argparse.ArgumentParser()
    Extended.add_arguments(p)
    args = vars(p.parse_args(["--group-size", "5", "--group-sync"]))
    assert args["group_size"] == 5 and args["group_sync"] is True and args["group_peers"] is None
    cfg = Extended.build({}, args)
    assert (cfg.group_size, cfg.group_sync, cfg.port) == (5, True, 10911)

    conf = tmp_path / "store.toml"
    conf.write_text('[store]\ngroup_peers = "a:1,b:2"\ngroup-size = 4\n')
    assert Extended.from_file(conf) == {"group_peers": "a:1,b:2", "group_size": 4}
    conf.write_text('[store]\ngroup_size = "4"\n')
    with pytest.raises(ConfigError, match=r"group_size must be an integer, got '4' \(a string\) .*line 2"):
        Extended.from_file(conf)
    conf.write_text('group_sizes = 4\n')
    with pytest.raises(ConfigError, match="unknown key 'group_sizes'.*did you mean 'group_size'"):
        Extended.from_file(conf)
    with pytest.raises(ConfigError, match=r"group_size must be 1\.\.9, got 12"):
        Extended.build({"group_size": 12})


def test_precedence_defaults_file_environment_flags(tmp_path):
    conf = tmp_path / "store.toml"
    conf.write_text('port = 1\nflush_mode = "sync"\n[store]\nwill_grace_s = 7\n')
    file_values = NodeConfig.from_file(conf)
    cfg = NodeConfig.build(file_values, {"port": 2, "token": None}, env={"LMQTT_STORE_TOKEN": "t"})
    assert (cfg.port, cfg.flush_mode, cfg.will_grace_s, cfg.token) == (2, "sync", 7.0, "t")
    assert isinstance(cfg.will_grace_s, float)
    file_values["token"] = "from-file"
    assert NodeConfig.build(file_values, env={"LMQTT_STORE_TOKEN": "t"}).token == "from-file"
    assert NodeConfig.build({}, {"token": "flag"}, env={"LMQTT_STORE_TOKEN": "t"}).token == "flag"


@pytest.mark.parametrize("text,want", [
    ('[store]\nflush_mode = "fast"\n', "flush_mode must be one of sync, async, async+buffer, got 'fast'"),
    ("metrics_port = 70000\n", "metrics_port must be 0..65535, got 70000"),
    ("[store]\nmax_frame_mb = 0\n", "max_frame_mb must be at least 1 (MiB), got 0"),
])
def test_lmqtt_store_refuses_a_bad_value_from_its_file(tmp_path, text, want):
    conf = tmp_path / "store.toml"
    conf.write_text(text)
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "store", "--config", str(conf), "--data-dir",
                        str(tmp_path / "d"), "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and want in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "d").exists()
