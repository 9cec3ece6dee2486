"""MQTT control packets as plain dataclasses (3.1.1 and 5.0 share one shape).

Why one class per packet type for both versions: the gateway's session logic should not branch on the
protocol version for every field. Fields that only exist in MQTT 5 (properties, reason codes on acks)
default to "absent" values and are simply not written when encoding for 3.1.1.

These classes carry no encoding logic; see `encoder.py` and `decoder.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "Properties", "Will", "Connect", "ConnAck", "Publish", "PubAck", "PubRec", "PubRel", "PubComp",
    "SubscriptionRequest", "Subscribe", "SubAck", "Unsubscribe", "UnsubAck", "PingReq", "PingResp",
    "Disconnect", "Auth", "Packet",
]


@dataclass(slots=True)
class Properties:
    """Every MQTT 5 property; None (or an empty list) means "not present on the wire"."""

    payload_format_indicator: int | None = None
    message_expiry_interval: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    subscription_identifier: list[int] = field(default_factory=list)
    session_expiry_interval: int | None = None
    assigned_client_identifier: str | None = None
    server_keep_alive: int | None = None
    authentication_method: str | None = None
    authentication_data: bytes | None = None
    request_problem_information: int | None = None
    will_delay_interval: int | None = None
    request_response_information: int | None = None
    response_information: str | None = None
    server_reference: str | None = None
    reason_string: str | None = None
    receive_maximum: int | None = None
    topic_alias_maximum: int | None = None
    topic_alias: int | None = None
    maximum_qos: int | None = None
    retain_available: int | None = None
    user_property: list[tuple[str, str]] = field(default_factory=list)
    maximum_packet_size: int | None = None
    wildcard_subscription_available: int | None = None
    subscription_identifier_available: int | None = None
    shared_subscription_available: int | None = None

    def is_empty(self) -> bool:
        """True when nothing would be written on the wire (lets encoders skip work)."""
        for name in self.__slots__:
            v = getattr(self, name)
            if v is not None and v != []:
                return False
        return True


@dataclass(slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Connect:
    client_id: str
    protocol_level: int = 4  # 3 = MQTT 3.1 ("MQIsdp"), 4 = 3.1.1, 5 = 5.0
    clean_start: bool = True
    keepalive: int = 60
    username: str | None = None
    password: bytes | None = None
    will: Will | None = None
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class ConnAck:
    session_present: bool = False
    reason_code: int = 0  # MQTT 5 reason code, or the 3.1.1 return code when decoded/encoded as v4
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Publish:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class PubAck:
    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class PubRec:
    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class PubRel:
    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class PubComp:
    packet_id: int
    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class SubscriptionRequest:
    topic_filter: str
    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@dataclass(slots=True)
class Subscribe:
    packet_id: int
    subscriptions: list[SubscriptionRequest]
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class SubAck:
    packet_id: int
    reason_codes: list[int]
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Unsubscribe:
    packet_id: int
    topic_filters: list[str]
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class UnsubAck:
    packet_id: int
    reason_codes: list[int] = field(default_factory=list)  # always empty for 3.1.1
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class PingReq:
    pass


@dataclass(slots=True)
class PingResp:
    pass


@dataclass(slots=True)
class Disconnect:
    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


@dataclass(slots=True)
class Auth:
    reason_code: int = 0
    properties: Properties = field(default_factory=Properties)


Packet = (Connect | ConnAck | Publish | PubAck | PubRec | PubRel | PubComp | Subscribe | SubAck
          | Unsubscribe | UnsubAck | PingReq | PingResp | Disconnect | Auth)
