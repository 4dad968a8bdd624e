"""Journal records in and out, for tests that plant damage or rewrite history."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from daemon.journal.format import (
    FORMAT_V1,
    FRAME,
    FRAME_OVERHEAD,
    GROUP_OVERHEAD,
    HEADER_SIZE,
    SEGMENT_MAGIC,
    SEGMENT_RE,
    group_sizes,
    list_files,
    parse_header,
)
from daemon.journal.replay import iter_records
from daemon.journal.writer import FsyncPolicy, Journal
from schemas.events import Record, decode_record, encode_record


def read_records(path: Path) -> list[Record]:
    """Every record of the journal at ``path``, in order."""
    _, records = iter_records(path)
    return list(records)


def write_records(path: Path, records: list[Record], segment_bytes: int = 64 * 1024 * 1024) -> Path:
    """Rewrite records through the journal writer, envelopes (seq, ts) as they are."""
    with Journal.open(path, fsync=FsyncPolicy.NEVER, segment_bytes=segment_bytes) as journal:
        for record in records:
            journal.append(encode_record(record))
    return path


def frames(segment: Path) -> list[tuple[int, int, list[Record]]]:
    """(offset, length, records) of every frame of an intact segment file.

    A format-1 frame holds one record; a format-2 frame (a group) every
    record of one commit, which a torn write loses together.
    """
    data = segment.read_bytes()
    _, version = parse_header(data, SEGMENT_MAGIC)
    offset, found = HEADER_SIZE, []
    while offset < len(data):
        length, _crc = FRAME.unpack_from(data, offset)
        body = offset + FRAME_OVERHEAD
        if version == FORMAT_V1:
            records = [decode_record(data[body : body + length])]
        else:
            records, start = [], offset + GROUP_OVERHEAD
            for size in group_sizes(data, offset):
                records.append(decode_record(data[start : start + size]))
                start += size
        found.append((offset, length, records))
        offset = body + length
    return found


def lose_from(directory: Path, first_lost: Callable[[Record], bool]) -> int:
    """Cut the journal back to just before the first record ``first_lost`` picks.

    What a power cut does to records written but not yet fdatasynced: they
    vanish from the end of the last segment (in format 2, with the rest of
    their commit: a group is written, and lost, whole). Returns the bytes
    cut off (0 when no record in the last segment matches: none was
    written yet).
    """
    segments = list_files(directory, SEGMENT_RE)
    path = segments[-1][1]
    size = path.stat().st_size
    for offset, _length, records in frames(path):
        if any(first_lost(record) for record in records):
            with path.open("r+b") as f:
                f.truncate(offset)
            return size - offset
    return 0
