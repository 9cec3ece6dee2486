"""A traffic worker's failure reaches the parent over its pipe (loadtest/traffic_worker.py)."""
from __future__ import annotations

import multiprocessing

import pytest

from lmqtt.loadtest.traffic_worker import _errors_to_parent


def test_a_worker_exception_is_sent_to_the_parent_then_raised_and_ctrl_c_is_quiet():
    parent, child = multiprocessing.Pipe()
    try:
        with pytest.raises(ValueError):
            with _errors_to_parent(child):
                raise ValueError("no route to broker")
        assert parent.poll(5) and parent.recv() == ("error", "ValueError: no route to broker")
        with _errors_to_parent(child):
            raise KeyboardInterrupt
        assert not parent.poll(0)
    finally:
        parent.close()
        child.close()
