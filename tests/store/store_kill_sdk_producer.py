"""Child process for tests/store/test_store_kill_sdk.py: produce batches through the SDK with a fixed
producer id; print every acknowledged message.

usage: python store_kill_sdk_producer.py ADDRESS PRODUCER_ID SEED
Prints "ready", then per acknowledged batch one line per message:
    "ack TAG MSG_ID OFFSET QUEUE_OFFSET SHA1(body)"
A batch whose send fails with a lost connection is re-sent with the SAME sequence and bytes until it
is acknowledged (the store deduplicates), bounded by 90 s per batch. Stops at "stop" on stdin (then
prints "done N" and exits 0), or after 200000 batches / 300 s.
"""
from __future__ import annotations

import hashlib
import random
import sys
import threading
import time

from lmqtt.store import protocol as W
from lmqtt.store.client import ConnectionLost, connect
from lmqtt.store.client.producer import make_props


def main() -> int:
    address, pid, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(seed)
    stop = threading.Event()

    def watch_stdin():
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()
    threading.Thread(target=watch_stdin, daemon=True).start()
    c = connect(address, reconnect_attempts=40, backoff_initial=0.05, backoff_max=0.25, timeout=30)
    p = c.producer(pid)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    props = make_props(qos=1)
    t_end = time.monotonic() + 300
    acked = retries = dups = 0
    for b in range(200_000):
        if stop.is_set() or time.monotonic() > t_end:
            break
        n = rng.choice((1, 2, 8, 32))
        msgs = []
        for i in range(n):
            tag = f"{seed}-{b}-{i}"
            msgs.append((f"ks/{rng.randrange(4)}", tag.encode() + b"|" + rng.randbytes(rng.randrange(1, 2000)),
                         (tag,), props, 0, 0))
        packed = W.encode_messages_for_produce(msgs)
        seq = p.next_sequence()
        frame = W.encode_produce(pid, seq, n, packed)
        deadline = time.monotonic() + 90
        while True:
            try:
                # no SDK-internal retry: this loop re-sends the same sequence and bytes itself
                _op, flags, body = c.call(W.OP_PRODUCE, frame, retry=False)
                rs = p._results(body)
                dups += bool(flags & 1)
                break
            except ConnectionLost as e:
                retries += 1
                if time.monotonic() > deadline:
                    print(f"batch {b} seq {seq} never acknowledged: {e}", file=sys.stderr)
                    return 1
                time.sleep(0.05)
        if len(rs) != n:
            print(f"batch {b} seq {seq}: {len(rs)} results for {n} messages (dedup window lost?)", file=sys.stderr)
            return 1
        out.write("".join(f"ack {m[2][0]} {r.msg_id} {r.offset} {r.queue_offset} {hashlib.sha1(m[1]).hexdigest()}\n"
                          for r, m in zip(rs, msgs)))
        out.flush()
        acked += n
    out.write(f"done {acked} retries {retries} duplicates {dups}\n")
    out.flush()
    c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
