"""Who owns the engine socket's path: one daemon per path, and only its owner removes it.

A lock file beside the socket (``NAME.sock.lock``, ``flock``-ed for the
daemon's life, with its pid inside) says who owns the path, as the journal's
lock does for its directory. A second daemon given the same path finds the
lock held and refuses to start, so the first stays reachable. Holding the
lock, whatever socket sits at the path is a leftover of a daemon that died
(its lock died with it) and is replaced; anything that is not a socket is
never removed. On the way out a daemon removes the path only if it still
names the socket this daemon bound.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
from pathlib import Path

from daemon.startup import StartupError

LOCK_SUFFIX = ".lock"
# Engines connect in bursts when a serving instance starts; the kernel queues them here.
BACKLOG = 512


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + LOCK_SUFFIX)


def _holder(fd: int) -> str:
    """The pid the owner wrote into the lock file, as a phrase ("" if unreadable)."""
    with contextlib.suppress(OSError, ValueError):
        pid = int(os.pread(fd, 32, 0).decode().strip())
        return f" (pid {pid})"
    return ""


def _lock(path: Path) -> int:
    where = lock_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # 0600: an engine able to open the lock could flock it and keep the daemon out.
        fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StartupError(
            f"engine socket {path}: cannot create {where}: {exc.strerror}; "
            f"make {path.parent} writable for the daemon's user, or set socket to another path"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise StartupError(
            f"engine socket {path} belongs to a running kvpushd{holder} ({where} is locked); "
            f"stop that daemon, or give this one another socket (--socket or socket =)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _serving(path: Path) -> bool:
    """Whether something accepts connections on the socket at ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        # Non-blocking: a live daemon with a full backlog answers EAGAIN, not a hang.
        probe.setblocking(False)
        try:
            probe.connect(str(path))
        except BlockingIOError:
            return True
        except OSError:
            return False
        return True


def _clear(path: Path) -> None:
    """Remove a dead daemon's socket at ``path``; refuse anything else there."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StartupError(
            f"engine socket {path}: something that is not a socket is there; "
            f"remove it, or set socket to another path"
        )
    if _serving(path):
        # A process that holds no kvpushd lock (another program, an older kvpushd).
        raise StartupError(
            f"engine socket {path}: another process serves on it; stop it, "
            f"or set socket to another path"
        )
    path.unlink(missing_ok=True)


class SocketClaim:
    """The lock on a socket path and the listening socket bound there."""

    def __init__(self, path: Path, lock_fd: int, sock: socket.socket) -> None:
        self.path = path
        self.sock = sock
        self._lock_fd: int | None = lock_fd
        st = os.lstat(path)
        self._identity = (st.st_dev, st.st_ino)

    @classmethod
    def take(cls, path: Path) -> SocketClaim:
        """Lock ``path``, clear a dead daemon's socket, bind and listen (mode 0660)."""
        fd = _lock(path)
        try:
            _clear(path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(str(path))
                # Who may connect is the group's business (and SO_PEERCRED's).
                os.chmod(path, 0o660)
                sock.listen(BACKLOG)
                return cls(path, fd, sock)
            except BaseException:
                sock.close()
                raise
        except OSError as exc:
            os.close(fd)
            raise StartupError(
                f"engine socket {path}: cannot bind: {exc.strerror or exc}; "
                f"make {path.parent} writable for the daemon's user, or set socket to another path"
            ) from exc
        except BaseException:
            os.close(fd)
            raise

    def release(self) -> None:
        """Remove the socket if the path is still ours, then let the lock go."""
        if self._lock_fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._identity:
                self.path.unlink()
        os.close(self._lock_fd)
        self._lock_fd = None
