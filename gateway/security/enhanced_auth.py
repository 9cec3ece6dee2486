"""MQTT 5 enhanced authentication (§4.12): the AUTH exchanges of a CONNECT that names an
Authentication Method, and of re-authentication on a live connection.

Why apart from the broker: the exchange is a small state machine of its own (challenge, response,
success or refusal, each with its own reason code), and the broker only needs to know where it
starts (a CONNECT with a method) and how it ends (the CONNECT goes on with an identity, or is
refused). The methods themselves are the authenticators' (gateway/security/auth.py: `ScramLogin` for
SCRAM-SHA-256, offered when the password file holds SCRAM verifiers); the state of an exchange in
progress is the connection's `auth_login`. Until CONNACK only AUTH or DISCONNECT may follow
(`Broker.handle_packet`), and a login that stalls is refused after `connect_timeout_s`: the
connection sweep (gateway/net/keepalive.py `ConnectionSweep`) finds it past its deadline and calls `timed_out`.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Callable

from lmqtt.gateway.security.auth import Credentials, Denied, certificate_subject
from lmqtt.gateway.mqtt import ProtocolError, ReasonCode as RC, packets as P

if TYPE_CHECKING:  # pragma: no cover
    from lmqtt.gateway.net.connection import MQTTConnection

log = logging.getLogger("lmqtt.gateway")


def peer_certificate_subject(conn) -> str | None:
    """The subject of the client certificate the connection presented over TLS, if any."""
    t = conn.transport
    if t is None:
        return None
    try:
        return certificate_subject(t.get_extra_info("peercert"))
    except Exception:
        return None


class EnhancedAuth:
    """`refuse(conn, rc, reason, cause)` answers a CONNECT with a failure CONNACK;
    `accept(conn, pkt, cid, assigned, identity, auth_reply)` goes on with the CONNECT once the
    exchange succeeded (`auth_reply`: the method and final data CONNACK carries)."""

    def __init__(self, auth, loop: asyncio.AbstractEventLoop,
                 refuse: Callable[..., None], accept: Callable[..., None], timeout_s: float = 0.0) -> None:
        self.auth = auth
        self.loop = loop
        self.refuse = refuse
        self.accept = accept
        self.timeout_s = timeout_s      # connect_timeout_s: the sweep's deadline, named in the refusals

    def timed_out(self, conn: "MQTTConnection") -> None:
        """The exchange in progress on `conn` missed its deadline (the connection sweep's call): a
        CONNECT's is refused with CONNACK 0x87, a re-authentication's closes the connection with
        DISCONNECT 0x87 (DISCONNECT has no 0x86)."""
        login = conn.auth_login
        if not conn.connected:
            return self.refuse(conn, RC.NOT_AUTHORIZED, "not authorized",
                               f"enhanced authentication ({login.method}) did not complete "
                               f"within connect_timeout_s ({self.timeout_s:g}s)")
        log.info("event=reauth_refused client_id=%s peer=%s reason_code=0x87 cause=%r", conn.client_id,
                 conn.peer, "re-authentication did not complete within connect_timeout_s")
        conn.auth_login = None
        conn.close_with_error(RC.NOT_AUTHORIZED, "re-authentication timed out")

    def begin(self, conn: "MQTTConnection", pkt: P.Connect, cid: str, assigned) -> None:
        """CONNECT with an Authentication Method: SCRAM-SHA-256 when a password file is configured
        (auth.ScramLogin), any other method 0x8C."""
        method = pkt.properties.authentication_method
        login = None
        if self.auth is not None:
            login = self.auth.enhanced_login(method, Credentials(cid, pkt.username, pkt.password,
                                                                 peer_certificate_subject(conn)))
        if login is None:
            return self.refuse(conn, RC.BAD_AUTHENTICATION_METHOD, "authentication method not supported",
                               f"authentication method {method[:64]!r} is not offered (SCRAM-SHA-256 "
                               f"needs --password-file with SCRAM verifiers)")
        login.pending = (pkt, cid, assigned)
        login.started_at = self.loop.time()
        conn.auth_login = login
        self._step(conn, pkt.properties.authentication_data or b"")

    def _step(self, conn: "MQTTConnection", data: bytes) -> None:
        login = conn.auth_login
        r = login.step(data)
        if isinstance(r, bytes):                 # a challenge: AUTH 0x18 (continue)
            a = P.Auth(RC.CONTINUE_AUTHENTICATION)
            a.properties.authentication_method = login.method
            a.properties.authentication_data = r
            conn.send(a)
            return
        conn.auth_login = None
        if login.pending is None:                # re-authentication of a live connection
            if isinstance(r, Denied):            # DISCONNECT has no 0x86: 0x87 for every failure
                log.info("event=reauth_refused client_id=%s peer=%s reason_code=0x87 cause=%r",
                         conn.client_id, conn.peer, r.reason)
                return conn.close_with_error(RC.NOT_AUTHORIZED, "re-authentication failed")
            a = P.Auth(RC.SUCCESS)
            a.properties.authentication_method = login.method
            a.properties.authentication_data = login.final_data
            conn.send(a)
            log.info("event=reauth client_id=%s user=%r", conn.client_id, r.username)
            return
        pkt, cid, assigned = login.pending
        if isinstance(r, Denied):
            rc = r.code or RC.NOT_AUTHORIZED
            return self.refuse(conn, rc, "bad user name or password" if rc == RC.BAD_USER_NAME_OR_PASSWORD
                               else "not authorized", r.reason)
        conn.auth_method = login.method
        self.accept(conn, pkt, cid, assigned, r, (login.method, login.final_data))

    def on_auth(self, conn, pkt: P.Auth) -> None:
        """AUTH from the client: the next step of the exchange in progress, or (0x19) the start of
        a re-authentication with the method the connection logged in with."""
        login = conn.auth_login
        rc = pkt.reason_code
        method = pkt.properties.authentication_method
        if login is None:
            if conn.auth_method is None:
                raise ProtocolError("AUTH on a connection that did not log in with an authentication "
                                    "method", RC.PROTOCOL_ERROR)
            if rc != RC.RE_AUTHENTICATE:
                raise ProtocolError(f"AUTH 0x{rc:02X} with no authentication exchange in progress",
                                    RC.PROTOCOL_ERROR)
            if method != conn.auth_method:
                raise ProtocolError(f"re-authentication with method {method!r}, the connection used "
                                    f"{conn.auth_method!r}", RC.PROTOCOL_ERROR)
            ident = conn.identity
            login = self.auth.enhanced_login(method, Credentials(conn.client_id, None, None,
                                                                 peer_certificate_subject(conn)),
                                             username=ident.username if ident is not None else None)
            if login is None:
                return conn.close_with_error(RC.BAD_AUTHENTICATION_METHOD, f"{method} is no longer offered")
            login.started_at = self.loop.time()
            conn.auth_login = login
            return self._step(conn, pkt.properties.authentication_data or b"")
        if rc != RC.CONTINUE_AUTHENTICATION:
            raise ProtocolError(f"AUTH 0x{rc:02X} in the middle of an authentication exchange "
                                f"(expected 0x18 continue)", RC.PROTOCOL_ERROR)
        if method != login.method:
            raise ProtocolError(f"AUTH with method {method!r} during a {login.method} exchange",
                                RC.PROTOCOL_ERROR)
        self._step(conn, pkt.properties.authentication_data or b"")
