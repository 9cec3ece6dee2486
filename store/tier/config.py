"""`TierConfig`: where sealed CommitLog segments go and how long they are kept (docs/store.md "Tiered storage").

Retention values are durations (`90s`, `30m`, `72h`, `30d`, `500ms`, a bare number = seconds),
sizes (`512MB`, `20GiB`, a bare number with a unit only) or both, comma-separated
(`72h,20GB`: whichever is reached first). `0` means "as soon as possible" (local: delete a
segment once the tier holds it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_DUR = {"ms": 1, "s": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 7 * 86_400_000}
_SIZE = {"b": 1, "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
         "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "k": 1 << 10, "m_": 1 << 20}
_PART = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_retention(text: str | int | float | None, what: str) -> tuple[int | None, int | None]:
    """`text` -> (milliseconds or None, bytes or None). ValueError naming `what` when unreadable."""
    if text is None or text == "":
        return None, None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text * 1000), None
    ms = size = None
    for part in str(text).split(","):
        m = _PART.match(part)
        if not m:
            raise ValueError(f"{what}: {part.strip()!r} is not a duration (72h, 30d, 90s) or a size (20GB)")
        num, unit = float(m.group(1)), m.group(2).lower()
        if unit in ("", *_DUR):
            if ms is not None:
                raise ValueError(f"{what}: two durations in {text!r}")
            ms = int(num * _DUR.get(unit, 1000))
        elif unit in _SIZE:
            if size is not None:
                raise ValueError(f"{what}: two sizes in {text!r}")
            size = int(num * _SIZE[unit])
        else:
            raise ValueError(f"{what}: unknown unit {m.group(2)!r} in {text!r} (durations: ms s m h d w; "
                             f"sizes: B KB MB GB TB KiB MiB GiB TiB)")
    return ms, size


@dataclass
class TierConfig:
    """Configuration of the tier under a `MessageStore` (`MessageStore.enable_tier`)."""

    # fsspec URL: file:///mnt/cold/lmqtt, s3://bucket/prefix, any other fsspec backend
    url: str
    # S3-compatible servers (MinIO, Ceph, moto ...): their endpoint, e.g. http://127.0.0.1:9000.
    # Credentials come from the usual AWS places (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY ...).
    endpoint: str | None = None
    # kept on the node's disk once uploaded (None: the store's retention applies to local files)
    local_retention_ms: int | None = 24 * 3600 * 1000
    local_retention_bytes: int | None = None
    # kept in the tier (None: forever); past it a segment is gone from the tier and from the node
    tier_retention_ms: int | None = 60 * 24 * 3600 * 1000   # > the longest delay (40 d) of a delayed message
    tier_retention_bytes: int | None = None
    # decompressed segments kept in memory for reads of offloaded ranges (at least one segment)
    cache_bytes: int = 256 << 20
    # how often the uploader looks for sealed segments (and retries after a failure, backing off
    # up to 30 s)
    upload_interval_ms: int = 1000
    # "zstd" (python zstandard, or pyarrow's zstd codec), "zlib", "none"; "auto": the first available
    codec: str = "auto"
    # further fsspec storage options (s3fs: key, secret, client_kwargs ...)
    storage_options: dict = field(default_factory=dict)
    # timeouts of one object operation against the tier (seconds)
    timeout_s: float = 20.0
    # Parquet compaction (with a columnar hook, --tier-parquet): a partition's (first-level topic,
    # day) files smaller than half of `parquet_file_bytes` are merged, in offset order, into files
    # of up to `parquet_file_bytes`, once `parquet_merge_files` of them follow each other, or once
    # the newest of them is `parquet_merge_after_ms` old (nothing more is coming soon)
    parquet_file_bytes: int = 128 << 20
    parquet_merge_files: int = 8
    parquet_merge_after_ms: int = 60_000

    @classmethod
    def from_flags(cls, url: str, endpoint: str | None = None, local_retention: str | None = None,
                   tier_retention: str | None = None, cache_mb: int | None = None,
                   parquet_file_mb: int | None = None, parquet_merge_after_s: float | None = None,
                   **kw) -> "TierConfig":
        """From the command-line / config-file strings (`--tier`, `--tier-endpoint`,
        `--local-retention`, `--tier-retention`, `--tier-cache-mb`, `--tier-parquet-file-mb`,
        `--tier-parquet-merge-after-s`)."""
        c = cls(url=url, endpoint=endpoint or None, **kw)
        if parquet_file_mb is not None:
            c.parquet_file_bytes = int(parquet_file_mb) << 20
        if parquet_merge_after_s is not None:
            c.parquet_merge_after_ms = int(float(parquet_merge_after_s) * 1000)
        if local_retention not in (None, ""):
            c.local_retention_ms, c.local_retention_bytes = parse_retention(local_retention, "--local-retention")
        if tier_retention not in (None, ""):
            if str(tier_retention).strip().lower() in ("forever", "none", "inf"):
                c.tier_retention_ms = c.tier_retention_bytes = None
            else:
                c.tier_retention_ms, c.tier_retention_bytes = parse_retention(tier_retention, "--tier-retention")
        if cache_mb is not None:
            c.cache_bytes = int(cache_mb) << 20
        c.validate()
        return c

    def validate(self) -> None:
        if not isinstance(self.url, str) or "://" not in self.url:
            raise ValueError(f"--tier must be a URL such as file:///mnt/cold/lmqtt or s3://bucket/prefix, "
                             f"got {self.url!r}")
        if self.codec not in ("auto", "zstd", "zlib", "none"):
            raise ValueError(f"tier codec must be auto, zstd, zlib or none, got {self.codec!r}")
        for name in ("local_retention_ms", "local_retention_bytes", "tier_retention_ms", "tier_retention_bytes"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name} must not be negative, got {v}")
        if self.cache_bytes <= 0:
            raise ValueError(f"the tier read cache must be positive, got {self.cache_bytes} bytes")
        if self.parquet_file_bytes < (1 << 20):
            raise ValueError(f"--tier-parquet-file-mb must be at least 1, got {self.parquet_file_bytes >> 20}")
        if self.parquet_merge_after_ms < 0 or self.parquet_merge_files < 2:
            raise ValueError("--tier-parquet-merge-after-s must not be negative (and parquet_merge_files at least 2)")


PARQUET_MODES = ("auto", "on", "off")


def parquet_problem(mode: str | None) -> str | None:
    """None when `--tier-parquet mode` can work in this environment, else why not (one line):
    `on` needs pyarrow (the Parquet writer, lmqtt.store.tier.parquet); `auto` turns itself off
    without it."""
    if mode not in PARQUET_MODES:
        return f"--tier-parquet must be auto, on or off, got {mode!r}"
    if mode != "on":
        return None
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        return (f"--tier-parquet on needs pyarrow, which is not importable here ({e}): "
                f"pip install 'lmqtt[spark]', or --tier-parquet auto/off")
    return None


def check_tier(url: str, endpoint: str | None = None, local_retention: str | None = None,
               tier_retention: str | None = None, parquet: str | None = "auto") -> TierConfig:
    """Everything about the tier flags that can be checked before the store starts: the URL's form
    and its fsspec backend (installed?), the endpoint's use, the retention values, `--tier-parquet
    on`'s pyarrow. ValueError with one line naming the flag otherwise."""
    c = TierConfig.from_flags(url, endpoint, local_retention, tier_retention)
    problem = parquet_problem(parquet if parquet is not None else "auto")
    if problem:
        raise ValueError(problem)
    proto = url.split("://", 1)[0].lower()
    if endpoint and proto not in ("s3", "s3a"):
        raise ValueError(f"--tier-endpoint is for s3:// tiers, not {proto}://")
    try:
        import fsspec  # optional: a tiered store only (the tier extra)
    except ImportError:
        raise ValueError("--tier needs fsspec (and s3fs for s3://): pip install 'lmqtt[tier]'") from None
    try:
        fsspec.get_filesystem_class(proto)
    except ImportError as e:
        raise ValueError(f"--tier {url}: the {proto}:// backend is not installed ({e}); for s3://: "
                         f"pip install 'lmqtt[tier]'") from None
    except ValueError:
        raise ValueError(f"--tier {url}: unknown protocol {proto!r} (file://, s3://, or another fsspec "
                         f"backend)") from None
    return c
