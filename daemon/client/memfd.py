"""KV memory an engine shares by descriptor: a sealed memfd, no file name anywhere.

Compared with a /dev/shm file (daemon/client/kvfile.py), a memfd has no
name to collide with, nothing to sweep after a crash (the memory goes when
its last holder closes it: the engine, and the daemon once it forgets the
engine) and no dependence on /dev/shm's mount size (a container's 64 MiB).
The engine passes it to its daemon with the Hello (``EngineClient.connect``'s
``descriptors``), again on every new connection.

Sealed against shrinking and growing: the daemon maps the memory and hands
its addresses to NIXL, and pages cut from under a mapping kill the process
that touches them (SIGBUS). The daemon refuses a memfd without the seal.
"""

from __future__ import annotations

import fcntl
import os

from daemon.client.kvfile import KvFileError

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def create_kv_memfd(name: str, size: int) -> int:
    """A memfd of ``size`` bytes, every page allocated, its size sealed; the caller owns it.

    Allocating up front makes too little memory one clear error now, not
    a process killed when a page is first touched mid-serving.
    """
    if size <= 0:
        raise KvFileError(f"KV memory must have a positive size, not {size}")
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)  # new pages read as zeros
        except OSError as exc:
            raise KvFileError(
                f"cannot allocate {size} bytes of KV memory ({name}): {exc.strerror}. "
                "Free memory or make the KV cache smaller (--kv-cache-memory-bytes)"
            ) from exc
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd
