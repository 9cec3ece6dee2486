"""Plain records kept by the metadata store: sessions, subscriptions, wills.

Why plain dataclasses with explicit (de)serialisation: the metadata store is the only copy of
this state, it must survive upgrades, and a later scale-out will ship it over the store's
native protocol. JSON (with binary fields in a length-prefixed tail) is slow-ish but readable,
versionable and small next to message payloads; sessions change at connect/subscribe rate, not
at message rate.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

from .errors import MetadataError

_U32 = struct.Struct(">I")
# one encoder for every record: json.dumps with non-default options builds a new JSONEncoder per
# call, a third of a session record's encoding time (same bytes: tests/lightqueue/test_lightqueue_metadata.py)
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
try:    # the C encoder `_JSON.encode` ends in, called directly (its Python layers were 2 of a session
    # record's ~7 us; a reconnect storm); the same bytes: tests/lightqueue/test_record_json_accel.py
    from json.encoder import c_make_encoder as _c_make_encoder, encode_basestring as _encode_basestring
    _C_ENCODE = _c_make_encoder(None, _JSON.default, _encode_basestring, None, ":", ",", False, False, True)
except (ImportError, TypeError):  # pragma: no cover - a Python without the C encoder
    _C_ENCODE = None


def _json_dumps(d: dict) -> str:
    """`_JSON.encode(d)` of a dict (no circular check: records are trees)."""
    if _C_ENCODE is None:  # pragma: no cover
        return _JSON.encode(d)
    return "".join(_C_ENCODE(d, 0))


@dataclass
class Subscription:
    """One subscription of a session, with its MQTT 5 options (3.1.1 clients use the defaults)."""

    filter: str                      # topic filter without the `$share/group/` prefix
    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0
    subscription_id: int | None = None
    share_group: str | None = None   # `$share/{group}/filter` subscriptions


NEVER_EXPIRES = 0xFFFFFFFF      # expiry_interval of a session that never expires
HOST = "gateway"                # extra[HOST]: id of the fleet gateway that last served the session
# extra[INFLIGHT]: a persistent session's QoS 1/2 exchanges (gateway/clients/session_persistence.py);
# its IN2_PENDING entries [packet id, topic, key, ms] are inbound QoS 2 messages whose append may
# or may not have been stored when the record was written (the id is written before the append,
# the message carries `key`): `resolve_pending_qos2` settles them against the log when the record
# is read, into IN2 ("stored, awaiting PUBREL"), or leaves them pending (not stored: the client's
# PUBLISH sent again is stored then, with the same key, at most once: store/unique_keys.py)
INFLIGHT = "inflight"
# extra[STUB] = true: not a session but the mark of one whose record is in another store group,
# written in each group that holds the session's offsets (gateway/storage/grouped_metadata.py), so
# that the group's own session sweep ends those offsets when the session's gateway is gone for
# good; readers of sessions never see one (`MetadataStore`), a record is never replaced by one
STUB = "stub"
_STUB_MARK = b'"' + STUB.encode() + b'":true'
IN2 = "in2"
IN2_PENDING = "in2p"
QOS2_KEY_PREFIX = "mqtt-qos2:"   # the message key of such an append (indexed under topic#key)


def resolve_pending_qos2(rec: "SessionRecord", stored) -> "SessionRecord":
    """Settle `rec`'s pending inbound QoS 2 ids (IN2_PENDING) in place: `stored(topic, key,
    ms)` says whether the message carrying `key` was stored (around `ms`); a stored one's id is
    known as stored, awaiting PUBREL; the others stay pending with their key.

    Why they are not forgotten: "not in the log" may only mean "not yet" - the gateway that wrote
    the id may be stalled with its append not sent (SIGSTOP, a VM pause) while its client moves to
    another gateway. The client's PUBLISH sent again then carries the same key, and the store
    keeps one record per key (store/unique_keys.py), whichever append comes second. A lookup that
    fails counts as not stored. Records without pending ids (every record of an older gateway)
    are returned untouched."""
    state = rec.extra.get(INFLIGHT) if rec.extra else None
    if not isinstance(state, dict) or not state.get(IN2_PENDING):
        return rec
    in2 = set(state.get(IN2) or ())
    left = []
    for entry in state.pop(IN2_PENDING):
        try:
            pid, topic, key, ms = entry
            if stored(topic, key, int(ms)):
                in2.add(int(pid))
                continue
        except Exception:  # noqa: BLE001 - not known as stored: it stays pending
            pass
        left.append(entry)
    state[IN2] = sorted(in2)
    if left:
        state[IN2_PENDING] = left
    return rec


@dataclass
class SessionRecord:
    """A persistent MQTT session (clean start = 0 / clean session = 0, or expiry interval > 0).

    `extra[HOST]` names the fleet gateway that last served the session (absent when written by
    the embedded server): at its restart that gateway restores its own sessions only, and the
    store node ends the sessions of a gateway that is gone for good (store/node/session_sweep.py).
    It lives in `extra` rather than in a field of its own so that a store node of the previous
    version still reads records a newer gateway wrote (rolling upgrades)."""

    client_id: str
    protocol_version: int = 4        # 3 = 3.1, 4 = 3.1.1, 5 = 5.0
    expiry_interval: int = 0         # seconds; 0xFFFFFFFF = never
    last_disconnect_ms: int | None = None   # None while connected
    subscriptions: list[Subscription] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # gateway-private JSON-able state

    @property
    def host(self) -> str | None:
        """The fleet gateway that last served this session, or None (embedded, older gateways)."""
        return self.extra.get(HOST) if self.extra else None

    @property
    def is_stub(self) -> bool:
        """The mark of a session whose record is in another store group (`STUB`)."""
        return bool(self.extra) and self.extra.get(STUB) is True

    @classmethod
    def stub(cls, client_id: str, protocol_version: int, expiry_interval: int, host: str | None) -> "SessionRecord":
        """The `STUB` of a session served by gateway `host`: connected (no disconnect time), so a
        sweep counts its expiry from when that gateway went away - never before the record's own,
        whose disconnect is no later."""
        extra: dict = {STUB: True}
        if host is not None:
            extra[HOST] = host
        return cls(client_id=client_id, protocol_version=protocol_version, expiry_interval=expiry_interval,
                   extra=extra)

    def expired(self, now_ms: int) -> bool:
        """Offline for at least its expiry interval at `now_ms` (a connected session never is)."""
        last = self.last_disconnect_ms
        if last is None or self.expiry_interval == NEVER_EXPIRES:
            return False
        return now_ms - last >= self.expiry_interval * 1000

    def to_bytes(self) -> bytes:
        # the dict `dataclasses.asdict` would give, built directly: asdict's generic deep copy was
        # half the cost of a session write, and sessions are written at every CONNECT, SUBSCRIBE
        # and disconnect of a persistent client (the same bytes: tests/lightqueue/test_lightqueue_metadata.py)
        d = {"client_id": self.client_id, "protocol_version": self.protocol_version,
             "expiry_interval": self.expiry_interval, "last_disconnect_ms": self.last_disconnect_ms,
             "subscriptions": [{"filter": s.filter, "qos": s.qos, "no_local": s.no_local,
                                "retain_as_published": s.retain_as_published,
                                "retain_handling": s.retain_handling, "subscription_id": s.subscription_id,
                                "share_group": s.share_group} for s in self.subscriptions],
             "extra": self.extra, "v": 1}
        return _json_dumps(d).encode("utf-8")

    @classmethod
    def from_bytes(cls, raw: bytes) -> "SessionRecord":
        try:
            d = json.loads(raw)
            d.pop("v", None)
            subs = [Subscription(**s) for s in d.pop("subscriptions", [])]
            return cls(subscriptions=subs, **d)
        except (ValueError, TypeError) as e:
            raise MetadataError(f"corrupt session record: {e}") from None


def is_stub_bytes(raw: bytes) -> bool:
    """`SessionRecord.is_stub` of a record's bytes, decoding only those that may be one."""
    return _STUB_MARK in raw and SessionRecord.from_bytes(raw).is_stub


@dataclass
class WillRecord:
    """A will message kept until the session ends cleanly (discarded) or uncleanly (published)."""

    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    props: bytes = b""               # gateway-encoded MQTT 5 will properties
    delay_interval: int = 0          # MQTT 5 Will Delay Interval, seconds
    created_ms: int = 0
    gateway: str = ""                # id of the gateway holding the connection ("" = embedded)

    def to_bytes(self) -> bytes:
        d = {"v": 1, "topic": self.topic, "qos": self.qos, "retain": self.retain,
             "delay_interval": self.delay_interval, "created_ms": self.created_ms, "plen": len(self.payload)}
        if self.gateway:
            d["gateway"] = self.gateway
        head = _JSON.encode(d).encode("utf-8")
        return b"".join((_U32.pack(len(head)), head, self.payload, self.props))

    @classmethod
    def from_bytes(cls, raw: bytes) -> "WillRecord":
        try:
            (hl,) = _U32.unpack_from(raw, 0)
            d = json.loads(raw[4:4 + hl])
            p0 = 4 + hl
            plen = d.pop("plen")
            d.pop("v", None)
            return cls(payload=raw[p0:p0 + plen], props=raw[p0 + plen:], **d)
        except (ValueError, TypeError, KeyError, struct.error) as e:
            raise MetadataError(f"corrupt will record: {e}") from None
