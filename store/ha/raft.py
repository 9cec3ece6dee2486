"""The one import of pysyncobj (the Raft implementation of a store group), made safe.

pysyncobj's `tcp_connection` imports its copy of `win_inet_pton`, which replaces
`socket.inet_ntop` with a Windows-only ctypes function on every platform (the `os.name == 'nt'`
guard covers only `inet_pton`). Anything in the same process that formats an address with it then
fails with "not_windows() takes 0 positional arguments" - psutil's connection listing among them.
The standard function is put back right after the import; every module uses pysyncobj from here.
"""
from __future__ import annotations

import socket

_inet_ntop = socket.inet_ntop
try:
    from pysyncobj import SyncObj, SyncObjConf, SyncObjConsumer, replicated  # noqa: E402
    from pysyncobj.syncobj import FAIL_REASON  # noqa: E402
finally:
    socket.inet_ntop = _inet_ntop

__all__ = ["Raft", "SyncObj", "SyncObjConf", "SyncObjConsumer", "replicated", "FAIL_REASON"]


class Raft(SyncObj):
    """pysyncobj's SyncObj, with a public name for what a member asks of it."""

    def leader(self):
        """The current Raft leader's address, or None while there is none."""
        return self._getLeader()
