"""No-I/O Python data source over the lmqtt schema with/without columns: JVM/worker CPU per 1M rows."""
import os, sys, time, json
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
import pyarrow as pa
from pyspark.sql import SparkSession, functions as F
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
sys.path.insert(0, "/work/main")
from lmqtt.loadtest.spark_bench import _spark_cpu

FULL = ("topic string, payload binary, qos int, retain boolean, client_id string, "
        "user_properties map<string,string>, content_type string, born_ts timestamp, "
        "store_ts timestamp, msg_id string, queue string, offset long")
N = 16384
ts = pa.timestamp("us", tz="UTC")
cols = {
 "topic": pa.array([f"fhist/d{i%10*10}/temp" for i in range(N)]),
 "payload": pa.array([os.urandom(100) for _ in range(N)], pa.binary()),
 "qos": pa.array([1]*N, pa.int32()), "retain": pa.array([False]*N),
 "client_id": pa.array([""]*N), "user_properties": pa.array([[]]*N, pa.map_(pa.string(), pa.string())),
 "content_type": pa.array([None]*N, pa.string()),
 "born_ts": pa.array(list(range(N)), pa.int64()).cast(ts), "store_ts": pa.array(list(range(N)), pa.int64()).cast(ts),
 "msg_id": pa.array([f"{i:032X}" for i in range(N)]), "queue": pa.array(["fhist:0"]*N),
 "offset": pa.array(list(range(N)), pa.int64())}
pa.RecordBatch.from_arrays(list(cols.values()), names=list(cols))  # check

class R(DataSourceReader):
    def __init__(s, o): s.o = o
    def partitions(s):
        n, rows = int(s.o["partitions"]), int(s.o["rows"])
        return [InputPartition(rows // n) for _ in range(n)]
    def read(s, p):
        names = s.o["cols"].split(",")
        b = pa.RecordBatch.from_arrays([cols[c] for c in names], names=names)
        left = p.value
        while left > 0:
            x = b if left >= N else b.slice(0, left)
            left -= x.num_rows
            yield x
class Src(DataSource):
    @classmethod
    def name(cls): return "hotcols"
    def schema(s):
        names = s.options["cols"].split(",")
        return ", ".join(d for d in FULL.split(", ") if d.split()[0] in names)
    def reader(s, schema): return R(s.options)

spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
         .config("spark.sql.session.timeZone", "UTC").config("spark.driver.memory", "4g").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
spark.dataSource.register(Src)
allc = [d.split()[0] for d in FULL.split(", ")]
variants = {"all": allc, "no_user_properties": [c for c in allc if c != "user_properties"],
            "no_payload": [c for c in allc if c != "payload"],
            "no_strings": ["qos", "retain", "born_ts", "store_ts", "offset"],
            "no_props_no_payload": [c for c in allc if c not in ("user_properties", "payload")]}
rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
for rnd in range(2):
  for name, vc in variants.items():
    df = spark.read.format("hotcols").option("cols", ",".join(vc)).option("rows", rows).option("partitions", 4).load()
    hc = [c for c in vc if c != "user_properties"]
    aggs = [F.count(F.lit(1)).alias("n"), F.sum(F.hash(*hc)).alias("h")]
    if "user_properties" in vc: aggs.append(F.sum(F.size("user_properties")))
    res = []
    for _ in range(3):
        j0, w0 = _spark_cpu(spark); t0 = time.perf_counter()
        r = df.select(*aggs).collect()[0]
        el = time.perf_counter() - t0; j1, w1 = _spark_cpu(spark)
        assert r["n"] == rows
        res.append((round(el, 3), round(j1 - j0, 2), round(w1 - w0, 2)))
    best = min(res)
    print(json.dumps({"round": rnd, "variant": name, "rows": rows, "runs (s, jvm cpu, py cpu)": res,
                      "rows_per_s": round(rows / best[0]), "load": open("/proc/loadavg").read().split()[0]}), flush=True)
spark.stop()
