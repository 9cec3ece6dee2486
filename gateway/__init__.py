"""lmqtt gateway package."""
