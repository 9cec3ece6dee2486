"""StoreConnection: one client of the `StoreServer` (server.py), an asyncio.Protocol.

Its job is the bytes: frames decoded (`protocol.FrameDecoder`), HELLO and the token checked, each
request handed to the server and answered with a frame of the same request id, the replies of one
read joined into one write, a too-large frame read away before the close, a client that does not
read its replies paused. What a request does (PRODUCE's dedup and append, the CALL commands, what
plugs in from store/node) is the server's.

Why a module of its own: the server is what the store answers; this is how one socket carries it.
server.py imports it when it starts listening (`StoreServer.start`), so the import goes one way.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
from typing import TYPE_CHECKING

from .. import protocol as W
from ..async_append import durable_waiter
from ..disk_space import size_text
from ..errors import DiskFull, InvalidMessage, InvalidTopic, MessageTooLarge, StoreError, is_disk_full
from ..fastpath import read_raw
from .calls import F_SDK_CLIENT, META_THEN, META_WRITES, CallError, Messages, RawFrame, RawMessages, raw_messages_head

if TYPE_CHECKING:
    from . import StoreServer

log = logging.getLogger("lmqtt.store.server")     # the server's log, as before the split


# A too-large frame is read away (up to this many bytes, for at most this long) before the
# connection closes, so its sender reads the ERROR rather than a connection reset.
MAX_DISCARD = 256 << 20
_JOIN_MAX = 256 << 10      # replies of one read up to this size go out joined, in one write
DISCARD_TIMEOUT_S = 10.0


class StoreConnection(asyncio.Protocol):
    """One client. The replies to the frames of one read (and the pushes raised meanwhile to this
    connection) are joined into one write: a gateway's PRODUCE answered with PRODUCED and the PUSH
    of what it appended costs one send, not two."""

    def __init__(self, server: StoreServer) -> None:
        self.srv = server
        self.decoder = W.FrameDecoder(server.max_frame)
        self.transport: asyncio.Transport | None = None
        self.ready = False
        self.gateway = False     # set by HELLO: True for a gateway's link (its PRODUCE may name '$' topics)
        self.closing = False
        self.peer = None
        self.discard_left = 0        # after a too-large frame: its bytes still to drop, then close
        self._cork: list[bytes] | None = None     # frames to write at the end of data_received
        # the transport's buffer is above its high-water mark (the client does not read): pushes
        # that carry data hold back (store/node/gateway_service.py sends hints only meanwhile)
        self.write_paused = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.peer = transport.get_extra_info("peername")
        self.srv.connections.add(self)

    def connection_lost(self, exc) -> None:
        self.srv.connections.discard(self)
        for fn in self.srv.on_connection_lost:
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - one cleanup hook must not stop the others
                log.exception("event=connection_lost_hook_failed")

    def push(self, op: int, body: bytes) -> None:
        """An unsolicited frame (request id 0) to this client, e.g. an EVENT; dropped once closing."""
        if self.ready and not self.closing:
            self._send(W.frame(op, 0, body))

    def push_framed(self, frames: bytes) -> None:
        """Unsolicited frames already framed (`W.frame(op, 0, body)`, joined), in one write."""
        if self.ready and not self.closing:
            self._send(frames)

    def push_parts(self, op: int, parts: list) -> None:
        """`push` of a body given as parts (record bytes are not joined into one buffer first),
        the head and the parts in one `writelines` (one writev): a write per part cost a system
        call each and woke the gateway for a frame it could not read whole yet (a fan-in's
        pushes were ~3 writes each, most of the store's ~7,000 writes a second)."""
        if self.ready and not self.closing:
            out = [W.frame_head(op, 0, sum([len(p) for p in parts]))]
            out += [p for p in parts if p]
            c = self._cork
            if c is not None:
                c += out
            elif not self.transport.is_closing():
                self.transport.writelines(out)

    def pause_writing(self) -> None:     # the client does not read its replies: stop reading requests
        self.write_paused = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if not self.closing:
            self.transport.resume_reading()

    def _send(self, data: bytes) -> None:
        c = self._cork
        if c is not None:
            c.append(data)
        elif not self.transport.is_closing():
            self.transport.write(data)

    def _send_raw(self, rid: int, header: dict, count: int, chunks: list) -> None:
        """A MESSAGES frame in the raw layout, sent as its head and the record chunks as they are:
        a 4 MiB reply is not copied twice more (body join, frame concat) before the socket."""
        head = raw_messages_head(header, count)
        out = [W.frame_head(W.OP_MESSAGES, rid, len(head) + sum(map(len, chunks)), W.F_RAW) + head, *chunks]
        c = self._cork
        if c is not None:
            c += out
        elif not self.transport.is_closing():
            self.transport.writelines(out)      # one writev (push_parts)

    def _uncork(self) -> None:
        c = self._cork
        self._cork = None
        if c and not self.transport.is_closing():
            if len(c) == 1:
                self.transport.write(c[0])
            elif sum(map(len, c)) < _JOIN_MAX:
                self.transport.write(b"".join(c))
            else:               # a large reply in pieces: the socket takes them without a join copy
                self.transport.writelines(c)

    def _discard(self, n: int) -> None:
        self.discard_left = max(0, self.discard_left - n)
        if not self.discard_left:
            self._close_now()

    def _close_now(self) -> None:
        self.discard_left = 0
        timer = getattr(self, "_discard_timer", None)
        if timer is not None:
            timer.cancel()
        self.transport.close()

    def _disk_full(self, rid: int, e: BaseException) -> None:
        """Refused for lack of space (ERROR disk_full; the SDK raises DiskFull). Not logged per
        request: the store logs the disk-full episode once (store/disk_space.py)."""
        disk = self.srv.store.clog.disk
        if isinstance(e, DiskFull):
            msg = str(e)
        else:   # not the store's own refusal (RocksDB): part of the episode too, and counted
            disk.write_failed(META_WRITES, e, META_THEN)
            self.srv.meta_full = True
            disk.refused += 1
            # RocksDB's error names the file: which of the node's metadata databases it was
            which = "the light-queue metadata" if f"{os.sep}lightqueue{os.sep}" in str(e) else "the SDK metadata"
            msg = (f"disk full: cannot write {which} next to {disk.data_dir} "
                   f"({size_text(disk.free_bytes())} free); nothing was stored, send again once space is freed")
        self.srv.errors += 1
        self.srv.disk_full_refusals += 1
        log.debug("event=request_refused_disk_full peer=%s error=%r", self.peer, msg)
        self._send(W.error_frame(rid, W.E_DISK_FULL, msg))

    def _error(self, rid: int, code: int, msg: str, close: bool = False) -> None:
        self.srv.errors += 1
        log.info("event=request_error peer=%s code=%s error=%r", self.peer, W.ERROR_NAMES.get(code, code), msg)
        self._send(W.error_frame(rid, code, msg))
        if close:
            self.closing = True
            self._uncork()            # the replies so far and this ERROR go out before the close
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.discard_left:
            self._discard(len(data))
            return
        if self.closing:
            return
        self._cork = []
        try:
            self._received(data)
            for fn in self.srv.after_frames:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - a hook must not cost the replies
                    log.exception("event=after_frames_hook_failed")
        finally:
            self._uncork()

    def _received(self, data: bytes) -> None:
        try:
            frames = self.decoder.feed(data)
        except W.ProtocolError as e:
            if e.unread > 0 and e.unread <= MAX_DISCARD:
                # answer, then read the rest of the frame away before closing: closing with unread
                # bytes makes the kernel send RST, and a peer still writing the frame would see
                # "connection reset" instead of this ERROR
                self._error(0, e.code, str(e))
                self.closing = True
                self.discard_left = e.unread
                self._discard_timer = asyncio.get_running_loop().call_later(
                    DISCARD_TIMEOUT_S, self._close_now)
            else:
                self._error(0, e.code, str(e), close=True)
            return
        for op, flags, rid, body in frames:
            if self.closing:
                return
            self.srv.frames += 1
            try:
                self._handle(op, rid, body, flags)
            except W.ProtocolError as e:
                self._error(rid, e.code, str(e), close=e.fatal)
            except CallError as e:
                self._error(rid, e.code, str(e))
            except (InvalidTopic, InvalidMessage, MessageTooLarge) as e:
                self._error(rid, W.E_INVALID, f"{type(e).__name__}: {e}")
            except DiskFull as e:
                self._disk_full(rid, e)
            except StoreError as e:
                self._error(rid, W.E_STORE, f"{type(e).__name__}: {e}")
            except (KeyError, ValueError, TypeError) as e:
                self._error(rid, W.E_INVALID, f"bad request: {type(e).__name__}: {e}")
            except Exception as e:  # noqa: BLE001 - a bug answers one request, never kills the server
                if is_disk_full(e):     # e.g. RocksDB (the SDK metadata) out of space
                    self._disk_full(rid, e)
                    continue
                if "Writer has previous error" in str(e):
                    # RocksDB refusing after one of its writes failed (a full disk, an I/O error):
                    # the cause was reported when it happened; no traceback for each refusal
                    self._error(rid, W.E_STORE, f"metadata write refused: {e} (an earlier write failed: it is "
                                                "refused until the database recovers; nothing was stored)")
                    continue
                log.exception("event=handler_failed op=%#x", op)
                self._error(rid, W.E_INTERNAL, f"{type(e).__name__}: {e}")

    def _handle(self, op: int, rid: int, body: bytes, flags: int = 0) -> None:
        srv = self.srv
        if not self.ready:
            if op != W.OP_HELLO:
                raise W.ProtocolError(W.E_NOT_READY, "the first frame must be HELLO", True)
            a = W.parse_json(body)
            if a.get("version") != W.PROTOCOL_VERSION:
                raise W.ProtocolError(W.E_VERSION, f"protocol version {a.get('version')!r} not supported "
                                      f"(server speaks {W.PROTOCOL_VERSION})", True)
            if srv.token and not hmac.compare_digest(str(a.get("token") or ""), srv.token):
                raise W.ProtocolError(W.E_AUTH, "missing or wrong auth token", True)
            self.ready = True
            # a gateway's link (gateway/app/gateway.py) may PRODUCE what MQTT clients may publish
            self.gateway = str(a.get("client") or "").startswith("lmqtt-gateway")
            self._send(W.json_frame(W.OP_HELLO_OK, rid, {"version": W.PROTOCOL_VERSION, "ident": srv.store.ident,
                                                         "max_frame": srv.max_frame, "server": "lmqtt-store",
                                                         **srv.hello_info}))
            return
        if srv.guard is not None and op != W.OP_CALL:
            srv.guard(op, None)
        if op == W.OP_PRODUCE:
            results, durable, dup = srv.produce(body, flags if self.gateway else flags | F_SDK_CLIENT)
            w = None if durable is None else durable_waiter(durable, asyncio.get_running_loop())
            if w is None:
                if durable is not None:
                    durable.result()
                self._send(W.frame(W.OP_PRODUCED, rid, results, 1 if dup else 0))
            else:
                # a callback, not a task per PRODUCE: on a store group every PRODUCE waits here
                w.add_done_callback(lambda f, rid=rid, results=results, fl=1 if dup else 0:
                                    self._reply_durable(rid, results, fl, f))
        elif op == W.OP_PULL:
            topic, qid, off, cnt, mb, _g = W.decode_pull(body)
            st = srv.store
            lo, hi = st.consume_queue_offsets(topic, qid)
            if off < lo:
                off = lo
            cnt = min(cnt, 65536)
            if flags & W.F_RAW_OK and off < hi:
                raw = read_raw(st, topic, qid, off, cnt, mb)
                if raw is not None:     # CommitLog bytes as stored (CRC-checked): no decode, no re-encode
                    n, chunks, nxt = raw
                    self._send_raw(rid, {"next_offset": nxt, "min_offset": lo, "max_offset": hi}, n, chunks)
                    return
            ms = st.read_consume_queue(topic, qid, off, cnt) if off < hi else []
            if mb and ms:
                total = 0
                for i, m in enumerate(ms):
                    total += m.size
                    if total > mb and i:
                        ms = ms[:i]
                        break
            nxt = ms[-1].queue_offset + 1 if ms else off
            self._send(W.frame(W.OP_MESSAGES, rid, W.encode_messages(
                {"next_offset": nxt, "min_offset": lo, "max_offset": hi}, ms)))
        elif op == W.OP_PULL_FILTER:
            if srv.filter_pull is None:
                raise CallError(W.E_UNKNOWN_CMD, "this store serves no light queues (PULL_FILTER)")
            flt, _qid, off, cnt, mb, group = W.decode_pull(body)
            res = srv.filter_pull(flt, off, cnt, mb, group)
            self._send(W.frame(W.OP_MESSAGES, rid, W.encode_messages(res.header, res.msgs)))
        elif op == W.OP_CALL:
            a = W.parse_json(body)
            cmd = a.get("cmd")
            fn = srv.calls.get(cmd)
            if fn is None:
                raise CallError(W.E_UNKNOWN_CMD, f"unknown command {cmd!r}")
            if srv.guard is not None:
                srv.guard(op, cmd)
            res = fn(a, self) if srv.takes_connection(cmd) else fn(a)
            if asyncio.isfuture(res):
                # a handler that must wait (e.g. for dispatch) answers later; replies carry the
                # request id, so later requests on this connection are not held behind it
                res.add_done_callback(lambda f, rid=rid: self._reply_later(rid, f))
                return
            self._reply_call(rid, res)
        elif op == W.OP_HELLO:
            raise W.ProtocolError(W.E_BAD_FRAME, "HELLO already done")
        else:
            raise W.ProtocolError(W.E_BAD_FRAME, f"unknown opcode {op:#x}")

    def _reply_later(self, rid: int, fut) -> None:
        if fut.cancelled():
            self._error(rid, W.E_INTERNAL, "request cancelled (store shutting down)")
            return
        e = fut.exception()
        if e is None:
            self._reply_call(rid, fut.result())
        elif isinstance(e, CallError):
            self._error(rid, e.code, str(e))
        else:
            self._error(rid, W.E_INTERNAL, f"{type(e).__name__}: {e}")

    def _reply_call(self, rid: int, res) -> None:
        if isinstance(res, Messages):
            self._send(W.frame(W.OP_MESSAGES, rid, W.encode_messages(res.header, res.msgs)))
        elif isinstance(res, RawMessages):
            self._send_raw(rid, res.header, res.count, res.chunks)
        elif isinstance(res, RawFrame):
            self._send(W.frame_head(res.op, rid, sum([len(p) for p in res.parts])))
            for p in res.parts:
                if p:
                    self._send(p)
        else:
            self._send(W.json_frame(W.OP_RESULT, rid, res))

    def _reply_durable(self, rid: int, results, flags: int, done: asyncio.Future) -> None:
        """PRODUCED once the append is durable (`done`, its durable_waiter); `flags` as the reply
        would have had at once (bit 0: a duplicate, e.g. a retry after a failover, answered once
        the new primary's replicas have it)."""
        if done.cancelled():
            self._error(rid, W.E_INTERNAL, "request cancelled (store shutting down)")
            return
        e = done.exception()
        if e is not None:      # the flush failed: the client must not think it durable
            if getattr(e, "not_primary", False):     # store/ha: deposed before the replicas had it
                self._error(rid, W.E_NOT_PRIMARY, str(e))
                return
            self._error(rid, W.E_STORE, f"flush failed: {type(e).__name__}: {e}")
            return
        self._send(W.frame(W.OP_PRODUCED, rid, results, flags))
