"""Small stand-ins shared by tests that drive a protocol object without a socket."""


class RecordingTransport:
    """What an asyncio Protocol sees of its transport: records what is written back (acks) and
    whether the protocol closed it — enough to feed `data_received` byte strings by hand."""

    def __init__(self):
        self.out, self.closed = bytearray(), False

    def write(self, b):
        self.out += b

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed
