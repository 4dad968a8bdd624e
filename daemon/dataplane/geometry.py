"""Geometry: descriptor lists and indices, and the layout checks; pure, no NIXL.

Each local engine gets ONE prepared descriptor list and each (remote agent,
remote engine) ONE, built with the same indexing: descriptor
``base_g + l * num_blocks_g + b`` is block ``b`` of layer ``l`` of group
``g``, where ``base_g`` counts the descriptors of the groups before it. A
request is then one ``make_prepped_xfer`` over two index arrays
(:func:`build_indices`); runs of consecutive blocks in a layer merge into one
descriptor inside NIXL. Everything here runs on the event loop thread and
refuses a bad layout or a bad request before anything reaches the worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from daemon.dataplane.errors import DataPlaneError
from daemon.dataplane.memory import MappedRegion
from daemon.dataplane.vram import VramRegion
from daemon.dataplane.window import Window
from schemas.events import Blocks
from schemas.kvlayout import EngineSpec, GroupSpec, MemoryKind, RemoteEngine, RemoteGroup

MAX_DESCRIPTORS: Final = 2**31 - 1

# GPU KV caches: an engine's regions are DRAM (/dev/shm, daemon.dataplane.memory) or VRAM
# (CUDA IPC, daemon.dataplane.vram); NIXL names the two like this. One kind per engine.
Region = MappedRegion | VramRegion
NIXL_MEM: Final[dict[MemoryKind, str]] = {MemoryKind.DRAM: "DRAM", MemoryKind.VRAM: "VRAM"}


@dataclass(frozen=True, slots=True)
class _GroupGeom:
    kind: str
    num_blocks: int
    block_bytes: int
    n_layers: int
    base: int  # index of this group's first descriptor


@dataclass(frozen=True, slots=True)
class EngineGeometry:
    """What indexing and validation need to know about one engine's blocks."""

    engine_id: str
    groups: tuple[_GroupGeom, ...]
    total: int  # number of descriptors in the engine's prepared list

    @classmethod
    def of(cls, engine_id: str, groups: Sequence[RemoteGroup]) -> EngineGeometry:
        geoms: list[_GroupGeom] = []
        base = 0
        for g in groups:
            n_layers = len(g.layer_addrs)
            geoms.append(_GroupGeom(g.kind.value, g.num_blocks, g.block_bytes, n_layers, base))
            base += n_layers * g.num_blocks
        if base > MAX_DESCRIPTORS:
            # make_prepped_xfer takes int32 indices.
            raise DataPlaneError(
                f"engine {engine_id!r} needs {base} descriptors, more than {MAX_DESCRIPTORS}",
                code="bad_layout",
            )
        return cls(engine_id, tuple(geoms), base)

    def signature(self) -> tuple[tuple[str, int, int], ...]:
        return tuple((g.kind, g.block_bytes, g.n_layers) for g in self.groups)


def blocks_nbytes(spec: EngineSpec, blocks: Blocks) -> int:
    """The bytes ``blocks`` of the engine ``spec`` hold, every layer counted."""
    return sum(
        len(ids) * g.block_bytes * len(g.layers) for ids, g in zip(blocks, spec.groups, strict=True)
    )


def descriptor_rows(engine: RemoteEngine) -> np.ndarray:
    """The N x 3 (addr, len, dev) rows of an engine's descriptor list, in index order.

    Used for both local and remote lists, so both sides index alike by construction.
    """
    parts: list[np.ndarray] = []
    for g in engine.groups:
        offsets = np.arange(g.num_blocks, dtype=np.uint64) * np.uint64(g.stride)
        for addr in g.layer_addrs:
            rows = np.empty((g.num_blocks, 3), dtype=np.uint64)
            rows[:, 0] = np.uint64(addr) + offsets
            rows[:, 1] = g.block_bytes
            rows[:, 2] = engine.device
            parts.append(rows)
    if not parts:
        return np.empty((0, 3), dtype=np.uint64)
    return np.concatenate(parts)


def _named_twice(ids: np.ndarray, num_blocks: int) -> bool:
    """Whether a block id occurs more than once in ``ids`` (all in 0..num_blocks-1).

    A mark per block of the pool, not ``np.unique``: this runs on every
    push before the post, and for 4,096 blocks unique's sort or hash took
    ~470 us against ~6 us here (bench/RESULTS.md, "The push gap").
    """
    seen = np.zeros(num_blocks, dtype=np.bool_)
    seen[ids] = True
    return int(np.count_nonzero(seen)) != ids.size


def _check_ids(ids: np.ndarray, num_blocks: int, side: str, g: int) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = ids[(ids < 0) | (ids >= num_blocks)]
        raise DataPlaneError(
            f"group {g}: {side} block ids {bad[:8].tolist()} outside 0..{num_blocks - 1}",
            code="bad_blocks",
        )


def build_indices(
    local: EngineGeometry, remote: EngineGeometry, src: Blocks, dst: Blocks
) -> tuple[np.ndarray, np.ndarray, int]:
    """Local and remote descriptor indices (int32) for ``src[g][i] -> dst[g][i]``, and bytes.

    Refuses, before anything is posted: group counts that differ, groups whose
    kind/block size/layer count differ, pair counts that differ within a
    group, block ids out of range, and a destination block named twice (two
    sources into one block would be a silent overwrite).
    """
    if not (len(src) == len(dst) == len(local.groups) == len(remote.groups)):
        raise DataPlaneError(
            f"group counts differ: src {len(src)}, dst {len(dst)},"
            f" local engine {len(local.groups)}, remote engine {len(remote.groups)}",
            code="mismatch",
        )
    if local.signature() != remote.signature():
        raise DataPlaneError(
            f"engines {local.engine_id!r} and {remote.engine_id!r} have incompatible layouts:"
            f" {local.signature()} vs {remote.signature()}",
            code="mismatch",
        )
    lparts: list[np.ndarray] = []
    rparts: list[np.ndarray] = []
    nbytes = 0
    for g, (lg, rg) in enumerate(zip(local.groups, remote.groups, strict=True)):
        if len(src[g]) != len(dst[g]):
            raise DataPlaneError(
                f"group {g}: {len(src[g])} source blocks vs {len(dst[g])} destination blocks",
                code="mismatch",
            )
        if not src[g]:
            continue
        s = np.asarray(src[g], dtype=np.int64)
        d = np.asarray(dst[g], dtype=np.int64)
        _check_ids(s, lg.num_blocks, "source", g)
        _check_ids(d, rg.num_blocks, "destination", g)
        if _named_twice(d, rg.num_blocks):
            raise DataPlaneError(
                f"group {g}: a destination block is named twice", code="bad_blocks"
            )
        layers = np.arange(lg.n_layers, dtype=np.int64)[:, None]
        lparts.append((lg.base + layers * lg.num_blocks + s[None, :]).ravel())
        rparts.append((rg.base + layers * rg.num_blocks + d[None, :]).ravel())
        nbytes += lg.n_layers * s.size * lg.block_bytes
    if not lparts:
        empty = np.empty(0, dtype=np.int32)
        return empty, empty, 0
    return (
        np.concatenate(lparts).astype(np.int32),
        np.concatenate(rparts).astype(np.int32),
        nbytes,
    )


def local_remote_engine(spec: EngineSpec, regions: Mapping[str, Region | Window]) -> RemoteEngine:
    """Validate a local engine against its mapped regions; the view peers need."""
    by_name = {r.name: r for r in spec.regions}
    for r in spec.regions:
        mapped = regions.get(r.name)
        if mapped is None or mapped.closed:
            raise DataPlaneError(f"region {r.name!r} is not mapped", code="bad_layout")
        if mapped.memory is not r.memory:  # VRAM: opened by daemon.dataplane.vram, not mapped
            raise DataPlaneError(
                f"region {r.name!r} is declared {r.memory.value}, opened as {mapped.memory.value}",
                code="bad_layout",
            )
        if mapped.size != r.size:
            raise DataPlaneError(
                f"region {r.name!r} is mapped with {mapped.size} bytes, spec says {r.size}",
                code="bad_layout",
            )
    groups = []
    for g, group in enumerate(spec.groups):
        groups.append(_local_group(g, group, by_name, regions))
    memory, device = _engine_memory(spec, regions)
    return RemoteEngine(spec.engine_id, memory, device, tuple(groups))


def _engine_memory(
    spec: EngineSpec, regions: Mapping[str, Region | Window]
) -> tuple[MemoryKind, int]:
    """Where all of an engine's regions live: one NIXL memory type and device per engine.

    A descriptor list has one memory type and RemoteEngine one (memory,
    device), so an engine mixing DRAM and VRAM, or two GPUs, is refused.
    """
    places = {(regions[r.name].memory, regions[r.name].device) for r in spec.regions}
    if len(places) > 1:
        found = ", ".join(f"{m.value} device {d}" for m, d in sorted(places))
        raise DataPlaneError(
            f"engine {spec.engine_id!r}: regions must all be DRAM or all VRAM on one device,"
            f" found {found}",
            code="bad_layout",
        )
    return places.pop() if places else (MemoryKind.DRAM, 0)


def _local_group(
    g: int, group: GroupSpec, specs: Mapping[str, object], regions: Mapping[str, Region | Window]
) -> RemoteGroup:
    if group.block_bytes <= 0 or group.num_blocks <= 0 or not group.layers:
        raise DataPlaneError(
            f"group {g}: needs block_bytes > 0, num_blocks > 0 and at least one layer",
            code="bad_layout",
        )
    if _blocks_overlap(group):
        raise DataPlaneError(
            f"group {g}: block_stride {group.block_stride} is less than block_bytes"
            f" {group.block_bytes}",
            code="bad_layout",
        )
    addrs = []
    span = group.layer_span
    for l, layer in enumerate(group.layers):  # noqa: E741 - l is the layer index throughout
        if layer.region not in specs:
            raise DataPlaneError(
                f"group {g} layer {l}: unknown region {layer.region!r}", code="bad_layout"
            )
        region = regions[layer.region]
        if layer.offset < 0 or layer.offset + span > region.size:
            raise DataPlaneError(
                f"group {g} layer {l}: blocks [{layer.offset}, {layer.offset + span}) do not fit"
                f" in region {layer.region!r} of {region.size} bytes",
                code="bad_layout",
            )
        addrs.append(region.base + layer.offset)
    return RemoteGroup(
        group.kind,
        group.num_blocks,
        group.block_bytes,
        tuple(addrs),
        group.per_logical,
        group.block_stride,
    )


def _blocks_overlap(group: GroupSpec | RemoteGroup) -> bool:
    """A stride below the block size: one block's write would land in the next."""
    return 0 < group.block_stride < group.block_bytes


def check_remote_engine(engine: RemoteEngine) -> None:
    # DRAM and VRAM both accepted (NIXL_MEM); the device id goes into every descriptor row.
    if engine.memory not in NIXL_MEM or engine.device < 0:
        raise DataPlaneError(
            f"remote engine {engine.engine_id!r}: unsupported memory"
            f" {engine.memory} device {engine.device}",
            code="bad_layout",
        )
    for g, group in enumerate(engine.groups):
        if (
            group.block_bytes <= 0
            or group.num_blocks <= 0
            or not group.layer_addrs
            or _blocks_overlap(group)
        ):
            raise DataPlaneError(
                f"remote engine {engine.engine_id!r} group {g}: bad geometry", code="bad_layout"
            )
