"""The store node, `lmqtt store`: the store engine, light queues and notify served over the native
protocol to SDK clients and gateways."""
