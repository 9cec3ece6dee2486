"""A minimal HTTP auth service in EMQX's shape, for `lmqtt bench compare --brokers lmqtt-auth-http`:
`POST /auth` allows the one user and password it is given (deny otherwise), `POST /acl` allows
everything. Standard library only, HTTP/1.1 keep-alive, one thread per connection; run as its own
process so its CPU is not the broker's (the probe counts the broker's processes only).

    python3 -m lmqtt.loadtest.auth_service --port P --user U --password PW
"""
from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lmqtt.loadtest.auth_service")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--user", required=True)
    p.add_argument("--password", required=True)
    a = p.parse_args(argv)
    allow, deny = json.dumps({"result": "allow"}).encode(), json.dumps({"result": "deny"}).encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_a) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            ok = not self.path.endswith("/auth") or (body.get("username") == a.user
                                                     and body.get("password") == a.password)
            out = allow if ok else deny
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    ThreadingHTTPServer.request_queue_size = 1024    # a connect storm asks 1,000s at once (default 5)
    srv = ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    srv.daemon_threads = True
    srv.serve_forever()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
