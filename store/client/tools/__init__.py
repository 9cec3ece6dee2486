"""The SDK's command-line tools (`lmqtt produce`, `consume`, `admin`) over the store's native protocol, like
Kafka's console producer/consumer; the web console is `console_web/`.

    lmqtt produce --store HOST:PORT --topic T [--qos N] [--key K]... [--property k=v]... [--batch]
    lmqtt consume --store HOST:PORT --filter F [--group G] [--from earliest|latest|TIME]
                  [--count N] [--timeout S] [--format text|json]
    lmqtt admin   --store HOST:PORT [--group G]... [--format table|json]
                  [--gateways | --release-gateway ID | --sessions [--limit N] | --session CLIENT_ID]
                  [--members | --add-member HOST:PORT | --remove-member HOST:PORT|NODE [--wait S]]

`produce` sends one message per stdin line (the line without its newline) and prints a one-line
summary (count, rate) to stderr. `consume` prints one message per stdout line. `--filter` is an MQTT
topic filter (wildcards, or any topic with a `/`: read from the filter's light queue, exactly what
an MQTT subscriber sees) or a plain first-level topic (`sensors`: its ConsumeQueue, every message
under `sensors/...`). `--from TIME` takes epoch milliseconds or ISO 8601. With `--group` the
position is committed in the store after every printed message batch, so the next run resumes
where this one stopped. Errors (store unreachable, refused, lost mid-run) name the cause on stderr
and exit non-zero; `produce` reports how many lines were acknowledged before the failure.
"""
from __future__ import annotations

import argparse
import base64
import datetime as _dt
import json
import os
import sys
import time

from . import members, security
from .sessions import admin_sessions
from .tier import admin_tier
from lmqtt.store.client import ConnectionLost, GroupedConnection, StoreClientError, connect, split_groups
from lmqtt.store.node import protocol as P
from lmqtt.store.node.protocol import call_sync

EXIT_UNREACHABLE = 3
EXIT_REFUSED = 4


def _connect(prog: str, address: str, token: str | None):
    try:
        split_groups(address)       # one group's members "a:p,b:p", several groups ";"-separated
    except ValueError as e:         # a usage error, not an unreachable store
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        return connect(address, token=token, reconnect_attempts=3, connect_timeout=3.0)
    except StoreClientError as e:
        if "is not an lmqtt store" in str(e):      # another server's port (connection.not_a_store)
            print(f"{prog}: {e}", file=sys.stderr)
            raise SystemExit(EXIT_UNREACHABLE) from None
        hint = " (give the store's token with --token or $LMQTT_STORE_TOKEN)" if "token" in str(e) else ""
        print(f"{prog}: store {address} refused the connection: {e}{hint}", file=sys.stderr)
        raise SystemExit(EXIT_REFUSED) from None
    except (ConnectionLost, OSError, ValueError) as e:
        why = str(e)
        # the SDK's message names the address already ("cannot reach the store at X (...)")
        print(f"{prog}: {why}" if address in why else f"{prog}: cannot reach store {address}: {why}",
              file=sys.stderr)
        raise SystemExit(EXIT_UNREACHABLE) from None


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", default="127.0.0.1:10911",
                   help="store address HOST:PORT, or a store group's HOST:PORT,HOST:PORT,... (docs/ha.md), "
                        "or several groups separated by ';' (docs/groups.md; default 127.0.0.1:10911)")
    # the same variable `lmqtt store` and `lmqtt gateway` read, so one export serves all of them
    p.add_argument("--token", default=os.environ.get("LMQTT_STORE_TOKEN") or None,
                   help="auth token for the store handshake (default: $LMQTT_STORE_TOKEN, else none; "
                        "a store started with --token needs it)")


# --------------------------------------------------------------------------------------- produce
def _prop(s: str) -> tuple[str, str]:
    k, sep, v = s.partition("=")
    if not sep or not k:
        raise argparse.ArgumentTypeError(f"--property wants k=v, got {s!r}")
    return k, v


def _line(raw: bytes) -> bytes:
    """The message of one stdin line: without its "\n" (and a "\r" before it)."""
    if raw.endswith(b"\n"):
        raw = raw[:-1]
        if raw.endswith(b"\r"):
            raw = raw[:-1]
    return raw


def produce_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lmqtt produce",
                                description="Send one message per stdin line to a topic of the store.")
    _common(p)
    p.add_argument("--topic", required=True, help="MQTT topic name (no wildcards)")
    p.add_argument("--qos", type=int, choices=(0, 1, 2), default=1, help="QoS carried on the record (default 1)")
    p.add_argument("--key", action="append", default=[], help="message key (repeatable; indexed for queries; default none)")
    p.add_argument("--property", action="append", default=[], type=_prop, metavar="K=V",
                   help="MQTT 5 user property (repeatable, order kept; default none)")
    p.add_argument("--retain", action="store_true", help="set the retain flag on the records")
    p.add_argument("--content-type", help="MQTT 5 content type (default none)")
    p.add_argument("--batch", action="store_true", help="AutoBatch: pack lines into batches (much faster)")
    p.add_argument("--producer-id", help="stable producer id (default: random)")
    args = p.parse_args(argv)
    if not args.topic:
        print("lmqtt produce: --topic must not be empty (a topic name such as sensors/kitchen/temp)", file=sys.stderr)
        return 2
    if "+" in args.topic or "#" in args.topic:
        print(f"lmqtt produce: --topic must be a topic name without wildcards, got {args.topic!r}", file=sys.stderr)
        return 2
    if args.topic.startswith("$"):
        # $SYS/... would reach MQTT subscribers as the broker's own statistics, $timer is the store's
        # queue of parked delayed messages: MQTT clients may not publish there either (PUBACK 0x87)
        print(f"lmqtt produce: --topic {args.topic!r}: topics starting with '$' belong to the broker and the "
              f"store ($SYS, $timer ...); MQTT clients may not publish there either", file=sys.stderr)
        return 2
    conn = _connect("lmqtt produce", args.store, args.token)
    kw = dict(keys=tuple(args.key), qos=args.qos, retain=args.retain, content_type=args.content_type,
              user_properties=list(args.property) or None)
    n = 0
    t0 = time.perf_counter()
    stdin = sys.stdin.buffer
    try:
        if args.batch:
            ab = conn.auto_batch_producer(args.producer_id)
            try:
                for line in stdin:
                    ab.send(args.topic, _line(line), **kw)
                    if ab.failed is not None:   # stop reading at the first refused batch
                        break
                n = ab.flush()                  # raises the first failure, if any
            except BaseException:
                n = ab.acknowledged             # what the store acknowledged, for the message below
                raise
            finally:
                try:
                    ab.close()
                except Exception:  # noqa: BLE001 - the error that matters is reported below
                    pass
        else:
            prod = conn.producer(args.producer_id)
            for line in stdin:
                prod.send(args.topic, _line(line), **kw)
                n += 1
    except StoreClientError as e:
        print(f"lmqtt produce: store {args.store} refused a message after {n} acknowledged: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except (ConnectionLost, OSError) as e:
        print(f"lmqtt produce: lost the store {args.store} after {n} acknowledged messages: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        print(f"lmqtt produce: interrupted after {n} acknowledged messages", file=sys.stderr)
        return 130
    finally:
        conn.close()
    el = time.perf_counter() - t0
    print(f"lmqtt produce: {n} messages to {args.topic!r} in {el:.3f} s ({n / el if el > 0 else 0:.0f} msg/s)",
          file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------- consume
def parse_time(s: str) -> int:
    """Epoch milliseconds from digits, or from ISO 8601 (naive = UTC)."""
    s = s.strip()
    if s.isdigit():
        return int(s)
    if s.endswith("Z"):
        s = s[:-1] + "+00:00"
    try:
        dt = _dt.datetime.fromisoformat(s)
    except ValueError:
        raise ValueError(f"--from wants earliest, latest, epoch ms or ISO 8601; got {s!r}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=_dt.timezone.utc)
    return int(dt.timestamp() * 1000)


def is_filter(f: str) -> bool:
    """True: the history of an MQTT filter (then its live tail); False: the ConsumeQueue of a first-level topic."""
    return "/" in f or "+" in f or "#" in f


def record_json(r) -> dict:
    m = r.mqtt
    try:
        body = {"payload": r.body.decode("utf-8")}
    except UnicodeDecodeError:
        body = {"payload_base64": base64.b64encode(r.body).decode()}
    props = {"user_properties": [list(kv) for kv in m.user_properties]}
    for name in ("content_type", "response_topic", "payload_format_indicator", "message_expiry_interval"):
        v = getattr(m, name)
        if v is not None:
            props[name] = v
    if m.correlation_data is not None:
        props["correlation_data_base64"] = base64.b64encode(m.correlation_data).decode()
    if m.client_id:
        props["client_id"] = m.client_id
    return {"topic": r.topic, **body, "properties": props, "offset": r.queue_offset, "queue_id": r.queue_id,
            "physical_offset": r.offset, "msg_id": r.msg_id, "keys": list(r.keys), "qos": m.qos,
            "retain": m.retain, "born_ts": r.born_ts, "store_ts": r.store_ts}


def consume_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lmqtt consume", description="Print messages of a topic filter, one per line.")
    _common(p)
    p.add_argument("--filter", required=True, help="MQTT topic filter (a/+/c, a/#) or a first-level topic")
    p.add_argument("--group", help="consumer group: resume from / commit to the store's offset (default none: "
                                   "nothing committed)")
    p.add_argument("--from", dest="start", default=None,
                   help="earliest | latest | epoch ms | ISO 8601 (default: the group's offset, else latest)")
    p.add_argument("--count", type=int, help="exit after N messages (default: no limit)")
    p.add_argument("--timeout", type=float,
                   help="exit after S seconds without a new message (default: none, wait until Ctrl-C)")
    p.add_argument("--queue-id", type=int, default=None,
                   help="ConsumeQueue id for a first-level topic, not a filter (default 0)")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="text: the payload per line; json: one object per line with topic, properties, "
                        "offsets (default text)")
    args = p.parse_args(argv)
    if args.count is not None and args.count < 0:
        print("lmqtt consume: --count must be >= 0", file=sys.stderr)
        return 2
    if not args.filter:
        print("lmqtt consume: --filter is empty (an MQTT filter such as sensors/# or a first-level topic)",
              file=sys.stderr)
        return 2
    if args.queue_id is not None and is_filter(args.filter):
        print(f"lmqtt consume: --queue-id applies to a first-level topic; {args.filter!r} is a filter, read "
              "across every queue of its topics (leave --queue-id out)", file=sys.stderr)
        return 2
    args.queue_id = args.queue_id or 0
    ts = None
    if args.start not in (None, "earliest", "latest"):
        try:
            ts = parse_time(args.start)
        except ValueError as e:
            print(f"lmqtt consume: {e}", file=sys.stderr)
            return 2
    conn = _connect("lmqtt consume", args.store, args.token)
    out = sys.stdout
    n = 0
    try:
        cons, position_of = _consumer(conn, args, ts)
        last_new = time.monotonic()
        while args.count is None or n < args.count:
            recs = cons.poll()
            if ts is not None:
                recs = [r for r in recs if r.store_ts >= ts]
            if not recs:
                if args.timeout is not None and time.monotonic() - last_new >= args.timeout:
                    break
                time.sleep(0.05)
                continue
            last_new = time.monotonic()
            if args.count is not None:
                recs = recs[:args.count - n]
            for r in recs:
                if args.format == "json":
                    out.write(json.dumps(record_json(r), separators=(",", ":")) + "\n")
                else:
                    out.write(r.body.decode("utf-8", "replace") + "\n")
            out.flush()
            n += len(recs)
            if args.group:
                cons.commit(position_of(recs[-1]))
    except StoreClientError as e:
        print(f"lmqtt consume: store {args.store} refused: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except (ConnectionLost, OSError) as e:
        print(f"lmqtt consume: lost the store {args.store} after {n} messages: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        conn.close()
    print(f"lmqtt consume: {n} messages", file=sys.stderr)
    return 0


class _TopicReader:
    """A ConsumeQueue reader without a group (nothing committed)."""

    def __init__(self, conn, topic: str, queue_id: int, position: int) -> None:
        self.conn, self.topic, self.queue_id, self.position = conn, topic, queue_id, position

    def poll(self):
        r = self.conn.pull(self.topic, self.queue_id, self.position, 256)
        self.position = r.next_offset
        return r.records


def _consumer(conn, args, ts):
    """(consumer, record -> offset to commit after it). An explicit --from overrides the group's
    committed offset; without --from a group resumes where it stopped (else: latest)."""
    f = args.filter
    start = "earliest" if ts is not None else (args.start or "latest")
    if is_filter(f):
        # a filter's history (every stored message matching it, held or not when written), then live
        cons = conn.filter_consumer(f, args.group, start=start, max_count=256, since=ts)
        if args.start is not None and ts is None:
            cons.seek(start)
        if args.group:      # a new group starts here, even if this run reads nothing (as Kafka's)
            cons.commit()
        return cons, lambda r: r            # commit through the record
    if args.group:
        cons = conn.consumer(f, args.group, args.queue_id, start=start, max_count=256)
    else:
        cons = _TopicReader(conn, f, args.queue_id, 0)
    if args.start is not None or not args.group:
        admin = conn.admin()
        lo, hi = admin.offsets(f, args.queue_id)
        if ts is not None:
            cons.position = admin.offset_for_time(f, ts, args.queue_id)
        else:
            cons.position = hi if start == "latest" else lo
    if args.group:
        cons.commit(cons.position)
    return cons, lambda r: r.queue_offset + 1


# ----------------------------------------------------------------------------------------- admin
def admin_main(argv: list[str] | None = None) -> int:
    """`lmqtt admin`; its output piped into a reader that leaves early (`| head`) ends it quietly."""
    try:
        return _admin(argv)
    except BrokenPipeError:
        # the reader is gone: nothing more to say, and Python's flush at exit must not say it either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _admin(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(prog="lmqtt admin",
                                description="Topics, queues, consumer groups with their lag, store stats; "
                                            "users and ACL rules managed live.")
    _common(p)
    p.add_argument("--group", action="append", default=[], help="only these groups (repeatable; default all)")
    p.add_argument("--format", choices=("table", "json"), default="table", help="output (default table)")
    p.add_argument("--gateways", action="store_true",
                   help="list the gateway ids holding wildcard filters in the store, and whether each is connected")
    p.add_argument("--release-gateway", metavar="ID",
                   help="drop the filter holds of a gateway id gone for good (refused while it is connected; "
                        "a filter only it holds for a persistent session is kept)")
    p.add_argument("--sessions", action="store_true",
                   help="list the persistent MQTT sessions: gateway, connected or since when not, expiry")
    p.add_argument("--session", metavar="CLIENT_ID",
                   help="one session: its subscriptions with their committed offsets and lag")
    p.add_argument("--limit", type=int, default=1000, help="--sessions: at most this many (default 1000)")
    p.add_argument("--tier", action="store_true",
                   help="tiered storage: what is local, uploading, in the tier, the oldest readable time")
    members.add_members_args(p)
    security.add_security_args(p)
    args = p.parse_args(argv)
    conn = _connect("lmqtt admin", args.store, args.token)
    if isinstance(conn, GroupedConnection) and (args.sessions or args.session):
        # session records are spread over the groups by client id (docs/groups.md "The gateway")
        return admin_sessions(conn, args, _admin_call, _table, list(zip(conn.names, conn.groups, strict=True)))
    if isinstance(conn, GroupedConnection) and (security.wanted(args) or args.tier or args.gateways
                                                or args.release_gateway):
        # several store groups: users, rules, gateways and the tier asked of the first group,
        # which the gateways use for them in this version (docs/groups.md "The gateway")
        for other in conn.groups[1:]:
            other.close()
        conn = conn.directory
    if security.wanted(args):
        return security.admin_security(conn, args, _admin_call, _table)
    if args.tier:
        return admin_tier(conn, args, _admin_call)
    if members.wanted(args):        # per store group: several (a ';' list) are listed one by one
        return members.admin_members(conn, args, _admin_call, _table,
                                     conn.groups if isinstance(conn, GroupedConnection) else None)
    if args.gateways or args.release_gateway:
        return _admin_gateways(conn, args)
    if args.sessions or args.session:
        return admin_sessions(conn, args, _admin_call, _table)
    if isinstance(conn, GroupedConnection):
        return _admin_groups(conn, args)
    r, code = _admin_call(conn, args.store, lambda c: _overview(c, args.group))
    if code:
        return code
    queues, groups, stats = r
    if args.format == "json":
        print(json.dumps({"store": args.store, "queues": queues, "groups": groups, "stats": stats},
                         default=str, indent=2))
        return 0
    print(render_table(queues, groups, stats))
    return 0


def _admin_call(conn, store: str, fn):
    """`fn(conn)`, the store's failures turned into admin's exit codes (the cause on stderr), the
    connection closed: (result, 0) or (None, exit code)."""
    try:
        return fn(conn), 0
    except StoreClientError as e:
        print(f"lmqtt admin: store {store} refused: {e}", file=sys.stderr)
        return None, EXIT_REFUSED
    except (ConnectionLost, OSError) as e:
        print(f"lmqtt admin: lost the store {store}: {e}", file=sys.stderr)
        return None, EXIT_UNREACHABLE
    finally:
        conn.close()


def _admin_groups(conn: GroupedConnection, args) -> int:
    """`lmqtt admin` over several store groups: each group's overview (as for one), then which
    group owns each first-level topic (docs/groups.md)."""
    def every(c: GroupedConnection):
        parts = [(name, address, _overview(g, args.group))
                 for name, address, g in zip(c.names, c.addresses, c.groups, strict=True)]
        return parts, c.owners()
    r, code = _admin_call(conn, args.store, every)
    if code:
        return code
    parts, owners = r
    if args.format == "json":
        print(json.dumps({"store": args.store,
                          "store_groups": [{"name": n, "store": a, "queues": q, "groups": g, "stats": st}
                                           for n, a, (q, g, st) in parts],
                          "topic_groups": owners}, default=str, indent=2))
        return 0
    out = []
    for name, address, (q, g, st) in parts:
        out += [f"=== STORE GROUP {name} ({address})", render_table(q, g, st), ""]
    out += ["TOPIC GROUPS (the first-level topics each group owns, kept by the first group)"]
    out += _table(["topic", "store group"], [[t, n] for t, n in sorted(owners.items())]) if owners else ["  (none)"]
    print("\n".join(out))
    return 0


def _overview(conn, only_groups: list[str]):
    a = conn.admin()
    queues = []
    for q in a.topics():
        lo, hi = a.offsets(q["topic"], q["queue_id"])
        queues.append({"topic": q["topic"], "queue_id": q["queue_id"], "min_offset": lo, "max_offset": hi})
    stats = a.stats()
    return queues, {g: a.lag(g) for g in (only_groups or stats.get("groups", []))}, stats


def _admin_gateways(conn, args) -> int:
    req = P.ReleaseGateway(args.release_gateway) if args.release_gateway else P.Holders()

    def call(c):
        try:
            return call_sync(c, req)
        except StoreClientError as e:
            if c.server_info.get(P.HELLO_KEY) == 0:        # an embedded lmqtt serve: no gateway service
                raise StoreClientError(e.code, "it is an embedded `lmqtt serve`, which keeps no gateways: "
                                               "--gateways and --release-gateway are for `lmqtt store` "
                                               "(docs/fleet.md)") from None
            raise
    r, code = _admin_call(conn, args.store, call)
    if code:
        return code
    if args.format == "json":
        print(json.dumps(r.to_wire(), indent=2))
    elif args.release_gateway:
        print(f"gateway {args.release_gateway}: released {len(r.released)} filter(s), kept {len(r.kept)} "
              f"(only it holds them for a persistent session)")
        for f in r.kept:
            print(f"  kept {f}")
    else:
        rows = [[g, v.filters, "yes" if v.connected else "no"] for g, v in r.gateways.items()]
        print("\n".join(_table(["gateway", "filters", "connected"], rows)) if rows else "(no gateway holds a filter)")
    return 0


def _table(headers: list[str], rows: list[list]) -> list[str]:
    rows = [[str(c) for c in r] for r in rows]
    w = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    fmt = lambda r: "  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return [fmt(headers), fmt(["-" * x for x in w])] + [fmt(r) for r in rows]


def render_table(queues, groups, stats) -> str:
    lines = ["QUEUES (ConsumeQueues by first-level topic)"]
    lines += _table(["topic", "queue", "min", "max", "messages"],
                    [[q["topic"], q["queue_id"], q["min_offset"], q["max_offset"], q["max_offset"] - q["min_offset"]]
                     for q in queues]) if queues else ["  (none)"]
    lines += ["", "GROUPS"]
    rows = []
    for g, qs in sorted(groups.items()):
        for q in qs:
            where = q.get("filter") if "filter" in q else f'{q["topic"]}[{q["queue_id"]}]'
            rows.append([g, "filter" if "filter" in q else "topic", where, q["committed"], q["max_offset"], q["lag"]])
    # a group asked for by name (--group) that has no committed offset anywhere: said, not left out
    unknown = [f"  {g}: no committed offset (no such group, or one that only POPs)"
               for g, qs in sorted(groups.items()) if not qs]
    lines += _table(["group", "kind", "queue", "committed", "max", "lag"], rows) if rows else []
    lines += unknown if rows or unknown else ["  (none)"]
    lines += ["", "STATS"]
    # a nested value (a store group's `ha`, the tier's ...) one row per field, and the values left
    # aligned: one long value must not push every other row to its width
    flat = []
    for k, v in sorted(stats.items()):
        if isinstance(v, dict) and v:
            flat += [[f"{k}.{kk}", vv] for kk, vv in v.items()]
        else:
            flat.append([k, v])
    flat = [[k, json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v)] for k, v in flat]
    w = max(len(k) for k, _ in flat + [["key", ""]])
    lines += [f"{'key'.ljust(w)}  value", f"{'-' * w}  -----"] + [f"{k.ljust(w)}  {v}" for k, v in flat]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(produce_main())
