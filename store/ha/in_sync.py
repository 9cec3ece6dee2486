"""The primary's in-sync set (a mixin of `Member`, store/ha/member.py): which replicas the
acknowledgements wait for. A replica is proposed for the set once its acknowledged offset reached
everything acknowledged so far and it applied the metadata changes waited for (the AckGate waits
for it from that moment, `adding`); one whose log, or metadata, stays behind what the primary had
`max_lag_s` ago is proposed for removal. Both are Raft commands of the group state
(`change_in_sync`), refused from anyone but the primary of the epoch.

Reads the Member's `state`, `gate`, `shipper`, `clog`, `sync`, `meta_log`, `node`, `group`,
`peers`, `role_epoch`, `max_lag_s` and its `_samples` / `_isr_proposal`.
"""
from __future__ import annotations

import logging

from .raft import FAIL_REASON

log = logging.getLogger("lmqtt.store.ha")


class InSyncSet:
    def _acked(self) -> None:
        g = self.gate
        if g is not None:
            g.replica_acked()        # not g.wake(): an acknowledgement gives the shipper nothing to send

    def _ack_set(self):
        g = self.gate
        extra = g.adding if g is not None else ()
        return (set(self.state.in_sync) | set(extra)) - {self.node}

    def _replica_offset(self, node: int) -> int:
        sh = self.shipper
        r = sh.replicas.get(node) if sh is not None else None
        if r is None:
            return 0
        return r.flushed if self.sync else r.written

    def replica_offset(self, node: int) -> int:
        """A replica's acknowledged log offset under the flush mode (0: not connected)."""
        return self._replica_offset(node)

    def replica_meta(self, node: int) -> int:
        """The last metadata change a replica applied."""
        return self._replica_meta(node)

    def _replica_meta(self, node: int) -> int:
        sh = self.shipper
        r = sh.replicas.get(node) if sh is not None else None
        return r.meta_acked if r is not None else 0

    def _want_add(self):
        sh = self.shipper
        if sh is None:
            return ()
        isr = self.state.in_sync
        # and has the metadata changes too: the oldest one waited for, or every one shipped when
        # none waits (else a stopped replica, whose log is complete while only metadata is
        # written, would be added back and removed again every round)
        g = self.gate
        mw = g.meta_waiting if g is not None else None
        need = mw[0][0] if mw else self.meta_log.seq
        if need <= self.meta_log.reset_seq:
            need = 0
        return [n for n, r in sh.replicas.items() if r.connected and n not in isr and r.meta_acked >= need
                and n in self.peers]

    def _propose_add(self, node: int) -> None:
        epoch = self.role_epoch

        def done(res, err, node=node):
            g = self.gate
            if g is not None:
                if err != FAIL_REASON.SUCCESS or res is None:
                    g.adding.discard(node)       # not added: the gate stops waiting for it
                elif node in self.state.in_sync:
                    g.adding.discard(node)
            if err == FAIL_REASON.SUCCESS and res is not None:
                log.info("event=ha_in_sync_grew group=%s node=%d in_sync=%s", self.group, node, list(res))
        self.state.change_in_sync(epoch, self.node, (node,), (), callback=done)

    def _maintain_in_sync(self, now: float) -> None:
        committed = self.clog.committed
        s = self._samples
        s.append((now, committed, self.meta_log.seq))
        while len(s) > 2 and s[1][0] <= now - self.max_lag_s:
            s.popleft()
        if self._isr_proposal and now - self._isr_proposal > 5.0:
            self._isr_proposal = 0.0       # no answer from Raft (no majority): propose again
        if s[0][0] > now - self.max_lag_s or self._isr_proposal:
            return      # not primary for max_lag_s yet, or a change is on its way
        bound, meta_bound = s[0][1], s[0][2]
        # behind on the log, or on the metadata changes (a stopped replica with only metadata
        # written meanwhile would hold every metadata answer otherwise)
        lagging = [n for n in self.state.in_sync if n != self.node and (
            self._replica_offset(n) < bound
            or (meta_bound > self.meta_log.reset_seq and self._replica_meta(n) < meta_bound))]
        if not lagging:
            return
        self._isr_proposal = now
        epoch = self.role_epoch

        def done(res, err):
            self._isr_proposal = 0.0
            if err == FAIL_REASON.SUCCESS and res is not None:
                log.warning("event=ha_in_sync_shrunk group=%s removed=%s in_sync=%s", self.group, lagging, list(res))
                g = self.gate
                if g is not None:
                    for n in lagging:
                        g.adding.discard(n)
                    g.wake()
        log.info("event=ha_in_sync_shrinking group=%s lagging=%s bound=%d", self.group, lagging, bound)
        self.state.change_in_sync(epoch, self.node, (), tuple(lagging), callback=done)
