"""Per-peer windows onto an engine's shared memory, and their revocation (fencing).

A peer writes into this node by naming addresses in this process. Dropping a
dead peer's NIXL agent here does not stop it: over UCX's cma transport the
copy is a ``process_vm_writev`` that the *pusher* runs against this process,
and nothing on this side is consulted. A pusher frozen between deciding to
write and posting (GC pause, SIGSTOP, a stalled VM) could thaw after it was
declared dead and its destination blocks were handed to another request, and
overwrite them.

So each peer gets its own mapping of every engine region (a *window*): the
same pages as the engine's, at addresses only that peer was told. Fencing a
peer revokes its windows: one ``mmap(MAP_FIXED)`` replaces each window, in
one step, with an inaccessible anonymous reservation. A write posted later
with the old descriptors faults (EFAULT) on the pusher's side, and the
reservation keeps the kernel from placing anything else at those addresses
while the peer may still hold them. Other peers' windows are untouched, so
their transfers go on.

One residue, inherent to ``process_vm_writev``: a copy the kernel had already
started (pages pinned) when the revocation ran completes; it was posted
before the fence and takes microseconds, far less than the journal commit
that must happen before the blocks are handed back.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Final

from daemon.dataplane.memory import MappedRegion, RegionError
from schemas.kvlayout import MemoryKind

# Linux values (the same on x86_64 and aarch64); the mmap module does not
# export them.
_PROT_NONE: Final = 0
_MAP_FIXED: Final = 0x10
_MAP_NORESERVE: Final = 0x4000
_MAP_FAILED: Final = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


def _mmap(addr: int | None, size: int, prot: int, flags: int, fd: int) -> int:
    result = _libc.mmap(addr, size, prot, flags, fd, 0)
    if result is None or result == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(result)


class Window:
    """One peer's mapping of one region: ``base`` is what that peer writes to.

    States: open (shared with the engine's pages), revoked (an inaccessible
    reservation, still holding the addresses), closed (unmapped).
    """

    memory: Final = MemoryKind.DRAM
    device: Final = 0

    def __init__(self, region: MappedRegion) -> None:
        self.name = region.name
        self.size = region.size
        try:
            self.base = _mmap(
                None,
                region.size,
                mmap.PROT_READ | mmap.PROT_WRITE,
                mmap.MAP_SHARED,
                region.fileno(),
            )
        except OSError as exc:
            raise RegionError(f"region {region.name!r}: cannot map a peer window: {exc}") from None
        self.state = "open"

    @property
    def closed(self) -> bool:
        return self.state != "open"

    def revoke(self) -> None:
        """Make every later access to the window fault; the addresses stay reserved."""
        if self.state != "open":
            return
        _mmap(
            self.base,
            self.size,
            _PROT_NONE,
            mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE,
            -1,
        )
        self.state = "revoked"

    def close(self) -> None:
        """Unmap the window (or its reservation); only once no peer can still use the addresses."""
        if self.state == "closed":
            return
        if _libc.munmap(self.base, self.size) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.state = "closed"

    def __repr__(self) -> str:
        return f"Window({self.name!r}, base=0x{self.base:x}, size={self.size}, {self.state})"
