"""lmqtt store package."""
