"""uvicorn's server, embedded in the running loop.

`uvicorn.Server.serve` installs its own SIGINT/SIGTERM handlers (and restores them on exit) in its
`capture_signals()` context: the gateway owns those signals (serve_command's stop event, SIGHUP
reloads), so this subclass makes `capture_signals` a no-op and runs the public `serve()` on a
socket bound here (a port in use is the caller's OSError, like the metrics server's, before
anything is served).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn

from .app import build_app
from .fleet import Fleet

log = logging.getLogger("lmqtt.console")


class _Server(uvicorn.Server):
    """uvicorn's `main_loop` polls `should_exit` ten times a second (`asyncio.sleep(0.1)`): on an
    idle broker that was the event loop's most frequent wake-up. Here setting `should_exit` wakes
    the loop instead (this server has no Date header, max-requests limit or notify callback, the
    other things uvicorn's ticks do)."""

    def __init__(self, config) -> None:
        self._exit: asyncio.Event | None = None
        self._should_exit = False
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        if value and self._exit is not None:
            self._exit.set()

    async def main_loop(self) -> None:
        self._exit = asyncio.Event()
        if await self.on_tick(0):           # the headers, as uvicorn's first tick
            return
        while not self._should_exit:
            await self._exit.wait()

    @contextlib.contextmanager
    def capture_signals(self):   # the gateway's loop handles the signals
        yield


class ConsoleServer:
    def __init__(self, gateway, cfg, sdk=None, ready=None) -> None:
        """`sdk`: lmqtt serve's store server (the groups page); `ready() -> (ok, why)`: /readyz of a
        fleet gateway (its store link), else ready while the broker accepts MQTT clients."""
        self.gw, self.cfg, self.sdk, self.ready = gateway, cfg, sdk, ready
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None
        self.state = None
        self.fleet: Fleet | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Bind HOST:PORT and serve /metrics, /healthz, /readyz and the console; the bound address."""
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(fam, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        bound = sock.getsockname()[:2]
        self.fleet = Fleet(self.gw, self.cfg, self.sdk)
        app, self.state = build_app(self.gw, self.cfg, bound[0], self.ready, self.fleet)
        self.state.sdk = self.sdk
        tls = {}
        if getattr(self.cfg, "console_tls", False):     # the listener's certificate (cfg.validate checked it is set)
            tls = {"ssl_certfile": self.cfg.cert, "ssl_keyfile": self.cfg.key or self.cfg.cert}
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1, server_header=False, date_header=False, **tls)
        try:
            config.load()          # reads the certificate: a bad file is this OSError/SSLError, before serving
        except BaseException:
            sock.close()
            raise
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        self.state.start_sampler()
        self.fleet.start(bound[0], bound[1])      # a fleet gateway: the other consoles can find this one
        return bound[0], bound[1]

    async def stop(self) -> None:
        if self.state is not None:
            self.state.stop()
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            try:
                await asyncio.wait_for(self._task, 5)
            except (asyncio.TimeoutError, Exception) as e:  # noqa: BLE001 - stopping must not fail the shutdown
                log.warning("event=console_stop_failed error=%r", e)
            self._server = self._task = None
