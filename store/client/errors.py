"""The SDK's errors and the store's refusals, shared by every connection class (connection.py's
sync `Connection`, aio.py's `AsyncConnection`, gateway/storage/store_link.py's `LoopConnection`) and the
command API (producers, consumers, admin): a module of its own, below all of them."""
from __future__ import annotations

from lmqtt.store import protocol as W
from lmqtt.store.errors import DiskFull as _StoreDiskFull

# commands that change state in a way a blind repeat could change again (not retried on a lost
# connection)
NOT_IDEMPOTENT = {"pop", "subscribe"}


class StoreClientError(Exception):
    """The store answered with an ERROR frame. `.code` is the protocol's error code.

    A refusal for lack of disk space is made a `DiskFull` (a subclass), wherever the SDK builds
    the error."""

    def __new__(cls, code: int = 0, message: str = "", *args, **kw):
        if cls is StoreClientError and _is_disk_full_reply(code, message):
            cls = DiskFull
        return super().__new__(cls)

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{W.ERROR_NAMES.get(code, code)}: {message}")
        self.code = code
        self.reason = message


def _is_disk_full_reply(code, message) -> bool:
    # E_DISK_FULL; a store from before that code answered E_STORE "DiskFull: ..."
    return code == W.E_DISK_FULL or (code == W.E_STORE and str(message).startswith("DiskFull:"))


class DiskFull(StoreClientError, _StoreDiskFull):
    """The store refused the request for lack of disk space: nothing of it was stored. The message
    names the store's data directory and its free space. The store accepts requests again once
    space is freed (no restart), so the same send can be retried later; a Producer's retry of the
    same batch is deduplicated as usual. Also a `lmqtt.store.DiskFull`."""


class ConnectionLost(ConnectionError):
    """The connection broke (or could not be made) while the request was in flight."""


def is_not_primary(e: BaseException) -> bool:
    """A store group member that is not the primary refused the request (nothing was done)."""
    return isinstance(e, StoreClientError) and e.code == W.E_NOT_PRIMARY


def check_reply(reply):
    op, flags, body = reply
    if op == W.OP_ERROR:
        code, msg = W.parse_error(body)
        raise StoreClientError(code, msg)
    return reply


def parse_hello_ok(op: int, body: bytes) -> dict:
    """`protocol.parse_hello_reply` with the SDK's error type (StoreClientError): the store's
    answer to HELLO, for every connection class of the SDK."""
    try:
        return W.parse_hello_reply(op, body)
    except W.ProtocolError as e:
        raise StoreClientError(e.code, str(e)) from None


NOT_A_STORE_HINT = (" (an MQTT or other non-store port does that; the store's native protocol is on "
                    "`lmqtt serve --store-port` / `lmqtt store --port`, default 10911)")


def not_a_store(address: str, data: bytes) -> StoreClientError:
    """The answer to HELLO was not store frames at all: the address is some other server's (the
    metrics/console HTTP port, an MQTT port ...). Named, with what it said; not retried."""
    what = "an HTTP server (the metrics/console port?)" if data[:5] == b"HTTP/" else f"it sent {data[:16]!r}"
    e = StoreClientError(W.E_BAD_FRAME, f"{address} is not an lmqtt store: {what}; the store's native "
                                        "protocol is on `lmqtt serve --store-port` / `lmqtt store --port`, "
                                        "default 10911")
    e.not_a_store = True
    return e


class NotStores:
    """The members of an address list that answered HELLO as some other server (`not_a_store`): a
    connect to a member list goes on to the next member, and names them all if none is a store.
    One rule for the sync and asyncio connections' connect loops."""

    def __init__(self, addresses: list) -> None:
        self.addresses = addresses
        self.seen: dict[tuple[str, int], str] = {}

    def note(self, at: tuple[str, int], e: StoreClientError) -> None:
        """Remember `at` as not a store (any other refusal - auth, version - is raised: retrying or
        another member won't change it); every member such: StoreClientError naming each."""
        if not getattr(e, "not_a_store", False):
            raise e
        self.seen[at] = e.reason.split(";", 1)[0]     # "H:P is not an lmqtt store: an HTTP server ..."
        if len(self.seen) >= len(set(self.addresses)):
            raise StoreClientError(W.E_BAD_FRAME, f"no member of {','.join(f'{h}:{p}' for h, p in self.addresses)} "
                                   f"is an lmqtt store: {'; '.join(self.seen.values())}; the store's native protocol "
                                   "is on `lmqtt serve --store-port` / `lmqtt store --port`, default 10911") from None

    def suffix(self) -> str:
        """For a final 'no primary found' error: the members that were not stores, if any."""
        return f"; not stores: {'; '.join(self.seen.values())}" if self.seen else ""
