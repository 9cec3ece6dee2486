"""The CI round of network partitions: real `lmqtt store --group` members, gateways, Redis and
clients on namespace hosts, one fault after the other under load (the module's tests share the
fleet and run in order), each healed and the group whole again before the next; the last test
judges every message of the whole round.

Each fault test asserts what a user of the group relies on through that fault: the primary cut
from its replicas (but not from its clients) is replaced and never acknowledges beside the new
one; a cut replica or gateway comes back; after every heal all members are back in the in-sync
set with byte-identical CommitLogs."""
from __future__ import annotations

import pytest

from .conftest import fleet_round, needs_bed

pytestmark = needs_bed


@pytest.fixture(scope="module")
def bed_round(tmp_path_factory):
    yield from fleet_round(tmp_path_factory, "partitions-ci")


def _whole_again(row: dict) -> None:
    assert row["whole_before"], row
    assert row["resynced"], f"the group was not whole again after the heal: {row.get('not_resynced')}; {row}"
    assert row["log_equal_upto"] > 0 and row["two_primary_acks"] == 0, row
    assert "died" not in row, row


def test_the_primary_cut_from_its_replicas_is_replaced_and_acknowledges_nothing_beside_the_new_one(bed_round):
    _bed, fleet, rnd = bed_round
    row = rnd.fault("primary-split")
    _whole_again(row)
    assert row["primary_after"] != row["primary_before"] and row["epoch_after"] > row["epoch_before"], row
    assert row["failover_s"] is not None, f"no SDK send acknowledged by the new primary during the cut: {row}"
    # the old primary, still reached by its clients, acknowledged nothing they kept: every SDK
    # acknowledgement so far names an offset that holds its own message in the group's log
    assert rnd.two_primary == [] and len(rnd._checked) > 0
    old = fleet.group.member(row["primary_before"])
    text = (fleet.workdir / f"{old.host}.log").read_text(errors="replace")
    assert "event=ha_primary_deposed" in text, "the old primary never learnt it was deposed"


def test_a_one_way_cut_of_what_the_replicas_send_the_primary_moves_the_primary(bed_round):
    _bed, _fleet, rnd = bed_round
    row = rnd.fault("asym-in")
    _whole_again(row)
    assert row["primary_after"] != row["primary_before"], row
    assert row["ack_gap_s"] < row["hold_s"], f"writes stopped for the whole cut: {row}"


def test_a_cut_replica_leaves_and_rejoins_while_writes_go_on(bed_round):
    _bed, _fleet, rnd = bed_round
    row = rnd.fault("replica-cut")
    _whole_again(row)
    assert row["primary_after"] == row["primary_before"], row
    assert row["ack_gap_s"] < row["hold_s"], f"writes stopped for the whole cut: {row}"


def test_a_gateway_cut_from_redis_still_delivers(bed_round):
    _bed, _fleet, rnd = bed_round
    before = rnd.checker.counts()["deliveries"]
    row = rnd.fault("gateway-redis")
    _whole_again(row)
    assert row["deliveries"] > before


def test_the_round_loses_nothing_acknowledged(bed_round):
    _bed, _fleet, rnd = bed_round
    s = rnd.finish()
    assert s["acked"] > 0 and s["sdk_acks_checked"] > 0, s
    assert s["lost"] == 0, [r["examples"].get("lost") for r in s["rows"]]
    assert s["two_primary_acks"] == 0, s["two_primary_examples"]
    assert s["acked_not_in_log"] == 0, s["not_in_log_examples"]
    assert s["never_sent"] == 0 and s["duplicated_qos2"] == 0 and s["reordered"] == 0, s
    assert s["logs_equal_at_end"] and not s["never_resynced"] and not s["died"], s
    assert s["failures"] == [], s["failures"]
