"""The web console (docs/console.md): an ASGI app (Starlette) served by uvicorn's asyncio server
inside the gateway's own event loop, on the metrics port, beside /metrics, /healthz and /readyz.

Why in the loop (no thread, no second process): every page reads the broker's live state
(connections, sessions, cursors), which only the loop thread may touch; a snapshot costs a walk
of plain Python objects, taken once per second by the sampler or once per page request.
"""
__all__ = ["ConsoleServer", "add_console_args"]


def __getattr__(name: str):
    # ConsoleServer (Starlette, uvicorn: ~0.1 s of imports) is imported when the console starts,
    # after the MQTT listener is up; the command's flags (`add_console_args`) need none of it
    if name == "ConsoleServer":
        from .server import ConsoleServer  # only with the console's port open (Starlette, uvicorn)
        return ConsoleServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_console_args(p) -> None:
    """The console's flags, the same on `lmqtt serve` and `lmqtt gateway` (its config keys too)."""
    p.add_argument("--no-console", dest="console", action="store_false", default=None,
                   help="serve /metrics only, without the web console (docs/console.md)")
    p.add_argument("--console-login", action="store_true", default=None,
                   help="the console asks for a login on loopback too (always elsewhere)")
    p.add_argument("--console-admins", help="password-file users with the console's admin role, comma-separated")
    p.add_argument("--console-viewers", help="password-file users with the console's read-only role, comma-separated")
    p.add_argument("--console-tls", action="store_true", default=None,
                   help="serve the metrics port (console and /metrics) over HTTPS with --cert/--key")
