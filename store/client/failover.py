"""Which member of a store group a client dials, and when it reconnects: the address list
("a:p,b:p,c:p"), the primary a refusal or a HELLO_OK names, the round robin while none is known,
the probe of the other members when the one dialled goes silent (`Members`), and the reconnect
schedule (`Retry`). One policy for every connection to a store: the SDK's sync (connection.py)
and asyncio (aio.py) connections, the gateway's link (gateway/storage/store_link.py) and a
replica's follower (store/ha/follower.py: `Retry`).

Why a module of its own: a connection is the framing, pipelining and reconnect of one socket;
finding the primary among several members is a separate decision with its own tests
(tests/store/test_group_client_rules.py), and every connection shares it. It dials only
through the handshake (handshake.py `dial`), for a probe.
"""
from __future__ import annotations

import queue
import threading
import time

from lmqtt.store import protocol as W

from .handshake import dial


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


class Retry:
    """The one reconnect schedule of every connection to a store: the SDK's sync and asyncio
    connections, the gateway's link (gateway/storage/store_link.py) and a replica's follower
    (store/ha/follower.py). Waits double from `initial` up to `cap`; it gives up after `attempts`
    tries or once `deadline_s` seconds have passed since it started (None: never)."""

    def __init__(self, initial: float, cap: float, *, attempts: int | None = None,
                 deadline_s: float | None = None) -> None:
        self.initial = initial
        self.cap = cap
        self.attempts = attempts
        self.deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self.tries = 0
        self._delay = initial

    def wait(self) -> float | None:
        """After a failed try: how long to wait before the next one, or None to give up."""
        self.tries += 1
        if self.attempts is not None and self.tries >= max(1, self.attempts):
            return None
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return None
        d = min(self._delay, self.cap)
        self._delay = min(self._delay * 2, self.cap)
        return d

    @property
    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


class Members:
    """Which member of a store (or of a store group, "a:p,b:p,c:p") a connection talks to, and when
    it leaves it: the one policy of the SDK's sync and asyncio connections and the gateway's link.
    Sans I/O: the connection tells it what happened (a HELLO_OK, a member unreachable, a
    not_primary refusal, silence while requests wait, what a probe found) and reads where to go
    (`host`, `port`) and whether to leave now.

    A member that says it is not the primary is left for the primary it names, or the next member
    while none is known (one that names itself is taking over: dialled again); one that answers
    nothing for `stall_timeout` s while requests wait is left (a stopped or cut-off primary keeps
    its socket open), or sooner, once the other members asked after `probe_after` s of such silence
    (`probe`, every `probe_interval` s) name a newer primary, which is then held to for
    EXPECT_PRIMARY_S (`keeps_expected`)."""

    def __init__(self, address: str, *, failover_timeout: float = 30.0) -> None:
        self.given = parse_addresses(address)      # as the user gave them; `addresses` adds what members say
        self.addresses = list(self.given)
        self.host, self.port = self.addresses[0]
        self.group = len(self.addresses) > 1
        self.failover_timeout = failover_timeout
        self.failovers = 0              # times the connection was attached to another member than before
        self._attached_to: tuple[str, int] | None = None
        self.stall_timeout = 5.0
        self.probe_after = 1.0
        self.probe_interval = 0.5
        self.probe_timeout = 1.0
        self.waiting_since = 0.0        # when the oldest request still waiting was sent
        self.stay = False               # the member dialled named itself primary (still taking over)
        self.expected: tuple[tuple[str, int], float] | None = None   # (address, deadline): a probe's finding
        self.heard_at = 0.0             # when a probe last heard members that know no newer primary
        self.next_probe = 0.0

    @property
    def at(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def address(self) -> str:
        """The member talked to (or dialled next): in a group, the one taken for primary."""
        return f"{self.host}:{self.port}"

    @property
    def members(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.addresses)

    def move(self, primary=None) -> None:
        """Aim at `primary` ("host:port" or (host, port), when a member named it) or else at the
        next member (round robin); a primary a probe found is held to meanwhile."""
        if keeps_expected(self.expected, self.at, primary):
            self.stay = True
            return
        # (not counted here: while a primary is elected the connection tries the members in turn)
        self.host, self.port = next_member(self.addresses, self.at, primary)

    def attached(self) -> None:
        """The connection is up on the member aimed at: a failover when it is another than before."""
        if self._attached_to is not None and self.at != self._attached_to:
            self.failovers += 1
        self._attached_to = self.at

    def refusal(self, info: dict) -> str | None:
        """A HELLO_OK: None when this member serves requests; else why not, the connection
        aimed at the primary it names (or the next member)."""
        self.learn(info)
        role = info.get("role")
        if not self.group or role is None or role == "primary":
            return None
        where = self.address
        self.stay = primary_named(f"primary={info.get('primary')}") == self.at
        self.move(info.get("primary"))
        return f"store {where} is not the group's primary ({role}; primary {info.get('primary') or 'unknown'})"

    def learn(self, info: dict) -> None:
        """Take the member list a store group's member sends in its HELLO_OK (`members`): those
        members are dialled from now on, before the addresses given that are not among them.
        So a client started before an online change of the members (docs/ha.md "Changing the
        members") follows it: a member added since is dialled, one removed is tried last. A
        client given one member's address stays on that member (an admin asking that member
        about itself), follows the primary a refusal names, and once the member it is on
        cannot be reached, tries the others it learned of. A list that does not parse is
        ignored: the addresses known stay."""
        listed = info.get("members")
        if not isinstance(listed, list) or not listed:
            return
        try:
            learned = [parse_address(str(a)) for a in listed]
        except ValueError:
            return
        merged = learned + [a for a in self.given if a not in learned]
        if merged != self.addresses:
            self.addresses = merged
            if len(self.given) > 1:
                self.group = len(merged) > 1

    def unreachable(self, at: tuple[str, int]) -> None:
        """Dialling `at` failed: in a group, the next member (unless it is the one taking over)."""
        if len(self.addresses) > 1 and at == self.at and not self.stay:
            self.move(None)
        self.stay = False

    def not_primary(self, reason: str) -> None:
        """A request refused not_primary: aim at the primary the refusal names."""
        self.move(primary_named(reason))

    def sent(self, pending: bool) -> None:
        """A request goes out; `pending`: others were already waiting."""
        if not pending:
            self.waiting_since = time.monotonic()

    def silence(self, last_rx: float, pending: bool, can_probe: bool = True) -> tuple[str, float] | None:
        """In a group, with requests waiting and nothing heard since `last_rx`: ("leave", silent)
        when the member is given up, ("probe", silent) when the others should be asked now, else
        None. Members that still take this one for the primary (a probe heard them lately) would
        only send the connection back to it: it waits then, up to twice the stall timeout."""
        if not self.group or not pending or not self.waiting_since:
            return None
        now = time.monotonic()
        silent = now - max(last_rx, self.waiting_since)
        held = now - self.heard_at < 1.5 and silent <= 2 * self.stall_timeout
        if silent > self.stall_timeout and not held:
            return "leave", silent
        if silent > self.probe_after and can_probe and now >= self.next_probe:
            self.next_probe = now + self.probe_interval
            return "probe", silent
        return None

    def stalled(self) -> str:
        """Why a silent member is left (`silence` said "leave")."""
        return f"no answer from the store at {self.address} for {self.stall_timeout:g} s (a stopped or cut-off group member?)"

    def probe(self, epoch, *, token: str | None, client_name: str) -> tuple[tuple[str, int] | None, list]:
        """Ask the other members (blocking: a thread or an executor runs it) -> (a newer primary or
        None, the members that answered)."""
        heard: list = []
        target = probe_primary(self.addresses, self.at, epoch, token=token, timeout=self.probe_timeout,
                               client_name=client_name, heard=heard)
        return target, heard

    def probed(self, target: tuple[str, int] | None, heard: list, silent: float) -> str | None:
        """What a probe found: None when the connection stays; else why it leaves the silent member
        for `target`, the newer primary, held to from now on (the caller aims at it: `move`)."""
        if heard and target is None:
            self.heard_at = time.monotonic()
        if target is None:
            return None
        self.expected = (target, time.monotonic() + EXPECT_PRIMARY_S)
        return (f"no answer from the store at {self.address} for {silent:.1f} s, and the group's primary is "
                f"now {target[0]}:{target[1]}")

    def retry(self, initial: float, cap: float, attempts: int) -> Retry:
        """A connect's schedule: in a group, members are tried in turn for up to `failover_timeout`
        with short waits (an election is short); one store: `attempts` tries."""
        if self.group:
            return Retry(initial, min(cap, GROUP_RETRY_S), deadline_s=self.failover_timeout)
        return Retry(initial, cap, attempts=attempts)


class _OfMembers:
    """A connection's attribute that is its `members`' (read and set through the connection)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return getattr(obj.members, self.name)

    def __set__(self, obj, value) -> None:
        setattr(obj.members, self.name, value)


class FollowsMembers:
    """Base of every connection to a store: where it is aimed and its failover settings are its
    `members`' (one Members policy), readable and settable on the connection as before
    (`conn.host`, `conn.failovers`, `conn.stall_timeout`, ...)."""

    members: Members
    host = _OfMembers()
    port = _OfMembers()
    addresses = _OfMembers()
    group = _OfMembers()
    failovers = _OfMembers()
    failover_timeout = _OfMembers()
    stall_timeout = _OfMembers()
    probe_after = _OfMembers()
    probe_interval = _OfMembers()
    probe_timeout = _OfMembers()

    @property
    def address(self) -> str:
        return self.members.address
