"""Block checksums over an engine's KV memory, without copies to the host.

One checksum per (group, layer, block), laid out as statemachine/integrity.py
says: group by group, layer by layer, block by block in the order given,
each a little-endian uint32. Two algorithms, named in the ``Digests``
message so that both sides compute the same one:

* ``crc32c`` for engines whose KV is in /dev/shm (DRAM): hardware crc32c
  over each block of this process's mapping; the library drops the GIL on
  large buffers. Computable only over DRAM.
* ``wsum32`` for engines whose KV is in GPU memory (VRAM): a
  position-weighted sum computed with torch ops on the device
  (daemon/dataplane/vram.py ``block_wsums``); the other side computes it
  too, on its own device or on the CPU over its mapping.

An engine whose regions allow neither (mixed kinds, a block size wsum32
cannot take) says :data:`UNCHECKED` and its requests go unchecked.
"""

from __future__ import annotations

from collections.abc import Mapping

import crc32c
import numpy as np

from daemon.dataplane import vram
from daemon.dataplane.errors import DataPlaneError
from daemon.dataplane.memory import MappedRegion
from daemon.dataplane.vram import VramRegion
from schemas.events import Blocks
from schemas.kvlayout import EngineSpec

ALGORITHM = "crc32c"  # DRAM engines
DEVICE_ALGORITHM = vram.WSUM_ALGORITHM  # VRAM engines
UNCHECKED = "none"  # the side that computes cannot: nothing is compared


def _open(regions: Mapping[str, object], name: str, kind: type) -> bool:
    region = regions.get(name)
    return isinstance(region, kind) and not region.closed  # type: ignore[attr-defined]


def algorithm_for(spec: EngineSpec, regions: Mapping[str, object]) -> str:
    """The algorithm this engine's own checksums use (the pusher's choice)."""
    if all(_open(regions, r.name, MappedRegion) for r in spec.regions):
        return ALGORITHM
    if all(_open(regions, r.name, VramRegion) for r in spec.regions) and all(
        vram.wsum_supported(g.block_bytes) and not g.block_stride for g in spec.groups
    ):
        return DEVICE_ALGORITHM
    return UNCHECKED


def can_compute(spec: EngineSpec, regions: Mapping[str, object], algorithm: str) -> bool:
    """Whether this engine's memory allows ``algorithm`` (the receiver's question)."""
    if algorithm == ALGORITHM:
        return all(_open(regions, r.name, MappedRegion) for r in spec.regions)
    if algorithm == DEVICE_ALGORITHM:
        return all(
            _open(regions, r.name, MappedRegion) or _open(regions, r.name, VramRegion)
            for r in spec.regions
        ) and all(
            # The GPU sums read whole, back-to-back blocks: no head slices.
            vram.wsum_supported(g.block_bytes) and not g.block_stride
            for g in spec.groups
        )
    return False


def _check(spec: EngineSpec, blocks: Blocks) -> None:
    if len(blocks) != len(spec.groups):
        raise DataPlaneError(
            f"{len(blocks)} block groups for an engine of {len(spec.groups)}", code="bad_request"
        )
    for ids, group in zip(blocks, spec.groups, strict=True):
        for b in ids:
            if not 0 <= b < group.num_blocks:
                raise DataPlaneError(
                    f"block {b} out of range 0..{group.num_blocks - 1}", code="bad_request"
                )


def _layer_view(spec: EngineSpec, regions: Mapping[str, object], g: int, l: int) -> np.ndarray:  # noqa: E741
    group = spec.groups[g]
    layer = group.layers[l]
    region = regions.get(layer.region)
    if not isinstance(region, MappedRegion) or region.closed:
        raise DataPlaneError(
            f"engine {spec.engine_id!r} group {g}: region {layer.region!r} is not a mapped "
            "DRAM region",
            code="bad_layout",
        )
    return region.view()[layer.offset : layer.offset + group.layer_span]


def digests(
    spec: EngineSpec, regions: Mapping[str, object], blocks: Blocks, algorithm: str = ALGORITHM
) -> bytes:
    """The checksums of ``blocks`` of the engine ``spec`` describes (see the module doc).

    Raises ``DataPlaneError`` if the memory does not allow ``algorithm``
    (:func:`can_compute`) or a block id is out of range.
    """
    _check(spec, blocks)
    if not can_compute(spec, regions, algorithm):
        raise DataPlaneError(
            f"engine {spec.engine_id!r}: its memory does not allow {algorithm!r} checksums",
            code="bad_layout",
        )
    out: list[int] = []
    for g, (ids, group) in enumerate(zip(blocks, spec.groups, strict=True)):
        if not ids:
            continue
        size, stride = group.block_bytes, group.stride
        for l, layer in enumerate(group.layers):  # noqa: E741 - l is the layer index
            if algorithm == ALGORITHM:
                view = _layer_view(spec, regions, g, l)
                out.extend(crc32c.crc32c(view[b * stride : b * stride + size].data) for b in ids)
            else:
                region = regions[layer.region]
                out.extend(
                    vram.region_wsums(region, layer.offset, size, group.num_blocks, list(ids))
                )
    return np.asarray(out, dtype="<u4").tobytes()


def flip_first(spec: EngineSpec, regions: Mapping[str, object], blocks: Blocks) -> None:
    """Invert byte 0 of the first of ``blocks`` in layer 0 of its group (the
    ``integrity.flip_dst`` failpoint: a receiver's memory changed between the
    landing and the check)."""
    group = next((g for g, ids in enumerate(blocks) if ids), None)
    if group is None:
        return
    view = _layer_view(spec, regions, group, 0)
    at = blocks[group][0] * spec.groups[group].stride
    view[at] ^= 0xFF
