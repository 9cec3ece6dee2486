"""The replica's side of CommitLog shipping (store/ha/replication.py's module docstring: the
protocol): connects to the primary's replication port, writes the bytes and applies the metadata
changes it streams, acknowledges them."""
from __future__ import annotations

import json
import logging
import socket
import threading
import time

from lmqtt.store.client.failover import Retry

from ..errors import StoreError
from .replication import ACK, U64, FrameReader, frame, jframe, parse_meta

log = logging.getLogger("lmqtt.store.ha")

# A member opens its replication port once it has taken over as primary, a moment after the group
# named it, and its replicas dial as soon as they hear the name: a refusal within this long of
# that, before the first handshake, is the start of a group or of a failover, not a fault.
NEW_PRIMARY_GRACE_S = 5.0


class Follower:
    """The replica's side: connects to the primary's replication port, writes what it ships."""

    def __init__(self, store, primary_addr: tuple[str, int], node: int, epoch_now, epochs, on_cut,
                 apply_meta, sync: bool, meta_state=None) -> None:
        self.store = store
        self.clog = store.clog
        self.addr = primary_addr
        self.node = node
        self.epoch_now = epoch_now        # () -> the epoch this member knows now
        self.epochs = epochs
        self.on_cut = on_cut              # fn(offset, why): the member cuts and restarts
        self.apply_meta = apply_meta
        self.meta_state = meta_state      # () -> {"meta_epoch": E, "meta_incomplete": bool} for the handshake
        self.sync = sync
        self.connected = False
        self.conn_epoch = 0
        self.error = ""
        self.primary_end = 0
        self.meta_seq = 0
        self.meta_id = None               # the primary's change numbering (MetaLog.ident)
        self._stop = False
        self._sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="lmqtt-ha-follow", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        s = self._sock
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(5)

    def _run(self) -> None:
        # the reconnect schedule of every connection to a store (store/client/failover.py Retry):
        # short waits growing to half a second, started again after a session that got going
        retry = Retry(0.1, 0.5)
        started = time.monotonic()
        warned = False            # whether self.error was logged as a WARNING
        while not self._stop:
            try:
                self._session()
            except (OSError, ConnectionError, ValueError, StoreError) as e:
                if not self._stop:
                    msg = f"replication from {self.addr[0]}:{self.addr[1]} failed: {e}"
                    early = (isinstance(e, ConnectionRefusedError) and not self.conn_epoch      # no handshake yet
                             and time.monotonic() - started < NEW_PRIMARY_GRACE_S)
                    if msg != self.error or (not warned and not early):
                        if early:
                            log.info("event=ha_follow_waiting primary=%s:%d (its replication port opens once "
                                     "it has taken over)", self.addr[0], self.addr[1])
                        else:
                            log.warning("event=ha_follow_failed error=%r", msg)
                        warned = not early
                    self.error = msg
            if self.connected:
                retry = Retry(0.1, 0.5)
            self.connected = False
            if self._sock is not None:
                try:
                    self._sock.close()
                except OSError:
                    pass
                self._sock = None
            end = time.monotonic() + (retry.wait() or 0.0)
            while time.monotonic() < end:
                if self._stop:
                    return
                time.sleep(min(0.1, max(0.0, end - time.monotonic())))

    def _session(self) -> None:
        clog = self.clog
        s = socket.create_connection(self.addr, timeout=2.0)
        self._sock = s
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = FrameReader(s)
        hello = {"node": self.node, "epoch": self.epoch_now(), "end": clog.wrote,
                 "epochs": self.epochs.entries, "segment_size": clog.seg_size}
        if self.meta_state is not None:
            hello.update(self.meta_state())
        s.sendall(jframe(b"H", hello))
        kind, payload = reader.read_one(10.0)
        h = json.loads(payload)
        if kind == b"X":
            raise ConnectionError(h.get("error", "refused"))
        if kind != b"S":
            raise ConnectionError(f"unexpected answer {kind!r} to the handshake")
        start, epoch = int(h["start"]), int(h["epoch"])
        if start < clog.wrote:
            self._stop = True
            self.on_cut(start, f"rejoining epoch {epoch}: the log diverged from the primary's at {start} "
                               f"(this member's ended at {clog.wrote})")
            return
        if start > clog.wrote:
            raise ConnectionError(f"the primary streams from {start}, this log ends at {clog.wrote}")
        self.epochs.replace(h["epochs"], clog.wrote)
        self.meta_seq = int(h.get("meta_from", 0))
        self.meta_id = h.get("meta_id")
        self.conn_epoch = epoch
        self.primary_end = int(h["end"])
        # the log agrees with the primary's up to here: a deposed primary's dispatch, held at what
        # its replicas had acknowledged (AckGate.committed), may go on (no cut was needed)
        self.store.dispatch.limit = clog
        self.connected = True
        self.error = ""
        log.info("event=ha_following primary=%s:%d epoch=%d from=%d", self.addr[0], self.addr[1], epoch, start)
        s.settimeout(5.0)       # keep-alives come every 0.2 s while idle
        dispatch = self.store.dispatch
        while not self._stop:
            data = s.recv(1 << 20)
            if not data:
                raise ConnectionError("the primary closed the replication stream")
            frames = reader.feed(data)
            wrote = False
            for kind, payload in frames:
                if kind == b"D":
                    off = U64.unpack_from(payload)[0]
                    clog.append_replicated(off, memoryview(payload)[8:])
                    wrote = True
                elif kind == b"M":
                    op = parse_meta(payload)
                    self.apply_meta(op)
                    self.meta_seq = int(op.get("n", self.meta_seq))
                elif kind == b"K":
                    self.primary_end = U64.unpack(payload)[0]
            if self.epoch_now() > self.conn_epoch:
                raise ConnectionError(f"a newer epoch than {self.conn_epoch} exists: not acknowledging its "
                                      "old primary")
            if wrote:
                dispatch.wake()
                if self.sync:
                    clog.flush()
            if frames:
                s.sendall(frame(b"A", ACK.pack(clog.wrote, clog.flushed, self.meta_seq)))
