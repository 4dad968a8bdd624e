"""``kvpushd status``: ask a running daemon for its status and show it.

One ``rpc.Status`` round trip over the engine socket, with a plain blocking
socket: the command is short-lived and needs no event loop. The daemon's
status document (``Node.status()``) is printed as tables, or as JSON with
``--json`` for scripts.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from typing import Any

import msgspec

from daemon.config import ConfigError, load_config
from daemon.framing import PREFIX_BYTES, FrameEncoder
from daemon.ops.texttable import table
from schemas import rpc

# Scripts branch on these; `kvpushd status --help` documents them (daemon/cli.py).
EXIT_OK = 0
EXIT_CONFIG = 2  # --config is unusable (argparse also exits 2 on bad arguments)
EXIT_NOT_RUNNING = 3  # no socket, or nobody accepts on it
EXIT_UNAVAILABLE = 4  # a daemon is there but gave no usable status

DEFAULT_TIMEOUT_S = 5.0
MAX_REPLY_BYTES = 64 * 1024 * 1024  # a status document is far smaller; this only bounds damage


class NotRunning(Exception):
    """Nothing answers on the socket: no daemon is running there."""


class StatusUnavailable(Exception):
    """Something answers on the socket, but not with a status."""


# ------------------------------------------------------------------ fetching


def socket_path(args: argparse.Namespace) -> str:
    """The engine socket: --socket, else the one --config (or the defaults) names.

    Raises ``daemon.config.ConfigError`` for an unusable config.
    """
    if args.socket:
        return str(args.socket)
    return load_config(args.config).socket


def fetch_status(path: str, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """One Status round trip; raises NotRunning or StatusUnavailable."""
    reply = ask(path, rpc.Status(id=1), timeout)
    if not isinstance(reply, rpc.StatusReply):
        raise StatusUnavailable(f"{path}: unexpected reply {type(reply).__name__}")
    document: dict[str, Any] = msgspec.to_builtins(reply.status)
    return document


def ask(path: str, request: rpc.Request, timeout: float = DEFAULT_TIMEOUT_S) -> rpc.Reply:
    """One operator request's round trip (``kvpushd status``, ``kvpushd quarantine``).

    Raises NotRunning, or StatusUnavailable (with the daemon's code and
    message for an ``Error`` reply).
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise NotRunning(f"no kvpushd is running at {path} ({exc.strerror})") from exc
        except OSError as exc:
            raise StatusUnavailable(f"cannot connect to {path}: {exc.strerror or exc}") from exc
        try:
            sock.sendall(FrameEncoder().encode(request))
            length = int.from_bytes(_recv_exact(sock, PREFIX_BYTES), "big")
            if not 0 < length <= MAX_REPLY_BYTES:
                raise StatusUnavailable(f"{path}: implausible reply length {length}")
            body = _recv_exact(sock, length)
        except TimeoutError as exc:
            raise StatusUnavailable(f"{path}: no reply within {timeout} s") from exc
        except OSError as exc:
            raise StatusUnavailable(f"{path}: {exc.strerror or exc}") from exc
    return _decode_reply(path, body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            # The daemon hangs up on connections it does not allow.
            raise StatusUnavailable("the daemon closed the connection")
        data += chunk
    return bytes(data)


def _decode_reply(path: str, body: bytes) -> rpc.Reply:
    try:
        reply = msgspec.msgpack.decode(body, type=rpc.ServerMessage)
    except msgspec.DecodeError as exc:
        raise StatusUnavailable(f"{path}: undecodable reply: {exc}") from exc
    if isinstance(reply, rpc.Error):
        raise StatusUnavailable(f"{path}: {reply.code}: {reply.message}")
    if not isinstance(reply, rpc.Reply):
        raise StatusUnavailable(f"{path}: unexpected message {type(reply).__name__}")
    return reply


# ----------------------------------------------------------------- rendering


def age(seconds: float | None) -> str:
    """A duration the way an operator reads it: 850ms, 12.3s, 4m05s, 2h03m, 3d04h."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1e3:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60)):
        if whole >= size:
            return f"{whole // size}{unit}{whole % size // sub_size:02d}{sub}"
    return f"{whole // 60}m{whole % 60:02d}s"


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _summary(st: dict[str, Any]) -> list[str]:
    journal = st["journal"]
    lines = [
        f"node     {st['node']}  pid {st['pid']}  version {st['version']}  "
        f"boot {st['boot_id']}  up {age(st['uptime_s'])}",
        f"journal  next seq {journal['next_seq']}, durable seq {journal['durable_seq']}, "
        f"lag {journal['lag']}  ({journal['dir']})",
        f"live     {_n(st['live'], 'request')}, "
        f"{_n(st['pending_peer_registrations'], 'pending peer registration')}, "
        f"{_n(st['writes_in_flight'], 'write')} in flight",
    ]
    oldest = st.get("oldest")
    if oldest:
        lines.append(
            f"oldest   {oldest['request_id']} {oldest['state']} for {age(oldest['age_s'])}"
        )
    counters = st.get("counters", {})
    if counters:
        lines.append("counters " + ", ".join(f"{k} {v}" for k, v in counters.items()))
    if st.get("metrics_port"):
        lines.append(f"metrics  http://127.0.0.1:{st['metrics_port']}/metrics")
    return lines


def _states(st: dict[str, Any]) -> str:
    # The request list is oldest first, so the first sighting of a state is
    # its oldest request (unless all of a state's requests lie past the cap).
    oldest: dict[str, float] = {}
    for request in st["requests"]:
        oldest.setdefault(request["state"], request["age_s"])
    rows = [(s, n, age(oldest.get(s))) for s, n in sorted(st["by_state"].items())]
    return table(["state", "requests", "oldest in state"], rows)


def _requests(st: dict[str, Any], limit: int) -> str:
    shown = st["requests"][:limit]
    rows = [
        (
            r["request_id"],
            r["incarnation"],
            r["role"],
            r["state"],
            age(r["age_s"]),
            r["engine"],
            r["peer"] or "-",
        )
        for r in shown
    ]
    title = f"oldest requests ({len(shown)} of {st['live']})"
    return (
        title
        + "\n"
        + table(["request", "inc", "role", "state", "in state", "engine", "peer"], rows)
    )


def _engines(st: dict[str, Any]) -> str:
    rows = [
        (
            engine_id,
            "yes" if e["connected"] else "no",
            e["live"],
            e["groups"],
            "-" if e["offload_free"] is None else e["offload_free"],
            e.get("memory") or "-",
            e.get("kv") or "-",
        )
        for engine_id, e in sorted(st["engines"].items())
    ]
    header = ["engine", "connected", "live", "groups", "offload free", "memory", "kv"]
    lines = [table(header, rows)]
    for engine_id, e in sorted(st["engines"].items()):
        if e.get("memory_why"):
            lines.append(f"  {engine_id} memory: {e['memory_why']}")
        fingerprint = e.get("fingerprint")
        described = (
            " ".join(f"{k}={v}" for k, v in fingerprint.items()) if fingerprint else "none declared"
        )
        lines.append(f"  {engine_id} fingerprint: {described}")
    return "\n".join(lines)


def _peers(st: dict[str, Any]) -> str:
    rows = [
        (
            p["node"],
            (p["address"] or "-") + (" (on demand)" if p.get("on_demand") else ""),
            "up" if p["up"] else "DOWN",
            p.get("direction") or "-",
            age(p.get("last_heard_age_s")),
            p.get("boot_id") or "-",
        )
        for p in st["peers"]
    ]
    return table(["peer", "address", "link", "direction", "last heard", "boot id"], rows)


def _offload(tier: dict[str, Any]) -> str:
    """The offload tier: its pool, slots by state, and what it served."""
    looked = tier["hits"] + tier["misses"]
    rate = f"{100 * tier['hits'] / looked:.1f} %" if looked else "-"
    where = tier["path"] or "memfd"
    kept = "survived the last restart" if tier["survived"] else "new at this start"
    states = ", ".join(f"{state} {n}" for state, n in tier["by_state"].items())
    return "\n".join(
        [
            f"offload  {tier['slots']} slots of {tier['slot_bytes']} bytes in {where} "
            f"(pool {tier['pool_id'][:12]}, {kept}), reserve {tier['reserve']}, "
            f"{_n(tier['holders'], 'holder')}",
            f"         slots: {states}",
            f"         lookups {looked}, hit rate {rate}; stored {tier['committed']}, "
            f"duplicates {tier['duplicates']}; resets {tier['resets']}, "
            f"not zero at grant {tier['not_zero']}, condemned {tier.get('condemned', 0)}",
        ]
    )


def render(st: dict[str, Any], *, limit: int = 10) -> str:
    """The status document as an operator reads it."""
    sections = ["\n".join(_summary(st))]
    if st.get("offload"):
        sections.append(_offload(st["offload"]))
    if st["live"]:
        sections += [_states(st), _requests(st, limit)]
    sections.append(_engines(st) if st["engines"] else "engines: none registered")
    sections.append(_peers(st) if st["peers"] else "peers: none configured or linked")
    return "\n\n".join(sections)


# ---------------------------------------------------------------- command


def run(args: argparse.Namespace) -> int:
    try:
        path = socket_path(args)
    except ConfigError as exc:
        print(f"kvpushd status: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        st = fetch_status(path, args.timeout)
    except NotRunning as exc:
        print(f"kvpushd status: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    except StatusUnavailable as exc:
        print(f"kvpushd status: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    print(json.dumps(st, indent=2) if args.json else render(st, limit=args.limit))
    return EXIT_OK
