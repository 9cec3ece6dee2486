"""The primary's ack gate (store/ha/replication.py's module docstring: the protocol): the durable
futures of a store group primary's appends, resolved once the acknowledging set of replicas has
the bytes under the flush mode and the epoch lease holds; and the metadata changes waited for (a
group offset commit, a POP pop/ack), answered once every in-sync replica applied them."""
from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import Future

log = logging.getLogger("lmqtt.store.ha")


class AckGate:
    """Durable futures of the primary's appends (MessageStore.use_ack_gate): `current` is shared by
    the appends of one round, like GroupCommitService's; a round resolves when its end offset is
    acknowledged (see the module docstring)."""

    def __init__(self, clog, sync: bool, ack_replicas: int, lease_ok, ack_set, replica_offset) -> None:
        self.clog = clog
        self.sync = sync
        self.ack_replicas = ack_replicas
        self.lease_ok = lease_ok
        self.ack_set = ack_set               # () -> node ids whose acknowledgement is needed
        self.replica_offset = replica_offset  # node -> its acknowledged offset under the flush mode
        self.current: Future = Future()
        self.waiting: collections.deque = collections.deque()
        self.taken = clog.committed
        self.acked = clog.committed
        # the confirm offset (RocketMQ's controller mode): the end of the acknowledged rounds, an
        # append boundary; the primary's dispatch goes no further (DispatchService.limit), so
        # readers, pulls and the gateways' pushes see only what the in-sync replicas have.
        # on_confirm(): called when it moved (the dispatcher's wake-up). A stopped gate keeps it.
        self.committed = clog.committed
        self.on_confirm = None
        self.failed: BaseException | None = None
        self._ev = threading.Event()
        self._stop = False
        # evaluate() runs on the gate's thread or, for an acknowledgement, on the replication
        # thread that read it (replica_acked): one at a time, never after stop()
        self._eval_lock = threading.Lock()
        self.blocked = ""                    # why nothing is being acknowledged now ("" when it is)
        self.also_wake = None                # fn() woken with the gate on every append (the shipper)
        # replicas being added to the in-sync set: waited for from the moment they had everything
        # acknowledged so far (want_add() -> candidates; on_add(node) proposes the change to Raft)
        self.adding: set = set()
        self.want_add = lambda: ()
        self.on_add = None
        # metadata changes (a group offset commit) answered once the replicas applied them:
        # (meta sequence, fn() to call then); replica_meta(node) -> the last sequence it applied
        self.meta_waiting: collections.deque = collections.deque()
        self._meta_lock = threading.Lock()
        self.replica_meta = lambda node: 0
        # retried batches the dedup found stored already (when_replicated): answered once every
        # in-sync replica has their bytes, as their first attempt would have been - (end, Future)
        self.dup_waiting: list = []
        self._thread = threading.Thread(target=self._run, name="lmqtt-ha-ackgate", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._ev.set()
        w = self.also_wake
        if w is not None:
            w()

    def stop(self, err: BaseException) -> None:
        self._stop = True
        self._ev.set()
        self._thread.join()
        with self._eval_lock:        # an acknowledgement's evaluate() in progress ends first
            pass
        with self.clog.lock:
            self.failed = err
            fut = self.current
            self.current = _failed_future(err)
            dups, self.dup_waiting = self.dup_waiting, []
        items = list(self.waiting) + [(0, fut)] + dups
        self.waiting.clear()
        metas = list(self.meta_waiting)
        self.meta_waiting.clear()
        for _seq, fn in metas:
            fn(err)
        for _t, f in items:
            if not f.done():
                f.set_exception(err)

    def when_replicated(self, end: int) -> Future:
        """A future resolved once the log up to `end` is on every in-sync replica (at least
        `ack_replicas`) under the flush mode and the lease holds - the rule of an append's
        acknowledgement, for bytes already in the log: a batch a retry found stored. A new primary
        counts its whole log as confirmed (its predecessor confirmed some of it, it cannot tell
        which), but its replicas may not have all of it yet: a retry answered "stored" at once
        would be acknowledged on this member only. Fails as the appends' futures do (stop)."""
        f: Future = Future()
        with self.clog.lock:
            if self.failed is not None:
                f.set_exception(self.failed)
                return f
            self.dup_waiting.append((end, f))
        self.wake()
        return f

    def _run(self) -> None:
        while not self._stop:
            self._ev.wait(0.002 if self.waiting or self.dup_waiting else 0.05)
            self._ev.clear()
            try:
                with self._eval_lock:
                    if not self._stop:
                        self.evaluate()
            except Exception:  # noqa: BLE001 - keep the gate alive; nothing is acknowledged meanwhile
                log.exception("event=ha_ack_gate_failed")

    def evaluate(self) -> None:
        clog = self.clog
        with clog.lock:
            if clog.committed > self.taken:
                fut = self.current
                self.current = Future()
                self.taken = clog.committed
                self.waiting.append((self.taken, fut))
        for n in self.want_add():
            # it must have everything acknowledged so far (safety) and what the oldest waiting
            # round needs (else a stalled replica that holds back the acks would look caught up)
            need = self.waiting[0][0] if self.waiting else self.taken
            if n not in self.adding and self.replica_offset(n) >= max(self.acked, need):
                self.adding.add(n)       # from now on acknowledgements wait for it too
                if self.on_add is not None:
                    self.on_add(n)
        if self.meta_waiting:
            self._meta_evaluate()
        if not self.waiting and not self.dup_waiting:
            return
        local = clog.flushed if self.sync else clog.committed
        if not self.lease_ok():
            self.blocked = "the primary's epoch lease is not confirmed (no Raft majority reached lately)"
            return
        members = list(self.ack_set())
        if len(members) < self.ack_replicas:
            self.blocked = (f"{len(members)} replica(s) in sync, --ack-replicas needs {self.ack_replicas}")
            return
        acked = local
        for n in members:
            acked = min(acked, self.replica_offset(n))
        self.blocked = ""
        if acked > self.acked:
            self.acked = acked
        if self.dup_waiting:
            with clog.lock:
                ready = [(e, f) for e, f in self.dup_waiting if e <= acked]
                if ready:
                    self.dup_waiting = [(e, f) for e, f in self.dup_waiting if e > acked]
            for e, f in ready:
                if not f.done():
                    f.set_result(e)
        w = self.waiting
        done = []
        while w and w[0][0] <= acked:
            done.append(w.popleft())
        if done and done[-1][0] > self.committed:
            self.committed = done[-1][0]     # visible first, then answered
            fn = self.on_confirm
            if fn is not None:
                fn()
        for target, f in done:
            if not f.done():
                f.set_result(target)


def _meta_evaluate_impl(self) -> None:
    """Answer the metadata changes every replica of the acknowledging set has applied. Runs on the
    gate's thread and on the replication threads that received an acknowledgement (`replica_acked`),
    so the callbacks are taken under `_meta_lock`: each runs once."""
    if not self.lease_ok():
        return
    members = list(self.ack_set())
    if len(members) < self.ack_replicas:
        return
    done = min([self.replica_meta(n) for n in members], default=1 << 62)
    w = self.meta_waiting
    ready = []
    with self._meta_lock:
        while w and w[0][0] <= done:
            ready.append(w.popleft())
    for _seq, fn in ready:
        fn(None)


def _replica_acked_impl(self) -> None:
    """A replica acknowledged (Shipper's thread reading its A frames): the metadata changes it
    completes are answered here, without a hop to the gate's thread (a pop, an ack or a commit on a
    group waits for exactly this); so are the appends' rounds it completes (`evaluate` on this
    thread when no other runs it: the hop to the gate's thread, a wake-up and a GIL hand-off per
    acknowledgement, was a third of a replicated append's round trip), else the gate is woken."""
    if self.meta_waiting:
        try:
            self._meta_evaluate()
        except Exception:  # noqa: BLE001 - the replica's stream goes on; the gate's round retries
            log.exception("event=ha_ack_gate_failed")
            self._ev.set()
    if self.adding:
        self._ev.set()           # its own 0.05 s round looks for replicas to add back
    if self.waiting or self.dup_waiting:
        if self._eval_lock.acquire(blocking=False):
            try:
                if not self._stop:
                    self.evaluate()
            except Exception:  # noqa: BLE001 - the gate's own round retries
                log.exception("event=ha_ack_gate_failed")
                self._ev.set()
            finally:
                self._eval_lock.release()
        else:
            self._ev.set()


def _meta_appended_impl(self) -> None:
    """A call appended its change to `meta_waiting`: answered at once if every replica applied it
    already (their acknowledgement came before the append), else by the acknowledgement that
    completes it (`replica_acked`) or the gate's own round. Wakes no thread: waking the gate's
    thread woke the shipper threads too (`wake`), two or three wake-ups per POP call for nothing."""
    try:
        self._meta_evaluate()
    except Exception:  # noqa: BLE001 - the gate's round retries
        log.exception("event=ha_ack_gate_failed")
        self._ev.set()


AckGate._meta_evaluate = _meta_evaluate_impl
AckGate.meta_appended = _meta_appended_impl
AckGate.replica_acked = _replica_acked_impl


def _failed_future(err: BaseException) -> Future:
    f: Future = Future()
    f.set_exception(err)
    return f
