"""The gateway's state objects, shared by the core and the delivery flow: Session (subscriptions,
cursors, the QoS 1/2 in-flight window), shared groups, the MQTT metadata kept in a record's props."""
