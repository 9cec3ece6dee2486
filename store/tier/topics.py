"""The topic lists of the tier's Parquet files in its manifest (`parquet_topics`).

With a columnar hook (store/spark/cold.py) each Parquet file's distinct topics are recorded in the
manifest when the file is written (upload) or merged (compaction), so `read_history(filter=...)`
matches a filter against them with the one manifest read it does anyway, not one footer read per
file (on S3: one or more GETs per file per query). In the manifest:

    "parquet_topics": {"lists": [[topic, ...], ...],          each distinct list once, sorted
                       "files": {key: index into lists | "many"}}

"many": the file has more than 4,096 distinct topics (its footer lists none either; a filter is
then matched row by row). A key without an entry (a tier written by an older version, which also
drops the field when it rewrites the manifest): read_history reads that file's footer. The field
names only keys some segment's "parquet" names (retention and merges drop the others).
"""
from __future__ import annotations

MANY = "many"


def encode(topics: dict, keys) -> dict | None:
    """The manifest's `parquet_topics` for the files `keys` (those with an entry in `topics`:
    key -> sorted list or MANY); None when none has one."""
    lists: list = []
    index: dict = {}
    files: dict = {}
    for k in keys:
        v = topics.get(k)
        if v is None:
            continue
        if v == MANY:
            files[k] = MANY
            continue
        t = tuple(v)
        i = index.get(t)
        if i is None:
            i = index[t] = len(lists)
            lists.append(list(t))
        files[k] = i
    return {"lists": lists, "files": files} if files else None


def decode(doc: dict) -> dict:
    """key -> sorted list of topics or MANY, from a manifest document (anything unreadable in the
    field: no entry, so the footer is read)."""
    pt = doc.get("parquet_topics")
    if not isinstance(pt, dict):
        return {}
    lists = pt.get("lists") or []
    out: dict = {}
    for k, v in (pt.get("files") or {}).items():
        if v == MANY:
            out[k] = MANY
        elif isinstance(v, int) and 0 <= v < len(lists) and isinstance(lists[v], list):
            out[k] = lists[v]
    return out
