"""docs/sdk.md walked block by block: its Python blocks run in order, in one session, against a real
`lmqtt serve` (as the page says they do), the sync blocks with the sync SDK, the asyncio ones in
one event loop. The page's examples are the SDK's public API: a block that stops working fails
here, naming the block."""
from __future__ import annotations

import ast
import asyncio
import pathlib
import re

import pytest

from tests.support import ROOT, LmqttServer

pytestmark = pytest.mark.timeout(180)

BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _blocks() -> list[str]:
    return BLOCK.findall((pathlib.Path(ROOT) / "docs" / "sdk.md").read_text())


def test_the_page_has_sync_and_asyncio_blocks():
    blocks = _blocks()
    assert len(blocks) >= 5 and any("await " in b for b in blocks) and any("await " not in b for b in blocks)


def test_every_python_block_of_docs_sdk_md_runs_against_a_real_store(tmp_path):
    (tmp_path / "data").mkdir()
    srv = LmqttServer(str(tmp_path / "data")).start()
    try:
        blocks = [(i, b.replace("127.0.0.1:10911", srv.store_address)) for i, b in enumerate(_blocks(), 1)]
        ns: dict = {}
        sync = [(i, b) for i, b in blocks if "await " not in b]
        aio = [(i, b) for i, b in blocks if "await " in b]
        for i, src in sync:
            _run(i, src, ns)
        assert ns["r"].msg_id and ns["a"] is not None
        if aio:
            asyncio.run(_run_async(aio, ns))       # one loop: a connection belongs to the loop it was made on
    finally:
        srv.stop()


def _code(i: int, src: str):
    return compile(src, f"docs/sdk.md python block {i}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def _run(i: int, src: str, ns: dict) -> None:
    try:
        eval(_code(i, src), ns)                    # noqa: S307 - the page's own examples
    except Exception as e:                         # noqa: BLE001 - named with its block
        pytest.fail(f"docs/sdk.md python block {i} failed: {type(e).__name__}: {e}\n{src}")


async def _run_async(blocks: list[tuple[int, str]], ns: dict) -> None:
    for i, src in blocks:
        try:
            result = eval(_code(i, src), ns)       # noqa: S307 - the page's own examples
            if asyncio.iscoroutine(result):
                await result
        except Exception as e:                     # noqa: BLE001 - named with its block
            pytest.fail(f"docs/sdk.md python block {i} failed: {type(e).__name__}: {e}\n{src}")
    await ns["c"].close()
