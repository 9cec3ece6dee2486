#!/bin/bash
cd /tmp
for i in 1 2 3; do
  for w in before after; do
    echo "=== $w run $i load $(cut -d' ' -f1 /proc/loadavg)" >> /tmp/split_bench2.out
    PYTHONPATH=/tmp/split_$w timeout 120 lmqtt bench store --duration 5 --sizes 100 --no-baseline --modes async --batch 1 --writers 0 >> /tmp/split_bench2.out 2>&1
  done
done
echo DONE >> /tmp/split_bench2.out
