"""QoS 2 exactly once across a kill -9 of a gateway over a remote store (`lmqtt gateway` +
`lmqtt store`, as a fleet and `lmqtt serve --workers` run): the gateway restores its sessions at
start, but over a remote store it cannot read the messages of their exchanges in flight there
(they are read ahead with the CONNECT that resumes a session); the restored copy keeps the
record's state unchanged (`MqttSession.keep_saved`, written back as read) and the client's CONNECT
resumes it with those messages: PUBLISH again with DUP and the same packet id, PUBREL for those
past PUBREC, never a message sent again as new. Before, the copy restored at start dropped its
queue's exchanges (the messages were "not stored"), wrote that back over the record, and the
messages since the last committed offset went out again as new ones: the subscriber delivered
them twice (`lmqtt bench chaos`: QoS 2 duplicates after a kill of the store under `serve
--workers` or of a fleet gateway)."""
from __future__ import annotations

import pytest

from tests.e2e.test_e2e_qos2_crash import qos2_exchanges_survive_a_crash
from tests.support import serve_or_fleet


@pytest.fixture
def fleet(tmp_path):
    yield from serve_or_fleet("fleet", tmp_path)


@pytest.mark.parametrize("victim", ["gateway", "store and gateway"])
def test_qos2_exchanges_survive_kill9_of_a_remote_gateway_exactly_once(fleet, victim):
    restart = fleet.gateway.restart if victim == "gateway" else fleet.restart     # gateway: the store stays up
    qos2_exchanges_survive_a_crash(fleet, lambda: restart(kill=True))
