"""A real HTTP server process for the integration tests (standard library only): the user's auth
service in EMQX's shape (POST /auth, POST /acl) and a webhook receiver (POST /hook).

    python3 -m tests.integrations.http_service --port P --rules RULES.json --log LOG.jsonl

RULES.json is read again on every request, so a test changes the service's answers by rewriting it:

    {"users": {"alice": {"password": "pw", "result": "allow", "is_superuser": false}},
     "unknown_user": "ignore",                     # result for a user not listed
     "acl": [{"username": "alice", "action": "publish", "topic": "a/#", "result": "allow"}],
     "acl_default": "ignore",
     "delay_s": 0,                                 # every answer waits this long (a slow service)
     "status": 200,                                # answer /auth and /acl with this status instead
     "hook_status": 200}

Every request is appended to LOG.jsonl as {"path", "body"} (the webhook's batches too).
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _matches(flt: str, topic: str) -> bool:
    f, t = flt.split("/"), topic.split("/")
    for i, lv in enumerate(f):
        if lv == "#":
            return True
        if i >= len(t) or (lv != "+" and lv != t[i]):
            return False
    return len(f) == len(t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rules", required=True)
    p.add_argument("--log", required=True)
    a = p.parse_args()
    lock = threading.Lock()

    def rules() -> dict:
        try:
            with open(a.rules) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_a) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n)
            try:
                body = json.loads(raw or b"null")
            except ValueError:
                body = raw.decode("utf-8", "replace")
            with lock, open(a.log, "a") as f:
                f.write(json.dumps({"path": self.path, "body": body}) + "\n")
            r = rules()
            if r.get("delay_s"):
                time.sleep(float(r["delay_s"]))
            if self.path.endswith("/hook"):
                return self._answer(int(r.get("hook_status", 200)), {})
            if r.get("status", 200) != 200:
                return self._answer(int(r["status"]), {"result": "allow"})
            if self.path.endswith("/auth"):
                u = (r.get("users") or {}).get(body.get("username"))
                if u is None:
                    return self._answer(200, {"result": r.get("unknown_user", "ignore")})
                if u.get("password") is not None and u["password"] != body.get("password"):
                    return self._answer(200, {"result": "deny"})
                return self._answer(200, {"result": u.get("result", "allow"), "is_superuser": bool(u.get("is_superuser"))})
            if self.path.endswith("/acl"):
                for rule in r.get("acl") or []:
                    if all(rule.get(k) in (None, body.get(k)) for k in ("username", "clientid", "action")) \
                            and _matches(rule["topic"], body.get("topic", "")):
                        return self._answer(200, {"result": rule["result"]})
                return self._answer(200, {"result": r.get("acl_default", "ignore")})
            self._answer(404, {})

        def _answer(self, status: int, doc: dict) -> None:
            data = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    ThreadingHTTPServer.request_queue_size = 1024    # a connect storm asks 1,000s at once (default 5)
    srv = ThreadingHTTPServer(("127.0.0.1", a.port), H)
    srv.daemon_threads = True
    print(f"listening on {a.port} pid {os.getpid()}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
