"""Sans-IO MQTT 3.1.1 + 5.0 codec: bytes in, packet objects out (modelled on h11 / wsproto).

Never touches a socket and has no asyncio, so the server, the load generator and the fuzzer share it
and it can be tested exhaustively with plain bytes.

    from lmqtt.gateway.mqtt import (packets as P, Decoder, encode, ProtocolError, ReasonCode,
                                    encode_publish, PublishTemplate)

    dec = Decoder()                      # server side; version learnt from CONNECT
    for pkt in dec.feed(data): ...       # raises ProtocolError (with .reason_code) on bad input
    sock_bytes = encode(P.ConnAck(), dec.version)
"""
from __future__ import annotations

from . import packets
from .decoder import Decoder
from .encoder import (PINGREQ_HEAD, PINGRESP_BYTES, SUCCESS_ACK_HEAD, PublishTemplate, encode, encode_connack_refusal,
                      encode_malformed_connect_reply, encode_publish, encode_publish_run, encode_publish_v5_parts,
                      encode_success_acks, message_expiry_prop, subscription_identifier_props,
                      topic_alias_prop)
from .errors import ProtocolError
from .reason_codes import (CONNACK_V5_TO_V311, SUBACK_FAILURE_V311, ReasonCode,
                           connack_return_code_v311)

__all__ = [
    "packets", "ProtocolError", "ReasonCode", "CONNACK_V5_TO_V311", "SUBACK_FAILURE_V311",
    "connack_return_code_v311", "Decoder", "encode", "encode_publish", "PublishTemplate",
    "SUCCESS_ACK_HEAD", "encode_success_acks", "encode_connack_refusal", "encode_malformed_connect_reply",
    "encode_publish_run", "encode_publish_v5_parts", "subscription_identifier_props",
    "topic_alias_prop", "message_expiry_prop", "PINGREQ_HEAD", "PINGRESP_BYTES",
]
