"""Table-driven tests of the prefix-cache trim (ARCHITECTURE.md, "Trim")."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas.reasons import Reason
from statemachine import GroupKind, TrimRefused, apply_prefix_caching, to_kernel_blocks

A, S = GroupKind.ATTENTION, GroupKind.SSM

# name, decode, prefill, kinds, decode ratio, prefill ratio, expected (decode, prefill)
ACCEPTED = [
    ("no hit", [[0, 1, 2]], [[7, 8, 9]], [A], 1, 1, ([[0, 1, 2]], [[7, 8, 9]])),
    (
        "partial hit tail-trims",
        [[500, 501]],
        [[10, 11, 12, 13, 14]],
        [A],
        1,
        1,
        ([[500, 501]], [[13, 14]]),
    ),
    ("one block left", [[9]], [[1, 2, 3]], [A], 1, 1, ([[9]], [[3]])),
    ("full hit writes nothing", [[]], [[10, 11, 12]], [A], 1, 1, ([[]], [[]])),
    ("full hit on both empty", [[]], [[]], [A], 1, 1, ([[]], [[]])),
    (
        "several groups, each its own hit",
        [[5, 6], [], [40, 41, 42]],
        [[1, 2, 3], [7, 8], [20, 21, 22]],
        [A, A, A],
        1,
        1,
        ([[5, 6], [], [40, 41, 42]], [[2, 3], [], [20, 21, 22]]),
    ),
    ("ssm equal counts kept", [[3]], [[8]], [S], 1, 1, ([[3]], [[8]])),
    ("ssm prefill longer keeps its last", [[3]], [[7, 8]], [S], 1, 1, ([[3]], [[8]])),
    ("ssm decode one longer keeps its first", [[3, 4]], [[8]], [S], 1, 1, ([[3]], [[8]])),
    ("ssm full hit", [[]], [[8]], [S], 1, 1, ([[]], [[]])),
    (
        "hybrid, equal ratios, attention tail-trims",
        [[100, 101], [3]],
        [[10, 11, 12, 13], [8]],
        [A, S],
        2,
        2,
        ([[100, 101], [3]], [[12, 13], [8]]),
    ),
    (
        "hybrid, ratios differ, within padding aligns from the front",
        [[100, 101, 102, 103, 104], [3]],
        [[10, 11, 12, 13], [8]],
        [A, S],
        2,
        1,
        ([[100, 101, 102, 103], [3]], [[10, 11, 12, 13], [8]]),
    ),
    (
        "hybrid, ratios differ, prefill longer within padding",
        [[100, 101], [3]],
        [[10, 11, 12, 13, 14], [8]],
        [A, S],
        1,
        2,
        ([[100, 101], [3]], [[10, 11], [8]]),
    ),
]

# name, decode, prefill, kinds, decode ratio, prefill ratio, reason
REFUSED = [
    (
        "decode longer than prefill",
        [[1, 2, 3]],
        [[7, 8]],
        [A],
        1,
        1,
        Reason.DECODE_LONGER_THAN_PREFILL,
    ),
    ("group count differs", [[1], [2]], [[7]], [A, A], 1, 1, Reason.GROUP_COUNT_MISMATCH),
    ("group kinds count differs", [[1]], [[7]], [A, A], 1, 1, Reason.GROUP_COUNT_MISMATCH),
    ("ssm decode longer by two", [[1, 2, 3]], [[7]], [S], 1, 1, Reason.SSM_COUNT_MISMATCH),
    (
        "hybrid ratios differ beyond padding",
        [[100, 101, 102, 103, 104, 105, 106], [3]],
        [[10, 11, 12], [8]],
        [A, S],
        2,
        1,
        Reason.RATIO_PADDING_EXCEEDED,
    ),
    (
        "hybrid equal ratios, decode longer",
        [[1, 2, 3], [3]],
        [[7, 8], [8]],
        [A, S],
        2,
        2,
        Reason.DECODE_LONGER_THAN_PREFILL,
    ),
]


@pytest.mark.parametrize(
    ("name", "decode", "prefill", "kinds", "dr", "pr", "expected"),
    ACCEPTED,
    ids=[c[0] for c in ACCEPTED],
)
def test_trim_accepts(name, decode, prefill, kinds, dr, pr, expected):
    before = copy.deepcopy((decode, prefill))
    got = apply_prefix_caching(
        decode, prefill, group_kinds=kinds, decode_per_logical=dr, prefill_per_logical=pr
    )
    assert got == expected
    assert (decode, prefill) == before, "inputs must not be mutated"
    for g in range(len(kinds)):
        assert got[0][g] is not decode[g] and got[1][g] is not prefill[g]


@pytest.mark.parametrize(
    ("name", "decode", "prefill", "kinds", "dr", "pr", "reason"),
    REFUSED,
    ids=[c[0] for c in REFUSED],
)
def test_trim_refuses(name, decode, prefill, kinds, dr, pr, reason):
    before = copy.deepcopy((decode, prefill))
    with pytest.raises(TrimRefused) as exc:
        apply_prefix_caching(
            decode, prefill, group_kinds=kinds, decode_per_logical=dr, prefill_per_logical=pr
        )
    assert exc.value.reason is reason
    assert (decode, prefill) == before
    if reason is not Reason.GROUP_COUNT_MISMATCH:
        # The message names the group and both counts, for the operator.
        assert exc.value.message.startswith("group ")
        assert "decode has" in exc.value.message and "prefill has" in exc.value.message


def test_refusal_message_names_group_and_counts():
    with pytest.raises(TrimRefused) as exc:
        apply_prefix_caching([[1], [1, 2, 3]], [[5], [6, 7]], group_kinds=[A, A])
    assert exc.value.message.startswith("group 1: decode has 3 blocks, prefill has 2")


def test_never_front_trims():
    # The silent-corruption bug: pairing the decode suffix with the prefill prefix.
    _, prefill = apply_prefix_caching([[500, 501]], [list(range(10, 15))], group_kinds=[A])
    assert prefill == [[13, 14]]
    assert prefill != [[10, 11]]


@pytest.mark.parametrize(
    ("logical", "ratio", "kernel"),
    [
        ([], 4, []),
        ([0], 1, [0]),
        ([3, 1], 1, [3, 1]),
        ([0], 2, [0, 1]),
        ([2, 5], 2, [4, 5, 10, 11]),
        ([1], 4, [4, 5, 6, 7]),
    ],
)
def test_to_kernel_blocks(logical, ratio, kernel):
    assert to_kernel_blocks(logical, ratio) == kernel


def test_to_kernel_blocks_refuses_bad_ratio():
    with pytest.raises(ValueError, match="per_logical"):
        to_kernel_blocks([1], 0)


@given(st.lists(st.integers(0, 10_000), unique=True, max_size=40), st.integers(0, 40))
def test_attention_tail_alignment_property(prefill, n_decode):
    """Invariant 3: P's last N kernel blocks go into D's N, for any hit length."""
    n_decode = min(n_decode, len(prefill))
    decode = list(range(100_000, 100_000 + n_decode))
    d, p = apply_prefix_caching([decode], [prefill], group_kinds=[A])
    assert d == [decode]
    assert p == [prefill[len(prefill) - n_decode :]]
    assert len(d[0]) == len(p[0])


@given(st.lists(st.integers(0, 50), max_size=10), st.integers(1, 8))
def test_kernel_expansion_property(logical, ratio):
    kernel = to_kernel_blocks(logical, ratio)
    assert len(kernel) == len(logical) * ratio
    assert [k // ratio for k in kernel[::ratio]] == logical
