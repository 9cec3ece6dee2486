"""`benchmarks/ab.py` (a checkout's A/B of two revisions): both sides run from their own trees, in alternating order, and the report's
medians and ratios are those of the runs. The trees here are stand-ins whose `bench store` /
`bench lightqueue` print fixed result lines, so every figure in the report is known beforehand; the
real benches are what BENCHMARKS.md's A/B row ran."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

AB = Path(__file__).resolve().parents[2] / "benchmarks" / "ab.py"
_spec = importlib.util.spec_from_file_location("benchmarks_ab", AB)
assert _spec and _spec.loader
_ab_module = importlib.util.module_from_spec(_spec)
sys.modules["benchmarks_ab"] = _ab_module          # its dataclasses look their module up
_spec.loader.exec_module(_ab_module)
figures = _ab_module.figures

STORE_LINE = {"mode": "async", "size": 100, "batch": 64, "writers": 1, "cpu_us_per_msg": 0.8}
LQ_LINE = {"case": "publish", "fanout": 4, "cpu_us_per_record": {"process": 2.4}}


def _tree(root, rates: list[int], encoder: str = "c"):
    """A namespaced source tree whose bench prints the next rate of `rates` on each run (so the
    rounds differ) and appends 'label' to a log shared by both trees (the order they ran in)."""
    (root / "gateway").mkdir(parents=True)
    (root / "store").mkdir()
    for pkg in ("gateway", "store"):
        (root / pkg / "__init__.py").write_text("")
    (root / "gateway" / "serve.py").write_text("")
    (root / "store" / "commitlog.py").write_text("")
    (root / "pyproject.toml").write_text('[tool.setuptools.package-dir]\n"lmqtt.gateway" = "gateway"\n')
    (root / "gateway" / "cli.py").write_text(f"""
import json, os, sys
root = {str(root)!r}
runs = os.path.join(root, "runs")
n = len(open(runs).read().split()) if os.path.exists(runs) else 0
open(runs, "a").write(sys.argv[2] + " ")
open(os.path.join(os.path.dirname(root), "order"), "a").write(os.path.basename(root) + " ")
rate = {rates!r}[n // 2]
print(json.dumps({{"mode": "baseline-python", "size": 0, "batch": 0, "writers": 1}}))
if sys.argv[2] == "store":
    print(json.dumps(dict({STORE_LINE!r}, msgs_per_s=rate, encoder={encoder!r})))
else:
    print(json.dumps(dict({LQ_LINE!r}, records_per_s=rate)))
""")


def _ab(tmp_path, *extra):
    return subprocess.run([sys.executable, str(AB), "--before", str(tmp_path / "old"),
                           "--after", str(tmp_path / "new"), "--benches", "store,lightqueue", "--out",
                           str(tmp_path / "out"), *extra], capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_report_gives_medians_ranges_and_ratios_of_alternated_rounds(tmp_path):
    _tree(tmp_path / "old", [100, 120, 80])
    _tree(tmp_path / "new", [150, 90, 210])
    r = _ab(tmp_path, "--rounds", "3")
    assert r.returncode == 0, r.stderr
    rows = {row["row"]: row for row in json.loads((tmp_path / "out" / "summary.json").read_text())["rows"]}
    store = rows["store async 100 B, batch 64"]
    assert (store["median_before"], store["median_after"], store["ratio"]) == (100, 150, 1.5)
    assert store["range_before"] == [80, 120] and store["range_after"] == [90, 210]
    assert store["cpu_median_before"] == 0.8
    assert rows["light queues publish, fan-out 4"]["ratio"] == 1.5
    # each bench, each round, each side: before first in odd rounds, after first in even ones
    order = (tmp_path / "order").read_text().split()
    assert order == ["old", "new", "old", "new", "new", "old", "new", "old", "old", "new", "old", "new"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| store async 100 B, batch 64 | 100 (80–120) | 150 (90–210) | 1.50× | 0.8 → 0.8 |" in report
    assert (tmp_path / "out" / "before-store-2.jsonl").exists()


def test_sides_that_ran_different_encoders_are_flagged(tmp_path):
    _tree(tmp_path / "old", [100], encoder="c")
    _tree(tmp_path / "new", [100], encoder="python")
    r = _ab(tmp_path, "--rounds", "1")
    assert r.returncode == 0, r.stderr
    assert "different record encoders" in (tmp_path / "out" / "report.md").read_text()


def test_a_tree_whose_store_comes_from_elsewhere_stops_the_run_before_measuring(tmp_path):
    """The tree lacks the module, so the import falls through to the installed lmqtt: measuring
    that would compare the installed code with itself."""
    _tree(tmp_path / "old", [100])
    _tree(tmp_path / "new", [100])
    (tmp_path / "new" / "store" / "commitlog.py").unlink()
    r = _ab(tmp_path, "--rounds", "1")
    assert r.returncode != 0
    assert "after:" in r.stderr and f"not the tree {tmp_path / 'new'}" in r.stderr, r.stderr
    assert not (tmp_path / "order").exists()


def test_an_unknown_revision_is_refused_by_name(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path / "repo")], check=True)
    r = subprocess.run([sys.executable, str(AB), "--before", "no-such-rev",
                        "--repo", str(tmp_path / "repo"), "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode != 0 and "'no-such-rev' is neither a directory nor a revision" in r.stderr


def test_figures_reads_the_three_benches_and_skips_the_rest():
    assert figures("store", dict(STORE_LINE, msgs_per_s=5.0)) == ("store async 100 B, batch 64", 5.0, 0.8)
    assert figures("store", dict(STORE_LINE, writers=64, msgs_per_s=5.0))[0] == "store async 100 B, 64 writers"
    assert figures("store", {"mode": "baseline-mmap", "msgs_per_s": 1.0, "size": 1, "batch": 1}) is None
    assert figures("lightqueue", dict(LQ_LINE, records_per_s=7)) == ("light queues publish, fan-out 4", 7, 2.4)
    assert figures("compare", {"broker": "mosquitto", "scenario": "fanin", "delivered_per_s": 9.0,
                               "broker_cpu_us_per_msg": 15.5}) == ("MQTT fanin (mosquitto)", 9.0, 15.5)
    assert figures("sdk", {"case": "pop", "size": 100, "msgs_per_s": 3.0, "client_cpu_us_per_msg": 1.5}) == (
        "SDK pop 100 B", 3.0, 1.5)
    assert figures("sdk", {"case": "redis-xadd", "size": 100, "msgs_per_s": 3.0}) is None
    assert figures("compare", {"broker": "lmqtt", "scenario": "fanin", "error": "x", "delivered_per_s": 0}) is None
