"""One loader for the optional C accelerators (`lmqtt.store._append`, `lmqtt.lightqueue._take`).

Each accelerator is a C loop beside a pure-Python reference that produces the same results; the
extensions are built by setup.py with `optional=True`, so an install without a C compiler still
works and runs the Python loops. `LMQTT_PURE_PYTHON=1` forces the Python loops even when the
extensions are built (equivalence tests, debugging, profiling the reference).

    from lmqtt.store import accel
    _take = accel.load("lmqtt.lightqueue._take")   # the module, or None

Only a missing module (ImportError) means "not built"; any other error while importing a built
extension is a bug and propagates.
"""
from __future__ import annotations

import importlib
import os


def pure_python() -> bool:
    """True when LMQTT_PURE_PYTHON asks for the Python loops (any value but empty or "0")."""
    return os.environ.get("LMQTT_PURE_PYTHON", "") not in ("", "0")


def load(name: str):
    """The accelerator module `name` (absolute, e.g. "lmqtt.store._append"), or None when it was not
    built or LMQTT_PURE_PYTHON is set."""
    if pure_python():
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
