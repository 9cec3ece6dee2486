"""A store group's member list: `--peers HOST:PORT,...` and the rules of the group settings.

Each member uses three consecutive ports: PORT (clients, the native protocol), PORT+1 (Raft,
pysyncobj) and PORT+2 (CommitLog replication). Node ids are positions in the list (1-based).
"""
from __future__ import annotations


def parse_peers(text: str) -> list[tuple[str, int]]:
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        host, sep, port_s = part[1:].partition("]:") if part.startswith("[") else part.rpartition(":")
        try:
            port = int(port_s) if sep else 0
        except ValueError:
            port = 0
        if not host or not 0 < port < 65533:
            raise ValueError(f"--peers entry {part!r} needs HOST:PORT with PORT 1..65532 (PORT+1 and PORT+2 are "
                             "the member's Raft and replication ports)")
        out.append((host, port))
    if not out:
        raise ValueError("--peers is empty: list every member's HOST:PORT, this one included")
    if len(set(out)) != len(out):
        raise ValueError(f"--peers lists a member twice: {text}")
    return out


def group_problem(cfg) -> str | None:
    """NodeConfig.validate's rules for a group member (None: fine, or not a group member)."""
    group_keys = [k for k in ("node_id", "peers", "ack_replicas", "join") if getattr(cfg, k, None)]
    if not cfg.group:
        return f"{group_keys[0]} is set but group is not (a store group: --group NAME)" if group_keys else None
    join = getattr(cfg, "join", None)
    if join and (cfg.peers or cfg.node_id):
        return ("--join adds this store to a running group (node id and members come from it): leave --peers "
                "and --node-id out")
    if not cfg.peers and not join:
        return ("a group member needs --peers HOST:PORT,... (every member, the same list on each), or --join "
                "HOST:PORT of a running group's member")
    try:        # the election runs on pysyncobj, the `[ha]` extra: named before anything is created
        import pysyncobj  # noqa: F401
    except ImportError as e:
        return f"a store group needs pysyncobj ({e}): pip install 'lmqtt[ha]'"
    if join:
        try:
            parse_peers(join)
        except ValueError as e:
            return str(e).replace("--peers", "--join")
        if cfg.host in ("0.0.0.0", "::"):
            return (f"--join needs --host to be this store's address as the other members reach it, not "
                    f"{cfg.host}")
        return None
    try:
        peers = parse_peers(cfg.peers)
    except ValueError as e:
        return str(e)
    if not 1 <= int(cfg.node_id) <= len(peers):
        return f"node_id must be this member's position in --peers, 1..{len(peers)}, got {cfg.node_id}"
    if cfg.ack_replicas is not None and not 0 <= int(cfg.ack_replicas) < len(peers):
        return f"ack_replicas must be 0..{len(peers) - 1} for a group of {len(peers)}, got {cfg.ack_replicas}"
    host, port = peers[int(cfg.node_id) - 1]
    if int(cfg.port) not in (port, 10911) or cfg.host not in (host, "127.0.0.1", "0.0.0.0", "::"):
        return (f"--host/--port {cfg.host}:{cfg.port} differ from this member's entry {host}:{port} in --peers "
                f"(node {cfg.node_id}); give the same address or leave --host/--port out")
    return None
