"""lmqtt loadtest package."""
