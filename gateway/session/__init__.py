"""The MQTT session machine (sans-IO, after h11's `_state.py`): `MqttSession` and the types it
holds. gateway/session/machine.py says what goes in and what comes out; docs/session.md lists the
rules of the specifications it keeps, each with its test."""
from __future__ import annotations

from lmqtt.gateway.session.inbound import ACCEPT, DUPLICATE, PENDING
from lmqtt.gateway.session.machine import NEVER_EXPIRES, NO_ALIASES, MqttSession
from lmqtt.gateway.session.messages import (EXPIRED, RUN_FLUSH_FIRST, RUN_FLUSH_MAX, TOO_LARGE, InFlight,
                                            OutboundMessage, RetainedMessage)
from lmqtt.gateway.session.outbound import OVER, QOS2_SENT, Counts, Tally
from lmqtt.gateway.session.parked import ParkedSession, fold, unfold
from lmqtt.gateway.session.subscriptions import ClientSubscription, Cursor

__all__ = ["MqttSession", "ParkedSession", "fold", "unfold", "InFlight", "OutboundMessage", "RetainedMessage",
           "ClientSubscription", "Cursor", "Counts", "Tally", "NEVER_EXPIRES", "NO_ALIASES", "EXPIRED",
           "TOO_LARGE", "OVER", "QOS2_SENT", "ACCEPT", "DUPLICATE", "PENDING", "RUN_FLUSH_FIRST", "RUN_FLUSH_MAX"]
