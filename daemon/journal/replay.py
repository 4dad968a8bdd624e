"""Replay: fold a journal through the core, as the daemon does on start.

The same ``Registry.apply`` that the live daemon uses rebuilds the state here
(ARCHITECTURE.md, Invariants: replay is the truth), so anything the live
path would refuse is also refused on replay: an intact journal whose events
break the lifecycle is damage, and is reported as such, never silently
skipped.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from daemon.journal.format import FRAME_OVERHEAD, U32
from daemon.journal.reader import JournalContents, read_journal, span_changed
from schemas.events import FORMAT_VERSION, Record, decode_record, record_decoder
from schemas.state import Deadlines, RegistrySnapshot
from statemachine import Refusal, Registry
from statemachine.registry import DEFAULT_TOMBSTONE_LIMIT

_snapshot_decoder = msgspec.msgpack.Decoder(RegistrySnapshot)
_snapshot_encoder = msgspec.msgpack.Encoder()


_fast_decode = record_decoder().decode


class ReplayError(Exception):
    """The journal decodes but cannot be folded: damage or a bug, never skipped."""


def encode_snapshot(snapshot: RegistrySnapshot) -> bytes:
    return _snapshot_encoder.encode(snapshot)


def decode_snapshot(payload: bytes) -> RegistrySnapshot:
    return _snapshot_decoder.decode(payload)


@dataclass(slots=True)
class ReplayResult:
    registry: Registry
    records: int = 0
    last_seq: int = 0
    snapshot_seq: int = 0
    torn_bytes: int = 0
    torn_at: tuple[Path, int] | None = None
    damage: list[str] = field(default_factory=list)
    first_ts: float | None = None
    last_ts: float | None = None


def _decode(seq: int, payload: bytes, exact: bool) -> Record:
    try:
        record = decode_record(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ReplayError(f"record {seq}: undecodable payload: {exc}") from exc
    # After salvaged damage the journal's numbering is a guess; the envelope's is the truth.
    if exact and record.seq != seq:
        raise ReplayError(f"record {seq}: envelope says seq {record.seq}")
    if record.v > FORMAT_VERSION:
        raise ReplayError(
            f"record {seq}: format version {record.v} is newer than this "
            f"kvpushd understands ({FORMAT_VERSION})"
        )
    return record


def iter_records(path: Path, *, salvage: bool = False) -> tuple[JournalContents, Iterator[Record]]:
    """The raw journal contents and an iterator of decoded records after the snapshot."""
    contents = read_journal(path, salvage=salvage)
    exact = contents.seqs_exact
    return contents, (_decode(seq, payload, exact) for seq, payload in contents.records)


def replay(
    path: Path,
    *,
    deadlines: Deadlines | None = None,
    tombstone_limit: int = DEFAULT_TOMBSTONE_LIMIT,
    salvage: bool = False,
    on_record: Callable[[Record, object], None] | None = None,
) -> ReplayResult:
    """Fold the journal at ``path`` (a directory or a segment file).

    ``on_record(record, touched)`` is called after each record is applied,
    with the record the registry returned (None for engine/marker events);
    stats and postmortem tools hang off it. Raises ``JournalCorrupt`` for
    damage before the tail and :class:`ReplayError` for an event the core
    refuses, unless ``salvage`` (then both are listed in ``damage``).
    """
    # Replay allocates millions of short-lived, acyclic objects; the cyclic
    # collector would rescan the growing registry over and over for nothing.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _replay(path, deadlines, tombstone_limit, salvage, on_record)
    finally:
        if gc_was_enabled:
            gc.enable()


def _replay(
    path: Path,
    deadlines: Deadlines | None,
    tombstone_limit: int,
    salvage: bool,
    on_record: Callable[[Record, object], None] | None,
) -> ReplayResult:
    return fold_contents(
        read_journal(path, salvage=salvage),
        deadlines=deadlines,
        tombstone_limit=tombstone_limit,
        salvage=salvage,
        on_record=on_record,
    )


def fold_contents(
    contents: JournalContents,
    *,
    deadlines: Deadlines | None = None,
    tombstone_limit: int = DEFAULT_TOMBSTONE_LIMIT,
    salvage: bool = False,
    on_record: Callable[[Record, object], None] | None = None,
) -> ReplayResult:
    """Fold already-read journal contents (the daemon's start-up path)."""
    exact = contents.seqs_exact
    registry = Registry(deadlines=deadlines, tombstone_limit=tombstone_limit)
    result = ReplayResult(registry=registry)
    if contents.snapshot is not None:
        snap_seq, payload = contents.snapshot
        registry = Registry.from_snapshot(
            decode_snapshot(payload), deadlines=deadlines, tombstone_limit=tombstone_limit
        )
        result.registry = registry
        result.snapshot_seq = result.last_seq = snap_seq
    apply = registry.apply
    decode = _fast_decode
    version = FORMAT_VERSION
    unpack = U32.unpack_from
    count, first, last = 0, None, None
    # The hot loop of replay (a million records in seconds). It walks the
    # validated frames of each span itself and decodes each payload out of
    # the segment's bytes: no (seq, payload) pair and no generator step per
    # record. The checks of _decode run only when the fast path fails. The
    # first and last records applied are kept, not their fields: two loads
    # per record fewer.
    for span in contents.records.spans():
        data, offset, end, seq = span.data, span.start, span.end, span.first_seq - 1
        while offset < end:
            seq += 1
            body = offset + FRAME_OVERHEAD
            offset = body + unpack(data, offset)[0]
            try:
                record = decode(data[body:offset])
            except (msgspec.DecodeError, msgspec.ValidationError):
                record = _decode(seq, data[body:offset], exact)  # raises with the details
            if record.v > version or (exact and record.seq != seq):
                record = _decode(seq, data[body:offset], exact)
            try:
                touched = apply(record.event, record.ts)
            except Refusal as exc:
                message = f"record {record.seq} ({type(record.event).__name__}): {exc}"
                if not salvage:
                    raise ReplayError(message) from exc
                result.damage.append(message)
                continue
            count += 1
            last = record
            if first is None:
                first = record
            if on_record is not None:
                on_record(record, touched)
        if offset != end:
            raise span_changed(span)
    last_seq = result.last_seq if last is None else last.seq
    first_ts = None if first is None else first.ts
    last_ts = None if last is None else last.ts
    result.records, result.last_seq = count, last_seq
    result.first_ts, result.last_ts = first_ts, last_ts
    result.torn_bytes = contents.torn_bytes
    result.torn_at = contents.torn_at
    result.damage[:0] = [str(d) for d in contents.damage]
    return result
