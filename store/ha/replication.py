"""CommitLog shipping (after RocketMQ's HAService / HAConnection / HAClient): the frames, the
primary's MetaLog and Shipper. The replica's side is store/ha/follower.py, the ack gate
store/ha/ack_gate.py.

The replica connects to the primary's replication port and says who it is, the epoch list it has
and its CommitLog end (HANDSHAKE); the primary answers where to stream from (the divergence point
of the two epoch lists, store/ha/epochs.py): below the replica's end, the replica must first cut
its tail (store/ha/truncate.py). Then the primary streams the CommitLog bytes as appended (DATA:
offset + bytes, at most one segment's rest per frame) and the SDK metadata changes that must
survive a failover (META: producer dedup markers, group offsets, filter registrations), each
META before the bytes it refers to. The replica writes the bytes at the same offsets
(CommitLog.append_replicated), lets its dispatch derive ConsumeQueues / light queues / index from
them, flushes under its flush mode and acknowledges (ACK: written, flushed).

Frames: 1 byte type, u32 length, payload.
  H  replica -> primary  JSON {node, epoch, end, epochs, segment_size}
  S  primary -> replica  JSON {epoch, start, end, min_offset, epochs}   (the stream starts at `start`)
  X  primary -> replica  JSON {error}                                   (refused; closed)
  D  primary -> replica  u64 offset + CommitLog bytes
  M  primary -> replica  JSON metadata change (with its sequence number "n")
  K  primary -> replica  u64 the primary's committed end (keep-alive while idle)
  A  replica -> primary  u64 written + u64 flushed + u64 the last META applied (its sequence)

`AckGate` (store/ha/ack_gate.py) holds the durable futures of appends on the primary: one resolves only when the primary
has the data under its flush mode, every member of the acknowledging set (the in-sync replicas,
at least `ack_replicas` of them) has acknowledged it under the flush mode, and the primary's epoch
lease is valid (store/ha/member.py: a Raft round trip confirmed it recently). A deposed primary's
waiting futures fail; nothing is acknowledged after a newer epoch exists.
"""
from __future__ import annotations

import base64
import collections
import itertools
import json
import logging
import socket
import struct
import threading
import time
import uuid

from ..errors import StoreError
from .epochs import divergence

log = logging.getLogger("lmqtt.store.ha")

_HEAD = struct.Struct(">cI")
U64 = struct.Struct(">Q")
ACK = struct.Struct(">QQQ")
MAX_CHUNK = 1 << 20
MAX_FRAME = 64 << 20
SNAP_KEYS = 2000            # metadata keys per snapshot frame


class NotPrimary(StoreError):
    """This member is not (or no longer) the primary: the write was not acknowledged. The store
    server answers it with ERROR not_primary (the SDK retries on the primary)."""
    not_primary = True


def frame(kind: bytes, payload: bytes) -> bytes:
    return _HEAD.pack(kind, len(payload)) + payload


def jframe(kind: bytes, obj) -> bytes:
    return frame(kind, json.dumps(obj, separators=(",", ":")).encode())


# A META payload whose change carries bytes: this byte, the u32 length of the JSON of the rest,
# that JSON, then the bytes as they are (never the first byte of JSON text)
_BIN_META = b"\x00"
_U32 = struct.Struct(">I")


def meta_frame(op: dict) -> bytes:
    """The META frame of a change: its JSON, or, when its "v" is bytes (a producer's dedup result:
    4 + 16 bytes per message of its batch, ~32 KB for a 256 KB AutoBatch batch of 100-byte
    messages), the JSON of the rest followed by the bytes as they are. Base64 inside JSON cost the
    primary and every replica about a tenth of a CPU second per million messages to encode and
    decode (BENCHMARKS.md "Replicated store group"). A replica of an earlier version cannot parse
    this form and drops the stream naming the JSON error (docs/ha.md "Upgrading a group": replicas
    first)."""
    v = op.get("v")
    if isinstance(v, (bytes, bytearray, memoryview)):
        head = json.dumps({k: x for k, x in op.items() if k != "v"}, separators=(",", ":")).encode()
        return frame(b"M", _BIN_META + _U32.pack(len(head)) + head + bytes(v))
    return jframe(b"M", op)


def parse_meta(payload: bytes) -> dict:
    """A META payload (either form of `meta_frame`) -> the change."""
    if payload[:1] == _BIN_META:
        n = _U32.unpack_from(payload, 1)[0]
        if 5 + n > len(payload):
            raise ValueError(f"metadata change frame of {len(payload)} bytes says its JSON has {n}")
        op = json.loads(payload[5:5 + n])
        op["v"] = bytes(payload[5 + n:])
        return op
    return json.loads(payload)


class FrameReader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def feed(self, data: bytes) -> list:
        self.buf += data
        out = []
        buf = self.buf
        i = 0
        while len(buf) - i >= 5:
            kind, n = _HEAD.unpack_from(buf, i)
            if n > MAX_FRAME:
                raise ConnectionError(f"replication frame of {n} bytes is above the limit")
            if len(buf) - i - 5 < n:
                break
            out.append((kind, bytes(buf[i + 5:i + 5 + n])))
            i += 5 + n
        del buf[:i]
        return out

    def read_one(self, timeout: float) -> tuple[bytes, bytes]:
        self.sock.settimeout(timeout)
        while True:
            got = self.feed(b"")
            if got:
                # put back what came after the first frame
                rest = got[1:]
                if rest:
                    self.buf[:0] = b"".join(frame(k, p) for k, p in rest)
                return got[0]
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("connection closed")
            self.buf += data


class MetaLog:
    """The metadata changes a primary ships, in order, bounded: (seq, log position, op).

    `covers_after`: every change made at a log position above it is held (None: none is, this
    member has not been primary). Set to the log end when the member becomes primary (`reset`),
    raised to the position of each change the bound drops. A replica whose log ends above it gets
    the changes from its end on; any other gets a snapshot first (Shipper, `snapshot`)."""

    def __init__(self, keep: int = 100_000) -> None:
        self.ops: collections.deque = collections.deque(maxlen=keep)
        self.seq = 0
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.on_add = None
        self.covers_after: int | None = None
        self.dropped = False          # the bound dropped a change since `reset`
        self.reset_seq = 0            # the sequence before this term's first change
        self.ident = uuid.uuid4().hex     # names this change numbering (per process)

    def reset(self, pos: int) -> None:
        """This member starts shipping as primary at log position `pos`."""
        with self.cond:
            self.covers_after = pos
            self.dropped = False
            self.ops.clear()             # an earlier term's changes are no replica's business now
            self.reset_seq = self.seq

    def covers(self, end: int) -> bool:
        """Whether every change a replica whose log ends at `end` may lack is held."""
        c = self.covers_after
        return c is not None and end > c

    def add(self, pos: int, op: dict) -> int:
        with self.cond:
            self.seq += 1
            op["n"] = self.seq
            ops = self.ops
            if len(ops) == ops.maxlen and self.covers_after is not None:
                self.covers_after = max(self.covers_after, ops[0][1])     # dropped below
                self.dropped = True
            ops.append((self.seq, pos, op, [None]))
            self.cond.notify_all()
            seq = self.seq
        if self.on_add is not None:
            self.on_add()            # wake the shipper
        return seq

    def since(self, seq: int, min_pos: int = -1) -> list:
        """[(seq, log position, op, frame cell)] after `seq` (and at/after `min_pos`), in order.
        The held changes are numbered consecutively up to `self.seq`, so the ones after `seq` are
        the last `self.seq - seq`: read from the end (a shipper asks on every change; scanning
        all 100,000 held ones each time cost it milliseconds per change once the bound filled)."""
        with self.lock:
            ops = self.ops
            k = min(len(ops), self.seq - seq)
            if k <= 0:
                return []
            tail = list(ops) if k == len(ops) else list(itertools.islice(reversed(ops), k))[::-1]
            return [e for e in tail if e[0] > seq and e[1] >= min_pos]

    @staticmethod
    def frame(entry) -> bytes:
        """The META frame of a `since` entry, encoded once for every replica's stream."""
        cell = entry[3]
        f = cell[0]
        if f is None:
            f = cell[0] = meta_frame(entry[2])
        return f


# ---------------------------------------------------------------------------------------- primary
class _Stream:
    """One replica's stream: what was sent on its socket (log bytes up to `pos`, changes up to
    `meta_seq`), the rest of a partial send, and the lock every writer of the socket holds."""
    __slots__ = ("sock", "pos", "meta_seq", "pending", "lock", "closed")

    def __init__(self, sock: socket.socket, pos: int, meta_seq: int) -> None:
        self.sock = sock
        self.pos = pos
        self.meta_seq = meta_seq
        self.pending = b""
        self.lock = threading.Lock()
        self.closed = False


class ReplicaInfo:
    __slots__ = ("node", "written", "flushed", "connected", "caught_up_at", "addr", "since", "meta_acked")

    def __init__(self, node: int) -> None:
        self.node = node
        self.written = 0
        self.flushed = 0
        self.meta_acked = 0
        self.connected = False
        self.caught_up_at = 0.0
        self.addr = ""
        self.since = time.monotonic()


class Shipper:
    """The primary's side: accepts replica connections on the replication port, streams to each."""

    def __init__(self, store, host: str, port: int, node: int, epoch: int, epochs, meta: MetaLog,
                 on_ack, group: str, snapshot=None, catch_up=None) -> None:
        self.store = store
        self.clog = store.clog
        self.node = node
        self.epoch = epoch
        self.epochs = epochs
        self.meta = meta
        self.on_ack = on_ack
        self.group = group
        # snapshot() -> (meta sequence, [(db name, iterator of (key, value))]): every replicated
        # metadata key as of that sequence, for a replica the MetaLog cannot bring up to date
        self.snapshot = snapshot
        # catch_up(handshake) -> the previous primary's changes this replica lacks and this member
        # applied before its promotion ([op]), or None: a snapshot is needed (store/ha/member.py)
        self.catch_up = catch_up
        self.replicas: dict[int, ReplicaInfo] = {}
        # the group's node ids (None: anyone): a node not in it (removed) is refused, its stream ended
        self.members: set | None = None
        self.cond = threading.Condition()
        self._stop = False
        self._socks: set = set()
        self._streams: list = []      # the replicas' streams (_Stream), replaced, never mutated
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self._thread = threading.Thread(target=self._accept, name="lmqtt-ha-ship-accept", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def stop(self) -> None:
        self._stop = True
        try:
            self.sock.close()
        except OSError:
            pass
        for s in list(self._socks):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                s.close()
            except OSError:
                pass
        self.wake()
        with self.meta.cond:
            self.meta.cond.notify_all()

    def _accept(self) -> None:
        while not self._stop:
            try:
                s, addr = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks.add(s)
            threading.Thread(target=self._serve, args=(s, addr), name="lmqtt-ha-ship", daemon=True).start()

    def _serve(self, s: socket.socket, addr) -> None:
        r = None
        try:
            reader = FrameReader(s)
            kind, payload = reader.read_one(10.0)
            if kind != b"H":
                raise ConnectionError(f"expected a handshake, got {kind!r}")
            h = json.loads(payload)
            node = int(h["node"])
            clog = self.clog
            if self.members is not None and node not in self.members:
                s.sendall(jframe(b"X", {"error": f"node {node} is not a member of store group {self.group!r} "
                                                  f"(members: {sorted(self.members)})"}))
                return
            if int(h.get("segment_size", clog.seg_size)) != clog.seg_size:
                s.sendall(jframe(b"X", {"error": f"segment size {h.get('segment_size')} differs from the "
                                                  f"primary's {clog.seg_size}: every member of a group must use "
                                                  "the same --segment-mb"}))
                return
            if int(h.get("epoch", 0)) > self.epoch:
                s.sendall(jframe(b"X", {"error": f"node {self.node} is primary of epoch {self.epoch}, the "
                                                  f"replica knows epoch {h.get('epoch')}: not primary any more"}))
                return
            end = clog.committed
            start = divergence(self.epochs.entries, end, h.get("epochs") or [], int(h["end"]))
            lo = clog.mfq.min_offset
            if start < lo:
                s.sendall(jframe(b"X", {"error": f"the replica's log ends at {start}, below the primary's oldest "
                                                  f"segment (offset {lo}, deleted by retention): it cannot catch up "
                                                  "from the stream; give it an empty data dir"}))
                return
            meta_from = self.meta.seq
            for e in self.meta.since(0, start):
                meta_from = e[0] - 1       # the changes from the replica's end on are shipped again
                break
            # a replica that followed another primary's metadata (or none, or not to the end of a
            # snapshot), or whose log ends where this MetaLog does not hold every change since,
            # gets a snapshot of the metadata first (docs/ha.md "Replicated metadata")
            snap = self.snapshot is not None and (
                int(h.get("meta_epoch", -1)) != self.epoch or bool(h.get("meta_incomplete"))
                or not self.meta.covers(start))
            tail = None
            if snap and self.catch_up is not None and not self.meta.dropped:
                tail = self.catch_up(h)      # both followed the same primary: its missing changes only
                if tail is not None:
                    snap = False
                    meta_from = self.meta.reset_seq      # then every change this primary made
            if snap:
                meta_from = 0
            s.sendall(jframe(b"S", {"epoch": self.epoch, "start": start, "end": end, "min_offset": lo,
                                    "epochs": self.epochs.entries, "group": self.group, "meta_from": meta_from,
                                    "meta_id": self.meta.ident}))
            if start < int(h["end"]):
                log.info("event=ha_replica_must_cut node=%d from=%d to=%d", node, int(h["end"]), start)
                return          # it cuts, restarts and connects again
            r = self.replicas.get(node)
            if r is None:
                r = self.replicas[node] = ReplicaInfo(node)
            r.written = r.flushed = start
            r.meta_acked = meta_from
            if snap and start >= int(h["end"]):
                meta_from = self._send_snapshot(s, node)
            elif tail is not None:
                self._send_tail(s, node, tail)
            r.connected = True
            r.addr = f"{addr[0]}:{addr[1]}"
            r.since = time.monotonic()
            log.info("event=ha_replica_connected node=%d from=%d epoch=%d", node, start, self.epoch)
            threading.Thread(target=self._acks, args=(s, reader, r), name="lmqtt-ha-acks", daemon=True).start()
            self._stream(s, r, start, meta_from)
        except (OSError, ConnectionError, ValueError, KeyError) as e:
            if not self._stop:
                log.info("event=ha_replica_stream_ended peer=%s error=%r", addr, str(e))
        finally:
            if r is not None:
                r.connected = False
                self.on_ack()
            self._socks.discard(s)
            try:
                s.close()
            except OSError:
                pass

    def set_members(self, members: set) -> None:
        """The group's node ids now: a removed node's stream ends and it is forgotten."""
        self.members = set(members)
        for n in [n for n in self.replicas if n not in self.members]:
            r = self.replicas.pop(n)
            r.connected = False
        self.wake()

    def _send_snapshot(self, s: socket.socket, node: int) -> int:
        """Every replicated metadata key, in frames of SNAP_KEYS: `snap_begin`, `snap` (db name,
        [[key, value] base64]), `snap_end` with the MetaLog sequence the snapshot is as of; the
        replica deletes what it holds beyond it (store/ha/member.py). -> that sequence."""
        seq, dbs = self.snapshot()
        s.sendall(jframe(b"M", {"k": "snap_begin"}))
        n = 0
        for name, items in dbs:
            chunk = []
            for k, v in items:
                chunk.append([base64.b64encode(k).decode(), base64.b64encode(v).decode()])
                if len(chunk) >= SNAP_KEYS:
                    s.sendall(jframe(b"M", {"k": "snap", "d": name, "ops": chunk}))
                    n += len(chunk)
                    chunk = []
            if chunk:
                s.sendall(jframe(b"M", {"k": "snap", "d": name, "ops": chunk}))
                n += len(chunk)
        s.sendall(jframe(b"M", {"k": "snap_end", "n": seq}))
        log.info("event=ha_metadata_snapshot_sent node=%d keys=%d as_of=%d", node, n, seq)
        return seq

    def _send_tail(self, s: socket.socket, node: int, tail: list) -> None:
        """The previous primary's changes a replica lacks (without their sequence numbers, which
        are that primary's), then `caught_up`: from here it holds this primary's metadata."""
        frames = [meta_frame({k: v for k, v in op.items() if k != "n"}) for op in tail]
        frames.append(jframe(b"M", {"k": "caught_up", "epoch": self.epoch, "from": self.meta.reset_seq}))
        s.sendall(b"".join(frames))
        log.info("event=ha_metadata_caught_up node=%d changes=%d (no snapshot)", node, len(tail))

    def _stream(self, s: socket.socket, r: ReplicaInfo, pos: int, meta_seq: int) -> None:
        clog = self.clog
        st = _Stream(s, pos, meta_seq)
        last_send = time.monotonic()
        self._streams = self._streams + [st]
        try:
            while not self._stop and r.connected and (self.members is None or r.node in self.members):
                # a metadata change made at log position P goes out exactly between the bytes before
                # P and the bytes from P on: a dedup marker (made before its batch's append) before
                # the batch's bytes, the batch's results (made after) only after them - a replica
                # must never hold the results of a batch it does not have (a retry would be answered
                # "stored" by it after a failover), nor a batch without its marker (a retry would be
                # stored again). So a DATA frame stops at the next unshipped change's position.
                # `committed` is read before the changes: one made after that read was made at or
                # beyond it (positions only grow), so no unseen change falls inside this frame.
                # Every write to the socket holds `st.lock` (`_direct` sends changes from the
                # thread that made them, under the same rule).
                with st.lock:
                    if st.pending:
                        s.sendall(st.pending)
                        st.pending = b""
                    committed = clog.committed
                    ops = self.meta.since(st.meta_seq)
                    ready = []
                    upto = committed
                    for e in ops:
                        if e[1] > st.pos:
                            upto = min(upto, e[1])
                            break
                        ready.append(MetaLog.frame(e))
                        st.meta_seq = e[0]
                    if ready:
                        s.sendall(b"".join(ready))
                    if st.pos < upto:
                        pos = st.pos
                        mf = clog.mfq.find(pos)
                        if mf is None:
                            raise ConnectionError(f"offset {pos} is no longer in the primary's log")
                        n = min(upto, mf.end_offset, pos + MAX_CHUNK) - pos
                        rel = pos - mf.start_offset
                        data = bytes(mf.mm[rel:rel + n])
                        s.sendall(_HEAD.pack(b"D", 8 + n) + U64.pack(pos) + data)
                        st.pos = pos + n
                        last_send = time.monotonic()
                        continue
                    now = time.monotonic()
                    if now - last_send >= 0.2:
                        s.sendall(frame(b"K", U64.pack(committed)))
                        last_send = now
                with self.cond:
                    if clog.committed <= st.pos and (self.meta.seq <= st.meta_seq or ops) and not self._stop:
                        self.cond.wait(0.05)
        finally:
            st.closed = True
            self._streams = [x for x in self._streams if x is not st]

    def wake_meta(self) -> None:
        """A metadata change was made (MetaLog.on_add): sent to each replica from this thread when
        its stream is idle (`_direct`), else the streams' threads are woken to send it. A POP call
        on a group waits for its change's round trip; a hop to a shipper thread per replica cost it
        ~0.2 ms and two thread wake-ups (docs/ha.md "POP on a group")."""
        for st in self._streams:
            if not self._direct(st):
                self.wake()
                return

    def _direct(self, st: "_Stream") -> bool:
        """Send the changes `st`'s replica may have now (those made at or below the log position
        its stream reached, as `_stream` would), without blocking: only if no other thread writes
        to the socket, nothing is left of an earlier partial send, the socket is in blocking mode
        (a timeout would make the send wait for room) and it takes the frames at once; a partial
        send leaves the rest to the stream's thread (`pending`). -> True when nothing is left to
        send for this change (the stream's thread need not wake)."""
        if not st.lock.acquire(blocking=False):
            return False
        try:
            s = st.sock
            if st.closed or st.pending or s.gettimeout() is not None:
                return False
            ops = self.meta.since(st.meta_seq)
            ready = []
            last = st.meta_seq
            for e in ops:
                if e[1] > st.pos:
                    return False            # after log bytes not shipped yet: the stream's turn
                ready.append(MetaLog.frame(e))
                last = e[0]
            if not ready:
                return True
            data = b"".join(ready)
            try:
                n = s.send(data, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                return False                # the stream's thread meets it and ends
            st.meta_seq = last
            if n < len(data):
                st.pending = data[n:]
                return False
            return True
        finally:
            st.lock.release()

    def _acks(self, s: socket.socket, reader: FrameReader, r: ReplicaInfo) -> None:
        try:
            s.settimeout(None)
            while not self._stop:
                data = s.recv(65536)
                if not data:
                    break
                for kind, payload in reader.feed(data):
                    if kind == b"A":
                        w, f, m = ACK.unpack(payload)
                        r.written, r.flushed, r.meta_acked = w, f, m
                        if w >= self.clog.committed:
                            r.caught_up_at = time.monotonic()
                        self.on_ack()
        except OSError:
            pass
        finally:
            r.connected = False
            self.on_ack()
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
