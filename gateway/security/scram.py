"""SCRAM-SHA-256 (RFC 5802 / RFC 7677) for MQTT 5 enhanced authentication, as a sans-IO server
state machine: bytes of the client's Authentication Data in, bytes to send back out. The gateway
carries them in CONNECT / AUTH (reason 0x18 "continue authentication") / CONNACK packets with the
Authentication Method "SCRAM-SHA-256" (gateway/security/auth.py `ScramLogin`, gateway/broker/broker.py).

Why SCRAM: the password never crosses the wire (not even inside TLS), the server stores no
password-equivalent (only StoredKey and ServerKey), and the client verifies the server too (the
final `v=` signature). Credentials are a third field of the user's password file line,
`user:$7$...:$scram-sha-256$ITER$SALT$STOREDKEY$SERVERKEY` (base64 fields; Mosquitto reads the
line and ignores the field), written by `scram_credentials()` via `lmqtt passwd --scram`. The
expensive PBKDF2 runs only there (and on the client); a login costs the server a few HMACs.

The exchange:
    client-first   n,,n=USER,r=CNONCE                      (CONNECT Authentication Data)
    server-first   r=CNONCE SNONCE,s=SALT,i=ITER            (AUTH 0x18)
    client-final   c=biws,r=CNONCE SNONCE,p=PROOF           (AUTH 0x18)
    server-final   v=SERVERSIGNATURE                        (CONNACK 0x00), or a failure
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass

METHOD = "SCRAM-SHA-256"
DEFAULT_ITERATIONS = 4096          # RFC 7677's minimum; raise it for stronger storage


class ScramError(Exception):
    """The exchange failed; the message is safe to log (it never contains secrets)."""


class ScramAuthFailed(ScramError):
    """A well-formed exchange whose credentials are wrong (unknown user, wrong password), as
    opposed to a malformed or unsupported one: the broker answers it with 0x86 (bad user name or
    password) rather than 0x87 (not authorized)."""


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _h(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def _hmac(key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, hashlib.sha256).digest()


def scram_credentials(password: str, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None) -> str:
    """The stored form of a password for SCRAM-SHA-256 (no password-equivalent is kept)."""
    salt = salt or secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    stored_key = _h(_hmac(salted, b"Client Key"))
    server_key = _hmac(salted, b"Server Key")
    return f"$scram-sha-256${iterations}${_b64(salt)}${_b64(stored_key)}${_b64(server_key)}"


@dataclass(frozen=True)
class ScramCredentials:
    iterations: int
    salt: bytes
    stored_key: bytes
    server_key: bytes

    @classmethod
    def parse(cls, stored: str) -> "ScramCredentials":
        parts = stored.split("$")
        if len(parts) != 6 or parts[0] or parts[1] != "scram-sha-256":
            raise ScramError("not a $scram-sha-256$ITER$SALT$STOREDKEY$SERVERKEY verifier")
        try:
            iterations = int(parts[2])
            salt, stored_key, server_key = (base64.b64decode(x, validate=True) for x in parts[3:])
        except ValueError:
            raise ScramError("malformed $scram-sha-256$ verifier (iterations or base64 fields)") from None
        if iterations < 1 or not salt or len(stored_key) != 32 or len(server_key) != 32:
            raise ScramError("malformed $scram-sha-256$ verifier (iterations, salt or key lengths)")
        return cls(iterations, salt, stored_key, server_key)


def _attrs(msg: str) -> dict[str, str]:
    out = {}
    for part in msg.split(","):
        if len(part) < 2 or part[1] != "=":
            raise ScramError(f"malformed SCRAM attribute {part[:16]!r}")
        out[part[0]] = part[2:]
    return out


def _saslname(s: str) -> str:
    return s.replace("=2C", ",").replace("=3D", "=")


class ScramServer:
    """One exchange. `lookup(username)` returns the stored credential string or None."""

    def __init__(self, lookup, server_nonce: str | None = None) -> None:
        """`server_nonce`: only for tests that replay a published exchange; default 18 random bytes."""
        self._lookup = lookup
        self.username: str | None = None
        self._state = "start"
        self._creds: ScramCredentials | None = None
        self._nonce = ""
        self._snonce = server_nonce
        self._gs2 = ""
        self._auth_message_prefix = ""

    @property
    def known_user(self) -> bool:
        return self._creds is not None

    @property
    def started(self) -> bool:
        """The client-first message was handled (the next message is the client-final)."""
        return self._state != "start"

    def first(self, client_first: bytes) -> bytes:
        """client-first -> server-first. Unknown users get a plausible challenge (a fake salt
        derived from the name), so a failed login does not reveal which usernames exist."""
        if self._state != "start":
            raise ScramError("unexpected client-first message")
        try:
            msg = client_first.decode("utf-8")
        except UnicodeDecodeError:
            raise ScramError("client-first is not UTF-8") from None
        if not msg:
            raise ScramError("no client-first message (the Authentication Data is empty)")
        cbflag, _, rest = msg.partition(",")
        authzid, sep, bare = rest.partition(",")
        if not sep or cbflag not in ("n", "y"):
            raise ScramError("channel binding is not supported (expected the gs2 header n,, or y,,)")
        if authzid:
            raise ScramError("an authorization identity (a=) is not supported")
        self._gs2 = f"{cbflag},,"
        a = _attrs(bare)
        if "m" in a:
            raise ScramError("mandatory SCRAM extension m= is not supported")
        if "n" not in a or "r" not in a or not a["r"]:
            raise ScramError("client-first needs n= and r=")
        self.username = _saslname(a["n"])
        stored = self._lookup(self.username)
        if stored is not None:
            self._creds = stored if isinstance(stored, ScramCredentials) else ScramCredentials.parse(stored)
            salt, iterations = self._creds.salt, self._creds.iterations
        else:
            salt, iterations = _h(b"lmqtt-unknown-user\0" + self.username.encode())[:16], DEFAULT_ITERATIONS
        if "," in a["r"]:
            raise ScramError("malformed client nonce")
        self._nonce = a["r"] + (self._snonce or _b64(secrets.token_bytes(18)))
        server_first = f"r={self._nonce},s={_b64(salt)},i={iterations}"
        self._auth_message_prefix = f"{bare},{server_first}"
        self._state = "first-sent"
        return server_first.encode()

    def final(self, client_final: bytes) -> bytes:
        """client-final -> server-final (`v=...`); raises ScramError when the proof is wrong."""
        if self._state != "first-sent":
            raise ScramError("unexpected client-final message")
        self._state = "done"
        try:
            msg = client_final.decode("utf-8")
        except UnicodeDecodeError:
            raise ScramError("client-final is not UTF-8") from None
        head, sep, proof_part = msg.rpartition(",p=")
        if not sep:
            raise ScramError("client-final has no proof")
        a = _attrs(head)
        if a.get("r") != self._nonce:
            raise ScramError("nonce mismatch")
        if a.get("c") != _b64(self._gs2.encode()):      # "biws" / "eSws": base64 of "n,," / "y,,"
            raise ScramError("channel binding data mismatch")
        if self._creds is None:
            raise ScramAuthFailed("authentication failed: unknown user (no SCRAM-SHA-256 verifier)")
        auth_message = f"{self._auth_message_prefix},{head}".encode()
        client_signature = _hmac(self._creds.stored_key, auth_message)
        try:
            proof = base64.b64decode(proof_part, validate=True)
        except ValueError:
            raise ScramError("malformed proof") from None
        if len(proof) != len(client_signature):
            raise ScramAuthFailed("authentication failed: the client proof has the wrong length")
        client_key = bytes(x ^ y for x, y in zip(proof, client_signature))
        if not hmac.compare_digest(_h(client_key), self._creds.stored_key):
            raise ScramAuthFailed("authentication failed: wrong password (the client proof does not verify)")
        return f"v={_b64(_hmac(self._creds.server_key, auth_message))}".encode()


class ScramClient:
    """The client side, for tests, the load generator and tools."""

    def __init__(self, username: str, password: str) -> None:
        self.username, self.password = username, password
        self._cnonce = _b64(secrets.token_bytes(18))
        self._bare = f"n={username.replace('=', '=3D').replace(',', '=2C')},r={self._cnonce}"
        self._server_signature = b""

    def first(self) -> bytes:
        return f"n,,{self._bare}".encode()

    def final(self, server_first: bytes) -> bytes:
        sf = server_first.decode()
        a = _attrs(sf)
        if not a["r"].startswith(self._cnonce):
            raise ScramError("server nonce does not extend ours")
        salted = hashlib.pbkdf2_hmac("sha256", self.password.encode(), base64.b64decode(a["s"]), int(a["i"]))
        client_key = _hmac(salted, b"Client Key")
        without_proof = f"c=biws,r={a['r']}"
        auth_message = f"{self._bare},{sf},{without_proof}".encode()
        signature = _hmac(_h(client_key), auth_message)
        proof = bytes(x ^ y for x, y in zip(client_key, signature))
        self._server_signature = _hmac(_hmac(salted, b"Server Key"), auth_message)
        return f"{without_proof},p={_b64(proof)}".encode()

    def verify(self, server_final: bytes) -> None:
        a = _attrs(server_final.decode())
        if not hmac.compare_digest(base64.b64decode(a.get("v", "")), self._server_signature):
            raise ScramError("the server's signature is wrong: not the server that holds our credentials")
