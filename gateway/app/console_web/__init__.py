"""The web console (docs/console.md): an ASGI app (Starlette) served by uvicorn's asyncio server
inside the gateway's own event loop, on the metrics port, beside /metrics, /healthz and /readyz.

Why in the loop (no thread, no second process): every page reads the broker's live state
(connections, sessions, cursors), which only the loop thread may touch; a snapshot costs a walk
of plain Python objects, taken once per second by the sampler or once per page request.
"""
from .server import ConsoleServer

__all__ = ["ConsoleServer"]
