"""The session machine's inbound side: the client's PUBLISH (QoS 1/2 duplicates, Receive Maximum,
topic aliases), the store's answer to its append, and PUBREL.

Inbound QoS 2 exactly once: an id is "waiting" from the PUBLISH until the store has appended the
message (a PUBLISH sent again meanwhile is ignored: its PUBREC follows), then "stored" until the
PUBREL (a PUBLISH sent again is answered with PUBREC, not stored twice: MQTT-4.3.3-9 method B). A
persistent session's id is written to its record before the append, with the unique key the
message carries (`write_ahead`): a crash between the append and the record saying "stored" is
settled when the record is read back (the store looks the key up in its log).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from lmqtt.gateway.mqtt import ProtocolError, ReasonCode as RC, encode, packets as P

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.session.machine import MqttSession

# what `publish_received` says of a QoS 1/2 PUBLISH
ACCEPT = 0        # a new message: append it (its id now waits for the store)
DUPLICATE = 1     # a QoS 2 message stored already, PUBREL not received: PUBREC again, nothing stored
PENDING = 2       # its id waits for the store already (sent again): its ack follows, nothing to do

NO_TOPIC_ALIASES: dict = {}    # never written: the inbound topic aliases of a client that set none


class Inbound:
    """The inbound half of `MqttSession` (a mixin: the fields are the session's slots)."""

    __slots__ = ()

    def publish_received(self: "MqttSession", qos: int, pid: int, receive_maximum: int) -> int:
        """A QoS 1/2 PUBLISH with packet id `pid`: ACCEPT, DUPLICATE or PENDING. More than
        `receive_maximum` (ours, in CONNACK) QoS 1/2 publishes unacknowledged from an MQTT 5
        client is a protocol error (0x93, MQTT-3.3.4-9)."""
        wait = self._in_wait
        if qos == 2:
            in2 = self._in2
            if in2 and pid in in2:
                return DUPLICATE
        if wait is not None and pid in wait:
            return PENDING
        if self.version == 5:
            n = (len(wait) if wait else 0) + (len(self._in2) if self._in2 else 0)
            if n >= receive_maximum:
                raise ProtocolError(f"more than Receive Maximum ({receive_maximum}) QoS 1/2 "
                                    "publishes unacknowledged", RC.RECEIVE_MAXIMUM_EXCEEDED)
        if wait is None:
            wait = self._in_wait = set()
        wait.add(pid)
        return ACCEPT

    def pubrec(self: "MqttSession", pid: int) -> bytes:
        """The PUBREC of an inbound QoS 2 message (answered again to a DUPLICATE)."""
        return encode(P.PubRec(pid), self.version)

    def write_ahead(self: "MqttSession", pid: int, topic: str, key: str, ms: int) -> None:
        """A persistent session's new QoS 2 message will be appended carrying `key`: its id goes
        into the session's record as written ahead (the driver writes the record before the append)."""
        keys = self._in_keys
        if keys is None:
            keys = self._in_keys = {}
        keys[pid] = (topic, key, ms)

    def written_ahead(self: "MqttSession", pid: int) -> tuple[str, str, int] | None:
        """(topic, key, ms) of `pid` written ahead and not known as stored: a restored session's
        id the store did not find in its log. Its PUBLISH sent again reuses the key."""
        keys = self._in_keys
        return keys.get(pid) if keys else None

    def publish_stored(self: "MqttSession", qos: int, pid: int) -> bool:
        """The store appended (durably) the client's QoS 1/2 message `pid`: its PUBACK / PUBREC is
        due. True: a QoS 2 id of a persistent session, whose PUBREC leaves only once the session's
        record says "stored" (`after_record`); False: the ack goes now."""
        wait = self._in_wait
        if wait:
            wait.discard(pid)
        if qos != 2:
            return False
        in2 = self._in2
        if in2 is None:
            in2 = self._in2 = set()
        in2.add(pid)
        self._forget_key(pid)
        return self.expiry_interval > 0

    def publish_failed(self: "MqttSession", pid: int) -> None:
        """The append of message `pid` failed (refused, the store failed, its record not written
        ahead): its id no longer waits; the client's PUBLISH sent again is appended again. A key
        written ahead is kept for it: an append that failed with an error may still have reached
        the log (a connection lost after the PRODUCE left, a full disk after the record), and the
        same key makes a store over the native protocol keep one record (store/unique_keys.py)."""
        wait = self._in_wait
        if wait:
            wait.discard(pid)

    def _forget_key(self: "MqttSession", pid: int) -> None:
        """`pid`'s written-ahead key is not needed any more (stored, or not stored at all)."""
        keys = self._in_keys
        if keys:
            keys.pop(pid, None)
            if not keys:
                self._in_keys = None

    def publish_refused_stored(self: "MqttSession", pid: int) -> None:
        """An MQTT 3.1.1 QoS 2 PUBLISH refused by the ACL: acknowledged (3.1.1 has no negative
        PUBREC) and dropped; its id is known as stored so that the PUBREL that follows is answered."""
        in2 = self._in2
        if in2 is None:
            in2 = self._in2 = set()
        in2.add(pid)

    def pubrel_received(self: "MqttSession", pid: int) -> tuple[bytes, bool]:
        """PUBREL: (PUBCOMP, after_record). A stored id is forgotten (MQTT-4.3.3-11: a PUBLISH with
        it is a new message from now on); for a persistent session the PUBCOMP leaves once its
        record no longer holds the id (`after_record` True). An unknown id: PUBCOMP 0x92 (MQTT 5)."""
        in2 = self._in2
        if in2 and pid in in2:
            in2.discard(pid)
            return encode(P.PubComp(pid), self.version), self.expiry_interval > 0
        return encode(P.PubComp(pid, RC.PACKET_IDENTIFIER_NOT_FOUND if self.version == 5 else 0), self.version), False

    def inbound_quiet(self: "MqttSession") -> bool:
        """No QoS 1/2 message of the client waits for the store."""
        return not self._in_wait

    def inbound_ids(self: "MqttSession") -> tuple[frozenset, frozenset]:
        """(ids waiting for the store, ids stored awaiting PUBREL): copies, for readers."""
        return frozenset(self._in_wait or ()), frozenset(self._in2 or ())

    # -- MQTT 5 topic aliases from the client ---------------------------------------------------
    def resolve_alias(self: "MqttSession", topic: str, alias: int, maximum: int) -> str:
        """The topic of a PUBLISH carrying a topic alias (§3.3.2.3.4): with a topic it sets the
        alias (for this network connection only: `connect` forgets them), with an empty topic it
        uses it. Alias 0 or above our CONNACK Topic Alias Maximum: 0x94 (MQTT-3.3.2-8, -9); an
        alias never set: protocol error."""
        if not 0 < alias <= maximum:
            raise ProtocolError(f"topic alias {alias} is outside 1..{maximum} "
                                "(the Topic Alias Maximum in CONNACK)", RC.TOPIC_ALIAS_INVALID)
        if topic:
            aliases = self._aliases_in
            if aliases is NO_TOPIC_ALIASES:
                aliases = self._aliases_in = {}
            aliases[alias] = topic
            return topic
        t = self._aliases_in.get(alias)
        if t is None:
            raise ProtocolError(f"topic alias {alias} was never set on this connection", RC.PROTOCOL_ERROR)
        return t
