"""lmqtt notify package."""
