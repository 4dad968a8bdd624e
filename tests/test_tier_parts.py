"""The offload tier's pure parts (daemon/client/vllm/tier/geometry.py): slots and namespaces."""

from __future__ import annotations

import msgspec
import pytest

from daemon.client.vllm.tier.geometry import (
    ChunkGeometry,
    SlotTooSmall,
    chain_seed,
    chunk_slots,
    namespace,
)
from schemas.fingerprint import Fingerprint

GEOMETRY = ChunkGeometry(blocks_per_chunk=2, tokens_per_hash=32, pages=((100, 200), (50,)))
FINGERPRINT = Fingerprint(
    model="m",
    revision="",
    dtype="float32",
    kv_cache_dtype="auto",
    block_size=32,
    num_layers=2,
    num_kv_heads=2,
    head_size=64,
    kv_layout="cpu:auto",
    tp_size=1,
    pp_size=1,
    engine="vllm x",
    protocol=4,
    weights="w1",
)


def test_a_chunk_is_its_blocks_each_the_pages_of_its_layers_in_order() -> None:
    assert GEOMETRY.block_bytes(0) == 300 and GEOMETRY.chunk_bytes(0) == 600
    assert GEOMETRY.page_offsets(0) == (0, 100)
    assert GEOMETRY.chunk_bytes(1) == 100 and GEOMETRY.page_offsets(1) == (0,)


def test_a_chunk_that_does_not_fit_a_slot_is_refused_with_the_size_it_needs() -> None:
    GEOMETRY.check_fits(600)
    with pytest.raises(SlotTooSmall, match="at least 600"):
        GEOMETRY.check_fits(599)


@pytest.mark.parametrize(
    ("first", "count", "per_chunk", "expected"),
    [
        (0, 3, 1, [(0, 0), (1, 0), (2, 0)]),
        (0, 4, 2, [(0, 0), (0, 1), (1, 0), (1, 1)]),
        # A load that starts inside a chunk: its chunks are counted from that one.
        (3, 3, 2, [(0, 1), (1, 0), (1, 1)]),
        (5, 1, 4, [(0, 1)]),
    ],
)
def test_each_block_finds_its_chunk_and_place_from_the_first_blocks_index(
    first: int, count: int, per_chunk: int, expected: list[tuple[int, int]]
) -> None:
    assert chunk_slots(first, count, per_chunk) == expected


def test_the_namespace_changes_with_every_part_of_what_makes_kv_comparable() -> None:
    base = namespace(FINGERPRINT, GEOMETRY, "sha256", "default")
    assert base == namespace(FINGERPRINT, GEOMETRY, "sha256", "default")
    others = {
        namespace(
            msgspec.structs.replace(FINGERPRINT, weights="w2"), GEOMETRY, "sha256", "default"
        ),
        namespace(msgspec.structs.replace(FINGERPRINT, rope="long"), GEOMETRY, "sha256", "default"),
        namespace(
            FINGERPRINT, msgspec.structs.replace(GEOMETRY, blocks_per_chunk=1), "sha256", "default"
        ),
        namespace(
            FINGERPRINT,
            msgspec.structs.replace(GEOMETRY, pages=((100, 201), (50,))),
            "sha256",
            "default",
        ),
        namespace(FINGERPRINT, GEOMETRY, "sha256_cbor", "default"),
        namespace(FINGERPRINT, GEOMETRY, "sha256", "env:0"),
    }
    assert base not in others and len(others) == 6


def test_the_chain_seed_is_shared_only_where_vllm_derives_it_the_same_in_every_process() -> None:
    assert chain_seed("sha256", {}) == chain_seed("sha256", {}) == "default"
    assert chain_seed("xxhash", {"PYTHONHASHSEED": "7"}) == "env:7"
    # A per-process random chain: a namespace nobody shares, not even this process twice.
    assert chain_seed("xxhash", {}) != chain_seed("xxhash", {})
    assert chain_seed("xxhash_cbor", {}).startswith("random:")
