"""The broker of one gateway: `Broker`, the protocol's decision table (what happens on each packet,
start, shutdown), the connection and rate limits, and the gateway's `$SYS` values."""
