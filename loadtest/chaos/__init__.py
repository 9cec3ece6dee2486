"""`lmqtt bench chaos`: faults (kill -9, SIGSTOP/SIGCONT, disk full) injected into lmqtt serve,
serve --workers 2, a fleet and Mosquitto under mixed MQTT / SDK / POP load, every message accounted
for by one loss checker (checker.py). docs/loadtest.md "lmqtt bench chaos"."""
