"""Who may use the console, and how they prove it.

On a loopback address nobody logs in (the same rule as anonymous MQTT clients: whoever can reach
127.0.0.1 is on the machine) unless `console_login = true`; anywhere else every page but
/metrics, /healthz and /readyz needs a login with a user of the MQTT password file
(`password_file`) that is named in `console_admins` (every page and action) or `console_viewers`
(read-only). A login is a random token in an HttpOnly, SameSite=Strict cookie (Secure when the
console is served over TLS); every action (POST) carries the session's CSRF token in a header.
"""
from __future__ import annotations

import secrets
import time

from lmqtt.gateway.security.auth import Credentials, PasswordFile
from lmqtt.store.loopback import is_loopback     # the one loopback rule of every lmqtt process

COOKIE = "lmqtt_console"
TTL_S = 8 * 3600


def _names(value: str | None) -> set[str]:
    return {n.strip() for n in (value or "").split(",") if n.strip()}


class Session:
    __slots__ = ("user", "role", "csrf", "expires")

    def __init__(self, user: str, role: str) -> None:
        self.user, self.role = user, role
        self.csrf = secrets.token_urlsafe(24)
        self.expires = time.monotonic() + TTL_S


class ConsoleAuth:
    def __init__(self, cfg, bound_host: str) -> None:
        self.cfg = cfg
        self.login_required = bool(getattr(cfg, "console_login", False)) or not is_loopback(bound_host)
        self.admins = _names(getattr(cfg, "console_admins", None))
        self.viewers = _names(getattr(cfg, "console_viewers", None))
        self.passwords = PasswordFile(cfg.password_file) if cfg.password_file else None
        self.sessions: dict[str, Session] = {}

    def why_no_login(self) -> str | None:
        """A login is required but cannot succeed: the one-line reason, for the page and the log."""
        if not self.login_required:
            return None
        if self.passwords is None:
            return "the console needs a login here and no password_file is configured (docs/console.md)"
        if not (self.admins or self.viewers):
            return "the console needs a login here and nobody has a console role: set console_admins (docs/console.md)"
        return None

    def session_of(self, token: str | None) -> Session | None:
        s = self.sessions.get(token or "")
        if s is None:
            return None
        if s.expires < time.monotonic():
            self.sessions.pop(token, None)
            return None
        return s

    def open(self, user: str, role: str) -> str:
        token = secrets.token_urlsafe(32)
        if len(self.sessions) > 10000:       # bounded: the oldest logins go first
            for t in list(self.sessions)[:1000]:
                del self.sessions[t]
        self.sessions[token] = Session(user, role)
        return token

    def check_password(self, user: str, password: str) -> tuple[str | None, str]:
        """(role or None, why): blocking (PBKDF2), so called off the loop."""
        if self.passwords is None:
            return None, "no password_file is configured"
        res = self.passwords.authenticate(Credentials("lmqtt-console", user, password.encode()))
        if not res:
            return None, "wrong user name or password"
        if user in self.admins:
            return "admin", ""
        if user in self.viewers:
            return "viewer", ""
        return None, f"user {user!r} has no console role (console_admins / console_viewers)"
