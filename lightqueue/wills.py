"""The wills of the metadata store: the will message each connected client left, kept until
its connection ends cleanly or is published (`Wills`, a part of `MetadataStore`).

Separate from lightqueue/metadata.py because wills have their own index and life: `W gateway \\0
client_id` lists the wills a gateway holds, so the store node publishes those of a gateway that
died (`take_wills`) without a scan of all, and a count kept in memory spares a CONNECT the read
of a will it rarely has. `MetadataStore` inherits these methods; the state they use (`_db`,
`_lock`, `_wills`, the write path `_batch`/`_write`/`_scan`) is the store's.
"""
from __future__ import annotations

import logging

from rocksdict import ReadOptions

from .errors import MetadataError
from .metadata_keys import P_WILL, P_WILL_BY_GATEWAY, prefix_end
from .records import WillRecord

log = logging.getLogger("lmqtt.lightqueue.metadata")


class Wills:
    """The will methods of `MetadataStore` (see the module docstring)."""

    # -- wills -------------------------------------------------------------------------------
    # A will belongs to the gateway holding its client's connection (`WillRecord.gateway`, "" for
    # the embedded one); `W gateway \0 client_id` indexes a gateway's wills, so the store node can
    # publish those of a gateway that died (store/node/gateway_service.py) without scanning all.
    # Index entries are hints checked against the record (a stale one is dropped when found).
    @staticmethod
    def _wkey(gateway: str, client_id: str) -> bytes:
        return P_WILL_BY_GATEWAY + gateway.encode("utf-8") + b"\x00" + client_id.encode("utf-8")

    def put_will(self, client_id: str, will: WillRecord, gateway: str | None = None) -> None:
        """Keep the will of `client_id`'s connection (replacing any earlier one, whichever gateway
        held it); `gateway` (if given) is recorded as its holder."""
        if gateway is not None:
            will.gateway = gateway
        key = P_WILL + client_id.encode("utf-8")
        wb = self._batch()
        wb.put(key, will.to_bytes())
        if will.gateway:
            wb.put(self._wkey(will.gateway, client_id), b"")
        with self._lock:
            prev = self._db.get(key)
            if prev is not None:             # held by another gateway until now: its index entry goes
                try:
                    held = WillRecord.from_bytes(prev).gateway
                except MetadataError:
                    held = ""
                if held and held != will.gateway:
                    wb.delete(self._wkey(held, client_id))
            self._write(wb)
            if prev is None and self._wills is not None:
                self._wills += 1

    def get_will(self, client_id: str) -> WillRecord | None:
        v = self._db.get(P_WILL + client_id.encode("utf-8"))
        return None if v is None else WillRecord.from_bytes(v)

    def pop_will(self, client_id: str, gateway: str | None = None) -> WillRecord | None:
        """Remove and return the will of `client_id` (None if it had none). With `gateway`, only
        a will that gateway holds (a will another gateway wrote since is kept, None returned)."""
        key = P_WILL + client_id.encode("utf-8")
        with self._lock:
            if self._wills == 0:
                return None
            v = self._db.get(key)
            if v is None:
                return None
            w = WillRecord.from_bytes(v)
            if gateway is not None and w.gateway != gateway:
                return None
            wb = self._batch()
            wb.delete(key)
            if w.gateway:
                wb.delete(self._wkey(w.gateway, client_id))
            self._write(wb)
            if self._wills:
                self._wills -= 1
        return w

    def void_will(self, client_id: str) -> None:
        """A new connection of `client_id`: the will a previous connection left (on any gateway)
        will never be published."""
        self.pop_will(client_id)

    def list_wills(self, gateway: str | None = None) -> list[tuple[str, WillRecord]]:
        """Stored wills: all, or those `gateway` holds."""
        if gateway is None:
            return [(k[1:].decode("utf-8"), WillRecord.from_bytes(v)) for k, v in self._scan(P_WILL)]
        return [(cid, w) for cid, w, _k in self._wills_of(gateway) if w is not None]

    def _wills_of(self, gateway: str):
        pre = self._wkey(gateway, "")
        for k, _ in list(self._scan(pre)):
            cid = k[len(pre):].decode("utf-8")
            try:
                w = self.get_will(cid)
            except MetadataError as e:    # a corrupt record is never served: skipped (its index entry too)
                log.error("event=will_record_corrupt client_id=%s error=%s (skipped)", cid, e)
                w = None
            yield cid, (w if w is not None and w.gateway == gateway else None), k

    def take_wills(self, gateway: str | None = None) -> list[tuple[str, WillRecord]]:
        """Remove and return the wills `gateway` holds (all of them with None): the orphans of a
        gateway that crashed, in one write."""
        with self._lock:
            wb = self._batch()
            out = []
            if gateway is None:
                for k, v in self._scan(P_WILL):
                    try:
                        w = WillRecord.from_bytes(v)
                    except MetadataError as e:     # never served as a will; left where it is
                        log.error("event=will_record_corrupt key=%r error=%s (skipped)", k, e)
                        continue
                    out.append((k[1:].decode("utf-8"), w))
                    wb.delete(k)
                for k, _ in self._scan(P_WILL_BY_GATEWAY):
                    wb.delete(k)
            else:
                for cid, w, k in self._wills_of(gateway):
                    wb.delete(k)
                    if w is not None:
                        out.append((cid, w))
                        wb.delete(P_WILL + cid.encode("utf-8"))
            self._write(wb)
            self._wills = self._count_wills()
        return out

    def _count_wills(self) -> int:
        """The will records on disk (a pass over their keys: at open, after `take_wills`)."""
        ro = ReadOptions()
        ro.set_iterate_upper_bound(prefix_end(P_WILL))
        return sum(1 for _ in self._db.keys(from_key=P_WILL, read_opt=ro))

    def will_gateways(self) -> set[str]:
        """The gateway ids holding at least one will ("" included for wills without one)."""
        out = set()
        for _k, v in self._scan(P_WILL):
            try:
                out.add(WillRecord.from_bytes(v).gateway)
            except MetadataError as e:     # a corrupt record is never served
                log.error("event=will_record_corrupt key=%r error=%s (skipped)", _k, e)
        return out
