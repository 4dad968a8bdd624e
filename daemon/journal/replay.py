"""Replay: fold a journal through the core, as the daemon does on start.

The same ``Registry.apply`` that the live daemon uses rebuilds the state here
(ARCHITECTURE.md, Invariants: replay is the truth), so anything the live
path would refuse is also refused on replay: an intact journal whose events
break the lifecycle is damage, and is reported as such, never silently
skipped.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import msgspec

from daemon.journal.reader import (
    JournalContents,
    Shape,
    Snapshot,
    Unit,
    clean_shape,
    read_journal,
    read_unchecked,
)
from schemas.events import FORMAT_VERSION, Record, decode_record, record_decoder
from schemas.state import Deadlines, RegistrySnapshot
from statemachine import Refusal, Registry
from statemachine.registry import DEFAULT_TOMBSTONE_LIMIT

_snapshot_decoder = msgspec.msgpack.Decoder(RegistrySnapshot)
_snapshot_encoder = msgspec.msgpack.Encoder()


_fast_decode = record_decoder().decode
# A format-2 group's records are one msgpack array: decoded in one call.
_decode_group = msgspec.msgpack.Decoder(list[Record]).decode

# Below this many bytes of segments, forking a validator costs more than the
# CRC pass it takes off the fold (a fork and a pipe: a few milliseconds).
PARALLEL_MIN_BYTES = 8 * 1024 * 1024


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


def _units(records: Iterable[tuple[int, bytes]]) -> Iterator[Unit]:
    """The records as units: a reader's own (format-2 groups whole), else one by one."""
    units = getattr(records, "units", None)
    if units is not None:
        return cast("Iterator[Unit]", units())
    return ((seq, payload, None) for seq, payload in records)


def _split(
    seq: int, payload: bytes | memoryview, sizes: tuple[int, ...]
) -> list[tuple[int, bytes]]:
    """A group unit's records one by one (the slow path: explaining a bad one)."""
    found = []
    position = 5  # the msgpack array header
    for index, size in enumerate(sizes):
        found.append((seq + index, bytes(payload[position : position + size])))
        position += size
    return found


def _one(payload: bytes | memoryview, sizes: tuple[int, ...] | None, index: int) -> bytes:
    """The payload of a unit's ``index``-th record."""
    if sizes is None:
        return bytes(payload)
    return _split(0, payload, sizes)[index][1]


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
    parallel: bool | None = None,
) -> ReplayResult:
    """Fold the journal at ``path`` (a directory or a segment file).

    ``on_record(record, touched)`` is called after each record is applied,
    with the record the registry returned (None for engine/marker events);
    stats and postmortem tools hang off it. Raises ``JournalCorrupt`` for
    damage before the tail and :class:`ReplayError` for an event the core
    refuses, unless ``salvage`` (then both are listed in ``damage``).

    ``parallel``: validate the CRCs in a forked process while this one folds
    the frames unchecked (:func:`replay_optimistic`), and fall back to the
    strict read and fold if the two disagree or anything went wrong; the
    result is the same either way. None: when there are two CPUs for it, the
    segments hold at least ``PARALLEL_MIN_BYTES`` and no ``on_record`` would
    be called twice by a fall-back.
    """
    # Replay allocates millions of short-lived, acyclic objects; the cyclic
    # collector would rescan the growing registry over and over for nothing.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if parallel is None:
            parallel = on_record is None and _parallel_pays(Path(path))
        if parallel:
            result = replay_optimistic(path, deadlines, tombstone_limit, salvage, on_record)
            if result is not None:
                return result
        return _replay(path, deadlines, tombstone_limit, salvage, on_record)
    finally:
        if gc_was_enabled:
            gc.enable()


def _parallel_pays(path: Path) -> bool:
    if not hasattr(os, "fork") or len(os.sched_getaffinity(0)) < 2:
        return False
    try:
        files = [path] if path.is_file() else list(path.glob("seg-*.kvj"))
        return sum(f.stat().st_size for f in files) >= PARALLEL_MIN_BYTES
    except OSError:
        return False


def replay_optimistic(
    path: Path,
    deadlines: Deadlines | None = None,
    tombstone_limit: int = DEFAULT_TOMBSTONE_LIMIT,
    salvage: bool = False,
    on_record: Callable[[Record, object], None] | None = None,
) -> ReplayResult | None:
    """Fold the frames unchecked while a forked child validates; None: use the strict path.

    The fold's result stands only if the child found the journal clean
    (:func:`clean_shape`: no torn tail, no damage, each segment intact from
    header to end) and both processes saw the same files, byte for byte
    (sizes and whole-file CRCs in the shape). Then the strict read would
    have yielded exactly the frames folded here, in the same order and
    numbering, and the strict fold the same result. Anything else (damage,
    a refusal, an undecodable frame, a file that changed, a child that
    failed) returns None without raising: the strict path reads again and
    reports it as it always has. ``on_record`` has then been called for
    some records already, so callers that pass one must be able to start
    over (replay() passes none unless asked).
    """
    try:
        read_end, write_end = os.pipe()
    except OSError:
        return None  # out of descriptors: the strict path needs none of these
    try:
        pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        return None  # no process to spare: the strict path needs none
    if pid == 0:  # the child: validate, report the shape, exit without cleanup
        status = 0
        try:
            os.close(read_end)
            shape = pickle.dumps(clean_shape(path))
            with os.fdopen(write_end, "wb") as out:
                out.write(shape)
        except BaseException:
            status = 1
        finally:
            os._exit(status)
    os.close(write_end)
    result: ReplayResult | None = None
    seen: Shape | None = None
    try:
        with os.fdopen(read_end, "rb") as report:
            try:
                snapshot, unchecked = read_unchecked(path)
                result = _fold(
                    unchecked,
                    snapshot,
                    True,
                    deadlines,
                    tombstone_limit,
                    salvage,
                    on_record,
                )
                seen = unchecked.shape()
            except Exception:
                # Damage, a refusal, a changed file: whatever it was, the
                # strict path meets it again and reports it as it always has.
                result = None
            raw = report.read()
    except BaseException:
        os.kill(pid, signal.SIGKILL)  # interrupted: the child's answer is moot
        raise
    finally:
        _, status = os.waitpid(pid, 0)
    if result is None or status != 0 or not raw:
        return None
    try:
        validated = pickle.loads(raw)  # our own child's report, never outside input
    except Exception:
        return None  # a garbled report is a disagreement
    return result if validated is not None and validated == seen else None


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


# Records handed to an ``on_batch`` callback at a time (the last batch may be shorter).
BATCH_RECORDS = 256

OnBatch = Callable[[list[Record], list[object]], None]


def fold_contents(
    contents: JournalContents,
    *,
    deadlines: Deadlines | None = None,
    tombstone_limit: int = DEFAULT_TOMBSTONE_LIMIT,
    salvage: bool = False,
    on_record: Callable[[Record, object], None] | None = None,
    on_batch: OnBatch | None = None,
) -> ReplayResult:
    """Fold already-read journal contents (the daemon's start-up path).

    ``on_batch(records, touched)``: called with the records applied, in
    order, about :data:`BATCH_RECORDS` at a time, and what the registry
    returned for each; for callers that keep columns (the postmortem), a
    call per batch instead of ``on_record``'s call per record.
    """
    result = _fold(
        contents.records,
        contents.snapshot,
        contents.seqs_exact,
        deadlines,
        tombstone_limit,
        salvage,
        on_record,
        on_batch,
    )
    result.torn_bytes = contents.torn_bytes
    result.torn_at = contents.torn_at
    result.damage[:0] = [str(d) for d in contents.damage]
    return result


def _fold(
    records: Iterable[tuple[int, bytes]],
    snapshot: Snapshot | None,
    exact: bool,
    deadlines: Deadlines | None,
    tombstone_limit: int,
    salvage: bool,
    on_record: Callable[[Record, object], None] | None,
    on_batch: OnBatch | None = None,
) -> ReplayResult:
    """The one fold of replay: ``(seq, payload)`` records, after ``snapshot``."""
    registry = Registry(deadlines=deadlines, tombstone_limit=tombstone_limit)
    result = ReplayResult(registry=registry)
    if snapshot is not None:
        snap_seq, snap_payload = snapshot
        registry = Registry.from_snapshot(
            decode_snapshot(snap_payload), deadlines=deadlines, tombstone_limit=tombstone_limit
        )
        result.registry = registry
        result.snapshot_seq = result.last_seq = snap_seq
    apply = registry.apply
    decode = _fast_decode
    decode_group = _decode_group
    version = FORMAT_VERSION
    count, first, last = 0, None, None
    applied: list[Record] = []
    touches: list[object] = []
    keep = applied.append if on_batch is not None else None
    keep_touched = touches.append
    # The hot loop of replay (a million records in seconds): decoding is
    # inlined, and the checks of _decode run only when the fast path fails.
    # The first and last records applied are kept, not their fields: two
    # loads per record fewer. A format-2 group decodes in one call; its
    # records then take the same path as format 1's, one by one.
    for seq, payload, sizes in _units(records):
        if sizes is None:
            # A format-1 record (or one of a group cut by a snapshot): the
            # loop of format 1, written out again, as a batch of one would
            # cost it a tenth of its speed.
            try:
                record = decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                record = _decode(seq, bytes(payload), exact)  # raises with the details
            if record.v > version or (exact and record.seq != seq):
                record = _decode(seq, bytes(payload), exact)
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
            if keep is not None:
                keep(record)
                keep_touched(touched)
                if len(applied) >= BATCH_RECORDS:
                    on_batch(applied, touches)  # type: ignore[misc]
                    applied.clear()
                    touches.clear()
            continue
        try:
            batch = decode_group(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            batch = [_decode(s, p, exact) for s, p in _split(seq, payload, sizes)]
        if len(batch) != len(sizes):
            raise ReplayError(f"records from {seq}: a group of {len(sizes)} holds {len(batch)}")
        start = seq
        for record in batch:
            if record.v > version or (exact and record.seq != seq):
                _decode(seq, _one(payload, sizes, seq - start), exact)  # raises
            seq += 1
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
            if keep is not None:
                keep(record)
                keep_touched(touched)
        if keep is not None and len(applied) >= BATCH_RECORDS:
            on_batch(applied, touches)  # type: ignore[misc]
            applied.clear()
            touches.clear()
    if on_batch is not None and applied:
        on_batch(applied, touches)
    last_seq = result.last_seq if last is None else last.seq
    first_ts = None if first is None else first.ts
    last_ts = None if last is None else last.ts
    result.records, result.last_seq = count, last_seq
    result.first_ts, result.last_ts = first_ts, last_ts
    return result
