"""What the web console of a fleet asks the store node (docs/console.md "Where it runs").

Every gateway's console shows the whole fleet: it finds the other gateways' consoles here. A
gateway with a console announces it on its store connection (`console_announce`: its gateway id,
its console's URL and a random token of its own, which a peer shows to read its clients or
disconnect one of them; over HTTPS the SHA-256 of its certificate, which a peer checks); the
announcement lives as long as that connection (a gateway that reconnects, or follows a store
group's new primary, announces again). `console_peers` answers the
announced consoles and the ids of every gateway connected (gw_hello), consoles or not.
`pop_groups` lists the POP consumer states (SDK `pop`: group, ConsumeQueue, next offset, messages
invisible now, backlog) and each group's dead letters, which the `stats` CALL's `groups` (groups
with a committed offset) leaves out.

Anyone who may CALL this store reads the tokens: the same people who may already read every
session, offset and message through it (the store's `--token`, or loopback only without one).
"""
from __future__ import annotations

import time

from lmqtt.store.pop import dlq_topic


def pop_groups(pop, store, limit: int = 500) -> list[dict]:
    """[{group, topic, queue_id, next, inflight, backlog}] of every POP state, persisted or in memory."""
    keys: set[tuple[str, str, int]] = pop.state_keys()
    for key in pop.meta.keys_with_prefix("s\0"):
        parts = key.split("\0")              # s, group, topic, queue id
        try:
            keys.add((parts[1], "\0".join(parts[2:-1]), int(parts[-1])))
        except (IndexError, ValueError):
            continue
    out = []
    for g, t, q in sorted(keys)[:limit]:
        try:
            info = pop.info(g, t, q)
        except Exception:  # noqa: BLE001 - a queue gone meanwhile: left out
            continue
        out.append({"group": g, "topic": t, "queue_id": q, **info})
    return out


def dead_letters(store, group: str) -> int:
    try:
        return store.consume_queue_offsets(dlq_topic(group), 0)[1]
    except Exception:  # noqa: BLE001 - no dead letter queue yet
        return 0


class ConsolePeers:
    def __init__(self, server, wills=None) -> None:
        """`wills`: the gateway service's GatewayWills (which connection is which gateway)."""
        self.srv = server
        self.wills = wills
        self.consoles: dict[object, dict] = {}        # StoreConnection -> its gateway's console
        server.register_call("console_announce", self.announce, with_connection=True)
        server.register_call("console_peers", self.peers)
        server.register_call("pop_groups", self.pop_groups)
        server.on_connection_lost.append(lambda conn: self.consoles.pop(conn, None))

    def announce(self, a: dict, conn) -> dict:
        gid, url, token = str(a.get("gateway") or ""), str(a.get("url") or ""), str(a.get("token") or "")
        if not gid or not url.startswith(("http://", "https://")) or len(token) < 16:
            raise ValueError("console_announce needs gateway, an http(s) url and a token of 16+ characters")
        for other in [c for c, v in self.consoles.items() if v["gateway"] == gid and c is not conn]:
            del self.consoles[other]       # the same gateway restarted before its old connection was seen gone
        self.consoles[conn] = {"gateway": gid, "url": url, "token": token, "since_ms": int(time.time() * 1000)}
        if a.get("cert_sha256"):                 # an HTTPS console: the certificate its peers must see
            self.consoles[conn]["cert_sha256"] = str(a["cert_sha256"])
        return {"ok": True}

    def peers(self, _a: dict) -> dict:
        connected = sorted(self.wills.connections_of) if self.wills is not None else []
        if self.wills is not None:
            connected = [g for g in connected if self.wills.is_connected(g)]
        return {"consoles": sorted(self.consoles.values(), key=lambda c: c["gateway"]), "connected": connected}

    def pop_groups(self, _a: dict) -> dict:
        rows = pop_groups(self.srv.pop, self.srv.store)
        return {"pop": rows, "dead_letters": {g: dead_letters(self.srv.store, g) for g in {r["group"] for r in rows}}}


def install(server, gateway_service=None) -> ConsolePeers:
    return ConsolePeers(server, getattr(gateway_service, "wills", None))
