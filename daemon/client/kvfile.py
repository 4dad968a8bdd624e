"""The /dev/shm file an engine's KV cache lives in, shared with its daemon.

Two operator traps, closed here:

- A sparse file (``ftruncate``) in a /dev/shm smaller than the cache (a
  container's 64 MB default) starts fine and dies of SIGBUS mid-serving,
  when a page is first touched. :func:`create_kv_file` allocates every page
  up front (``posix_fallocate``): too small a /dev/shm is one clear error
  at start.
- A file left by an engine that died is removed by the next one that
  starts; judging "died" by the pid in its name removes another
  container's live KV when containers share an IPC namespace but not a PID
  namespace. The owner holds an exclusive ``flock`` on its file for its
  whole life instead; the lock is the file's, whoever looks, so
  :func:`sweep_stale_kv_files` removes only files nobody holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path


class KvFileError(RuntimeError):
    """The KV cache file could not be made; the message says what to change."""


def create_kv_file(path: Path, size: int) -> int:
    """Create ``path`` with ``size`` bytes allocated and locked; the descriptor holding the lock.

    The caller keeps the descriptor open for as long as the file is in use
    (closing it, or exiting, releases the lock). The file is made under a
    temporary name, locked, allocated, and only then renamed into place, so a
    sweeper never sees it unlocked.
    """
    temporary = path.with_name(f".{path.name}.new")
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            os.posix_fallocate(fd, 0, size)  # new pages read as zeros
        except OSError as exc:
            raise KvFileError(
                f"cannot allocate the KV cache file {path} ({size} bytes) in {path.parent}: "
                f"{exc.strerror}; {_free_bytes(path.parent)} bytes are free there. Give "
                f"{path.parent} more room (a container's --shm-size) or make the KV cache "
                f"smaller (--kv-cache-memory-bytes)"
            ) from exc
        os.rename(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        os.close(fd)
        raise
    return fd


def sweep_stale_kv_files(directory: Path, prefix: str) -> list[Path]:
    """Remove this user's KV files under ``directory`` that no live owner holds; those removed."""
    removed = []
    for path in directory.glob(f"{prefix}*"):
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:  # gone already, or not ours to open
            continue
        try:
            if os.fstat(fd).st_uid != os.getuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner lives, in whatever PID namespace
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
        finally:
            os.close(fd)
    return removed


def _free_bytes(directory: Path) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize
