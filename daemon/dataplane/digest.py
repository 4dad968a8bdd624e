"""Block checksums over an engine's mapped KV memory, without copies.

One crc32c (hardware-accelerated; the library drops the GIL on large
buffers) per (group, layer, block), over the block's bytes in this
process's mapping of the engine's /dev/shm region, laid out as
statemachine/integrity.py says: group by group, layer by layer, block by
block in the order given, each a little-endian uint32.

An engine whose KV lives in VRAM is not checksummed (:func:`supported`):
no device checksum is implemented, and copying every block to the host to
checksum it would cost more than the write it checks. Its daemon says so
(``UNCHECKED``) instead of sending digests (ARCHITECTURE.md, "Integrity").
"""

from __future__ import annotations

from collections.abc import Mapping

import crc32c
import numpy as np

from daemon.dataplane.errors import DataPlaneError
from daemon.dataplane.memory import MappedRegion
from schemas.events import Blocks
from schemas.kvlayout import EngineSpec

ALGORITHM = "crc32c"
UNCHECKED = "none"  # the side that computes cannot: nothing is compared


def supported(spec: EngineSpec, regions: Mapping[str, object]) -> bool:
    """Whether every region of the engine is a /dev/shm mapping this module can read."""
    for r in spec.regions:
        region = regions.get(r.name)
        if not isinstance(region, MappedRegion) or region.closed:
            return False
    return True


def block_bytes(spec: EngineSpec, blocks: Blocks) -> int:
    """How many bytes :func:`digests` reads for ``blocks``."""
    return sum(
        len(ids) * g.block_bytes * len(g.layers) for ids, g in zip(blocks, spec.groups, strict=True)
    )


def _views(spec: EngineSpec, regions: Mapping[str, object]) -> list[list[np.ndarray]]:
    """Per group, per layer: the uint8 array over that layer's blocks."""
    out: list[list[np.ndarray]] = []
    for g, group in enumerate(spec.groups):
        layers = []
        span = group.num_blocks * group.block_bytes
        for layer in group.layers:
            region = regions.get(layer.region)
            if not isinstance(region, MappedRegion) or region.closed:
                raise DataPlaneError(
                    f"engine {spec.engine_id!r} group {g}: region {layer.region!r} is not a "
                    "mapped DRAM region; checksums are computed over /dev/shm mappings only",
                    code="bad_layout",
                )
            layers.append(region.view()[layer.offset : layer.offset + span])
        out.append(layers)
    return out


def digests(spec: EngineSpec, regions: Mapping[str, object], blocks: Blocks) -> bytes:
    """The checksums of ``blocks`` of the engine ``spec`` describes (see the module doc).

    Raises ``DataPlaneError`` if a region is not mapped DRAM or a block id
    is out of range.
    """
    if len(blocks) != len(spec.groups):
        raise DataPlaneError(
            f"{len(blocks)} block groups for an engine of {len(spec.groups)}", code="bad_request"
        )
    views = _views(spec, regions)
    out: list[int] = []
    crc = crc32c.crc32c
    for ids, group, layers in zip(blocks, spec.groups, views, strict=True):
        size = group.block_bytes
        for b in ids:
            if not 0 <= b < group.num_blocks:
                raise DataPlaneError(
                    f"block {b} out of range 0..{group.num_blocks - 1}", code="bad_request"
                )
        for view in layers:
            out.extend(crc(view[b * size : (b + 1) * size].data) for b in ids)
    return np.asarray(out, dtype="<u4").tobytes()


def flip_byte(spec: EngineSpec, regions: Mapping[str, object], group: int, block: int) -> None:
    """Invert byte 0 of ``block`` of layer 0 of ``group`` (the ``integrity.flip_dst``
    failpoint: a receiver's memory changed between the landing and the check)."""
    view = _views(spec, regions)[group][0]
    at = block * spec.groups[group].block_bytes
    view[at] ^= 0xFF
