#!/bin/bash
cd /work/main
for i in 1 2; do
  for mode in idle open; do
    rm -rf /tmp/cw/bt; mkdir -p /tmp/cw/bt
    W=""
    if [ $mode = open ]; then
      python3 /tmp/cw/watch.py /tmp/cw/bt 900 > docs/benchmarks/results/2026-11-25/console-workers-open-vs-idle/$mode$i-viewer.log 2>&1 &
      W=$!
    fi
    date -u +%FT%TZ > docs/benchmarks/results/2026-11-25/console-workers-open-vs-idle/$mode$i.started
    TMPDIR=/tmp/cw/bt timeout 900 lmqtt bench compare --brokers lmqtt-workers,mosquitto --scenarios fanin,pairs --duration 10 --quiet --out docs/benchmarks/results/2026-11-25/console-workers-open-vs-idle/$mode$i > docs/benchmarks/results/2026-11-25/console-workers-open-vs-idle/$mode$i.stdout 2>&1
    if [ -n "$W" ]; then kill $W 2>/dev/null; wait $W 2>/dev/null; fi
  done
done
echo finished > /tmp/cw/bench.done
