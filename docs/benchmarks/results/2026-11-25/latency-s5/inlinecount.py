import sys, time, atexit, collections
import lmqtt.store.dispatch as D
orig = D.DispatchService.try_inline
c = collections.Counter()
def try_inline(self):
    r = orig(self); c[r] += 1; return r
D.DispatchService.try_inline = try_inline
import lmqtt.lightqueue.index as I
of = I.LightQueueIndex.flush
ft = []
def flush(self):
    t = time.perf_counter(); of(self); ft.append(time.perf_counter() - t)
I.LightQueueIndex.flush = flush
atexit.register(lambda: open(sys.argv.pop() if False else "/tmp/latency5/inline-" + __import__("os").environ["TAG"] + ".txt", "w").write(
    f"inline ok {c[True]} refused {c[False]} ({100*c[False]/max(1,sum(c.values())):.2f} %); index flush ms: " + " ".join(f"{x*1000:.1f}" for x in ft) + "\n"))
sys.argv = ["lmqtt", "serve"] + sys.argv[1:]
from lmqtt.gateway.cli import main
sys.exit(main())
