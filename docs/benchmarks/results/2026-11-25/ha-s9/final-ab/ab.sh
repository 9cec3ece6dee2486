#!/bin/bash
# usage: ab.sh OUT A B [rounds]: alternate `lmqtt bench ha --cases append-replicated` between snapshots /tmp/hab/A and /tmp/hab/B
out=$1; a=$2; b=$3; n=${4:-3}; mkdir -p $out
for i in $(seq 1 $n); do
  for v in $a $b; do
    echo "run $i $v start $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/log.txt
    (cd /tmp && PYTHONPATH=/tmp/hab/$v timeout 400 python3 -m lmqtt.loadtest.ha_bench --cases append-replicated --flush-modes sync --messages 1000000 > $out/$v-$i.jsonl 2> $out/$v-$i.err)
  done
done
echo "done $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" >> $out/log.txt
