"""The status document (schemas/status.py) of a running node."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import msgspec

from daemon.dataplane.plane import DataPlane
from daemon.journal.writer import Journal
from daemon.node.peerlink import LinkInfo
from schemas.state import RequestRecord
from schemas.status import (
    DataPlaneCounters,
    EngineLine,
    JournalLine,
    OffloadLine,
    OldestRequest,
    PeerLine,
    RequestLine,
    StatusDocument,
)
from statemachine import Registry

if TYPE_CHECKING:
    from daemon.node.engine_state import EngineState

# Requests listed one by one, oldest first; the counts cover all of them.
MAX_LISTED = 200


def status_document(
    *,
    node: str,
    version: str,
    boot_id: str,
    now: float,
    started_at: float,
    registry: Registry,
    engines: Mapping[str, EngineState],
    links: Iterable[LinkInfo],
    journal_dir: str,
    journal: Journal,
    counters: dict[str, int],
    peer_engines: dict[str, list[str]],
    dataplane: DataPlane,
    writes_in_flight: int,
    metrics_port: int | None,
    offload: OffloadLine | None = None,
) -> StatusDocument:
    live = list(registry.live.values())
    by_state: dict[str, int] = {}
    for record in live:
        by_state[record.state.value] = by_state.get(record.state.value, 0) + 1
    listed = sorted(live, key=lambda r: r.entered_at)
    oldest = _oldest(listed[0], now) if listed else None
    return StatusDocument(
        node=node,
        version=version,
        boot_id=boot_id,
        pid=os.getpid(),
        uptime_s=round(now - started_at, 3),
        live=len(live),
        by_state=by_state,
        pending_peer_registrations=len(registry.pending),
        oldest=oldest,
        requests=[_line(r, now) for r in listed[:MAX_LISTED]],
        engines={
            engine_id: EngineLine(
                connected=e.session is not None,
                groups=len(e.spec.groups),
                live=e.live,
                offload_free=None if e.offload is None else e.offload.free_count,
                fingerprint=e.spec.fingerprint,
                memory=",".join(sorted({r.shared_as.value for r in e.spec.regions})),
                kv=e.note.placement.value,
                memory_why=e.note.why,
            )
            for engine_id, e in engines.items()
        },
        peers=[PeerLine(**msgspec.structs.asdict(info)) for info in links],
        journal=JournalLine(
            dir=journal_dir,
            next_seq=journal.next_seq,
            durable_seq=journal.durable_seq,
            lag=journal.next_seq - 1 - journal.durable_seq,
        ),
        counters=counters,
        peer_engines=peer_engines,
        dataplane=DataPlaneCounters(
            writes=dataplane.writes,
            write_errors=dataplane.write_errors,
            writes_cancelled=dataplane.writes_cancelled,
            bytes_written=dataplane.bytes_written,
        ),
        writes_in_flight=writes_in_flight,
        metrics_port=metrics_port,
        offload=offload,
    )


def _oldest(record: RequestRecord, now: float) -> OldestRequest:
    return OldestRequest(
        request_id=record.request_id,
        state=record.state.value,
        age_s=round(now - record.entered_at, 3),
    )


def _line(r: RequestRecord, now: float) -> RequestLine:
    return RequestLine(
        request_id=r.request_id,
        incarnation=r.incarnation,
        role=r.role.value,
        state=r.state.value,
        engine=r.engine_id,
        peer=r.peer,
        age_s=round(now - r.entered_at, 3),
    )
