"""`lmqtt bench tier --cases history-plan` (loadtest/tier_bench.py) runs and measures what it says:
a tier of N segments' Parquet files (3 per segment), every one listed in the manifest, the filter
matched both ways (footers, manifest lists) to the same topics."""
from __future__ import annotations

import json

import pytest

from tests.support import lmqtt_cli

pytest.importorskip("pyarrow")


def test_history_plan_case_on_a_file_tier(tmp_path):
    r = lmqtt_cli("bench", "tier", "--cases", "history-plan", "--tiers", "file", "--plan-segments", "4",
                  "--repeat", "1", "--data-dir", str(tmp_path), timeout=240)
    assert r.returncode == 0, r.stderr
    out = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(out) == 1, r.stdout
    o = out[0]
    assert o["case"] == "history-plan" and o["segments"] >= 4
    assert o["files"] == o["listed_files"] == 3 * o["segments"]
    assert o["topics_matched"] == 120                      # {a,b,c}/<40>/temp
    assert o["footers_s"] > 0 and o["manifest_s"] > 0


def test_filter_sdk_case_reads_every_matching_message_from_the_tier(tmp_path):
    r = lmqtt_cli("bench", "tier", "--cases", "filter-sdk", "--tiers", "file", "--filter-rows", "3000",
                  "--repeat", "1", "--data-dir", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr
    (o,) = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert o["case"] == "filter-sdk" and o["read"] == o["matching"] == 3000 and o["topic_read"] == 6000
    assert o["tier_segments"] >= 1 and o["filter_msgs_per_s"] > 0
