"""Writing a journal: :class:`Journal`, the one writer of a journal directory.

Appending (framing inlined on the hot path), committing (one ``write`` and,
per the fsync policy, one ``fdatasync``; also split in phases so the sync can
run off the event loop), segment rotation, snapshots, pruning, and failure
handling: any I/O error is fatal. The rules it keeps are the writer rules of
format.py; recovery.py takes the directory over before it writes.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from types import TracebackType
from typing import NoReturn, Self, TypeAlias

from crc32c import crc32c

from daemon import failpoints
from daemon.journal.format import (
    DEFAULT_SEGMENT_BYTES,
    DEFAULT_WRITE_FORMAT,
    FILE_MODE,
    FORMAT_V1,
    FORMAT_V2,
    FRAME,
    FRAME_OVERHEAD,
    GROUP_MARK,
    GROUP_OVERHEAD,
    HEADER_SIZE,
    MARK_COUNT,
    MAX_GROUP_BYTES,
    MAX_RECORD_BYTES,
    SEEDS,
    SEGMENT_MAGIC,
    SEGMENT_RE,
    SNAPSHOT_MAGIC,
    SNAPSHOT_RE,
    TMP_SUFFIX,
    BytesLike,
    JournalClosed,
    JournalError,
    JournalFatal,
    bad_size,
    frame_header,
    length_seed,
    list_files,
    pack_file_header,
    segment_name,
    sizes_struct,
    snapshot_name,
)
from daemon.journal.reader import JournalContents, read_journal
from daemon.journal.recovery import lock_directory, recover_tail
from schemas.config import FsyncPolicy

# FsyncPolicy (schemas.config) is the type of Journal.open's ``fsync``: part of this API.
__all__ = ["FsyncPolicy", "Journal", "SyncFn", "WriteFn"]

WriteFn: TypeAlias = Callable[[int, BytesLike], int]
SyncFn: TypeAlias = Callable[[int], None]


def _fsync_directory(directory: Path, fsync: SyncFn) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def _write_all(write: WriteFn, fd: int, data: BytesLike) -> None:
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
    ``ALWAYS`` every append commits. With ``BATCH`` and ``NEVER`` the buffer
    is written by ``commit()`` (or by the split-phase ``write_pending``,
    ``sync_fd``, ``mark_durable``), which ``append`` calls by itself only when
    the segment is full. The journal has no timer and no commit window: when
    to commit is its caller's choice (the daemon's is :class:`GroupCommit`).
    """

    __slots__ = (
        "_buf",
        "_closed",
        "_directory",
        "_durable_seq",
        "_failure",
        "_fd",
        "_format",
        "_groups",
        "_lock_fd",
        "_next_seq",
        "_policy",
        "_recovered",
        "_segment_bytes",
        "_segment_path",
        "_segment_size",
        "_sizes",
        "_snapshot_seq",
        "_sync_each",
        "_sys",
        "_unsynced",
    )

    def __init__(
        self,
        directory: Path,
        *,
        lock_fd: int,
        policy: FsyncPolicy,
        segment_bytes: int,
        syscalls: _Syscalls,
        recovered: JournalContents,
        format: int = FORMAT_V1,
    ) -> None:
        """Internal: use :meth:`Journal.open`, which recovers the directory first."""
        # Format 2: _buf holds the open group (its 13-byte head reserved and
        # filled in when it is written), _sizes its payload sizes, _groups the
        # groups closed because they reached MAX_GROUP_BYTES, not yet written.
        self._format = format
        self._sizes: list[int] = []
        self._groups: list[bytearray] = []
        self._directory = directory
        self._lock_fd = lock_fd
        self._policy = policy
        self._sync_each = policy is FsyncPolicy.ALWAYS
        self._segment_bytes = segment_bytes
        self._sys = syscalls
        self._recovered: JournalContents | None = recovered
        self._snapshot_seq = 0 if recovered.snapshot is None else recovered.snapshot.seq
        self._next_seq = recovered.last_seq + 1
        self._durable_seq = recovered.last_seq
        self._buf = self._new_buffer()
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
        write: WriteFn = os.write,
        fdatasync: SyncFn = os.fdatasync,
        fsync_dir: SyncFn = os.fsync,
        format: int | None = None,
    ) -> Journal:
        """Lock ``directory`` (created if missing), recover it and start a new segment.

        ``format``: the on-disk format of the segments this journal creates,
        1 (a frame per record) or 2 (a frame per commit); None:
        ``DEFAULT_WRITE_FORMAT``, which is the daemon's ``journal.format``
        default too (``schemas.config.DEFAULT_JOURNAL_FORMAT``). A
        directory's older segments are read whatever their format.

        Raises :class:`JournalLocked` if another Journal holds it,
        :class:`JournalCorrupt` if it holds anything but a torn tail, and
        :class:`JournalFatal` on an I/O error. What recovery read is kept in
        :meth:`take_recovered` so the caller can replay it without a second scan.
        """
        if segment_bytes <= HEADER_SIZE:
            raise ValueError(f"segment_bytes must exceed the {HEADER_SIZE}-byte header")
        if format is None:
            format = DEFAULT_WRITE_FORMAT
        if format not in (FORMAT_V1, FORMAT_V2):
            raise ValueError(f"format must be {FORMAT_V1} or {FORMAT_V2}, got {format}")
        policy = FsyncPolicy(fsync)
        root = Path(directory)
        syscalls = _Syscalls(write=write, fdatasync=fdatasync, fsync=fsync_dir)
        lock_fd = lock_directory(root)
        try:
            recovered = read_journal(root)
            recover_tail(root, recovered, fdatasync)
            journal = cls(
                root,
                lock_fd=lock_fd,
                policy=policy,
                segment_bytes=segment_bytes,
                syscalls=syscalls,
                recovered=recovered,
                format=format,
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
    def format(self) -> int:
        """The format of the segments this journal writes (1 or 2)."""
        return self._format

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
        # with frame_header, as each Python call costs ~10% of an append.
        failpoints.hit("journal.append")
        if self._failure is not None or self._closed:
            self._check_usable()
        length = len(payload)
        if not 0 < length <= MAX_RECORD_BYTES:
            raise bad_size(length)
        buf = self._buf
        sizes = self._sizes
        if self._format == FORMAT_V1:
            try:
                seed = SEEDS[length]
            except KeyError:
                seed = length_seed(length)
            buf += FRAME.pack(length, crc32c(payload, seed))
            buf += payload
            pending = len(buf)
        else:
            # Format 2: the payload joins the open group; framing and the one
            # CRC wait for the write (_close_group).
            pending = len(buf) + 4 * len(sizes) + length + 4
            if pending - FRAME_OVERHEAD > MAX_GROUP_BYTES:
                self._close_group()
                buf, sizes = self._buf, self._sizes
                pending = len(buf) + length + 4
            buf += payload
            sizes.append(length)
            if self._groups:
                pending += sum(map(len, self._groups))
        seq = self._next_seq
        self._next_seq = seq + 1
        if self._sync_each or self._segment_size + pending >= self._segment_bytes:
            self.commit()
        return seq

    def _new_buffer(self) -> bytearray:
        # Format 2 reserves the group's head (length, crc, mark, count).
        return bytearray(GROUP_OVERHEAD if self._format == FORMAT_V2 else 0)

    def _close_group(self) -> None:
        """Frame the open group (format 2): sizes, mark and count, length, one CRC."""
        sizes, self._sizes = self._sizes, []
        buf, self._buf = self._buf, self._new_buffer()
        if not sizes:
            return
        count = len(sizes)
        buf += sizes_struct(count).pack(*sizes)
        length = len(buf) - FRAME_OVERHEAD
        MARK_COUNT.pack_into(buf, FRAME_OVERHEAD, GROUP_MARK, count)
        crc = crc32c(memoryview(buf)[FRAME_OVERHEAD:], length_seed(length))
        FRAME.pack_into(buf, 0, length, crc)
        self._groups.append(buf)

    def _has_buffered(self) -> bool:
        return bool(self._sizes or self._groups) if self._format == FORMAT_V2 else bool(self._buf)

    def commit(self) -> int:
        """Write the buffered records in one write and sync per policy; return durable_seq."""
        self._check_usable()
        if self._has_buffered():
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
        if self._has_buffered():
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
        if self._format == FORMAT_V2:
            self._close_group()
            groups, self._groups = self._groups, []
            buf = groups[0] if len(groups) == 1 else bytearray().join(groups)
        else:
            buf, self._buf = self._buf, bytearray()
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
            header = pack_file_header(SEGMENT_MAGIC, first_seq, self._format)
            self._fd = _create_durably(path, header, self._sys)
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
        data = pack_file_header(SNAPSHOT_MAGIC, seq) + frame_header(payload) + payload
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
            for seq, path in list_files(self._directory, SNAPSHOT_RE)
            if seq < self._snapshot_seq
        ]
        if doomed:
            with self._fatal_on_oserror(f"pruning {self._directory}"):
                for path in doomed:
                    path.unlink()
                _fsync_directory(self._directory, self._sys.fsync)
        return doomed

    def _prunable_segments(self, retain_segments: int) -> list[Path]:
        segments = list_files(self._directory, SEGMENT_RE)
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

    def _fatal_on_oserror(self, what: str) -> _FatalOnOSError:
        return _FatalOnOSError(self, what)

    def _fail(self, what: str, exc: OSError) -> NoReturn:
        self._failure = JournalFatal(f"{what}: {exc}")
        self._buf = self._new_buffer()
        self._sizes, self._groups = [], []
        raise self._failure from exc


class _FatalOnOSError:
    """``with``: an OSError raised inside fails the journal (JournalFatal), naming ``what``.

    A class, not a generator: it guards every group commit's write, and a
    generator-based context manager costs a generator and its resumptions.
    """

    __slots__ = ("_journal", "_what")

    def __init__(self, journal: Journal, what: str) -> None:
        self._journal, self._what = journal, what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if isinstance(exc, OSError):
            self._journal._fail(self._what, exc)


def _create_durably(path: Path, header: bytes, syscalls: _Syscalls) -> int:
    """Create ``path`` holding ``header`` so that it never exists half-written.

    Written and synced under a temporary name, renamed into place, directory
    synced. Returns the open descriptor, positioned at the end of the file.
    """
    tmp = path.with_name(path.name + TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        _write_all(syscalls.write, fd, header)
        syscalls.fdatasync(fd)
        os.rename(tmp, path)
        _fsync_directory(path.parent, syscalls.fsync)
    except BaseException:
        os.close(fd)
        raise
    return fd
