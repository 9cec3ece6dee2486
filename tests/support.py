"""Test helpers shared by every test folder: free ports, a real `lmqtt serve` subprocess, and MQTT
test clients (paho-mqtt and a raw client on the gateway's own codec). Import them as
`from tests.support import ...`; the fixtures built on them are in conftest.py."""
from __future__ import annotations

import contextlib
import os
import queue as _queue
import signal
import socket
import subprocess
import sys
import threading as _threading
import time
import warnings
import weakref as _weakref


# A free loopback port never handed out before in this process (one set shared with the bench's
# broker starter: a server's MQTT, metrics and store ports come from successive calls, and the
# kernel may offer a just-released port again).
from lmqtt.loadtest.brokers import free_port  # noqa: E402


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def listening(host: str, port: int, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> bool:
    """Whether `host:port` accepts a connection within `timeout` seconds (tried every 50 ms);
    False at once when `proc`, the process meant to listen there, has exited."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def _listens_on(proc: subprocess.Popen, ports: tuple[int, ...]) -> bool:
    """Whether `proc` (or one of its worker processes) is what listens on every one of `ports`."""
    import psutil
    try:
        root = psutil.Process(proc.pid)
        mine = {c.laddr.port for p in (root, *root.children(recursive=True))
                for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    except psutil.Error:
        return False
    return all(port in mine for port in ports)


def _start_on_fresh_ports(server, start, repick, tries: int = 3):
    """`start()`, and on a first start that found one of its ports taken ("address already in
    use": another test process bound the port between free_port()'s check and the server's bind),
    again on ports picked anew. A restart keeps its ports (it must: the clients know them)."""
    first = not getattr(server, "_started_once", False)
    server._started_once = True
    for attempt in range(tries):
        try:
            return start()
        except RuntimeError as e:
            if not first or "address already in use" not in str(e) or attempt == tries - 1:
                raise
            repick()
    raise AssertionError("unreachable")


class LmqttServer:
    """One `lmqtt serve` process: tmp data dir, free ports, SIGTERM (or SIGKILL) and restart.

    Unpacks as `(host, port, data_dir)`; `.restart(kill=True)` simulates a crash (kill -9) and
    starts a new process on the same port and data dir.
    """

    def __init__(self, data_dir: str, extra_args: tuple[str, ...] = (), log_path: str | None = None) -> None:
        self.host = "127.0.0.1"
        self.port = free_port()
        self.metrics_port = free_port()
        self.store_port = free_port()      # the native store protocol (SDK); never the shared 10911
        self.data_dir = str(data_dir)
        self.extra_args = tuple(extra_args)
        self.log_path = log_path or os.path.join(self.data_dir, "..", f"lmqtt-serve-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    def __iter__(self):
        return iter((self.host, self.port, self.data_dir))

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def start(self, timeout: float = 20.0) -> "LmqttServer":
        def repick():
            self.port, self.metrics_port, self.store_port = free_port(), free_port(), free_port()
        return _start_on_fresh_ports(self, lambda: self.spawn(
            ["serve", "--host", self.host, "--port", str(self.port), "--data-dir", self.data_dir,
             "--metrics-port", str(self.metrics_port), "--segment-mb", "16",
             "--store-port", str(self.store_port), *self.extra_args], (self.port, self.store_port), timeout), repick)

    def spawn(self, args: list[str], ports: tuple[int, ...], timeout: float = 20.0):
        """Run `lmqtt <args>` (output appended to the log) and wait until each of `ports` accepts a
        connection, in order; -> self. Exited first, or not listening within `timeout` seconds:
        RuntimeError with the log's tail. (LmqttStore and LmqttGateway start through it too; a test
        that wants other flags than start()'s, e.g. the default segment size, calls it itself.)"""
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "lmqtt.gateway.cli", *args], stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + timeout
        for port in ports:
            if not listening(self.host, port, deadline - time.monotonic(), self.proc):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.command} exited with {self.proc.returncode}: {self.log_tail()}")
                message = f"{self.command} did not listen within {timeout}s: {self.log_tail()}"
                self.stop()         # not left running (with its workers, holding ports) after the test
                raise RuntimeError(message)
        # a port another test process bound first (free_port() gave both the same one) accepts as
        # well, and this process then exits with "address already in use" (a first start is
        # retried on other ports: _start_on_fresh_ports): wait until the listener is this process
        while not _listens_on(self.proc, ports):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.command} exited with {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                message = f"{self.command}: another process listens on one of {ports}: {self.log_tail()}"
                self.stop()
                raise RuntimeError(message)
            time.sleep(0.05)
        return self

    @property
    def store_address(self) -> str:
        """HOST:PORT of the embedded store protocol, for `lmqtt.store.client.connect`."""
        return f"{self.host}:{self.store_port}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
                # a process that ignores SIGTERM is a fault a user meets (an orchestrator waits its
                # grace period, then kills): say so in the run's warnings summary
                warnings.warn(f"{self.command} did not stop within {timeout:g} s of signal {sig}: killed", stacklevel=2)
        self.proc = None
        self._log.close()
        return p.returncode

    def kill9(self) -> int | None:
        return self.stop(signal.SIGKILL)

    command = "lmqtt serve"       # for messages; LmqttStore / LmqttGateway share these methods

    def restart(self, kill: bool = False):
        """Stop (kill -9 with kill=True) and start again on the same ports and data."""
        rc = self.stop(signal.SIGKILL if kill else signal.SIGTERM)
        if not kill:
            assert rc == 0, f"{self.command} exit code {rc} on SIGTERM: {self.log_tail()}"
        return self.start()

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return "<no log>"


class LmqttStore:
    """One `lmqtt store` process (the store node on the native protocol): tmp data dir, free port,
    SIGTERM/SIGKILL and restart on the same port and data dir. `.address` is HOST:PORT."""

    def __init__(self, data_dir: str, extra_args: tuple[str, ...] = (), log_path: str | None = None) -> None:
        self.host = "127.0.0.1"
        self.port = free_port()
        self.data_dir = str(data_dir)
        self.extra_args = tuple(extra_args)
        self.log_path = log_path or os.path.join(self.data_dir, "..", f"lmqtt-store-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> "LmqttStore":
        def repick():
            self.port = free_port()
        return _start_on_fresh_ports(self, lambda: self.spawn(
            ["store", "--host", self.host, "--port", str(self.port), "--data-dir", self.data_dir,
             "--segment-mb", "16", *self.extra_args], (self.port,), timeout), repick)

    spawn = LmqttServer.spawn
    stop = LmqttServer.stop
    kill9 = LmqttServer.kill9
    log_tail = LmqttServer.log_tail

    restart = LmqttServer.restart
    command = "lmqtt store"


# Every Paho/RawMQTT made in this process (weak references, in creation order: nothing is kept
# alive by this list): `close_clients_since(mark)` ends those a test left open, so a server shared
# by a module's tests starts each test without them.
_CLIENTS: list = []


def client_mark() -> int:
    """A mark for `close_clients_since`: the clients made after it are the current test's."""
    return len(_CLIENTS)


def close_clients_since(mark: int) -> None:
    """Disconnect (Paho) or close (RawMQTT) every client made after `mark`, newest first."""
    made = [r() for r in _CLIENTS[mark:]]
    del _CLIENTS[mark:]
    for c in reversed(made):
        if c is None:
            continue
        try:
            if isinstance(c, Paho):
                c.c.disconnect()
                c.c.loop_stop()
            else:
                c.close()
        except Exception:
            pass


class Paho:
    """A paho-mqtt 2.2 client (MQTT 3.1.1 or 5) with blocking helpers for tests.

    Every wait is bounded; messages land in `self.msgs` (a queue of paho MQTTMessage).
    """

    def __init__(self, server, client_id: str = "", version: int = 4, clean: bool = True,
                 expiry: int | None = None, keepalive: int = 30, will: tuple | None = None,
                 receive_maximum: int | None = None, connect: bool = True) -> None:
        _CLIENTS.append(_weakref.ref(self))
        import paho.mqtt.client as mqtt
        from paho.mqtt.properties import Properties
        from paho.mqtt.packettypes import PacketTypes
        self.mqtt = mqtt
        self.host, self.port = server.host, server.port
        self.version = version
        proto = mqtt.MQTTv5 if version == 5 else mqtt.MQTTv311
        kw = {} if version == 5 else {"clean_session": clean}
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=proto, **kw)
        self.msgs: _queue.Queue = _queue.Queue()
        self.connack: _queue.Queue = _queue.Queue()
        self.disconnects: _queue.Queue = _queue.Queue()
        self._subacks: dict[int, list] = {}
        self._sub_ev = _threading.Condition()
        self.c.on_message = lambda c, u, m: self.msgs.put(m)
        self.c.on_connect = lambda c, u, flags, rc, props: self.connack.put((flags, rc, props))
        self.c.on_disconnect = lambda c, u, flags, rc, props: self.disconnects.put(rc)

        def on_sub(c, u, mid, rcs, props):
            with self._sub_ev:
                self._subacks[mid] = rcs
                self._sub_ev.notify_all()
        self.c.on_subscribe = on_sub
        self.c.on_unsubscribe = on_sub
        if will:
            self.c.will_set(*will)
        self._props = None
        if version == 5:
            self._props = Properties(PacketTypes.CONNECT)
            if expiry is not None:
                self._props.SessionExpiryInterval = expiry
            if receive_maximum is not None:
                self._props.ReceiveMaximum = receive_maximum
        self.clean = clean
        self.keepalive = keepalive
        if connect:
            self.connect()

    def connect(self, timeout: float = 5.0):
        if self.version == 5:
            self.c.connect(self.host, self.port, self.keepalive, clean_start=self.clean, properties=self._props)
        else:
            self.c.connect(self.host, self.port, self.keepalive)
        self.c.loop_start()
        try:
            flags, rc, props = self.connack.get(timeout=timeout)
            assert not rc.is_failure, f"CONNACK refused: {rc}"
        except BaseException:
            # a refused or unanswered CONNECT must not leave paho's loop running: it would
            # reconnect on its own with this client id, and once the broker serves again every
            # such leftover takes the session over from the next (a takeover storm)
            self.c.loop_stop()
            self.c.disconnect()
            raise
        self.session_present = bool(flags.session_present)
        self.connack_props = props
        return flags, rc, props

    def subscribe(self, topic, qos: int = 0, timeout: float = 5.0, since: int | None = None, **kw):
        """SUBACK's reason codes; MQTT 5: `kw` the subscription options, `since` (epoch ms) the
        user property of subscribing from the past."""
        if self.version == 5 and (kw or since is not None):
            from paho.mqtt.subscribeoptions import SubscribeOptions
            props = None
            if since is not None:
                from paho.mqtt.packettypes import PacketTypes
                from paho.mqtt.properties import Properties
                props = Properties(PacketTypes.SUBSCRIBE)
                props.UserProperty = ("since", str(since))
            res, mid = self.c.subscribe(topic, options=SubscribeOptions(qos=qos, **kw), properties=props)
        else:
            res, mid = self.c.subscribe(topic, qos)
        assert res == 0
        deadline = time.monotonic() + timeout
        with self._sub_ev:
            while mid not in self._subacks:
                left = deadline - time.monotonic()
                assert left > 0, f"no SUBACK for {topic!r}"
                self._sub_ev.wait(left)
            return [int(getattr(r, "value", r)) for r in self._subacks.pop(mid)]

    def unsubscribe(self, topic, timeout: float = 5.0):
        res, mid = self.c.unsubscribe(topic)
        deadline = time.monotonic() + timeout
        with self._sub_ev:
            while mid not in self._subacks:
                left = deadline - time.monotonic()
                assert left > 0, "no UNSUBACK"
                self._sub_ev.wait(left)
            return self._subacks.pop(mid)

    def publish(self, topic, payload, qos: int = 0, retain: bool = False, properties=None, timeout: float = 5.0):
        info = self.c.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        info.wait_for_publish(timeout)
        assert info.is_published(), f"publish to {topic!r} not acknowledged"
        return info

    def get(self, timeout: float = 5.0):
        return self.msgs.get(timeout=timeout)

    def get_n(self, n: int, timeout: float = 10.0) -> list:
        deadline = time.monotonic() + timeout
        out = []
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                out.append(self.msgs.get(timeout=left))
            except _queue.Empty:
                break
        return out

    def drain(self, wait: float = 0.5) -> list:
        """Whatever else arrives within `wait` seconds."""
        out = []
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return out
            try:
                out.append(self.msgs.get(timeout=left))
            except _queue.Empty:
                return out

    def disconnect(self):
        try:
            self.c.disconnect()
        finally:
            self.c.loop_stop()

    def before_sentinel(self, publisher: "Paho", topic: str, qos: int = 1, timeout: float = 10.0) -> list:
        """What this client receives before a sentinel that `publisher` publishes to `topic` now (the
        sentinel is consumed): see `before_sentinel` below."""
        return before_sentinel(publisher, topic, self, qos=qos, timeout=timeout)[0]


_SENTINELS = iter(range(1, 1 << 62))


def before_sentinel(publisher: Paho, topic: str, *subscribers: Paho, qos: int = 1,
                    timeout: float = 10.0) -> list[list]:
    """For "nothing (more) arrives" checks: `publisher` publishes a unique sentinel to `topic` (which
    each subscriber's subscription matches, through the same filter as the messages in question);
    returns, per subscriber, the messages it received before the sentinel. Whatever the server was
    going to deliver through that filter before the sentinel has arrived by the time the sentinel
    does, so this replaces a fixed `drain(wait)` with a wait for a condition; the sentinel must
    arrive (AssertionError otherwise)."""
    token = f"sentinel-{os.getpid()}-{next(_SENTINELS)}".encode()
    publisher.publish(topic, token, qos=qos)
    out = []
    for sub in subscribers:
        got = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"sentinel on {topic!r} did not arrive within {timeout}s (before it: {got!r})"
            try:
                m = sub.msgs.get(timeout=left)
            except _queue.Empty:
                continue
            if m.payload == token:
                break
            got.append(m)
        out.append(got)
    return out


class RawMQTT:
    """A blocking raw-socket MQTT client built on the gateway's own sans-IO codec.

    For what client libraries hide: killing the socket without DISCONNECT, malformed bytes,
    never reading, exact packet flags.
    """

    def __init__(self, server, version: int = 4, timeout: float = 5.0) -> None:
        from lmqtt.gateway.mqtt import Decoder
        _CLIENTS.append(_weakref.ref(self))
        self.version = version
        self.sock = socket.create_connection((server.host, server.port), timeout=timeout)
        self.dec = Decoder(version=version, server_side=False)
        self._pending: list = []

    def send(self, pkt) -> None:
        from lmqtt.gateway.mqtt import encode
        self.sock.sendall(encode(pkt, self.version))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, timeout: float = 5.0):
        """Next packet, or None if the server closed the connection."""
        self.sock.settimeout(timeout)
        while not self._pending:
            data = self.sock.recv(65536)
            if not data:
                return None
            self._pending.extend(self.dec.feed(data))
        return self._pending.pop(0)

    def connect(self, client_id: str, clean: bool = True, keepalive: int = 60, will=None, props=None):
        from lmqtt.gateway.mqtt import packets as P
        self.send(P.Connect(client_id, self.version, clean, keepalive, None, None, will,
                            props or P.Properties()))
        return self.recv()

    def closed_by_server(self, timeout: float = 5.0) -> bool:
        """True when the server closes the socket within `timeout` (packets before that are skipped)."""
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                self.sock.settimeout(max(0.01, deadline - time.monotonic()))
                data = self.sock.recv(65536)
                if not data:
                    return True
        except socket.timeout:
            return False
        except (ConnectionResetError, BrokenPipeError):
            return True
        return False

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class LmqttGateway:
    """One `lmqtt gateway` process over a running `lmqtt store` (`store_address` HOST:PORT): free
    MQTT and metrics ports; unpacks as `(host, port, None)` like LmqttServer (no data dir)."""

    def __init__(self, store_address: str, extra_args: tuple[str, ...] = (), log_path: str | None = None,
                 log_dir: str | None = None) -> None:
        self.host = "127.0.0.1"
        self.port = free_port()
        self.metrics_port = free_port()
        self.store_address_ = store_address
        self.data_dir = None
        self.extra_args = tuple(extra_args)
        self.log_path = log_path or os.path.join(log_dir or "/tmp", f"lmqtt-gateway-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    __iter__ = LmqttServer.__iter__
    metrics_url = LmqttServer.metrics_url

    def start(self, timeout: float = 20.0) -> "LmqttGateway":
        def repick():
            self.port, self.metrics_port = free_port(), free_port()
        # the metrics/health port opens right after MQTT's
        return _start_on_fresh_ports(self, lambda: self.spawn(
            ["gateway", "--store", self.store_address_, "--host", self.host, "--port", str(self.port),
             "--metrics-port", str(self.metrics_port), "--gateway-id", f"test-{self.port}",
             *self.extra_args], (self.port, self.metrics_port), timeout), repick)

    spawn = LmqttServer.spawn
    stop = LmqttServer.stop
    kill9 = LmqttServer.kill9
    log_tail = LmqttServer.log_tail

    restart = LmqttServer.restart
    command = "lmqtt gateway"


class LmqttFleet:
    """`lmqtt store` + one `lmqtt gateway` standing in for `lmqtt serve` in end-to-end tests (same
    `host`, `port`, `data_dir` of the store, `store_address`, `restart`, `stop`): the gateway's
    tests run against the remote seam too (gateway/storage/remote_store.py)."""

    def __init__(self, data_dir: str, extra_args: tuple[str, ...] = (), log_dir: str | None = None) -> None:
        self.store = LmqttStore(data_dir, log_path=os.path.join(log_dir or os.path.dirname(str(data_dir)),
                                                                "lmqtt-store.log") if log_dir else None)
        self.gateway: LmqttGateway | None = None
        self.extra_args = tuple(extra_args)
        self.log_dir = log_dir

    def start(self) -> "LmqttFleet":
        self.store.start()
        try:
            self.gateway = LmqttGateway(self.store.address, self.extra_args, log_dir=self.log_dir).start()
        except BaseException:
            self.store.stop()       # not left running (holding its port and data dir) after the failure
            raise
        return self

    host = property(lambda self: self.gateway.host)
    port = property(lambda self: self.gateway.port)
    data_dir = property(lambda self: self.store.data_dir)
    store_address = property(lambda self: self.store.address)
    metrics_url = property(lambda self: self.gateway.metrics_url)
    proc = property(lambda self: self.gateway.proc)      # the MQTT-facing process (SIGHUP etc.)

    def __iter__(self):
        return iter((self.host, self.port, self.data_dir))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        rc = self.gateway.stop(sig, timeout) if self.gateway is not None else None
        rs = self.store.stop(sig, timeout)
        return rc if rc not in (0, None) else rs

    def kill9(self) -> int | None:
        return self.stop(signal.SIGKILL)

    def restart(self, kill: bool = False) -> "LmqttFleet":
        """Both processes stop (kill -9 with kill=True) and start again on the same ports."""
        rc = self.stop(signal.SIGKILL if kill else signal.SIGTERM)
        if not kill:
            assert rc == 0, f"fleet exit code {rc} on SIGTERM: {self.log_tail()}"
        self.store.start()
        self.gateway.start()
        return self

    def log_tail(self, n: int = 4000) -> str:
        return f"--- store ---\n{self.store.log_tail(n)}\n--- gateway ---\n{self.gateway.log_tail(n) if self.gateway else ''}"


@contextlib.contextmanager
def fleet_of(directory, n: int = 2, store_args: tuple[str, ...] = (), gateway_args: tuple[str, ...] = ()):
    """One `lmqtt store` (data in `directory`/store, log store.log, `store_args`) and `n` `lmqtt
    gateway`s over it (logs in `directory`, `gateway_args`): `with fleet_of(tmp_path) as (store,
    a, b):`. After: every gateway still running stops with exit code 0, then the store (asserted,
    with the log's tail); a gateway the test stopped or killed itself is passed over."""
    directory = str(directory)
    store = LmqttStore(os.path.join(directory, "store"), store_args,
                       log_path=os.path.join(directory, "store.log")).start()
    gws: list[LmqttGateway] = []
    try:
        for _ in range(n):
            gws.append(LmqttGateway(store.address, gateway_args, log_dir=directory).start())
        yield (store, *gws)
    finally:
        try:
            for g in gws:
                if g.proc is not None:
                    rc = g.stop()
                    assert rc == 0, f"gateway exit code {rc}: {g.log_tail()}"
        finally:
            assert store.stop() == 0, store.log_tail()


def store_and_gateways(directory, n: int = 2):
    """`fleet_of` as a fixture's generator, which keeps its own scope: `yield from
    store_and_gateways(tmp_path)` per test, or over `tmp_path_factory.mktemp(...)` per module."""
    with fleet_of(directory, n) as fleet:
        yield fleet


SERVER_KINDS = ("serve", "fleet")


def running(srv):
    """Generator for a fixture: `srv` (an LmqttServer, LmqttStore, LmqttGateway or LmqttFleet not
    started yet) started, yielded, stopped after: `yield from running(LmqttStore(...))`."""
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def serve_or_fleet(kind: str, tmp_path, extra_args: tuple[str, ...] = ()):
    """Generator for a fixture parametrized over SERVER_KINDS: an embedded `lmqtt serve`
    (the in-process storage facades) or `lmqtt store` + `lmqtt gateway` (the remote ones), started, stopped after."""
    if kind == "serve":
        srv = LmqttServer(str(tmp_path / "data"), extra_args, log_path=str(tmp_path / "lmqtt-serve.log"))
    else:
        srv = LmqttFleet(str(tmp_path / "store-data"), extra_args, log_dir=str(tmp_path))
    yield from running(srv)


def server_alive(srv) -> bool:
    """Whether every process of an LmqttServer / LmqttStore / LmqttGateway / LmqttFleet runs."""
    if isinstance(srv, LmqttFleet):
        return server_alive(srv.store) and srv.gateway is not None and server_alive(srv.gateway)
    return srv.proc is not None and srv.proc.poll() is None


def ensure_running(srv):
    """Start again (same ports, same data) whatever a previous test left stopped or killed: a server
    shared by a module's tests is running when each test starts."""
    if server_alive(srv):
        return srv
    if isinstance(srv, LmqttFleet):
        if srv.gateway is not None and srv.gateway.proc is not None:
            srv.gateway.stop(signal.SIGKILL)
        if not server_alive(srv.store):
            srv.store.stop(signal.SIGKILL)
            srv.store.start()
        srv.gateway.start()
        return srv
    srv.stop(signal.SIGKILL)
    return srv.start()


def shared_serve_or_fleet(kind: str, tmp_path_factory, extra_args: tuple[str, ...] = ()):
    """serve_or_fleet for a module-scoped fixture: one server (or store + gateway) in its own tmp
    dir for all of a module's tests of that kind. Pair it with `per_test(srv)` in a function-scoped
    fixture; tests then use their own client ids and topics."""
    yield from serve_or_fleet(kind, tmp_path_factory.mktemp(f"{kind}-shared"), extra_args)


def both_kinds_fixtures():
    """The `shared_server` and `lmqtt_server` fixtures of a module whose tests run against both
    server kinds: `shared_server, lmqtt_server = both_kinds_fixtures()` at module level.
    `shared_server`: one server per kind for the module, the embedded `lmqtt serve` and `lmqtt
    store` + `lmqtt gateway` (the remote store seam); `lmqtt_server`: the same, up when the test
    starts (restarted if an earlier test left it down), the test's clients disconnected when it
    ends. Tests use their own client ids and topics."""
    import pytest

    @pytest.fixture(scope="module", params=SERVER_KINDS)
    def shared_server(request, tmp_path_factory):
        yield from shared_serve_or_fleet(request.param, tmp_path_factory)

    @pytest.fixture
    def lmqtt_server(shared_server):
        yield from per_test(shared_server)
    return shared_server, lmqtt_server


def per_test(srv):
    """Generator for the function-scoped fixture over a module-scoped shared server: the server
    runs when the test starts (restarted if an earlier test left it down), and the MQTT clients the
    test made are disconnected when it ends."""
    ensure_running(srv)
    mark = client_mark()
    try:
        yield srv
    finally:
        close_clients_since(mark)


async def wait_until(pred, timeout: float = 5.0) -> bool:
    """On an asyncio loop: poll `pred()` every 10 ms until it is true (True) or `timeout` seconds
    passed (False)."""
    import asyncio
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def redis_server_fixture():
    """A module-scoped fixture: one real redis-server (lmqtt.loadtest.redis_streams.RedisServer)
    for the module's tests. `redis_server = redis_server_fixture()` at module level."""
    import pytest

    @pytest.fixture(scope="module")
    def redis_server():
        from lmqtt.loadtest.redis_streams import RedisServer
        srv = RedisServer()
        yield srv
        srv.stop()
    return redis_server


def mixed_publish_props(i: int, user: tuple[int, int], expiry: tuple[int, int]):
    """MQTT 5 PUBLISH properties for message `i` of a mixed run: a user property ("i", str(i)) when
    i % user[0] == user[1], else a Message Expiry Interval of 3600 s when i % expiry[0] ==
    expiry[1], else none. -> (paho Properties or None, the user property or None, the expiry or
    None). The runs test that messages needing properties interrupt a plain run in order."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    if i % user[0] == user[1]:
        props = Properties(PacketTypes.PUBLISH)
        props.UserProperty = ("i", str(i))
        return props, ("i", str(i)), None
    if i % expiry[0] == expiry[1]:
        props = Properties(PacketTypes.PUBLISH)
        props.MessageExpiryInterval = 3600
        return props, None, 3600
    return None, None, None


def until(fn, timeout: float = 20.0):
    """`fn()` once it is truthy (polled every 50 ms), or its last value after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (got := fn()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def metric(url: str, name: str) -> float:
    """The value of metric `name` (or `name_total`, a counter) on a /metrics page."""
    import urllib.request
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "_total "):
                return float(line.split()[-1])
    raise AssertionError(f"{name} not in {url}")


def wait_metric(url: str, name: str, want: float, timeout: float = 15.0) -> float:
    """`metric` once it equals `want`, or its last value after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (v := metric(url, name)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return v


def disk_usage(path: str) -> int:
    """Bytes allocated on disk under `path` (what `du` counts: blocks, not apparent sizes)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            total += os.lstat(os.path.join(root, f)).st_blocks * 512
    return total


def pki_files(directory) -> dict[str, str]:
    """A test PKI written into `directory`/pki by trustme (the caller skips without it): "ca",
    the server's "cert" (for 127.0.0.1 and localhost) and "key", a "client" key + certificate
    (CN dev-01), and a "rogue" one with the same name signed by another CA. -> the PEM paths."""
    import trustme
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("dev-01", common_name="dev-01")
    rogue = trustme.CA().issue_cert("dev-01", common_name="dev-01")      # signed by another CA
    d = os.path.join(str(directory), "pki")
    os.mkdir(d)
    paths = {k: os.path.join(d, f"{k}.pem") for k in ("ca", "cert", "key", "client", "rogue")}
    ca.cert_pem.write_to_path(paths["ca"])
    server.cert_chain_pems[0].write_to_path(paths["cert"])
    server.private_key_pem.write_to_path(paths["key"])
    client.private_key_and_cert_chain_pem.write_to_path(paths["client"])
    rogue.private_key_and_cert_chain_pem.write_to_path(paths["rogue"])
    return paths


def record_position(segment: str, topic: str, body: bytes) -> int:
    """Position in CommitLog `segment` (a file named by its start offset) of the first record of
    (`topic`, `body`); a delayed message's parked record has the topic "$timer"."""
    from lmqtt.store.record import PREFIX, decode
    with open(segment, "rb") as f:
        data = f.read()
    start = int(os.path.basename(segment))
    pos = 0
    while pos + 8 <= len(data):
        total, _magic = PREFIX.unpack_from(data, pos)
        if total == 0:
            break
        m = decode(data, pos, start + pos, "", True, pos + total)
        if m.topic == topic and m.body == body:
            return pos
        pos += total
    raise AssertionError(f"no record of {topic} {body!r} in {segment}")


def poll_n(consumer, n: int, timeout: float = 10.0) -> list:
    """Records from an SDK consumer's `poll()` until `n` came or `timeout` seconds passed (then
    fewer: the caller's assertion says what was missing)."""
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        recs = consumer.poll()
        got += recs
        if not recs:
            time.sleep(0.05)
    return got


def stop_all(gateways, store) -> None:
    """Stop the gateway processes still running, then the store."""
    for g in gateways:
        if g.proc is not None and g.proc.poll() is None:
            g.stop()
    store.stop()


def lmqtt_cli(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    """Run `lmqtt ARGS…` (this checkout's, as `python3 -m lmqtt.gateway.cli`), output captured as
    text; a traceback on stderr fails the test (user errors are one line naming the cause)."""
    r = subprocess.run([sys.executable, "-m", "lmqtt.gateway.cli", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout, **kw)
    assert "Traceback" not in r.stderr, r.stderr
    return r
