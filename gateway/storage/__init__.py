"""The gateway's one seam to the store: what it asks of the store, and the implementation
over the store node's native protocol (`lmqtt gateway`)."""
