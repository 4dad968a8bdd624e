"""Groups laid over one memory (vLLM's hybrid allocator) own a block id once.

vLLM lays a sliding-window group and a full-attention group over the same
tensors and hands a block id to one group at a time. The daemon finds the
overlay from the memory (statemachine/overlay.py) and keys block ownership
by the memory, so invariant 1 (one owner per destination block) holds
across such groups: a second request claiming block ``b`` through the other
group is refused, as is one listing ``b`` in both.
"""

from __future__ import annotations

import pytest

from schemas.events import WriteDone
from schemas.kvlayout import EngineSpec, GroupSpec, LayerSpec, RegionSpec
from schemas.layout import EngineLayout, GroupKind, GroupLayout, Role
from schemas.reasons import Reason
from statemachine import Refusal, Registry
from statemachine.overlay import OverlayRefused, group_overlays

ATT = GroupKind.ATTENTION
BLOCK = 4096
N = 16
LAYER = N * BLOCK


def _group(
    *offsets: int, num_blocks: int = N, block_bytes: int = BLOCK, stride: int = 0
) -> GroupSpec:
    layers = tuple(LayerSpec("kv", offset) for offset in offsets)
    return GroupSpec(ATT, num_blocks, block_bytes, layers, block_stride=stride)


def test_vllms_hybrid_layout_overlays_the_second_group_on_the_first() -> None:
    # Two tensors, each shared by one layer of each group (vLLM's KVCacheTensor).
    sliding, full = _group(0, LAYER), _group(0, LAYER)
    assert group_overlays((sliding, full)) == (-1, 0)


def test_groups_in_separate_memory_overlay_nothing() -> None:
    assert group_overlays((_group(0), _group(LAYER), _group(2 * LAYER))) == (-1, -1, -1)


def test_a_third_group_names_the_first_group_of_the_memory() -> None:
    assert group_overlays((_group(0), _group(0), _group(0))) == (-1, 0, 0)


@pytest.mark.parametrize(
    "other",
    [
        _group(BLOCK),  # shifted by one block: block b would be b+1 of the other
        _group(0, block_bytes=BLOCK // 2, num_blocks=2 * N),
        _group(0, num_blocks=N - 1),
        _group(0, block_bytes=BLOCK // 2, stride=BLOCK),
    ],
    ids=["shifted", "smaller-blocks", "fewer-blocks", "strided"],
)
def test_an_overlap_block_ids_cannot_name_is_refused(other: GroupSpec) -> None:
    with pytest.raises(OverlayRefused):
        group_overlays((_group(0), other))


def test_a_group_over_two_separate_memories_is_refused() -> None:
    with pytest.raises(OverlayRefused, match="one block id cannot name"):
        group_overlays((_group(0), _group(LAYER), _group(0, LAYER)))


def test_the_engine_spec_carries_the_overlay_into_the_cores_layout() -> None:
    spec = EngineSpec("e", (_group(0), _group(0)), (RegionSpec("kv", 2 * LAYER),))
    layout = spec.layout(0, group_overlays(spec.groups))
    assert [g.overlays for g in layout.groups] == [-1, 0]
    assert [g.overlays for g in spec.layout().groups] == [-1, -1]


# ----------------------------------------------------------------- registry

HYBRID = EngineLayout("hyb", (GroupLayout(ATT, N), GroupLayout(ATT, N, overlays=0)))
APART = EngineLayout("apart", (GroupLayout(ATT, N), GroupLayout(ATT, N)))


def _registry(*layouts: EngineLayout) -> Registry:
    reg = Registry()
    for layout in layouts:
        reg.apply(reg.check_attach(layout), 0.0)
    return reg


def _register(reg: Registry, rid: str, engine: str, blocks: list[list[int]]) -> None:
    reg.apply(reg.check_register(rid, 1, Role.RECEIVER, engine, "peer", blocks), 0.0)


def test_a_block_owned_through_one_group_is_refused_through_the_other() -> None:
    reg = _registry(HYBRID)
    _register(reg, "a", "hyb", [[3, 4], [5]])
    with pytest.raises(Refusal) as info:
        reg.check_register("b", 1, Role.RECEIVER, "hyb", "peer", [[6], [3]])
    assert info.value.reason is Reason.BLOCKS_OWNED
    assert reg.owner_of("hyb", 1, 3) == "a" and reg.owner_of("hyb", 0, 5) == "a"


def test_separate_groups_may_each_own_the_same_id() -> None:
    # The control: without the overlay, block 3 of each group is other memory.
    reg = _registry(APART)
    _register(reg, "a", "apart", [[3], []])
    _register(reg, "b", "apart", [[], [3]])
    assert (reg.owner_of("apart", 0, 3), reg.owner_of("apart", 1, 3)) == ("a", "b")


def test_one_request_listing_a_block_in_both_groups_is_refused() -> None:
    reg = _registry(HYBRID)
    with pytest.raises(Refusal) as info:
        reg.check_register("a", 1, Role.RECEIVER, "hyb", "peer", [[3], [3]])
    assert info.value.reason is Reason.DUPLICATE_BLOCK
    assert not reg.live


def test_a_released_request_frees_its_blocks_in_every_overlaid_group() -> None:
    reg = _registry(HYBRID)
    _register(reg, "a", "hyb", [[3], [5]])
    reg.apply(WriteDone("a", 1), 0.0)
    for event in reg.plan_release("a", 1):
        reg.apply(event, 0.0)
    assert reg.owned_blocks() == {}
    _register(reg, "b", "hyb", [[5], [3]])
    assert reg.owned_blocks() == {("hyb", 0): {5: "b", 3: "b"}}


@pytest.mark.parametrize(
    "groups",
    [
        (GroupLayout(ATT, N, overlays=0),),  # over itself
        (GroupLayout(ATT, N), GroupLayout(ATT, N, overlays=1)),  # over itself, later
        (GroupLayout(ATT, N), GroupLayout(ATT, N - 1, overlays=0)),  # block counts differ
        (GroupLayout(ATT, N), GroupLayout(ATT, N, overlays=0), GroupLayout(ATT, N, overlays=1)),
    ],
    ids=["self", "later", "fewer-blocks", "chain"],
)
def test_an_overlay_the_core_cannot_key_is_refused_at_attach(groups: tuple) -> None:
    reg = Registry()
    with pytest.raises(Refusal) as info:
        reg.check_attach(EngineLayout("bad", groups))
    assert info.value.reason is Reason.GROUP_COUNT_MISMATCH
    assert not reg.engines
