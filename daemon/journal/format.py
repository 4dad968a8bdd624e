"""The journal's on-disk format: file names and headers, record framing, CRCs.

The journal knows nothing about event schemas: a record is an opaque, non-empty
``bytes`` payload (a msgspec-encoded event produced by the caller). The journal
assigns sequence numbers, frames records so that a torn tail is told apart from
corruption, rotates segments by size and keeps snapshots that let old segments
be deleted. This module is the format: the specification below, the constants,
the framing and its checks, shared by the writer (writer.py, recovery.py) and
the reader (reader.py). The errors every journal module raises are here too.

On-disk format (versions 1 and 2; every integer is big-endian)
--------------------------------------------------------------

A journal is a directory holding:

``seg-{first_seq:020d}.kvj``
    A segment. An 18-byte header, then record frames back to back::

        magic     4 bytes   b"KVPJ"
        version   u16       1 or 2: how the segment's records are framed
        first_seq u64       sequence number of the segment's first record
        hcrc      u32       CRC32C of the 14 bytes above

    Record ``i`` of a segment (counting from 0) has sequence number
    ``first_seq + i``; sequence numbers are not stored per record. The header's
    ``first_seq`` must equal the one in the file name.

    Each segment has one version; a directory may hold segments of both,
    in any order (a journal written by an older kvpushd, continued in
    format 2 by a newer one). A writer writes every segment it creates in
    its own format (:meth:`Journal.open`'s ``format``), never appending to
    an older one, so a segment's records all share its header's version.

``snap-{seq:020d}.kvs``
    A snapshot of the caller's state as of record ``seq``: the same 18-byte
    header with magic ``b"KVPS"``, version 1 and ``seq`` in place of
    ``first_seq``, then exactly one format-1 record frame holding the
    snapshot payload, then end of file.

``journal.lock``
    Held with ``flock`` by the one :class:`Journal` writing the directory.

``*.tmp``
    Files being created; ignored by readers and removed by :meth:`Journal.open`.

Format 1: a frame per record::

    length    u32       payload length, 1 <= length <= MAX_RECORD_BYTES
    crc       u32       CRC32C of the 4 length bytes followed by the payload
    payload   length bytes

A zero length is invalid. As ``crc32c(b"") == 0``, this guarantees that a run
of zero bytes (what a filesystem may leave after a crash) never parses as a
record. Sequence numbers start at 1 in a new journal.

Format 2: a frame per commit (a *group*), holding every record appended
since the previous write::

    length    u32       length of the body (all below), 10 <= length <= MAX_GROUP_BYTES
    crc       u32       CRC32C of the 4 length bytes followed by the body
    mark      u8        0xDD
    count     u32       n >= 1, the number of records in the group
    payloads  the n payloads back to back
    sizes     n x u32   each payload's length, 1 <= size <= MAX_RECORD_BYTES

The sizes must add up to ``length - 5 - 4 * n``. The record of a group's
i-th payload (from 0) has sequence number ``first`` + i, where ``first`` is
one past the previous group's last (the header's ``first_seq`` for the
segment's first group). ``mark`` and ``count`` are, byte for byte, a
msgpack array header (array 32) of n items: when each payload is one
msgpack value (the daemon's records are), ``mark`` through ``payloads`` is
one msgpack array, decoded in one call; the journal itself never looks
inside a payload. One CRC covers the group, so a group is intact or
damaged as a whole: a torn group loses all its records, which is safe
because a group is written with one ``write`` and none of its records may
be acted upon before the ``fdatasync`` that follows. A zero length, or a
mark other than 0xDD, is invalid, so a run of zero bytes never parses as
a group either.

Every rule below speaks of *frames*: a record frame in format 1, a group
in format 2. A frame's *count* is 1 in format 1 and n in format 2.

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
  held exactly one record (a lower bound, exact for a single damaged record
  of format 1); ``seqs_exact`` is then False. The next segment's header
  restores exact numbering.
* A segment whose header is damaged (salvage only) is read in the format
  whose frame is found intact right after the header, format 1 if none.

Writer rules
------------

* One writer per directory (``flock``), used from one thread. ``append``
  buffers a record and returns its seq; ``commit`` writes the buffer with one
  ``write`` and, unless the policy is ``never``, one ``fdatasync`` (group
  commit). In format 2 the records buffered between two writes become one
  group (two or more if they would pass ``MAX_GROUP_BYTES``). A record may
  be acted upon once ``durable_seq >= seq``. The journal commits by itself
  only under policy ``always`` (every append) and
  when a segment is full; otherwise when to commit is the caller's choice
  (the daemon's is :class:`GroupCommit`, groupcommit.py).
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

import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

from crc32c import crc32c

from schemas.config import DEFAULT_JOURNAL_FORMAT

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "DEFAULT_WRITE_FORMAT",
    "FORMAT_V1",
    "FORMAT_V2",
    "FORMAT_VERSION",
    "FRAME_OVERHEAD",
    "GROUP_OVERHEAD",
    "HEADER_SIZE",
    "MAX_GROUP_BYTES",
    "MAX_RECORD_BYTES",
    "JournalClosed",
    "JournalCorrupt",
    "JournalError",
    "JournalFatal",
    "JournalLocked",
    "NoJournal",
    "check_payload",
    "segment_name",
    "snapshot_name",
]

# The names below that are neither in __all__ nor private are shared with the
# other journal modules (writer.py, recovery.py, reader.py) and nobody else.

FORMAT_V1 = 1
FORMAT_V2 = 2
# The newest segment format this code reads and writes; snapshots stay format 1.
FORMAT_VERSION = FORMAT_V2
READABLE_VERSIONS = (FORMAT_V1, FORMAT_V2)
SNAPSHOT_VERSION = FORMAT_V1
# The format new segments are written in when Journal.open is not told: the
# one default, shared with the daemon's `journal.format` (schemas/config.py
# says why it is 2).
DEFAULT_WRITE_FORMAT = DEFAULT_JOURNAL_FORMAT
MAX_RECORD_BYTES = 16 * 1024 * 1024
MAX_GROUP_BYTES = 32 * 1024 * 1024
DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024

SEGMENT_MAGIC = b"KVPJ"
SNAPSHOT_MAGIC = b"KVPS"
LOCK_NAME = "journal.lock"

_HEADER = struct.Struct(">4sHQ")
U32 = struct.Struct(">I")
FRAME = struct.Struct(">II")
HEADER_SIZE = _HEADER.size + U32.size
FRAME_OVERHEAD = FRAME.size

# Format 2: a group's mark and count follow its frame header.
GROUP_MARK = 0xDD
GROUP_MARK_BYTE = b"\xdd"
GROUP_HEAD = struct.Struct(">IIBI")  # length, crc, mark, count
GROUP_OVERHEAD = GROUP_HEAD.size  # per group; each record adds 4 bytes (its size)
MARK_COUNT = struct.Struct(">BI")
MIN_GROUP_LENGTH = MARK_COUNT.size + 1 + U32.size  # one 1-byte record

SEGMENT_RE = re.compile(r"seg-(\d{20})\.kvj")
SNAPSHOT_RE = re.compile(r"snap-(\d{20})\.kvs")
TMP_SUFFIX = ".tmp"
FILE_MODE = 0o640

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
SEEDS: dict[int, int] = {}

BytesLike: TypeAlias = bytes | bytearray | memoryview


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


class NoJournal(JournalError):
    """The path holds no journal at all: a wrong path, not damage."""


class JournalClosed(JournalError):
    """The journal was closed."""


# --------------------------------------------------------------------------
# Names and framing


def segment_name(first_seq: int) -> str:
    return f"seg-{first_seq:020d}.kvj"


def snapshot_name(seq: int) -> str:
    return f"snap-{seq:020d}.kvs"


def length_seed(length: int) -> int:
    seed = SEEDS.get(length)
    if seed is None:
        seed = crc32c(U32.pack(length))
        if length < _SEED_CACHE_LIMIT:
            SEEDS[length] = seed
    return seed


def bad_size(length: int) -> ValueError:
    return ValueError(f"payload must be 1..{MAX_RECORD_BYTES} bytes, got {length}")


def check_payload(payload: BytesLike) -> int:
    """The payload's length, or ValueError if no journal would take it."""
    length = len(payload)
    if not 0 < length <= MAX_RECORD_BYTES:
        raise bad_size(length)
    return length


def frame_header(payload: BytesLike) -> bytes:
    length = check_payload(payload)
    return FRAME.pack(length, crc32c(payload, length_seed(length)))


def pack_file_header(magic: bytes, seq: int, version: int = FORMAT_V1) -> bytes:
    head = _HEADER.pack(magic, version, seq)
    return head + U32.pack(crc32c(head))


class Invalid(Exception):
    """Internal: a header or frame failed validation; the message says why."""


def parse_header(data: bytes, magic: bytes) -> tuple[int, int]:
    """(first seq, format version) of a file's header; :class:`Invalid` if it is bad."""
    if len(data) < HEADER_SIZE:
        raise Invalid(f"file is {len(data)} bytes, shorter than its {HEADER_SIZE}-byte header")
    found_magic, version, seq = _HEADER.unpack_from(data)
    (stored,) = U32.unpack_from(data, _HEADER.size)
    if crc32c(data[: _HEADER.size]) != stored:
        raise Invalid("header CRC mismatch")
    if found_magic != magic:
        raise Invalid(f"bad magic {found_magic!r}, expected {magic!r}")
    if version not in READABLE_VERSIONS or (magic == SNAPSHOT_MAGIC and version != 1):
        raise Invalid(f"unsupported format version {version}")
    if seq < 1:
        raise Invalid(f"sequence number {seq} in header is below 1")
    return int(seq), int(version)


def parse_file_header(data: bytes, magic: bytes) -> int:
    return parse_header(data, magic)[0]


# --------------------------------------------------------------------------
# Frame checks, written once for both formats
#
# A frame is checked in two parts. The part both formats share: a length
# within the format's bounds, a frame that ends before end of file, a CRC
# that matches (check_frames, below). The part only format 2 has: the
# group's mark, count and size table (group_records). check_frames is both
# replay's hot walk over intact frames and the "why" of the first bad one
# (frame_problem is the same walk, told to stop after one frame): it stops
# at the first check that fails and says which.

_SIZES: dict[int, struct.Struct] = {}


def sizes_struct(count: int) -> struct.Struct:
    """The struct of a group's table of ``count`` sizes (cached; counts repeat)."""
    found = _SIZES.get(count)
    if found is None:
        found = struct.Struct(f">{count}I")
        if count < 4096:
            _SIZES[count] = found
    return found


def group_sizes(data: bytes, offset: int) -> tuple[int, ...]:
    """The payload sizes of the (valid) group at ``offset``."""
    length, _, _, count = GROUP_HEAD.unpack_from(data, offset)
    return sizes_struct(count).unpack_from(data, offset + FRAME_OVERHEAD + length - 4 * count)


def group_records(data: bytes, body: int, stop: int) -> int:
    """The record count of the group whose CRC-checked body is ``data[body:stop]``.

    Format 2's own checks: the mark, a count that fits the body, a size
    table whose sizes are legal and fill the body. :class:`Invalid` says
    which failed.
    """
    length = stop - body
    mark, count = MARK_COUNT.unpack_from(data, body)
    if mark != GROUP_MARK:
        raise Invalid(f"group mark {mark:#04x}, expected {GROUP_MARK:#04x}")
    if not 0 < count <= (length - MARK_COUNT.size) // 5:
        raise Invalid(f"group count {count} does not fit its {length}-byte body")
    sizes = sizes_struct(count).unpack_from(data, stop - 4 * count)
    held = length - MARK_COUNT.size - 4 * count
    if sum(sizes) != held:
        raise Invalid(f"group sizes add up to {sum(sizes)}, its body holds {held}")
    if min(sizes) < 1 or max(sizes) > MAX_RECORD_BYTES:
        raise Invalid(f"group holds a record size outside 1..{MAX_RECORD_BYTES}")
    return count


@dataclass(frozen=True, slots=True)
class Framing:
    """What a format's frames must be: the rules :func:`check_frames` applies.

    ``noun`` names the frame in reasons; ``minimum`` and ``maximum`` bound
    its length field; ``too_short`` is the reason for a length below
    ``minimum`` (``{length}`` and ``{minimum}`` filled in); ``records``
    checks a CRC-checked body and returns its record count (None: a frame
    is one record, format 1); ``find`` finds the next valid frame.
    """

    version: int
    noun: str
    minimum: int
    maximum: int
    too_short: str
    records: Callable[[bytes, int, int], int] | None
    find: Callable[[bytes, memoryview, int], int | None]


def _cut_short(end: int, offset: int) -> str:
    return f"frame header cut short ({end - offset} bytes before end of file)"


def check_frames(
    framing: Framing, data: bytes, view: memoryview, offset: int, last: int = -1
) -> tuple[int, int, str | None]:
    """Walk the intact frames from ``offset``: ``(stop, records, why)``.

    ``stop``: the offset of the first frame that fails a check (or end of
    file); ``records``: how many records the intact frames before it hold;
    ``why``: what the frame at ``stop`` fails, None if ``stop`` is the end
    of ``data`` or lies past ``last`` (the last offset a frame is checked
    at; -1: no limit).

    The hot loop of replay, hence the local aliases, the cached CRC seeds
    and no allocation but the memoryview slice handed to crc32c; a reason
    is only formatted once a check has failed.
    """
    unpack = FRAME.unpack_from
    seeds = SEEDS
    crc = crc32c
    minimum, maximum, count_records = framing.minimum, framing.maximum, framing.records
    end = len(data)
    limit = end - FRAME_OVERHEAD
    if last < 0 or last > limit:
        last = limit
    records = 0
    while offset <= last:
        length, stored = unpack(data, offset)
        body = offset + FRAME_OVERHEAD
        stop = body + length
        if length < minimum:
            return offset, records, framing.too_short.format(length=length, minimum=minimum)
        if length > maximum:
            return offset, records, f"{framing.noun} length {length} exceeds {maximum}"
        if stop > end:
            noun = framing.noun
            return offset, records, f"{length}-byte {noun} runs {stop - end} bytes past end of file"
        try:
            seed = seeds[length]
        except KeyError:
            seed = length_seed(length)
        computed = crc(view[body:stop], seed)
        if computed != stored:
            noun = framing.noun
            why = f"{noun} CRC mismatch (stored {stored:#010x}, computed {computed:#010x})"
            return offset, records, why
        if count_records is None:
            records += 1
        else:
            try:
                records += count_records(data, body, stop)
            except Invalid as exc:
                return offset, records, str(exc)
        offset = stop
    if offset > limit and offset != end:
        return offset, records, _cut_short(end, offset)
    return offset, records, None


def frame_problem(framing: Framing, data: bytes, view: memoryview, offset: int) -> str | None:
    """Why no valid frame starts at ``offset``, or None if one does."""
    stop, _, why = check_frames(framing, data, view, offset, last=offset)
    if stop != offset:
        return None
    return _cut_short(len(data), offset) if why is None else why  # None: at end of file


def find_next_frame(data: bytes, view: memoryview, start: int) -> int | None:
    """The first offset >= start where a valid format-1 frame begins, or None."""
    end = len(data)
    pos = start
    while pos + FRAME_OVERHEAD < end:
        zeros = data.find(_ZERO_RUN, pos)
        # Inside a zero run no offset can hold a legal length, so the regex
        # may stop there; it sees 3 bytes into the run so that a length field
        # ending in zeros (01 00 00 00) just before it is still found.
        limit = end if zeros < 0 else zeros + 3
        for match in _CANDIDATE.finditer(data, pos, limit):
            if frame_problem(RECORD_FRAMES, data, view, match.start()) is None:
                return match.start()
        if zeros < 0:
            return None
        nonzero = _NONZERO.search(data, zeros)
        if nonzero is None:
            return None
        # A length field may start up to 3 zero bytes before a non-zero byte.
        pos = nonzero.start() - 3
    return None


def find_next_group(data: bytes, view: memoryview, start: int) -> int | None:
    """The first offset >= start where a valid group begins, or None.

    A group's mark byte sits right after its frame header, so only the
    offsets 8 bytes before a 0xDD byte are tried.
    """
    pos = data.find(GROUP_MARK_BYTE, start + FRAME_OVERHEAD)
    while pos >= 0:
        if frame_problem(GROUP_FRAMES, data, view, pos - FRAME_OVERHEAD) is None:
            return pos - FRAME_OVERHEAD
        pos = data.find(GROUP_MARK_BYTE, pos + 1)
    return None


# Format 1: a frame is a record. Format 2: a frame is a group of records.
RECORD_FRAMES = Framing(
    FORMAT_V1, "record", 1, MAX_RECORD_BYTES, "zero record length", None, find_next_frame
)
GROUP_FRAMES = Framing(
    FORMAT_V2,
    "group",
    MIN_GROUP_LENGTH,
    MAX_GROUP_BYTES,
    "group length {length} is below {minimum}",
    group_records,
    find_next_group,
)
FRAMINGS = {FORMAT_V1: RECORD_FRAMES, FORMAT_V2: GROUP_FRAMES}


def list_files(directory: Path, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
    found = []
    for entry in os.scandir(directory):
        match = pattern.fullmatch(entry.name)
        if match is not None:
            found.append((int(match.group(1)), Path(entry.path)))
    found.sort()
    return found
