"""The console's view of the fleet (docs/console.md "Where it runs").

**Every gateway's console shows the whole fleet.** `lmqtt serve --workers N` and the `lmqtt
gateway` processes of a fleet each serve the console on their metrics port, and each of them:

* finds the other consoles through the store: it announces its own (gateway id, URL, a random
  token) on its store connection (`console_announce`, store/node/console_peers.py; again after
  every reconnect, a store group's failover included) and asks `console_peers` for the others';
* asks each peer over HTTP for what only that gateway knows - its live clients, its overview
  sample - at `/console/peer/*`, with the peer's token in `X-Lmqtt-Peer` (no login: the token is
  the proof, handed out by the store to whoever may CALL it); a disconnect on the page goes to the
  gateway the client is on;
* reads what the store keeps - persistent sessions, groups and POP, retained messages, topics, the
  store group's roles, disk and tier - from the store itself, through the same CALLs `lmqtt admin`
  makes (`sessions`, `session`, `stats`, `lag`, `pop_groups`, `topics`, `tier`, `ha_status`).

`lmqtt serve` (one process) is a fleet of one: the same pages read its embedded store's SDK server
directly (its CALL handlers, on this loop).
"""
from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import logging
import re
import secrets
import socket
import ssl
import time
import urllib.parse

from lmqtt.store.client.connection import StoreClientError

log = logging.getLogger("lmqtt.console")
PEER_HEADER = "X-Lmqtt-Peer"
PEER_TIMEOUT_S = 3.0
STORE_TIMEOUT_S = 5.0


class StoreUnavailable(Exception):
    """The store cannot answer (one line: why)."""


class Fleet:
    def __init__(self, gw, cfg, sdk=None) -> None:
        self.gw, self.cfg, self.sdk = gw, cfg, sdk
        self.token = secrets.token_urlsafe(24)
        self.remote = bool(gw.remote)
        # a fleet gateway's storage is its RemoteStore (started before the console): its id, no probing
        self.gateway_id = (gw.storage.gateway_id or cfg.gateway_id or "gateway") if self.remote else "lmqtt serve"
        self.url: str | None = None
        self.cert_sha256: str | None = None      # console_tls: the certificate peers must see here
        self._peers: tuple[float, list[dict], list[str]] = (0.0, [], [])
        self._announce_warned = False
        self._ssl: ssl.SSLContext | None = None

    # ------------------------------------------------------------------ the store
    async def call(self, name: str, **args) -> dict:
        """A CALL of the store this gateway uses (its result dict); StoreUnavailable if it cannot answer."""
        if not self.remote:
            if self.sdk is None:
                raise StoreUnavailable("lmqtt serve runs without its store port (--store-port 0): the SDK "
                                       "service that answers this is off")
            if name == "pop_groups":
                # lmqtt serve only (its store in this process): a fleet gateway never loads RocksDB
                from lmqtt.store.node.console_peers import dead_letters, pop_groups
                rows = pop_groups(self.sdk.pop, self.sdk.store)
                return {"pop": rows, "dead_letters": {g: dead_letters(self.sdk.store, g)
                                                      for g in {r["group"] for r in rows}}}
            fn = self.sdk.calls.get(name)
            if fn is None:
                raise StoreUnavailable(f"this store does not answer {name!r}")
            out = fn(args)
            if asyncio.isfuture(out):
                out = await out
            return out
        _op, _flags, body = await self.call_raw(name, **args)
        return json.loads(body)

    def links(self) -> list:
        """This gateway's store links, one per store group (docs/groups.md), the first group's
        (sessions, the topic table, the consoles' directory) first; [] for `lmqtt serve`."""
        first = getattr(self.gw, "link", None)
        return ([first] if first is not None else []) + list(getattr(self.gw, "more_links", None) or [])

    @staticmethod
    def group_name(link) -> str:
        """A store group's name as its members say it (HELLO_OK), else the address dialled."""
        return str(link.server_info.get("group") or link.address)

    async def call_each(self, name: str, **args) -> list[tuple[str, dict | StoreUnavailable]]:
        """The CALL asked of every store group at once: [(group name, its result or why it could
        not answer)], in `--store` order. One group (or `lmqtt serve`): that store's only."""
        links = self.links()
        if len(links) <= 1:
            try:
                return [(self.group_name(links[0]) if links else "", await self.call(name, **args))]
            except StoreUnavailable as e:
                return [(self.group_name(links[0]) if links else "", e)]

        async def one(link) -> dict | StoreUnavailable:
            try:
                return await self.call_at(link, name, **args)
            except StoreUnavailable as e:
                return e
        got = await asyncio.gather(*(one(link) for link in links))
        return [(self.group_name(link), r) for link, r in zip(links, got)]

    async def call_at(self, link, name: str, /, **args) -> dict:
        """`call` of one store group's link (a fleet gateway)."""
        _op, _flags, body = await self.call_raw(name, link, **args)
        return json.loads(body)

    async def call_raw(self, name: str, link=None, /, **args) -> tuple[int, int, bytes]:
        """A fleet gateway's CALL answered as the frame (op, flags, body): a MESSAGES reply too.
        `link`: the store group's link to ask (default: the first group's)."""
        if link is None:
            link = getattr(self.gw, "link", None)
        if link is None or not link.connected:
            raise StoreUnavailable(f"store {self.cfg.store_address} unreachable: "
                                   f"{link.last_error if link is not None else 'closed'}")
        try:
            return await asyncio.wait_for(link.cmd(name, **args), STORE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise StoreUnavailable(f"store {link.address} did not answer {name!r} within {STORE_TIMEOUT_S:g} s") from None
        except StoreClientError as e:
            raise StoreUnavailable(f"store {link.address} refused {name!r}: {e}") from None
        except Exception as e:  # noqa: BLE001 - ConnectionLost and the like: one line
            raise StoreUnavailable(f"store {link.address}: {e}") from None

    def store_where(self, link=None) -> str:
        if not self.remote:
            return "embedded (lmqtt serve)"
        if link is None:
            link = getattr(self.gw, "link", None)
        return f"lmqtt://{link.address if link is not None else self.cfg.store_address}"

    # ------------------------------------------------------------------ announcing this console
    def start(self, bound_host: str, port: int) -> None:
        """Announce this console to the store (a fleet gateway; again after each reconnect)."""
        if not self.remote:
            return
        scheme = "https" if getattr(self.cfg, "console_tls", False) else "http"
        host = bound_host
        if host in ("0.0.0.0", "::", ""):
            host = self._route_address() or "127.0.0.1"
        self.url = f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"
        if scheme == "https":
            self.cert_sha256 = cert_fingerprint(self.cfg.cert)
        self.gw.link.on_reconnect(self._announce)
        self._announce()

    def _route_address(self) -> str | None:
        """The address this machine reaches the store from: what the peers can reach it at when the
        console listens on every address."""
        link = self.gw.link
        try:
            fam = socket.AF_INET6 if ":" in link.host else socket.AF_INET
            with socket.socket(fam, socket.SOCK_DGRAM) as s:       # no packet is sent
                s.connect((link.host, link.port))
                return s.getsockname()[0]
        except OSError:
            return None

    def _announce(self) -> None:
        link = self.gw.link
        if link is None or self.url is None:
            return
        extra = {"cert_sha256": self.cert_sha256} if self.cert_sha256 else {}
        fut = link.cmd("console_announce", gateway=self.gateway_id, url=self.url, token=self.token, **extra)

        def done(f) -> None:
            e = f.exception()
            if e is not None and not self._announce_warned:
                self._announce_warned = True
                log.warning("event=console_announce_failed store=%s error=%s (the other gateways' consoles "
                            "will not list this one)", link.address, e)
        fut.add_done_callback(done)

    # ------------------------------------------------------------------ the other gateways
    async def peers(self) -> tuple[list[dict], list[str]]:
        """(the other gateways' consoles, every connected gateway id), asked at most once a second."""
        if not self.remote:
            return [], []
        at, consoles, connected = self._peers
        if time.monotonic() - at < 1.0:
            return consoles, connected
        out = await self.call("console_peers")
        consoles = [c for c in out.get("consoles", []) if c.get("token") != self.token]
        connected = list(out.get("connected", []))
        self._peers = (time.monotonic(), consoles, connected)
        return consoles, connected

    def _connection(self, peer: dict) -> tuple[http.client.HTTPConnection, str]:
        """A connection to the peer's console, and its base path. Over HTTPS the peer's certificate
        is the one its gateway announced to the store (SHA-256 of its DER): the store is the
        trusted channel, so neither a CA nor a host name that matches the URL is needed (a fleet
        often shares one certificate, or a self-signed one, and peers are reached by address)."""
        u = urllib.parse.urlsplit(peer["url"])
        if u.scheme != "https":
            return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=PEER_TIMEOUT_S), u.path.rstrip("/")
        want = peer.get("cert_sha256")
        if not want:
            raise ConnectionError("it announced no certificate fingerprint (an older gateway): not asked over HTTPS")
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE          # checked below: the announced certificate, exactly
        c = http.client.HTTPSConnection(u.hostname, u.port or 443, timeout=PEER_TIMEOUT_S, context=ctx)
        c.connect()
        got = hashlib.sha256(c.sock.getpeercert(binary_form=True) or b"").hexdigest()
        if not secrets.compare_digest(got, want):
            c.close()
            raise ConnectionError(f"its certificate (sha256 {got[:16]}...) is not the one its gateway announced "
                                  f"({want[:16]}...)")
        return c, u.path.rstrip("/")

    def _http(self, peer: dict, path: str, body: dict | None) -> dict:
        try:
            c, base = self._connection(peer)
        except (OSError, ssl.SSLError, ValueError) as e:
            return {"error": f"console {peer['url']} unreachable: {e}", "status": 0}
        try:
            c.request("POST" if body is not None else "GET", base + path,
                      body=json.dumps(body).encode() if body is not None else None,
                      headers={PEER_HEADER: peer["token"], "Accept": "application/json",
                               "Content-Type": "application/json"})
            r = c.getresponse()
            raw = r.read()
            try:
                out = json.loads(raw)
            except ValueError:
                out = None
            if r.status != 200:
                why = out.get("error") if isinstance(out, dict) else None
                return {"error": why or f"HTTP {r.status}", "status": r.status}
            if not isinstance(out, dict):
                return {"error": f"console {peer['url']}: not a JSON answer", "status": 0}
            return out
        except (OSError, http.client.HTTPException) as e:
            return {"error": f"console {peer['url']} unreachable: {e}", "status": 0}
        finally:
            c.close()

    async def ask(self, peer: dict, path: str, body: dict | None = None) -> dict:
        """A peer console's /console/peer/* answer, or {"error": ..., "status": ...}."""
        return await asyncio.to_thread(self._http, peer, path, body)

    async def ask_all(self, path: str) -> list[tuple[dict, dict]]:
        consoles, _ = await self.peers()
        if not consoles:
            return []
        answers = await asyncio.gather(*(self.ask(p, path) for p in consoles))
        return list(zip(consoles, answers))


def cert_fingerprint(path: str | None) -> str | None:
    """SHA-256 (hex) of the first certificate in a PEM file: what a TLS server presents from it."""
    if not path:
        return None
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            m = re.search(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", f.read(), re.S)
    except OSError:
        return None
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(m.group(0))).hexdigest() if m else None
