"""Say at start, in the banner and the log, that the Redis of `--redis URL` does not answer.

Both sides keep running without it (Redis carries hints only: a gateway falls back on its safety
poll, the store on the EVENT frames of its watching gateways) and retry quietly, so a typo'd URL or
a Redis not started yet used to show nowhere until a later, unrelated-looking error. `lmqtt gateway`
(gateway/app/gateway_command.py) and `lmqtt store` (store/node/command.py) both call `unreachable_note`."""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable

log = logging.getLogger("lmqtt.notify")

WAIT_S = 3.0


async def unreachable_note(url: str, answered: Awaitable, meanwhile: str, timeout: float = WAIT_S) -> str:
    """Wait up to `timeout` s for `answered` (a first connect, a PING). -> "" when it came, else the
    banner's note " (Redis NOT REACHABLE at URL: retrying; until it answers, <meanwhile>)", with a
    warning `event=notify_redis_unreachable url=...` logged once."""
    try:
        await asyncio.wait_for(answered, timeout)
        return ""
    except Exception as e:  # noqa: BLE001 - a timeout, a refused connection, a DNS error: all "not there"
        why = "" if isinstance(e, asyncio.TimeoutError) else f" error={type(e).__name__}: {str(e)[:200]}"
        log.warning("event=notify_redis_unreachable url=%s%s (retrying; until it answers, %s)", url, why, meanwhile)
        return f" (Redis NOT REACHABLE at {url}: retrying; until it answers, {meanwhile})"
