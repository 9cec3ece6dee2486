#!/bin/bash
# the session-9 A/B of replicated appends: before = 996e34c (session start), after = 5f39c06
out=/tmp/hab/alt; mkdir -p $out
for i in 1 2 3; do
  for v in before after; do
    echo "run $i $v start $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/log.txt
    (cd /tmp && PYTHONPATH=/tmp/hab/$v timeout 400 python3 -m lmqtt.loadtest.ha_bench --cases append-replicated --flush-modes sync --messages 1000000 > $out/$v-$i.jsonl 2> $out/$v-$i.err)
    echo "run $i $v end $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/log.txt
  done
done
echo done >> $out/log.txt
