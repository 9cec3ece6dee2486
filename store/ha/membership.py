"""Members changed online: add, remove and replace a member of a running store group.

The member list is part of the group state Raft decides (store/ha/state.py `members`, node id ->
store address, with a version): a change is one `set_members` command, compare-and-set on the
version, so two changes never cross. Raft's own membership (pysyncobj's dynamic membership
change, `addNodeToCluster` / `removeNodeFromCluster`, one node at a time) is then brought to the
list by the primary (`step_membership`), and the change is marked settled once they match. Nothing
here is a consensus of its own: the list and each Raft change are pysyncobj's.

* **Adding** (`member_add`, the `member_add` CALL on the primary): the new process runs first
  (`lmqtt store --group G --join ANY_MEMBER`, a *joining* member: it answers HELLO with role
  `joining` and refuses everything else). The primary dials it (a clear error when it is not
  there, or is not a joining member of this group), gives it the next node id in the list, and
  the joining member, which asks the members every 0.5 s (`poll_join`), finds itself there, starts
  its Raft with the current list and is added to Raft by the primary. It then follows the primary
  as any replica does: the CommitLog from its end (its whole log for an empty data dir) and a
  metadata snapshot; it counts toward the acknowledgements once the primary puts it in the in-sync
  set (caught up), never before.
* **Removing** (`member_remove`): the node leaves the list, the in-sync set (the primary stops
  waiting for it at once) and then Raft. The removed process, which learns it from Raft or, cut off
  from Raft, from the other members, stops (`on_removed`), and its data dir refuses to start as
  that member again. The primary is not removed: another in-sync member is made primary first
  (`handover`).
* **Persisted**: `<data-dir>/ha/members` holds the list this member last applied (and its node
  id); a restart uses it, not the `--peers` / `--node-id` it was first started with.
* `--ack-replicas` left out follows the group's size (a majority counting the primary); given,
  a change that would leave it unreachable is refused.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import secrets
import threading
import time

from ..checkpoint import write_atomic
from ..client.connection import connect
from ..client.errors import StoreClientError
from ..client.handshake import dial
from ..protocol import E_INVALID, FrameDecoder
from ..server import CallError
from .peers import parse_peers
from .raft import FAIL_REASON

log = logging.getLogger("lmqtt.store.ha")

MEMBERS_FILE = "members"
JOIN_POLL_S = 0.5
# a removed member is taken out of Raft this long after the list changed, so that it most likely
# learns its removal from Raft itself (it asks the other members otherwise)
REMOVE_GRACE_S = 1.0


def address(hp: tuple[str, int]) -> str:
    h, p = hp
    return f"[{h}]:{p}" if ":" in h else f"{h}:{p}"


def raft_address(hp: tuple[str, int]) -> str:
    """A member's Raft address: its store port + 1 (store/ha/member.py raft_port)."""
    return address((hp[0], hp[1] + 1))


def load_members(ha_dir: str) -> dict | None:
    """The member list this data dir last applied: {"group", "node", "version", "members":
    {node: "HOST:PORT"}, "removed": bool}, or None for a data dir that never was a member."""
    try:
        with open(os.path.join(ha_dir, MEMBERS_FILE), encoding="utf-8") as f:
            d = json.load(f)
    except FileNotFoundError:
        return None
    d["members"] = {int(k): str(v) for k, v in d.get("members", {}).items()}
    return d


def save_members(ha_dir: str, group: str, node: int, version: int, members: dict, removed: bool = False) -> None:
    os.makedirs(ha_dir, exist_ok=True)
    write_atomic(os.path.join(ha_dir, MEMBERS_FILE), json.dumps(
        {"group": group, "node": node, "version": version, "removed": removed,
         "members": {str(k): v for k, v in sorted(members.items())}}, indent=1).encode())


def _parse_one(text: str) -> tuple[str, int]:
    peers = parse_peers(text)
    if len(peers) != 1:
        raise ValueError(f"one member's HOST:PORT, got {text!r}")
    return peers[0]


def _reason(e: Exception) -> str:
    """pysyncobj's failure of a sync call (a FAIL_REASON number, or 'Timeout') in words."""
    code = e.args[0] if e.args else e
    names = {v: k.lower().replace("_", " ") for k, v in vars(FAIL_REASON).items() if k.isupper()}
    return names.get(code, str(code))


class Membership:
    """The member-list side of `Member` (a mixin, like MetadataSync): reads the Member's `state`,
    `raft`, `role`, `node`, `peers`, `group`, `ha_dir`, `shipper`, `gate`, `token`."""

    def _init_membership(self, version: int, join: list[str], token: str | None, ack_flag: int | None) -> None:
        self.members_version = version       # of the list in `self.peers`
        self.join_addresses = list(join)     # a joining member asks these for the list
        self.token = token
        self.ack_flag = ack_flag             # --ack-replicas as given (None: follows the group's size)
        self.join_id = secrets.token_hex(8) if self.node is None else None
        self.removed = False
        self.on_removed = None               # fn(why): stop this process (store/node/ha_member.py)
        self._raft_change_at = 0.0
        self._changed_at = 0.0
        self._next_poll = 0.0
        self.heartbeat_ok_at = time.monotonic()      # when a heartbeat of this member last committed
        self._join_logged = False
        self.handing_over: int | None = None     # the successor while this primary hands over
        # one change asked at a time here; the answers of the last ones by the caller's request id,
        # so a CALL the client sent again (its connection moved while it waited) is answered the
        # same rather than done twice
        self._change_lock = threading.Lock()
        self._answers: collections.OrderedDict = collections.OrderedDict()

    # ------------------------------------------------------------------ views
    def members_map(self) -> dict[int, str]:
        return {n: address(hp) for n, hp in sorted(self.peers.items())}

    def current(self) -> tuple[int, dict[int, str], dict | None]:
        """(version, node -> address, change under way) as Raft applied them here: ahead of
        `peers` until the control loop follows them (a new primary still taking over, say), and
        what a change is computed from and compare-and-set against."""
        st = self.state
        members, version, changing = dict(st.members), st.members_version, st.changing
        if not members or version < self.members_version:
            return self.members_version, self.members_map(), None
        return version, {int(n): a for n, a in members.items()}, changing

    def members_status(self) -> dict:
        version, members, changing = self.current()
        st = self.state
        return {"group": self.group, "node": self.node, "role": self.role, "version": version,
                "members": {str(n): a for n, a in sorted(members.items())},
                "changing": changing if self.node is not None else None,
                "primary": st.primary if self.node is not None else None,
                "in_sync": sorted(st.in_sync) if self.node is not None else [],
                "ack_replicas": self.ack_replicas}

    def _persist(self) -> None:
        if self.node is not None:
            save_members(self.ha_dir, self.group, self.node, self.members_version, self.members_map(), self.removed)

    def _ack_for(self, size: int) -> int:
        return size // 2 if self.ack_flag is None else int(self.ack_flag)

    # ------------------------------------------------------------------ every member: follow the list
    def follow_members(self, now: float) -> None:
        """The list Raft applied becomes this member's (peers, size, --ack-replicas default, the
        file); a member no longer in it stops. Called by the control loop once Raft is ready."""
        st = self.state
        if st.members and st.members_version > self.members_version:
            self.peers = {int(n): _parse_one(a) for n, a in st.members.items()}
            self.members_version = st.members_version
            self.ack_replicas = self._ack_for(len(self.peers))
            g = self.gate
            if g is not None:
                g.ack_replicas = self.ack_replicas
                g.adding = g.adding & set(self.peers)      # a removed node is not waited for
                g.wake()
            self._changed_at = now
            if self.node not in self.peers:
                self._removed(f"removed from store group {self.group!r} (members now "
                              f"{self.members_map()})")
                return
            sh = self.shipper
            if sh is not None:
                sh.set_members(set(self.peers))
            self._persist()
            log.info("event=ha_members group=%s node=%d version=%d members=%s changing=%s ack_replicas=%d",
                     self.group, self.node, self.members_version, self.members_map(), st.changing,
                     self.ack_replicas)

    def _removed(self, why: str) -> None:
        if self.removed:
            return
        self.removed = True
        self._persist()
        log.warning("event=ha_member_removed group=%s node=%s %s", self.group, self.node, why)
        fn = self.on_removed
        if fn is not None:
            fn(why)

    def check_cut_off(self, now: float) -> None:
        """A member whose heartbeats have not committed for 5 s asks the other members for the
        list: one removed while it was cut off (stopped, partitioned) never applies its removal
        through Raft (the others no longer talk to it), and pysyncobj keeps the last leader it
        knew while it is connected to no one, so Raft alone never tells it."""
        if now - self.heartbeat_ok_at < 5.0 or now < self._next_poll:
            return
        self._next_poll = now + 2.0
        newest = self._ask_members([a for n, a in self.members_map().items() if n != self.node])
        if newest is not None and newest["version"] > self.members_version \
                and str(self.node) not in newest["members"] and newest.get("group") == self.group:
            self._removed(f"removed from store group {self.group!r} while cut off (members now "
                          f"{newest['members']})")

    def _ask_members(self, addresses: list[str]) -> dict | None:
        """The newest member list any of `addresses` answers with (`members` CALL), or None."""
        best = None
        for a in addresses:
            try:
                c = connect(a, token=self.token, timeout=2.0, connect_timeout=1.0, reconnect_attempts=1,
                            client_name="lmqtt-group-member")
            except Exception:  # noqa: BLE001 - not up: the next one
                continue
            try:
                r = c.cmd("members")
            except Exception:  # noqa: BLE001 - an earlier version, or gone meanwhile
                continue
            finally:
                c.close()
            if r.get("node") is not None and (best is None or r["version"] > best["version"]):
                best = r
        return best

    # ------------------------------------------------------------------ a joining member
    def poll_join(self, now: float) -> bool:
        """A member started with --join: ask the members for the list until this one is in it
        (added by `member_add`). True once it has its node id (the caller starts its Raft)."""
        if now < self._next_poll:
            return False
        self._next_poll = now + JOIN_POLL_S
        got = self._ask_members(self.join_addresses)
        if got is None:
            if not self._join_logged:
                log.warning("event=ha_join_waiting group=%s reason=\"no member of %s answers\"", self.group,
                            self.join_addresses)
                self._join_logged = True
            return False
        if got.get("group") != self.group:
            log.error("event=ha_join_wrong_group group=%s answered=%r", self.group, got.get("group"))
            return False
        ch = got.get("changing") or {}
        me = address(self.listen_addr)
        mine = [int(n) for n, a in got["members"].items() if a == me]
        if ch.get("op") == "add" and ch.get("join") == self.join_id:
            mine = [int(ch["node"])]
        if not mine or str(mine[0]) not in got["members"]:
            if not self._join_logged:
                log.info("event=ha_join_waiting group=%s address=%s members=%s (add it: lmqtt admin --store %s "
                         "--add-member %s)", self.group, me, got["members"], ",".join(self.join_addresses), me)
                self._join_logged = True
            return False
        self.node = mine[0]
        self.peers = {int(n): _parse_one(a) for n, a in got["members"].items()}
        self.members_version = int(got["version"])
        self.ack_replicas = self._ack_for(len(self.peers))
        self._persist()
        log.info("event=ha_joined group=%s node=%d members=%s", self.group, self.node, self.members_map())
        return True

    # ------------------------------------------------------------------ the primary: changes
    def _in_progress(self) -> str | None:
        ch = self.state.changing
        if not ch:
            return None
        return (f"a member change is under way ({ch.get('op')} node {ch.get('node')} {ch.get('address')}, "
                f"{max(0, int(time.time() - float(ch.get('at', time.time()))))} s ago): wait until `lmqtt admin "
                "--members` shows it done")

    def _propose(self, expected: int, members: dict, changing: dict | None, next_node: int,
                 gone: tuple = ()) -> int:
        """Commit the new list. A Raft leader change on the way (the member being removed may be
        the Raft leader, stopped) fails the call without saying whether the command committed: it
        is asked again until a deadline, and a refusal that finds this very change applied (its
        `changing` names it: same time, same node) is its success."""
        st = self.state
        members = {int(n): a for n, a in members.items()}
        deadline = time.monotonic() + 20.0
        err = None
        while True:
            try:
                res = st.set_members(expected, members, changing, next_node, gone, sync=True, timeout=5.0)
            except Exception as e:  # noqa: BLE001 - pysyncobj's SyncObjException: leader changed, timeout
                err, res = _reason(e), None
            else:
                err = None
            if res is not None:
                return res
            if st.changing == changing and st.members == members:
                return st.members_version          # committed by an attempt that reported a failure
            if err is None:
                raise CallError(E_INVALID, "another member change came first: look at `lmqtt admin --members` and "
                                           "try again")
            if time.monotonic() > deadline:
                raise CallError(E_INVALID, f"the group did not commit the change ({err}): is a majority of "
                                           f"{self.current()[1]} up?")
            time.sleep(0.3)

    def member_add(self, addr: str) -> dict:
        """Add the joining member listening at `addr` (runs on a worker thread: it dials)."""
        try:
            hp = _parse_one(addr)
        except ValueError as e:
            raise CallError(E_INVALID, f"--add-member: {e}") from None
        addr = address(hp)
        why = self._in_progress()
        if why:
            raise CallError(E_INVALID, why)
        version, mm, _ch = self.current()
        for n, a in mm.items():
            if a == addr:
                raise CallError(E_INVALID, f"{addr} is node {n} of store group {self.group!r} already")
        hint = (f"start it first: lmqtt store --group {self.group} --join {','.join(mm.values())} "
                f"--host {hp[0]} --port {hp[1]} --data-dir DIR")
        try:
            s, info, _early = dial(hp[0], hp[1], connect_timeout=3.0, client_name="lmqtt-group-add",
                                   token=self.token, decoder=FrameDecoder())
            s.close()
        except (OSError, StoreClientError) as e:
            raise CallError(E_INVALID, f"cannot reach {addr} ({e}); {hint}") from None
        if info.get("group") != self.group or info.get("role") != "joining":
            what = (f"node {info.get('node')} ({info.get('role')}) of store group {info.get('group')!r}"
                    if info.get("group") else "not a store group member")
            raise CallError(E_INVALID, f"{addr} is {what}, not a member joining {self.group!r}; {hint}")
        node = max([self.state.next_node, *mm]) + 1
        members = {**mm, node: addr}
        changing = {"op": "add", "node": node, "address": addr, "at": time.time(), "join": info.get("join_id")}
        version = self._propose(version, members, changing, node)
        log.info("event=ha_member_adding group=%s node=%d address=%s version=%d", self.group, node, addr, version)
        return {"node": node, "address": addr, "version": version, "members": {str(k): v for k, v in members.items()}}

    def member_remove(self, target: str) -> dict:
        """Remove a member named by node id or HOST:PORT (the primary hands over first)."""
        node = None
        version, mm, _ch = self.current()
        if str(target).isdigit():
            node = int(target)
        else:
            try:
                a = address(_parse_one(target))
            except ValueError as e:
                raise CallError(E_INVALID, f"--remove-member: {e}") from None
            node = next((n for n, x in mm.items() if x == a), None)
        if node not in mm:
            raise CallError(E_INVALID, f"{target} is not a member of store group {self.group!r}; members: {mm}")
        ch = self.state.changing
        if ch and not (ch.get("op") == "add" and ch.get("node") == node):      # cancelling an add is allowed
            raise CallError(E_INVALID, self._in_progress())
        if len(mm) == 1:
            raise CallError(E_INVALID, f"node {node} is the last member of store group {self.group!r}: stop it "
                                       "instead")
        left = len(mm) - 1
        if self.ack_flag is not None and int(self.ack_flag) >= left:
            raise CallError(E_INVALID, f"--ack-replicas {self.ack_flag} needs at least {int(self.ack_flag) + 1} "
                                       f"members; removing node {node} would leave {left}")
        if node == self.node:
            raise CallError(E_INVALID, self.handover(f"node {node} is the primary"))
        members = {n: a for n, a in mm.items() if n != node}
        changing = {"op": "remove", "node": node, "address": mm[node], "at": time.time()}
        version = self._propose(version, members, changing, max([self.state.next_node, *mm]), (node,))
        log.info("event=ha_member_removing group=%s node=%d address=%s version=%d", self.group, node, mm[node],
                 version)
        return {"node": node, "address": mm[node], "version": version,
                "members": {str(k): v for k, v in members.items()}}

    def handover(self, why: str) -> str:
        """Make another in-sync member primary; this one becomes a replica. Requests are refused
        with not_primary from now (clients re-send them to the new primary, as after an election),
        and the successor is elected once it has this member's whole log and every metadata
        change: no member then holds bytes the new primary lacks, so none cuts its log and
        restarts, and what was in flight is acknowledged here or re-sent there (stored once by
        its producer id + sequence). Returns the error to answer with."""
        st = self.state
        others = [n for n in st.in_sync if n != self.node and n in self.peers]
        if not others:
            return (f"{why} and no other member is in sync to take over (in sync: {sorted(st.in_sync)}); wait "
                    "until one is, then remove it again")
        best = max(others, key=lambda n: (self.replica_offset(n), -n))
        self.handing_over = best
        srv = self.server
        if srv is not None:
            srv.guard = self.guard
        clog = self.clog
        deadline = time.monotonic() + 10.0
        caught = 0
        while time.monotonic() < deadline and caught < 3:       # three looks 20 ms apart: the log stopped
            end = clog.wrote
            time.sleep(0.02)
            ok = end == clog.wrote and self.replica_offset(best) >= end and \
                self.replica_meta(best) >= self.meta_log.seq
            caught = caught + 1 if ok else 0
        res = None
        err = None
        if caught >= 3:
            try:
                res = st.elect(st.epoch, best, sync=True, timeout=10.0)
            except Exception as e:  # noqa: BLE001 - no majority
                err = e
        if res is None:
            self.handing_over = None
            self.refresh_server()
            if caught < 3:
                return f"{why}; node {best} did not catch up with this primary's log within 10 s: try again"
            return f"{why}; handing over to node {best} failed ({err or 'the epoch moved'}): try again"
        log.info("event=ha_handover group=%s from=%d to=%d epoch=%s log_end=%d", self.group, self.node, best, res,
                 clog.wrote)
        return (f"{why}: handed over to node {best} ({self.address_of(best)}, epoch {res}); ask again to remove "
                f"node {self.node}")

    def step_membership(self, now: float) -> None:
        """The primary brings Raft's membership to the list, one node at a time, then marks the
        change settled."""
        st = self.state
        if self._raft_change_at and now - self._raft_change_at < 10.0:
            return
        self._raft_change_at = 0.0
        want = {raft_address(hp) for n, hp in self.peers.items() if n != self.node}
        have = {getattr(n, "address", str(n)) for n in self.raft.otherNodes}
        add, remove = sorted(want - have), sorted(have - want)

        def done(_res, err, what):
            self._raft_change_at = 0.0
            if err == FAIL_REASON.SUCCESS:
                log.info("event=ha_raft_members_changed group=%s %s", self.group, what)
            else:
                log.info("event=ha_raft_members_change_refused group=%s %s reason=%s", self.group, what, err)
        if add:
            self._raft_change_at = now
            self.raft.addNodeToCluster(add[0], callback=lambda r, e, a=add[0]: done(r, e, f"added={a}"))
        elif remove:
            if now - self._changed_at < REMOVE_GRACE_S:
                return
            self._raft_change_at = now
            self.raft.removeNodeFromCluster(remove[0], callback=lambda r, e, a=remove[0]: done(r, e, f"removed={a}"))
        elif st.changing and st.members_version == self.members_version:
            self._raft_change_at = now
            st.set_members(self.members_version, dict(st.members), None, st.next_node,
                           callback=lambda r, e: done(r, e, f"settled version={r}"))

    def leave_raft_leadership(self) -> None:
        """A removed member that leads Raft hands the leadership on (the leader cannot remove itself)."""
        try:
            if self.raft.leader() is not None and str(getattr(self.raft.leader(), "address", "")) == self.raft_addr:
                self.raft.transferLeadership()
        except Exception:  # noqa: BLE001 - best effort: the others elect a leader once it stops
            pass

    # ------------------------------------------------------------------ CALLs
    def _once(self, request, fn) -> dict:
        """fn() under the change lock, answered again from memory for a request id seen before."""
        with self._change_lock:
            if request and request in self._answers:
                log.info("event=ha_member_change_asked_again request=%s (answered as before)", request)
                return self._answers[request]
            res = fn()
            if request:
                self._answers[request] = res
                while len(self._answers) > 64:
                    self._answers.popitem(last=False)
            return res

    def register_membership_calls(self, server) -> None:
        server.register_call("members", lambda _a: self.members_status())

        def in_worker(fn):
            def call(a):
                return asyncio.get_running_loop().run_in_executor(None, self._once, a.get("request"),
                                                                  lambda: fn(a))
            return call
        server.register_call("member_add", in_worker(lambda a: self.member_add(str(a.get("address", "")))))
        server.register_call("member_remove", in_worker(lambda a: self.member_remove(str(a.get("member", "")))))
