"""Errors raised by the light-queue package.

Each error carries the MQTT 5 reason code the gateway should send back, so the gateway never
has to guess how to map a storage-side refusal onto the protocol.
"""
from __future__ import annotations


class LightQueueError(Exception):
    """Base class for light-queue errors."""

    reason_code: int = 0x80  # MQTT 5 "Unspecified error"


class InvalidTopicName(LightQueueError, ValueError):
    """A PUBLISH topic name breaks MQTT 3.1.1/5.0 §4.7 (reason 0x90 "Topic Name invalid")."""

    reason_code = 0x90


class InvalidTopicFilter(LightQueueError, ValueError):
    """A SUBSCRIBE filter breaks MQTT §4.7 (reason 0x8F "Topic Filter invalid")."""

    reason_code = 0x8F


class MetadataError(LightQueueError):
    """The metadata database refused a read or write (I/O error, corrupt record)."""
