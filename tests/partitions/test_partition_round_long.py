"""The long round of network partitions (LMQTT_PARTITIONS_LONG=1; about 2.5 minutes): the fault
kinds the CI round does not cut, on a fleet of its own, then every message judged. Same
assertions as tests/partitions/test_partition_round.py."""
from __future__ import annotations

import pytest

from .conftest import fleet_round, long_round, needs_bed
from .test_partition_round import _whole_again

pytestmark = [needs_bed, long_round]


@pytest.fixture(scope="module")
def bed_round(tmp_path_factory):
    yield from fleet_round(tmp_path_factory, "partitions-long")


def test_a_one_way_cut_of_what_the_primary_sends_its_replicas_moves_the_primary(bed_round):
    row = bed_round[2].fault("asym-out")
    _whole_again(row)
    assert row["primary_after"] != row["primary_before"] and row["failover_s"] is not None, row


def test_a_gateway_cut_from_every_store_member_comes_back(bed_round):
    rnd = bed_round[2]
    row = rnd.fault("gateway-store")
    _whole_again(row)
    acked = rnd.checker.counts()["acked"]
    row = rnd.fault("gateway-store")             # the other gateway
    _whole_again(row)
    assert rnd.checker.counts()["acked"] > acked


def test_ten_percent_loss_on_the_primary_link(bed_round):
    row = bed_round[2].fault("loss")
    _whole_again(row)
    assert row["ack_gap_s"] < row["hold_s"], row


def test_two_hundred_ms_delay_on_the_primary_link(bed_round):
    row = bed_round[2].fault("delay")
    _whole_again(row)
    assert row["ack_gap_s"] < row["hold_s"], row


def test_a_flapping_link_between_the_primary_and_its_replicas(bed_round):
    row = bed_round[2].fault("flap")
    _whole_again(row)
    assert row["flaps"] >= 2, row


def test_the_primary_cut_from_one_replica_then_from_the_raft_leader(bed_round):
    rnd = bed_round[2]
    for _ in range(2):            # the Raft leader when a replica leads, then the other replica
        row = rnd.fault("primary-half")
        _whole_again(row)
        assert row["ack_gap_s"] < row["hold_s"], f"writes stopped for the whole cut: {row}"


def test_the_primary_split_again_after_everything_else(bed_round):
    row = bed_round[2].fault("primary-split")
    _whole_again(row)
    assert row["primary_after"] != row["primary_before"], row


def test_the_long_round_loses_nothing_acknowledged(bed_round):
    s = bed_round[2].finish()
    assert s["lost"] == 0 and s["two_primary_acks"] == 0 and s["acked_not_in_log"] == 0, s
    assert s["logs_equal_at_end"] and not s["never_resynced"] and s["failures"] == [], s["failures"]
