"""The gateway and the systems around it (docs/integrations.md): events to a webhook and as
`$events/...` records, bridges to other MQTT brokers, wired beside the broker by `wiring.py`.
The HTTP auth service and the live users and ACL rules are security's (gateway/security/)."""
