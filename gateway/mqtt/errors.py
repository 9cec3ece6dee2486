"""The single exception the codec raises.

Why one exception type: the server has exactly one reaction to undecodable input (send DISCONNECT /
CONNACK with the reason code when it can, then close), so callers catch `ProtocolError` and nothing else.
Any other exception escaping the decoder is a bug.
"""
from __future__ import annotations


class ProtocolError(Exception):
    """Input violates MQTT; `.reason_code` is the MQTT 5 reason code to report (0x81, 0x82, 0x95, ...).

    `.packets` holds the packets `Decoder.feed` had fully decoded, in the same call, before the bad
    bytes (a client's PUBLISH followed by garbage in one TCP read is still a PUBLISH the server may
    handle before closing). Empty when raised anywhere else.
    """

    def __init__(self, message: str, reason_code: int = 0x81) -> None:
        super().__init__(message)
        self.reason_code = int(reason_code)
        self.packets: list = []

    def __repr__(self) -> str:
        return f"ProtocolError({str(self)!r}, reason_code=0x{self.reason_code:02X})"
