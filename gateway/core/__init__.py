"""The protocol core of one gateway: the Broker's per-packet decisions, the SUBSCRIBE handler,
the session and subscription registries, session persistence, limits, $SYS."""
