#!/bin/sh
# $1 = namespace dir; start serve, run the latency load, per-thread CPU and switches over 8 s
NS=$1; PORT=$2
rm -rf /tmp/cpu/srv/d$PORT
PYTHONPATH=$NS python3 -m lmqtt.gateway.cli serve --host 127.0.0.1 --port $PORT --data-dir /tmp/cpu/srv/d$PORT --metrics-port 0 --max-inflight 65535 > /tmp/cpu/srv/s$PORT.log 2>&1 &
P=$!
sleep 4
lmqtt bench mqtt --broker-port $PORT --scenario latency --rate 5000 --pairs 50 --qos 1 --size 64 --duration 14 --quiet > /tmp/cpu/srv/b$PORT.json 2>&1 &
sleep 4
/tmp/cpu/thr.sh $P 8 | awk '$4+$6>0 || $8>20'
sleep 4
kill $P
python3 -c "
import json; r=json.loads(open('/tmp/cpu/srv/b$PORT.json').read().strip().splitlines()[-1]); print('cpu/msg', r['broker_cpu_us_per_msg'], 'p50', r['latency_us']['p50'], 'p99', r['latency_us']['p99'])"
