"""The node's offload pool: the memory of the KV offload tier (README.md, "Offload tier").

One mapping the daemon owns: a header page, then ``slots`` slots of
``slot_bytes`` bytes each. Engines map the same pages from the descriptor
the daemon passes them (daemon/client/pool.py); which slot holds what, and
who may write or read it, is the core's slot table (statemachine/slots.py),
journaled. This module only makes, maps, zeroes and checks the bytes.

Header (little-endian, at offset 0): magic ``KVPDPOOL``, format version,
the pool's id (random hex, chosen when the pool is made), ``slots``,
``slot_bytes``. A pool at a /dev/shm ``path`` whose header says the same
slots and slot size is reopened as it is (``survived``: its bytes are those
of the daemon before); anything else there is replaced by a new pool,
zero-filled, with a new id. A pool with no path is an anonymous memfd,
sealed against shrinking and growing, that dies with the daemon.

Zeroing and checking run at memory speed (``ctypes.memset`` and a numpy
reduction over 64-bit words, both outside the GIL) and are meant to be
called from a thread, never the event loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import stat
import struct
import uuid
from collections.abc import Iterable
from typing import Final

import numpy as np

from schemas.config import OFFLOAD_HEADER_BYTES

MAGIC: Final = b"KVPDPOOL"
VERSION: Final = 1
_HEADER: Final = struct.Struct("<8sI32sQQ")  # magic, version, pool_id, slots, slot_bytes
_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class PoolError(Exception):
    """The pool cannot be made or mapped (the message says where and why)."""


class Pool:
    """The pool's mapping; ``fd`` is what an engine is passed (read-write)."""

    def __init__(
        self, fd: int, mapping: mmap.mmap, *, slots: int, slot_bytes: int, pool_id: str,
        survived: bool, path: str,
    ) -> None:  # fmt: skip
        self.fd = fd
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.header_bytes = OFFLOAD_HEADER_BYTES
        self.pool_id = pool_id
        self.survived = survived  # reopened as the daemon before left it
        self.path = path  # "" for a memfd
        self._mmap: mmap.mmap | None = mapping
        self._bytes = np.frombuffer(mapping, dtype=np.uint8)
        self._words = self._bytes[OFFLOAD_HEADER_BYTES:].view(np.uint64)
        self._base = int(self._bytes.ctypes.data)
        self._words_per_slot = slot_bytes // 8

    # ------------------------------------------------------------ making

    @classmethod
    def open(cls, *, slots: int, slot_bytes: int, path: str = "") -> Pool:
        """Reopen the pool at ``path`` if its header matches, else make a new one."""
        if slots < 1 or slot_bytes < 8 or slot_bytes % 8:
            raise PoolError(
                f"a pool needs slots >= 1 and a slot size in words ({slots=}, {slot_bytes=})"
            )
        size = OFFLOAD_HEADER_BYTES + slots * slot_bytes
        if not path:
            return cls._made(_memfd(size), size, slots, slot_bytes, path)
        fd = _reopen(path, size)
        if fd is not None:
            try:
                mapping = _map(fd, size)
                pool_id = _matching_id(mapping, slots, slot_bytes)
                if pool_id is not None:
                    return cls(
                        fd, mapping, slots=slots, slot_bytes=slot_bytes, pool_id=pool_id,
                        survived=True, path=path,
                    )  # fmt: skip
                mapping.close()
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        return cls._made(_create_file(path, size), size, slots, slot_bytes, path)

    @classmethod
    def _made(cls, fd: int, size: int, slots: int, slot_bytes: int, path: str) -> Pool:
        try:
            mapping = _map(fd, size)
            pool_id = uuid.uuid4().hex
            # Written last: a pool torn before this never reopens as survived.
            mapping[: _HEADER.size] = _HEADER.pack(
                MAGIC, VERSION, pool_id.encode(), slots, slot_bytes
            )
            mapping.flush(0, mmap.PAGESIZE)
        except BaseException:
            os.close(fd)
            raise
        return cls(
            fd, mapping, slots=slots, slot_bytes=slot_bytes, pool_id=pool_id, survived=False,
            path=path,
        )  # fmt: skip

    # ----------------------------------------------------------- reading

    def offset(self, slot: int) -> int:
        """Where ``slot`` starts in the pool (the header is before slot 0)."""
        self._check(slot)
        return OFFLOAD_HEADER_BYTES + slot * self.slot_bytes

    def view(self, slot: int) -> np.ndarray:
        """A writable uint8 array over ``slot``."""
        start = self.offset(slot)
        return self._bytes[start : start + self.slot_bytes]

    def is_zero(self, slot: int) -> bool:
        """Whether every byte of ``slot`` is zero (a word-wise reduction, outside the GIL)."""
        self._check(slot)
        n = self._words_per_slot
        return not self._words[slot * n : (slot + 1) * n].any()

    def dirty(self, slots: Iterable[int]) -> list[int]:
        """The ones of ``slots`` that are not all zero."""
        return [slot for slot in slots if not self.is_zero(slot)]

    def zero(self, slots: Iterable[int]) -> None:
        """Zero ``slots``: one memset per run of consecutive slots (outside the GIL)."""
        if self._mmap is None:
            raise PoolError("the pool is closed")
        for first, count in _runs(sorted(set(slots))):
            self._check(first)
            self._check(first + count - 1)
            ctypes.memset(self._base + self.offset(first), 0, count * self.slot_bytes)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} is not in a pool of {self.slots}")

    # ----------------------------------------------------------- closing

    def close(self) -> None:
        """Unmap (once no view is alive: else left to the collector) and close the descriptor."""
        mapping, self._mmap = self._mmap, None
        if mapping is None:
            return
        del self._bytes, self._words
        with contextlib.suppress(BufferError):
            mapping.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _runs(slots: list[int]) -> Iterable[tuple[int, int]]:
    """Sorted slots as (first, count) runs of consecutive ones."""
    start = prev = None
    for slot in slots:
        if start is not None and slot == prev + 1:  # type: ignore[operator]
            prev = slot
            continue
        if start is not None:
            yield start, prev - start + 1  # type: ignore[operator]
        start = prev = slot
    if start is not None:
        yield start, prev - start + 1  # type: ignore[operator]


def _map(fd: int, size: int) -> mmap.mmap:
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise PoolError(f"cannot map the offload pool ({size} bytes): {exc.strerror}") from exc


def _memfd(size: int) -> int:
    fd = os.memfd_create("kvpushd-offload", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        _allocate(fd, size, "memfd")
        # An engine holding the descriptor can then neither shrink the pool
        # under the daemon's mapping (SIGBUS) nor grow it.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _allocate(fd: int, size: int, where: str) -> None:
    try:
        os.ftruncate(fd, size)
        # Backed now, not at first touch: a pool larger than /dev/shm or the
        # memory limit fails here, at start, not with SIGBUS under load.
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise PoolError(
            f"cannot allocate the offload pool at {where} ({size} bytes): {exc.strerror}"
        ) from exc


def _reopen(path: str, size: int) -> int | None:
    """The existing pool file, open read-write, if it is ours and of the right size."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PoolError(f"offload.path {path}: {exc.strerror}") from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != size:
        os.close(fd)
        return None
    return fd


def _matching_id(mapping: mmap.mmap, slots: int, slot_bytes: int) -> str | None:
    magic, version, pool_id, n, size = _HEADER.unpack_from(mapping, 0)
    if magic != MAGIC or version != VERSION or n != slots or size != slot_bytes:
        return None
    try:
        text = pool_id.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text if len(text) == 32 and all(c in "0123456789abcdef" for c in text) else None


def _create_file(path: str, size: int) -> int:
    """A new pool file at ``path`` (mode 0600), replacing whatever was there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise PoolError(f"offload.path {path}: cannot create the pool: {exc.strerror}") from exc
    try:
        _allocate(fd, size, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return fd
