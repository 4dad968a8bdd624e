"""Journal storage layer: a bytes-level, append-only, segmented write-ahead log.

The journal knows nothing about event schemas: a record is an opaque, non-empty
``bytes`` payload (a msgspec-encoded event produced by the caller). The journal
assigns sequence numbers, frames records so that a torn tail is told apart from
corruption, rotates segments by size and keeps snapshots that let old segments
be deleted.

On-disk format (version 1; every integer is big-endian)
-------------------------------------------------------

A journal is a directory holding:

``seg-{first_seq:020d}.kvj``
    A segment. An 18-byte header, then record frames back to back::

        magic     4 bytes   b"KVPJ"
        version   u16       FORMAT_VERSION
        first_seq u64       sequence number of the segment's first record
        hcrc      u32       CRC32C of the 14 bytes above

    Record ``i`` of a segment (counting from 0) has sequence number
    ``first_seq + i``; sequence numbers are not stored per record. The header's
    ``first_seq`` must equal the one in the file name.

``snap-{seq:020d}.kvs``
    A snapshot of the caller's state as of record ``seq``: the same 18-byte
    header with magic ``b"KVPS"`` and ``seq`` in place of ``first_seq``, then
    exactly one record frame holding the snapshot payload, then end of file.

``journal.lock``
    Held with ``flock`` by the one :class:`Journal` writing the directory.

``*.tmp``
    Files being created; ignored by readers and removed by :meth:`Journal.open`.

A record frame is::

    length    u32       payload length, 1 <= length <= MAX_RECORD_BYTES
    crc       u32       CRC32C of the 4 length bytes followed by the payload
    payload   length bytes

A zero length is invalid. As ``crc32c(b"") == 0``, this guarantees that a run
of zero bytes (what a filesystem may leave after a crash) never parses as a
record. Sequence numbers start at 1 in a new journal.

Reading and recovery rules
--------------------------

* A frame that fails to parse at offset ``o`` (zero or oversized length, frame
  running past end of file, CRC mismatch) is a *torn tail* when it lies in the
  last segment and no valid frame starts at any offset after ``o`` in that
  segment; the bytes from ``o`` on are then ignored (``torn_bytes``).
  Everything else is *corruption* and raises :class:`JournalCorrupt`: damage
  followed by an intact frame, any damage in a segment that is not the last,
  a bad segment header, a gap or an overlap in sequence numbers.
* The last segment may be shorter than its header: that is a torn tail at
  offset 0 (its file name then gives its first sequence number). Segments are
  created with their header written and synced under a temporary name before
  being renamed into place, so a header can only be short through a torn copy.
* Only the newest snapshot counts; segments whose records it covers are not
  read. Without a snapshot a journal directory must start at sequence 1; with
  one, the first segment read must start at or before ``snapshot.seq + 1``.
* The rule is strict by design and has one false alarm: a crash during an
  unacknowledged commit on a filesystem that may persist the pages of one
  write out of order (XFS exposing zeros before later data, say) can leave an
  intact frame after a hole, which reads as corruption. Salvage recovers it.
* Under policy ``never`` a crash may lose records that a snapshot already
  covers; a writer then continues at ``snapshot.seq + 1`` and readers accept
  that jump, as no record below the snapshot is needed.
* ``salvage=True`` turns corruption into :class:`Damage` entries: reading
  resumes at the next valid frame. Frames carry no sequence numbers, so records
  that follow a damaged span in the same segment are numbered as if the span
  held exactly one record (a lower bound, exact for a single damaged record);
  ``seqs_exact`` is then False. The next segment's header restores exact
  numbering.

Writer rules
------------

* One writer per directory (``flock``), used from one thread. ``append``
  buffers a frame and returns its seq; ``commit`` writes the buffer with one
  ``write`` and, unless the policy is ``never``, one ``fdatasync`` (group
  commit). A record may be acted upon once ``durable_seq >= seq``.
* :meth:`Journal.open` never appends to a file written by an earlier process.
  It syncs the last segment, cuts a torn tail off it (``ftruncate`` +
  ``fdatasync``), removes it if it holds no intact record, and starts a new
  segment at the next sequence number. Restarts therefore leave small
  segments behind; :meth:`Journal.prune` removes them once a snapshot covers
  them. What recovery read is handed over by :meth:`Journal.take_recovered`,
  so the caller replays it without validating the journal a second time.
* Rotation seals a segment with ``fdatasync`` whatever the fsync policy, so
  only the last segment can ever have a torn tail.
* Any ``OSError`` while writing, syncing, truncating, renaming or deleting is
  fatal (:class:`JournalFatal`): after a failed ``fsync`` the kernel may have
  dropped the dirty pages, so a retry could report success for lost data.
  The journal refuses every later call; the owner exits and replays.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain, pairwise
from pathlib import Path
from types import TracebackType
from typing import NamedTuple, NoReturn, Self, TypeAlias

from crc32c import crc32c

from daemon import failpoints
from schemas.config import FsyncPolicy

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "FORMAT_VERSION",
    "FRAME_OVERHEAD",
    "HEADER_SIZE",
    "MAX_RECORD_BYTES",
    "Damage",
    "FsyncPolicy",
    "Journal",
    "JournalClosed",
    "JournalContents",
    "JournalCorrupt",
    "JournalError",
    "JournalFatal",
    "JournalLocked",
    "Records",
    "Snapshot",
    "check_payload",
    "read_journal",
    "segment_name",
    "snapshot_name",
]

FORMAT_VERSION = 1
MAX_RECORD_BYTES = 16 * 1024 * 1024
DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024

SEGMENT_MAGIC = b"KVPJ"
SNAPSHOT_MAGIC = b"KVPS"
LOCK_NAME = "journal.lock"

_HEADER = struct.Struct(">4sHQ")
_U32 = struct.Struct(">I")
_FRAME = struct.Struct(">II")
HEADER_SIZE = _HEADER.size + _U32.size
FRAME_OVERHEAD = _FRAME.size

_SEGMENT_RE = re.compile(r"seg-(\d{20})\.kvj")
_SNAPSHOT_RE = re.compile(r"snap-(\d{20})\.kvs")
_TMP_SUFFIX = ".tmp"
_FILE_MODE = 0o640

# Resynchronisation after damage looks for offsets whose 4 length bytes could
# hold a legal length (1 .. 0x01000000): a zero byte followed by a non-zero
# byte within the next three, or exactly 01 00 00 00. Every alternative
# consumes one byte so that overlapping candidates are all found.
_CANDIDATE = re.compile(rb"\x00(?=[^\x00]|\x00[^\x00]|\x00\x00[^\x00])|\x01(?=\x00\x00\x00)")
# Long zero runs are skipped with find() and a char-class search, which run at
# C speed; the candidate regex alone crawls through zeros some 10x slower.
_ZERO_RUN = bytes(64)
_NONZERO = re.compile(rb"[^\x00]")

# CRC32C of a frame's length bytes, the seed for the payload CRC. Payload
# lengths repeat, so caching saves a C call per record; capped so a journal of
# many distinct large lengths cannot grow the table without bound.
_SEED_CACHE_LIMIT = 1 << 16
_SEEDS: dict[int, int] = {}

_Bytes: TypeAlias = bytes | bytearray | memoryview
WriteFn: TypeAlias = Callable[[int, _Bytes], int]
SyncFn: TypeAlias = Callable[[int], None]
Clock: TypeAlias = Callable[[], float]


class JournalError(Exception):
    """Base class of every error this module raises on purpose."""


class JournalCorrupt(JournalError):
    """The journal holds damage that is not a torn tail."""

    def __init__(self, path: Path | None, offset: int | None, reason: str) -> None:
        where = "" if path is None else f"{path}" + ("" if offset is None else f" @ {offset}")
        super().__init__(f"{where}: {reason}" if where else reason)
        self.path = path
        self.offset = offset
        self.reason = reason


class JournalFatal(JournalError):
    """An I/O operation failed; the journal is unusable and must not be retried."""


class JournalLocked(JournalError):
    """Another Journal holds the directory."""


class JournalClosed(JournalError):
    """The journal was closed."""


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
        return chain.from_iterable(_iter_segment(seg, self._after) for seg in self._plan)

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


# --------------------------------------------------------------------------
# Framing


def segment_name(first_seq: int) -> str:
    return f"seg-{first_seq:020d}.kvj"


def snapshot_name(seq: int) -> str:
    return f"snap-{seq:020d}.kvs"


def _length_seed(length: int) -> int:
    seed = _SEEDS.get(length)
    if seed is None:
        seed = crc32c(_U32.pack(length))
        if length < _SEED_CACHE_LIMIT:
            _SEEDS[length] = seed
    return seed


def _bad_size(length: int) -> ValueError:
    return ValueError(f"payload must be 1..{MAX_RECORD_BYTES} bytes, got {length}")


def check_payload(payload: _Bytes) -> int:
    """The payload's length, or ValueError if no journal would take it."""
    length = len(payload)
    if not 0 < length <= MAX_RECORD_BYTES:
        raise _bad_size(length)
    return length


def _frame_header(payload: _Bytes) -> bytes:
    length = check_payload(payload)
    return _FRAME.pack(length, crc32c(payload, _length_seed(length)))


def _pack_file_header(magic: bytes, seq: int) -> bytes:
    head = _HEADER.pack(magic, FORMAT_VERSION, seq)
    return head + _U32.pack(crc32c(head))


class _Invalid(Exception):
    """Internal: a header or frame failed validation; the message says why."""


def _parse_file_header(data: bytes, magic: bytes) -> int:
    if len(data) < HEADER_SIZE:
        raise _Invalid(f"file is {len(data)} bytes, shorter than its {HEADER_SIZE}-byte header")
    found_magic, version, seq = _HEADER.unpack_from(data)
    (stored,) = _U32.unpack_from(data, _HEADER.size)
    if crc32c(data[: _HEADER.size]) != stored:
        raise _Invalid("header CRC mismatch")
    if found_magic != magic:
        raise _Invalid(f"bad magic {found_magic!r}, expected {magic!r}")
    if version != FORMAT_VERSION:
        raise _Invalid(f"unsupported format version {version}")
    if seq < 1:
        raise _Invalid(f"sequence number {seq} in header is below 1")
    return int(seq)


def _frame_problem(data: bytes, view: memoryview, offset: int) -> str | None:
    """Why the frame at ``offset`` is invalid, or None if it is valid."""
    end = len(data)
    if offset + FRAME_OVERHEAD > end:
        return f"frame header cut short ({end - offset} bytes before end of file)"
    length, stored = _FRAME.unpack_from(data, offset)
    if length == 0:
        return "zero record length"
    if length > MAX_RECORD_BYTES:
        return f"record length {length} exceeds {MAX_RECORD_BYTES}"
    stop = offset + FRAME_OVERHEAD + length
    if stop > end:
        return f"{length}-byte record runs {stop - end} bytes past end of file"
    computed = crc32c(view[offset + FRAME_OVERHEAD : stop], _length_seed(length))
    if computed != stored:
        return f"record CRC mismatch (stored {stored:#010x}, computed {computed:#010x})"
    return None


def _parse_run(data: bytes, view: memoryview, offset: int) -> tuple[int, int]:
    """Walk intact frames from ``offset``; return (offset of first bad frame or EOF, count).

    The hot loop of replay, hence the local aliases, the cached CRC seeds and
    no allocation but the memoryview slice handed to crc32c.
    """
    unpack = _FRAME.unpack_from
    seeds = _SEEDS
    crc = crc32c
    end = len(data)
    limit = end - FRAME_OVERHEAD
    count = 0
    while offset <= limit:
        length, stored = unpack(data, offset)
        body = offset + FRAME_OVERHEAD
        stop = body + length
        if stop > end or not 0 < length <= MAX_RECORD_BYTES:
            break
        try:
            seed = seeds[length]
        except KeyError:
            seed = _length_seed(length)
        if crc(view[body:stop], seed) != stored:
            break
        offset = stop
        count += 1
    return offset, count


def _find_next_frame(data: bytes, view: memoryview, start: int) -> int | None:
    """The first offset >= start where a valid frame begins, or None."""
    end = len(data)
    pos = start
    while pos + FRAME_OVERHEAD < end:
        zeros = data.find(_ZERO_RUN, pos)
        # Inside a zero run no offset can hold a legal length, so the regex
        # may stop there; it sees 3 bytes into the run so that a length field
        # ending in zeros (01 00 00 00) just before it is still found.
        limit = end if zeros < 0 else zeros + 3
        for match in _CANDIDATE.finditer(data, pos, limit):
            if _frame_problem(data, view, match.start()) is None:
                return match.start()
        if zeros < 0:
            return None
        nonzero = _NONZERO.search(data, zeros)
        if nonzero is None:
            return None
        # A length field may start up to 3 zero bytes before a non-zero byte.
        pos = nonzero.start() - 3
    return None


def _iter_segment(seg: _SegmentPlan, after: int) -> Iterator[tuple[int, bytes]]:
    data = _read_bytes(seg.path)
    unpack = _U32.unpack_from
    for run in seg.runs:
        end = run.end
        if len(data) < end:
            raise JournalError(f"{seg.path} shrank since it was read")
        offset = run.start
        seq = run.first_seq
        while seq <= after and offset < end:
            offset += FRAME_OVERHEAD + unpack(data, offset)[0]
            seq += 1
        while offset < end:
            (length,) = unpack(data, offset)
            body = offset + FRAME_OVERHEAD
            offset = body + length
            yield seq, data[body:offset]
            seq += 1
        if offset != end:
            raise JournalError(f"{seg.path} changed since it was read")


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise JournalError(f"{path} vanished since it was read") from exc


# --------------------------------------------------------------------------
# Reading


def _list_files(directory: Path, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
    found = []
    for entry in os.scandir(directory):
        match = pattern.fullmatch(entry.name)
        if match is not None:
            found.append((int(match.group(1)), Path(entry.path)))
    found.sort()
    return found


@dataclass(slots=True)
class _ScannedSegment:
    path: Path
    size: int
    first_seq: int | None  # None: neither header nor file name says
    runs: list[tuple[int, int, int]]  # (start, end, count); damage lies between runs
    damaged: bool = False  # salvage tolerated a problem in this segment
    lost_tail: bool = False  # salvage skipped damage up to end of file
    torn_at: int | None = None


class _Reader:
    """One read_journal pass: knows whether problems raise or are recorded."""

    def __init__(self, salvage: bool) -> None:
        self.salvage = salvage
        self.damage: list[Damage] = []
        self.seqs_exact = True

    def problem(self, path: Path, offset: int, length: int, reason: str) -> None:
        if not self.salvage:
            raise JournalCorrupt(path, offset, reason)
        self.damage.append(Damage(path, offset, length, reason))

    def newest_snapshot(self, directory: Path) -> Snapshot | None:
        for seq, path in reversed(_list_files(directory, _SNAPSHOT_RE)):
            try:
                return _read_snapshot(path, seq)
            except _Invalid as exc:
                self.problem(path, 0, path.stat().st_size, f"bad snapshot: {exc}")
        return None

    def scan_segment(self, path: Path, name_seq: int | None, is_last: bool) -> _ScannedSegment:
        data = path.read_bytes()
        scanned = _ScannedSegment(path, len(data), name_seq, [])
        if len(data) < HEADER_SIZE and is_last:
            scanned.torn_at = 0
            return scanned
        try:
            scanned.first_seq = _parse_file_header(data, SEGMENT_MAGIC)
        except _Invalid as exc:
            self.problem(path, 0, min(len(data), HEADER_SIZE), f"bad segment header: {exc}")
            scanned.damaged = True
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
        while True:
            stop, count = _parse_run(data, view, offset)
            if count:
                scanned.runs.append((offset, stop, count))
            if stop == len(data):
                return
            resume = _find_next_frame(data, view, stop + 1)
            if resume is None and is_last:
                scanned.torn_at = stop
                return
            reason = _frame_problem(data, view, stop) or "invalid frame"
            skipped = (len(data) if resume is None else resume) - stop
            self.problem(scanned.path, stop, skipped, reason)
            scanned.damaged = True
            if resume is None:
                scanned.lost_tail = True
                return
            offset = resume


def _read_snapshot(path: Path, name_seq: int) -> Snapshot:
    data = path.read_bytes()
    seq = _parse_file_header(data, SNAPSHOT_MAGIC)
    if seq != name_seq:
        raise _Invalid(f"header says seq {seq}, file name {name_seq}")
    problem = _frame_problem(data, memoryview(data), HEADER_SIZE)
    if problem is not None:
        raise _Invalid(problem)
    (length,) = _U32.unpack_from(data, HEADER_SIZE)
    if HEADER_SIZE + FRAME_OVERHEAD + length != len(data):
        raise _Invalid("trailing bytes after the snapshot record")
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


def read_journal(path: str | os.PathLike[str], *, salvage: bool = False) -> JournalContents:
    """Validate a journal directory, or one segment file, and return its contents.

    Pure reading. Raises :class:`JournalCorrupt` on anything but a torn tail
    unless ``salvage`` is set, ``FileNotFoundError`` if ``path`` is missing.
    A single segment file is read as the only (hence last) segment, with no
    snapshot and no continuity requirement on its first sequence number.
    """
    root = Path(path)
    reader = _Reader(salvage)
    listing: list[tuple[int | None, Path]]
    if root.is_file():
        match = _SEGMENT_RE.fullmatch(root.name)
        listing = [(None if match is None else int(match.group(1)), root)]
        snapshot = None
    elif root.is_dir():
        snapshot = reader.newest_snapshot(root)
        covered = 0 if snapshot is None else snapshot.seq
        listing = [*_segments_to_read(_list_files(root, _SEGMENT_RE), covered)]
    else:
        raise FileNotFoundError(errno.ENOENT, "no journal here", str(root))
    scans = [
        reader.scan_segment(path, name_seq, is_last=index == len(listing) - 1)
        for index, (name_seq, path) in enumerate(listing)
    ]
    return _assemble(reader, scans, snapshot, require_start=root.is_dir())


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
            plan.append(_SegmentPlan(scanned.path, tuple(runs)))
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


# --------------------------------------------------------------------------
# Writing


def _fsync_directory(directory: Path, fsync: SyncFn) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def _write_all(write: WriteFn, fd: int, data: _Bytes) -> None:
    """Write everything; regular files may still return short counts (signals, >2 GiB)."""
    view = memoryview(data)
    while view:
        written = write(fd, view)
        if written <= 0:
            raise OSError(errno.EIO, f"write returned {written}")
        view = view[written:]


@dataclass(frozen=True, slots=True)
class _Syscalls:
    """The mutating system calls, injectable so tests and failpoints can fail them."""

    write: WriteFn
    fdatasync: SyncFn
    fsync: SyncFn  # directories


class Journal:
    """The single writer of a journal directory. Not thread-safe.

    Create with :meth:`open`. ``append`` buffers a record and returns its
    sequence number; the record is durable once ``durable_seq >= seq``. With
    ``BATCH`` and ``NEVER`` the buffer is written by ``commit()``, which
    ``append`` also calls by itself once the oldest buffered record has waited
    ``commit_window_s`` or the segment is full. A caller that may go idle with
    records buffered must call ``commit()`` by :attr:`commit_deadline` (an
    event-loop timer): ``append`` only looks at the clock when it is called.
    """

    __slots__ = (
        "_buf",
        "_clock",
        "_closed",
        "_directory",
        "_durable_seq",
        "_failure",
        "_fd",
        "_lock_fd",
        "_next_seq",
        "_pending_since",
        "_policy",
        "_recovered",
        "_segment_bytes",
        "_segment_path",
        "_segment_size",
        "_snapshot_seq",
        "_sync_each",
        "_sys",
        "_unsynced",
        "_window",
    )

    def __init__(
        self,
        directory: Path,
        *,
        lock_fd: int,
        policy: FsyncPolicy,
        segment_bytes: int,
        commit_window_s: float,
        syscalls: _Syscalls,
        clock: Clock,
        recovered: JournalContents,
    ) -> None:
        """Internal: use :meth:`Journal.open`, which recovers the directory first."""
        self._directory = directory
        self._lock_fd = lock_fd
        self._policy = policy
        self._sync_each = policy is FsyncPolicy.ALWAYS
        self._segment_bytes = segment_bytes
        self._window = commit_window_s
        self._sys = syscalls
        self._clock = clock
        self._recovered: JournalContents | None = recovered
        self._snapshot_seq = 0 if recovered.snapshot is None else recovered.snapshot.seq
        self._next_seq = recovered.last_seq + 1
        self._durable_seq = recovered.last_seq
        self._buf = bytearray()
        self._pending_since: float | None = None
        self._fd: int | None = None
        self._segment_path: Path | None = None
        self._segment_size = 0
        self._unsynced = False  # written since the last fdatasync of this segment
        self._failure: JournalFatal | None = None
        self._closed = False

    # -- construction ------------------------------------------------------

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        fsync: FsyncPolicy | str = FsyncPolicy.BATCH,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        commit_window_s: float = 0.001,
        write: WriteFn = os.write,
        fdatasync: SyncFn = os.fdatasync,
        fsync_dir: SyncFn = os.fsync,
        clock: Clock = time.monotonic,
    ) -> Journal:
        """Lock ``directory`` (created if missing), recover it and start a new segment.

        Raises :class:`JournalLocked` if another Journal holds it,
        :class:`JournalCorrupt` if it holds anything but a torn tail, and
        :class:`JournalFatal` on an I/O error. What recovery read is kept in
        :meth:`take_recovered` so the caller can replay it without a second scan.
        """
        if segment_bytes <= HEADER_SIZE:
            raise ValueError(f"segment_bytes must exceed the {HEADER_SIZE}-byte header")
        if commit_window_s < 0:
            raise ValueError("commit_window_s must be >= 0")
        policy = FsyncPolicy(fsync)
        root = Path(directory)
        syscalls = _Syscalls(write=write, fdatasync=fdatasync, fsync=fsync_dir)
        lock_fd = _lock_directory(root)
        try:
            recovered = read_journal(root)
            _recover_tail(root, recovered, syscalls)
            journal = cls(
                root,
                lock_fd=lock_fd,
                policy=policy,
                segment_bytes=segment_bytes,
                commit_window_s=commit_window_s,
                syscalls=syscalls,
                clock=clock,
                recovered=recovered,
            )
            journal._start_segment()
        except BaseException:
            os.close(lock_fd)
            raise
        return journal

    # -- properties --------------------------------------------------------

    @property
    def directory(self) -> Path:
        return self._directory

    @property
    def policy(self) -> FsyncPolicy:
        return self._policy

    @property
    def next_seq(self) -> int:
        """The seq the next append will get."""
        return self._next_seq

    @property
    def durable_seq(self) -> int:
        """Highest seq made durable (for ``NEVER``: handed to the OS)."""
        return self._durable_seq

    @property
    def pending(self) -> int:
        """Records appended but not yet committed."""
        return self._next_seq - 1 - self._durable_seq

    @property
    def commit_deadline(self) -> float | None:
        """Clock time by which commit() is due, or None with nothing buffered."""
        return None if self._pending_since is None else self._pending_since + self._window

    @property
    def snapshot_seq(self) -> int:
        """Seq of the newest snapshot, 0 if none."""
        return self._snapshot_seq

    @property
    def segment_path(self) -> Path:
        """The segment being appended to (the last one, once closed)."""
        assert self._segment_path is not None, "open() always starts a segment"
        return self._segment_path

    def take_recovered(self) -> JournalContents:
        """Hand over what :meth:`open` read; callable once.

        The journal lets go of it, so the snapshot payload it holds is not
        kept alive for the journal's lifetime.
        """
        recovered, self._recovered = self._recovered, None
        if recovered is None:
            raise JournalError("the recovered contents were already taken")
        return recovered

    # -- appending ---------------------------------------------------------

    def append(self, payload: bytes) -> int:
        """Buffer one record and return its seq; may commit (see the class doc)."""
        # The hot path of the daemon: framing is inlined rather than shared
        # with _frame_header, as each Python call costs ~10% of an append.
        failpoints.hit("journal.append")
        if self._failure is not None or self._closed:
            self._check_usable()
        length = len(payload)
        if not 0 < length <= MAX_RECORD_BYTES:
            raise _bad_size(length)
        try:
            seed = _SEEDS[length]
        except KeyError:
            seed = _length_seed(length)
        buf = self._buf
        buf += _FRAME.pack(length, crc32c(payload, seed))
        buf += payload
        seq = self._next_seq
        self._next_seq = seq + 1
        if self._sync_each or self._segment_size + len(buf) >= self._segment_bytes:
            self.commit()
            return seq
        now = self._clock()
        since = self._pending_since
        if since is None:
            self._pending_since = since = now
        if now - since >= self._window:
            self.commit()
        return seq

    def commit(self) -> int:
        """Write the buffered records in one write and sync per policy; return durable_seq."""
        self._check_usable()
        if self._buf:
            self._write_buffer()
        if self._segment_size >= self._segment_bytes:
            self._rotate()
        return self._durable_seq

    # -- split-phase commit (group commit off the event loop) ----------------

    def write_pending(self) -> tuple[int, int | None]:
        """Write buffered records without syncing them.

        Returns ``(written_seq, fd)``: ``fd`` is a duplicate of the segment's
        descriptor for the caller to ``sync_fd`` (typically in another thread,
        so the writer keeps appending meanwhile) and then ``mark_durable``; it
        is None when nothing needs a sync (policy ``never``, or a rotation
        already synced it). The duplicate keeps the sync valid even if the
        segment rotates and closes in the meantime.
        """
        self._check_usable()
        if self._buf:
            self._write_out()
        written = self._next_seq - 1
        if self._segment_size >= self._segment_bytes:
            self._rotate()  # seals (and syncs) the segment holding what was written
            self._durable_seq = written
            return written, None
        if self._policy is FsyncPolicy.NEVER or written <= self._durable_seq:
            self._durable_seq = written
            return written, None
        with self._fatal_on_oserror(f"duplicating the descriptor of {self._segment_path}"):
            return written, os.dup(self._active_fd())

    def sync_fd(self, fd: int) -> None:
        """fdatasync a descriptor from :meth:`write_pending` and close it; thread-safe.

        An error is fatal for the journal, exactly like a failed commit.
        """
        try:
            failpoints.hit("journal.sync_fd")
            self._sys.fdatasync(fd)
        except OSError as exc:
            self._failure = JournalFatal(f"fdatasync of {self._segment_path}: {exc}")
            raise self._failure from exc
        finally:
            os.close(fd)

    def mark_durable(self, seq: int) -> None:
        """Record that everything up to ``seq`` was synced by :meth:`sync_fd`."""
        self._check_usable()
        if seq > self._durable_seq:
            self._durable_seq = seq

    def _write_out(self) -> None:
        """write(2) the buffered records to the active segment, unsynced."""
        # Swapped out, never resized in place: a failed write may leave views of
        # it alive (in the traceback), and a bytearray with views cannot shrink.
        buf, self._buf = self._buf, bytearray()
        self._pending_since = None
        with self._fatal_on_oserror(f"writing {self._segment_path}"):
            failpoints.hit("journal.write")
            _write_all(self._sys.write, self._active_fd(), buf)
        self._segment_size += len(buf)
        self._unsynced = True

    def _write_buffer(self) -> None:
        self._write_out()
        if self._policy is not FsyncPolicy.NEVER:
            self._sync_segment()
        self._durable_seq = self._next_seq - 1

    def _sync_segment(self) -> None:
        with self._fatal_on_oserror(f"fdatasync of {self._segment_path}"):
            failpoints.hit("journal.fdatasync")
            self._sys.fdatasync(self._active_fd())
        self._unsynced = False

    def _rotate(self) -> None:
        # Sealed segments are synced whatever the policy: recovery relies on
        # only the last segment ever having a torn tail.
        if self._unsynced:
            self._sync_segment()
        self._close_segment()
        self._start_segment()

    def _start_segment(self) -> None:
        first_seq = self._next_seq
        path = self._directory / segment_name(first_seq)
        with self._fatal_on_oserror(f"creating {path}"):
            failpoints.hit("journal.rotate")
            self._fd = _create_durably(path, _pack_file_header(SEGMENT_MAGIC, first_seq), self._sys)
        self._segment_path = path
        self._segment_size = HEADER_SIZE
        self._unsynced = False

    def _close_segment(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def _active_fd(self) -> int:
        assert self._fd is not None, "a usable journal always has an open segment"
        return self._fd

    # -- snapshots and pruning ----------------------------------------------

    def write_snapshot(self, seq: int, payload: bytes) -> Path:
        """Atomically write the caller's state as of record ``seq`` (<= durable_seq)."""
        self._check_usable()
        if not max(1, self._snapshot_seq) <= seq <= self._durable_seq:
            raise ValueError(
                f"snapshot seq {seq} must lie in {max(1, self._snapshot_seq)}..{self._durable_seq}"
            )
        data = _pack_file_header(SNAPSHOT_MAGIC, seq) + _frame_header(payload) + payload
        path = self._directory / snapshot_name(seq)
        with self._fatal_on_oserror(f"writing {path}"):
            failpoints.hit("journal.snapshot")
            os.close(_create_durably(path, data, self._sys))
        self._snapshot_seq = seq
        return path

    def prune(self, retain_segments: int = 1) -> list[Path]:
        """Delete what the newest snapshot makes redundant; return the deleted paths.

        Deletes sealed segments whose records all have seq <= the snapshot's,
        oldest first, keeping the ``retain_segments`` newest of them, and every
        snapshot older than the newest.
        """
        self._check_usable()
        if retain_segments < 0:
            raise ValueError("retain_segments must be >= 0")
        doomed = self._prunable_segments(retain_segments) + [
            path
            for seq, path in _list_files(self._directory, _SNAPSHOT_RE)
            if seq < self._snapshot_seq
        ]
        if doomed:
            with self._fatal_on_oserror(f"pruning {self._directory}"):
                for path in doomed:
                    path.unlink()
                _fsync_directory(self._directory, self._sys.fsync)
        return doomed

    def _prunable_segments(self, retain_segments: int) -> list[Path]:
        segments = _list_files(self._directory, _SEGMENT_RE)
        covered = [
            path
            for (_, path), (next_first, _) in pairwise(segments)
            if next_first - 1 <= self._snapshot_seq and path != self._segment_path
        ]
        return covered[: max(0, len(covered) - retain_segments)]

    # -- lifecycle ---------------------------------------------------------

    def close(self) -> None:
        """Commit and release the directory. Idempotent.

        After a fatal error, releases resources without committing or raising:
        the failure was reported when it happened.
        """
        if self._closed:
            return
        try:
            if self._failure is None:
                self.commit()
        finally:
            self._closed = True
            self._close_segment()
            os.close(self._lock_fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "failed" if self._failure else "closed" if self._closed else "open"
        return (
            f"Journal({str(self._directory)!r}, {state}, policy={self._policy.value}, "
            f"next_seq={self._next_seq}, durable_seq={self._durable_seq})"
        )

    # -- failure handling --------------------------------------------------

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise JournalFatal(f"journal unusable after: {self._failure}") from self._failure
        if self._closed:
            raise JournalClosed(f"journal {self._directory} is closed")

    @contextmanager
    def _fatal_on_oserror(self, what: str) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            self._fail(what, exc)

    def _fail(self, what: str, exc: OSError) -> NoReturn:
        self._failure = JournalFatal(f"{what}: {exc}")
        self._buf = bytearray()
        raise self._failure from exc


def _lock_directory(directory: Path) -> int:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, _FILE_MODE)
    except OSError as exc:
        raise JournalFatal(f"cannot open journal directory {directory}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise JournalLocked(f"{directory} is in use by another journal writer") from exc
    return fd


def _create_durably(path: Path, header: bytes, syscalls: _Syscalls) -> int:
    """Create ``path`` holding ``header`` so that it never exists half-written.

    Written and synced under a temporary name, renamed into place, directory
    synced. Returns the open descriptor, positioned at the end of the file.
    """
    tmp = path.with_name(path.name + _TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _FILE_MODE)
    try:
        _write_all(syscalls.write, fd, header)
        syscalls.fdatasync(fd)
        os.rename(tmp, path)
        _fsync_directory(path.parent, syscalls.fsync)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _recover_tail(directory: Path, contents: JournalContents, syscalls: _Syscalls) -> None:
    """Make the last segment safe to leave behind: synced with any torn tail cut off.

    A last segment left without an intact record is removed instead: the new
    segment may need its name.
    """
    try:
        for name in os.listdir(directory):
            if name.endswith(_TMP_SUFFIX):
                (directory / name).unlink()
        if not contents.segments:
            return
        last = contents.segments[-1]
        cut = None if contents.torn_at is None else contents.torn_at[1]
        if (last.stat().st_size if cut is None else cut) <= HEADER_SIZE:
            last.unlink()
        else:
            _truncate_and_sync(last, cut, syscalls)
    except OSError as exc:
        raise JournalFatal(f"recovering {directory}: {exc}") from exc


def _truncate_and_sync(path: Path, cut: int | None, syscalls: _Syscalls) -> None:
    # The previous writer may have run with policy NEVER, and this segment is
    # about to become a sealed one: it must be durable before a newer exists.
    fd = os.open(path, os.O_WRONLY)
    try:
        if cut is not None:
            os.ftruncate(fd, cut)
        syscalls.fdatasync(fd)
    finally:
        os.close(fd)
