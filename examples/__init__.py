"""Examples that run against a live lmqtt: a device simulator, the IoT analytics Spark job."""
