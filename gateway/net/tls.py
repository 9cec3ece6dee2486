"""TLS for the MQTT and WebSocket listeners: one server `SSLContext` built from the listener's
settings, with errors that name the file and the real cause.

`--cert`/`--key` are the server's PEM chain and key; `--cafile` is the CA that signs client
certificates; with `--require-certificate` a client without a valid certificate fails the
handshake (mutual TLS), and the certificate's CN (else first DNS SAN) can become the MQTT username
(gateway/security/auth.py `ClientCertificate`). TLS 1.2 is the floor, as in Mosquitto 2's default.
"""
from __future__ import annotations

import os
import ssl


class TlsConfigError(Exception):
    """A TLS setting that cannot work; the message names the file and the reason."""


def server_context(cert: str, key: str | None = None, cafile: str | None = None,
                   require_certificate: bool = False) -> ssl.SSLContext:
    for label, path in (("certificate", cert), ("key", key), ("CA file", cafile)):
        if path and not os.path.isfile(path):
            raise TlsConfigError(f"TLS {label} {path}: no such file")
    if require_certificate and not cafile:
        raise TlsConfigError("--require-certificate needs --cafile (the CA that signs client certificates)")
    problem = _pem_problem(cert, key)
    if problem:
        raise TlsConfigError(problem)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise TlsConfigError(f"TLS certificate {cert} / key {key or cert}: {e.reason or e} "
                             f"(do the certificate and key belong together?)") from e
    except OSError as e:
        raise TlsConfigError(f"TLS certificate {cert}: {e.strerror or e}") from e
    if cafile:
        try:
            ctx.load_verify_locations(cafile)
        except (ssl.SSLError, OSError) as e:
            raise TlsConfigError(f"TLS CA file {cafile}: {getattr(e, 'reason', None) or e}") from e
        ctx.verify_mode = ssl.CERT_REQUIRED if require_certificate else ssl.CERT_OPTIONAL
    return ctx


def _pem_problem(cert: str, key: str | None) -> str | None:
    """What OpenSSL would only call "PEM lib": a --cert file with no certificate in it (a key given
    as the certificate), or no --key and no private key inside --cert."""
    try:
        with open(cert, "rb") as f:
            text = f.read()
    except OSError:
        return None                 # load_cert_chain names it
    if b"-----BEGIN CERTIFICATE-----" not in text:
        return f"TLS certificate {cert}: no PEM certificate in it (-----BEGIN CERTIFICATE-----; is it the key?)"
    if key is None and b"PRIVATE KEY-----" not in text:
        return f"TLS certificate {cert} has no private key in it: give the key file with --key FILE"
    return None
