P=$1; D=$2
snap(){ for t in /proc/$P/task/*; do tid=$(basename $t); echo "$tid $(cat $t/comm|tr ' ' _) $(awk '{print $14, $15}' $t/stat) $(awk '/voluntary_ctxt_switches/{printf "%s ",$2}' $t/status)"; done; }
snap > /tmp/cpu/s0; sleep $D; snap > /tmp/cpu/s1
join /tmp/cpu/s0 /tmp/cpu/s1 | awk '{printf "%s %s utime %d stime %d vcs %d nvcs %d\n",$1,$2,$8-$3,$9-$4,$10-$5,$11-$6}'
