"""The `lmqtt` format's options, shared by the reader (source.py), the writer (sink.py) and the
views (views.py): where the store is, how to connect to it, how a time option reads.

Why a module of its own: the reader returns the writer (`LmqttDataSource.writer`) and the writer
connects as the reader does; with these here, source.py imports sink.py and neither imports the
other back."""
from __future__ import annotations

import datetime as _dt

from lmqtt.store.client import Connection, connect

DEFAULT_STORE = "127.0.0.1:10911"


def lower(options) -> dict:
    """Spark option names are case-insensitive: one plain dict with lower-case names."""
    return {str(k).lower(): v for k, v in dict(options).items()}


def store_connection(opts: dict) -> Connection:
    """An SDK connection to the store the options name (`store`, `token`)."""
    return connect(opts.get("store") or DEFAULT_STORE, token=opts.get("token") or None,
                   client_name="lmqtt-spark")


def parse_time(v) -> int | None:
    """Epoch milliseconds (int or digits) or ISO 8601 (naive = UTC) -> epoch ms."""
    if v is None or v == "":
        return None
    if isinstance(v, (int, float)):
        return int(v)
    s = str(v).strip()
    if s.lstrip("-").isdigit():
        return int(s)
    d = _dt.datetime.fromisoformat(s.replace("Z", "+00:00"))
    if d.tzinfo is None:
        d = d.replace(tzinfo=_dt.timezone.utc)
    return int(d.timestamp() * 1000)
