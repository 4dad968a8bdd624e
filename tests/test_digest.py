"""Block checksums (daemon/dataplane/digest.py and vram.py's wsum32) over real /dev/shm.

crc32c is checked against the library over the same bytes; wsum32 against a
plain numpy reading of its definition. VRAM regions are stood in for by
CPU tensors (``fake_region``: a ``VramRegion`` over host memory), so these
tests check the torch code and the choice of algorithm, never that a GPU
computed anything; the device itself is exercised only on a GPU machine.
"""

from __future__ import annotations

import os
import struct
import uuid
from collections.abc import Iterator

import crc32c
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.dataplane import digest
from daemon.dataplane.errors import DataPlaneError
from daemon.dataplane.memory import MappedRegion, create_shm_file, map_dram_region
from daemon.dataplane.vram import VramRegion, block_wsums
from schemas.kvlayout import EngineSpec, GroupSpec, LayerSpec, RegionSpec
from schemas.layout import GroupKind

BLOCK = 4096
BLOCKS = 16


def _spec(regions: tuple[RegionSpec, ...], block: int = BLOCK) -> EngineSpec:
    # Group 0: two layers in region 0 (second at an offset); group 1: one layer in region 1.
    span = BLOCKS * block
    groups = (
        GroupSpec(
            GroupKind.ATTENTION,
            BLOCKS,
            block,
            (LayerSpec(regions[0].name), LayerSpec(regions[0].name, span)),
        ),
        GroupSpec(GroupKind.ATTENTION, BLOCKS, block, (LayerSpec(regions[1].name),)),
    )
    return EngineSpec("eng", groups, regions)


@pytest.fixture
def dram() -> Iterator[tuple[EngineSpec, dict[str, MappedRegion]]]:
    tag = uuid.uuid4().hex[:8]
    specs = (
        create_shm_file(f"/dev/shm/kvpushd-test-dg0-{tag}", 2 * BLOCKS * BLOCK),
        create_shm_file(f"/dev/shm/kvpushd-test-dg1-{tag}", BLOCKS * BLOCK),
    )
    regions = {s.name: map_dram_region(s, owner_uid=os.getuid()) for s in specs}
    rng = np.random.default_rng(3)
    for region in regions.values():
        region.view()[:] = rng.integers(0, 256, region.size, dtype=np.uint8)
    yield _spec(specs), regions
    for region in regions.values():
        region.close()
    for s in specs:
        os.unlink(s.path)


def _fake_vram(
    spec: EngineSpec, regions: dict[str, MappedRegion]
) -> tuple[EngineSpec, dict[str, VramRegion]]:
    """The same bytes as ``regions`` in VramRegions over CPU tensors (a stand-in)."""
    fake = {
        name: VramRegion(name, torch.from_numpy(np.array(r.view())), 0)
        for name, r in regions.items()
    }
    return spec, fake


def _words(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def _wsum_reference(block: bytes) -> int:
    w = np.frombuffer(block, dtype="<u4").astype(np.uint64)
    weights = np.arange(len(w), dtype=np.uint64) * 2 + 1
    lo = int(((w & 0xFFFF) * weights).sum())
    hi = int(((w >> 16) * weights).sum())
    return (lo + hi * 0x9E3779B1) & 0xFFFFFFFF


SELECTED = ((3, 0, 15), (7,))


def test_crc32c_per_group_layer_block_matches_the_library(dram) -> None:
    spec, regions = dram
    got = _words(digest.digests(spec, regions, SELECTED))
    r0, r1 = (regions[r.name].view() for r in spec.regions)
    expected = [crc32c.crc32c(bytes(r0[b * BLOCK : (b + 1) * BLOCK])) for b in SELECTED[0]]
    off = BLOCKS * BLOCK
    expected += [
        crc32c.crc32c(bytes(r0[off + b * BLOCK : off + (b + 1) * BLOCK])) for b in (3, 0, 15)
    ]
    expected += [crc32c.crc32c(bytes(r1[7 * BLOCK : 8 * BLOCK]))]
    assert got == expected


def test_wsum32_over_the_mapping_follows_its_definition(dram) -> None:
    spec, regions = dram
    got = _words(digest.digests(spec, regions, SELECTED, digest.DEVICE_ALGORITHM))
    r0 = regions[spec.regions[0].name].view()
    assert got[0] == _wsum_reference(bytes(r0[3 * BLOCK : 4 * BLOCK]))
    assert len(got) == 7  # 3 blocks x 2 layers + 1 block x 1 layer


def test_a_vram_engine_and_a_dram_engine_agree_with_fake_region_without_cuda(dram) -> None:
    spec, regions = dram
    _, fake = _fake_vram(spec, regions)
    assert digest.algorithm_for(spec, fake) == digest.DEVICE_ALGORITHM
    assert digest.algorithm_for(spec, regions) == digest.ALGORITHM
    # A VRAM pusher's checksums can be checked by a DRAM receiver (on its CPU).
    assert digest.can_compute(spec, regions, digest.DEVICE_ALGORITHM)
    # A VRAM receiver cannot take crc32c: that request goes unchecked.
    assert not digest.can_compute(spec, fake, digest.ALGORITHM)
    on_device = digest.digests(spec, fake, SELECTED, digest.DEVICE_ALGORITHM)
    assert on_device == digest.digests(spec, regions, SELECTED, digest.DEVICE_ALGORITHM)


def test_an_engine_wsum32_cannot_take_goes_unchecked_with_fake_region_without_cuda(dram) -> None:
    spec, regions = dram
    odd = _spec(spec.regions, block=BLOCK - 2)  # not a whole number of words
    _, fake = _fake_vram(spec, regions)
    assert digest.algorithm_for(odd, fake) == digest.UNCHECKED
    assert not digest.can_compute(odd, regions, digest.DEVICE_ALGORITHM)
    with pytest.raises(DataPlaneError):
        digest.digests(odd, fake, SELECTED, digest.ALGORITHM)


def test_a_block_out_of_range_is_refused(dram) -> None:
    spec, regions = dram
    with pytest.raises(DataPlaneError, match="out of range"):
        digest.digests(spec, regions, ((BLOCKS,), ()))


def test_flip_first_changes_exactly_one_checksum(dram) -> None:
    spec, regions = dram
    before = _words(digest.digests(spec, regions, SELECTED))
    digest.flip_first(spec, regions, ((0, 5), ()))
    after = _words(digest.digests(spec, regions, SELECTED))
    # Block 0 of layer 0 is the second checksum; nothing else moved.
    assert [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b] == [1]
    digest.flip_first(spec, regions, ((), ()))  # no block: nothing to flip
    assert _words(digest.digests(spec, regions, SELECTED)) == after


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=256, max_size=256),
    at=st.integers(0, 255),
    delta=st.integers(1, 255),
    swap=st.tuples(st.integers(0, 63), st.integers(0, 63)),
)
def test_wsum32_sees_any_changed_byte_and_two_swapped_words(data, at, delta, swap) -> None:
    layer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    (base,) = block_wsums(layer, 256, [0])
    assert base == _wsum_reference(data)
    changed = bytearray(data)
    changed[at] = (changed[at] + delta) % 256
    assert block_wsums(torch.frombuffer(changed, dtype=torch.uint8), 256, [0]) != [base]
    i, j = swap
    words = np.frombuffer(data, dtype="<u4").copy()
    if words[i] != words[j]:
        words[[i, j]] = words[[j, i]]
        swapped = torch.frombuffer(bytearray(words.tobytes()), dtype=torch.uint8)
        assert block_wsums(swapped, 256, [0]) != [base]
