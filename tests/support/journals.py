"""Journal records in and out, for tests that plant damage or rewrite history."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from daemon.journal.format import (
    FRAME,
    FRAME_OVERHEAD,
    HEADER_SIZE,
    SEGMENT_MAGIC,
    SEGMENT_RE,
    list_files,
    parse_file_header,
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


def lose_from(directory: Path, first_lost: Callable[[Record], bool]) -> int:
    """Cut the journal back to just before the first record ``first_lost`` picks.

    What a power cut does to records written but not yet fdatasynced: they
    vanish from the end of the last segment. Returns the bytes cut off (0
    when no record in the last segment matches: none was written yet).
    """
    segments = list_files(directory, SEGMENT_RE)
    path = segments[-1][1]
    data = path.read_bytes()
    parse_file_header(data, SEGMENT_MAGIC)
    offset = HEADER_SIZE
    while offset < len(data):
        length, _crc = FRAME.unpack_from(data, offset)
        body = offset + FRAME_OVERHEAD
        if first_lost(decode_record(data[body : body + length])):
            with path.open("r+b") as f:
                f.truncate(offset)
            return len(data) - offset
        offset = body + length
    return 0
