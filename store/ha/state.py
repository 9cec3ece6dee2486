"""The group's replicated state, decided by Raft (pysyncobj, embedded in every member).

What Raft decides, and only that (RocketMQ's controller: `SyncStateSet`, master epoch):
  epoch      the current primary's term; +1 at every election
  primary    the node id of the primary of `epoch` (None before the first election)
  in_sync    the node ids that have every acknowledged record (the primary included)
  reports    node id -> (epoch it knows, its CommitLog end) from its last heartbeat

CommitLog bytes never go through Raft: the primary ships them itself (store/ha/replication.py).

Liveness is what each member saw applied locally (`last_seen`, monotonic, not replicated): the Raft
leader acts as the controller and elects a new primary when the primary's heartbeats stopped
arriving for `dead_after` seconds while the other members' kept arriving (store/ha/member.py
`_control`); only a member of `in_sync` may become primary (`elect` refuses anyone else, on every
member alike, because it runs as a replicated command).

A heartbeat carries the Raft term its sender knew. One applied in a later term is stale: a dead
Raft leader's last heartbeats are committed by its successor, after the election, and stamping them
"seen now" would make a primary killed together with the Raft leader look alive for a whole Raft
election longer (failovers of 3.5-4 s instead of 2.5). Stale heartbeats update the report, not
`last_seen`; so do the journal's heartbeats replayed at start.
"""
from __future__ import annotations

import logging
import time

from .raft import SyncObjConsumer, replicated


class GroupState(SyncObjConsumer):
    def __init__(self) -> None:
        # local, not replicated (set before SyncObjConsumer.__init__: pysyncobj leaves out of its
        # snapshots every attribute that exists at that point)
        self.last_seen: dict[int, float] = {}
        self.listeners: list = []
        self.term_now = None          # fn() -> this member's Raft term (Member sets it)
        super().__init__()
        self.epoch = 0
        self.primary: int | None = None
        self.in_sync: frozenset = frozenset()
        self.reports: dict[int, tuple[int, int]] = {}

    def _changed(self) -> None:
        for fn in list(self.listeners):
            try:
                fn()
            except Exception:  # noqa: BLE001 - a listener must not break Raft's apply loop
                logging.getLogger("lmqtt.store.ha").exception("event=ha_state_listener_failed")

    def snapshot(self) -> dict:
        return {"epoch": self.epoch, "primary": self.primary, "in_sync": sorted(self.in_sync),
                "reports": {int(k): list(v) for k, v in self.reports.items()}}

    # ------------------------------------------------------------------ replicated commands
    @replicated
    def heartbeat(self, node: int, epoch: int, offset: int, term: int | None = None):
        """A member says it is alive, the epoch it knows and its CommitLog end (and the Raft term
        it knew when it sent this). Returns the state as applied: a primary that gets back another
        epoch or primary is deposed."""
        self.reports[node] = (epoch, offset)
        fn = self.term_now
        if term is None or fn is None or term >= fn():
            self.last_seen[node] = time.monotonic()
        return self.epoch, self.primary, tuple(sorted(self.in_sync))

    @replicated
    def elect(self, expected_epoch: int, node: int):
        """Make `node` the primary of epoch `expected_epoch + 1`. Refused (returns None) when the
        epoch moved meanwhile or `node` is not in sync (the first election of a group excepted:
        nobody is in sync yet). The old primary leaves the in-sync set: it has to catch up (and
        maybe truncate) as a replica before it may count again."""
        if self.epoch != expected_epoch:
            return None
        if self.in_sync and node not in self.in_sync:
            return None
        old = self.primary
        self.epoch += 1
        self.primary = node
        keep = set(self.in_sync) - {old} if old is not None else set()
        self.in_sync = frozenset(keep | {node})
        self._changed()
        return self.epoch

    @replicated
    def change_in_sync(self, epoch: int, node: int, add: tuple = (), remove: tuple = ()):
        """The primary of `epoch` changes the in-sync set: adds replicas that caught up, removes
        laggards. Refused (None) from anyone but the current primary; the primary stays in."""
        if epoch != self.epoch or node != self.primary or node in remove:
            return None
        self.in_sync = frozenset((set(self.in_sync) | set(add)) - set(remove))
        self._changed()
        return tuple(sorted(self.in_sync))
