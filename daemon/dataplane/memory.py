"""Engine KV memory as the daemon sees it: mapped shared-memory regions, offload slots.

An engine hands its DRAM KV cache to the daemon either as a descriptor (a
memfd passed over the engine socket, :func:`map_dram_descriptor`) or as a
POSIX shared-memory file under /dev/shm (:func:`map_dram_region`). The daemon
maps it read-write and shared, so the addresses it registers with NIXL are
its own mapping of the engine's pages: bytes a peer writes there are seen by
the engine, and nothing is copied.

Both come from an engine, so they are untrusted. A path must resolve to a
regular file under /dev/shm (no symlink escapes); a descriptor must be a
memfd sealed against shrinking, because memory that shrinks under the
daemon's mapping kills it with SIGBUS on the next touch. Either must be
owned by the engine's uid when that is known, and exactly as large as the
engine says.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Final

import numpy as np

from schemas.kvlayout import MemoryKind, RegionSpec

SHM_ROOT: Final = "/dev/shm"


class RegionError(Exception):
    """A region or offload request was refused; ``code`` is stable for callers and replies."""

    def __init__(self, message: str, *, code: str = "bad_region") -> None:
        super().__init__(message)
        self.code = code


def _shm_root() -> str:
    # /dev/shm is itself a symlink on some distributions (-> /run/shm): compare
    # resolved paths on both sides.
    return os.path.realpath(SHM_ROOT)


def resolve_shm_path(path: str) -> str:
    """The real path of ``path`` if it lies (directly or indirectly) under /dev/shm.

    Refuses empty paths, relative paths and anything whose real path leaves
    /dev/shm, which covers symlinks pointing elsewhere and ``..`` tricks.
    """
    if not path:
        raise RegionError("DRAM region has no path")
    if not os.path.isabs(path):
        raise RegionError(f"region path {path!r} is not absolute")
    real = os.path.realpath(path)
    root = _shm_root()
    if real == root or os.path.commonpath([real, root]) != root:
        raise RegionError(f"region path {path!r} resolves to {real!r}, which is not under {root}")
    return real


class MappedRegion:
    """One engine region mapped read-write and shared into this process.

    ``base`` is the address of byte 0 in this process; it stays valid until
    :meth:`close`. Callers must deregister the region from NIXL (and fence any
    write that could still land in it) before closing: after the unmap, a
    remote write to a stale registration could hit whatever is mapped there
    next.
    """

    def __init__(self, name: str, mapping: mmap.mmap, path: str, fd: int) -> None:
        self.name = name
        self.path = path  # the file, or "memfd:NAME" for memory passed by descriptor
        # Which memory this is, whatever name or descriptor number it came by:
        # an engine that registers again must bring this same memory.
        self.identity = _identity(os.fstat(fd))
        self.size = len(mapping)
        self.memory = MemoryKind.DRAM
        self.device = 0
        self._mmap: mmap.mmap | None = mapping
        # numpy over the mmap gives a stable, inspectable base address; the
        # mapping never moves, so ``base`` is fixed for the region's life.
        self._array: np.ndarray | None = np.frombuffer(mapping, dtype=np.uint8)
        self.base: int = int(self._array.ctypes.data)
        # Kept open so more mappings of the same pages can be made later
        # (daemon/dataplane/window.py: one per peer, re-made after a fence).
        self._fd: int | None = fd

    @property
    def closed(self) -> bool:
        return self._array is None

    def fileno(self) -> int:
        """The region file, open read-write, for further mappings of its pages."""
        if self._fd is None:
            raise RegionError(f"region {self.name!r} is closed")
        return self._fd

    def view(self) -> np.ndarray:
        """A writable uint8 array over the whole region."""
        if self._array is None:
            raise RegionError(f"region {self.name!r} is closed")
        return self._array

    def close(self) -> None:
        """Drop this object's hold on the mapping; idempotent.

        If views handed out by :meth:`view` are still alive, the unmap is left
        to the garbage collector (mmap refuses to close under live exports),
        which is memory-safe: Python code can never touch an unmapped page.
        """
        if self._mmap is None:
            return
        mapping, self._mmap, self._array = self._mmap, None, None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        # BufferError: a view is still exported; the last one to go unmaps.
        with contextlib.suppress(BufferError):
            mapping.close()

    def __enter__(self) -> MappedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"base=0x{self.base:x}"
        return f"MappedRegion({self.name!r}, size={self.size}, {state})"


def _open_checked(real: str, spec: RegionSpec, owner_uid: int | None) -> int:
    # O_NOFOLLOW: the last component cannot be swapped for a symlink between
    # realpath() and open(); the fstat below checks the file actually opened.
    try:
        fd = os.open(real, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RegionError(f"region {spec.name!r}: {spec.path!r} does not exist") from None
    except OSError as exc:
        raise RegionError(f"region {spec.name!r}: cannot open {spec.path!r}: {exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RegionError(f"region {spec.name!r}: {spec.path!r} is not a regular file")
        _check_owner_and_size(st, spec, repr(spec.path), owner_uid)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_owner_and_size(
    st: os.stat_result, spec: RegionSpec, what: str, owner_uid: int | None
) -> None:
    if owner_uid is not None and st.st_uid != owner_uid:
        raise RegionError(
            f"region {spec.name!r}: {what} is owned by uid {st.st_uid},"
            f" not by the engine's uid {owner_uid}"
        )
    if st.st_size != spec.size:
        raise RegionError(
            f"region {spec.name!r}: {what} is {st.st_size} bytes, the engine declared {spec.size}"
        )


def _check_dram(spec: RegionSpec) -> None:
    if spec.memory is not MemoryKind.DRAM:
        raise RegionError(f"region {spec.name!r} is {spec.memory.value}, not DRAM")
    if spec.size <= 0:
        raise RegionError(f"region {spec.name!r} has size {spec.size}; it must be positive")


def map_dram_region(spec: RegionSpec, *, owner_uid: int | None) -> MappedRegion:
    """Validate and map an engine's shared-memory region read-write, shared."""
    _check_dram(spec)
    real = resolve_shm_path(spec.path)
    return _mapped(spec, _open_checked(real, spec, owner_uid), repr(spec.path), real)


def _mapped(spec: RegionSpec, fd: int, what: str, path: str) -> MappedRegion:
    """``fd``'s memory mapped read-write and shared; the region owns ``fd`` from here."""
    try:
        mapping = mmap.mmap(fd, spec.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        os.close(fd)
        raise RegionError(f"region {spec.name!r}: cannot map {what}: {exc}") from None
    return MappedRegion(spec.name, mapping, path, fd)


# Seals a region passed by descriptor must carry: a memfd that can shrink
# could be cut under the daemon's mapping.
_REQUIRED_SEALS: Final = fcntl.F_SEAL_SHRINK


def _identity(st: os.stat_result) -> tuple[int, int]:
    """(device, inode): equal for the same memfd or file, whatever it was reached by."""
    return st.st_dev, st.st_ino


def descriptor_of(spec: RegionSpec, descriptors: Sequence[int]) -> int:
    """The descriptor ``spec`` names among those its connection carried."""
    if not 0 <= spec.descriptor < len(descriptors):
        carried = len(descriptors)
        raise RegionError(
            f"region {spec.name!r} names descriptor {spec.descriptor}; the connection's Hello"
            f" carried {carried} descriptor{'s' if carried != 1 else ''}"
        )
    return descriptors[spec.descriptor]


def map_dram_descriptor(
    spec: RegionSpec, descriptors: Sequence[int], *, owner_uid: int | None
) -> MappedRegion:
    """Validate and map a region an engine passed as a memfd (SCM_RIGHTS), read-write, shared.

    The region gets its own duplicate of the descriptor: the connection's
    copies close with the connection, the memory stays mapped until the
    engine is forgotten.
    """
    _check_dram(spec)
    if spec.path:
        raise RegionError(f"region {spec.name!r} names both a descriptor and a path")
    passed = descriptor_of(spec, descriptors)
    name = _memfd_name(passed)
    try:
        seals = fcntl.fcntl(passed, fcntl.F_GET_SEALS)
    except OSError:
        raise RegionError(
            f"region {spec.name!r}: descriptor {spec.descriptor} is not a memfd"
            " (memfd_create with MFD_ALLOW_SEALING)"
        ) from None
    if seals & _REQUIRED_SEALS != _REQUIRED_SEALS:
        raise RegionError(
            f"region {spec.name!r}: memfd {name!r} is not sealed against shrinking"
            " (F_SEAL_SHRINK): memory cut under the daemon's mapping would kill it"
        )
    _check_owner_and_size(os.fstat(passed), spec, f"memfd {name!r}", owner_uid)
    # A duplicate (non-inheritable, like every descriptor Python makes): the
    # connection's copy closes with the connection.
    return _mapped(spec, os.dup(passed), f"memfd {name!r}", name)


def map_dram(
    spec: RegionSpec, descriptors: Sequence[int], *, owner_uid: int | None
) -> MappedRegion:
    """Map a DRAM region however the engine shares it: by descriptor, or by its file's path."""
    if spec.descriptor >= 0:
        return map_dram_descriptor(spec, descriptors, owner_uid=owner_uid)
    return map_dram_region(spec, owner_uid=owner_uid)


def brought_identity(spec: RegionSpec, descriptors: Sequence[int]) -> tuple[int, int] | None:
    """The identity of the memory a registration names now (None: not there to name)."""
    try:
        if spec.descriptor >= 0:
            return _identity(os.fstat(descriptor_of(spec, descriptors)))
        return _identity(os.stat(resolve_shm_path(spec.path)))
    except (OSError, RegionError):
        return None


def _memfd_name(fd: int) -> str:
    # /proc names a memfd "/memfd:NAME (deleted)"; the name is only for messages.
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"
    return target.removeprefix("/").removesuffix(" (deleted)")


def create_shm_file(path: str, size: int, *, mode: int = 0o600) -> RegionSpec:
    """Create a new zero-filled shared-memory file (daemon offload buffers, tests, benches).

    Refuses an existing file (O_EXCL) so two owners never share one by accident.
    """
    real = resolve_shm_path(path)
    if size <= 0:
        raise RegionError(f"shared-memory file size must be positive, got {size}")
    fd = os.open(real, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        os.unlink(real)
        raise
    os.close(fd)
    return RegionSpec(name=Path(real).name, size=size, memory=MemoryKind.DRAM, path=real)


class OffloadPool:
    """Fixed-size slots over one mapped region: their memory, and which are busy.

    Which request gets which slot is the core's rule (``Registry.check_register``
    grants them, and the grant is journaled); the pool carries it out. A slot
    is busy from its grant (:meth:`take`) until its request's release is
    durable and the slot zeroed (:meth:`release`): invariant 5 of the design,
    no request reads another's residue. Busy slots are handed to the core as
    unavailable, so a released slot is not granted again before it is zeroed.
    Not thread-safe: use it from the event loop only.
    """

    def __init__(self, region: MappedRegion, n_slots: int, *, held: Iterable[int] = ()) -> None:
        """``held``: slots live requests hold already (granted before a restart).

        Every other slot is zeroed now: a mapped file may hold a previous
        run's bytes. A held slot is left as it is, since its request may
        still be using it, and zeroed when that request is released.
        """
        if n_slots <= 0:
            raise RegionError(f"offload pool needs at least one slot, got {n_slots}")
        if region.size % n_slots:
            raise RegionError(
                f"region {region.name!r} of {region.size} bytes does not split into"
                f" {n_slots} equal slots"
            )
        self.region = region
        self.n_slots = n_slots
        self.slot_bytes = region.size // n_slots
        busy = set(held)
        for slot in busy:
            self._check_index(slot)
        self._busy = busy
        if not busy:
            region.view().fill(0)
            return
        for slot in range(n_slots):
            if slot not in busy:
                self.slot_view(slot).fill(0)

    @property
    def free_count(self) -> int:
        return self.n_slots - len(self._busy)

    @property
    def used_count(self) -> int:
        return len(self._busy)

    @property
    def busy(self) -> AbstractSet[int]:
        """Slots granted, or released and not yet zeroed (a live view, not a copy)."""
        return self._busy

    def take(self, slots: Iterable[int]) -> None:
        """Mark granted slots busy; all or nothing.

        Every slot must be in range, free and listed once, else nothing is
        taken and RegionError(code="bad_slot") is raised.
        """
        slots = tuple(slots)
        for slot in slots:
            self._check_index(slot)
        if len(set(slots)) != len(slots):
            raise RegionError(f"slot listed twice in take: {slots}", code="bad_slot")
        taken = [s for s in slots if s in self._busy]
        if taken:
            raise RegionError(f"slots {taken} are busy", code="bad_slot")
        self._busy.update(slots)

    def release(self, slots: Iterable[int]) -> None:
        """Zero the slots and make them free; all or nothing.

        Every slot must be currently busy and listed once, else nothing
        is released and RegionError(code="bad_slot") is raised.
        """
        slots = tuple(slots)
        if len(set(slots)) != len(slots):
            raise RegionError(f"slot listed twice in release: {slots}", code="bad_slot")
        stray = [s for s in slots if s not in self._busy]
        if stray:
            raise RegionError(f"slots {stray} are not busy", code="bad_slot")
        for slot in slots:
            self.slot_view(slot).fill(0)
            self._busy.remove(slot)

    def slot_view(self, slot: int) -> np.ndarray:
        """A writable uint8 array over one slot."""
        self._check_index(slot)
        start = slot * self.slot_bytes
        return self.region.view()[start : start + self.slot_bytes]

    def slot_addr(self, slot: int) -> int:
        """Address of the slot in this process (for NIXL descriptors)."""
        self._check_index(slot)
        return self.region.base + slot * self.slot_bytes

    def _check_index(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise RegionError(
                f"slot {slot} out of range 0..{self.n_slots - 1}",
                code="bad_slot",
            )
