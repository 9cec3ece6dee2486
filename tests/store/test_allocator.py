"""The long-running processes run on the C library's malloc, or on jemalloc when asked
(store/allocator.py): with LMQTT_MALLOC=jemalloc `lmqtt serve` executes itself again with it
preloaded, keeping its PID; and the store's periodic trim returns jemalloc's freed pages."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from lmqtt.store import allocator
from tests.support import ROOT, free_port, listening

pytestmark = pytest.mark.timeout(60)
JEMALLOC = allocator.find_jemalloc()
needs_jemalloc = pytest.mark.skipif(JEMALLOC is None, reason="libjemalloc is not installed")


def _serve(tmp_path, env_extra: dict[str, str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF", allocator.ENV)}
    env.update(env_extra)
    p = subprocess.Popen([sys.executable, "-m", "lmqtt.gateway.cli", "serve", "--port", str(port),
                          "--data-dir", str(tmp_path / "d"), "--metrics-port", "0", "--store-port", "0"],
                         cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    listening("127.0.0.1", port, 30, p)
    return p, port


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def _stop(p: subprocess.Popen) -> str:
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    return err


@needs_jemalloc
def test_lmqtt_malloc_jemalloc_runs_serve_on_it_in_the_process_it_was_started_as(tmp_path):
    p, _ = _serve(tmp_path, {allocator.ENV: "jemalloc"})
    try:
        maps = _maps(p.pid)          # the PID a supervisor knows is the one that serves
    finally:
        err = _stop(p)
    assert "libjemalloc" in maps
    assert "malloc:     jemalloc" in err


def test_by_default_serve_runs_on_the_c_library_malloc(tmp_path):
    p, _ = _serve(tmp_path, {})
    try:
        maps = _maps(p.pid)
    finally:
        err = _stop(p)
    assert "libjemalloc" not in maps
    assert "malloc:     C library malloc" in err


def test_an_unknown_lmqtt_malloc_value_is_refused_with_the_choices(tmp_path):
    env = dict(os.environ, **{allocator.ENV: "tcmalloc"})
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", "serve", "--data-dir", str(tmp_path / "d")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "LMQTT_MALLOC='tcmalloc': expected jemalloc or libc" in r.stderr


@needs_jemalloc
def test_the_store_trim_returns_pages_jemalloc_freed():
    # decay off: without the purge jemalloc would keep the freed pages for good
    code = textwrap.dedent("""
        from lmqtt.store import heap
        def anon():
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
        blocks = [bytes(1024) + bytes([i % 251]) for i in range(150_000)]
        blocks.clear()
        freed = anon()
        ok = heap.trim()
        print(ok, freed - anon())
    """)
    env = dict(os.environ, LD_PRELOAD=JEMALLOC, MALLOC_CONF="dirty_decay_ms:-1,muzzy_decay_ms:-1")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    ok, returned_kib = r.stdout.split()
    assert ok == "True"
    assert int(returned_kib) > 100_000          # most of the ~150 MiB went back
