"""Authentication of MQTT clients: who is connecting, decided from CONNECT's username/password (and
the TLS peer certificate when there is one), before any session state is touched.

Authenticators are tried in the configured order; the first that *recognises* the credentials
decides (accept or reject), one that does not recognise them passes to the next, and when none
does the client is refused as "not authorized". Anonymous clients are a separate switch, decided by
the caller (loopback-only unless `--allow-anonymous`), never by an authenticator.

Password files are Mosquitto-compatible both ways: `lmqtt passwd` writes the `$7$` PBKDF2-SHA512
form that Mosquitto 2 reads and writes (with many more iterations than mosquitto_passwd's 101), and
every line mosquitto_passwd writes (`$7$` and the older `$6$` salted SHA-512) verifies here, so a
Mosquitto user migrates by pointing `--password-file` at the file they have. Plaintext is never
stored. A slow hash costs milliseconds per CONNECT, so successful verifications are remembered
(keyed by an HMAC of user and password under a per-process random key, never the password) until
the file changes.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from lmqtt.gateway.security.scram import ScramAuthFailed, ScramCredentials, ScramError, ScramServer

log = logging.getLogger("lmqtt.gateway")


class AuthError(Exception):
    """A configuration problem (unreadable file, malformed line); names the file and line."""


@dataclass(frozen=True)
class Credentials:
    client_id: str
    username: str | None
    password: bytes | None
    cert_subject: str | None = None      # CN (or first DNS SAN) of a verified TLS client certificate
    peer: str | None = None              # HOST:PORT of the client (an HTTP auth service is told)
    protocol: int = 4                    # MQTT protocol level: 4 = 3.1.1, 5 = 5.0


@dataclass(frozen=True)
class Identity:
    """The authenticated principal ACL rules are written against."""
    username: str | None
    client_id: str
    method: str                           # "password", "scram", "hmac", "jwt", "certificate", "http", "live", "anonymous"
    cert_subject: str | None = None
    superuser: bool = False               # not subject to ACLs (an HTTP auth service's `is_superuser`)


class Denied:
    """A refusal with its reason, for the operator's log only: the client gets the bare reason
    code (0x86 / 0x87), never which part was wrong (no user enumeration). Falsy, so callers that
    only ask "accepted?" keep working."""

    __slots__ = ("reason", "method", "code")

    def __init__(self, reason: str, method: str = "", code: int | None = None) -> None:
        """`code`: the MQTT 5 reason code to refuse with, when the authenticator knows better than
        the caller's default (enhanced authentication: 0x86 wrong proof, 0x87 unusable exchange)."""
        self.reason, self.method, self.code = reason, method, code

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"Denied({self.reason!r})"


class Authenticator(Protocol):
    name: str

    def authenticate(self, creds: Credentials) -> Identity | Denied | None | bool:
        """An Identity to accept, a Denied (or False) to reject, None when these credentials are
        not its kind."""


# ------------------------------------------------------------------------------ password hashes
PBKDF2_ITERATIONS = 210_000      # OWASP's figure for PBKDF2-HMAC-SHA512
SALT_BYTES = 12                  # as mosquitto_passwd


def hash_password(password: str | bytes, iterations: int = PBKDF2_ITERATIONS) -> str:
    """`$7$ITER$SALT$HASH`: PBKDF2-HMAC-SHA512, base64 salt and hash; Mosquitto 2 reads it."""
    pw = password.encode() if isinstance(password, str) else password
    salt = secrets.token_bytes(SALT_BYTES)
    dk = hashlib.pbkdf2_hmac("sha512", pw, salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(dk).decode()}"


def verify_password(stored: str, password: bytes) -> bool:
    """Check `password` against one stored hash of any supported form (constant-time compare)."""
    parts = stored.split("$")
    try:
        if len(parts) == 5 and parts[1] == "7":
            iterations = int(parts[2])
            salt, want = base64.b64decode(parts[3], validate=True), base64.b64decode(parts[4], validate=True)
            got = hashlib.pbkdf2_hmac("sha512", password, salt, iterations)
        elif len(parts) == 4 and parts[1] == "6":
            salt, want = base64.b64decode(parts[2], validate=True), base64.b64decode(parts[3], validate=True)
            got = hashlib.sha512(password + salt).digest()
        else:
            return False
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, want)


def _check_hash_form(stored: str) -> str | None:
    """None when `stored` is a hash this module verifies, else what is wrong with it."""
    parts = stored.split("$")
    if len(parts) == 5 and parts[1] == "7" and parts[2].isdigit():
        return None
    if len(parts) == 4 and parts[1] == "6":
        return None
    if not stored.startswith("$"):
        return "the password is in plaintext (hash the file with `lmqtt passwd -U FILE`)"
    return f"unsupported hash form {stored.split('$')[1]!r} (supported: $7$ PBKDF2-SHA512, $6$ SHA-512)"


def split_entry(stored: str) -> tuple[str, str | None]:
    """A password file entry after `user:` -> (password hash, SCRAM-SHA-256 verifier or None).
    The verifier is an optional third field, `user:HASH:$scram-sha-256$...`: Mosquitto splits the
    line at ':' and reads only the first two fields, so the file stays Mosquitto-compatible."""
    h, sep, scram = stored.partition(":")
    return h, (scram if sep else None)


def _check_entry(stored: str) -> str | None:
    """None when `stored` (everything after `user:`) is valid, else what is wrong with it."""
    h, scram = split_entry(stored)
    if h.startswith("$scram-sha-256$"):
        return ("a SCRAM-SHA-256 verifier must follow the password hash (user:HASH:$scram-sha-256$...; "
                "`lmqtt passwd --scram` writes both)")
    problem = _check_hash_form(h)
    if problem or scram is None:
        return problem
    try:
        ScramCredentials.parse(scram)
    except ScramError as e:
        return str(e)
    return None


class PasswordFile:
    """`user:hash` lines (Mosquitto's password_file format); `#` comments and blank lines skipped.
    A line may carry a third field, the user's SCRAM-SHA-256 verifier (`scram_credentials`), for
    MQTT 5 enhanced authentication (`ScramLogin`).

    Reloaded when the file's mtime/size change (checked at most once a second) or on `reload()`.
    Usernames not in the file are not recognised (the next authenticator may know them); a known
    user with a wrong password is rejected.
    """

    name = "password"

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._key = secrets.token_bytes(32)
        self._ok: dict[bytes, bool] = {}
        self._stamp: tuple | None = None
        self._users: dict[str, str] = {}
        self._scram: dict = {}
        self.reload()

    def reload(self) -> None:
        entries = read_password_file(self.path)
        users, scram = {}, {}
        for user, stored in entries.items():
            users[user], verifier = split_entry(stored)
            if verifier is not None:
                scram[user] = ScramCredentials.parse(verifier)
        st = os.stat(self.path)
        with self._lock:
            self._users = users
            self._scram = scram
            self._ok = {}
            self._stamp = (st.st_mtime_ns, st.st_size)

    def scram_credentials(self, username: str):
        """The user's parsed SCRAM-SHA-256 verifier, or None (unknown user, or no verifier)."""
        self._maybe_reload()
        return self._scram.get(username)

    def _maybe_reload(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            return                                  # keep serving the last good file
        if (st.st_mtime_ns, st.st_size) != self._stamp:
            try:
                self.reload()
            except AuthError:
                pass                                # a half-written file: keep the last good one

    def _cache_key(self, creds: Credentials) -> bytes:
        return hmac.new(self._key, creds.username.encode() + b"\0" + (creds.password or b""),
                        hashlib.sha256).digest()

    def is_slow(self, creds: Credentials) -> bool:
        return (creds.username is not None and creds.username in self._users
                and self._cache_key(creds) not in self._ok)

    def authenticate(self, creds: Credentials):
        self._maybe_reload()
        if creds.username is None:
            return None
        stored = self._users.get(creds.username)
        if stored is None:
            return None
        pw = creds.password or b""
        key = self._cache_key(creds)
        ok = self._ok.get(key)
        if ok is None:
            ok = verify_password(stored, pw)
            with self._lock:
                if len(self._ok) > 100_000:
                    self._ok.clear()
                self._ok[key] = ok
        if not ok:
            return Denied(f"wrong password for user {creds.username!r}", "password")
        return Identity(creds.username, creds.client_id, "password", creds.cert_subject)


def password_file_entries(path: str):
    """(line number, user, stored) for each entry of a `user:...` file; comments and blank lines
    skipped. Raises AuthError naming the file (and line) when it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise AuthError(f"cannot read password file {path}: {e.strerror or e}") from e
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, stored = line.partition(":")
        if not sep or not user:
            raise AuthError(f"{path}:{n}: expected user:hash")
        yield n, user, stored


def read_password_file(path: str) -> dict[str, str]:
    users: dict[str, str] = {}
    for n, user, stored in password_file_entries(path):
        problem = _check_entry(stored)
        if problem:
            raise AuthError(f"{path}:{n}: user {user!r}: {problem}")
        users[user] = stored
    return users


def write_password_file(path: str, users: dict[str, str]) -> None:
    """Atomically and durably replace `path` (mode 0600: hashes are secrets too): temp file, fsync,
    rename, fsync of the directory (as lmqtt.store.atomic_file, which this layer cannot import)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for u, h in users.items():
            f.write(f"{u}:{h}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)  # the rename survives a power loss
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# --------------------------------------------------------------------------- HMAC signatures
class HmacSignature:
    """Device fleets without per-device passwords, as RocketMQ-MQTT signs them: the username is
    `Signature|ACCESS_KEY|INSTANCE` (or just `ACCESS_KEY`), the password is
    base64(HMAC-SHA1(secret_key, client_id)). A device holding the fleet's secret can connect only
    under client ids it can sign. Keys file: `access_key:secret_key` lines.
    """

    name = "hmac"

    def __init__(self, keys_path: str) -> None:
        self.path = keys_path
        self.reload()

    def reload(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise AuthError(f"cannot read HMAC keys file {self.path}: {e.strerror or e}") from e
        keys = {}
        for n, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            ak, sep, sk = line.partition(":")
            if not sep or not ak or not sk:
                raise AuthError(f"{self.path}:{n}: expected access_key:secret_key")
            keys[ak] = sk.encode()
        self._keys = keys

    @staticmethod
    def sign(secret_key: str | bytes, client_id: str) -> str:
        sk = secret_key.encode() if isinstance(secret_key, str) else secret_key
        return base64.b64encode(hmac.new(sk, client_id.encode(), hashlib.sha1).digest()).decode()

    def authenticate(self, creds: Credentials):
        if not creds.username:
            return None
        parts = creds.username.split("|")
        if parts[0] == "Signature" and len(parts) >= 2:
            ak = parts[1]
        elif len(parts) == 1:
            ak = parts[0]
        else:
            return None
        sk = self._keys.get(ak)
        if sk is None:
            return None
        want = self.sign(sk, creds.client_id).encode()
        if not hmac.compare_digest(want, creds.password or b""):
            return Denied(f"HMAC signature of access key {ak!r} does not sign client id "
                          f"{creds.client_id!r}", "hmac")
        return Identity(ak, creds.client_id, "hmac", creds.cert_subject)


# ------------------------------------------------------------------------------------- JWT
class JwtToken:
    """A JSON Web Token as the CONNECT password (HS256 with a shared secret, or RS256/ES256 with
    the issuer's public key), the way device fleets behind an identity service connect. The token
    must carry `exp`; `iss`/`aud` are checked when configured. The username becomes the token's
    `username_claim` (default `sub`); a CONNECT username, when given, must equal it, and a
    `clientid` claim, when present, must equal the client id (a token cannot be replayed under
    another device's id). Tokens are told apart from passwords by their shape (three base64url
    parts), so a password file and JWT can serve the same listener.
    """

    name = "jwt"

    def __init__(self, *, secret: str | None = None, public_key_file: str | None = None,
                 algorithms: tuple[str, ...] | None = None, issuer: str | None = None,
                 audience: str | None = None, username_claim: str = "sub", leeway_s: int = 30) -> None:
        if (secret is None) == (public_key_file is None):
            raise AuthError("JWT authentication needs exactly one of a secret (HS256) or a public key file")
        if public_key_file is not None:
            try:
                with open(public_key_file, encoding="utf-8") as f:
                    self._key = f.read()
            except OSError as e:
                raise AuthError(f"cannot read JWT public key {public_key_file}: {e.strerror or e}") from e
            self.algorithms = list(algorithms or ("RS256", "ES256"))
        else:
            self._key = secret
            self.algorithms = list(algorithms or ("HS256",))
        self.issuer, self.audience = issuer, audience
        self.username_claim = username_claim
        self.leeway = leeway_s

    def authenticate(self, creds: Credentials):
        import jwt  # only JWT authentication, when configured
        token = creds.password or b""
        if token.count(b".") != 2 or len(token) < 20:
            return None
        try:
            claims = jwt.decode(token.decode("ascii", "replace"), self._key, algorithms=self.algorithms,
                                issuer=self.issuer, audience=self.audience, leeway=self.leeway,
                                options={"require": ["exp"], "verify_aud": self.audience is not None})
        except jwt.ExpiredSignatureError:
            return Denied("JWT expired", "jwt")
        except jwt.InvalidSignatureError:
            return Denied("JWT signature does not verify (tampered, or signed with another key)", "jwt")
        except jwt.PyJWTError as e:
            return Denied(f"JWT refused: {e}", "jwt")
        user = claims.get(self.username_claim)
        if not isinstance(user, str) or not user:
            return Denied(f"JWT has no {self.username_claim!r} claim naming the user", "jwt")
        if creds.username not in (None, "", user):
            return Denied(f"JWT is for user {user!r}, CONNECT names {creds.username!r}", "jwt")
        cid = claims.get("clientid")
        if cid is not None and cid != creds.client_id:
            return Denied(f"JWT is bound to client id {cid!r}, not {creds.client_id!r}", "jwt")
        return Identity(user, creds.client_id, "jwt", creds.cert_subject)


# ---------------------------------------------------------------------------- certificates
class ClientCertificate:
    """A verified TLS client certificate names the user: its CN, else its first DNS SAN. The TLS
    layer has already verified the chain against `--cafile`; this only maps it to an identity."""

    name = "certificate"

    def authenticate(self, creds: Credentials):
        if not creds.cert_subject:
            return None
        return Identity(creds.cert_subject, creds.client_id, "certificate", creds.cert_subject)


def certificate_subject(peercert: dict | None) -> str | None:
    """CN, else first DNS subjectAltName, of `ssl.SSLSocket.getpeercert()`'s dict."""
    if not peercert:
        return None
    for rdn in peercert.get("subject", ()):
        for k, v in rdn:
            if k == "commonName":
                return v
    for kind, v in peercert.get("subjectAltName", ()):
        if kind == "DNS":
            return v
    return None


# ------------------------------------------------------------------- MQTT 5 enhanced authentication
class ScramLogin:
    """One SCRAM-SHA-256 exchange over MQTT 5 AUTH packets (gateway/security/scram.py does the SASL part).

    `step(data)` takes the client's Authentication Data (CONNECT's, then each AUTH's) and returns
    bytes to send back in AUTH 0x18 (continue), an Identity when the client proved the password
    (`final_data`, the server signature, then goes into CONNACK / AUTH 0x00), or a Denied with the
    reason code and the cause for the log. Only HMAC/SHA-256 here: cheap enough for the event loop
    (the PBKDF2 was done once by `lmqtt passwd --scram`)."""

    method = "SCRAM-SHA-256"

    def __init__(self, lookup, creds: Credentials, username: str | None = None) -> None:
        self.server = ScramServer(lookup)
        self.creds = creds
        self.username = username           # re-authentication: must stay the same user
        self.final_data: bytes | None = None
        self.pending = None                # set by `EnhancedAuth.begin`: the CONNECT waiting for the outcome
        self.started_at = 0.0

    def step(self, data: bytes):
        s = self.server
        try:
            if not s.started:
                return s.first(data)
            final = s.final(data)
        except ScramError as e:
            return Denied(f"SCRAM-SHA-256 user {s.username!r}: {e}", "scram",
                          0x86 if isinstance(e, ScramAuthFailed) else 0x87)
        user = s.username
        if self.creds.username not in (None, "", user):
            return Denied(f"SCRAM-SHA-256 authenticated {user!r}, CONNECT names user "
                          f"{self.creds.username!r}", "scram", 0x86)
        if self.username is not None and user != self.username:
            return Denied(f"re-authentication as {user!r} on a connection of {self.username!r}",
                          "scram", 0x87)
        self.final_data = final
        return Identity(user, self.creds.client_id, "scram", self.creds.cert_subject)


# ------------------------------------------------------------------------------------ chain
class AuthChain:
    """Authenticators in order; the first that recognises the credentials decides."""

    def __init__(self, authenticators: list, allow_anonymous: bool, http=None) -> None:
        """`http`: an HttpAuthService (gateway/security/http_auth.py), asked before the others by
        `AuthRunner.check_later` (it answers asynchronously); its `ignore` goes on to them."""
        self.authenticators = list(authenticators)
        self.allow_anonymous = allow_anonymous
        self.http = http

    @property
    def configured(self) -> bool:
        return bool(self.authenticators) or self.http is not None

    @property
    def names(self) -> list[str]:
        return (["http"] if self.http is not None else []) + [a.name for a in self.authenticators]

    def check(self, creds: Credentials) -> Identity | Denied:
        """The identity, or a Denied naming why (for the log): refuse the CONNECT (0x86 bad
        credentials / 0x87 not authorized in MQTT 5; 0x04 / 0x05 in 3.1.1 — the caller picks by
        `creds`). May take a slow password hash: callers on an event loop run it in a thread
        (hashlib releases the GIL), see `Broker.on_connect`."""
        for a in self.authenticators:
            r = a.authenticate(creds)
            if r is None:
                continue
            if r:
                return r
            return r if isinstance(r, Denied) else Denied("refused", getattr(a, "name", ""))
        if creds.username is None and creds.cert_subject is None and self.allow_anonymous:
            return Identity(None, creds.client_id, "anonymous")
        if creds.username is not None:
            return Denied(f"unknown user {creds.username!r}")
        if creds.password is not None:
            return Denied("a password without a user name")
        return Denied("no credentials and anonymous clients are not allowed here")

    def authenticate(self, creds: Credentials) -> Identity | None:
        """`check` without the reason: the identity, or None."""
        r = self.check(creds)
        return r if isinstance(r, Identity) else None

    def enhanced_login(self, method: str, creds: Credentials, username: str | None = None):
        """A `ScramLogin` for an MQTT 5 Authentication Method this chain offers, else None (the
        caller refuses with 0x8C). SCRAM-SHA-256 is offered when a password file is configured."""
        if method != ScramLogin.method:
            return None
        for a in self.authenticators:
            lookup = getattr(a, "scram_credentials", None)
            if lookup is not None:
                return ScramLogin(lookup, creds, username)
        return None

    def is_slow(self, creds: Credentials) -> bool:
        """True when checking these credentials may compute a password hash (not cached yet)."""
        return any(getattr(a, "is_slow", lambda c: False)(creds) for a in self.authenticators)

    def reload_files(self) -> None:
        """SIGHUP: re-read each authenticator's file (password file, HMAC keys), logged; one that
        fails keeps its previous contents, and the others are re-read all the same. The HTTP
        service's cached decisions are dropped (asked again)."""
        if self.http is not None:
            self.http.forget()
        for a in self.authenticators:
            if hasattr(a, "reload"):
                try:
                    a.reload()
                    log.info("event=reloaded what=%s path=%s", a.name, getattr(a, "path", ""))
                except Exception as e:
                    log.error("event=reload_failed what=%s error=%s (previous rules kept)", a.name, e)


# ------------------------------------------------------------------------ off the event loop
class AuthRunner:
    """Credential checks that must compute a password hash run on a small thread pool.

    Why: a `$7$` hash costs ~100-200 ms of CPU by design (PBKDF2, 210,000 rounds). Computed on the
    event loop, 1,000 logins with wrong passwords would stall every connected client for minutes;
    on a pool (hashlib releases the GIL while hashing) they cost CPU but the loop keeps serving.
    Checks that need no hash (a remembered result, an unknown user, HMAC, JWT) stay inline.
    At most `max_pending` checks wait at once; beyond that a CONNECT is refused as "server busy"
    (0x89) instead of queueing without bound."""

    BUSY = "busy"

    def __init__(self, chain: "AuthChain", loop, workers: int = 2, max_pending: int = 256) -> None:
        self.chain = chain
        self.loop = loop
        self.workers = workers
        self.max_pending = max_pending
        self.pending = 0
        self._pool = None

    def check_later(self, creds: Credentials, done) -> bool:
        """True when the check was handed to the pool (or to the HTTP auth service first):
        `done(result)` runs on the loop later. False: the caller checks inline (`chain.check`),
        nothing slow to do."""
        if self.chain.http is not None:
            self.loop.create_task(self._http_first(creds, done))
            return True
        return self._pool_check(creds, done)

    async def _http_first(self, creds: Credentials, done) -> None:
        """The HTTP service decides unless it says `ignore`; then the rest of the chain."""
        try:
            r = await self.chain.http.authenticate(creds)
        except Exception as e:  # noqa: BLE001 - a failing check refuses this client only
            r = Denied(f"authentication failed: {type(e).__name__}: {e}")
        if r is not None:
            done(r)
        elif not self._pool_check(creds, done):
            done(self.chain.check(creds))

    def _pool_check(self, creds: Credentials, done) -> bool:
        if not self.chain.is_slow(creds):
            return False
        if self.pending >= self.max_pending:
            self.loop.call_soon(done, Denied(f"{self.pending} logins already waiting for a password "
                                             f"check", self.BUSY))
            return True
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="lmqtt-auth")
        self.pending += 1
        fut = self.loop.run_in_executor(self._pool, self.chain.check, creds)

        def finished(f) -> None:
            self.pending -= 1
            try:
                result = f.result()
            except Exception as e:  # noqa: BLE001 - a failing check refuses this client only
                result = Denied(f"authentication failed: {type(e).__name__}: {e}")
            done(result)
        fut.add_done_callback(finished)
        return True

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
