"""Journal records in and out, for tests that plant damage or rewrite history."""

from __future__ import annotations

from pathlib import Path

from daemon.journal.replay import iter_records
from daemon.journal.writer import FsyncPolicy, Journal
from schemas.events import Record, encode_record


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
