"""The key index's flush from two threads at once: the background service's flush and an
explicit flush of every dispatcher (shutdown, tests) may meet. Each saves the checkpoint through
the same temp file, so unserialized, one rename found it gone (FileNotFoundError: a CI run of
tests/store/test_file_budget.py met it)."""
from __future__ import annotations

import threading

from lmqtt.store.index_file import IndexService


def test_two_threads_flushing_the_key_index_at_once_both_succeed_and_the_checkpoint_is_the_last(tmp_path):
    svc = IndexService(str(tmp_path / "index"), slots=64, entries=1024, preallocate=False)
    svc.load()
    errors: list[BaseException] = []
    end = [0]
    lock = threading.Lock()

    def flusher():
        for _ in range(400):
            with lock:
                end[0] += 1
                svc._last_end = end[0]
            try:
                svc.flush()
            except BaseException as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)

    threads = [threading.Thread(target=flusher) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    svc.flush()
    assert svc._ckpt_file.load() == 800
