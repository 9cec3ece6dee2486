"""The gateway <-> store node protocol (store/node/protocol.py): every request and reply type
survives its wire form, the registry is exactly what the node serves and what `NodeClient` sends,
a malformed request is refused naming its field by a real `lmqtt store`, and the version rule:
a gateway refuses a store node of another version, or an embedded `lmqtt serve`, before it
sends anything."""
from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import typing

import pytest

from lmqtt.gateway.storage.node_client import NodeClient
from lmqtt.store.node import protocol as P
from lmqtt.store.node.protocol import call_sync

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- the types, without a store
def _sample(tp, k: int = 0):
    """A value of field type `tp` (k varies it)."""
    if tp is str:
        return f"s{k}/é"
    if tp is int:
        return 7 + k
    if tp is bool:
        return True
    if tp is bytes:
        return b"\x00\xff" + bytes([k])
    if tp is dict:
        return {"filter": "a/+", "sources": [["a", 0, k]]}
    if dataclasses.is_dataclass(tp):
        return tp(**{f.name: _sample(h, k) for f, h in _hints(tp)})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return [_sample(args[0], k), _sample(args[0], k + 1)]
    if origin is tuple:
        return tuple(_sample(a, k + i) for i, a in enumerate(args))
    if origin is dict:
        return {f"k{k}": _sample(args[1], k), f"k{k + 1}": _sample(args[1], k + 1)}
    inner = [a for a in args if a is not type(None)]
    return _sample(inner[0], k)                   # X | None


def _hints(cls):
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.metadata.get("wire", True)]


def _full(cls):
    kw = {f.name: _sample(h, i) for i, (f, h) in enumerate(_hints(cls))}
    if cls is P.Register:
        kw["filter"] = None                        # one of filter / filters
    if cls.has_messages:
        kw["messages"] = [("an entry",)]
    return cls(**kw)


def _required(cls):
    kw = {f.name: _sample(h) for f, h in _hints(cls)
          if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if cls is P.Register:
        kw["filters"] = ["a/#"]
    return cls(**kw)


ALL_TYPES = sorted({t for pair in P.COMMANDS.values() for t in pair} | {P.HolderInfo}, key=lambda t: t.__name__)


@pytest.mark.parametrize("cls", ALL_TYPES, ids=lambda t: t.__name__)
def test_every_request_and_reply_type_round_trips_through_its_wire_form(cls):
    for obj in (_full(cls), _required(cls)):
        wire = json.loads(json.dumps(obj.to_wire()))          # what crosses the socket
        back = cls.from_wire(wire, obj.messages) if cls.has_messages else cls.from_wire(wire)
        assert back == obj, (wire, back, obj)
        assert "messages" not in wire


@pytest.mark.parametrize("cls", [t for t, _r in P.COMMANDS.values()], ids=lambda t: t.cmd)
def test_a_request_missing_a_field_or_with_a_wrong_type_is_refused_naming_the_field(cls):
    wire = _full(cls).to_wire()
    for f, tp in _hints(cls):
        wrong = dict(wire, **{f.name: 1.5})                     # no field of ours is a float
        with pytest.raises(P.BadRequest, match=rf"^{cls.cmd}: field '{f.name}' must be .*, got a number \(1.5\)$"):
            cls.from_wire(wrong)
        if f.default is dataclasses.MISSING:
            with pytest.raises(P.BadRequest, match=rf"^{cls.cmd}: field '{f.name}' is missing$"):
                cls.from_wire({k: v for k, v in wire.items() if k != f.name})


def test_the_wire_form_is_the_one_gateways_and_stores_used_before():
    """The JSON bodies are those of the untyped commands (docs/protocol.md's table): a push-less
    watch answer has no `push`, binary fields are base64, a missing session is `rec: null`."""
    assert P.Watch(["a"], push=True).to_wire() == {"queues": ["a"], "push": True, "raw": False, "replace": False}
    assert P.WatchReply({"a": 3}).to_wire() == {"max_offsets": {"a": 3}}
    assert P.WatchReply({"a": 3}, push=True, raw=True).to_wire() == {"max_offsets": {"a": 3}, "push": True, "raw": True}
    assert P.RetainedReply([("r/1", b"\x00\xff", b"")]).to_wire() == {"retained": [["r/1", "AP8=", ""]]}
    assert P.SessionReply(None).to_wire() == {"rec": None}
    assert P.RegisterReply(count=2).to_wire() == {"count": 2}
    assert P.HoldersReply({"g": P.HolderInfo(2, False)}).to_wire() == {"gateways": {"g": {"filters": 2, "connected": False}}}
    assert P.PutWill.from_wire({"client_id": "c", "will": "AP8="}) == P.PutWill("c", b"\x00\xff", None)
    assert P.Pull.from_wire({"queue": "q", "cmd": "gw_pull", "later": 1}) == P.Pull("q")    # unknown fields ignored
    with pytest.raises(P.BadRequest, match=r"^gw_set_retained: field 'payload' must be a base64 string"):
        P.SetRetained.from_wire({"topic": "t", "payload": "not base64!"})
    with pytest.raises(P.BadRequest, match=r"^gw_claim_sessions: field 'claims\[1\]\[1\]' must be an integer"):
        P.ClaimSessions.from_wire({"gateway": "g", "claims": [["a", 1], ["b", "2"]]})
    with pytest.raises(P.BadRequest, match=r"gw_register: give field 'filter' or field 'filters'"):
        P.Register.from_wire({"gateway": "g"})


def test_the_node_client_has_one_method_per_command_taking_the_requests_fields():
    for name, (req, _reply) in P.COMMANDS.items():
        method = getattr(NodeClient, name[len("gw_"):])
        params = list(inspect.signature(method).parameters)[1:]
        assert params == [f.name for f in dataclasses.fields(req)], name


def test_every_command_says_whether_it_changes_the_replicated_metadata():
    """A store group answers a write only once its in-sync replicas applied it (ha_member.py wraps
    the commands of `WRITES`): a command that writes but is not marked would be answered before,
    and its change lost in a failover. So `writes` has no default, and a command named for a
    change (put, set, delete, pop, void, take, register, release, claim, clear, ack) is a write."""
    with pytest.raises(TypeError):
        P.command("gw_unmarked", P.Ok)    # type: ignore[call-arg]
    assert "gw_unmarked" not in P.COMMANDS
    changes = ("put_", "set_", "delete_", "pop_will", "void_", "take_", "register", "unregister", "release_",
               "claim_", "clear_", "_ack")
    named_for_a_change = {c for c in P.COMMANDS if any(v in c for v in changes)}
    assert named_for_a_change <= P.WRITES, sorted(named_for_a_change - P.WRITES)
    assert P.WRITES <= set(P.COMMANDS)
    from lmqtt.store.node.ha_member import GW_WRITES
    assert P.WRITES - {"gw_group_ack"} <= set(GW_WRITES)      # gw_group_ack: with its groups' state


# ---------------------------------------------------------------- a real `lmqtt store`
def test_the_registry_is_exactly_what_the_node_serves(tmp_path):
    """Every command of the registry is served by the node's method of that name, and the node
    serves no gw_* command the registry does not type."""
    from lmqtt.lightqueue import LightQueueStore
    from lmqtt.store import MessageStore, StoreConfig
    from lmqtt.store.node import gateway_service
    from lmqtt.store.server import StoreServer

    store = MessageStore(StoreConfig(data_dir=str(tmp_path / "store"), flush_mode="async"))
    lq = LightQueueStore(store, str(tmp_path / "lq"))
    store.start()
    loop = asyncio.new_event_loop()
    srv = StoreServer(store, str(tmp_path / "meta"), port=0)
    gws = gateway_service.install(srv, lq, loop)
    try:
        served = {c for c in srv.calls if c.startswith("gw_")}
        assert served == set(P.COMMANDS)
        assert all(callable(getattr(gws, c)) for c in P.COMMANDS)
        assert srv.hello_info == {"gateway_protocol": P.NODE_PROTOCOL_VERSION}
    finally:
        gws.close()
        loop.close()
        asyncio.run(srv.stop())
        store.shutdown()
        lq.close()


def test_a_malformed_request_gets_an_error_naming_the_field_and_the_connection_goes_on(lmqtt_store):
    from lmqtt.store.client import StoreClientError, connect

    with connect(lmqtt_store.address) as c:
        with pytest.raises(StoreClientError, match=r"^invalid: gw_pull: field 'queue' is missing$"):
            c.cmd("gw_pull", offset=0)
        with pytest.raises(StoreClientError, match=r"^invalid: gw_pull: field 'offset' must be an integer, "
                                                   r"got a string \(\"12\"\)$"):
            c.cmd("gw_pull", queue="q", offset="12")
        with pytest.raises(StoreClientError, match=r"^invalid: gw_set_offsets: field 'offsets.a/b' must be an "
                                                   r"integer, got null$"):
            c.cmd("gw_set_offsets", consumer="c", offsets={"a/b": None})
        with pytest.raises(StoreClientError, match=r"^invalid: gw_put_will: field 'will' must be a base64 string"):
            c.cmd("gw_put_will", client_id="c", will="%%%")
        assert c.cmd("gw_get_offsets", consumer="c") == {"offsets": {}}       # nothing was written
        assert c.cmd("gw_max_offsets", queues=["q"]) == {"max_offsets": {"q": 0}}
        assert c.server_info["gateway_protocol"] == P.NODE_PROTOCOL_VERSION


def test_the_one_gateway_group_lease_is_gone_an_old_caller_gets_unknown_command(lmqtt_store):
    """gw_group_lease (protocol 1's one-gateway-per-group lease) was replaced by per-message
    assignment (gw_group_pop/ack/renew): the node no longer serves it, a caller gets one clear
    error and the connection goes on."""
    from lmqtt.store.client import StoreClientError, connect

    assert "gw_group_lease" not in P.COMMANDS
    with connect(lmqtt_store.address) as c:
        with pytest.raises(StoreClientError, match=r"^unknown_command: unknown command 'gw_group_lease'$"):
            c.cmd("gw_group_lease", gateway="gw-a", group="g", queue="q", consumer="$share/g", ttl_ms=3000)
        assert c.cmd("gw_max_offsets", queues=["q"]) == {"max_offsets": {"q": 0}}


def test_docs_protocol_md_lists_exactly_the_commands_the_node_serves():
    """docs/protocol.md's table of gw_* commands names each command of the registry once and no
    other (a removed command leaves the docs with it)."""
    import re

    from tests.support import ROOT

    text = open(f"{ROOT}/docs/protocol.md", encoding="utf-8").read()
    documented: list[str] = []
    for line in text.splitlines():
        if line.startswith("| `gw_"):
            documented += re.findall(r"`(gw_[a-z_]+)`", line.split(" | ")[0])
    assert sorted(documented) == sorted(P.COMMANDS)


# ---------------------------------------------------------------- the version rule, real processes
def _gateway_exit(store_address: str, tmp_path) -> tuple[int, str]:
    """`lmqtt gateway --store store_address` run to its exit (30 s at most): (exit code, output)."""
    import subprocess
    import sys

    from tests.support import ROOT, free_port
    cmd = [sys.executable, "-m", "lmqtt.gateway.cli", "gateway", "--store", store_address, "--host", "127.0.0.1",
           "--port", str(free_port()), "--metrics-port", "0", "--gateway-id", "refused-gw"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, text=True)
    try:
        out, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"the gateway started against {store_address} instead of refusing it: {err[-2000:]}")
    return p.returncode, out + err


def _start_store_speaking(version: int, data_dir: str, port: int, log_path: str):
    """`lmqtt store` as another lmqtt version would run it: the same node, NODE_PROTOCOL_VERSION
    set to `version` before it starts (a real process on a real port)."""
    import subprocess
    import sys

    from tests.support import ROOT, listening
    code = ("import sys\nfrom lmqtt.store.node import protocol\nprotocol.NODE_PROTOCOL_VERSION = %d\n"
            "from lmqtt.gateway.cli import main\nsys.exit(main())\n" % version)
    log = open(log_path, "ab")
    p = subprocess.Popen([sys.executable, "-c", code, "store", "--host", "127.0.0.1", "--port", str(port),
                          "--data-dir", data_dir, "--segment-mb", "16"], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    log.close()
    if listening("127.0.0.1", port, 20, p):
        return p
    assert p.poll() is None, f"lmqtt store exited with {p.returncode}"
    p.kill()
    pytest.fail("lmqtt store did not listen")


def _stop(p) -> None:
    import signal
    import subprocess
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(15)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)


def test_a_gateway_pointed_at_an_embedded_serve_is_told_it_needs_lmqtt_store(tmp_path):
    """`lmqtt serve --store-port` serves the SDK, not gateways: `lmqtt gateway --store` at that port
    exits at start with one line saying so, no traceback (it used to start and fail later)."""
    from tests.support import LmqttServer
    srv = LmqttServer(str(tmp_path / "serve"), log_path=str(tmp_path / "serve.log")).start()
    try:
        code, output = _gateway_exit(srv.store_address, tmp_path)
    finally:
        srv.stop()
    assert code == 1, output
    assert output.strip().splitlines()[-1] == (f"lmqtt gateway: {srv.store_address} is an embedded `lmqtt serve`; "
                                               f"gateways need `lmqtt store` (docs/fleet.md)"), output
    assert "Traceback" not in output


def test_a_gateway_refuses_a_store_node_of_another_version(tmp_path):
    from tests.support import free_port
    port = free_port()
    theirs = P.NODE_PROTOCOL_VERSION + 1
    p = _start_store_speaking(theirs, str(tmp_path / "node"), port, str(tmp_path / "node.log"))
    try:
        code, output = _gateway_exit(f"127.0.0.1:{port}", tmp_path)
    finally:
        _stop(p)
    assert code == 1, output
    assert output.strip().splitlines()[-1] == (
        f"lmqtt gateway: store node 127.0.0.1:{port} speaks gateway protocol {theirs}, this gateway speaks "
        f"{P.NODE_PROTOCOL_VERSION}: run the same lmqtt version on both"), output
    assert "Traceback" not in output


def test_a_node_that_comes_back_as_another_version_gets_nothing_until_the_versions_match(tmp_path):
    """A running gateway whose store node restarts as another version (one side upgraded) drops
    the link before it sends anything (the node never hears its gw_hello: the gateway does not
    count as connected there), reports why, and redials; the same version back, it goes on."""
    from lmqtt.gateway.storage.remote_store import RemoteStore
    from lmqtt.gateway.storage.store_link import LoopConnection
    from lmqtt.store.client import connect
    from tests.support import LmqttStore, wait_until

    store = LmqttStore(str(tmp_path / "node"), log_path=str(tmp_path / "node.log")).start()
    other = None

    async def go():
        nonlocal other
        link = LoopConnection(store.address, loop=asyncio.get_running_loop(), backoff_max=0.2)
        link.connect_blocking()
        st = RemoteStore(link, "gw-up", safety_poll_s=0)
        try:
            assert st.metadata.filters.register("vx/+").wait() == 1                    # a hold: the node names its holder
            store.stop()
            other = _start_store_speaking(P.NODE_PROTOCOL_VERSION + 1, store.data_dir, store.port,
                                          str(tmp_path / "other.log"))
            why = f"store node {store.address} speaks gateway protocol {P.NODE_PROTOCOL_VERSION + 1}"
            assert await wait_until(lambda: why in (st.unavailable() or ""), 20), st.unavailable()
            with connect(store.address) as sdk:
                holders = call_sync(sdk, P.Holders()).gateways
            assert holders == {"gw-up": P.HolderInfo(1, False)}      # gw_hello never reached it
            _stop(other)
            other = None
            store.start()
            assert await wait_until(lambda: st.unavailable() is None, 20), st.unavailable()
            assert st.metadata.filters.registered().wait() == {"vx/+": 1}
            with connect(store.address) as sdk:
                assert await wait_until(lambda: call_sync(sdk, P.Holders()).gateways["gw-up"].connected, 10)
        finally:
            st.close()
            link.close()
    try:
        asyncio.run(go())
    finally:
        if other is not None:
            _stop(other)
        store.stop()
