"""The processes and their composition: `lmqtt serve`, `lmqtt gateway`, `serve --workers`,
configuration, metrics, the console tools."""
