"""Compression of cold segments: zstd when the environment has it (the `zstandard` package, else
pyarrow's zstd codec), else zlib. The codec is recorded per object in the manifest, so a tier
written with one codec stays readable when the node later has another."""
from __future__ import annotations

import zlib

try:                                   # pragma: no cover - depends on the environment
    import zstandard as _zstd          # type: ignore
except ImportError:                    # pragma: no cover
    _zstd = None

try:
    import pyarrow as _pa              # type: ignore
    _PA_ZSTD = _pa.Codec.is_available("zstd")
except Exception:                      # noqa: BLE001 - any import trouble: not available
    _pa = None
    _PA_ZSTD = False

EXT = {"zstd": ".zst", "zlib": ".zz", "none": ".seg"}


def zstd_available() -> bool:
    return _zstd is not None or _PA_ZSTD


def zstd_provider() -> str | None:
    if _zstd is not None:
        return "zstandard"
    if _PA_ZSTD:
        return "pyarrow"
    return None


def choose(codec: str) -> str:
    if codec == "auto":
        return "zstd" if zstd_available() else "zlib"
    if codec == "zstd" and not zstd_available():
        raise ValueError("tier codec zstd asked for, but neither the zstandard package nor pyarrow's zstd "
                         "codec is installed (pip install zstandard), or use zlib")
    return codec


def compress(codec: str, data) -> bytes:
    if codec == "zstd":
        if _zstd is not None:
            return _zstd.ZstdCompressor(level=3).compress(data)
        return _pa.Codec("zstd", compression_level=3).compress(data).to_pybytes()
    if codec == "zlib":
        return zlib.compress(data, 1)
    if codec == "none":
        return bytes(data)
    raise ValueError(f"unknown tier codec {codec!r}")


def decompress(codec: str, data: bytes, size: int) -> bytes:
    """`size`: the raw length the manifest recorded (checked by the caller)."""
    if codec == "zstd":
        if _zstd is not None:
            return _zstd.ZstdDecompressor().decompress(data, max_output_size=size)
        if not _PA_ZSTD:
            raise ValueError("this tier object is zstd-compressed and this node has no zstd codec "
                             "(pip install zstandard)")
        return _pa.Codec("zstd").decompress(data, decompressed_size=size).to_pybytes()
    if codec == "zlib":
        return zlib.decompress(data)
    if codec == "none":
        return data
    raise ValueError(f"unknown tier codec {codec!r}")
