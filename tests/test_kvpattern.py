"""Tests of the KV block patterns and their checks (daemon/sim/kvpattern.py).

The checks are the oracle of every end-to-end test: if they could miss a
wrong block, a silent-corruption bug in the daemon would pass the suite.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from daemon.sim.kvpattern import (
    HEADER_BYTES,
    PERIOD,
    KvView,
    LayoutError,
    block_pattern,
    blocks_unchanged,
    changed_blocks,
    check_blocks,
    fill_blocks,
    pattern_header,
    snapshot,
)
from schemas.kvlayout import GroupSpec, LayerSpec
from schemas.layout import GroupKind

BLOCK = 4096 + 100  # not a page multiple, longer than one PERIOD


def make_view(
    num_blocks: int = 8, layers: int = 2, block_bytes: int = BLOCK, gap: int = 64
) -> KvView:
    """Two groups in one region "r", layers separated by ``gap`` unused bytes."""
    layer_bytes = num_blocks * block_bytes
    specs = []
    offset = gap
    for _ in range(2):
        layer_specs = []
        for _ in range(layers):
            layer_specs.append(LayerSpec("r", offset))
            offset += layer_bytes + gap
        specs.append(GroupSpec(GroupKind.ATTENTION, num_blocks, block_bytes, tuple(layer_specs)))
    return KvView(specs, {"r": np.zeros(offset, dtype=np.uint8)})


def copy_blocks(src: KvView, dst: KvView, pairs: list[list[tuple[int, int]]]) -> None:
    """What the daemon's WRITE does: destination block <- source block, every layer."""
    for g, group_pairs in enumerate(pairs):
        for layer in range(len(src.groups[g].layers)):
            for d, s in group_pairs:
                dst.block(g, layer, d)[:] = src.block(g, layer, s)


# ----------------------------------------------------------------- patterns


def test_pattern_is_deterministic_and_exactly_sized() -> None:
    a = block_pattern("eng", "req#1", 0, 1, 2, 1 << 20)
    b = block_pattern("eng", "req#1", 0, 1, 2, 1 << 20)
    assert a.dtype == np.uint8 and a.shape == (1 << 20,)
    assert np.array_equal(a, b)
    assert np.array_equal(block_pattern("eng", "req#1", 0, 1, 2, 7), a[:7])


def test_patterns_differ_per_tuple_in_the_header() -> None:
    base = ("eng", "req#1", 0, 0, 0)
    variants = [
        base,
        ("eng2", *base[1:]),
        ("eng", "req#2", 0, 0, 0),
        ("eng", "req#1", 1, 0, 0),
        ("eng", "req#1", 0, 1, 0),
        ("eng", "req#1", 0, 0, 1),
        # Length-prefixed tags: moving a separator between tags changes the tuple.
        ("a|b", "c", 0, 0, 0),
        ("a", "b|c", 0, 0, 0),
    ]
    headers = [block_pattern(*v, 4 * BLOCK)[:HEADER_BYTES].tobytes() for v in variants]
    assert len(set(headers)) == len(variants)
    assert headers[0] == pattern_header(*base)


def test_patterns_differ_in_the_body_too() -> None:
    a = block_pattern("eng", "r", 0, 0, 0, BLOCK)[HEADER_BYTES:]
    b = block_pattern("eng", "r", 0, 0, 1, BLOCK)[HEADER_BYTES:]
    assert (a != b).mean() > 0.9


def test_pattern_never_repeats_on_a_page_boundary() -> None:
    """Swapped pages inside one block must not compare equal."""
    p = block_pattern("eng", "r", 0, 0, 0, 4 * 4096)
    assert PERIOD % 4096 != 0
    assert not np.array_equal(p[4096:8192], p[8192:12288])


def test_filling_a_mib_block_is_cheap() -> None:
    start = time.perf_counter()
    for b in range(64):
        block_pattern("eng", "r", 0, 0, b, 1 << 20)
    assert time.perf_counter() - start < 2.0  # ~0.3 ms each in practice


# ------------------------------------------------------------ fill / check


def test_correct_copy_passes_check() -> None:
    src, dst = make_view(), make_view()
    fill_blocks(src, "P", "r#1", [[0, 1, 2, 3], [4, 5]])
    pairs = [[(6, 2), (7, 3)], [(0, 4), (1, 5)]]
    copy_blocks(src, dst, pairs)
    assert check_blocks(dst, "P", "r#1", pairs) == []


def test_fill_returns_bytes_and_touches_only_listed_blocks() -> None:
    view = make_view()
    before = snapshot(view)
    assert fill_blocks(view, "P", "r#1", [[3], []]) == 2 * BLOCK  # two layers
    assert {(c.group, c.layer, c.block) for c in changed_blocks(before, view)} == {
        (0, 0, 3),
        (0, 1, 3),
    }


@pytest.mark.parametrize("offset", [0, HEADER_BYTES - 1, HEADER_BYTES, 3000, BLOCK - 1])
def test_check_detects_a_single_flipped_byte(offset: int) -> None:
    src, dst = make_view(), make_view()
    fill_blocks(src, "P", "r#1", [[1], []])
    pairs = [[(2, 1)], []]
    copy_blocks(src, dst, pairs)
    dst.block(0, 1, 2)[offset] ^= 0x01
    [mismatch] = check_blocks(dst, "P", "r#1", pairs)
    assert (mismatch.group, mismatch.layer, mismatch.dst_block, mismatch.src_block) == (0, 1, 2, 1)
    assert mismatch.first_bad_offset == offset
    assert mismatch.bad_bytes == 1


def test_check_names_the_source_block_a_front_trim_wrote() -> None:
    """D asked for P's last two blocks; a front-trim wrote P's first two."""
    src, dst = make_view(), make_view()
    fill_blocks(src, "P", "r#1", [[0, 1, 2, 3], []])
    copy_blocks(src, dst, [[(5, 0), (6, 1)], []])  # the bug
    mismatches = check_blocks(dst, "P", "r#1", [[(5, 2), (6, 3)], []])
    assert len(mismatches) == 4  # two blocks, two layers
    by_key = {(m.layer, m.dst_block): m.holds for m in mismatches}
    assert by_key[(0, 5)] == "source block 0 layer 0"
    assert by_key[(1, 6)] == "source block 1 layer 1"


def test_check_detects_layers_swapped() -> None:
    src, dst = make_view(), make_view()
    fill_blocks(src, "P", "r#1", [[0], []])
    dst.block(0, 0, 0)[:] = src.block(0, 1, 0)
    dst.block(0, 1, 0)[:] = src.block(0, 0, 0)
    holds = {m.layer: m.holds for m in check_blocks(dst, "P", "r#1", [[(0, 0)], []])}
    assert holds == {0: "source block 0 layer 1", 1: "source block 0 layer 0"}


def test_check_rejects_another_incarnations_residue_and_zeros() -> None:
    src, dst = make_view(), make_view()
    fill_blocks(src, "P", "r#1", [[0], []])
    copy_blocks(src, dst, [[(0, 0)], []])
    stale = check_blocks(dst, "P", "r#2", [[(0, 0)], []])
    assert len(stale) == 2 and all(m.holds == "unknown" for m in stale)
    missing = check_blocks(dst, "P", "r#1", [[(1, 0)], []])
    assert len(missing) == 2 and all(m.holds == "zeros" for m in missing)


def test_check_rejects_more_groups_than_the_layout() -> None:
    with pytest.raises(LayoutError):
        check_blocks(make_view(), "P", "r", [[], [], []])


# ---------------------------------------------------------- unchanged check


def test_blocks_unchanged_allows_only_the_listed_blocks() -> None:
    view = make_view()
    fill_blocks(view, "D", "bg", [range(8), range(8)])
    before = snapshot(view)
    view.block(1, 0, 4)[10] ^= 0xFF
    assert blocks_unchanged(before, view, [[], [4]])
    assert not blocks_unchanged(before, view, [[4], []])
    assert not blocks_unchanged(before, view)
    [change] = changed_blocks(before, view, [[4], [3, 5]])
    assert (change.group, change.layer, change.block) == (1, 0, 4)


def test_blocks_unchanged_detects_a_write_outside_every_block() -> None:
    """A write overrunning a layer lands in the gap between layers."""
    view = make_view(gap=64)
    before = snapshot(view)
    ext = view.extents[0]
    view.regions["r"][ext.end + 3] = 1
    [change] = changed_blocks(before, view, [range(8), range(8)])
    assert change.block is None and change.offset == ext.end + 3
    assert "outside every block" in str(change)


def test_snapshot_refresh_accepts_new_contents() -> None:
    view = make_view()
    before = snapshot(view)
    fill_blocks(view, "P", "r", [[2], []])
    before.refresh(view, 0, [2])
    assert blocks_unchanged(before, view)


def test_view_refuses_layouts_that_do_not_fit() -> None:
    group = GroupSpec(GroupKind.ATTENTION, 4, 100, (LayerSpec("r", 50),))
    with pytest.raises(LayoutError, match="do not fit"):
        KvView([group], {"r": np.zeros(400, dtype=np.uint8)})
    with pytest.raises(LayoutError, match="no region"):
        KvView([group], {"x": np.zeros(1000, dtype=np.uint8)})
    view = KvView([group], {"r": np.zeros(450, dtype=np.uint8)})
    with pytest.raises(IndexError):
        view.block(0, 0, 4)


def test_every_tuple_in_a_small_space_is_distinct() -> None:
    keys = itertools.product(("P1", "P2"), ("a#1", "a#2"), range(2), range(3), range(16))
    headers = {pattern_header(*k) for k in keys}
    assert len(headers) == 2 * 2 * 2 * 3 * 16
