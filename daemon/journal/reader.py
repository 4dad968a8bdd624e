"""Reading a journal: validation, torn tails and salvage, without writing a byte.

:func:`read_journal` applies the reading and recovery rules of format.py to a
journal directory (or a single segment file) and returns a
:class:`JournalContents`: the newest snapshot, the intact records after it,
the torn tail, and what salvage skipped. Records are validated up front and
sliced out of the files lazily (:class:`Records`), so memory stays at one
segment whatever the journal's length.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import NamedTuple

from crc32c import crc32c

from daemon.journal.format import (
    FORMAT_V1,
    FORMAT_V2,
    FRAME_OVERHEAD,
    FRAMINGS,
    GROUP_FRAMES,
    GROUP_OVERHEAD,
    HEADER_SIZE,
    MARK_COUNT,
    RECORD_FRAMES,
    SEGMENT_MAGIC,
    SEGMENT_RE,
    SNAPSHOT_MAGIC,
    SNAPSHOT_RE,
    U32,
    Invalid,
    JournalCorrupt,
    JournalError,
    NoJournal,
    check_frames,
    frame_problem,
    group_sizes,
    list_files,
    parse_header,
)

__all__ = [
    "Damage",
    "JournalContents",
    "Records",
    "Shape",
    "Snapshot",
    "UncheckedRecords",
    "Unit",
    "clean_shape",
    "first_payload",
    "read_journal",
    "read_unchecked",
    "require_journal",
]


class Snapshot(NamedTuple):
    seq: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class Damage:
    """A span that salvage skipped (or a sequence gap it tolerated)."""

    path: Path
    offset: int
    length: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path.name} @ {self.offset}: {self.reason} ({self.length} bytes skipped)"


@dataclass(frozen=True, slots=True)
class _Run:
    """Intact frames back to back: [start, end) of a segment file."""

    start: int
    end: int
    count: int
    first_seq: int


@dataclass(frozen=True, slots=True)
class _SegmentPlan:
    path: Path
    runs: tuple[_Run, ...]
    version: int = FORMAT_V1


# What replay folds: ``(seq, payload, sizes)``. ``sizes`` None: ``payload`` is
# the record ``seq``. Otherwise ``payload`` is a format-2 group's records from
# ``seq`` on, as one msgpack array header and the payloads (sizes given), so
# a caller can decode them in one call.
Unit = tuple[int, bytes | memoryview, tuple[int, ...] | None]


class Records:
    """The intact records of a read, as ``(seq, payload)`` pairs in order.

    Re-iterable and sized. Reading validated every frame up front; iterating
    re-reads each segment file and slices the payloads, so memory stays at
    one segment whatever the journal's length. Files are append-only, so
    iterating after further appends yields the same records; a segment that
    shrank or vanished since (pruned, say) raises :class:`JournalError`.
    """

    __slots__ = ("_after", "_count", "_plan")

    def __init__(self, plan: tuple[_SegmentPlan, ...], after: int) -> None:
        self._plan = plan
        self._after = after
        self._count = sum(
            max(0, run.first_seq + run.count - max(run.first_seq, after + 1))
            for seg in plan
            for run in seg.runs
        )

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        return _records(self.units())

    def units(self) -> Iterator[Unit]:
        """The same records as :data:`Unit` s: a format-2 group in one piece."""
        return chain.from_iterable(_segment_units(seg, self._after) for seg in self._plan)

    def __repr__(self) -> str:
        return f"Records({self._count} records in {len(self._plan)} segments)"


@dataclass(frozen=True, slots=True)
class JournalContents:
    """What :func:`read_journal` found.

    ``snapshot``: the newest snapshot, or None. ``records``: the intact
    records with seq > ``snapshot.seq``, in order. ``torn_bytes`` and
    ``torn_at`` (segment, offset): the torn tail of the last segment, if any.
    ``damage``: what salvage skipped (always empty without salvage, which
    raises instead). ``segments``: the segment files read; those a snapshot
    covers entirely are not. ``last_seq``: the highest seq the journal
    accounts for, snapshot included: a writer continues at ``last_seq + 1``.
    ``seqs_exact``: False when salvage had to guess how many records a
    damaged span held.
    """

    snapshot: Snapshot | None
    records: Records
    torn_bytes: int
    torn_at: tuple[Path, int] | None
    damage: tuple[Damage, ...]
    segments: tuple[Path, ...]
    last_seq: int
    seqs_exact: bool = True


def _segment_units(seg: _SegmentPlan, after: int) -> Iterator[Unit]:
    data = _read_bytes(seg.path)
    for run in seg.runs:
        if len(data) < run.end:
            raise JournalError(f"{seg.path} shrank since it was read")
        yield from _units(seg.path, data, seg.version, run.start, run.end, run.first_seq, after)


def _units(
    path: Path, data: bytes, version: int, start: int, end: int, first_seq: int, after: int
) -> Iterator[Unit]:
    """The reader's one walk: the records of the frames in ``data[start:end]``, seq > ``after``.

    Both formats, as :data:`Unit` s: a format-1 frame is one record; a
    format-2 group is one unit, but for a group that a snapshot cuts, whose
    records after it come one by one. The frames were validated (or are
    walked unchecked: :class:`UncheckedRecords`); a walk that misses
    ``end`` means the file changed. A generator, not a loop inlined in the
    fold: a generator's step costs less than the same walk written into
    the consumer's loop (measured on a million records).
    """
    unpack = U32.unpack_from
    grouped = version == FORMAT_V2
    view = memoryview(data)
    offset = start
    seq = first_seq
    while seq <= after and offset < end:  # the frames a snapshot covers, whole or in part
        body = offset + FRAME_OVERHEAD
        stop = body + unpack(data, offset)[0]
        count = 1
        if grouped:
            sizes = group_sizes(data, offset)
            count = len(sizes)
            if seq + count - 1 > after:  # the snapshot cuts the group: the rest one by one
                position = body + MARK_COUNT.size
                for index, size in enumerate(sizes):
                    if seq + index > after:
                        yield seq + index, data[position : position + size], None
                    position += size
        seq += count
        offset = stop
    while offset < end:
        (length,) = unpack(data, offset)
        body = offset + FRAME_OVERHEAD
        if grouped:
            sizes = group_sizes(data, offset)
            offset = body + length
            yield seq, view[body : offset - 4 * len(sizes)], sizes
            seq += len(sizes)
        else:
            offset = body + length
            yield seq, data[body:offset], None
            seq += 1
    if offset != end:
        raise JournalError(f"{path} changed since it was read")


def _records(units: Iterable[Unit]) -> Iterator[tuple[int, bytes]]:
    """Units one record at a time, as ``(seq, payload)``: :class:`Records` and
    :class:`UncheckedRecords` iterated (``journal show``, the postmortem's
    second pass; replay folds units, which pay nothing for this).

    Over the one walk rather than a walk of its own per format: that costs
    this path a generator step a record (bench/journal_read_bench.py, 1 M
    records of 100 bytes, best of 5 interleaved runs, ns a record: format 1
    348 -> 417; format 2, 8 records a group 355 -> 403, 1000 a group 275 ->
    249), small beside decoding the record, which every caller does next.
    """
    for seq, payload, sizes in units:
        if sizes is None:
            yield seq, payload  # type: ignore[misc]  # a lone record is sliced as bytes
            continue
        group = bytes(payload)  # one copy, then a slice per record: cheaper than a view's
        position = MARK_COUNT.size
        for size in sizes:
            stop = position + size
            yield seq, group[position:stop]
            position = stop
            seq += 1


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise JournalError(f"{path} vanished since it was read") from exc


@dataclass(slots=True)
class _ScannedSegment:
    path: Path
    size: int
    first_seq: int | None  # None: neither header nor file name says
    runs: list[tuple[int, int, int]]  # (start, end, count); damage lies between runs
    damaged: bool = False  # salvage tolerated a problem in this segment
    lost_tail: bool = False  # salvage skipped damage up to end of file
    torn_at: int | None = None
    digest: int | None = None  # CRC32C of the whole file, for clean_shape
    version: int = FORMAT_V1


def _guess_version(data: bytes) -> int:
    """A damaged header's format: 2 if a group is intact right after it, else 1."""
    if frame_problem(GROUP_FRAMES, data, memoryview(data), HEADER_SIZE) is None:
        return FORMAT_V2
    return FORMAT_V1


class _Reader:
    """One read_journal pass: knows whether problems raise or are recorded."""

    def __init__(self, salvage: bool, digests: bool = False) -> None:
        self.salvage = salvage
        self.digests = digests
        self.damage: list[Damage] = []
        self.seqs_exact = True

    def problem(self, path: Path, offset: int, length: int, reason: str) -> None:
        if not self.salvage:
            raise JournalCorrupt(path, offset, reason)
        self.damage.append(Damage(path, offset, length, reason))

    def newest_snapshot(self, directory: Path) -> Snapshot | None:
        for seq, path in reversed(list_files(directory, SNAPSHOT_RE)):
            try:
                return _read_snapshot(path, seq)
            except Invalid as exc:
                self.problem(path, 0, path.stat().st_size, f"bad snapshot: {exc}")
        return None

    def scan_segment(self, path: Path, name_seq: int | None, is_last: bool) -> _ScannedSegment:
        data = path.read_bytes()
        scanned = _ScannedSegment(path, len(data), name_seq, [])
        if self.digests:
            scanned.digest = crc32c(data)
        if len(data) < HEADER_SIZE and is_last:
            scanned.torn_at = 0
            return scanned
        try:
            scanned.first_seq, scanned.version = parse_header(data, SEGMENT_MAGIC)
        except Invalid as exc:
            self.problem(path, 0, min(len(data), HEADER_SIZE), f"bad segment header: {exc}")
            scanned.damaged = True
            scanned.version = _guess_version(data)
        # Salvage trusts a header over the name: only the header has a CRC.
        if name_seq is not None and scanned.first_seq != name_seq:
            reason = f"header says first seq {scanned.first_seq}, file name {name_seq}"
            self.problem(path, 0, 0, reason)
            scanned.damaged = True
        if len(data) > HEADER_SIZE:
            self._scan_frames(scanned, data, is_last)
        return scanned

    def _scan_frames(self, scanned: _ScannedSegment, data: bytes, is_last: bool) -> None:
        view = memoryview(data)
        offset = HEADER_SIZE
        framing = FRAMINGS[scanned.version]
        while True:
            stop, count, why = check_frames(framing, data, view, offset)
            if count:
                scanned.runs.append((offset, stop, count))
            if why is None:  # the run reached end of file
                return
            resume = framing.find(data, view, stop + 1)
            if resume is None and is_last:
                scanned.torn_at = stop
                return
            skipped = (len(data) if resume is None else resume) - stop
            self.problem(scanned.path, stop, skipped, why)
            scanned.damaged = True
            if resume is None:
                scanned.lost_tail = True
                return
            offset = resume


def _read_snapshot(path: Path, name_seq: int) -> Snapshot:
    data = path.read_bytes()
    seq, _ = parse_header(data, SNAPSHOT_MAGIC)
    if seq != name_seq:
        raise Invalid(f"header says seq {seq}, file name {name_seq}")
    problem = frame_problem(RECORD_FRAMES, data, memoryview(data), HEADER_SIZE)
    if problem is not None:
        raise Invalid(problem)
    (length,) = U32.unpack_from(data, HEADER_SIZE)
    if HEADER_SIZE + FRAME_OVERHEAD + length != len(data):
        raise Invalid("trailing bytes after the snapshot record")
    return Snapshot(seq, data[HEADER_SIZE + FRAME_OVERHEAD :])


def _segments_to_read(segments: list[tuple[int, Path]], covered: int) -> list[tuple[int, Path]]:
    """Drop the segments whose records the snapshot covers entirely."""
    start = 0
    for index, (first_seq, _) in enumerate(segments):
        if first_seq <= covered + 1:
            start = index
    return segments[start:]


def _number_runs(
    reader: _Reader, scanned: _ScannedSegment, first_seq: int
) -> tuple[list[_Run], int]:
    """Give each run its first seq; return the runs and the segment's last seq.

    Runs are separated by damaged spans. A span counts as one lost record,
    the least it can hold, since it starts where a frame failed.
    """
    runs = []
    next_seq = first_seq
    for start, end, count in scanned.runs:
        if start != HEADER_SIZE:
            next_seq += 1
            reader.seqs_exact = False
        runs.append(_Run(start, end, count, next_seq))
        next_seq += count
    if scanned.lost_tail:
        next_seq += 1
    return runs, next_seq - 1


def _check_continuity(
    reader: _Reader, path: Path, first_seq: int, prev_last: int | None, covered: int
) -> None:
    # Records up to the snapshot need no segment, so a gap below it is fine.
    floor = covered if prev_last is None else max(prev_last, covered)
    if first_seq > floor + 1:
        reader.problem(path, 0, 0, f"gap: records {floor + 1}..{first_seq - 1} are missing")
    elif prev_last is not None and first_seq <= prev_last:
        reader.problem(path, 0, 0, f"overlap: segment starts at {first_seq}, after {prev_last}")


def first_payload(segment: Path) -> bytes | None:
    """The payload of a segment file's first record, unchecked; None if it has none.

    For tools that only peek (which node wrote a copied segment); reads the
    header and the first frame, whatever the segment's format.
    """
    with segment.open("rb") as file:
        head = file.read(HEADER_SIZE + GROUP_OVERHEAD)
        if len(head) < HEADER_SIZE + FRAME_OVERHEAD:
            return None
        try:
            _, version = parse_header(head, SEGMENT_MAGIC)
        except Invalid:
            version = FORMAT_V1  # a damaged header: peek as the oldest format
        (length,) = U32.unpack_from(head, HEADER_SIZE)
        if version == FORMAT_V1:
            file.seek(HEADER_SIZE + FRAME_OVERHEAD)
            return file.read(length)
        if len(head) < HEADER_SIZE + GROUP_OVERHEAD:
            return None
        file.seek(HEADER_SIZE)
        frame = file.read(FRAME_OVERHEAD + length)
    try:
        size = group_sizes(frame, 0)[0]
    except (IndexError, struct.error):
        return None
    return frame[GROUP_OVERHEAD : GROUP_OVERHEAD + size]


def require_journal(path: str | os.PathLike[str]) -> None:
    """Raise :class:`NoJournal` unless ``path`` is a journal directory or segment file.

    For the operator's commands: reading an empty directory yields an empty,
    valid journal (a daemon starts that way), so pointing a command at
    /var/lib/kvpushd instead of /var/lib/kvpushd/NODE would report "0
    records, all is well". A segment file is recognised by its magic, so a
    damaged one is still read (and its damage listed); anything else is not
    a journal. ``FileNotFoundError`` if ``path`` is missing.
    """
    root = Path(path)
    if root.is_dir():
        if list_files(root, SEGMENT_RE) or list_files(root, SNAPSHOT_RE):
            return
        inside = sorted(
            str(sub) for sub in root.iterdir() if sub.is_dir() and list_files(sub, SEGMENT_RE)
        )
        hint = (
            f"; journals are one level down: {', '.join(inside)}"
            if inside
            else "; give a node's journal directory (journal.dir, e.g. /var/lib/kvpushd/NODE)"
        )
        raise NoJournal(f"{root}: no journal here (no seg-*.kvj segment files){hint}")
    if not root.exists():
        raise FileNotFoundError(errno.ENOENT, "no such file or directory", str(root))
    with root.open("rb") as file:
        magic = file.read(len(SEGMENT_MAGIC))
    if magic != SEGMENT_MAGIC:
        raise NoJournal(
            f"{root}: not a kvpushd journal segment (it does not start with "
            f"{SEGMENT_MAGIC.decode()}); give a journal directory or its seg-*.kvj files"
        )


def read_journal(path: str | os.PathLike[str], *, salvage: bool = False) -> JournalContents:
    """Validate a journal directory, or one segment file, and return its contents.

    Pure reading. Raises :class:`JournalCorrupt` on anything but a torn tail
    unless ``salvage`` is set, ``FileNotFoundError`` if ``path`` is missing.
    A single segment file is read as the only (hence last) segment, with no
    snapshot and no continuity requirement on its first sequence number.
    """
    return _read(Path(path), _Reader(salvage))[0]


def _read(root: Path, reader: _Reader) -> tuple[JournalContents, list[_ScannedSegment]]:
    listing, snapshot = _listing(root, reader)
    scans = [
        reader.scan_segment(path, name_seq, is_last=index == len(listing) - 1)
        for index, (name_seq, path) in enumerate(listing)
    ]
    return _assemble(reader, scans, snapshot, require_start=root.is_dir()), scans


def _listing(root: Path, reader: _Reader) -> tuple[list[tuple[int | None, Path]], Snapshot | None]:
    """The segment files to read, in order, each with the seq its name gives; the snapshot."""
    if root.is_file():
        match = SEGMENT_RE.fullmatch(root.name)
        return [(None if match is None else int(match.group(1)), root)], None
    if root.is_dir():
        snapshot = reader.newest_snapshot(root)
        covered = 0 if snapshot is None else snapshot.seq
        return [*_segments_to_read(list_files(root, SEGMENT_RE), covered)], snapshot
    raise FileNotFoundError(errno.ENOENT, "no journal here", str(root))


# --------------------------------------------------------------------------
# The optimistic read: replay may fold a journal before its CRCs are checked
# (daemon/journal/replay.py), while another process validates it. The fold
# counts only if both reads saw the same bytes and the journal is clean.


class Shape(NamedTuple):
    """What a read of a clean journal saw: equal shapes, equal records.

    ``snapshot``: (seq, size, CRC32C) of the snapshot payload, or None.
    ``segments``: (path, first seq, size, CRC32C of the whole file) of each
    segment read, in order. A clean journal's records are every frame of
    these segments, from the header to end of file, numbered from the
    header's first seq, those up to the snapshot's seq skipped.
    """

    snapshot: tuple[int, int, int] | None
    segments: tuple[tuple[str, int, int, int], ...]


def _snapshot_key(snapshot: Snapshot | None) -> tuple[int, int, int] | None:
    if snapshot is None:
        return None
    return snapshot.seq, len(snapshot.payload), crc32c(snapshot.payload)


def clean_shape(path: str | os.PathLike[str]) -> Shape | None:
    """Validate ``path`` as :func:`read_journal` does; its shape if it is clean, else None.

    Clean: no torn tail and no damage, every segment intact from its header
    to its end. Anything else is None (the caller then reads the strict way,
    which reports it); so is an exception, which the caller's strict read
    raises again.
    """
    try:
        contents, scans = _read(Path(path), _Reader(False, digests=True))
    except (JournalError, OSError):
        return None
    if contents.torn_at is not None or contents.damage or not contents.seqs_exact:
        return None
    segments = []
    for scanned in scans:
        intact = (
            [(HEADER_SIZE, scanned.size)]
            if scanned.size > HEADER_SIZE
            else []
            if scanned.size == HEADER_SIZE
            else None
        )
        if (
            scanned.damaged
            or scanned.lost_tail
            or scanned.torn_at is not None
            or scanned.first_seq is None
            or scanned.digest is None
            or [(start, end) for start, end, _ in scanned.runs] != intact
        ):
            return None
        segments.append((str(scanned.path), scanned.first_seq, scanned.size, scanned.digest))
    return Shape(_snapshot_key(contents.snapshot), tuple(segments))


class UncheckedRecords:
    """Every frame of each segment, header to end of file, as ``(seq, payload)``; CRCs unchecked.

    The optimistic fold's input. A bad header raises :class:`JournalError`;
    a frame that is not what it claims shows up as an undecodable payload or
    a walk past a span's end in the fold, or as a shape that differs from
    :func:`clean_shape`'s: in every case the caller falls back to the strict
    read. :meth:`shape` is what was walked, once iterating is done.
    """

    __slots__ = ("_after", "_paths", "_seen", "_snapshot")

    def __init__(self, paths: list[Path], snapshot: Snapshot | None) -> None:
        self._paths = paths
        self._snapshot = snapshot
        self._after = 0 if snapshot is None else snapshot.seq
        self._seen: list[tuple[str, int, int, int]] = []

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        return _records(self.units())

    def units(self) -> Iterator[Unit]:
        """Every frame as :data:`Unit` s (a format-2 group in one piece), CRCs unchecked."""
        for path in self._paths:
            data = _read_bytes(path)
            try:
                first_seq, version = parse_header(data, SEGMENT_MAGIC)
            except Invalid as exc:
                raise JournalError(f"{path}: bad segment header: {exc}") from exc
            self._seen.append((str(path), first_seq, len(data), crc32c(data)))
            end = len(data)
            yield from _units(path, data, version, HEADER_SIZE, end, first_seq, self._after)

    def shape(self) -> Shape:
        return Shape(_snapshot_key(self._snapshot), tuple(self._seen))


def read_unchecked(path: str | os.PathLike[str]) -> tuple[Snapshot | None, UncheckedRecords]:
    """The snapshot and segments :func:`read_journal` would read, frames unchecked.

    Raises as :func:`read_journal` does without salvage on a bad snapshot;
    the segments are read only as the records are walked.
    """
    listing, snapshot = _listing(Path(path), _Reader(False))
    return snapshot, UncheckedRecords([p for _, p in listing], snapshot)


def _assemble(
    reader: _Reader,
    scans: list[_ScannedSegment],
    snapshot: Snapshot | None,
    *,
    require_start: bool,
) -> JournalContents:
    covered = 0 if snapshot is None else snapshot.seq
    plan: list[_SegmentPlan] = []
    prev_last: int | None = None
    prev_damaged = False
    for scanned in scans:
        first_seq = scanned.first_seq
        if first_seq is None:
            first_seq = (covered if prev_last is None else prev_last) + 1
        elif (require_start or prev_last is not None) and not prev_damaged:
            # After damage the previous segment's last seq is only a lower bound.
            _check_continuity(reader, scanned.path, first_seq, prev_last, covered)
        runs, prev_last = _number_runs(reader, scanned, first_seq)
        prev_damaged = scanned.damaged
        if runs:
            plan.append(_SegmentPlan(scanned.path, tuple(runs), scanned.version))
    tail = scans[-1] if scans else None
    torn_at = None if tail is None or tail.torn_at is None else (tail.path, tail.torn_at)
    return JournalContents(
        snapshot=snapshot,
        records=Records(tuple(plan), covered),
        torn_bytes=0 if tail is None or tail.torn_at is None else tail.size - tail.torn_at,
        torn_at=torn_at,
        damage=tuple(reader.damage),
        segments=tuple(scanned.path for scanned in scans),
        last_seq=max(covered, prev_last or 0),
        seqs_exact=reader.seqs_exact,
    )
