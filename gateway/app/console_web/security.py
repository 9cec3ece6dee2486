"""The console's Access page: the users and ACL rules kept in the store (store/node/security_service.py)
listed for every role, changed by the admin role (`lmqtt admin --user-add ...` does the same from a
shell). The store is reached as the console reaches it for the rest: `lmqtt serve`'s in-process
node directly, a fleet gateway's store by a CALL. Passwords are hashed here (off the event loop:
PBKDF2 takes ~0.2 s) and never sent to the store; hashes never reach the page."""
from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request
from starlette.routing import Route

from .fleet import StoreUnavailable

log = logging.getLogger("lmqtt.console")

OPS = ("user_set", "user_remove", "rule_add", "rule_remove", "default")


def routes(gw, fleet, need, action, answer) -> list[Route]:
    """GET and POST /console/api/security. `need(request, role)` -> (session, refusal),
    `action(request, session)` -> a CSRF refusal or None, `answer(obj, status)` -> the response."""
    async def get_doc() -> dict:
        if gw.embedded is not None:
            return gw.embedded.security.get()
        return await fleet.call("security_get")

    async def update(change: dict) -> dict:
        if gw.embedded is not None:
            return gw.embedded.security.update(change)
        return await fleet.call("security_update", **change)

    async def security(request: Request):
        s, refused = need(request, "admin" if request.method == "POST" else None)
        if refused is not None:
            return refused
        if request.method == "GET":
            try:
                doc = await get_doc()
            except StoreUnavailable as e:
                return answer({"error": str(e)}, 502)
            return answer({"enabled": bool(gw.cfg.live_security), "version": doc["version"],
                           "users": [{"user": u, "updated_ms": v.get("updated_ms")} for u, v in sorted(doc["users"].items())],
                           "rules": doc["rules"], "default": doc.get("default")}, 200)
        if (r := action(request, s)) is not None:
            return r
        try:
            body = await request.json()
            op = body["op"]
        except (ValueError, KeyError, TypeError):
            return answer({"error": "send {\"op\": ..., ...}"}, 400)
        if op not in OPS:
            return answer({"error": f"op must be one of {', '.join(OPS)}"}, 400)
        change = {"op": op}
        from lmqtt.gateway.security.acl import AclError  # only when configured
        from lmqtt.gateway.security.auth import hash_password  # only when configured
        from lmqtt.gateway.security.live import check_rule  # only when configured
        try:
            if op == "user_set":
                user, pw = str(body.get("user") or ""), body.get("password")
                if not isinstance(pw, str) or not pw:
                    return answer({"error": "a password is required"}, 400)
                change.update(user=user, hash=await asyncio.to_thread(hash_password, pw))
            elif op == "user_remove":
                change["user"] = str(body.get("user") or "")
            elif op == "rule_add":
                change["rule"] = check_rule(str(body.get("rule") or ""))
                if body.get("position"):
                    change["position"] = int(body["position"])
            elif op == "rule_remove":
                change["index"] = int(body.get("index"))
            else:
                change["value"] = body.get("value") or None
        except (AclError, ValueError, TypeError) as e:
            return answer({"error": str(e)}, 400)
        try:
            res = await update(change)
        except StoreUnavailable as e:
            return answer({"error": str(e)}, 400)
        except Exception as e:  # noqa: BLE001 - the store's refusal (CallError): its message
            return answer({"error": str(e)}, 400)
        log.info("event=console_action action=security op=%s user=%s target=%r version=%s", op, s.user,
                 change.get("user") or change.get("rule") or change.get("index") or change.get("value"),
                 res.get("version"))
        return answer(res, 200)

    return [Route("/console/api/security", security, methods=["GET", "POST"])]
