"""The repository is a product, not a lab notebook (the developers' guide): code, tests and docs
say why and what, never which issue or which working session a change came from; raw benchmark
results and dated run logs stay out of the tree (git history keeps them); BENCHMARKS.md holds
the current figures in at most 300 lines; the tree stays small enough to read."""
from __future__ import annotations

import re
import subprocess

import pytest

from tests.architecture.test_layering import ROOT

# What a diary leaves behind: an issue number (the word issue, or #, and a number), a working
# session (the word session and a number, or session-N), a dated run folder ("2026-11-25-s3/",
# "2026-11-23/x"), the results folder and the history file that held them.
NOTEBOOK = re.compile(
    r"\bissues? #?\d+"
    r"|(?<![\w/&])#\d{1,5}\b"
    r"|(?<![-\w])(?<!clean )(?<!per )sessions? \d+\b(?!\s*(?:s\b|ms\b|seconds?\b|minutes?\b|µs\b|KiB\b|MiB\b|bytes?\b))"
    r"|\bsession-\d+\b"
    r"|(?<![=\w])20\d\d-\d\d-\d\d(?:-[a-z0-9]+)?/"
    r"|docs/benchmarks/|benchmarks/history\.md|benchmarks/results",
    re.IGNORECASE)
# a file named after when it was written ("test_walk_s8.py", "storm-s7")
DIARY_NAME = re.compile(r"(?:^|[_-])s\d{1,2}(?:[_.-]|$)")

SKIP_SUFFIXES = (".png", ".json", ".css", ".lock")


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f for f in out.splitlines() if (ROOT / f).is_file()]


def notebook_lines(text: str) -> list[tuple[int, str]]:
    return [(i, m.group(0)) for i, line in enumerate(text.splitlines(), 1) for m in NOTEBOOK.finditer(line)]


def test_no_issue_numbers_session_names_or_results_paths():
    bad = []
    for f in tracked():
        if f.endswith(SKIP_SUFFIXES) or f == "tests/architecture/test_product_not_notebook.py":
            continue
        text = (ROOT / f).read_text(errors="replace")
        bad += [f"{f}:{line}: {hit!r}" for line, hit in notebook_lines(text)]
    assert bad == [], "a comment says why and a test name what behaviour, not which issue or session " \
        "(and raw results stay out of the tree):\n" + "\n".join(bad)


def test_no_file_is_named_after_a_session():
    bad = [f for f in tracked() if DIARY_NAME.search(f.rsplit("/", 1)[-1])]
    assert bad == []


@pytest.mark.parametrize("text, hits", [
    # the diary's phrases are built from their parts, so that this file does not contain them
    ("see issue %d storm" % 29, ["issue %d" % 29]), ("(issues %d, 27)" % 26, ["issues %d" % 26]),
    ("fixed in #%d." % 43, ["#%d" % 43]),
    ("Session %d's walk" % 8, ["Session %d" % 8]), ("sessions %d-7 changed" % 5, ["sessions %d" % 5]),
    ("raw: docs/benchmarks/results/2026-11-25/x", ["docs/benchmarks/", "2026-11-25/"]),
    ("persistent sessions (clean session 0)", []), ("expiry 10 s, a session 30 s", []),
    ("#include <x.h>  color: #0f1720", []), ("lmqtt bench storm --sessions 3000", []),
    ("CPU per session %d µs" % 167, []), ("<URL>/parquet/date=2026-11-24/0.parquet", []), ("https://github.com/apache/rocketmq/issues/9006", []),
    ("since 2026-11-23T08:00:00Z", []),
])
def test_the_notebook_check_sees_what_it_should(text, hits):
    assert [h for _, h in notebook_lines(text)] == hits


def test_diary_names_are_seen():
    assert DIARY_NAME.search("test_walk_s8.py") and DIARY_NAME.search("storm-s7-x")
    assert not DIARY_NAME.search("test_tier_s3fs.py") and not DIARY_NAME.search("test_sessions.py")


def test_benchmarks_md_is_current_figures_only():
    lines = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    assert len(lines) <= 300, f"BENCHMARKS.md has {len(lines)} lines: keep the current figures, " \
        "git history keeps the runs behind them"


def test_the_tree_stays_readable():
    n = len(tracked())
    assert n < 700, f"{n} tracked files: raw results and one-off scripts stay out of the tree"


# loadtest modules with a command line that are not `lmqtt bench` commands, and why
NOT_BENCH_COMMANDS = {
    "lmqtt.loadtest.fleet_launcher": "the `lmqtt-fleet` broker process that `bench compare` starts, not a benchmark",
    "lmqtt.loadtest.auth_service": "the HTTP auth service `bench compare`'s lmqtt-auth-http broker runs against",
    "lmqtt.loadtest.chaos.nfdelay": "the delaying queue `bench chaos --partitions` starts inside a host's namespace",
    "lmqtt.loadtest.floor_broker": "the `floor` / `floor-store` brokers `bench cost` and `bench compare` start",
}


def test_what_a_user_runs_is_lmqtt_bench_and_each_is_documented():
    """Every load tool with a command line is `lmqtt bench NAME`, listed by `lmqtt bench --help` (the
    BENCH table) and in docs/loadtest.md; nothing a user runs is reachable only by `python3 -m`."""
    from lmqtt.gateway.cli import BENCH, _bench_usage
    from tests.architecture.test_layering import modules
    commands = {target.partition(":")[0] for target, _ in BENCH.values()}
    with_main = {m for m, p in modules().items() if m.startswith("lmqtt.loadtest")
                 and re.search(r"^def main\(", p.read_text(), re.M)}
    assert sorted(with_main - commands - set(NOT_BENCH_COMMANDS)) == []
    doc = (ROOT / "docs" / "loadtest.md").read_text()
    usage = _bench_usage()
    assert [n for n in BENCH if f"`lmqtt bench {n}`" not in doc] == []
    assert [n for n in BENCH if f"  {n} " not in usage] == []
