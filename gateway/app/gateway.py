"""The gateway process: the broker and its MQTT listeners over a store.

`Gateway(cfg)` is what `lmqtt serve` and `lmqtt gateway` run and what tests may build in-process.
`lmqtt serve` is a gateway over an in-process store node (store/node/embedded.py opens the store,
the light queues and the notify bus and hands over the storage facades); `lmqtt gateway` is the
same broker over a `RemoteStore`. The store is opened first and the listeners last; stop is the
reverse, with the broker persisting sessions/offsets before the store flushes and closes. This
module never imports the engine, the light queues or RocksDB (tests/architecture/test_layering.py).
"""
from __future__ import annotations

import asyncio
import logging
import resource
import socket
from functools import partial

from lmqtt.gateway.integrations.wiring import Integrations
from lmqtt.gateway.app.config import GatewayConfig
from lmqtt.gateway.app.metrics import GatewayMetrics
from lmqtt.gateway.broker.broker import Broker
from lmqtt.gateway.broker.limits import ConnectionGate, Limits
from lmqtt.gateway.broker.sys_topics import SysTopics
from lmqtt.gateway.net.connection import MQTTConnection
from lmqtt.notify.redis_bus import RedisEventSubscriber
from lmqtt.store.loopback import is_loopback

log = logging.getLogger("lmqtt.gateway")


class SecurityConfigError(Exception):
    """A listener/authentication/ACL setting that cannot work; the message names the cause."""


class ListenerError(Exception):
    """A listener could not be opened; the message names the listener, address and reason."""


def build_security(cfg: GatewayConfig):
    """(ssl context or None, AuthChain or None, AclFile or None) from the configuration.

    `None` for the chain means "no authentication configured and anonymous clients are fine here"
    (a loopback host, or `allow_anonymous`): CONNECT then pays nothing for authentication.
    """
    # TLS, authentication and the ACL are imported only when configured: a plain `lmqtt serve`
    # starts without them (the start's imports count in a restart)
    ctx = None
    if cfg.tls_port or cfg.wss_port:
        from lmqtt.gateway.net.tls import TlsConfigError, server_context  # TLS only, when configured
        try:
            ctx = server_context(cfg.cert, cfg.key, cfg.cafile, bool(cfg.require_certificate))
        except TlsConfigError as e:
            raise SecurityConfigError(str(e)) from None
    authenticators: list = []
    if (cfg.cafile and ctx is not None) or cfg.password_file or cfg.hmac_keys or cfg.jwt_secret or cfg.jwt_public_key \
            or cfg.live_security:
        authenticators = _authenticators(cfg, ctx)
    if not authenticators and not cfg.auth_http and not cfg.allow_anonymous and not is_loopback(cfg.host):
        raise SecurityConfigError(
            f"refusing to listen on {cfg.host} (not loopback) without authentication: anyone who can "
            f"reach it could publish and subscribe. Configure --password-file (or --hmac-keys, "
            f"--jwt-secret, --cafile with --require-certificate, --auth-http, --live-security), or pass "
            f"--allow-anonymous to accept anonymous clients on purpose")
    http = None
    if cfg.auth_http:      # the user's HTTP service, asked first (gateway/security/http_auth.py)
        from lmqtt.gateway.security.http_auth import HttpAuthService  # only when configured
        http = HttpAuthService(cfg.auth_http, cfg.auth_http_timeout_s, cfg.auth_http_cache_s)
    chain = None
    if authenticators or http is not None:
        from lmqtt.gateway.security.auth import AuthChain  # only when configured
        chain = AuthChain(authenticators, bool(cfg.allow_anonymous), http=http)
    acl = None
    if cfg.acl_file:
        from lmqtt.gateway.security.acl import AclError, AclFile  # only when configured
        try:
            acl = AclFile(cfg.acl_file)
        except AclError as e:
            raise SecurityConfigError(str(e)) from None
    live = next((a for a in authenticators if a.name == "live"), None)
    if http is not None or live is not None:    # the ACL sources in order (gateway/security/acl_chain.py)
        from lmqtt.gateway.security.acl_chain import AclChain  # only when configured
        acl = AclChain(acl, http, live)
    return ctx, chain, acl


def _authenticators(cfg: GatewayConfig, ctx) -> list:
    # only when configured
    from lmqtt.gateway.security.auth import AuthError, ClientCertificate, HmacSignature, JwtToken, PasswordFile
    authenticators: list = []
    try:
        if cfg.cafile and ctx is not None:
            authenticators.append(ClientCertificate())   # a verified certificate names the user
        if cfg.password_file:
            authenticators.append(PasswordFile(cfg.password_file))
        if cfg.live_security:       # users kept in the store (gateway/security/live.py)
            from lmqtt.gateway.security.live import LiveSecurity  # only when configured
            authenticators.append(LiveSecurity())
        if cfg.hmac_keys:
            authenticators.append(HmacSignature(cfg.hmac_keys))
        if cfg.jwt_secret or cfg.jwt_public_key:
            authenticators.append(JwtToken(secret=cfg.jwt_secret, public_key_file=cfg.jwt_public_key))
    except AuthError as e:
        raise SecurityConfigError(str(e)) from None
    except OSError as e:
        raise SecurityConfigError(f"cannot read {e.filename}: {e.strerror or e}") from None
    return authenticators


# why a TLS handshake failed, from the ssl module's reason: (cause label, what to tell the operator)
_TLS_CAUSES = {
    "WRONG_VERSION_NUMBER": ("not_tls", "not TLS: the client sent plain MQTT (or another protocol) to the TLS port"),
    "UNKNOWN_PROTOCOL": ("not_tls", "not TLS: the client sent plain MQTT (or another protocol) to the TLS port"),
    "HTTP_REQUEST": ("not_tls", "not TLS: the client sent a plain HTTP request to the TLS port"),
    "RECORD_LAYER_FAILURE": ("not_tls", "not TLS: the client sent plain data to the TLS port"),
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": ("no_client_certificate",
                                          "the client sent no certificate and --require-certificate is set"),
    "CERTIFICATE_VERIFY_FAILED": ("client_certificate_untrusted",
                                  "the client's certificate is not signed by --cafile (or expired)"),
    "TLSV1_ALERT_UNKNOWN_CA": ("server_certificate_rejected", "the client does not trust our certificate"),
    "SSLV3_ALERT_BAD_CERTIFICATE": ("server_certificate_rejected", "the client rejected our certificate"),
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": ("server_certificate_rejected", "the client rejected our certificate"),
    "UNSUPPORTED_PROTOCOL": ("tls_version", "no TLS version in common (we accept TLS 1.2 and 1.3)"),
    "NO_SHARED_CIPHER": ("tls_version", "no cipher in common"),
}


def tls_failure_cause(exc: BaseException) -> tuple[str, str]:
    """(cause label, explanation) of a failed TLS handshake."""
    import ssl  # only TLS, when configured
    if isinstance(exc, ssl.SSLError):
        return _TLS_CAUSES.get(exc.reason or "", ("tls_error", f"TLS error {exc.reason or exc}"))
    # uvloop reports its ssl_handshake_timeout as a ConnectionAbortedError whose message says the
    # handshake is "taking longer" than the timeout: a third-party message with no class of its
    # own, so it is matched by text (asyncio raises TimeoutError)
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)) or (
            isinstance(exc, ConnectionAbortedError) and "taking longer" in str(exc)):
        return "handshake_timeout", "no TLS handshake within connect_timeout_s"
    return "connection_lost", f"the client left during the handshake ({type(exc).__name__})"


class _Resume:
    """Awaits the rest of a coroutine whose first step already ran (see `TlsAcceptor`)."""

    __slots__ = ("it", "first")

    def __init__(self, it, first) -> None:
        self.it, self.first = it, first

    def __await__(self):
        it, y = self.it, self.first
        while True:
            try:
                sent = yield y
            except GeneratorExit:
                it.close()
                raise
            except BaseException as e:  # noqa: BLE001 - thrown into the coroutine as a Task would
                try:
                    y = it.throw(e)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    y = it.send(sent)
                except StopIteration as stop:
                    return stop.value


class TlsAcceptor(asyncio.Protocol):
    """A TLS listener's socket until its handshake is done; then the MQTT (or WebSocket) protocol
    takes over the TLS transport.

    Why not `create_server(ssl=...)`: there a failed handshake is silent (asyncio and uvloop log it
    only in debug mode), so an operator never learns that a device speaks plain MQTT to the TLS port
    or presents an untrusted certificate. Here `loop.start_tls` runs the handshake and a failure is
    logged with its cause (`event=tls_handshake_failed ... cause=not_tls`) and counted
    (`lmqtt_tls_handshake_failures_total{cause}`). start_tls's first step (switching the socket to
    the TLS protocol) runs inside `connection_made`, before any byte can be read, and the rest is
    awaited in a task (`_Resume`).
    """

    def __init__(self, gateway: "Gateway", factory, ctx, listener: str) -> None:
        self.gw, self.factory, self.ctx, self.listener = gateway, factory, ctx, listener

    def connection_made(self, transport) -> None:  # type: ignore[override]
        loop = asyncio.get_running_loop()
        pn = transport.get_extra_info("peername")
        peer = f"{pn[0]}:{pn[1]}" if pn else "?"
        gw = self.gw
        gate = gw.broker.gate if gw.broker is not None else None
        if gate is not None and pn and gate.over_connect_rate(pn[0]):
            # over its connect rate: refused before the handshake (no CONNACK can be sent without
            # one); within the rate the MQTT connection's own admission takes the token
            gw.metrics.connect_refused.labels(reason="0x9F").inc()
            left_out = gate.log_allowed()
            if left_out is not None:
                log.warning("event=connect_refused peer=%s reason_code=none cause=connect_rate_per_address limit=%s "
                            "reason='closed before the TLS handshake (listener %s)'%s", peer,
                            gate.limits.connect_rate_per_address, self.listener,
                            f" suppressed={left_out}" if left_out else "")
            transport.abort()
            return
        proto = self.factory()
        try:
            it = loop.start_tls(transport, proto, self.ctx, server_side=True,
                                ssl_handshake_timeout=max(1.0, float(self.gw.cfg.connect_timeout_s))).__await__()
            first = it.send(None)
        except StopIteration as stop:      # cannot happen (start_tls awaits the handshake), but be exact
            proto.connection_made(stop.value)
            return
        except Exception as e:  # noqa: BLE001
            self._failed(e, peer, transport)
            return
        loop.create_task(self._finish(it, first, proto, peer, transport))

    async def _finish(self, it, first, proto, peer: str, transport) -> None:
        try:
            tls = await _Resume(it, first)
        except Exception as e:  # noqa: BLE001 - every failure is the client's handshake; logged
            self._failed(e, peer, transport)
            return
        if tls is None or tls.is_closing():
            # uvloop may complete start_tls for a peer that closed during the handshake
            self._failed(ConnectionResetError("closed during the TLS handshake"), peer, transport)
            return
        proto.connection_made(tls)

    def _failed(self, exc: BaseException, peer: str, transport) -> None:
        cause, why = tls_failure_cause(exc)
        gw = self.gw
        gw.tls_failures[cause] = gw.tls_failures.get(cause, 0) + 1
        gate = gw.broker.gate if gw.broker is not None else None
        left_out = gate.log_allowed() if gate is not None else 0
        if left_out is not None:
            # a peer that connects and leaves without a handshake is what TCP health checks of a
            # load balancer do: counted, logged at debug only
            log.log(logging.DEBUG if cause == "connection_lost" else logging.WARNING,
                    "event=tls_handshake_failed listener=%s peer=%s cause=%s reason=%r error=%r%s", self.listener,
                    peer, cause, why, str(exc)[:200], f" suppressed={left_out}" if left_out else "")
        if not transport.is_closing():
            transport.abort()


class Gateway:
    def __init__(self, cfg: GatewayConfig, metrics: GatewayMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or GatewayMetrics()
        self.embedded = None        # `lmqtt serve`: the in-process store node (store/node/embedded.py)
        self.broker: Broker | None = None
        self.server: asyncio.base_events.Server | None = None
        self.address: tuple[str, int] | None = None
        self.servers: list = []                            # every listener's asyncio Server
        self.listeners: dict[str, tuple[str, int]] = {}    # "mqtt", "mqtts", "ws", "wss" -> address
        self.ssl_context = self.auth = self.acl = None
        self.link = None            # remote: the store connection (gateway/storage/store_link.py)
        self.more_links: list = []  # remote over several store groups: the other groups' links
        self.storage = None         # remote: the RemoteStore
        self.group_leases = None    # remote: who delivers each shared group
        self.redis_events = None    # remote with Redis notify: the RedisEventSubscriber
        self.sessions_directory = None   # remote: client id claims across the fleet (Redis or the store)
        self.tls_failures: dict[str, int] = {}   # TLS handshake failures by cause (TlsAcceptor)
        self.integrations: Integrations | None = None   # events, bridges, live security (gateway/integrations/)

    @property
    def remote(self) -> bool:
        return bool(self.cfg.store_address)

    # the embedded node's engine objects, for in-process tests: the gateway itself reaches the
    # store through `embedded.storage` (the facades) only
    @property
    def store(self):
        return self.embedded.store if self.embedded is not None else None

    @property
    def lq(self):
        return self.embedded.lq if self.embedded is not None else None

    @property
    def bus(self):
        return self.embedded.bus if self.embedded is not None else None

    async def start(self) -> None:
        if self.remote:
            await self._start_remote()
            return
        # lmqtt serve only: the engine; a fleet gateway never loads it
        from lmqtt.store.node.embedded import open_embedded

        cfg = self.cfg
        loop = asyncio.get_running_loop()
        # settings that cannot work are refused before the store is opened
        self.ssl_context, self.auth, self.acl = build_security(cfg)
        self.embedded = node = open_embedded(cfg, loop)
        try:
            self.integrations = Integrations(self)
            self.broker = Broker(cfg, node.storage, loop, self.metrics, auth=self.auth,
                                 acl=self.acl, gate=self._new_gate(), append_listener=node.append_listener)
            self.integrations.attach(self.broker)
            node.attach(self.broker.publisher.flush, self.broker.delivery.on_queues)
            self.broker.start()
            await self._listen(loop)
            await self.integrations.start()
        except BaseException:
            for srv in self.servers:
                srv.close()
            self._close_storage()
            raise
        self._start_sys_topics(loop)

    async def _start_remote(self) -> None:
        """`lmqtt gateway`: the same broker over a `RemoteStore` (docs/fleet.md). Refuses to start
        while the store cannot be reached: a gateway that accepted clients it cannot serve would
        only fail their publishes."""
        from lmqtt.gateway.fleet.sessions import FleetSessionRegistry  # a fleet gateway only
        from lmqtt.gateway.storage.remote_store import RemoteStore  # a fleet gateway only
        from lmqtt.gateway.storage.store_link import LoopConnection  # a fleet gateway only (its store link)
        from lmqtt.store.client.groups import group_names, split_groups  # a fleet gateway only

        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self.ssl_context, self.auth, self.acl = build_security(cfg)
        mode = cfg.notify_mode or ("broadcast" if cfg.redis else "native")
        gid = cfg.gateway_id or f"{socket.gethostname()}:{cfg.port}"
        # several store groups (docs/groups.md "The gateway"): a link and a RemoteStore per group
        groups = split_groups(cfg.store_address) if ";" in cfg.store_address else [cfg.store_address]
        links = [LoopConnection(g, loop=loop, token=cfg.token, client_name=f"lmqtt-gateway {gid}") for g in groups]
        self.link, self.more_links = links[0], links[1:]
        await loop.run_in_executor(None, lambda: None)   # the default executor exists before any redial
        for link in links:
            link.connect_blocking()
        try:
            # (the push counters on /metrics: the first group's; the others' are summed into the
            # lmqtt_remote_* counters below)
            stores = [RemoteStore(link, gid, self.metrics if k == 0 else None, safety_poll_s=cfg.safety_poll_ms / 1000.0,
                                  watch=(mode == "native"),
                                  # the same budget as the embedded delivery ring, shared by the groups
                                  mirror_bytes=(int(cfg.lq_cache_mb) << 20) // 4 // len(links))
                      for k, link in enumerate(links)]
            if len(stores) == 1:
                self.storage = stores[0]
            else:
                from lmqtt.gateway.storage.grouped_queues import GroupedQueues  # several groups only
                from lmqtt.gateway.storage.grouped_metadata import grouped_storage  # several groups only
                from lmqtt.gateway.storage.topic_owners import TopicOwners  # several groups only
                names = group_names([link.server_info for link in links], groups, cfg.store_address)
                owners = TopicOwners(links[0], names, groups, cfg.store_address)
                grouped = GroupedQueues(owners, stores, loop)
                grouped.metadata = grouped_storage(owners, [st.metadata for st in stores], grouped)
                self.storage = grouped
            if mode in ("broadcast", "precise"):
                self.redis_events = RedisEventSubscriber(cfg.redis, gid, mode, safety_poll_s=cfg.safety_poll_ms / 1000.0)
                self.redis_events.subscribe(self.storage.heard_names)
                self.redis_events.on_resync(self.storage.poll)
                if mode == "precise":
                    ev = self.redis_events
                    self.storage.on_track = lambda q: ev.watch_later((q,))
                    self.storage.on_forget = ev.unwatch_later
                await self.redis_events.start()
            # the safety poll runs in every mode: the Redis subscriber's own resync stops while
            # Redis is down, which is exactly when events are being lost
            self.storage.start()
            self._remote_metrics()
            self.integrations = Integrations(self)
            self.broker = Broker(cfg, self.storage.metadata, loop, self.metrics, auth=self.auth, acl=self.acl,
                                 session_registry_cls=FleetSessionRegistry,
                                 gate=self._new_gate(), gateway_id=gid)
            self.integrations.attach(self.broker)
            self.storage.on_new_data(self.broker.delivery.on_queues)
            delivery = self.broker.delivery
            # (a shared group's messages come from the store's assignment, not from a mirror)
            self.storage.is_served = lambda q: q in delivery.direct
            # shared subscriptions: the store hands each message to one gateway (gateway/fleet/group_leases.py)
            from lmqtt.gateway.fleet.group_leases import FleetGroups
            from lmqtt.gateway.storage.remote_groups import GroupedRemoteGroups, RemoteGroups  # a fleet gateway only
            leases = (RemoteGroups(self.link, gid) if len(stores) == 1
                      else GroupedRemoteGroups([RemoteGroups(link, gid) for link in links], self.storage.owners))
            self.group_leases = FleetGroups(leases, delivery, loop,
                                            ttl_s=max(1.0, 3 * cfg.safety_poll_ms / 1000.0),
                                            tick_s=max(0.2, cfg.safety_poll_ms / 1000.0))
            self.group_leases.start()
            # one live connection per client id across the fleet (gateway/fleet/sessions.py): claims over
            # Redis when there is one, else relayed by the store
            from lmqtt.gateway.fleet.sessions import SessionDirectory, StoreSessionDirectory
            reg = self.broker.session_registry
            if cfg.redis:
                self.sessions_directory = SessionDirectory(cfg.redis, gid, reg.release_to_other_gateway)
            else:
                self.sessions_directory = StoreSessionDirectory(loop, self.storage.metadata.sessions,
                                                                reg.release_to_other_gateway)
            reg.directory = self.sessions_directory
            await self.sessions_directory.start()
            self.broker.start()
            await self._listen(loop)
            await self.integrations.start()
        except BaseException:
            for srv in self.servers:
                srv.close()
            await self._close_remote()
            raise
        self._start_sys_topics(loop, f"$SYS/broker/gateways/{gid}/")
        log.info("event=gateway_started store=%s gateway_id=%s notify=%s", cfg.store_address, gid, mode)

    def _remote_metrics(self) -> None:
        """The remote seam's counters on /metrics: pulls that crossed the network (one per queue
        per event however many local sessions read it), blocking reads behind the mirror, EVENT
        frames heard, safety polls, store reconnects and whether the store is connected now."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # only with the metrics port open
        gw = self

        class _Collector:
            def collect(self):
                st, link = gw.storage, gw.link
                if st is None:
                    return
                for name, help_, v in (("lmqtt_remote_pulls", "Light-queue reads the store made for this gateway (pulls and pushed batches)", st.remote_pulls),
                                       ("lmqtt_remote_pull_misses", "Reads behind the local mirror (a reader further back than it holds)", st.remote_misses),
                                       ("lmqtt_remote_events", "EVENT frames heard from the store", st.events),
                                       ("lmqtt_remote_safety_polls", "Safety polls of the served queues", st.polls),
                                       ("lmqtt_remote_reconnects", "Reconnects to the store",
                                        link.reconnects if link is not None else 0)):
                    yield CounterMetricFamily(name, help_, value=v)
                d = gw.sessions_directory
                for name, help_, v in (
                        ("lmqtt_session_claims_sent", "Client id claims this gateway announced (one per attached connection)",
                         d.claims_sent if d is not None else 0),
                        ("lmqtt_session_claims_heard", "Client id claims of other gateways heard",
                         d.claims_heard if d is not None else 0),
                        ("lmqtt_session_claim_errors", "Claims that could not be announced (the old connection elsewhere stays)",
                         d.errors if d is not None else 0),
                        ("lmqtt_takeovers_by_other_gateway", "Connections closed (0x8E) for a newer one on another gateway",
                         gw.broker.session_registry.taken_over_elsewhere if gw.broker is not None else 0)):
                    yield CounterMetricFamily(name, help_, value=v)
                fg = gw.group_leases
                for name, help_, v in (
                        ("lmqtt_group_pops", "Shared-group messages asked of the store (gw_group_pop requests)",
                         fg.pops if fg is not None else 0),
                        ("lmqtt_group_messages_assigned", "Shared-group messages the store handed to this gateway",
                         fg.received if fg is not None else 0),
                        ("lmqtt_group_messages_handed_back", "Shared-group messages handed back to the store "
                         "(no member here could take them)", fg.handed_back if fg is not None else 0)):
                    yield CounterMetricFamily(name, help_, value=v)
                ev = gw.redis_events
                yield CounterMetricFamily("lmqtt_remote_redis_events", "Event messages heard on Redis pub/sub",
                                          value=ev.events_received if ev is not None else 0)
                yield GaugeMetricFamily("lmqtt_remote_store_connected", "1 while connected to the store",
                                        value=1 if link is not None and link.connected else 0)
                yield GaugeMetricFamily("lmqtt_remote_mirrored_queues", "Queues mirrored locally",
                                        value=len(st.queues))
                yield GaugeMetricFamily("lmqtt_remote_mirror_bytes", "Payload bytes held by the mirrors",
                                        value=st.mirrored_bytes)

        self.metrics.registry.register(_Collector())

    async def _close_remote(self) -> None:
        if self.group_leases is not None:
            self.group_leases.close()
        if self.storage is not None:
            self.storage.close()
        if self.sessions_directory is not None:
            try:
                await self.sessions_directory.close()
            except Exception as e:  # noqa: BLE001
                log.error("event=session_directory_close_failed error=%r", e)
            self.sessions_directory = None
        if self.redis_events is not None:
            try:
                await self.redis_events.close()
            except Exception as e:  # noqa: BLE001
                log.error("event=redis_close_failed error=%r", e)
            self.redis_events = None
        if self.link is not None:
            self.link.close()
            self.link = None
        for link in self.more_links:
            link.close()
        self.more_links = []

    def _new_gate(self):
        """The connection and rate limits (gateway/broker/limits.py) the broker and its connections apply."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        share = self.embedded.open_files_share if self.embedded is not None else 0
        return ConnectionGate(Limits.from_config(self.cfg), open_files=(soft, share))

    def files_line(self) -> str:
        """The banner's line on open files: the store's share and the client sockets admitted."""
        gate = self.broker.gate
        limit, share = gate.open_files or (0, 0)
        store = f"store {share} of {limit} open files, " if share else f"limit {limit} open files, "
        return f"{store}client connections up to {gate.socket_cap} (then CONNACK 0x97)"

    def _install_limits(self) -> None:
        """The counters of the broker's connection and rate limits on /metrics:
        lmqtt_limit_hits_total{limit}, lmqtt_tls_handshake_failures_total{cause},
        lmqtt_limit_refused_sockets_waiting."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # only with the metrics port open

        gate = self.broker.gate
        gw = self

        class _Collector:
            def collect(self):
                c = CounterMetricFamily("lmqtt_limit_hits", "Times a limit refused or slowed a client "
                                        "(connections: refused sockets; publish rate: read pauses)", labels=["limit"])
                for name, v in gate.hits.items():
                    c.add_metric([name], v)
                yield c
                t = CounterMetricFamily("lmqtt_tls_handshake_failures", "Failed TLS handshakes", labels=["cause"])
                for name, v in gw.tls_failures.items():
                    t.add_metric([name], v)
                yield t
                yield GaugeMetricFamily("lmqtt_limit_refused_sockets_waiting",
                                        "Refused sockets waiting for their CONNECT to be answered",
                                        value=gate.refused_pending)

        self.metrics.registry.register(_Collector())

    async def _listen(self, loop) -> None:
        cfg = self.cfg
        broker = self.broker
        self._install_limits()

        def mqtt():
            return MQTTConnection(broker)

        def ws():
            return WebSocketProtocol(mqtt, path="/mqtt", max_message_bytes=cfg.max_packet_size)

        if cfg.ws_port or cfg.wss_port:     # wsproto: imported only with a WebSocket listener
            from lmqtt.gateway.net.websocket import WebSocketProtocol  # a WebSocket listener only

        plan = [("mqtt", cfg.port, mqtt, None)]
        if cfg.tls_port:
            plan.append(("mqtts", cfg.tls_port, mqtt, self.ssl_context))
        if cfg.ws_port:
            plan.append(("ws", cfg.ws_port, ws, None))
        if cfg.wss_port:
            plan.append(("wss", cfg.wss_port, ws, self.ssl_context))
        for name, port, factory, ctx in plan:
            if ctx is not None:
                factory = partial(TlsAcceptor, self, factory, ctx, name)
            try:
                srv = await loop.create_server(factory, cfg.host, port, reuse_address=True, backlog=1024,
                                               reuse_port=bool(cfg.reuse_port) or None)
            except OSError as e:
                what = {"mqtt": "", "mqtts": "TLS ", "ws": "WebSocket ", "wss": "secure WebSocket "}[name]
                flag = {"mqtt": "--port", "mqtts": "--tls-port", "ws": "--ws-port", "wss": "--wss-port"}[name]
                raise ListenerError(f"cannot listen on {what}{cfg.host}:{port} ({flag}): {e.strerror or e}") from None
            self.servers.append(srv)
            self.listeners[name] = srv.sockets[0].getsockname()[:2]
            if name == "mqtt":
                self.server = srv
        self.address = self.listeners["mqtt"]

    # ------------------------------------------------------------------------------ $SYS
    def _start_sys_topics(self, loop, prefix: str = "$SYS/broker/") -> None:
        """Publish `$SYS/...` (gateway/broker/sys_topics.py) every `sys_interval` seconds, retained,
        from memory (the broker's `sys_retained`: never appended to the store)."""
        if not self.cfg.sys_interval or self.cfg.sys_interval <= 0:
            return
        publish = self.broker.sys_retained.publish
        try:
            from importlib.metadata import version  # only --version and the banners (~8 ms of every start otherwise)
            ver = version("lmqtt")
        except Exception:  # noqa: BLE001 - a source tree without metadata
            ver = "unknown"
        self.sys_topics = SysTopics(self._sys_stats, publish, version=ver, prefix=prefix)

        def tick() -> None:
            try:
                self.sys_topics.tick()
            except Exception as e:  # noqa: BLE001 - $SYS must never take the gateway down
                log.warning("event=sys_topics_failed error=%r", e)
            self._sys_handle = loop.call_later(self.cfg.sys_interval, tick)
        self._sys_handle = loop.call_soon(tick)

    def _sys_stats(self) -> dict:
        b, m = self.broker, self.metrics
        connected = m.connections
        sessions = b.session_registry.sessions
        known = b.session_registry.count()       # with those restored dormant (not built yet)
        totals = {}
        for fam in m.registry.collect():
            if fam.name in ("lmqtt_dropped_messages", "lmqtt_connects"):
                totals[fam.name] = sum(x.value for x in fam.samples if x.name.endswith("_total"))
        received, sent = sum(m.msg_in), sum(m.msg_out)
        return {"connected": connected, "disconnected": max(0, known - connected),
                "messages_received": received, "messages_sent": sent,
                "publish_received": received, "publish_sent": sent,
                "publish_dropped": totals.get("lmqtt_dropped_messages", 0),
                "bytes_received": m.bytes_in, "bytes_sent": m.bytes_out,
                "subscriptions": sum(s.subscription_count() for s in sessions.values())     # and the dormant's
                + sum(len(d.subs) // 2 for d in b.session_registry.dormant.values()),
                "connects": totals.get("lmqtt_connects", 0)}

    def reload_security(self) -> None:
        """SIGHUP: re-read the password/keys files and the ACL; connections stay. A file that does
        not parse keeps its previous rules (logged)."""
        if self.broker is not None:
            self.broker.reload_security()

    async def stop(self) -> None:
        """Stop accepting, close sessions (persisting offsets), flush and close the store."""
        if getattr(self, "_sys_handle", None) is not None:
            self._sys_handle.cancel()
        if self.integrations is not None:        # bridges first: their local sessions end cleanly
            await self.integrations.stop()
        for srv in self.servers:
            srv.close()
        if self.broker is not None:
            await self.broker.shutdown()
        for srv in self.servers:
            try:
                await asyncio.wait_for(srv.wait_closed(), 2.0)
            except (asyncio.TimeoutError, Exception):
                pass
        if self.remote:
            await self._close_remote()
            return
        self._close_storage()

    def _close_storage(self) -> None:
        if self.embedded is not None:
            self.embedded.close()
            self.embedded = None
