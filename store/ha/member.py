"""One member of a replicated store group: Raft (pysyncobj) for the group state, roles, fencing.

`Member` runs beside a started MessageStore and its StoreServer (wired by store/node/ha_member.py):

* Raft: a `SyncObj` on the member's raft port with the `GroupState` (store/ha/state.py) as its
  consumer. Every member heartbeats through Raft (`heartbeat(node, epoch, log end)`, every
  `heartbeat_s`); the Raft leader acts as the controller and, when the primary's heartbeats stopped
  for `dead_after_s` (or there is none), elects the live in-sync member with the longest log.
* Primary of epoch E: appends its epoch entry (start = its log end), serves the replication port
  (Shipper) and routes every append's durable future through the AckGate: acknowledged once the
  in-sync replicas (at least `ack_replicas`) have it under the flush mode AND its lease holds: a
  heartbeat sent less than `lease_s` ago came back from Raft confirming it as primary of E. The
  controller waits `dead_after_s` > `lease_s` of silence before electing another, so a paused old
  primary's lease has run out before a newer epoch can exist: it acknowledges nothing after.
* Replica: refuses requests (not_primary, naming the primary), follows the primary's stream
  (Follower); when its log diverged it asks for a cut and its process restarts in place.
* In-sync set: the primary proposes removing a replica whose log stays behind what the primary had
  `max_lag_s` ago, and adding one whose acknowledged offset reached everything acknowledged so far
  (the gate waits for it from that moment on).

The metadata changes shipped beside the log (and applied on the replicas) are store/ha/metadata_sync.py
(`MetadataSync`, a mixin of `Member`); the member list changed online (add, remove, a joining
member) is store/ha/membership.py (`Membership`, a mixin too); the primary's upkeep of the in-sync
set is store/ha/in_sync.py (`InSyncSet`, a mixin). Node ids are stable: the initial
members are numbered by their position in `--peers`, an added one gets the next unused number.
"""
from __future__ import annotations

import collections
import logging
import os
import threading
import time

from ..protocol import E_NOT_PRIMARY, decode_produced
from ..record import PREFIX
from ..server import CallError
from .ack_gate import AckGate
from .epochs import EpochFile
from .follower import Follower
from .in_sync import InSyncSet
from .membership import Membership, address
from .metadata_sync import MetadataSync
from .raft import FAIL_REASON, Raft, SyncObjConf
from .replication import NotPrimary, Shipper
from .state import GroupState
from .truncate import request_cut

log = logging.getLogger("lmqtt.store.ha")


# CALLs whose metadata change is shipped and waited for (store/server.py, store/node/sdk_service.py;
# the gateways' gw_* commands are wrapped by store/node/ha_member.py)
META_CALLS = ("commit", "filter_commit", "subscribe", "unsubscribe", "cancel_delayed")


def alive_members(seen: dict[int, float], me: int, now: float, dead_after_s: float, new_leader: bool) -> set[int]:
    """The members the controller (`me`, the Raft leader) counts as alive, from when each one's
    last heartbeat was applied here (`seen`, monotonic).

    A member is silent when the others' heartbeats kept being applied for `dead_after_s` after its
    last one: measured against the newest heartbeat of anyone else, not the clock, so a Raft stall
    (no leader for a while, a disruptive restart) that holds everyone's heartbeats back makes no
    member look dead when Raft resumes. A leader elected less than `dead_after_s` ago leaves its
    own heartbeats out of that reference: they are applied the moment it leads, while the others'
    come back only once each found the new leader, so a primary that lost a few heartbeats to the
    old leader (stopped, cut off) would look silent next to them and be deposed while alive. A
    primary that really died is still judged against the other members' heartbeats.

    `me` is always alive: its own heartbeats may just not commit (no majority now), and an election
    proposed then would commit when the majority returns and depose a live primary."""
    alive = {me}
    for n, t in seen.items():
        others = [u for m, u in seen.items() if m != n and not (new_leader and m == me)]
        ref = max(others or [now])
        if ref - t < dead_after_s:
            alive.add(n)
    return alive


def raft_port(port: int) -> int:
    """A member uses three consecutive ports: the store's (clients), +1 Raft, +2 replication."""
    return port + 1


def ship_port(port: int) -> int:
    return port + 2


def default_ack_replicas(group_size: int) -> int:
    """A majority of the group counting the primary: group of 3 -> 1 replica, 5 -> 2, 1 -> 0."""
    return group_size // 2


class Member(MetadataSync, Membership, InSyncSet):
    def __init__(self, *, group: str, node: int | None, peers, store, ha_dir: str,
                 ack_replicas: int | None = None, heartbeat_s: float = 0.2, dead_after_s: float = 2.5,
                 lease_s: float | None = None, max_lag_s: float = 2.0, on_restart=None,
                 listen_host: str | None = None, members_version: int = 0, join: list[str] = (),
                 listen_addr: tuple[str, int] | None = None, token: str | None = None) -> None:
        """`peers`: node id -> (host, port) of every member (a list: ids are positions, 1-based);
        `node` None: a joining member (`join`: members to ask; `listen_addr`: its own address),
        which starts its Raft once it finds itself in the list (membership.py)."""
        if isinstance(peers, (list, tuple)):
            peers = {i + 1: hp for i, hp in enumerate(peers)}
        if node is not None and node not in peers:
            raise ValueError(f"node id {node} is not one of the members {sorted(peers)} (the position of this "
                             "member in --peers)")
        self.group = group
        self.node = node
        self.peers = dict(peers)
        self.listen_addr = listen_addr or (self.peers[node] if node is not None else None)
        self.store = store
        self.clog = store.clog
        self.ha_dir = ha_dir
        self.ack_replicas = default_ack_replicas(self.size) if ack_replicas is None else int(ack_replicas)
        if node is not None and not 0 <= self.ack_replicas < self.size:
            raise ValueError(f"--ack-replicas must be 0..{self.size - 1} for a group of {self.size}, "
                             f"got {self.ack_replicas}")
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.lease_s = lease_s if lease_s is not None else dead_after_s * 0.6
        if self.lease_s >= self.dead_after_s:
            raise ValueError("the lease must be shorter than the election timeout")
        self.max_lag_s = max_lag_s
        self.on_restart = on_restart         # fn(): stop serving and restart this process (after a cut)
        self.listen_host = listen_host or self.listen_addr[0]
        self.sync = store.cfg.flush_mode == "sync"
        os.makedirs(ha_dir, exist_ok=True)
        self.epochs = EpochFile(os.path.join(ha_dir, "epochs"))
        self.state = GroupState()
        self.role = "starting"
        self.role_epoch = 0
        self.lease_at = -1e9
        self.following: int | None = None
        self.shipper: Shipper | None = None
        self.follower: Follower | None = None
        self.gate: AckGate | None = None
        self._init_metadata_sync(ha_dir)
        self.server = None
        self.on_promoted: list = []          # fn() after this member became primary
        self.on_demoted: list = []           # fn() when it becomes a replica
        self._isr_proposal = 0.0
        self._samples: collections.deque = collections.deque()
        self._electing_until = 0.0
        self._stop = threading.Event()
        self._saved_live_cap = self.clog.live_cap
        self.elections_won = 0
        self.cuts_requested = 0
        self._init_membership(members_version, list(join), token, ack_replicas)
        self.raft = None
        self.raft_addr = ""
        # when this member started to see the group's heartbeats applied (the controller duty needs
        # `dead_after_s` of them before it may call anyone silent: a member just restarted that
        # becomes Raft leader has not watched long enough to know)
        self._watching_since: float | None = None
        # when this member last became the Raft leader (None while it is not): see `alive_members`
        self._leader_since: float | None = None
        if node is None:
            self.role = "joining"
            self._become_read_only("joining the group: not a member yet")
        else:
            self._persist()
            self._start_raft()
        self._thread = threading.Thread(target=self._run, name="lmqtt-ha-control", daemon=True)
        self._thread.start()

    @property
    def size(self) -> int:
        return len(self.peers)

    def _start_raft(self) -> None:
        me = self.peers[self.node]
        self.raft_addr = f"{me[0]}:{raft_port(me[1])}"
        others = [f"{h}:{raft_port(p)}" for n, (h, p) in self.peers.items() if n != self.node]
        # connectionRetryTime: pysyncobj re-dials a peer it lost every 5 s by default, so a member
        # restarted just after a dial failed waited up to 5 s for the Raft leader (and its role).
        # dynamicMembershipChange: members are added and removed online (membership.py)
        conf = SyncObjConf(autoTick=True, raftMinTimeout=0.4, raftMaxTimeout=1.2, appendEntriesPeriod=0.1,
                           connectionTimeout=3.5, connectionRetryTime=0.5,
                           journalFile=os.path.join(self.ha_dir, "raft.journal"),
                           fullDumpFile=os.path.join(self.ha_dir, "raft.dump"), dynamicMembershipChange=True,
                           bindAddress=f"{self.listen_host}:{raft_port(me[1])}")
        self._become_read_only("starting: the group state is not known yet")
        self.role = "starting"
        self.heartbeat_ok_at = time.monotonic()
        self.raft = Raft(self.raft_addr, others, conf=conf, consumers=[self.state])
        self.state.term_now = lambda: self.raft.raftCurrentTerm
        self._update_server()

    # ------------------------------------------------------------------ wiring
    def attach_server(self, server) -> None:
        """The StoreServer: refused requests on a replica, `ha_status`, role in HELLO_OK."""
        self.server = server
        pop = getattr(server, "pop", None)
        if pop is not None:
            # POP state is shipped as SDK metadata (PopManager.persist, every 0.1 s); a member
            # changing role drops what it holds in memory: a new primary reads the shipped state,
            # a replica must not write its stale state over it
            def clear(pop=pop):
                pop.forget_memory()

            def fresh_pop(server=server):      # on the server's loop, where POP runs
                loop = getattr(server, "_loop", None)
                if loop is not None:
                    loop.call_soon_threadsafe(clear)
                else:
                    clear()
            self.on_promoted.append(fresh_pop)
            self.on_demoted.append(fresh_pop)
        server.produce = self._replicated_duplicates(server.produce)
        server.register_call("ha_status", lambda _a: self.status())
        self.register_membership_calls(server)
        for name in META_CALLS:
            fn = server.calls.get(name)
            if fn is not None:
                server.register_call(name, self._replicated_call(fn), with_connection=server.takes_connection(name))
        stats = server.calls.get("stats")
        if stats is not None:       # `lmqtt admin` shows the group beside the store's counters
            server.register_call("stats", lambda a: {**stats(a), "ha": self.brief()})
        self._update_server()

    def _replicated_duplicates(self, produce):
        """StoreServer.produce on a member: a retried batch the dedup finds stored already is
        answered when every in-sync replica has its bytes (AckGate.when_replicated), like its first
        attempt - not at once: a new primary inherits batches (bytes and results) its replicas may
        not have yet, and a retry acknowledged before they do would be lost with this member."""
        clog = self.clog

        def wrapped(body, flags=0):
            out, durable, dup = produce(body, flags)
            gate = self.gate
            if dup and gate is not None and out:
                got = decode_produced(out)
                end = clog.committed
                if got:
                    phys = got[-1][0]
                    mf = clog.mfq.find(phys)
                    if mf is not None and phys < clog.wrote:
                        end = phys + PREFIX.unpack_from(mf.mm, phys - mf.start_offset)[0]
                durable = gate.when_replicated(end)
            return out, durable, dup
        return wrapped

    # ------------------------------------------------------------------ status
    def address_of(self, node: int | None) -> str:
        hp = self.peers.get(node) if node is not None else None
        return address(hp) if hp is not None else "unknown"

    def lease_ok(self) -> bool:
        return time.monotonic() - self.lease_at < self.lease_s

    def status(self) -> dict:
        st = self.state
        reps = []
        if self.shipper is not None:
            for n, r in sorted(self.shipper.replicas.items()):
                reps.append({"node": n, "connected": r.connected, "written": r.written, "flushed": r.flushed,
                             "lag_bytes": max(0, self.clog.committed - (r.flushed if self.sync else r.written))})
        leader = self.raft.leader() if self.raft is not None else None
        return {"group": self.group, "node": self.node, "role": self.role, "epoch": st.epoch,
                "primary": st.primary, "primary_address": self.address_of(st.primary),
                "in_sync": sorted(st.in_sync), "ack_replicas": self.ack_replicas,
                "raft_leader": str(leader) if leader is not None else None,
                "lease_ok": self.lease_ok() if self.role == "primary" else None,
                "acks_blocked": (self.gate.blocked or None) if self.gate is not None else None,
                "log_end": self.clog.wrote, "flushed": self.clog.flushed,
                "dispatched": self.store.dispatch.dispatched, "epochs": [list(x) for x in self.epochs.entries],
                "replicas": reps, "following": self.address_of(self.following) if self.following else None,
                "follow_error": (self.follower.error or None) if self.follower is not None else None,
                "elections_won": self.elections_won, "members": {str(k): v for k, v in self.members_map().items()},
                "members_version": self.members_version, "changing": st.changing}

    def brief(self) -> dict:
        """The group as `stats` (and so `lmqtt admin`) shows it."""
        st = self.status()
        return {k: st[k] for k in ("group", "node", "role", "epoch", "primary_address", "in_sync", "ack_replicas",
                                   "acks_blocked")} | {"replica_lag_bytes": {r["node"]: r["lag_bytes"]
                                                                              for r in st["replicas"]}}

    def _update_server(self) -> None:
        srv = self.server
        if srv is None:
            return
        # epoch: the term this member knows; a client whose primary went silent asks the others
        # (store/client/failover.py probe_primary) and follows one that knows a later epoch
        srv.hello_info.update(group=self.group, node=self.node, role=self.role,
                              primary=self.address_of(self.state.primary), epoch=self.state.epoch,
                              members=list(self.members_map().values()))
        if self.join_id is not None:
            srv.hello_info["join_id"] = self.join_id
        if self.role == "primary" and self.handing_over is None:
            srv.guard = None
        else:
            srv.guard = self._guard

    def refresh_server(self) -> None:
        """What the server says and refuses, after a change of role (membership.py's handover)."""
        self._update_server()

    def guard(self, op: int, cmd: str | None) -> None:
        """StoreServer.guard of a member that serves nothing but status now."""
        self._guard(op, cmd)

    def _guard(self, op: int, cmd: str | None) -> None:
        if cmd in ("stats", "ha_status", "members"):
            return
        if self.role == "joining":
            raise CallError(E_NOT_PRIMARY, f"this store is joining store group {self.group!r} and is not a member "
                                           "yet (lmqtt admin --add-member adds it); primary=unknown")
        if self.role == "primary" and self.handing_over is not None:
            raise CallError(E_NOT_PRIMARY, f"node {self.node} of store group {self.group!r} is handing the primary "
                                           f"role over to node {self.handing_over}; primary=unknown")
        raise CallError(E_NOT_PRIMARY, f"node {self.node} of store group {self.group!r} is a {self.role}, not "
                                       f"the primary; primary={self.address_of(self.state.primary)}")

    # ------------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._drop_primary(NotPrimary(f"node {self.node} is shutting down; primary=unknown"))
        if self.follower is not None:
            self.follower.stop()
            self.follower = None
        try:
            if self.raft is not None:
                self.raft.destroy()
        except Exception:  # noqa: BLE001
            pass

    def _run(self) -> None:
        next_hb = 0.0
        while not self._stop.wait(0.05):
            try:
                now = time.monotonic()
                if self.raft is None:        # a joining member: not in the list yet
                    if self.poll_join(now):
                        self._start_raft()
                    continue
                if self.removed:
                    self.leave_raft_leadership()
                    continue
                if now >= next_hb:
                    next_hb = now + self.heartbeat_s
                    self._heartbeat(now)
                self.check_cut_off(now)
                if not self.raft.isReady():
                    continue
                self.follow_members(now)
                if self.removed:
                    self._drop_primary(None)
                    self._stop_following()
                    continue
                self._control(now)
                self._reconcile()
                if self.role == "primary":
                    self._maintain_in_sync(now)
                    self.step_membership(now)
            except Exception:  # noqa: BLE001 - the control loop keeps going
                log.exception("event=ha_control_failed")

    def _heartbeat(self, sent: float) -> None:
        epoch = self.role_epoch

        def done(res, err, sent=sent, epoch=epoch):
            if err != FAIL_REASON.SUCCESS or res is None:
                return
            self.heartbeat_ok_at = max(self.heartbeat_ok_at, sent)
            e, primary, _isr = res
            if primary == self.node and e == epoch and self.role == "primary" and self.role_epoch == epoch:
                if sent > self.lease_at:
                    self.lease_at = sent
                    g = self.gate
                    if g is not None:
                        g.wake()
        try:
            self.state.heartbeat(self.node, epoch, self.clog.wrote, self.raft.raftCurrentTerm, callback=done)
        except Exception as e:  # noqa: BLE001 - no leader yet, queue full: the next one tries again
            log.debug("event=ha_heartbeat_not_sent error=%r", e)

    def _is_leader(self) -> bool:
        leader = self.raft.leader()
        return leader is not None and str(getattr(leader, "address", leader)) == self.raft_addr

    def _control(self, now: float) -> None:
        """The Raft leader's controller duty: elect a primary when there is none or it went silent."""
        if self._watching_since is None:
            self._watching_since = now
        if not self._is_leader():
            self._leader_since = None
            return
        if self._leader_since is None:
            self._leader_since = now
        if now < self._electing_until:
            return
        st = self.state
        seen = dict(st.last_seen)
        if now - self._watching_since < self.dead_after_s and st.primary is not None:
            return      # restarted (or Raft just became ready) less than a timeout ago: not watched enough
        alive = alive_members(seen, self.node, now, self.dead_after_s,
                              new_leader=now - self._leader_since < self.dead_after_s)
        p = st.primary
        if p is not None and p in alive:
            return
        if st.epoch == 0 and len(alive) < self.size:
            return      # the group's first election waits for every member: the longest log wins
                        # (a data dir that joins with data must not be cut to an empty member's log)
        cands = [n for n in alive if n != p and n in self.peers and (not st.in_sync or n in st.in_sync)]
        if not cands:
            return
        # the longest log (the fewest unacknowledged records cut from the others, and no cut of this
        # member's tail: a cut restarts the process, and with it the group's Raft leader); on a tie
        # not this Raft leader, so that losing the primary does not also cost a Raft election
        best = max(cands, key=lambda n: (st.reports.get(n, (0, 0))[0], st.reports.get(n, (0, 0))[1],
                                         n != self.node, -n))
        self._electing_until = now + 1.0

        def done(res, err, best=best):
            if err == FAIL_REASON.SUCCESS and res is not None:
                log.info("event=ha_elected group=%s primary=%d epoch=%d (by controller %d)", self.group, best,
                         res, self.node)
        log.info("event=ha_electing group=%s old_primary=%s candidate=%d alive=%s in_sync=%s", self.group, p, best,
                 sorted(alive), sorted(st.in_sync))
        self.state.elect(st.epoch, best, callback=done)

    def _reconcile(self) -> None:
        st = self.state
        epoch, primary = st.epoch, st.primary
        if primary == self.node:
            if self.role != "primary" or self.role_epoch != epoch:
                self._become_primary(epoch)
        elif primary is None:
            if self.role == "primary":
                self._drop_primary(NotPrimary(f"node {self.node} lost the primary role; primary=unknown"))
            if self.role != "electing":
                self._become_read_only("no primary elected yet")
                self.role = "electing"
                self._update_server()
        elif primary not in self.peers:
            return      # a primary this member's list does not have yet (follow_members brings it)
        elif self.role != "replica" or self.following != primary or self.role_epoch != epoch:
            self._become_replica(primary, epoch)

    # ------------------------------------------------------------------ roles
    def _become_read_only(self, why: str) -> None:
        self.store.refuse_appends = (f"store group {self.group!r} node {self.node}: {why}; "
                                     f"appends go to the primary")

    def _become_primary(self, epoch: int) -> None:
        log.info("event=ha_becoming_primary group=%s node=%d epoch=%d log_end=%d", self.group, self.node, epoch,
                 self.clog.wrote)
        f = self.follower
        if f is not None:
            f.stop()
            self.follower = None
        # the previous primary's changes this member applied: a replica that followed it too is
        # brought up to date with them (Shipper.catch_up) rather than a snapshot
        self._promoted_from = None
        if f is not None and self._applied_id is not None and self._applied_id == f.meta_id \
                and self._meta_epoch_now == f.conn_epoch:
            self._promoted_from = (self._applied_id, self._meta_epoch_now, self._applied_last, self._applied_from,
                                   list(self._applied))
        self._applied_id = None
        self.following = None
        self._drop_primary(None)
        store, clog = self.store, self.clog
        # the old primary's last frame may have ended inside a record (never acknowledged): the
        # log must end at a whole record before this member appends (CommitLog.cut_partial_record)
        clog.cut_partial_record(store.dispatch.dispatched)
        store.dispatch.limit = clog          # its log is the group's from now on (a deposed gate's bound goes)
        store.dispatch.wait_for(clog.committed, 30.0)
        with clog.lock:
            clog.queue_table.update(store.consume_queues.max_offsets())
            clog.live_cap = self._saved_live_cap
        if self.epochs.last_epoch != epoch:
            self.epochs.begin(epoch, clog.wrote)
        host = self.listen_host
        # the metadata this member holds is the group's from here: changes from this log end on
        # are held for the replicas (MetaLog.reset); others get a snapshot first
        self.meta_log.reset(clog.wrote)
        if os.path.exists(self._meta_incomplete_path):
            log.error("event=ha_primary_with_incomplete_metadata group=%s node=%d (a metadata snapshot from the "
                      "previous primary was cut short: keys it had not sent yet may be missing)", self.group,
                      self.node)
        self._set_meta_epoch(epoch)
        self.shipper = Shipper(store, host, ship_port(self.peers[self.node][1]), self.node, epoch, self.epochs,
                               self.meta_log, self._acked, self.group,
                               snapshot=self._snapshot if self.meta_dbs else None, catch_up=self._catch_up)
        self.shipper.members = set(self.peers)
        self.gate = AckGate(clog, self.sync, self.ack_replicas, self.lease_ok, self._ack_set, self._replica_offset)
        self.gate.also_wake = self.shipper.wake
        self.meta_log.on_add = self.shipper.wake_meta
        self.gate.want_add = self._want_add
        self.gate.replica_meta = self._replica_meta
        self.gate.on_add = self._propose_add
        self.gate.on_confirm = store.dispatch.wake
        store.dispatch.limit = self.gate     # readers see only what the in-sync replicas acknowledged
        store.use_ack_gate(self.gate)
        self.role = "primary"
        self.role_epoch = epoch
        self._samples.clear()
        self.elections_won += 1
        for fn in self.on_promoted:
            try:
                fn()
            except Exception:  # noqa: BLE001
                log.exception("event=ha_on_promoted_failed")
        store.refuse_appends = None
        self._update_server()
        # the lease now rather than at the next heartbeat tick: acknowledgements wait for it
        self._heartbeat(time.monotonic())
        log.info("event=ha_primary group=%s node=%d epoch=%d start=%d in_sync=%s ack_replicas=%d", self.group,
                 self.node, epoch, clog.wrote, sorted(self.state.in_sync), self.ack_replicas)

    def _drop_primary(self, err) -> None:
        """Stop acting as primary: refuse appends, fail what waits for acknowledgement, stop shipping."""
        if self.role == "primary" or self.gate is not None or self.shipper is not None:
            self._become_read_only(f"no longer primary (epoch {self.role_epoch})")
            gate, self.gate = self.gate, None
            if gate is not None:
                # the stopped gate stays the store's: its `current` is a failed future from now on,
                # so an append racing this sees NotPrimary rather than the flush mode's own future
                gate.stop(err if err is not None else NotPrimary(
                    f"node {self.node} is no longer the primary; primary={self.address_of(self.state.primary)}"))
            sh, self.shipper = self.shipper, None
            if sh is not None:
                sh.stop()
            if self.role == "primary":
                if self._stop.is_set():
                    log.info("event=ha_primary_stopping group=%s node=%d epoch=%d", self.group, self.node,
                             self.role_epoch)
                else:
                    log.warning("event=ha_primary_deposed group=%s node=%d epoch=%d now_epoch=%d primary=%s",
                                self.group, self.node, self.role_epoch, self.state.epoch, self.state.primary)
                self.role = "deposed"

    def _stop_following(self) -> None:
        f, self.follower = self.follower, None
        if f is not None:
            f.stop()
        self.role = "removed"
        self._become_read_only("removed from the group")
        self._update_server()

    def _become_replica(self, primary: int, epoch: int) -> None:
        self._drop_primary(None)
        self.handing_over = None
        for fn in self.on_demoted:
            try:
                fn()
            except Exception:  # noqa: BLE001
                log.exception("event=ha_on_demoted_failed")
        self._become_read_only(f"a replica (primary: node {primary})")
        clog = self.clog
        with clog.lock:
            clog.live_cap = 0
            clog.live_enabled = False
            clog.live.clear()
            clog.live_count = 0
        if self.follower is not None:
            self.follower.stop()
        self.role = "replica"
        self.role_epoch = epoch
        self.following = primary
        h, p = self.peers[primary]
        self.follower = Follower(self.store, (h, ship_port(p)), self.node, lambda: self.state.epoch, self.epochs,
                                 self._cut, self._apply_meta, self.sync, meta_state=self.meta_state)
        self._update_server()
        log.info("event=ha_replica group=%s node=%d epoch=%d primary=%d log_end=%d", self.group, self.node, epoch,
                 primary, clog.wrote)

    def _cut(self, offset: int, why: str) -> None:
        self.cuts_requested += 1
        log.warning("event=ha_cut_requested group=%s node=%d offset=%d log_end=%d reason=%r", self.group, self.node,
                    offset, self.clog.wrote, why)
        request_cut(self.ha_dir, offset, why)
        if self.on_restart is not None:
            self.on_restart()
