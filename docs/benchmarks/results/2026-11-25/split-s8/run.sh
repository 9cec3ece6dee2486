#!/bin/bash
# alternated before/after store bench, bounded: 4 runs
cd /tmp
for i in 1 2; do
  for w in before after; do
    echo "=== $w run $i load $(cut -d' ' -f1 /proc/loadavg)" >> /tmp/split_bench.out
    PYTHONPATH=/tmp/split_$w timeout 300 lmqtt bench store --duration 5 --sizes 100 --no-baseline --modes async,sync >> /tmp/split_bench.out 2>&1
  done
done
echo DONE >> /tmp/split_bench.out
