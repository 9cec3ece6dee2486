"""Which member of a store group a client dials: the address list ("a:p,b:p,c:p"), the primary a
refusal or a HELLO_OK names, the round robin while none is known, and the probe of the other
members when the one dialled goes silent. One set of rules for the sync (connection.py), asyncio
(aio.py) and gateway (loop_connection.py) connections.

Why a module of its own: connection.py is the framing, pipelining and reconnect of one socket;
finding the primary among several members is a separate decision with its own tests
(tests/store/test_group_client_rules.py), and the three connections share it. It dials only
through connection.py's handshake (`dial`, imported when a probe runs).
"""
from __future__ import annotations

import threading
import time

from lmqtt.store import protocol as W


def parse_address(address: str, default_port: int = W.DEFAULT_PORT) -> tuple[str, int]:
    """"host:port", "[v6]:port" or "host" -> (host, port); ValueError naming the address when
    its port is not a port number."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, _port(address, rest[1:]) if rest.startswith(":") else default_port
    host, sep, port = address.rpartition(":")
    if not sep:
        return address, default_port
    return host or "127.0.0.1", _port(address, port)


def _port(address: str, text: str) -> int:
    if text.isdigit() and 0 < int(text) < 65536:
        return int(text)
    raise ValueError(f"store address {address!r}: {text!r} is not a port number (HOST:PORT, PORT 1..65535)")


def parse_addresses(address: str, default_port: int = W.DEFAULT_PORT) -> list[tuple[str, int]]:
    """"a:p" or a store group's "a:p,b:p,c:p" -> [(host, port), ...] (at least one)."""
    parts = [a.strip() for a in str(address).split(",") if a.strip()]
    return [parse_address(a, default_port) for a in parts] or [parse_address(str(address), default_port)]


def primary_named(message: str) -> tuple[str, int] | None:
    """The primary a not_primary refusal names ("... primary=HOST:PORT"), None while unknown."""
    _, sep, rest = str(message).rpartition("primary=")
    if not sep:
        return None
    rest = rest.split()[0].rstrip(";,.") if rest.split() else ""
    if not rest or rest == "unknown":
        return None
    try:
        return parse_address(rest)
    except ValueError:
        return None


def next_member(addresses: list, current: tuple[str, int], primary=None) -> tuple[str, int]:
    """Where a client of a store group dials next: `primary` ("host:port" or (host, port)) when a
    member named it, else the member after `current` in `addresses` (round robin). The one rule
    the sync, asyncio and gateway connections share."""
    target = primary_named(f"primary={primary}") if isinstance(primary, str) else primary
    if target is not None:
        return target
    try:
        i = addresses.index(current)
    except ValueError:
        i = -1
    return addresses[(i + 1) % len(addresses)]


def newer_primary(info: dict, at: tuple[str, int], current: tuple[str, int], epoch) -> tuple[str, int] | None:
    """What one member's HELLO_OK (`info`, from the member at `at`) says about the group's primary,
    seen from a client connected to `current` in `epoch` (its HELLO_OK's): the address of another
    primary, or None when the member knows of none newer. A member that knows a later epoch than
    the client's is believed (epochs only grow: the client's primary is deposed); from a member
    that does not say its epoch, only a primary other than `current`."""
    theirs = info.get("epoch")
    if isinstance(theirs, int) and isinstance(epoch, int) and theirs <= epoch:
        return None
    target = at if info.get("role") == "primary" else primary_named(f"primary={info.get('primary')}")
    if target is None or target == current:
        return None
    return target


# how often a client of a store group retries while it looks for the primary: a failover's
# last step is the client finding the new one, so this is part of every failover's length
GROUP_RETRY_S = 0.1
# how long a primary found by a probe (a member knew its later epoch) is held to
EXPECT_PRIMARY_S = 3.0


def keeps_expected(expected, here: tuple[str, int], named) -> bool:
    """True when a client aimed at `here` should not follow the primary a member `named`: a probe
    found `here` to be the group's new primary (`expected` = (address, monotonic deadline)), and the
    finding is fresh. The new primary itself applies the election a moment after the members that
    answered the probe, and until then names the old primary - a stopped one, whose HELLO would
    be waited for (2 s). So the client dials the new primary again instead (one shared rule for
    the sync, asyncio and gateway connections)."""
    if expected is None or named is None or here != expected[0] or time.monotonic() >= expected[1]:
        return False
    target = primary_named(f"primary={named}") if isinstance(named, str) else named
    return target is not None and target != here


def probe_primary(addresses: list, current: tuple[str, int], epoch, *, token: str | None, timeout: float,
                  client_name: str, heard: list | None = None) -> tuple[str, int] | None:
    """Ask the other members of a store group (their HELLO_OK: role, primary, epoch) whether another
    member is primary now: the address of a newer primary (newer_primary), or None. For a client
    whose requests get no answer: a stopped or cut-off primary keeps its connections open, so
    silence alone cannot tell it from a slow one, but the members that elected its successor can.
    The members are asked at once (a thread each) and the first that names a newer primary
    answers; each gets `timeout` (a loaded member may answer late, a stopped one never). `heard`
    (a list) gets one entry per member that answered at all."""
    import queue

    from .connection import dial        # connection.py imports this module
    others = [at for at in addresses if at != current]
    if not others:
        return None
    answers: queue.Queue = queue.Queue()

    def ask(at):
        target = None
        try:
            s, info, _early = dial(at[0], at[1], connect_timeout=timeout, client_name=f"{client_name}-probe",
                                   token=token, decoder=W.FrameDecoder())
            try:
                s.close()
            except OSError:
                pass
            if heard is not None:
                heard.append(at)
            target = newer_primary(info, at, current, epoch)
        except Exception:  # noqa: BLE001 - unreachable, refusing or silent: the others may know
            pass
        answers.put(target)

    for at in others:
        threading.Thread(target=ask, args=(at,), name="lmqtt-sdk-probe", daemon=True).start()
    # dial's three steps may each take `timeout`; a member silent that long is not waited for
    deadline = time.monotonic() + 3 * timeout
    for _ in others:
        try:
            target = answers.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if target is not None:
            return target
    return None
