"""Disk faults for the chaos bench and the disk-full tests: a small filesystem that can be filled.

SmallDisk mounts a size-limited tmpfs (``mount -t tmpfs -o size=<n>m``) at a path; a test puts a
data dir on it, ``fill()`` takes all space but a few bytes with a filler file, ``free()`` removes
the filler so the space returns. It needs root (or CAP_SYS_ADMIN); ``can_mount_tmpfs()`` says
whether this machine allows it, for ``pytest.mark.skipif``.

There is no SlowDisk here. A slow disk would be device-mapper's ``delay`` target over a loop
device (``dmsetup create slow --table "0 <sectors> delay /dev/loopN 0 <ms>"``): on the machine this
was written on, losetup works but the kernel has no device-mapper driver (no /dev/mapper/control,
``dmsetup version`` fails "Failure to communicate with kernel device-mapper driver", no modprobe,
the module cannot be loaded from inside the container), so dm-delay cannot be set up. A FUSE
passthrough that sleeps would be the other way (/dev/fuse exists) but needs a FUSE library that is
not installed (no network to get one).
"""

from __future__ import annotations

import errno
import os
import subprocess
import tempfile

FILLER = ".lmqtt-disk-filler"


class MountError(RuntimeError):
    """The tmpfs could not be mounted (not root, or mount not permitted in this container)."""


def _mounted(path: str) -> bool:
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[1].replace("\\040", " ") == real:
                    return True
    except OSError:
        return os.path.ismount(real)
    return False


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class SmallDisk:
    """A size-limited tmpfs mounted at `path` (root needed: mount -t tmpfs -o size=...)."""

    def __init__(self, path: str, size_mb: int):
        if size_mb <= 0:
            raise ValueError(f"SmallDisk size_mb must be positive, got {size_mb}")
        self.path = os.path.realpath(path)
        self.size_mb = int(size_mb)
        self._mounted_by_us = False

    @property
    def filler(self) -> str:
        return os.path.join(self.path, FILLER)

    def mount(self) -> "SmallDisk":
        """Create `path` and mount the tmpfs there; MountError if mounting is not permitted."""
        os.makedirs(self.path, exist_ok=True)
        if _mounted(self.path):
            raise MountError(f"{self.path} is already a mount point; SmallDisk will not mount over it")
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m,mode=0755", "tmpfs", self.path]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except FileNotFoundError:
            raise MountError("cannot mount a tmpfs: the mount command is not installed") from None
        if r.returncode != 0:
            why = (r.stderr or r.stdout).strip() or f"exit status {r.returncode}"
            hint = "" if os.geteuid() == 0 else " (not root: mounting a tmpfs needs root)"
            raise MountError(f"cannot mount a {self.size_mb} MB tmpfs at {self.path}: {why}{hint}")
        self._mounted_by_us = True
        return self

    def free_bytes(self) -> int:
        """Bytes a non-root writer can still use on the disk."""
        return _free_bytes(self.path)

    def fill(self, leave_bytes: int = 0) -> None:
        """Grow the filler file so it takes all space but `leave_bytes` (rounded to the block size).

        Can be called again (after the product wrote more, or with another leave_bytes): the
        filler grows or shrinks to leave about `leave_bytes` free.
        """
        if not _mounted(self.path):
            raise MountError(f"{self.path} is not mounted; call mount() first")
        leave_bytes = max(0, int(leave_bytes))
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            have = os.fstat(fd).st_size
            target = have + _free_bytes(self.path) - leave_bytes
            if target < 0:
                target = 0
            if target <= have:
                os.ftruncate(fd, target)
                return
            try:
                os.posix_fallocate(fd, 0, target)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                # No fallocate (or the block rounding overshot): write zeros until the target or ENOSPC.
                os.lseek(fd, have, os.SEEK_SET)
                chunk = b"\0" * (1 << 20)
                left = target - have
                while left > 0:
                    try:
                        n = os.write(fd, chunk[: min(left, len(chunk))])
                    except OSError as e2:
                        if e2.errno == errno.ENOSPC:
                            break
                        raise
                    left -= n
        finally:
            os.close(fd)

    def free(self) -> None:
        """Remove the filler, so the space it took returns."""
        try:
            os.unlink(self.filler)
        except FileNotFoundError:
            pass

    def umount(self) -> None:
        """Lazy-unmount the tmpfs (umount -l); nothing if it is not mounted. Idempotent."""
        if not _mounted(self.path):
            self._mounted_by_us = False
            return
        subprocess.run(["umount", "-l", self.path], capture_output=True, text=True, timeout=30)
        self._mounted_by_us = False

    def __enter__(self) -> "SmallDisk":
        return self.mount()

    def __exit__(self, *exc) -> None:
        self.umount()

    def __repr__(self) -> str:
        return f"SmallDisk({self.path!r}, size_mb={self.size_mb})"


_CAN_MOUNT: bool | None = None


def can_mount_tmpfs() -> bool:
    """True if this process can mount (and unmount) a tmpfs; tried once, then remembered."""
    global _CAN_MOUNT
    if _CAN_MOUNT is None:
        _CAN_MOUNT = False
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            d = tempfile.mkdtemp(prefix="lmqtt-tmpfs-probe-")
            try:
                disk = SmallDisk(d, 1)
                try:
                    disk.mount()
                    _CAN_MOUNT = _mounted(d)
                except MountError:
                    pass
                finally:
                    disk.umount()
            finally:
                try:
                    os.rmdir(d)
                except OSError:
                    pass
    return _CAN_MOUNT
