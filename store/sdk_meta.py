"""Store-side metadata of SDK clients: consumer-group offsets, producer dedup state, POP state.

Why its own small RocksDB (rocksdict, WAL on) under `<data-dir>/sdk-meta` and not the light
queues' MetadataStore: `store/` may import nothing of `lightqueue/` (docs/internals.md), and the store
server must work without light queues (a plain `MessageStore` behind `StoreServer`). The light
queues keep their own metadata (sessions, retained, filters) where the gateway reads them.

Keys:  o\\0<group>\\0<queue key>   -> u64 committed offset (queue key: "cq\\0<topic>\\0<qid>" or
                                     "lq\\0<filter>")
       p\\0<producer id>\\0<u64 seq> -> PRODUCED reply body of that batch (the last 64 per producer),
                                     or a pending marker while the batch is being appended
       s\\0<group>\\0<topic>\\0<qid> -> JSON POP state (see pop.py)
       f\\0<filter>                -> b"1": a filter an SDK consumer registered (store/node/sdk_service.py)
       tg\\0<first-level topic>      -> JSON {"group": name, "ms": when}: the store group owning the
                                     topic, kept by the first group of a deployment of several
                                     (store/server `topic_group_claim`, docs/groups.md)
       R                          -> u64 the store's last recovery generation whose cut the offsets
                                     and POP states were checked against (store/recovery.py)
"""
from __future__ import annotations

import json
import os
import struct

from rocksdict import Rdict, WriteBatch, WriteOptions

from .protocol import compact_json
from .rocksdb_options import rocksdb_options

_U64 = struct.Struct(">Q")
_K_RECOVERY = b"R"
TOPIC_GROUP = "tg\0"     # tg\0<first-level topic> -> the store group that owns it (docs/groups.md)
SDK_FILTER = "f\0"      # f\0<filter> -> a filter an SDK consumer registered (store/node/sdk_service.py)
_PENDING = struct.Struct(">cQI")        # b"P", CommitLog position before the append, message count
DEDUP_WINDOW = 64      # batches per producer whose results are kept for retries


def cq_key(topic: str, queue_id: int) -> str:
    return f"cq\0{topic}\0{queue_id}"


def lq_key(flt: str) -> str:
    return f"lq\0{flt}"


def queue_label(qkey: str) -> str:
    """A queue key as messages show it: `<topic>:<queue id>` (ConsumeQueue) or the filter."""
    kind, _, rest = qkey.partition("\0")
    if kind == "cq":
        topic, _, qid = rest.rpartition("\0")
        return f"{topic}:{qid}"
    return rest


class SdkMetadata:
    def __init__(self, path: str, max_open_files: int = -1) -> None:
        """`max_open_files`: RocksDB's table files open at once (-1: no bound; a store node passes
        its budget's share, store/file_budget.py)."""
        os.makedirs(path, exist_ok=True)
        self._db = Rdict(path, rocksdb_options(max_open_files))
        self._wo = WriteOptions()
        self._producers: dict[str, dict] = {}

    # ---------------------------------------------------------------- group offsets
    def commit(self, group: str, queue: str, offset: int) -> None:
        self._db.put(f"o\0{group}\0{queue}".encode(), _U64.pack(offset), self._wo)

    def committed(self, group: str, queue: str) -> int | None:
        v = self._db.get(f"o\0{group}\0{queue}".encode())
        return None if v is None else _U64.unpack(v)[0]

    def _scan(self, prefix: bytes):
        """(key, value) of every key starting with `prefix`, in key order (one RocksDB seek)."""
        it = self._db.iter()
        it.seek(prefix)
        while it.valid():
            k = it.key()
            if not k.startswith(prefix):
                return
            yield k, it.value()
            it.next()

    def group_offsets(self, group: str) -> dict[str, int]:
        prefix = f"o\0{group}\0".encode()
        return {k[len(prefix):].decode(): _U64.unpack(v)[0] for k, v in self._scan(prefix)}

    def groups(self) -> list[str]:
        return sorted({k.split(b"\0")[1].decode() for k, _v in self._scan(b"o\0")})

    # ---------------------------------------------------------------- after a recovery
    def recovery_checked(self) -> int:
        """The store recovery generation the offsets were last checked against (0: none)."""
        v = self._db.get(_K_RECOVERY)
        return 0 if v is None else _U64.unpack(v)[0]

    def set_recovery_checked(self, generation: int) -> None:
        self._db.put(_K_RECOVERY, _U64.pack(generation), self._wo)

    def reset_offsets_beyond(self, store, cut: int) -> int:
        """Every group offset beyond its queue's end when the CommitLog ended at `cut` (a recovery
        cut it there, store/recovery.py) back to that end, with a WARNING each: left there, the
        group would skip the new messages appended at the offsets below it. The end comes from
        `store.queue_end_at` ("cq" ConsumeQueues; "lq" light queues when they are there). Returns
        how many were reset."""
        ends: dict[str, int | None] = {}
        n = 0
        for k, v in list(self._scan(b"o\0")):
            group, _, qkey = k[2:].decode().partition("\0")
            off = _U64.unpack(v)[0]
            if qkey not in ends:
                kind, _, name = qkey.partition("\0")
                ends[qkey] = store.queue_end_at(kind, name, cut)
            end = ends[qkey]
            if end is None or off <= end:
                continue
            store.offset_reset(f"group {group}", queue_label(qkey), off, end)
            self.commit(group, qkey, end)
            n += 1
        return n

    # ---------------------------------------------------------------- producer dedup
    # one key per remembered batch: p\0<producer id>\0<u64 sequence> -> the PRODUCED reply body
    # (binary, as sent), so remembering a batch costs one small put, never a re-encode of a window
    @staticmethod
    def _pkey(pid: str, seq: int) -> bytes:
        return f"p\0{pid}\0".encode() + _U64.pack(seq)

    def _window(self, pid: str) -> list[int]:
        w = self._producers.get(pid)
        if w is None:
            prefix = f"p\0{pid}\0".encode()
            w = sorted(_U64.unpack(k[len(prefix):])[0] for k, _v in self._scan(prefix)
                       if len(k) == len(prefix) + 8)
            self._producers[pid] = w
        return w

    def seen(self, pid: str, seq: int) -> bytes | None:
        """None if (pid, seq) was never stored; else the PRODUCED body sent for it, or b"" when the
        batch is older than the window (stored long ago, results forgotten).

        Membership in the window, not "seq <= last": batches in flight together may be re-sent
        out of order after a lost connection, and a later one stored first must not make an
        earlier, never-stored one look like a duplicate."""
        w = self._window(pid)
        if not w:
            return None
        v = self._db.get(self._pkey(pid, seq))
        if v is not None:
            return v
        if len(w) >= DEDUP_WINDOW and seq < w[0]:
            return b""
        return None

    def remember(self, pid: str, seq: int, produced_body: bytes) -> None:
        w = self._window(pid)
        if not w or w[-1] != seq:        # begin() already listed it
            w.append(seq)
            if len(w) > 1 and w[-2] > seq:
                w.sort()
        if len(w) <= DEDUP_WINDOW:
            self._db.put(self._pkey(pid, seq), produced_body, self._wo)
            return
        # the batch and the window's oldest forgotten in one write (one WAL append, not two: a
        # write per PRODUCE on the primary and on every replica)
        wb = WriteBatch(raw_mode=True)
        wb.put(self._pkey(pid, seq), produced_body)
        while len(w) > DEDUP_WINDOW:
            wb.delete(self._pkey(pid, w.pop(0)))
        self._db.write(wb, self._wo)

    # A batch is appended to the CommitLog first and remembered here after; a process killed
    # between the two would leave it stored but unknown to dedup, and its retry stored twice.
    # So before appending, `begin` writes a pending marker holding the CommitLog write position
    # and the batch's size; a retry that finds the marker looks for the batch in the log from
    # that position (StoreServer.produce) instead of trusting either answer blindly.
    def begin(self, pid: str, seq: int, log_position: int, count: int) -> None:
        self.remember(pid, seq, _PENDING.pack(b"P", log_position, count))

    @staticmethod
    def pending(value: bytes) -> tuple[int, int] | None:
        """(log position, message count) when `value` (from `seen`) is a pending marker, else None.
        A marker is 13 bytes; a PRODUCED body is 4 + 16 * n, never 13."""
        if len(value) != _PENDING.size:
            return None
        _p, pos, count = _PENDING.unpack(value)
        return pos, count

    # ---------------------------------------------------------------- POP + filters
    def put_json(self, key: str, obj) -> None:
        self._db.put(key.encode(), compact_json(obj).encode(), self._wo)

    def put_json_text(self, key: str, text: str) -> None:
        """put_json of a value already encoded (compact_json): a store group ships the text as is."""
        self._db.put(key.encode(), text.encode(), self._wo)

    def get_json(self, key: str):
        v = self._db.get(key.encode())
        return None if v is None else json.loads(v)

    def delete_json(self, key: str) -> None:
        self._db.delete(key.encode(), self._wo)

    # ---------------------------------------------------------------- store groups (docs/ha.md)
    def snapshot(self):
        """(key, value) of every key but this data dir's own (`_K_RECOVERY`), as of now (a
        RocksDB snapshot, read lazily): what a store group's primary sends a replica whose
        metadata it cannot bring up to date change by change."""
        snap = self._db.snapshot()

        def items(snap=snap):
            for k, v in snap.items():
                if k != _K_RECOVERY:
                    yield k, v
        return items()

    def replicated_keys(self):
        for k in self._db.keys():
            if k != _K_RECOVERY:
                yield k

    def apply_replicated(self, ops) -> None:
        """Write (key, value | None = delete) pairs a primary sent (a snapshot's); the producer
        windows are read again from what is stored."""
        for k, v in ops:
            if k == _K_RECOVERY:
                continue
            if v is None:
                self._db.delete(k, self._wo)
            else:
                self._db.put(k, v, self._wo)
        self._producers.clear()

    def keys_with_prefix(self, prefix: str) -> list[str]:
        return [k.decode() for k, _v in self._scan(prefix.encode())]

    def flush(self) -> None:
        try:
            self._db.flush()
        except Exception:  # noqa: BLE001 - the WAL holds it anyway
            pass

    def close(self) -> None:
        self._db.close()
