"""What the store's session sweep reads: 200,000 session records of two live gateways and 10 of
a gone one in a fresh MetadataStore, then the time of one full pass (pages of 1,000) of
  decode every record (list_sessions)           - what a sweep would cost by decoding
  session_hosts                                  - the first sweep after a store start
  sessions_of_gateways({gone gateway})           - a later sweep while that gateway is away
and the slowest page of each.  Usage: python3 session_scan.py DIR"""
import shutil
import sys
import time

from lmqtt.lightqueue import MetadataStore, SessionRecord, Subscription
from lmqtt.lightqueue.records import HOST

path = sys.argv[1]
shutil.rmtree(path, ignore_errors=True)
md = MetadataStore(path)
N = 200_000
for i in range(N):
    h = "gw-gone" if i % 20000 == 0 else ("gw-a" if i % 2 else "gw-b")
    md.put_session(f"dev-{i:07d}", SessionRecord(f"dev-{i:07d}", 4, 3600, None,
                                                 [Subscription(f"d/{i}/+", 1)], {HOST: h}))


def decode_all(after):
    recs = md.list_sessions(after, 1000)
    return recs, (recs[-1].client_id if len(recs) == 1000 else None)


for name, page in (("decode every record", decode_all),
                   ("session_hosts", lambda a: md.session_hosts(a, 1000)),
                   ("sessions_of_gateways(gone)", lambda a: md.sessions_of_gateways({"gw-gone"}, a, 1000))):
    t = time.perf_counter()
    after, n, worst = None, 0, 0.0
    while True:
        t1 = time.perf_counter()
        part, after = page(after)
        worst = max(worst, time.perf_counter() - t1)
        n += len(part)
        if after is None:
            break
    print(f"{name}: {n} returned, {time.perf_counter() - t:.2f} s, slowest page {worst * 1000:.1f} ms")
md.close()
shutil.rmtree(path, ignore_errors=True)
