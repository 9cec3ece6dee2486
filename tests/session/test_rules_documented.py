"""docs/session.md lists every normative statement the session machine's tables check, each with
the test file that checks it, and names no statement no row checks."""
from __future__ import annotations

import pathlib
import re

from tests.session import test_inbound, test_limits, test_outbound, test_resume

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "session.md"
TABLES = {"test_outbound.py": test_outbound.IDS + test_outbound.QOS2 + test_outbound.FLOW + test_outbound.RUNS
          + test_outbound.RETAINED,
          "test_inbound.py": test_inbound.INBOUND,
          "test_limits.py": test_limits.ALIASES + test_limits.MAX_PACKET + test_limits.EXPIRY,
          "test_resume.py": test_resume.RESUME + test_resume.PERSISTENT + test_resume.EXPIRY}
RULE = re.compile(r"MQTT-[\d.]+-\d+|MQTT 5 §[\d.]+")


def checked() -> dict[tuple[str, str], set[str]]:
    """(spec, statement) -> the test files whose rows check it."""
    out: dict[tuple[str, str], set[str]] = {}
    for f, rows in TABLES.items():
        for row in rows:
            assert RULE.search(row.rules), row.id
            for seg in row.rules.split(";"):
                seg = seg.strip()
                spec = "5.0"
                if seg.startswith("3.1.1:"):
                    spec, seg = "3.1.1", seg[len("3.1.1:"):]
                for rid in RULE.findall(seg):
                    out.setdefault((spec, rid), set()).add(f)
    return out


def documented() -> dict[tuple[str, str], str]:
    """(spec, statement) -> its line in docs/session.md's table."""
    out = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] in ("5.0", "3.1.1"):
            out[(cells[0], cells[1])] = line
    return out


def test_every_rule_a_row_checks_is_in_the_docs_with_its_test_file():
    docs = documented()
    missing = sorted(k for k in checked() if k not in docs)
    assert missing == [], f"add to docs/session.md: {missing}"
    wrong = sorted((k, f) for k, files in checked().items() for f in files if f"`{f}`" not in docs[k])
    assert wrong == [], f"docs/session.md does not name the test file: {wrong}"


def test_the_docs_name_no_rule_without_a_row():
    extra = sorted(set(documented()) - set(checked()))
    assert extra == [], f"no row checks these (docs/session.md): {extra}"
