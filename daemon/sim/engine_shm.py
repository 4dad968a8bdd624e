"""The simulated engine's KV cache in POSIX shared memory (one region per group).

Group ``g`` lives in ``{shm_dir}/{prefix}-g{g}`` (region name ``g{g}``),
``prefix`` defaulting to ``kvpushd-{engine_id}-{pid}`` (characters outside
``[A-Za-z0-9_.-]`` become ``_``). A region is ``GUARD | layer 0 | GUARD |
layer 1 | ... | GUARD``: each layer's ``num_blocks * block_bytes`` bytes,
page-aligned, between 4 KiB guard bands filled with a canary, so a write
that overruns a layer shows up as a change "outside every block". One
region per group (not per layer) keeps the file count and the daemon's
NIXL registrations small while groups keep their own block sizes. The
files are unlinked on :meth:`daemon.sim.engine.SimEngine.close`, at
interpreter exit, and in process mode on SIGTERM/SIGINT.

With ``memory="descriptor"`` each region is a sealed memfd instead
(:class:`MemfdRegion`, daemon/client/memfd.py), passed to the daemon with
the engine's Hello: no file at all.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import re
import threading
from typing import Final

import numpy as np

from daemon.client.memfd import create_kv_memfd
from daemon.sim.engine_layout import SimError, SimGroup, SimLayout
from schemas.kvlayout import GroupSpec, LayerSpec, MemoryKind, RegionSpec, SharedAs

SHM_DIR: Final = "/dev/shm"
GUARD_BYTES: Final = 4096
_PAGE: Final = 4096

_LIVE_PATHS: set[str] = set()
_LIVE_LOCK = threading.Lock()


def _unlink_all() -> None:
    """Last resort at interpreter exit: no shm file outlives its engine."""
    with _LIVE_LOCK:
        paths = list(_LIVE_PATHS)
        _LIVE_PATHS.clear()
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


atexit.register(_unlink_all)


class ShmRegion:
    """One POSIX shared-memory file, mapped; created exclusively, unlinked on close."""

    def __init__(self, name: str, path: str, size: int) -> None:
        self.name = name
        self.path = path
        self.size = size
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o660)
        with _LIVE_LOCK:
            _LIVE_PATHS.add(path)
        try:
            os.ftruncate(fd, size)
            self._map: mmap.mmap | None = mmap.mmap(fd, size)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def spec(self) -> RegionSpec:
        """How the engine names this region to its daemon."""
        return RegionSpec(self.name, self.size, MemoryKind.DRAM, path=self.path)

    def unlink(self) -> None:
        with _LIVE_LOCK:
            _LIVE_PATHS.discard(self.path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        """Unlink, then unmap if no numpy view is still exported."""
        self.unlink()
        _unmap(self)


class MemfdRegion:
    """One region as a sealed memfd, mapped; shared by descriptor ``index``, gone when closed."""

    def __init__(self, name: str, label: str, size: int, index: int) -> None:
        self.name = name
        self.path = f"memfd:{label}"  # no file: what /proc calls it, for messages
        self.size = size
        self.index = index
        self.fd: int | None = create_kv_memfd(label, size)
        self._map: mmap.mmap | None = mmap.mmap(self.fd, size)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def spec(self) -> RegionSpec:
        """How the engine names this region to its daemon: by its place among the descriptors."""
        return RegionSpec(self.name, self.size, MemoryKind.DRAM, descriptor=self.index)

    def close(self) -> None:
        """Unmap if no numpy view is still exported, and close the memfd."""
        _unmap(self)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


Region = ShmRegion | MemfdRegion


def _unmap(region: Region) -> None:
    region.array = np.empty(0, dtype=np.uint8)
    if region._map is not None:
        with contextlib.suppress(BufferError):  # a caller still holds a view
            region._map.close()
        region._map = None


FILE: Final = SharedAs.FILE
DESCRIPTOR: Final = SharedAs.DESCRIPTOR


def default_shm_prefix(engine_id: str, pid: int | None = None) -> str:
    """The default file-name prefix: ``kvpushd-{engine_id}-{pid}``, file-name safe."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)
    return f"kvpushd-{safe}-{os.getpid() if pid is None else pid}"


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _group_memory(
    g: int, group: SimGroup, prefix: str, shm_dir: str, memory: str
) -> tuple[GroupSpec, Region]:
    name = f"g{g}"
    stride = _round_up(group.num_blocks * group.block_bytes, _PAGE) + GUARD_BYTES
    layers = tuple(LayerSpec(name, GUARD_BYTES + li * stride) for li in range(group.layers))
    size = GUARD_BYTES + group.layers * stride
    region: Region
    if memory == DESCRIPTOR:
        region = MemfdRegion(name, f"{prefix}-{name}", size, g)
    else:
        region = ShmRegion(name, os.path.join(shm_dir, f"{prefix}-{name}"), size)
    spec = GroupSpec(group.kind, group.num_blocks, group.block_bytes, layers, group.per_logical)
    return spec, region


def allocate(
    layout: SimLayout, prefix: str, shm_dir: str = SHM_DIR, memory: str = FILE
) -> tuple[tuple[GroupSpec, ...], list[Region]]:
    """Create one region per group (a file, or a memfd); on failure, free what was created."""
    if memory not in (FILE, DESCRIPTOR):
        raise SimError(f"memory must be {FILE!r} or {DESCRIPTOR!r}, not {memory!r}")
    specs: list[GroupSpec] = []
    regions: list[Region] = []
    try:
        for g, group in enumerate(layout):
            if group.num_blocks < 0 or group.block_bytes < 1 or group.layers < 1:
                raise SimError(f"group {g}: invalid sizes {group}")
            spec, region = _group_memory(g, group, prefix, shm_dir, memory)
            specs.append(spec)
            regions.append(region)
    except BaseException:
        for region in regions:
            region.close()
        raise
    return tuple(specs), regions
