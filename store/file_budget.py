"""The store's share of the process's open files (`--max-open-files`), and how it is spent.

A broker's descriptors go to two users that must not starve each other: the store's files (the
CommitLog's mapped segments, the RocksDB databases' table files, index and timer files) and the
clients' sockets. Without a bound the store's grew with the number of topics (a file per topic)
and with the retention (a mapped file per CommitLog segment), until a busy broker could not open
a file nor accept a socket, and could not restart either.

So the store holds at most `total` descriptors whatever the topics and the retention:
- each RocksDB database (ConsumeQueue, light queues, their metadata, the SDK's metadata) keeps at
  most `rocksdb_tables` table files open (RocksDB's max_open_files; it reopens others on demand);
- at most `commitlog_maps` CommitLog segments stay mapped (each mapping holds a descriptor):
  idle sealed ones are unmapped and mapped again when read (MappedFileQueue.release_idle);
- at most `index_maps` key index files stay mapped, likewise;
- the rest covers the files written now (the segment being written, index and timer files,
  checkpoints written and closed at once) and each database's own few (log, manifest, lock).
The gateway sharing the process admits client connections up to what is left
(`client_connections`), refusing the next ones cleanly (CONNACK 0x97) instead of failing the
store's next open with EMFILE.
"""
from __future__ import annotations

import resource
from dataclasses import dataclass

MIN_SHARE = 128          # below this a store cannot keep its own files open
MAX_DEFAULT_SHARE = 4096  # the default share never takes more than this from the sockets
RESERVE = 64             # listening sockets, the metrics/console server, logs, short-lived opens
DATABASES = 4            # RocksDB databases in a store node (ConsumeQueue, light queues, metadata, SDK metadata)


def process_limit() -> int:
    """The soft limit on open files of this process (RLIMIT_NOFILE)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def default_share(limit: int, with_clients: bool = True) -> int:
    """The store's default share of a process limit of `limit` descriptors: a quarter when client
    sockets share the process (`lmqtt serve`), half in a store node of its own, between MIN_SHARE
    and MAX_DEFAULT_SHARE, never more than the limit leaves after RESERVE."""
    share = limit // 4 if with_clients else limit // 2
    return max(MIN_SHARE, min(share, MAX_DEFAULT_SHARE, max(0, limit - RESERVE)))


@dataclass(frozen=True)
class FileBudget:
    """`total`: the store's descriptors at most; `limit`: the process limit it is a share of."""

    total: int
    limit: int

    @classmethod
    def for_process(cls, max_open_files: int = 0, with_clients: bool = True) -> "FileBudget":
        """The budget of a store in this process: `max_open_files`, or the default share (0)."""
        limit = process_limit()
        total = max_open_files if max_open_files > 0 else default_share(limit, with_clients)
        return cls(max(MIN_SHARE // 2, total), limit)

    @property
    def rocksdb_tables(self) -> int:
        """max_open_files of each RocksDB database."""
        return max(16, self.total // (2 * DATABASES))

    @property
    def commitlog_maps(self) -> int:
        """CommitLog segments mapped at once at most."""
        return max(4, self.total // 4)

    @property
    def index_maps(self) -> int:
        """Key index files mapped at once at most (each holds a descriptor, as a segment)."""
        return max(2, self.total // 16)

    def client_connections(self, refused_headroom: int) -> int:
        """Client sockets a gateway in the same process may hold: what the limit leaves after the
        store's share, the reserve and `refused_headroom` (sockets of refused clients waiting to
        be told why)."""
        return max(1, self.limit - self.total - RESERVE - refused_headroom)

    def describe(self) -> str:
        return (f"{self.total} of {self.limit} open files (RocksDB: {self.rocksdb_tables} table files per "
                f"database, CommitLog: {self.commitlog_maps} mapped segments)")
