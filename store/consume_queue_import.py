"""Import of a data dir's ConsumeQueues from the file-per-queue layout into the RocksDB one.

Until the ConsumeQueue moved into RocksDB (store/consume_queue.py), `consumequeue/` held a
directory per first-level topic (its name %-quoted, or `h_<sha1>` for a long one, with the name
in a `.topic` file), a directory per queue id in it, and memory-mapped files of 20-byte entries
named by the byte offset of their first entry; `consumequeue/checkpoint` said up to where they
were durable. A store opening such a data dir reads those files once, writes their entries into
the database, and removes the directory (store/consume_queue.py `load`): nothing is re-dispatched
for a queue whose name is known, so history the local CommitLog no longer holds (the tier's)
stays readable by topic. A queue whose name is lost (no `.topic`, a hashed directory name) is
rebuilt by replaying the CommitLog from its first entry still in the local log.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Callable, Iterator
from urllib.parse import quote, unquote

from .checkpoint import OffsetCheckpoint

log = logging.getLogger("lmqtt.store")

OLD_DIR = "consumequeue"
_EMPTY_LEVEL_DIR = "%empty"          # the queues of the first level '' (topics starting with '/')
_UNNAMED_MARK = "%unnamed"           # a queue directory set aside by an older version
_HASHED = re.compile(r"h_[0-9a-f]{40}")
_ENTRY = 20


def _dir_name(topic: str) -> str:
    """The old layout's directory name of a first-level topic."""
    if not topic:
        return _EMPTY_LEVEL_DIR
    name = quote(topic, safe="")
    if name.startswith("."):
        name = "%2E" + name[1:]
    return name


def _topic_of(tdir: str, dname: str) -> str | None:
    """The first-level topic of a topic directory: its `.topic`, else its (reversible) name."""
    if dname == _EMPTY_LEVEL_DIR:
        return ""
    try:
        with open(os.path.join(tdir, ".topic"), "rb") as f:
            topic = f.read().decode("utf-8")
        if topic and (_dir_name(topic) == dname or dname.startswith("h_")):
            return topic
    except (OSError, UnicodeDecodeError):
        pass
    if _HASHED.fullmatch(dname):
        return None
    topic = unquote(dname)
    return topic if topic and _dir_name(topic) == dname else None


def _queue_files(qdir: str) -> list[tuple[int, str]]:
    names = sorted(n for n in os.listdir(qdir) if len(n) == 20 and n.isdigit())
    return [(int(n), os.path.join(qdir, n)) for n in names]


def _written(data: bytes) -> int:
    """How many entries from the start of a file are written (entries fill a file from its
    start; an unwritten one has size 0). Binary search, as the old layout's load did."""
    lo, hi = 0, len(data) // _ENTRY
    while lo < hi:
        mid = (lo + hi) // 2
        if int.from_bytes(data[mid * _ENTRY + 8:mid * _ENTRY + 12], "little"):
            lo = mid + 1
        else:
            hi = mid
    return lo


def _read_queue(qdir: str) -> tuple[int, int, list[tuple[int, bytes]]]:
    """(min_offset, max_offset, [(first qoff, entries)]) of one old queue directory."""
    files = _queue_files(qdir)
    if not files:
        return 0, 0, []
    pieces = []
    for i, (start, path) in enumerate(files):
        with open(path, "rb") as f:
            data = f.read()
        if i == len(files) - 1:
            data = data[:_written(data) * _ENTRY]
        if data:
            pieces.append((start // _ENTRY, data))
    lo = files[0][0] // _ENTRY
    hi = pieces[-1][0] + len(pieces[-1][1]) // _ENTRY if pieces else files[-1][0] // _ENTRY
    return lo, hi, pieces


def import_file_queues(root: str, put_queue: Callable[[str, int, int, int, Iterator[tuple[int, bytes]]], None],
                       log_min: int) -> int:
    """Read every queue of the old layout under `root` into `put_queue(fl, qid, min, max, pieces)`;
    -> the CommitLog offset the new ConsumeQueue dispatch resumes from (the old checkpoint, or the
    first local entry of a queue whose name is lost, if lower)."""
    ckpt = OffsetCheckpoint(os.path.join(root, "checkpoint")).load(0)
    resume = ckpt
    queues = 0
    for dname in sorted(os.listdir(root)):
        tdir = os.path.join(root, dname)
        if not os.path.isdir(tdir) or _UNNAMED_MARK in dname:
            continue
        if dname.isdigit():            # an older version kept the '' level's queues in the root
            qdirs = [(int(dname), tdir)]
            topic: str | None = ""
        else:
            qdirs = [(int(q), os.path.join(tdir, q)) for q in os.listdir(tdir)
                     if q.isdigit() and os.path.isdir(os.path.join(tdir, q))]
            topic = _topic_of(tdir, dname)
        for qid, qdir in qdirs:
            lo, hi, pieces = _read_queue(qdir)
            if topic is not None:
                put_queue(topic, qid, lo, hi, iter(pieces))
                queues += 1
                continue
            firsts = [int.from_bytes(p[i:i + 8], "little") for _, p in pieces
                      for i in range(0, len(p), _ENTRY) if int.from_bytes(p[i + 8:i + 12], "little")]
            local = [f for f in firsts if f >= log_min]
            if local:
                resume = min(resume, min(local))
            log.warning("consumequeue import: %s has no name left (no .topic, a hashed directory name): "
                        "%s", qdir, f"rebuilt from the CommitLog from offset {min(local)}" if local else
                        "none of its records is left in the local CommitLog, so it is not imported")
    log.info("consumequeue: %d queue(s) imported from the file-per-queue layout in %s into RocksDB; "
             "dispatch resumes at %d", queues, root, resume)
    return resume
