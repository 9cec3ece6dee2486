"""The retained messages of the metadata store (MQTT §3.3.1.3): one key per topic, read by a
subscribe's filter as a range of keys (`RetainedMessages`, a part of `MetadataStore`).

Separate from lightqueue/metadata.py because it is its own kind of data with its own read path:
the range scan of a wildcard filter, batched as it is consumed, with its per-entry loop in C
(lightqueue/_retained.c) beside the Python reference `retained_rows_py` here. `MetadataStore`
inherits these methods; the state they use (`_db`, `_lock`, `_retained_maybe`, the write path
`_put`/`_batch`/`_write`) is the store's.
"""
from __future__ import annotations

from itertools import islice
from typing import Iterator

from rocksdict import ReadOptions

from lmqtt.store import accel

from .metadata_keys import P_RETAINED, U32, prefix_end
from .topics import is_wildcard, literal_prefix, topic_matches, validate_filter, validate_topic


class RetainedMessages:
    """The retained-message methods of `MetadataStore` (see the module docstring)."""

    # -- retained messages -------------------------------------------------------------------
    def set_retained(self, topic: str, payload: bytes, props: bytes = b"") -> None:
        """Store the retained message of `topic`; an empty payload clears it (MQTT §3.3.1.3)."""
        validate_topic(topic)
        key = P_RETAINED + topic.encode("utf-8")
        with self._lock:                  # against clear_retained_if's read-then-delete
            if not payload:
                wb = self._batch()
                wb.delete(key)
                self._write(wb)
                return
            self._retained_maybe = True      # before the write: a reader never misses it
            self._put(key, b"".join((U32.pack(len(payload)), payload, props)))

    def clear_retained_if(self, topic: str, props: bytes) -> bool:
        """Clear the retained message of `topic` if it is still the one with these `props` (a
        message found past its expiry: cleared unless a newer one replaced it meanwhile). One
        step in the store, so it needs no round trip from a remote gateway and races no
        `set_retained`. True if cleared."""
        key = P_RETAINED + topic.encode("utf-8")
        with self._lock:
            v = self._db.get(key)
            if v is None or self._decode_retained(v)[1] != props:
                return False
            wb = self._batch()
            wb.delete(key)
            self._write(wb)
            return True

    @staticmethod
    def _decode_retained(v: bytes) -> tuple[bytes, bytes]:
        (n,) = U32.unpack_from(v, 0)
        return v[4:4 + n], v[4 + n:]

    def get_retained(self, topic: str) -> tuple[bytes, bytes] | None:
        v = self._db.get(P_RETAINED + topic.encode("utf-8"))
        return None if v is None else self._decode_retained(v)

    def retained_matching(self, flt: str) -> list[tuple[str, bytes, bytes]]:
        """Retained (topic, payload, props) for every topic `flt` matches, in topic order.

        An exact filter is one point lookup; a wildcard filter scans only the key range of its
        literal prefix (`a/b/+/c` scans topics starting `a/b`), so cost follows the matching
        subtree, not the total number of retained topics. A leading wildcard scans everything.
        """
        return [m for batch in self.retained_batches(flt) for m in batch]

    def retained_batches(self, flt: str, first: int = 64, most: int = 1024) -> Iterator[list[tuple[str, bytes, bytes]]]:
        """`retained_matching` in lists read as they are consumed (`first` entries, then twice as
        many each time up to `most`); the filter is checked at once. Why: a subscriber's first
        retained messages go out while the rest of the range is still read (reading 1,000 before
        sending any delayed the first by ~0.7 ms), and a list per batch costs one step of this
        generator per batch instead of per message. `()` when no retained message was ever
        stored here (no read: a falsy answer the caller may skip)."""
        validate_filter(flt)
        if not self._retained_maybe:
            return ()
        if not is_wildcard(flt):
            r = self.get_retained(flt)
            return iter(()) if r is None else iter(([(flt, r[0], r[1])],))
        return self._retained_batches(flt, first, most)

    def _retained_batches(self, flt: str, n: int, most: int) -> Iterator[list[tuple[str, bytes, bytes]]]:
        pre = literal_prefix(flt)
        scan = P_RETAINED + pre.encode("utf-8")
        ro = ReadOptions()
        ro.set_iterate_upper_bound(prefix_end(scan))
        items = self._db.items(from_key=scan, read_opt=ro)
        # `a/b/#` matches `a/b` and every topic below it, nothing else: the key says so (no topic
        # split and compare per retained message; 1,000 on a subscribe)
        exact = bool(pre) and flt == pre + "/#"
        below = scan + b"/" if exact else None
        while True:
            rows, ended = _retained_rows(items, n, len(P_RETAINED), len(scan), below)
            if not exact:
                rows = [r for r in rows if topic_matches(flt, r[0])]
            if rows:
                yield rows
            if ended:
                return
            if n < most:
                n *= 2


def retained_rows_py(items, n: int, plen: int, klen: int, below: bytes | None) -> tuple[list, bool]:
    """Up to `n` (key, value) pairs of the retained range from the iterator `items` -> ([(topic,
    payload, props)], whether `items` ended): the pairs kept are those whose key is `klen` bytes
    long or starts with `below` (None: all); the topic is the key after its first `plen` bytes.
    Reference of the C loop in lightqueue/_retained.c (tests/lightqueue/test_retained_accel.py)."""
    rows = []
    taken = 0
    for k, v in islice(items, n):
        taken += 1
        if below is not None and len(k) != klen and not k.startswith(below):
            continue
        if len(v) < 4 or 4 + U32.unpack_from(v, 0)[0] > len(v):
            raise ValueError("retained value shorter than its length prefix")
        e = 4 + U32.unpack_from(v, 0)[0]
        rows.append((k[plen:].decode("utf-8"), v[4:e], v[e:]))
    return rows, taken < n


_retained = accel.load("lmqtt.lightqueue._retained")
_retained_rows = _retained.retained_rows if _retained is not None else retained_rows_py
