"""The sessions this gateway holds, by client id: which exist and who owns them (takeover, expiry,
the sessions restored at start, wills) and what is kept of them in the store (session records,
committed offsets, the QoS 2 write-ahead). One session's MQTT flow state is gateway/session/."""
