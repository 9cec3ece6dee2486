"""The marks a gateway over several store groups leaves of a session in the groups that hold its
offsets but not its record (docs/groups.md "The gateway").

Why: a session's record lives in one group (its home) and its offsets in its queues' groups. When
the session's gateway is gone for good, each group's store sweeps the records it holds of that
gateway (store/node/session_sweep.py): the home group ends the record and the offsets beside it,
but a group holding only offsets has nothing to judge them by, and they stayed for ever - one
leak per session of every gateway retired. So each such group is given a `STUB` of the session
(lightqueue/records.py `SessionRecord.stub`: its gateway and expiry interval, connected): its
own sweep treats it as a record - offline from when the gateway went away, ended with its
offsets once expired. A stub counts from the gateway's loss, never earlier than the record's
disconnect, so a group never ends the offsets of a session whose record lives on.

What is written, and when (a stub changes only with the session's gateway or expiry interval):
  * the first offsets of a session written to a group (`offsets_set`): its stub there first, on
    the same link, so the store has it before the offsets;
  * a record put that names another gateway or expiry (a takeover, MQTT 5's DISCONNECT raising
    the expiry): the stub again in each group it was written to, and in each group a load found
    offsets of the session in (`loaded`: a session taken over from another gateway whose quiet
    queues this gateway has not written yet);
  * after a sweep changed records of this gateway (`swept`): again at the next record put.
A session's end (`forget`: clean start, expiry) deletes the stubs with the offsets in every
group (`GroupedSessions.delete`). Embedded records (no gateway) are never swept: no stubs.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from lmqtt.gateway.storage.facades import Answer, Storage
from lmqtt.lightqueue.records import SessionRecord

log = logging.getLogger("lmqtt.gateway.storage.session_stubs")

Mark = tuple[int, str]          # (expiry interval, gateway): what a stub says


class SessionStubs:
    def __init__(self, groups: list[Storage], home: Callable[[str], int]) -> None:
        """`home(client_id)`: the group its record is written in (no stub goes there)."""
        self.groups = groups
        self.home = home
        self._mark: dict[str, tuple[int, Mark]] = {}     # client id -> (protocol version, mark) of its last record
        self._written: dict[str, dict[int, Mark]] = {}   # client id -> group -> the mark written there
        self._pending: dict[str, set[int]] = {}          # client id -> groups to write at its next record put

    def record_put(self, client_id: str, rec: Any) -> None:
        """`rec` was written as `client_id`'s record: its stubs where they say otherwise."""
        host = rec.host
        if host is None:
            return
        mark = (int(rec.expiry_interval), host)
        self._mark[client_id] = (rec.protocol_version, mark)
        written = self._written.get(client_id)
        todo = set(written or ()) | self._pending.pop(client_id, set())
        if todo:
            self._write(client_id, todo, mark, written)

    def offsets_set(self, client_id: str, groups: Iterable[int]) -> None:
        """Offsets of `client_id` are about to be written to `groups`: a stub first where none of
        its mark is (not a session's - a shared group's consumer - none)."""
        known = self._mark.get(client_id)
        if known is None:
            return
        mark = known[1]
        written = self._written.get(client_id)
        todo = [i for i in groups if written is None or written.get(i) != mark]
        if todo:
            self._write(client_id, todo, mark, written)

    def loaded(self, client_id: str, groups: Iterable[int]) -> None:
        """A load found the session's record and offsets of it in `groups`: stubs there at its
        next record put (which names this gateway)."""
        self._pending.setdefault(client_id, set()).update(groups)

    def swept(self, client_ids: Iterable[str]) -> None:
        """A store's sweep changed these sessions' records or stubs while this gateway was away:
        each stub written again at the session's next record put."""
        for cid in client_ids:
            written = self._written.pop(cid, None)
            if written:
                self._pending.setdefault(cid, set()).update(written)

    def forget(self, client_id: str) -> None:
        """The session ended (its stubs are deleted with it) or moved to another gateway."""
        self._mark.pop(client_id, None)
        self._written.pop(client_id, None)
        self._pending.pop(client_id, None)

    def _write(self, client_id: str, groups: Iterable[int], mark: Mark, written: dict[int, Mark] | None) -> None:
        home = self.home(client_id)
        version = self._mark[client_id][0]
        if written is None:
            written = self._written[client_id] = {}
        for i in groups:
            if i == home:
                continue
            written[i] = mark
            stub = SessionRecord.stub(client_id, version, mark[0], mark[1])
            self.groups[i].sessions.put(client_id, stub).add_done_callback(self._answered(client_id, i, mark))

    def _answered(self, client_id: str, i: int, mark: Mark) -> Callable[[Answer[None]], None]:
        def done(answer: Answer[None]) -> None:
            e = answer.exception()
            if e is not None:
                self._failed(client_id, i, mark, e)
        return done

    def _failed(self, client_id: str, i: int, mark: Mark, e: BaseException) -> None:
        # written again with the session's next offsets or record
        written = self._written.get(client_id)
        if written is not None and written.get(i) == mark:
            del written[i]
            self._pending.setdefault(client_id, set()).add(i)
        log.warning("event=session_stub_failed client_id=%s group=%d error=%r (written again with the "
                    "session's next offsets or record)", client_id, i, e)
