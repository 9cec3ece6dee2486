"""lmqtt lightqueue package."""
