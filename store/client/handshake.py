"""The HELLO handshake of every SDK connection class: a TCP connection opened to a store and
greeted (`dial`). Blocking: the sync connection dials in its caller's thread, the gateway's link
and the member probe in a thread of their own."""
from __future__ import annotations

import socket
import time

from lmqtt.store import protocol as W

from .errors import NOT_A_STORE_HINT, ConnectionLost, not_a_store, parse_hello_ok


def dial(host: str, port: int, *, connect_timeout: float, client_name: str, token: str | None,
         decoder: "W.FrameDecoder") -> tuple[socket.socket, dict, list]:
    """Open a TCP connection to a store and do the HELLO handshake: (the socket, back in blocking
    mode; the server's info; the frames that arrived behind HELLO_OK, already fed to `decoder`).
    The one handshake of every SDK connection class.

    It blocks for at most `connect_timeout` in each of its three steps: the connect, the send of
    HELLO (the socket keeps the connect's timeout) and the wait for the answer, so about three
    times `connect_timeout` in the worst case.

    The socket is closed on any error: ConnectionLost (an OSError, naming the store) when the
    network fails; StoreClientError when the store refuses (wrong token or version) or answers
    with another frame or a HELLO_OK whose body is not a JSON object, and when its bytes are not
    frames at all (another server's port: `not_a_store`). Connection._ensure
    retries only ConnectionLost (a refusal or a malformed answer will not change on retry);
    LoopConnection's redial loop retries every error."""
    address = f"{host}:{port}"
    try:
        s = socket.create_connection((host, port), timeout=connect_timeout)
    except OSError as e:
        raise ConnectionLost(f"cannot reach the store at {address}: {e.strerror or e}") from None
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(W.hello_frame(client_name, token))
        frames = []
        deadline = time.monotonic() + connect_timeout
        while not frames:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            data = s.recv(65536)
            if not data:
                raise ConnectionLost(f"store {address} closed the connection during the handshake"
                                     f"{NOT_A_STORE_HINT}")
            try:
                frames = decoder.feed(data)
            except W.ProtocolError:
                raise not_a_store(address, data) from None
        op, _flags, _rid, body = frames[0]
        info = parse_hello_ok(op, body)
    except ConnectionLost:
        s.close()
        raise
    except OSError as e:
        s.close()
        raise ConnectionLost(f"handshake with the store at {address} failed: {e}") from None
    except BaseException:
        s.close()
        raise
    s.settimeout(None)
    return s, info, frames[1:]
