"""A group that starts healthy says so without alarms: its members log no WARNING or ERROR line
on the way to a primary with every member in sync (an operator alerts on those levels)."""
from __future__ import annotations

import re

import pytest

from tests.ha.group import StoreGroup

pytestmark = pytest.mark.timeout(120)


def test_a_group_starting_healthy_logs_no_warning(tmp_path):
    g = StoreGroup(tmp_path, 3, election_timeout=2.0).start()
    try:
        g.wait_primary(in_sync=3)
        for m in g.members:
            text = m.log_text()
            assert "event=ha_following" in text or "event=ha_primary " in text, text
            alarms = [ln for ln in text.splitlines() if re.search(r"level=(warning|error|critical)", ln)]
            assert alarms == [], f"member {m.node}:\n" + "\n".join(alarms)
    finally:
        g.stop()
