"""The metadata side of a store group member: the metadata changes a failover must keep (producer
dedup markers, group offsets, filter registrations, POP state, the light queues' metadata,
cancelled timers), shipped by the primary and applied by the replicas.

Why a module of its own: store/ha/member.py is the member's roles (Raft heartbeats, the
controller's elections, becoming primary or replica, the in-sync set, fencing by lease); this is
what flows beside the log once the roles are set, with its own state and files:

* Primary: `attach_meta` wraps the SdkMetadata writers so each change is added to the `MetaLog`
  (store/ha/replication.py) at the log position it was written after; `ship(op)` adds others
  (store/node/ha_member.py: the light queues' "md" ops, timer cancels); `replicated_call(fn)`
  makes a CALL that changed metadata answer once the in-sync replicas applied the change.
* Replica: `_apply_meta` applies each shipped change with the function `meta_kind` registered for
  its kind; a full snapshot arrives as snap_begin / snap / snap_end (`_snap*`), keys the primary no
  longer has are dropped at its end. `meta_state()` is what the replica tells the primary in the
  replication handshake: the epoch whose primary's metadata it holds (file `meta_epoch`) and
  whether a snapshot was cut short (file `meta_incomplete`).
* Promotion: the recent changes a replica applied (`_applied`, `_note_applied`) let it, once
  primary, bring a replica that followed the same old primary up to date with the changes it
  lacks (`_catch_up`) instead of a snapshot.

`MetadataSync` is a mixin of `Member` (store/ha/member.py), which calls `_init_metadata_sync`
from its __init__ and uses `meta_log`, `_snapshot`, `_catch_up`, `_promoted_from` when it becomes
primary; it reads the Member's `clog`, `role`, `gate`, `follower`, `group`, `node`.
"""
from __future__ import annotations

import asyncio
import base64
import collections
import logging
import os

from ..checkpoint import write_atomic
from ..protocol import E_NOT_PRIMARY, compact_json
from ..server import CallError
from .replication import MetaLog

log = logging.getLogger("lmqtt.store.ha")


def _body(v) -> bytes:
    """A shipped dedup result: bytes (store/ha/replication.py meta_frame), or base64 text from a
    primary of an earlier version (a group being upgraded)."""
    return v if isinstance(v, bytes) else base64.b64decode(v)


class MetadataSync:
    """The metadata changes shipped (primary) and applied (replica): see the module's docstring."""

    def _init_metadata_sync(self, ha_dir: str) -> None:
        """The metadata side's state (Member.__init__ calls it)."""
        self.meta_log = MetaLog()
        self.meta = None            # the SdkMetadata whose changes are shipped (attach_meta)
        self._meta_apply: dict = {}
        # replicated metadata stores by name ("sdk", and "md" the light queues' MetadataStore):
        # snapshot() / replicated_keys() / apply_replicated(ops), for snapshots (Shipper)
        self.meta_dbs: dict = {}
        self._snap_seen: dict | None = None
        # fn() -> run by the snapshot where no metadata write runs concurrently (the server's loop)
        self.run_consistent = None
        self._meta_epoch_path = os.path.join(ha_dir, "meta_epoch")
        self._meta_incomplete_path = os.path.join(ha_dir, "meta_incomplete")
        # the changes applied from the primary followed now, while this member holds that primary's
        # whole metadata (its meta_epoch): numbering (MetaLog.ident), the last sequence applied,
        # and the recent ones [(seq, op)]. A member promoted with them brings a replica that
        # followed the same primary up to date with the ones it lacks instead of a snapshot.
        self._applied: collections.deque = collections.deque(maxlen=100_000)
        self._applied_id: str | None = None
        self._applied_last = 0
        self._applied_from = 0            # the tail holds every change after this sequence
        self._promoted_from = None        # (ident, old epoch, last, from, [(seq, op)]) at promotion
        self._meta_epoch_now = self.meta_state()["meta_epoch"]

    def attach_meta(self, meta) -> None:
        """Ship the SDK metadata changes a failover must keep (producer dedup markers,
        group offsets, filter registrations) to the replicas, and apply them there."""
        self.meta = meta
        orig_remember, orig_commit, orig_put = meta.remember, meta.commit, meta.put_json
        orig_delete = meta.delete_json
        self._meta_apply.update({"remember": lambda o: orig_remember(o["p"], int(o["s"]), _body(o["v"])),
                                 "commit": lambda o: orig_commit(o["g"], o["q"], int(o["o"])),
                                 "put_json": lambda o: (meta.put_json_text(o["key"], o["s"]) if "s" in o
                                                        else orig_put(o["key"], o["v"])),
                                 "delete_json": lambda o: orig_delete(o["key"]),
                                 "snap_begin": self._snap_begin, "snap": self._snap, "snap_end": self._snap_end,
                                 "caught_up": self._caught_up})
        self.meta_dbs["sdk"] = meta
        clog = self.clog
        ml = self.meta_log

        pending = meta.pending

        def remember(pid, seq, body):
            orig_remember(pid, seq, body)
            # only a batch's pending marker (SdkMetadata.begin: its log position and count) is
            # shipped, not its results: a retry after a failover finds the batch in the log from
            # that position (fastpath.find_batch, as after a crash between marker and results).
            # One change per PRODUCE shipped and applied on every replica instead of two.
            if self.role == "primary" and pending(body) is not None:
                ml.add(clog.wrote, {"k": "remember", "p": pid, "s": seq, "v": body})   # shipped as bytes

        def commit(group, queue, offset):
            orig_commit(group, queue, offset)
            if self.role == "primary":
                ml.add(clog.wrote, {"k": "commit", "g": group, "q": queue, "o": offset})

        def put_json(key, obj):
            # encoded once: the same text is written here and shipped as a string (a POP state of
            # 64 in-flight messages costs ~20 us to encode and as much to decode; the replicas
            # write the text as is instead of decoding the nested object and encoding it again)
            text = compact_json(obj)
            meta.put_json_text(key, text)
            if self.role == "primary":
                ml.add(clog.wrote, {"k": "put_json", "key": key, "s": text})
        def delete_json(key):
            orig_delete(key)
            if self.role == "primary":
                ml.add(clog.wrote, {"k": "delete_json", "key": key})
        meta.remember, meta.commit, meta.put_json, meta.delete_json = remember, commit, put_json, delete_json

    def meta_kind(self, kind: str, apply) -> None:
        """Replicas apply the shipped changes {"k": kind, ...} with `apply(op)`."""
        self._meta_apply[kind] = apply

    def ship(self, op: dict) -> None:
        """Ship a metadata change (this member is the primary): after the log bytes written so far,
        before any written later; applied by the replicas in that order."""
        self.meta_log.add(self.clog.wrote, op)

    # ------------------------------------------------------------------ metadata snapshots
    def meta_state(self) -> dict:
        """What a replica tells the primary about its metadata (the replication handshake): the
        epoch whose primary's metadata it holds, and whether a snapshot was cut short."""
        try:
            with open(self._meta_epoch_path) as f:
                epoch = int(f.read().strip() or -1)
        except (OSError, ValueError):
            epoch = -1
        return {"meta_epoch": epoch, "meta_incomplete": os.path.exists(self._meta_incomplete_path),
                "follow_id": getattr(self, "_applied_id", None), "follow_seq": getattr(self, "_applied_last", 0)}

    def _set_meta_epoch(self, epoch: int) -> None:
        write_atomic(self._meta_epoch_path, str(epoch).encode())
        self._meta_epoch_now = epoch

    def _tail_reset(self, ident, seq: int) -> None:
        self._applied.clear()
        self._applied_id = ident
        self._applied_last = self._applied_from = seq

    def _note_applied(self, op: dict) -> None:
        """Keep a change applied from the primary (see `_applied`)."""
        f = self.follower
        n = op.get("n")
        if f is None or n is None or f.meta_id is None or self._meta_epoch_now != f.conn_epoch:
            self._applied_id = None
            return
        n = int(n)
        if f.meta_id != self._applied_id:
            self._tail_reset(f.meta_id, n - 1)
        if n <= self._applied_last:
            return                       # shipped again after a reconnect
        if n != self._applied_last + 1:
            self._applied_id = None      # a gap: not a tail to bring anyone up to date with
            return
        a = self._applied
        if len(a) == a.maxlen:
            self._applied_from = a[0][0]
        a.append((n, op))
        self._applied_last = n

    def _catch_up(self, h: dict):
        """The replica's handshake `h`: the changes it lacks of the primary both followed, if this
        member holds them all (see Shipper.catch_up); None: it needs a snapshot."""
        pf = self._promoted_from
        if pf is None or h.get("meta_incomplete"):
            return None
        ident, old_epoch, last, frm, ops = pf
        seq = h.get("follow_seq")
        if h.get("follow_id") != ident or int(h.get("meta_epoch", -1)) != old_epoch or seq is None:
            return None
        seq = int(seq)
        if not frm <= seq <= last:
            return None                  # it has changes this member lacks, or older than the tail
        return [op for n, op in ops if n > seq]

    def _caught_up(self, op) -> None:
        f = self.follower
        self._set_meta_epoch(int(op["epoch"]))
        try:
            os.unlink(self._meta_incomplete_path)
        except FileNotFoundError:
            pass
        self._tail_reset(f.meta_id if f is not None else None, int(op.get("from", 0)))

    def _snapshot(self):
        """(MetaLog sequence, [(db name, items)]) taken where no metadata write runs (the server's
        loop), so the items are the state after exactly the changes up to that sequence."""
        def take():
            return self.meta_log.seq, [(name, db.snapshot()) for name, db in self.meta_dbs.items()]
        run = self.run_consistent
        return run(take) if run is not None else take()

    def _snap_begin(self, _op) -> None:
        with open(self._meta_incomplete_path, "wb"):
            pass
        self._snap_seen = {name: set() for name in self.meta_dbs}

    def _snap(self, op) -> None:
        db = self.meta_dbs.get(op["d"])
        if db is None or self._snap_seen is None:
            return
        ops = [(base64.b64decode(k), base64.b64decode(v)) for k, v in op["ops"]]
        db.apply_replicated(ops)
        self._snap_seen[op["d"]].update(k for k, _v in ops)

    def _snap_end(self, _op) -> None:
        seen, self._snap_seen = self._snap_seen, None
        if seen is None:
            return
        dropped = 0
        for name, db in self.meta_dbs.items():
            gone = [(k, None) for k in db.replicated_keys() if k not in seen[name]]
            if gone:
                db.apply_replicated(gone)
                dropped += len(gone)
        f = self.follower
        if f is not None:
            self._set_meta_epoch(f.conn_epoch)
            self._tail_reset(f.meta_id, int(_op.get("n", 0)))
        try:
            os.unlink(self._meta_incomplete_path)
        except FileNotFoundError:
            pass
        log.info("event=ha_metadata_snapshot_applied group=%s node=%d kept=%d dropped=%d", self.group, self.node,
                 sum(len(v) for v in seen.values()), dropped)

    def replicated_call(self, fn):
        return self._replicated_call(fn)

    def _replicated_call(self, fn):
        """A CALL that changes shipped metadata (a group offset commit, a filter registration)
        answers once the in-sync replicas applied the change (as a produce waits for its bytes):
        an offset committed on the primary is there after a failover."""
        def call(*a):
            before = self.meta_log.seq
            res = fn(*a)
            gate = self.gate
            seq = self.meta_log.seq
            if seq == before or gate is None or asyncio.isfuture(res):
                return res
            loop = asyncio.get_running_loop()
            fut = loop.create_future()

            def settle(err, fut=fut, res=res):
                if fut.done():
                    return
                if err is None:
                    fut.set_result(res)
                else:
                    fut.set_exception(CallError(E_NOT_PRIMARY, str(err)))
            gate.meta_waiting.append((seq, lambda err: loop.call_soon_threadsafe(settle, err)))
            gate.meta_appended()     # no thread woken: the replicas' acknowledgements answer it
            return fut
        return call

    def _apply_meta(self, op: dict) -> None:
        fn = self._meta_apply.get(op.get("k"))
        if fn is None:
            return
        try:
            fn(op)
            if "n" in op and not op.get("k", "").startswith("snap"):
                self._note_applied(op)
        except Exception as e:  # noqa: BLE001 - a RocksDB write refused (a full disk...)
            # not acknowledged; the next connection asks for a snapshot (the changes before this
            # one's log position are not shipped again)
            try:
                with open(self._meta_incomplete_path, "wb"):
                    pass
            except OSError:
                pass
            raise ConnectionError(f"applying a metadata change ({op.get('k')}) failed: {e}") from e
