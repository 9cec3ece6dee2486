"""Cold side only, one Spark session, warm, layouts alternated round by round: 10M rows like the
filter-history load (100 topics fhist/dK/{temp,hum}, 1 in 10 temp), sorted by topic; topic IN (the 10
temp topics) + the all-columns job. JVM CPU-s and wall per round."""
import json, os, sys, time
import numpy as np, pyarrow as pa, pyarrow.compute as pc, pyarrow.parquet as pq
from lmqtt.loadtest import spark_bench as sb
from lmqtt.store.spark import cold as cm
from pyspark.sql import functions as F
N = 10_000_000
d = "/tmp/spark-s6/ab2"; os.makedirs(d, exist_ok=True)
i = np.arange(N)
topics = pa.array([f"fhist/d{k % 100}/{'temp' if k % 10 == 0 else 'hum'}" for k in range(1000)]).take(pa.array(i % 1000))
ts = pa.timestamp("us", tz="UTC")
body = os.urandom(100)
t = pa.table({"topic": topics, "payload": pa.array([body] * 1000, pa.binary()).take(pa.array(i % 1000)),
              "qos": pa.array(np.zeros(N, np.int32)), "retain": pa.array(np.zeros(N, bool)),
              "client_id": pa.array([""] * 1000).take(pa.array(i % 1000)),
              "user_properties": pa.array([[]] * 1000, pa.map_(pa.string(), pa.string())).take(pa.array(i % 1000)),
              "content_type": pa.nulls(N, pa.string()),
              "born_ts": pa.array(1764000000000000 + (i // 200) * 1000, pa.int64()).cast(ts),
              "store_ts": pa.array(1764000000000000 + (i // 200) * 1000, pa.int64()).cast(ts),
              "msg_id": pc.binary_join_element_wise("7F000001A1B2C3D4", pc.utf8_upper(pc.utf8_lpad(pa.array([format(x, "x") for x in (i * 201).tolist()]), 16, "0")), ""),
              "queue": pa.array(["fhist:0"] * N), "offset": pa.array(i, pa.int64())})
ts_ = cm._by_topic(t)
variants = {"commitlog-order": (t, {}), "topic-sorted": (ts_, {}),
            "topic-sorted+pageindex8192": (ts_, dict(write_page_index=True, max_rows_per_page=8192))}
for name, (tt, kw) in variants.items():
    os.makedirs(f"{d}/{name}", exist_ok=True)
    pq.write_table(tt, f"{d}/{name}/f.parquet", compression="zstd", use_dictionary=cm.DICTIONARY_COLUMNS, row_group_size=131072, **kw)
    md = pq.read_metadata(f"{d}/{name}/f.parquet")
    sizes = {}
    for g in range(md.num_row_groups):
        for c in range(md.num_columns):
            cc = md.row_group(g).column(c); sizes[cc.path_in_schema] = sizes.get(cc.path_in_schema, 0) + cc.total_compressed_size
    print(json.dumps({"layout": name, "column_bytes": sizes}), flush=True)
del ts_
del t
spark = sb._session("local[2]", 2)
names = [f"fhist/d{k}/temp" for k in range(0, 100, 10)]
dfs = {n: spark.read.parquet(f"file://{d}/{n}").where(cm._topic_in(F.col("topic"), names)) for n in variants}
full = {n: spark.read.parquet(f"file://{d}/{n}") for n in variants}
for _ in range(3):
    for n in variants:
        sb._touch_all(dfs[n]); sb._touch_all(full[n])
res = {n: {"filter_s": [], "filter_jvm": [], "full_s": [], "full_jvm": []} for n in variants}
order = list(variants)
for r in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    for n in (order if r % 2 == 0 else order[::-1]):
        for what, df in (("filter", dfs[n]), ("full", full[n])):
            j0 = sb._spark_cpu(spark)[0]; t0 = time.perf_counter()
            x = sb._touch_all(df)
            res[n][f"{what}_s"].append(round(time.perf_counter() - t0, 3)); res[n][f"{what}_jvm"].append(round(sb._spark_cpu(spark)[0] - j0, 2))
            assert x["n"] == (1_000_000 if what == "filter" else N)
import statistics as st
for n, v in res.items():
    print(json.dumps({"layout": n, "bytes": os.path.getsize(f"{d}/{n}/f.parquet"),
                      **{k + "_median": st.median(x) for k, x in v.items()}, **v,
                      "load": open("/proc/loadavg").read().split()[0]}), flush=True)
spark.stop()
