"""The console's routes (Starlette) and /metrics, /healthz, /readyz on the same port."""
from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import secrets
from urllib.parse import quote

from prometheus_client import make_asgi_app
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, RedirectResponse, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from . import data, store_reads
from .auth import COOKIE, ConsoleAuth, Session
from .fleet import PEER_HEADER, Fleet, StoreUnavailable

log = logging.getLogger("lmqtt.console")
STATIC = pathlib.Path(__file__).parent / "static"
_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
            "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-store"}


class ConsoleState:
    def __init__(self, gw, cfg, bound_host: str, fleet: Fleet) -> None:
        self.gw, self.cfg, self.fleet = gw, cfg, fleet
        self.auth = ConsoleAuth(cfg, bound_host)
        self.sampler = data.Sampler(gw, (lambda: fleet.call("stats")) if fleet.remote else None)
        self.stopping = asyncio.Event()
        self.sdk = None       # lmqtt serve's SDK store server (its CALL handlers), when it listens
        why = self.auth.why_no_login()
        if why:
            log.warning("event=console_login_impossible reason=%r", why)

    def start_sampler(self) -> None:
        self.sampler.start()

    def stop(self) -> None:
        self.stopping.set()
        self.sampler.stop()


def _quote(q: str) -> str:
    return quote(q, safe="")


def _json(obj, status: int = 200) -> JSONResponse:
    return JSONResponse(obj, status_code=status, headers=_HEADERS)


def build_app(gw, cfg, bound_host: str, ready=None, fleet: Fleet | None = None):
    fleet = fleet or Fleet(gw, cfg)
    st = ConsoleState(gw, cfg, bound_host, fleet)
    auth = st.auth
    _local = Session("local", "admin")
    _local.csrf = None          # never matches a header: actions need a real session
    secure_cookie = bool(getattr(cfg, "console_tls", False))   # over plain HTTP a Secure cookie never comes back

    def who(request: Request):
        s = auth.session_of(request.cookies.get(COOKIE))
        if s is None and not auth.login_required:
            # loopback without a login: a page kept open across a restart goes on reading (an
            # action still needs the CSRF token of a session from /console/api/me: a reload)
            s = _local
        return s

    def need(request: Request, role: str | None = None):
        """The session, or the refusal to return."""
        s = who(request)
        if s is None:
            return None, _json({"error": "login required", "login": True, "why": auth.why_no_login()}, 401)
        if role == "admin" and s.role != "admin":
            return None, _json({"error": f"user {s.user!r} has the read-only role: this needs the admin role"}, 403)
        return s, None

    def action(request: Request, s) -> JSONResponse | None:
        """CSRF: an action carries the session's token in X-CSRF-Token (a page of another site
        cannot read it, and SameSite=Strict keeps the cookie off its requests anyway)."""
        if s.csrf is None or request.headers.get("x-csrf-token") != s.csrf:
            log.warning("event=console_action_refused user=%s reason=csrf path=%s", s.user, request.url.path)
            return _json({"error": "missing or wrong CSRF token: reload the page"}, 403)
        return None

    async def healthz(request: Request):
        return PlainTextResponse("ok\n")

    async def readyz(request: Request):
        if ready is not None:             # a fleet gateway: its own rule (gateway_command._Health)
            ok, why = ready()
            return PlainTextResponse(why + "\n", status_code=200 if ok else 503)
        b = gw.broker
        if b is None or not b.accepting:
            return PlainTextResponse("not accepting MQTT clients\n", status_code=503)
        return PlainTextResponse("ready\n")

    async def root(request: Request):
        return RedirectResponse("/console/", status_code=302)

    async def index(request: Request):
        return FileResponse(STATIC / "index.html", headers=_HEADERS)

    async def me(request: Request):
        s = auth.session_of(request.cookies.get(COOKIE))
        if s is None and not auth.login_required:
            token = auth.open("local", "admin")
            s = auth.session_of(token)
            resp = _json({"user": s.user, "role": s.role, "csrf": s.csrf, "login_required": False})
            resp.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=secure_cookie, path="/")
            return resp
        if s is None:
            return _json({"error": "login required", "login": True, "why": auth.why_no_login()}, 401)
        return _json({"user": s.user, "role": s.role, "csrf": s.csrf, "login_required": auth.login_required})

    async def login(request: Request):
        try:
            body = await request.json()
            user, password = str(body["user"]), str(body["password"])
        except (ValueError, KeyError, TypeError):
            return _json({"error": "send {\"user\": ..., \"password\": ...}"}, 400)
        why = auth.why_no_login()
        if why:
            return _json({"error": why}, 403)
        role, why = await asyncio.to_thread(auth.check_password, user, password)
        peer = request.client.host if request.client else "?"
        if role is None:
            log.warning("event=console_login_refused user=%s peer=%s reason=%r", user, peer, why)
            return _json({"error": why}, 403)
        log.info("event=console_login user=%s role=%s peer=%s", user, role, peer)
        token = auth.open(user, role)
        s = auth.session_of(token)
        resp = _json({"user": user, "role": role, "csrf": s.csrf, "login_required": True})
        resp.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=secure_cookie, path="/",
                        max_age=8 * 3600)
        return resp

    async def logout(request: Request):
        s, refused = need(request)
        if refused:
            return refused
        if (r := action(request, s)) is not None:
            return r
        auth.sessions.pop(request.cookies.get(COOKIE), None)
        log.info("event=console_logout user=%s", s.user)
        resp = _json({"ok": True})
        resp.delete_cookie(COOKIE, path="/")
        return resp

    async def overview(request: Request):
        """This process (as before), the fleet's members (this gateway and every peer console, with
        the gateways connected to the store without one), their totals, and the store."""
        if (r := need(request)[1]) is not None:
            return r
        out = data.overview(gw, st.sampler)
        me = data.member_row(gw, fleet, st.sampler, ready)
        me["self"] = True
        members, peers_error, connected = [me], None, []
        try:
            _c, connected = await fleet.peers()
            for peer, ans in await fleet.ask_all("/console/peer/overview"):
                if "error" in ans:
                    members.append({"gateway": peer["gateway"], "url": peer["url"], "ready": False,
                                    "health": ans["error"], "unreachable": True})
                else:
                    members.append(ans)
        except StoreUnavailable as e:
            peers_error = str(e)
        listed = {m["gateway"] for m in members}
        for gid in connected:          # connected to the store, console off (or not announced yet)
            if gid not in listed:
                members.append({"gateway": gid, "url": None, "ready": None, "health": "no console announced"})
        members.sort(key=lambda m: m["gateway"])
        live = [m for m in members if "connections" in m]
        out["fleet"] = {"members": members, "error": peers_error, "gateways": len(members),
                        "totals": {k: round(sum(m.get(k) or 0 for m in live), 1)
                                   for k in ("connections", "sessions", "subscriptions", "msg_in_s", "msg_out_s")}}
        out["store"] = await store_reads.store_overview(gw, fleet)
        return _json(out)

    def peer_ok(request: Request) -> bool:
        got = request.headers.get(PEER_HEADER.lower()) or ""
        return bool(got) and secrets.compare_digest(got, fleet.token)

    peer_refused = _json({"error": "a peer console's request needs this gateway's token (from the store)"}, 403)

    async def peer_overview(request: Request):
        if not peer_ok(request):
            return peer_refused
        return _json(data.member_row(gw, fleet, st.sampler, ready))

    async def peer_clients(request: Request):
        if not peer_ok(request):
            return peer_refused
        return _json(data.clients(gw, request.query_params.get("q", "")))

    async def peer_disconnect(request: Request):
        if not peer_ok(request):
            log.warning("event=console_action_refused action=disconnect user=- reason=peer_token peer=%s",
                        request.client.host if request.client else "?")
            return peer_refused
        try:
            body = await request.json()
            client_id, user, via = str(body["client_id"]), str(body.get("user") or "?"), str(body.get("via") or "?")
        except (ValueError, KeyError, TypeError):
            return _json({"error": "send {\"client_id\": ...}"}, 400)
        return local_disconnect(client_id, user, via)

    def local_disconnect(client_id: str, user: str, via: str | None = None):
        conn = data.find_connection(gw, client_id)
        hop = f" via={via}" if via else ""
        if conn is None:
            log.info("event=console_action action=disconnect user=%s client_id=%s gateway=%s%s result=not_connected",
                     user, client_id, fleet.gateway_id, hop)
            return _json({"error": f"client {client_id!r} is not connected to gateway {fleet.gateway_id}"}, 404)
        log.info("event=console_action action=disconnect user=%s client_id=%s gateway=%s%s peer=%s result=ok",
                 user, client_id, fleet.gateway_id, hop, conn.peer)
        conn.close_with_error(0x98, f"disconnected from the console by {user}")   # Administrative action
        return _json({"ok": True, "client_id": client_id, "gateway": fleet.gateway_id})

    async def history(request: Request):
        if (r := need(request)[1]) is not None:
            return r
        return _json({"samples": list(st.sampler.ring)})

    async def clients(request: Request):
        """Every gateway's clients: this one's, and each peer console's (in parallel), each row
        with the gateway it is on; a peer that does not answer is named in `unreachable`."""
        if (r := need(request)[1]) is not None:
            return r
        q = request.query_params.get("q", "")
        out = data.clients(gw, q)
        for c in out["clients"]:
            c["gateway"] = fleet.gateway_id
        unreachable = []
        try:
            answers = await fleet.ask_all(f"/console/peer/clients?q={_quote(q)}")
        except StoreUnavailable as e:
            answers, unreachable = [], [{"gateway": "(the store)", "error": str(e)}]
        for peer, ans in answers:
            if "error" in ans:
                unreachable.append({"gateway": peer["gateway"], "error": ans["error"]})
                continue
            for c in ans["clients"]:
                c["gateway"] = peer["gateway"]
            out["clients"].extend(ans["clients"])
            out["total"] += ans["total"]
        out["clients"].sort(key=lambda c: (c["client_id"] or "", c["gateway"]))
        del out["clients"][500:]
        out["shown"] = len(out["clients"])
        out["unreachable"] = unreachable
        out["gateways"] = 1 + len(answers)
        return _json(out)

    async def sessions(request: Request):
        if (r := need(request)[1]) is not None:
            return r
        if fleet.remote:
            return _json(await store_reads.sessions_remote(fleet))
        return _json(data.sessions(gw))

    async def disconnect(request: Request):
        s, refused = need(request, "admin")
        if refused is not None:
            s2 = who(request)
            log.warning("event=console_action_refused action=disconnect user=%s reason=role",
                        s2.user if s2 else "-")
            return refused
        if (r := action(request, s)) is not None:
            return r
        try:
            body = await request.json()
            client_id, where = str(body["client_id"]), body.get("gateway")
        except (ValueError, KeyError, TypeError):
            return _json({"error": "send {\"client_id\": ..., \"gateway\": ...}"}, 400)
        if not where or where == fleet.gateway_id:
            return local_disconnect(client_id, s.user)
        # the client is on another gateway: its console does it (and logs it too)
        try:
            consoles, _ = await fleet.peers()
        except StoreUnavailable as e:
            return _json({"error": f"cannot reach gateway {where}: {e}"}, 502)
        peer = next((p for p in consoles if p["gateway"] == where), None)
        if peer is None:
            log.info("event=console_action action=disconnect user=%s client_id=%s gateway=%s result=no_such_gateway",
                     s.user, client_id, where)
            return _json({"error": f"gateway {where!r} has no console in the fleet now"}, 404)
        ans = await fleet.ask(peer, "/console/peer/disconnect",
                              {"client_id": client_id, "user": s.user, "via": fleet.gateway_id})
        if "error" in ans:
            log.info("event=console_action action=disconnect user=%s client_id=%s gateway=%s result=%r",
                     s.user, client_id, where, ans["error"])
            return _json({"error": ans["error"]}, 404 if ans.get("status") == 404 else 502)
        log.info("event=console_action action=disconnect user=%s client_id=%s gateway=%s result=ok",
                 s.user, client_id, where)
        return _json(ans)

    async def stream(request: Request):
        """Server-sent events: a sample a second (overview, charts) until the page goes away."""
        if (r := need(request)[1]) is not None:
            return r
        q: asyncio.Queue = asyncio.Queue()
        st.sampler.listeners.add(q)

        async def events():
            try:
                yield "retry: 2000\n\n"
                while not st.stopping.is_set():
                    try:
                        sample = await asyncio.wait_for(q.get(), 5)
                    except asyncio.TimeoutError:
                        yield ": keepalive\n\n"
                        continue
                    if sample is None:
                        return
                    yield f"data: {json.dumps(sample)}\n\n"
            finally:
                st.sampler.listeners.discard(q)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={**_HEADERS, "X-Accel-Buffering": "no"})

    def acl_gate(s, flt: str, what: str):
        """(allowed(topic) or None, refusal): what a logged-in user may see of `flt` — what their
        MQTT ACL lets them subscribe to and read. Without a login (loopback) everything."""
        if not auth.login_required or gw.acl is None:
            return None, None
        from lmqtt.gateway.security.auth import Identity  # only when configured
        ident = Identity(s.user, "lmqtt-console", "password")
        try:
            ok = gw.acl.can_subscribe(ident, flt)
        except Exception as e:  # noqa: BLE001 - an invalid filter: its reason
            return None, _json({"error": f"invalid filter {flt!r}: {e}"}, 400)
        if not ok:
            log.info("event=console_%s_refused user=%s filter=%r reason=acl", what, s.user, flt)
            return None, _json({"error": f"the ACL does not let user {s.user!r} subscribe to {flt!r}"}, 403)
        if gw.acl.needs_read_check(ident, flt):
            return (lambda topic: gw.acl.can_read(ident, topic)), None
        return None, None

    rates = data.TopicRates(gw, fleet)

    async def groups(request: Request):
        if (r := need(request)[1]) is not None:
            return r
        return _json(await store_reads.groups(fleet))

    async def topics(request: Request):
        if (r := need(request)[1]) is not None:
            return r
        return _json(await rates.snapshot())

    async def retained(request: Request):
        s, refused = need(request)
        if refused is not None:
            return refused
        flt = request.query_params.get("filter") or "#"
        allowed, refused = acl_gate(s, flt, "retained")
        if refused is not None:
            return refused
        try:
            return _json(await data.retained(gw, flt, allowed))
        except StoreUnavailable as e:
            return _json({"error": str(e)}, 502)
        except Exception as e:  # noqa: BLE001 - an invalid filter: its reason, one line
            if gw.embedded is None and type(e).__name__ in ("ConnectionLost", "StoreClientError"):
                return _json({"error": f"the store could not answer: {e}"}, 502)
            return _json({"error": f"invalid filter {flt!r}: {e}"}, 400)

    async def trace(request: Request):
        """Server-sent events: the messages of a filter since a time, then live (the tracer)."""
        s, refused = need(request)
        if refused is not None:
            return refused
        flt = request.query_params.get("filter", "")
        try:
            since = int(request.query_params.get("since") or 0)
        except ValueError:
            return _json({"error": "since must be epoch milliseconds"}, 400)
        allowed, refused = acl_gate(s, flt, "trace")
        if refused is not None:
            return refused
        try:
            tr = store_reads.remote_trace(fleet, flt, since, allowed) if fleet.remote else data.Trace(gw, flt, since, allowed)
        except Exception as e:  # noqa: BLE001 - an invalid filter: its reason, one line
            return _json({"error": f"invalid filter {flt!r}: {e}"}, 400)
        if fleet.remote:
            try:
                await tr.start()
            except StoreUnavailable as e:        # e.g. a time outside the store's retention
                return _json({"error": str(e)}, 400)
        log.info("event=console_trace user=%s filter=%r since_ms=%d", s.user, flt, since)

        async def events():
            yield "retry: 2000\n\n"
            while not st.stopping.is_set():
                if await request.is_disconnected():
                    return
                try:
                    batch = await tr.apoll()
                except StoreUnavailable as e:     # the store went away: said once, then tried again
                    yield f"event: trace_error\ndata: {json.dumps(str(e))}\n\n"
                    batch = []
                if batch:
                    yield f"data: {json.dumps(batch)}\n\n"
                if len(batch) < tr.MAX_PER_POLL:
                    try:
                        await asyncio.wait_for(st.stopping.wait(), 0.5)
                    except asyncio.TimeoutError:
                        pass

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={**_HEADERS, "X-Accel-Buffering": "no"})

    routes = [
        Route("/console/api/trace", trace), Route("/console/api/topics", topics),
        Route("/console/api/retained", retained), Route("/console/api/groups", groups),
        Route("/healthz", healthz), Route("/readyz", readyz), Route("/", root),
        Route("/console/", index), Route("/console", root),
        Route("/console/api/me", me), Route("/console/api/login", login, methods=["POST"]),
        Route("/console/api/logout", logout, methods=["POST"]),
        Route("/console/api/overview", overview), Route("/console/api/history", history),
        Route("/console/api/clients", clients), Route("/console/api/sessions", sessions),
        Route("/console/api/clients/disconnect", disconnect, methods=["POST"]),
        Route("/console/api/stream", stream),
        Route("/console/peer/overview", peer_overview), Route("/console/peer/clients", peer_clients),
        Route("/console/peer/disconnect", peer_disconnect, methods=["POST"]),
        Mount("/console/static", app=StaticFiles(directory=str(STATIC)), name="static"),
    ]
    from . import security                  # the Access page: users and ACL rules managed live
    routes[-1:-1] = security.routes(gw, fleet, need, action, _json)
    console = Starlette(routes=routes)
    metrics = make_asgi_app(gw.metrics.registry)

    local_names = {bound_host.strip("[]"), "127.0.0.1", "localhost", "::1"}
    host_refused = PlainTextResponse("the console without a login answers only to a loopback Host "
                                     "(DNS rebinding); open it as http://127.0.0.1:PORT/console/\n", status_code=403)

    def _host_ok(scope) -> bool:
        """Without a login (loopback), a page of another site whose name an attacker points at
        127.0.0.1 (DNS rebinding) would be same-origin with the console: its Host header names it."""
        for k, v in scope.get("headers", ()):
            if k == b"host":
                h = v.decode("latin-1")
                name = h[1:h.index("]")] if h.startswith("[") and "]" in h else h.rsplit(":", 1)[0]
                return name.lower() in local_names
        return False

    async def app(scope, receive, send):
        # /metrics exactly as before (prometheus_client's own exposition: content negotiation, gzip)
        if scope["type"] == "http" and scope["path"] == "/metrics":
            await metrics(scope, receive, send)
        elif scope["type"] == "http" and not auth.login_required and scope["path"].startswith("/console") \
                and not scope["path"].startswith("/console/peer/") and not _host_ok(scope):
            await host_refused(scope, receive, send)
        else:
            await console(scope, receive, send)
    return app, st
