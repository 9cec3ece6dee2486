"""SIGTERM and SIGINT of `lmqtt store`, taken by one thread with sigwait while every other thread
blocks them.

Why not the event loop's signal handlers: a group member restarts in place (execve, the same pid)
to cut its log back to its primary's (store/node/ha_member.py), and a stop that comes meanwhile -
an orchestrator's SIGTERM can land at any moment - must stop the restarted store, not be lost. The
kernel keeps a *blocked* signal pending across execve; but a signal is delivered to any thread that
does not block it, and RocksDB's and the store's threads inherit the mask of the thread that starts
them: with the loop's handlers they did not block it, so a SIGTERM that reached one of them after
the loop had stopped reading its wakeup fd ran a handler of the old image and vanished (the member
ran on until killed), or one that came once the new image started, before its handlers, killed it
midway.

So: `block()` first thing in `main`, before any thread exists, so every thread inherits the block;
`StopSignals` waits for them on its own thread and hands each to the event loop; before a restart
`close()` ends that thread, and whatever came since stays pending for the new image's
`StopSignals` to take. (A child process would inherit the block; the store node starts none.)
"""
from __future__ import annotations

import signal
import threading
from typing import Callable

STOP = frozenset({signal.SIGTERM, signal.SIGINT})
# wakes the waiting thread when it is closed; any other SIGUSR2 is ignored (not a stop)
_WAKE = signal.SIGUSR2


def block() -> None:
    """Block the stop signals (and the wake-up) in this thread and every thread it starts."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP | {_WAKE})


class StopSignals:
    """The thread that takes SIGTERM/SIGINT (blocked everywhere by `block`) and calls `on_signal`
    (from that thread: use `loop.call_soon_threadsafe`)."""

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self._on_signal = on_signal
        self._closing = False
        self.received: list[int] = []
        self._thread = threading.Thread(target=self._run, name="lmqtt-stop-signals", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            sig = signal.sigwait(STOP | {_WAKE})
            if sig == _WAKE:
                if self._closing:
                    return
                continue
            self.received.append(sig)
            try:
                self._on_signal(sig)
            except RuntimeError:      # the event loop is already closed: the store is stopping anyway
                return

    def close(self) -> None:
        """End the waiting thread; a stop signal sent from now on stays pending (blocked)."""
        self._closing = True
        if self._thread.is_alive():
            signal.pthread_kill(self._thread.ident, _WAKE)      # type: ignore[arg-type]
        self._thread.join(5)

    def stop_pending(self) -> bool:
        """Whether a stop signal came: taken by the thread, or pending since it was closed."""
        return bool(self.received) or bool(STOP & signal.sigpending())
