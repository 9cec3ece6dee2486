"""Child process for tests/store/test_store_kill.py: append forever, print every acknowledged record.

usage: python store_kill_writer.py DATA_DIR MODE SEED
Prints "ready" once started, then one line per acknowledged record: "phys size sha1(body) key".
A record is printed only after its durable future resolved (sync: after the group-commit fsync).
"""
from __future__ import annotations

import hashlib
import os
import random
import sys

from lmqtt.store import Message, MessageStore, StoreConfig


def config(data_dir: str, mode: str) -> StoreConfig:
    return StoreConfig(data_dir=data_dir, segment_size=256 * 1024, max_message_size=16 * 1024, flush_mode=mode,
                       index_slots=256, index_entries=8192, cq_block_entries=1000,
                       commit_interval_ms=20, flush_interval_ms=50)


def main() -> None:
    data_dir, mode, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    st = MessageStore(config(data_dir, mode))
    st.start()
    rng = random.Random(seed)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    i = 0
    while True:
        n = rng.choice((1, 1, 3, 16))
        msgs = []
        for _ in range(n):
            msgs.append(Message(topic=f"k/{rng.randrange(3)}", body=os.urandom(rng.randrange(1, 3000)),
                                keys=(f"s{seed}-{i}",)))
            i += 1
        rs = st.append_batch(msgs)
        rs[-1].durable.result()
        out.write("".join(f"{r.phys_offset} {r.size} {hashlib.sha1(m.body).hexdigest()} {m.keys[0]}\n"
                          for r, m in zip(rs, msgs)))
        out.flush()


if __name__ == "__main__":
    main()
