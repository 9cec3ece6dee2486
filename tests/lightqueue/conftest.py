"""Fixtures of the light-queue tests."""
from __future__ import annotations

import pytest

from tests.lightqueue.pairs import open_pair


@pytest.fixture
def pair(tmp_path):
    """A started MessageStore and its LightQueueStore (tests.lightqueue.pairs.open_pair)."""
    st, lq = open_pair(tmp_path)
    st.start()
    yield st, lq
    st.shutdown()
    lq.close()
