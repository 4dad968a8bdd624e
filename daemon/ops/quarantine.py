"""``kvpushd quarantine list|clear``: the pairings a running daemon quarantined.

A decode engine that finds a load's KV is not its own (it recomputed the
prompt's last token and its K/V differed: ``kv_mismatch``) makes the
prefill daemon quarantine the pairing of the two engines' fingerprints
(statemachine/quarantine.py): later pushes between them are refused
``quarantined`` until the prefill engine registers with another fingerprint
or an operator clears it here. One round trip over the engine socket, as
``kvpushd status``; a clear is journaled, so a restarted daemon keeps it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgspec

from daemon.config import ConfigError
from daemon.ops.status import (
    EXIT_CONFIG,
    EXIT_NOT_RUNNING,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    NotRunning,
    StatusUnavailable,
    ask,
    socket_path,
)
from daemon.ops.texttable import table
from schemas import rpc
from schemas.fingerprint import Fingerprint
from schemas.state import Quarantined


def _model(fingerprint: Fingerprint | None) -> str:
    if fingerprint is None:
        return "(none declared)"
    return fingerprint.model + (f"@{fingerprint.revision}" if fingerprint.revision else "")


def render(entries: tuple[Quarantined, ...]) -> str:
    if not entries:
        return "no quarantined pairings"
    rows = [
        (
            q.id,
            _model(q.prefill_fingerprint),
            f"{q.peer}/{q.peer_engine or '?'}",
            q.request_id,
            f"L{q.layer} @{q.position}",
            f"{q.difference:.4g} > {q.tolerance:.4g}",
            str(q.mismatches),
        )
        for q in entries
    ]
    return table(
        ["id", "prefill model", "decode node/engine", "first request", "where", "diff", "count"],
        rows,
    )


def _print(reply: rpc.QuarantineReply, as_json: bool) -> None:
    if as_json:
        doc: dict[str, Any] = {
            "quarantined": msgspec.to_builtins(reply.entries),
            "cleared": list(reply.cleared),
        }
        print(json.dumps(doc, indent=2))
        return
    if reply.cleared:
        print(f"cleared: {', '.join(reply.cleared)}")
    print(render(reply.entries))


def run(args: argparse.Namespace) -> int:
    try:
        path = socket_path(args)
    except ConfigError as exc:
        print(f"kvpushd quarantine: invalid configuration: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.quarantine_command == "clear":
        if not args.ids and not args.all:
            print("kvpushd quarantine clear: name the ids to clear, or --all", file=sys.stderr)
            return EXIT_CONFIG
        request: rpc.Request = rpc.QuarantineClear(1, tuple(args.ids), args.all)
    else:
        request = rpc.QuarantineList(1)
    try:
        reply = ask(path, request, args.timeout)
    except NotRunning as exc:
        print(f"kvpushd quarantine: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    except StatusUnavailable as exc:
        print(f"kvpushd quarantine: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    if not isinstance(reply, rpc.QuarantineReply):
        print(f"kvpushd quarantine: unexpected reply {type(reply).__name__}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    _print(reply, args.json)
    return EXIT_OK
