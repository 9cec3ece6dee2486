"""`ObjectStore`: the few object operations the tier needs, over fsspec.

put() makes an object visible whole or not at all: on S3 (and S3-compatible servers) one PUT is
atomic; on a filesystem (`file://`, a mounted volume) the bytes go to `<key>.tmp-<pid>-<rand>`,
are fsynced, then renamed over the key. A process killed in between leaves only a `.tmp-` file
(`.<name>.tmp-...`: a dot file, which Spark and Hadoop skip when they list a Parquet directory),
which is never read and is removed at the next start (the tier service's sync).
"""
from __future__ import annotations

import os
import secrets
import time

TMP_MARK = ".tmp-"


class TierUnavailable(Exception):
    """The tier could not be reached or refused an operation (the message names the cause)."""


def _cause(e: BaseException) -> str:
    s = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {s}" if s else type(e).__name__


class ObjectStore:
    def __init__(self, url: str, endpoint: str | None = None, storage_options: dict | None = None,
                 timeout_s: float = 20.0) -> None:
        try:
            import fsspec  # optional: a tiered store only (the tier extra)
        except ImportError:
            raise TierUnavailable("--tier needs fsspec (and s3fs for s3://): pip install 'lmqtt[tier]'") from None
        self.url = url.rstrip("/")
        opts = dict(storage_options or {})
        proto = url.split("://", 1)[0].lower()
        if proto in ("s3", "s3a"):
            if endpoint:
                opts.setdefault("endpoint_url", endpoint)
            ck = dict(opts.pop("config_kwargs", {}) or {})
            ck.setdefault("connect_timeout", min(5.0, timeout_s))
            ck.setdefault("read_timeout", timeout_s)
            ck.setdefault("retries", {"max_attempts": 2, "mode": "standard"})
            opts["config_kwargs"] = ck
        elif endpoint:
            raise ValueError(f"--tier-endpoint is for s3:// tiers, not {proto}://")
        opts.setdefault("skip_instance_cache", True)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **opts)
        except ImportError as e:
            raise TierUnavailable(f"--tier {url}: {e} (pip install 'lmqtt[tier]')") from None
        except Exception as e:  # noqa: BLE001 - a bad URL or option: one line
            raise ValueError(f"--tier {url}: {_cause(e)}") from None
        if proto in ("s3", "s3a") and hasattr(self.fs, "retries"):
            self.fs.retries = 2       # s3fs's own retry loop on top of botocore's (default 5)
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, (tuple, list))
                                else (self.fs.protocol,)) or proto == "file"
        self.root = self.root.rstrip("/")

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def _wrap(self, what: str, key: str, fn, *args):
        try:
            return fn(*args)
        except FileNotFoundError:
            raise
        except TierUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - network, auth, bucket: one line naming the cause
            raise TierUnavailable(f"tier {what} {self.where(key)} failed: {_cause(e)}") from None

    def put(self, key: str, data: bytes) -> None:
        if self.local:
            self._wrap("write of", key, self._put_local, key, data)
        else:
            self._wrap("write of", key, self.fs.pipe_file, self.path(key), data)

    def _put_local(self, key: str, data: bytes) -> None:
        final = self.path(key)
        d = os.path.dirname(final)
        os.makedirs(d, exist_ok=True)
        tmp = os.path.join(d, f".{os.path.basename(final)}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        pause_point("tmp")
        os.replace(tmp, final)
        try:
            dfd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError:
            pass

    def get(self, key: str) -> bytes:
        """The object's bytes; FileNotFoundError when there is no such object."""
        return self._wrap("read of", key, self.fs.cat_file, self.path(key))

    def size(self, key: str) -> int:
        """The object's size in bytes; FileNotFoundError when there is no such object."""
        return int(self._wrap("size of", key, self.fs.size, self.path(key)))

    def delete(self, key: str) -> None:
        try:
            self._wrap("delete of", key, self.fs.rm_file, self.path(key))
        except FileNotFoundError:
            pass

    def list(self, prefix: str) -> list[str]:
        """Keys under `prefix/` (relative to the tier root); [] when there is none."""
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache()       # a listing cached earlier in this process is stale
        try:
            names = self._wrap("listing of", prefix, self.fs.ls, self.path(prefix), False)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            n = n if isinstance(n, str) else n.get("name", "")
            rel = n[len(self.root) + 1:] if n.startswith(self.root + "/") else n.rsplit("/", 1)[-1]
            if "/" not in rel:
                rel = f"{prefix}/{rel}"
            out.append(rel)
        return sorted(out)

    def find(self, prefix: str) -> list[str]:
        """Keys anywhere under `prefix/` (relative to the tier root); [] when there is none."""
        if hasattr(self.fs, "invalidate_cache"):
            self.fs.invalidate_cache()
        try:
            names = self._wrap("listing of", prefix, self.fs.find, self.path(prefix))
        except FileNotFoundError:
            return []
        root = self.root + "/"
        return sorted(n[len(root):] for n in names if n.startswith(root))

    def ensure(self) -> None:
        """Check the tier answers (and, for a filesystem, make the root)."""
        if self.local:
            self._wrap("creation of", "", os.makedirs, self.root, 0o755, True)
            return
        bucket = self.root.split("/", 1)[0]
        try:
            self._wrap("check of", "", self.fs.ls, bucket, False)
        except FileNotFoundError:
            raise TierUnavailable(f"tier {self.url}: the bucket {bucket!r} does not exist (create it first)") from None


def pause_point(name: str) -> None:
    """Fault injection for the crash tests (tests/tier): with LMQTT_TIER_PAUSE=<name> the uploader
    writes LMQTT_TIER_PAUSE_FILE and stops here until the test kills the process with SIGKILL."""
    if os.environ.get("LMQTT_TIER_PAUSE") != name:
        return
    marker = os.environ.get("LMQTT_TIER_PAUSE_FILE")
    if marker:
        with open(marker, "w") as f:
            f.write(name)
    while True:
        time.sleep(3600)
