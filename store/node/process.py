"""What every lmqtt process does around its work: log lines in one key=value format, the event loop
(uvloop when installed), the data dir (checked with the real cause of a refusal, and locked so two
processes never open one), the process name (for ps/pidof), the banner's metrics line.

Shared by `lmqtt store` (store/node/command.py), `lmqtt serve` and `lmqtt gateway`
(gateway/app/serve_command.py, gateway_command.py); it lives with the store node because the node is the
lower layer: the gateway's processes may import the node package, never the other way round
(docs/internals.md). Standard library only (setproctitle when installed).
"""
from __future__ import annotations

import ctypes
import fcntl
import logging
import os
import pwd
import resource
import shutil
import sys


class KeyValueFormatter(logging.Formatter):
    """`ts=... level=... logger=... event=... k=v`: greppable structured logs without a dependency."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        base = f"ts={self.formatTime(record, '%Y-%m-%dT%H:%M:%S')}.{int(record.msecs):03d} " \
               f"level={record.levelname.lower()} logger={record.name} {msg}"
        if record.exc_info:
            base += " exc=" + repr(self.formatException(record.exc_info))
        return base


def raise_open_files_limit() -> int:
    """Raise the soft open-files limit to the hard one, what the administrator allows (shells
    start programs with a soft limit of 1,024 however high the hard one is), before anything is
    opened; -> the limit now. The store's share of it and the clients' are in store/file_budget.py."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and hard != resource.RLIM_INFINITY:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            return hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def install_event_loop() -> str:
    """uvloop when installed, else asyncio's own loop;
    returns the name for the startup banner. Shared by every long-running lmqtt command."""
    try:
        import uvloop  # type: ignore
        uvloop.install()
        return "uvloop"
    except ImportError:  # pragma: no cover
        return "asyncio"


def setup_logging(level: str) -> None:
    """key=value lines on stderr at `level` (every lmqtt process logs alike)."""
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(getattr(logging, str(level).upper(), logging.INFO))


def metrics_unavailable(host: str, port: int, e: OSError) -> str:
    """The banner's metrics line when its port cannot be opened: MQTT still serves; the line names
    the address and the flag that moves it."""
    return (f"unavailable: cannot listen on {host}:{port}: {e.strerror or e} (choose another port with "
            f"--metrics-port N, or 0 = off)")


def check_data_dir(path: str) -> str | None:
    """None if `path` can be created and written, else the real reason (startup errors name their
    cause: an unwritable data dir is reported as such, not as a listener that cannot start; a file
    where the directory should be as "not a directory", not as "File exists")."""
    where = os.path.abspath(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        return f"cannot use data dir {where}: not a directory (a file of that name is in the way)"
    try:
        os.makedirs(path, exist_ok=True)
    except NotADirectoryError:
        parent = _blocking_parent(where)
        return f"cannot use data dir {where}: {parent} is a file, not a directory"
    except PermissionError:
        return (f"cannot use data dir {where}: permission denied (creating it in {_existing_parent(where)}, "
                f"as {_user()})")
    except OSError as e:
        return f"cannot use data dir {where}: {e.strerror or e}"
    probe = os.path.join(path, f".write-test-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
        os.unlink(probe)
    except PermissionError:
        return f"cannot use data dir {where}: permission denied (writing in it, as {_user()})"
    except OSError as e:
        return f"cannot use data dir {where}: {e.strerror or e}"
    locked = _not_writable(path)
    if locked:
        return (f"cannot use data dir {where}: permission denied: {os.path.abspath(locked)} is not writable "
                f"as {_user()} (made by another user? then: chown -R {_user().split()[-1]} {where})")
    return None


def _not_writable(path: str, limit: int = 20000) -> str | None:
    """The first directory or file under `path` this process cannot write (None: all it looked at
    are writable; at most `limit` entries are looked at). The store and RocksDB open these for
    writing; one made by another user (an earlier run as root) would otherwise fail deep inside
    RocksDB with a traceback."""
    seen = 0
    for root, dirs, files in os.walk(path):
        for name in [""] + files:
            p = os.path.join(root, name) if name else root
            mode = os.W_OK | (os.X_OK if not name else 0)
            if not os.access(p, mode) and not os.path.islink(p):
                return p
            seen += 1
            if seen >= limit:
                return None
    return None


def _existing_parent(path: str) -> str:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _blocking_parent(path: str) -> str:
    """The first component of `path` that exists and is not a directory."""
    parts = path.split(os.sep)
    for i in range(2, len(parts) + 1):
        p = os.sep.join(parts[:i]) or os.sep
        if os.path.exists(p) and not os.path.isdir(p):
            return p
    return path


def _user() -> str:
    try:
        return f"user {pwd.getpwuid(os.geteuid()).pw_name}"
    except (ImportError, KeyError):
        return f"uid {os.geteuid()}"


class DataDirError(Exception):
    """The data dir cannot be used by this process; the message names the cause."""


LOCK_FILE = "lmqtt.lock"


def remove_refused_data_dir(path: str, existed: bool) -> None:
    """A start refused after the data dir was made (a port in use, a failing listener): the data
    dir goes again when this start created it, so a mistyped flag leaves nothing behind. Called
    while the lock is still held (no other process can be using it); one that was there is kept."""
    if not existed:
        shutil.rmtree(path, ignore_errors=True)


def lock_data_dir(path: str, command: str) -> int:
    """Take the data dir for this process: an exclusive lock (flock) on `lmqtt.lock` in it, which
    then holds `PID COMMAND`. Returns the file descriptor (the lock lives as long as it is open, and
    ends with the process however it ends; the file stays). Taken before anything in the data dir
    is opened: two processes on one data dir would both open the CommitLog, and the second one's
    recovery could cut what the first just appended. Raises DataDirError naming the holder."""
    lock_path = os.path.join(path, LOCK_FILE)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise DataDirError(f"cannot open {os.path.abspath(lock_path)}: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
        except OSError:
            holder = ""
        os.close(fd)
        pid, _, cmd = holder.partition(" ")
        who = f"pid {pid}" + (f", {cmd}" if cmd else "") if pid.isdigit() else "pid unknown"
        raise DataDirError(f"data dir {os.path.abspath(path)} is in use by another lmqtt ({who}); stop it "
                           f"first, or give this one another --data-dir") from None
    except OSError as e:
        os.close(fd)
        raise DataDirError(f"cannot lock {os.path.abspath(lock_path)}: {e.strerror or e}") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {command}\n".encode(), 0)
    except OSError:         # a full disk: the lock holds all the same, only the pid is not shown
        pass
    return fd


def set_process_title(command: str, argv: list[str], name: str = "lmqtt", child: bool = False) -> None:
    """Name this process for ps/top/pidof/pkill: its name (`ps -o comm`, /proc/PID/comm) becomes
    `name`, and, unless it is a `child`, its command line (`ps -f`) becomes `lmqtt COMMAND ARGS...`
    in place of `python3 -m lmqtt.gateway.cli COMMAND ARGS...` (the setproctitle package).

    Why both: `pidof lmqtt` (sysvinit's, Debian's) finds a process by its name only once its
    command line was rewritten (it then holds a space), so `kill -HUP $(pidof -s lmqtt)` reaches
    `lmqtt serve` / `lmqtt gateway` (they reload the password file and ACL on SIGHUP). The
    children of `lmqtt serve --workers` (store, gateways) get names of their own (`lmqtt-store`,
    `lmqtt-w0`, ...) and keep their command line, so `pidof -s lmqtt` is the supervisor (which
    passes SIGHUP on to its workers) and tools that read a child's argv (the chaos harness,
    `ps --ppid`) still can. A standalone `lmqtt store` is named `lmqtt-store` (it has nothing to
    reload and ignores SIGHUP). Without the setproctitle package only the name is set (prctl)."""
    try:
        import setproctitle  # only the processes serve --workers starts
    except ImportError:      # pragma: no cover - a dependency; without it the name only
        setproctitle = None
    if setproctitle is not None:
        if not child:
            setproctitle.setproctitle(" ".join(["lmqtt", command, *argv]))
        setproctitle.setthreadtitle(name)          # the main thread's name is the process name
        return
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)   # PR_SET_NAME
        except (OSError, AttributeError):
            pass
