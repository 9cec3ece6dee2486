"""Test help for the C accelerators' configure() refusals (tests/store/test_fastpath_accel.py,
tests/store/test_fastpath.py, tests/store/test_encoding.py, tests/store/test_record_decode_accel.py,
tests/spark/test_columns.py)."""
from __future__ import annotations

import importlib
import struct
import subprocess
import sys


def outcome(fn, *args):
    """What `fn(*args)` gives, or "raises" where a C entry packer and its Python reference both
    refuse (the reference raises struct.error where C raises OverflowError: a phys past 2**64 - 1
    that would be packed, a size past 32 bits): tests/store/test_fastpath_accel.py (cq_entries),
    tests/lightqueue/test_run_entries_accel.py (run_entries)."""
    try:
        return fn(*args)
    except (struct.error, OverflowError):
        return "raises"


def run_unconfigured(name: str, call: str) -> str:
    """Load the C extension `name` in a new interpreter, bypassing the Python module that configures
    it at import (in this process it is configured already, and its configuration is per process),
    evaluate `call` with the extension bound to `m`, and return what happened: the RuntimeError's
    message, or "ran"."""
    path = importlib.import_module(name).__file__
    code = ("import importlib.util as u\n"
            f"s = u.spec_from_file_location({name!r}, {path!r})\n"
            "m = u.module_from_spec(s)\n"
            "s.loader.exec_module(m)\n"
            f"try:\n    {call}\n    print('ran')\nexcept RuntimeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def swapped(names: tuple[str, ...], a: str, b: str) -> tuple[str, ...]:
    """`names` with `a` and `b` swapped: two fields of one width exchanged, which a check of offsets
    alone would not see (a configure() must refuse it by the names)."""
    names = list(names)
    i, j = names.index(a), names.index(b)
    names[i], names[j] = names[j], names[i]
    return tuple(names)
