import json,sys,glob
for d in sys.argv[1:]:
    for line in open(d+"/results.jsonl"):
        r=json.loads(line)
        if r.get("scenario")!="latency": continue
        l=r["latency_us"]
        print(f'{d:22s} {r["broker"]:10s} rep{r.get("rep")} p50 {l["p50"]/1000:.3f} p99 {l["p99"]/1000:.2f} ms  cpu/msg {r["broker_cpu_us_per_msg"]:.1f} us  behind {r["behind_schedule"]}')
