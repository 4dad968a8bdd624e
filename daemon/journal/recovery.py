"""Taking over a journal directory: what :meth:`Journal.open` does before writing.

Lock the directory against a second writer, then make what an earlier
process left safe to leave behind: stale temporary files removed, the last
segment synced with its torn tail cut off, or removed if it holds no intact
record (the writer rules of format.py). Reading and validating is
:func:`read_journal`'s job; this module only acts on what it found.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

from daemon.journal.format import (
    FILE_MODE,
    HEADER_SIZE,
    LOCK_NAME,
    TMP_SUFFIX,
    JournalFatal,
    JournalLocked,
)
from daemon.journal.reader import JournalContents


def lock_directory(directory: Path) -> int:
    """Create ``directory`` if missing and ``flock`` it; return the lock's descriptor."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, FILE_MODE)
    except OSError as exc:
        raise JournalFatal(f"cannot open journal directory {directory}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise JournalLocked(f"{directory} is in use by another journal writer") from exc
    return fd


def recover_tail(
    directory: Path, contents: JournalContents, fdatasync: Callable[[int], None]
) -> None:
    """Make the last segment safe to leave behind: synced with any torn tail cut off.

    A last segment left without an intact record is removed instead: the new
    segment may need its name.
    """
    try:
        for name in os.listdir(directory):
            if name.endswith(TMP_SUFFIX):
                (directory / name).unlink()
        if not contents.segments:
            return
        last = contents.segments[-1]
        cut = None if contents.torn_at is None else contents.torn_at[1]
        if (last.stat().st_size if cut is None else cut) <= HEADER_SIZE:
            last.unlink()
        else:
            _truncate_and_sync(last, cut, fdatasync)
    except OSError as exc:
        raise JournalFatal(f"recovering {directory}: {exc}") from exc


def _truncate_and_sync(path: Path, cut: int | None, fdatasync: Callable[[int], None]) -> None:
    # The previous writer may have run with policy NEVER, and this segment is
    # about to become a sealed one: it must be durable before a newer exists.
    fd = os.open(path, os.O_WRONLY)
    try:
        if cut is not None:
            os.ftruncate(fd, cut)
        fdatasync(fd)
    finally:
        os.close(fd)
