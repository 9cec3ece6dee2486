"""filter-history-cold variants on one loaded store: row-group size, page index; cold side vs hot side."""
import json, os, shutil, sys, tempfile, time
import pyarrow as pa, pyarrow.parquet as pq
from lmqtt.loadtest import spark_bench as sb
from lmqtt.store.spark import read_history
from lmqtt.store.spark import cold as cm
from pyspark.sql import functions as F

rows = int(sys.argv[1]); repeat = 4
base = tempfile.mkdtemp(prefix="spark-s6-exp-")
spark = sb._session("local[2]", 2)
proc, address, tier, log = sb._cold_store(base, 64, "fhist")
try:
    sb._load_mixed(address, rows, 100, 10)
    sb._wait_offloaded(address, 1800)
    want = len(range(0, rows, 10))
    ct = cm.ColdTier.open(f"file://{tier}")
    keys = ct.file_keys({"fhist"})
    orig = {k: open(os.path.join(tier, k), "rb").read() for k in keys}
    def rewrite(rg, page_index, max_rows_per_page=None):
        for k, data in orig.items():
            t = pq.read_table(pa.BufferReader(data))
            kw = dict(compression="zstd", use_dictionary=cm.DICTIONARY_COLUMNS, row_group_size=rg, write_page_index=page_index)
            if max_rows_per_page: kw["max_rows_per_page"] = max_rows_per_page
            tmp = os.path.join(tier, k + ".x")
            pq.write_table(t, tmp, **kw)
            os.replace(tmp, os.path.join(tier, k))
    def measure(name):
        out = {"variant": name}
        for what in ("read_history", "cold_only", "hot_only"):
            ts, cpu = [], []
            for _ in range(repeat):
                j0 = sb._spark_cpu(spark)[0]; t0 = time.perf_counter()
                if what == "read_history":
                    df = read_history(spark, store=address, tier=f"file://{tier}", filter="fhist/+/temp", recordsPerPartition=250000)
                    n = want
                elif what == "cold_only":
                    c = cm.ColdTier.open(f"file://{tier}")
                    names = c.matching_topics(keys, "fhist/+/temp")[0]
                    df = spark.read.parquet(*[f"file://{tier}/{k}" for k in keys]).where(cm._topic_in(F.col("topic"), names))
                    n = None
                else:
                    c = cm.ColdTier.open(f"file://{tier}")
                    df = (spark.read.format("lmqtt").option("store", address).option("filter", "fhist/+/temp")
                          .option("recordsPerPartition", "250000").option("fromPosition", str(c.cut)).load())
                    n = None
                r = sb._touch_all(df)
                ts.append(round(time.perf_counter() - t0, 3)); cpu.append(round(sb._spark_cpu(spark)[0] - j0, 2))
                if n is not None: assert r["n"] == n, (r["n"], n)
            out[what] = {"best_s": min(ts), "runs_s": ts, "jvm_cpu_s": cpu, "rows": r["n"]}
        out["load"] = open("/proc/loadavg").read().split()[0]
        print(json.dumps(out), flush=True)
    measure("as-written (row groups 131072)")
    rewrite(131072, True)
    measure("131072 + page index")
    rewrite(131072, True, 8192)
    measure("131072 + page index, 8192 rows/page")
    rewrite(32768, False)
    measure("32768")
finally:
    proc.terminate(); proc.wait(30); log.close(); spark.stop(); shutil.rmtree(base, ignore_errors=True)
