"""The status document: what `kvpushd status` and the engines' status call show."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import msgspec

from schemas.state import RequestRecord

if TYPE_CHECKING:
    from daemon.node.runtime import Node

# Requests listed one by one, oldest first; the counts cover all of them.
MAX_LISTED = 200


def status_document(node: Node) -> dict[str, Any]:
    from daemon.node.runtime import VERSION

    now = node.clock()
    live = node.registry.live.values()
    by_state: dict[str, int] = {}
    oldest: RequestRecord | None = None
    for record in live:
        by_state[record.state.value] = by_state.get(record.state.value, 0) + 1
        if oldest is None or record.entered_at < oldest.entered_at:
            oldest = record
    journal = node.journal
    links = node.links
    return {
        "node": node.config.node,
        "version": VERSION,
        "boot_id": node.boot_id,
        "pid": os.getpid(),
        "uptime_s": round(now - node.started_at, 3),
        "live": len(node.registry.live),
        "by_state": by_state,
        "pending_peer_registrations": len(node.registry.pending),
        "oldest": None
        if oldest is None
        else {
            "request_id": oldest.request_id,
            "state": oldest.state.value,
            "age_s": round(now - oldest.entered_at, 3),
        },
        "requests": [
            {
                "request_id": r.request_id,
                "incarnation": r.incarnation,
                "role": r.role.value,
                "state": r.state.value,
                "engine": r.engine_id,
                "peer": r.peer,
                "age_s": round(now - r.entered_at, 3),
            }
            for r in sorted(live, key=lambda r: r.entered_at)[:MAX_LISTED]
        ],
        "engines": {
            engine_id: {
                "connected": e.session is not None,
                "groups": len(e.spec.groups),
                "live": e.live,
                "offload_free": None if e.offload is None else e.offload.free_count,
            }
            for engine_id, e in node.engines.by_id.items()
        },
        "peers": [msgspec.structs.asdict(info) for info in links.links]
        if links is not None
        else [],
        "journal": {
            "dir": str(node.config.journal.dir),
            "next_seq": journal.next_seq if journal else 0,
            "durable_seq": journal.durable_seq if journal else 0,
            "lag": (journal.next_seq - 1 - journal.durable_seq) if journal else 0,
        },
        "counters": dict(node.counters),
        "peer_engines": {peer: sorted(p.engines) for peer, p in node.peers.states.items()},
        "dataplane": {
            "writes": node.dataplane.writes,
            "write_errors": node.dataplane.write_errors,
            "writes_cancelled": node.dataplane.writes_cancelled,
            "bytes_written": node.dataplane.bytes_written,
        },
        "writes_in_flight": len(node.writes),
        **node.status_extras,
    }
