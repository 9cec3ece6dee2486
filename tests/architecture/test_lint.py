"""ruff over the whole tree with the rules in pyproject.toml ([tool.ruff.lint]: pyflakes and
pycodestyle's error classes): an undefined name, an unused import or variable fails CI with its
file and line, before a user meets it as a NameError on a rarely taken path."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytest.importorskip("ruff", reason="ruff is in the test extras (pip install -e '.[test]')")


def _ruff(*args: str, cwd: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_tree_passes_ruff():
    r = _ruff(".")
    assert r.returncode == 0, f"ruff found problems:\n{r.stdout}{r.stderr}"


def test_ruff_sees_an_undefined_name(tmp_path):
    """The check would pass on anything if ruff read no configuration or no file."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "probe.py").write_text("def f():\n    return undefined_name\n")
    r = _ruff(".", cwd=tmp_path)
    assert r.returncode == 1 and "F821" in r.stdout, r.stdout + r.stderr
