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
one step, with a *sink*: private anonymous memory at the same addresses,
shared with nobody. A write posted later with the old descriptors lands in
the sink, never in the engine's pages, and the sink keeps the kernel from
placing anything else at those addresses while the peer may still hold
them. Other peers' windows are untouched, so their transfers go on.

Why a writable sink and not an inaccessible reservation: who copies the
bytes depends on the transport. Over cma the pusher's kernel copies
(``process_vm_writev``), and an inaccessible page would fail its write.
Over TCP (two hosts) the *receiver's* UCX copies what arrives on its socket
into the address the pusher named, trusting it; a partition that heals
after the fence delivers a write the pusher's kernel still had buffered,
and an inaccessible page there was a segmentation fault of this daemon
(measured: tests/test_hosts.py). Over RDMA the NIC writes, and the memory
deregistration that follows the revocation refuses it. A sink is safe for
all three: late bytes reach nobody's KV. The pusher may see such a write
succeed; it was fenced, so the receiver ended the request already and
ignores whatever the pusher says of it.

A sink's pages cost memory only where a late write touched them, until the
peer comes back as a new process (``drop_revoked``).

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

    States: open (shared with the engine's pages), revoked (a private sink at
    the same addresses, shared with nobody), closed (unmapped).
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
        """Swap the engine's pages for a private sink: later writes reach nobody's KV."""
        if self.state != "open":
            return
        _mmap(
            self.base,
            self.size,
            mmap.PROT_READ | mmap.PROT_WRITE,
            mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE,
            -1,
        )
        self.state = "revoked"

    def close(self) -> None:
        """Unmap the window (or its sink); only once no peer can still use the addresses."""
        if self.state == "closed":
            return
        if _libc.munmap(self.base, self.size) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.state = "closed"

    def __repr__(self) -> str:
        return f"Window({self.name!r}, base=0x{self.base:x}, size={self.size}, {self.state})"
