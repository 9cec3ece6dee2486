#!/bin/sh
# alternated A/B of hot.py: base vs new, $1 rounds, $2 messages
N=${2:-30000}
for i in $(seq 1 ${1:-4}); do
  for t in ${AB:-base new}; do echo "$t $(SRC=/tmp/cpu/$t python3 /tmp/cpu/hot.py $N)"; done
done
