"""Packet objects -> bytes, for MQTT 3.1.1 (version 4, or 3 = MQTT 3.1 "MQIsdp") and 5.0.

Every byte the gateway writes to a client is built here: packets through `encode`, delivered
messages through `PublishTemplate` (topic, properties and payload encoded once per message, only
flags and packet id per subscriber), batched success acks through `encode_success_acks`, refusals
of a CONNECT through `encode_connack_refusal` / `encode_malformed_connect_reply`.

The encoder trusts its caller (our own server/clients): it raises ValueError for values that cannot be
represented at all (e.g. strings over 65535 bytes), but it does not police MQTT semantics.
"""
from __future__ import annotations

from dataclasses import replace
from struct import Struct, pack

from lmqtt.store import accel

from . import packets as P
from .properties import encode_properties
from .reason_codes import SUBACK_FAILURE_V311, ReasonCode, connack_return_code_v311
from .wire import VARINT_MAX, encode_string, encode_varint, read_varint

__all__ = ["encode", "encode_publish", "PublishTemplate", "SUCCESS_ACK_HEAD", "encode_success_acks",
           "encode_connack_refusal", "encode_malformed_connect_reply", "encode_publish_v5_parts", "encode_publish_run",
           "subscription_identifier_props", "topic_alias_prop", "message_expiry_prop"]


def _bin(b: bytes) -> bytes:
    if len(b) > 0xFFFF:
        raise ValueError(f"binary data of {len(b)} bytes does not fit MQTT's 2-byte length")
    return pack("!H", len(b)) + bytes(b)


def _frame(first: int, body: bytes) -> bytes:
    return bytes((first,)) + encode_varint(len(body)) + body


def _connect(p: P.Connect, version: int) -> bytes:
    # `version` wins, except that a 3.1 ("MQIsdp") CONNECT stays 3.1 when asked for the 3.x wire format.
    level = 3 if (version in (3, 4) and p.protocol_level == 3) else (version or p.protocol_level)
    name = b"\x00\x06MQIsdp" if level == 3 else b"\x00\x04MQTT"
    flags = 0x02 if p.clean_start else 0
    will = p.will
    if will is not None:
        flags |= 0x04 | (will.qos << 3) | (0x20 if will.retain else 0)
    if p.password is not None:
        flags |= 0x40
    if p.username is not None:
        flags |= 0x80
    parts = [name, bytes((level, flags)), pack("!H", p.keepalive)]
    if level == 5:
        parts.append(encode_properties(p.properties))
    parts.append(encode_string(p.client_id))
    if will is not None:
        if level == 5:
            parts.append(encode_properties(will.properties))
        parts.append(encode_string(will.topic))
        parts.append(_bin(will.payload))
    if p.username is not None:
        parts.append(encode_string(p.username))
    if p.password is not None:
        parts.append(_bin(p.password))
    return _frame(0x10, b"".join(parts))


def _connack(p: P.ConnAck, version: int) -> bytes:
    sp = 1 if p.session_present else 0
    if version == 5:
        return _frame(0x20, bytes((sp, p.reason_code)) + encode_properties(p.properties))
    return bytes((0x20, 2, sp, connack_return_code_v311(p.reason_code)))


def _ack(first: int):
    def enc(p, version: int) -> bytes:
        if version == 5:
            props = encode_properties(p.properties)
            if props != b"\x00":
                return _frame(first, pack("!HB", p.packet_id, p.reason_code) + props)
            if p.reason_code:  # reason code only: the short form
                return pack("!BBHB", first, 3, p.packet_id, p.reason_code)
        return pack("!BBH", first, 2, p.packet_id)
    return enc


def _subscribe(p: P.Subscribe, version: int) -> bytes:
    parts = [pack("!H", p.packet_id)]
    if version == 5:
        parts.append(encode_properties(p.properties))
    for s in p.subscriptions:
        opts = s.qos
        if version == 5:
            opts |= (0x04 if s.no_local else 0) | (0x08 if s.retain_as_published else 0) \
                | (s.retain_handling << 4)
        parts.append(encode_string(s.topic_filter))
        parts.append(bytes((opts,)))
    return _frame(0x82, b"".join(parts))


def _suback(p: P.SubAck, version: int) -> bytes:
    if version == 5:
        return _frame(0x90, pack("!H", p.packet_id) + encode_properties(p.properties)
                      + bytes(p.reason_codes))
    codes = bytes(c if c < 0x80 else SUBACK_FAILURE_V311 for c in p.reason_codes)
    return _frame(0x90, pack("!H", p.packet_id) + codes)


def _unsubscribe(p: P.Unsubscribe, version: int) -> bytes:
    parts = [pack("!H", p.packet_id)]
    if version == 5:
        parts.append(encode_properties(p.properties))
    parts.extend(encode_string(f) for f in p.topic_filters)
    return _frame(0xA2, b"".join(parts))


def _unsuback(p: P.UnsubAck, version: int) -> bytes:
    if version == 5:
        return _frame(0xB0, pack("!H", p.packet_id) + encode_properties(p.properties)
                      + bytes(p.reason_codes))
    return pack("!BBH", 0xB0, 2, p.packet_id)


def _disconnect(p: P.Disconnect, version: int) -> bytes:
    if version == 5:
        props = encode_properties(p.properties)
        if props != b"\x00":
            return _frame(0xE0, bytes((p.reason_code,)) + props)
        if p.reason_code:
            return bytes((0xE0, 1, p.reason_code))
    return b"\xe0\x00"


def _auth(p: P.Auth, version: int) -> bytes:
    if version != 5:
        raise ValueError("AUTH exists only in MQTT 5")
    props = encode_properties(p.properties)
    if p.reason_code == 0 and props == b"\x00":
        return b"\xf0\x00"
    return _frame(0xF0, bytes((p.reason_code,)) + props)


def _publish(p: P.Publish, version: int) -> bytes:
    return encode_publish(p.topic, p.payload, p.qos, p.retain, p.dup, p.packet_id, p.properties, version)


# the two packets a parked idle connection's watcher (gateway/net/parking.py, _park.c) handles
# without the decoder: a PINGREQ's first byte (kept when the second has not come yet) and its reply
PINGREQ_HEAD = b"\xc0"
PINGRESP_BYTES = b"\xd0\x00"

_ENCODERS = {
    P.Connect: _connect, P.ConnAck: _connack, P.Publish: _publish,
    P.PubAck: _ack(0x40), P.PubRec: _ack(0x50), P.PubRel: _ack(0x62), P.PubComp: _ack(0x70),
    P.Subscribe: _subscribe, P.SubAck: _suback, P.Unsubscribe: _unsubscribe, P.UnsubAck: _unsuback,
    P.PingReq: lambda p, v: PINGREQ_HEAD + b"\x00", P.PingResp: lambda p, v: PINGRESP_BYTES,
    P.Disconnect: _disconnect, P.Auth: _auth,
}


def encode(packet, version: int) -> bytes:
    """Encode one packet for protocol `version` (3, 4 or 5)."""
    try:
        enc = _ENCODERS[type(packet)]
    except KeyError:
        raise TypeError(f"not an MQTT packet: {packet!r}") from None
    return enc(packet, version)


def encode_publish(topic: str, payload: bytes, qos: int = 0, retain: bool = False, dup: bool = False,
                   packet_id: int | None = None, properties: P.Properties | None = None,
                   version: int = 4) -> bytes:
    """Encode a PUBLISH without building a packet object (the hot path of every delivery)."""
    t = topic.encode("utf-8")
    first = 0x30 | (qos << 1) | (0x08 if dup else 0) | (0x01 if retain else 0)
    props = encode_properties(properties) if version == 5 else b""
    if qos:
        if not packet_id:
            raise ValueError("a QoS 1/2 PUBLISH needs a packet id in 1..65535")
        head = pack("!H", len(t)) + t + pack("!H", packet_id) + props
    else:
        head = pack("!H", len(t)) + t + props
    return b"".join((bytes((first,)), encode_varint(len(head) + len(payload)), head, payload))


_U16 = Struct(">H")
_TOPIC_CACHE: dict[str, bytes] = {}     # topic -> u16 length + UTF-8 (bounded, cleared when full)
_TOPIC_CACHE_MAX = 65536


def _topic_bytes(topic: str) -> bytes:
    tb = _TOPIC_CACHE.get(topic)
    if tb is None:
        raw = topic.encode("utf-8")
        tb = _U16.pack(len(raw)) + raw
        if len(_TOPIC_CACHE) >= _TOPIC_CACHE_MAX:
            _TOPIC_CACHE.clear()
        _TOPIC_CACHE[topic] = tb
    return tb


# keys of `PublishTemplate.encodings` besides the (qos, retain, version) variants (0..14)
_PROPS_BLOCK = 16       # the property block, length prefix included
_PROPS_BODY = 17        # the properties other than the Message Expiry Interval, no length prefix
_EXPIRY = 18            # (seconds left, {qos | retain: variant}): variants with a Message Expiry Interval


class PublishTemplate:
    """One message pre-encoded for fan-out: the only place PUBLISH bytes for delivery are built.

    A message sent to N subscribers differs per subscriber only in the flags (QoS, DUP, retain), the
    protocol version and the packet id. Each variant `(qos, retain, version)` is encoded once, on
    first use: a QoS 0 variant is the complete packet; a QoS 1/2 variant is the bytes before the
    packet id (fixed header, topic) and after it (properties, payload), so one subscriber's packet
    is a single `join` of three parts — topic, properties and payload are never re-encoded, and no
    variant is built that nobody receives.

    `encode(qos, retain, version, pid, dup)` is the general form used by the gateway;
    `encode_with_expiry` the MQTT 5 form carrying the seconds of Message Expiry Interval left (kept
    per second, so a fan-out within the same second shares it); `properties_body` the shared part
    of a PUBLISH built per subscriber (`encode_publish_v5_parts`). The load generator uses the
    template's own QoS/retain/version through `for_packet_id` and `qos0`.

    A subclass may build its MQTT 5 properties lazily from another representation by overriding
    `message_properties` (the gateway decodes them from the store record only when a v5 client
    needs them). One that skips `__init__` (the gateway builds one per message pulled and gives
    QoS, retain and version per subscriber) sets `topic`, `payload` and `encodings`: a new dict,
    or the `encodings` of another template of the same message (same topic, payload and
    properties) so that what one encodes the other reuses. The entries of `encodings` are the
    template's own: nothing else reads or writes them.
    """

    __slots__ = ("topic", "payload", "qos", "retain", "properties", "version", "encodings")

    def __init__(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False,
                 properties: P.Properties | None = None, version: int = 4) -> None:
        self.topic, self.payload, self.qos, self.retain = topic, payload, qos, retain
        self.properties, self.version = properties, version
        self.encodings: dict[int, object] = {}

    def message_properties(self) -> P.Properties | None:
        """The message's MQTT 5 properties (read once per template: the encodings are kept)."""
        return self.properties

    def properties_block(self) -> bytes:
        """The MQTT 5 property block (with its length prefix), encoded once."""
        enc = self.encodings
        b = enc.get(_PROPS_BLOCK)
        if b is None:
            b = enc[_PROPS_BLOCK] = encode_properties(self.message_properties())
        return b

    def properties_body(self) -> bytes:
        """The message's MQTT 5 properties other than the Message Expiry Interval, without the
        length prefix, encoded once: the shared part of a PUBLISH built per subscriber, to which
        the caller adds the remaining expiry, subscription identifiers and a topic alias."""
        enc = self.encodings
        b = enc.get(_PROPS_BODY)
        if b is None:
            pr = self.message_properties()
            if pr is not None and pr.message_expiry_interval is not None:
                pr = replace(pr, message_expiry_interval=None)
            block = encode_properties(pr)
            _, start = read_varint(block, 0, len(block))
            b = enc[_PROPS_BODY] = block[start:]
        return b

    def _parts(self, qos: int, retain: bool, props: bytes):
        """The packet for QoS 0, or the bytes before and after the packet id."""
        tb = _topic_bytes(self.topic)
        payload = self.payload
        first = 0x30 | (qos << 1) | (0x01 if retain else 0)
        if qos:
            rl = len(tb) + 2 + len(props) + len(payload)
            return (bytes((first,)) + encode_varint(rl) + tb, props + payload if props else payload)
        rl = len(tb) + len(props) + len(payload)
        return b"".join((bytes((first,)), encode_varint(rl), tb, props, payload))

    def encode(self, qos: int, retain: bool, version: int, pid: int | None = None,
               dup: bool = False) -> bytes:
        """The PUBLISH for one subscriber: granted `qos`, `retain` flag, its protocol `version`."""
        key = qos | (4 if retain else 0) | (8 if version == 5 else 0)
        t = self.encodings.get(key)
        if t is None:
            t = self.encodings[key] = self._parts(qos, retain, self.properties_block() if version == 5 else b"")
        if qos == 0:
            return t
        if pid is None or not 0 < pid <= 0xFFFF:
            raise ValueError(f"packet id must be 1..65535, got {pid}")
        head = t[0]
        if dup:
            head = bytes((head[0] | 0x08,)) + head[1:]
        return b"".join((head, _U16.pack(pid), t[1]))

    def encode_with_expiry(self, qos: int, retain: bool, pid: int | None, dup: bool, seconds_left: int) -> bytes:
        """The MQTT 5 PUBLISH carrying `seconds_left` of Message Expiry Interval (§3.3.2.3.3) and
        nothing else per subscriber: encoded once per (seconds left, QoS, retain) like the other
        variants, so a fan-out within the same second shares it."""
        enc = self.encodings
        exp = enc.get(_EXPIRY)
        if exp is None or exp[0] != seconds_left:
            exp = enc[_EXPIRY] = (seconds_left, {})
        variants = exp[1]
        key = qos | (4 if retain else 0)
        t = variants.get(key)
        if t is None:
            body = self.properties_body() + message_expiry_prop(seconds_left)
            t = variants[key] = self._parts(qos, retain, encode_varint(len(body)) + body)
        if qos == 0:
            return t
        if pid is None or not 0 < pid <= 0xFFFF:
            raise ValueError(f"packet id must be 1..65535, got {pid}")
        head = t[0]
        if dup:
            head = bytes((head[0] | 0x08,)) + head[1:]
        return b"".join((head, _U16.pack(pid), t[1]))

    def for_packet_id(self, pid: int, dup: bool = False) -> bytes:
        """The template's QoS 1/2 encoding with packet id `pid`."""
        if not self.qos:
            raise ValueError("a QoS 0 template has no packet id; use .qos0")
        return self.encode(self.qos, self.retain, self.version, pid, dup)

    @property
    def qos0(self) -> bytes:
        """The encoding for subscribers granted QoS 0."""
        return self.encode(0, self.retain, self.version)


# ----------------------------------------------------------------------------- PUBLISH runs
# The fixed header + one-byte remaining length of a PUBLISH, by (first byte & 0x0F, remaining length)
_PUB_HEAD = [[bytes((0x30 | f, n)) for n in range(128)] for f in range(16)]


def encode_publish_run_py(msgs, version: int, max_packet: int = 0) -> tuple[bytes, int]:
    """PUBLISH packets without properties for `msgs` [(topic, payload, qos, retain, packet id or
    None), ...], joined in order: MQTT 3.1.1, or MQTT 5 with an empty property block. Those larger
    than `max_packet` (the client's MQTT 5 Maximum Packet Size, 0 = none) are left out; only QoS 0
    runs pass one (a QoS 1/2 message has its packet id allocated before this). Returns (bytes, how
    many were left out).

    Byte for byte `PublishTemplate(topic, payload).encode(qos, retain, version, pid)` per message
    (tests/mqtt compare them). Why: a history sent on `$replay/` (gateway/delivery/history.py), retained
    messages on SUBSCRIBE (gateway/delivery/retained.py) and a reader's backlog (`MqttSession.offer_records`, gateway/session/outbound.py) are
    runs of distinct messages each sent once to one subscriber, so a template per message (and its
    variant cache) buys nothing there; this is one join per run."""
    parts: list = []
    append = parts.append
    tcache = _TOPIC_CACHE
    heads = _PUB_HEAD
    u16 = _U16.pack
    extra = 1 if version == 5 else 0
    dropped = 0
    for topic, payload, qos, retain, pid in msgs:
        tb = tcache.get(topic)
        if tb is None:
            if len(topic) > 0x3FFF and len(topic.encode("utf-8")) > 0xFFFF:
                raise ValueError(f"topic is {len(topic.encode('utf-8'))} bytes in UTF-8, more than 65535")
            tb = _topic_bytes(topic)
        if not 0 <= qos <= 2:
            raise ValueError(f"qos must be 0, 1 or 2, got {qos}")
        f = (qos << 1) | 1 if retain else qos << 1
        rl = len(tb) + extra + len(payload)
        if qos:
            if pid is None or not 0 < pid <= 0xFFFF:
                raise ValueError(f"packet id must be 1..65535, got {pid}")
            rl += 2
        if rl > VARINT_MAX:
            raise ValueError(f"variable byte integer {rl} exceeds the maximum {VARINT_MAX}")
        if max_packet and rl + 1 + len(encode_varint(rl)) > max_packet:
            dropped += 1
            continue
        append(heads[f][rl] if rl < 128 else bytes((0x30 | f,)) + encode_varint(rl))
        append(tb)
        if qos:
            append(u16(pid))
        if extra:
            append(b"\x00")
        append(payload)
    return b"".join(parts), dropped


# The C loop (gateway/mqtt/_run.c) when built, else the reference above; the same bytes, errors
# and drop counts (tests/mqtt/test_publish_run_accel.py).
_run = accel.load("lmqtt.gateway.mqtt._run")
encode_publish_run = _run.encode_publish_run if _run is not None else encode_publish_run_py


# ----------------------------------------------------------------------------- per-subscriber MQTT 5 PUBLISH
# What differs per subscriber beyond QoS/retain/packet id in MQTT 5: the subscription identifiers
# of the subscriptions that matched (§3.3.4), a topic alias in place of the topic (§3.3.2.3.4) and
# the remaining message expiry (§3.3.2.3.3). Those packets are built from ready parts: the
# message's other properties (encoded once per message) plus these few bytes.

def subscription_identifier_props(ids) -> bytes:
    """Subscription Identifier properties (0x0B, variable byte integer), one per id."""
    return b"".join([b"\x0b" + encode_varint(i) for i in ids])


def topic_alias_prop(alias: int) -> bytes:
    """Topic Alias property (0x23, two-byte integer)."""
    return b"\x23" + _U16.pack(alias)


def message_expiry_prop(seconds: int) -> bytes:
    """Message Expiry Interval property (0x02, four-byte integer)."""
    return b"\x02" + pack(">I", seconds)


def encode_publish_v5_parts(topic: str | None, payload: bytes, qos: int, retain: bool, dup: bool,
                            packet_id: int | None, props_body: bytes) -> bytes:
    """An MQTT 5 PUBLISH from a ready property block body (`props_body`: the properties without
    their length prefix). `topic=None` sends an empty topic name (the receiver resolves the topic
    alias carried in `props_body`)."""
    tb = b"\x00\x00" if topic is None else _topic_bytes(topic)
    first = 0x30 | (qos << 1) | (0x08 if dup else 0) | (0x01 if retain else 0)
    props = encode_varint(len(props_body)) + props_body
    if qos:
        if not packet_id or packet_id > 0xFFFF:
            raise ValueError("a QoS 1/2 PUBLISH needs a packet id in 1..65535")
        rl = len(tb) + 2 + len(props) + len(payload)
        return b"".join((bytes((first,)), encode_varint(rl), tb, _U16.pack(packet_id), props, payload))
    rl = len(tb) + len(props) + len(payload)
    return b"".join((bytes((first,)), encode_varint(rl), tb, props, payload))


# ----------------------------------------------------------------------------- server-side helpers
# Success acks of one store batch are written as one buffer per connection: the publish path
# collects, per connection, pairs of `SUCCESS_ACK_HEAD[qos]` and packet id (two list appends, no
# per-message bytes object) and `encode_success_acks` packs them with one struct call.
# MQTT 5 omits reason code 0 with no properties (§3.4.2.1), so both versions share the short form.
SUCCESS_ACK_HEAD = (0, 0x4002, 0x5002)     # by QoS: unused, PUBACK, PUBREC (first byte, length 2)
_ACK_FORMATS: dict[int, Struct] = {}


def encode_success_acks(words: list[int]) -> bytes:
    """Pack `[head, pid, head, pid, ...]` (heads from `SUCCESS_ACK_HEAD`) into wire bytes."""
    n = len(words)
    st = _ACK_FORMATS.get(n)
    if st is None:
        st = Struct(">%dH" % n)
        if len(_ACK_FORMATS) < 256:
            _ACK_FORMATS[n] = st
    return st.pack(*words)


def encode_connack_refusal(reason_code: int, reason: str, version: int) -> bytes:
    """CONNACK refusing a connection: MQTT 5 with the reason code and reason string, 3.1.1 with the
    closest return code (MQTT 5 codes that 3.1.1 cannot express become "server unavailable")."""
    ack = P.ConnAck(False, reason_code)
    if version == 5:
        ack.properties.reason_string = reason[:200] if reason else None
    return _connack(ack, version)


def encode_malformed_connect_reply(reason_code: int, reason: str, version: int) -> bytes | None:
    """What to answer a CONNECT the decoder refused (§4.13.1), or None to close silently.

    MQTT 5: a CONNACK with the error's reason code when CONNACK may carry it, else 0x81 (malformed).
    3.1.1 (and a client whose version is not known yet): only an unsupported protocol level gets
    an answer (return code 1); anything else closes the connection without one.
    """
    if version == 5:
        rc = reason_code if reason_code in _CONNACK_V5_CODES else ReasonCode.MALFORMED_PACKET
        return encode_connack_refusal(rc, reason, 5)
    if reason_code == ReasonCode.UNSUPPORTED_PROTOCOL_VERSION:
        return encode_connack_refusal(reason_code, "", 4)
    return None


_CONNACK_V5_CODES = frozenset({0x80, 0x81, 0x82, 0x83, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90,
                               0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F})
