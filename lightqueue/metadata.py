"""MetadataStore: consumer offsets, persistent sessions, retained messages, wills, filters.

Why a separate RocksDB with the WAL on: unlike the light-queue index (rebuilt from the
CommitLog), this state exists nowhere else. Every write goes through the WAL, so a process
crash (kill -9) loses nothing that a call returned from; `sync=True` additionally fsyncs the
WAL per write for power-loss safety at a large cost per call.

Why one small API: a later scale-out puts this behind the store server; the gateway must not
know it is RocksDB. Its key layout (one byte prefix per kind) is lightqueue/metadata_keys.py;
the retained messages (lightqueue/retained_messages.py) and the wills (lightqueue/wills.py) are
their own modules, methods of `MetadataStore` all the same.
"""
from __future__ import annotations

import heapq
import logging
import threading
import time
from typing import Collection, Iterator

from rocksdict import Rdict, ReadOptions, WriteBatch, WriteOptions

from lmqtt.store.rocksdb_options import rocksdb_options

from .errors import MetadataError
from .metadata_keys import (
    EPOCH,
    K_RECOVERY,
    K_SECURITY,
    K_SESSION_INDEX,
    P_EPOCH,
    P_FILTER,
    P_OFFSET,
    P_RETAINED,
    P_SESSION,
    P_SESSION_BY_HOST,
    P_WILL,
    U32,
    U64,
    host_key,
    prefix_end,
)
from .records import HOST, IN2_PENDING, SessionRecord, is_stub_bytes, resolve_pending_qos2
from .retained_messages import RetainedMessages
from .wills import Wills

log = logging.getLogger("lmqtt.lightqueue.metadata")

_HOST_KEY = b'"' + HOST.encode() + b'":"'


def _host_of(raw: bytes) -> str | None:
    """`SessionRecord.host` of a record's bytes without decoding the record: the string value of
    its last `"gateway":` key (the record's `extra`, written last; a queue named `gateway` in the
    in-flight state before it has a number for value). A host that needs JSON unescaping is
    read by decoding the record."""
    i = raw.rfind(_HOST_KEY)
    if i < 0:
        return None
    j = i + len(_HOST_KEY)
    value = raw[j:raw.find(b'"', j)]
    return SessionRecord.from_bytes(raw).host if b"\\" in value else value.decode("utf-8")


class MetadataStore(RetainedMessages, Wills):
    """Crash-safe key/value metadata for gateways and consumers (see module docstring)."""

    def __init__(self, path: str, *, sync: bool = False, max_open_files: int = -1) -> None:
        opts = rocksdb_options(max_open_files)      # the store's budget share (store/file_budget.py)
        try:
            self._db = Rdict(str(path), opts)
        except Exception as e:  # rocksdict raises plain Exception with the RocksDB status
            raise MetadataError(f"cannot open metadata DB at {path}: {e}") from e
        self._wo = WriteOptions()
        self._wo.sync = sync
        self._lock = threading.Lock()   # read-modify-write of reference counts
        self._closed = False
        # `stored(topic, key, ms)`: whether the log holds the message with that key (set by the
        # light-queue store): a session record read back has its pending inbound QoS 2 ids settled
        # (records.py `resolve_pending_qos2`); None: they are returned as written
        self.qos2_stored = None
        # a store group member (store/node/ha_member.py `replicate`): every write is checked
        # (`check()` raises on a member that is not the primary) and its operations handed to
        # `ship(ops)` right after, both under `_ship_lock`, so they ship in the order written
        self._ship = None
        self._check = None
        self._ship_lock = threading.Lock()
        if self._db.get(K_SESSION_INDEX) is None:
            self._build_session_index()
        # how many will records there are, None when not known (a replica's shipped writes): with
        # none, a CONNECT's `void_will` and a clean disconnect's `pop_will` need no RocksDB read
        # (a reconnect storm: a read per CONNECT for the will a client rarely left)
        self._wills: int | None = self._count_wills()
        # whether a retained message may be stored: False while none ever was here (one seek at
        # open), so a SUBSCRIBE's retained lookup opens no iterator (a reconnect storm: every
        # SUBSCRIBE of a broker without retained messages scanned its filter's empty range).
        # Set by every write of a retained message (and a replica's shipped one); never cleared
        # but by a restart, so it is only ever wrong towards reading
        self._retained_maybe = next(iter(self._scan(P_RETAINED)), None) is not None
        # `one_write`: the batch of the thread that opened one (`_group_tid`), None when none is open
        self._group = None
        self._group_tid: int | None = None

    # -- replication (store groups, docs/ha.md "Replicated metadata") -------------------------
    def replicate(self, check, ship) -> None:
        """Group mode: before every write `check()` (raises to refuse it: only the primary writes
        its metadata), after it `ship(ops)`, ops = [(key, value | None for a delete)] in the
        order written (every write of this class goes through `_put` / `_write`: the one
        chokepoint). Keys of this data dir only (`K_RECOVERY`) are not shipped. None, None: off."""
        self._check, self._ship = check, ship

    def apply_replicated(self, ops) -> None:
        """Write what the primary shipped (`replicate`): one WAL write, no check, not shipped."""
        wb = WriteBatch(raw_mode=True)
        for k, v in ops:
            if k == K_RECOVERY:
                continue
            if v is None:
                wb.delete(k)
            else:
                wb.put(k, v)
            if k[:1] == P_WILL:
                self._wills = None          # not known from here on: wills are read
            elif k[:1] == P_RETAINED and v is not None:
                self._retained_maybe = True
        if self._closed:
            raise MetadataError("metadata store is closed")
        self._db.write(wb, self._wo)

    def snapshot(self):
        """A point-in-time view of the replicated keys: an iterator of (key, value), lazily
        read (RocksDB snapshot; take it where no write runs concurrently to tie it to a
        position in the shipped stream)."""
        snap = self._db.snapshot()

        def items(snap=snap):
            for k, v in snap.items():
                if k != K_RECOVERY:
                    yield k, v
        return items()

    def replicated_keys(self):
        """Every key a snapshot would hold (the replica's side of a snapshot: those it did not
        get are deleted after it)."""
        for k in self._db.keys():
            if k != K_RECOVERY:
                yield k

    def _batch(self):
        """A WriteBatch; in group mode one that also lists its operations (for `ship`)."""
        return WriteBatch(raw_mode=True) if self._ship is None else _ShippedBatch()

    # -- one write for several -----------------------------------------------------------------
    def one_write(self) -> "_OneWrite":
        """A context: the filter references (`put_filter_ref`), session records (`put_session`)
        and offsets (`set_offsets`) this thread writes inside it go in one WriteBatch, written -
        one WAL write - when it ends (also when an exception leaves it); a failure of that write
        raises MetadataError from its end. Why: a new persistent session's SUBSCRIBE wrote its
        filter's reference, its record and its offsets, three writes before its SUBACK (a
        reconnect storm). Nothing inside may read those keys back (they are not written yet); every other
        write goes at once, as outside. Nested, or opened while another thread's is: no group of
        its own (the writes go with the open one, or at once)."""
        return _OneWrite(self)

    def _grouped(self):
        """The open `one_write` batch of this thread, or None."""
        tid = self._group_tid
        if tid is None or tid != threading.get_ident():
            return None
        g = self._group
        if g is None:                 # made at the first write (a SUBSCRIBE repeating one writes none)
            g = self._group = self._batch()
        return g

    def _flush_group(self) -> None:
        """A write (or read) of this thread of keys an open group may hold, outside the group's
        methods: what the group holds so far is written first, in order (a SUBSCRIBE refused by
        the ACL releases the filter reference it registered in its group)."""
        if self._group is not None and self._group_tid == threading.get_ident():
            wb, self._group = self._group, None
            self._write(wb)

    # -- low level ---------------------------------------------------------------------------
    def _put(self, key: bytes, value: bytes) -> None:
        """One key written (a plain put: a one-entry WriteBatch cost ~4 µs more per write, and
        every CONNECT, SUBSCRIBE and disconnect of a persistent client writes its record)."""
        if self._closed:
            raise MetadataError("metadata store is closed")
        if self._ship is not None and key != K_RECOVERY:
            with self._ship_lock:
                self._check()
                try:
                    self._db.put(key, value, self._wo)
                except Exception as e:
                    raise MetadataError(f"metadata write failed: {e}") from e
                self._ship([(key, value)])
            return
        try:
            self._db.put(key, value, self._wo)
        except Exception as e:
            raise MetadataError(f"metadata write failed: {e}") from e

    def _write(self, wb) -> None:
        if self._closed:
            raise MetadataError("metadata store is closed")
        if isinstance(wb, _ShippedBatch):
            if not wb.ops:
                return
            with self._ship_lock:
                self._check()
                try:
                    self._db.write(wb.wb, self._wo)
                except Exception as e:
                    raise MetadataError(f"metadata write failed: {e}") from e
                self._ship(wb.ops)
            return
        try:
            self._db.write(wb, self._wo)
        except Exception as e:
            raise MetadataError(f"metadata write failed: {e}") from e

    def _scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) of every key starting with `prefix` (from `start` on, if given), in key
        order. RocksDB stops at the prefix's end (an iterate upper bound), so no Python compares
        each key."""
        ro = ReadOptions()
        ro.set_iterate_upper_bound(prefix_end(prefix))
        # a generator, so `ro` (which the RocksDB iterator reads its bound from) lives as long
        # as the iteration: returned bare, it was freed early and the scan stopped short
        yield from self._db.items(from_key=start if start is not None else prefix, read_opt=ro)

    # -- consumer / session offsets ---------------------------------------------------------
    @staticmethod
    def _okey(consumer: str, queue: str) -> bytes:
        return P_OFFSET + consumer.encode("utf-8") + b"\x00" + queue.encode("utf-8")

    def get_offset(self, consumer: str, queue: str) -> int | None:
        """The committed offset of `consumer` in `queue`, or None if it never committed one."""
        v = self._db.get(self._okey(consumer, queue))
        return None if v is None else U64.unpack(v)[0]

    def set_offsets(self, consumer: str, offsets: dict[str, int]) -> None:
        """Commit several queue offsets of one consumer atomically (one WAL write)."""
        group = self._grouped() if self._group_tid is not None else None
        if len(offsets) == 1 and group is None:   # most sessions: one subscription
            [(q, off)] = offsets.items()
            if off < 0:
                raise ValueError(f"offset for {q!r} must be >= 0, got {off}")
            return self._put(self._okey(consumer, q), U64.pack(off))
        for q, off in offsets.items():
            if off < 0:
                raise ValueError(f"offset for {q!r} must be >= 0, got {off}")
        wb = group if group is not None else self._batch()
        for q, off in offsets.items():
            wb.put(self._okey(consumer, q), U64.pack(off))
        if group is None:
            self._write(wb)

    def get_offsets(self, consumer: str) -> dict[str, int]:
        """Every committed offset of `consumer` (prefix scan)."""
        pre = P_OFFSET + consumer.encode("utf-8") + b"\x00"
        return {k[len(pre):].decode("utf-8"): U64.unpack(v)[0] for k, v in self._scan(pre)}

    def iter_offsets(self) -> Iterator[tuple[str, str, int]]:
        """(consumer, queue, offset) of every committed offset (sessions, shared groups), in key order."""
        for k, v in self._scan(P_OFFSET):
            consumer, _, queue = k[1:].partition(b"\x00")
            yield consumer.decode("utf-8"), queue.decode("utf-8"), U64.unpack(v)[0]

    def recovery_checked(self) -> int:
        """The store recovery generation the offsets were last checked against (0: none)."""
        v = self._db.get(K_RECOVERY)
        return 0 if v is None else U64.unpack(v)[0]

    def set_recovery_checked(self, generation: int) -> None:
        self._put(K_RECOVERY, U64.pack(generation))

    def delete_offsets(self, consumer: str, queues: list[str] | None = None) -> None:
        """Forget `consumer`'s offsets (all, or only for `queues`)."""
        if self._group_tid is not None:
            self._flush_group()
        wb = self._batch()
        if queues is None:
            pre = P_OFFSET + consumer.encode("utf-8") + b"\x00"
            for k, _ in self._scan(pre):
                wb.delete(k)
        else:
            for q in queues:
                wb.delete(self._okey(consumer, q))
        self._write(wb)

    # -- persistent sessions -----------------------------------------------------------------
    def put_session(self, client_id: str, rec: SessionRecord, before: str | None = None) -> bool:
        """The record and its entry in the by-gateway index, in one write. `before`: the gateway
        the record named until now, when the caller read it (`session_host`): its entry goes in
        the same write; otherwise an entry of a gateway it named before stays, and the readers
        drop it (`sessions_of_gateways`)."""
        if rec.is_stub and not self._stub_may_go(client_id):
            return False
        group = self._grouped() if self._group_tid is not None else None
        value = rec.to_bytes()
        wb = group if group is not None else self._batch()
        wb.put(P_SESSION + client_id.encode("utf-8"), value)
        wb.put(host_key(rec.host, client_id), b"")
        if before is not None and before != rec.host:
            wb.delete(host_key(before, client_id))
        if group is None:
            self._write(wb)
        return True

    def _stub_may_go(self, client_id: str) -> bool:
        """Whether a session's `STUB` may be written: never over its record (a group that holds
        the record - written there before a group was added - keeps it)."""
        if self._group_tid is not None:
            self._flush_group()
        v = self._db.get(P_SESSION + client_id.encode("utf-8"))
        return v is None or is_stub_bytes(v)

    def put_sessions(self, records: list[tuple[str, SessionRecord]]) -> None:
        """Several records (and their by-gateway index entries, as `put_session` without `before`)
        in one write: the sessions a gateway saw go offline in one event-loop tick."""
        if self._group_tid is not None:
            self._flush_group()
        wb = self._batch()
        for client_id, rec in records:
            if rec.is_stub and not self._stub_may_go(client_id):
                continue
            wb.put(P_SESSION + client_id.encode("utf-8"), rec.to_bytes())
            wb.put(host_key(rec.host, client_id), b"")
        self._write(wb)

    def _build_session_index(self) -> None:
        """Index every session record by the gateway it names (a data dir written before the index
        existed; one pass over the records' bytes, said once in the log), then mark it built."""
        t0, n = time.monotonic(), 0
        wb = WriteBatch(raw_mode=True)
        for k, v in self._scan(P_SESSION):
            wb.put(host_key(_host_of(v), k[len(P_SESSION):].decode("utf-8")), b"")
            n += 1
            if n % 10000 == 0:
                self._db.write(wb, self._wo)
                wb = WriteBatch(raw_mode=True)
        wb.put(K_SESSION_INDEX, b"1")
        self._db.write(wb, self._wo)
        if n:
            log.info("event=session_index_built records=%d seconds=%.2f (session records indexed by gateway: a "
                     "data dir of a version before the index; done once)", n, time.monotonic() - t0)

    def get_session(self, client_id: str, stubs: bool = False) -> SessionRecord | None:
        """`client_id`'s record; None if there is none, or only a `STUB` (unless `stubs`: the
        session sweep, and a will's delay - a stub's expiry is its session's)."""
        v = self._db.get(P_SESSION + client_id.encode("utf-8"))
        if v is None or (not stubs and is_stub_bytes(v)):
            return None
        return self._session(v)

    def _session(self, v: bytes) -> SessionRecord:
        rec = SessionRecord.from_bytes(v)
        if self.qos2_stored is not None and IN2_PENDING.encode() in v:
            ask = self.qos2_stored

            def stored(topic: str, key: str, ms: int) -> bool:
                # rare (an id written ahead of an append that did not answer), and what decides
                # whether the client's PUBLISH sent again is stored or answered as a duplicate
                found = ask(topic, key, ms)
                log.info("event=qos2_pending_settled client_id=%s key=%s stored=%s", rec.client_id, key, found)
                return found
            resolve_pending_qos2(rec, stored)
        return rec

    def delete_session(self, client_id: str) -> bool:
        """Delete the session and its consumer offsets (consumer name = client id)."""
        if self._group_tid is not None:
            self._flush_group()
        key = P_SESSION + client_id.encode("utf-8")
        v = self._db.get(key)
        existed = v is not None
        wb = self._batch()
        wb.delete(key)
        if existed:
            wb.delete(host_key(_host_of(v), client_id))
        for k, _ in self._scan(P_OFFSET + client_id.encode("utf-8") + b"\x00"):
            wb.delete(k)
        self._write(wb)
        return existed

    def list_sessions(self, after: str | None = None, limit: int | None = None) -> list[SessionRecord]:
        """Every session record in client id order (no `STUB`); a page of them: the first `limit`
        whose client id sorts after `after`."""
        start = None if after is None else P_SESSION + after.encode("utf-8") + b"\x00"
        out = []
        for _, v in self._scan(P_SESSION, start):
            if limit is not None and len(out) >= limit:
                break
            if not is_stub_bytes(v):
                out.append(self._session(v))
        return out

    def session_page(self, after: str | None, limit: int) -> tuple[list[tuple[str, bytes]], str | None]:
        """(client id, record bytes) of the next `limit` session records after client id `after`,
        and the client id to go on after (None at the end)."""
        start = None if after is None else P_SESSION + after.encode("utf-8") + b"\x00"
        out = []
        for k, v in self._scan(P_SESSION, start):
            if len(out) >= limit:
                return out, out[-1][0]
            out.append((k[len(P_SESSION):].decode("utf-8"), v))
        return out, None

    def session_host(self, client_id: str) -> str | None:
        """The gateway `client_id`'s session record names (None: no record, or one of no
        gateway), read from its bytes: the store checks it on every record write of a fleet
        gateway, to tell the gateway it named when another one takes the session over."""
        v = self._db.get(P_SESSION + client_id.encode("utf-8"))
        return None if v is None else _host_of(v)

    def session_hosts(self, after: str | None = None, limit: int = 1000) -> tuple[list[tuple[str, str | None]], str | None]:
        """(client id, host) of the next `limit` records (client id order, after `after`), and the
        client id to go on after (None at the end), read from the records' bytes (`_host_of`)
        without decoding them: the store's first session sweep learns which gateways have
        sessions at ~1/5 of the cost of decoding every record."""
        page, nxt = self.session_page(after, limit)
        return [(cid, _host_of(v)) for cid, v in page], nxt

    def sessions_of_gateways(self, gateways: Collection[str] | None, after: str | None = None,
                             limit: int = 1000, unhosted: bool = False,
                             stubs: bool = False) -> tuple[list[SessionRecord], str | None]:
        """The next `limit` records (client id order, after `after`) whose host
        (`SessionRecord.host`) is one of `gateways`, with `unhosted` also those naming no gateway,
        and the client id to go on after (None at the end): the store's session sweep looking
        for those of one gone gateway, or a restarting gateway's restore (`gw_list_sessions
        {hosted_by}`). Read through the by-gateway index: only those records are read, not the
        other gateways' (a gateway of a fleet with a million sessions spent ~3 s reading them
        all). `gateways` None: any gateway - the records among the next `limit`, each's host read
        from its bytes; only those returned are decoded. `stubs`: the `STUB`s too (the sweep)."""
        if gateways is not None:
            return self._sessions_by_host(sorted(set(gateways) | ({""} if unhosted else set())), after, limit,
                                          stubs)
        page, nxt = self.session_page(after, limit)
        out = []
        for _cid, v in page:
            host = _host_of(v)
            if (unhosted if host is None else (gateways is None or host in gateways)) and \
                    (stubs or not is_stub_bytes(v)):
                out.append(self._session(v))
        return out, nxt

    def _sessions_by_host(self, hosts: list[str], after: str | None,
                          limit: int, stubs: bool) -> tuple[list[SessionRecord], str | None]:
        """`sessions_of_gateways` through the index: the `h` ranges of `hosts` ("" for no
        gateway) merged in client id order, each record read and its host checked (an entry left
        by a record that moved to another gateway or ended is dropped from the index here)."""
        def entries(host: str):
            pre = P_SESSION_BY_HOST + host.encode("utf-8") + b"\x00"
            start = None if after is None else pre + after.encode("utf-8") + b"\x00"
            for k, _ in self._scan(pre, start):
                yield k[len(pre):].decode("utf-8"), host
        out: list[SessionRecord] = []
        stale: list[bytes] = []
        nxt = None
        get = self._db.get
        for cid, host in heapq.merge(*(entries(h) for h in hosts)):
            if len(out) >= limit:
                nxt = out[-1].client_id
                break
            v = get(P_SESSION + cid.encode("utf-8"))
            if v is None or (_host_of(v) or "") != host:
                stale.append(host_key(host, cid))
                continue
            if stubs or not is_stub_bytes(v):
                out.append(self._session(v))
        if stale:
            try:
                wb = self._batch()
                for k in stale:
                    wb.delete(k)
                self._write(wb)
            except Exception as e:  # noqa: BLE001 - a replica, a closing store: dropped next time
                log.debug("event=session_index_stale_kept entries=%d error=%r", len(stale), e)
        return out, nxt

    def sessions_with_offsets(self, hosted_by: str | None = None) -> list[tuple[SessionRecord, dict[str, int]]]:
        """Every session record with its committed offsets (consumer = client id): what a gateway
        restores at start. `hosted_by`: only those that gateway served last and those of no
        gateway (`SessionRecord.host`; read through the by-gateway index)."""
        if hosted_by is None:
            return [(rec, self.get_offsets(rec.client_id)) for rec in self.list_sessions()]
        out, after = [], None
        while True:
            recs, after = self.sessions_of_gateways([hosted_by], after, 5000, unhosted=True)
            out += [(rec, self.get_offsets(rec.client_id)) for rec in recs]
            if after is None:
                return out

    # -- filter registry (used by FilterRegistry) -------------------------------------------
    def release_filter_ref(self, flt: str, n: int, epoch_too: bool) -> None:
        """Write `flt`'s reference count `n` after one reference was let go of (the caller holds
        the counts: FilterRegistry; 0 deletes it) and, with `epoch_too` (a wildcard filter let go
        of by its last holder), delete its epoch in the same WAL write: a device's own filter,
        registered on its SUBSCRIBE and released when it leaves, was a read and two writes here."""
        key = P_FILTER + flt.encode("utf-8")
        group = self._grouped() if self._group_tid is not None else None
        wb = group if group is not None else self._batch()
        if n:
            wb.put(key, U32.pack(n))
        else:
            wb.delete(key)
            if epoch_too:
                wb.delete(P_EPOCH + flt.encode("utf-8"))
        if group is None:
            self._write(wb)

    def put_filter_ref(self, flt: str, n: int, epoch: tuple[int, int] | None = None) -> None:
        """Write `flt`'s reference count `n` (> 0; the caller holds the counts: FilterRegistry)
        and, for a wildcard filter registered anew, its epoch (CommitLog position, ms), in one
        WAL write."""
        key = P_FILTER + flt.encode("utf-8")
        group = self._grouped() if self._group_tid is not None else None
        if epoch is None and group is None:
            return self._put(key, U32.pack(n))
        wb = group if group is not None else self._batch()
        wb.put(key, U32.pack(n))
        if epoch is not None:
            wb.put(P_EPOCH + flt.encode("utf-8"), EPOCH.pack(*epoch))
        if group is None:
            self._write(wb)

    def set_filter_refs(self, counts: dict[str, int]) -> None:
        """Write absolute reference counts (0 deletes) in one WAL write; the caller holds the
        authoritative in-memory counts (FilterRegistry), so no read-modify-write is needed."""
        if self._group_tid is not None:
            self._flush_group()
        wb = self._batch()
        for flt, n in counts.items():
            key = P_FILTER + flt.encode("utf-8")
            if n > 0:
                wb.put(key, U32.pack(n))
            else:
                wb.delete(key)
        self._write(wb)

    def filters(self) -> dict[str, int]:
        """Every registered filter with its reference count."""
        return {k[1:].decode("utf-8"): U32.unpack(v)[0] for k, v in self._scan(P_FILTER)}

    # -- filter epochs (subscribing from the past: lightqueue/replay.py) ---------------------
    def put_filter_epoch(self, flt: str, phys: int, ms: int) -> None:
        if self._group_tid is not None:
            self._flush_group()
        self._put(P_EPOCH + flt.encode("utf-8"), EPOCH.pack(phys, ms))

    def get_filter_epoch(self, flt: str) -> tuple[int, int] | None:
        if self._group_tid is not None:
            self._flush_group()
        v = self._db.get(P_EPOCH + flt.encode("utf-8"))
        return None if v is None else EPOCH.unpack(v)

    def filter_epochs(self) -> dict[str, tuple[int, int]]:
        """Every wildcard filter's epoch (CommitLog position, ms)."""
        n = len(P_EPOCH)
        return {k[n:].decode("utf-8"): EPOCH.unpack(v) for k, v in self._scan(P_EPOCH)}

    def delete_filter_epoch(self, flt: str) -> None:
        if self._group_tid is not None:
            self._flush_group()
        wb = self._batch()
        wb.delete(P_EPOCH + flt.encode("utf-8"))
        self._write(wb)

    # -- lifecycle ---------------------------------------------------------------------------
    # -- users and ACL rules managed live (one document: store/node/security_service.py) -----
    def get_security(self) -> bytes | None:
        return self._db.get(K_SECURITY)

    def put_security(self, doc: bytes) -> None:
        self._flush_group()
        self._put(K_SECURITY, doc)

    def flush(self) -> None:
        self._db.flush_wal(True)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._db.close()


class _OneWrite:
    """`MetadataStore.one_write`'s context."""
    __slots__ = ("md", "mine")

    def __init__(self, md: MetadataStore) -> None:
        self.md = md
        self.mine = False

    def __enter__(self) -> "_OneWrite":
        md = self.md
        with md._lock:
            if md._group_tid is None:
                md._group = None
                md._group_tid = threading.get_ident()
                self.mine = True
        return self

    def __exit__(self, *exc) -> None:
        if not self.mine:
            return
        md = self.md
        with md._lock:
            wb, md._group, md._group_tid = md._group, None, None
        if wb is not None:
            md._write(wb)


class _ShippedBatch:
    """A WriteBatch that lists its operations too (`MetadataStore._batch` in group mode)."""
    __slots__ = ("wb", "ops")

    def __init__(self) -> None:
        self.wb = WriteBatch(raw_mode=True)
        self.ops: list = []

    def put(self, key: bytes, value: bytes) -> None:
        self.wb.put(key, value)
        self.ops.append((key, value))

    def delete(self, key: bytes) -> None:
        self.wb.delete(key)
        self.ops.append((key, None))
