"""Bytes on sockets: the MQTT connection (asyncio.Protocol), WebSocket, TLS."""
