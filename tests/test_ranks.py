"""TP ranks' shares of one transfer: how they are named, and how a postmortem finds them."""

from __future__ import annotations

import pytest

from daemon.postmortem.filters import RequestMatcher
from statemachine.ranks import share_id, transfer_of


def test_one_rank_is_the_transfer_itself_and_more_ranks_are_named_by_rank() -> None:
    assert share_id("cmpl-1", 0, 1) == "cmpl-1"
    assert [share_id("cmpl-1", r, 2) for r in range(2)] == ["cmpl-1@tp0", "cmpl-1@tp1"]


@pytest.mark.parametrize(
    ("request_id", "transfer"),
    [
        ("cmpl-1@tp0", "cmpl-1"),
        ("cmpl-1@tp13", "cmpl-1"),
        ("a@tp1@tp2", "a@tp1"),
        ("cmpl-1", "cmpl-1"),
        ("cmpl-1@tp", "cmpl-1@tp"),
        ("cmpl-1@tp01", "cmpl-1@tp01"),  # not a name share_id makes
        ("@tp0", "@tp0"),
    ],
)
def test_a_share_names_its_transfer(request_id: str, transfer: str) -> None:
    assert transfer_of(request_id) == transfer


def test_share_and_transfer_round_trip() -> None:
    for tp_size in (1, 2, 4, 8):
        for rank in range(tp_size):
            assert transfer_of(share_id("xfer-9", rank, tp_size)) == "xfer-9"


def test_an_exact_request_filter_finds_every_ranks_share_and_nothing_else() -> None:
    matches = RequestMatcher(["cmpl-1"])
    assert matches(("cmpl-1", 1)) and matches(("cmpl-1@tp0", 1)) and matches(("cmpl-1@tp1", 2))
    assert not matches(("cmpl-10@tp0", 1)) and not matches(("cmpl-2@tp0", 1))
    # One share alone, when asked for by its own name.
    only = RequestMatcher(["cmpl-1@tp1"])
    assert only(("cmpl-1@tp1", 1)) and not only(("cmpl-1@tp0", 1))


# ------------------------------------------------------------- head slices

from statemachine.ranks import (  # noqa: E402 - the head-slice half of the module
    HeadSource,
    UnmappableRanks,
    forgone_sources,
    head_sources,
    heads_of,
    unread_prefill_ranks,
)

SHAPES = [
    (p_tp, d_tp, heads)
    for heads in (1, 2, 4, 8)
    for d_tp in (1, 2, 4, 8)
    for p_tp in (1, 2, 4, 8, 16)
    if p_tp % d_tp == 0
]


def test_vllm_splits_heads_by_rank_and_replicates_beyond_the_head_count() -> None:
    assert [heads_of(r, 2, 2) for r in range(2)] == [(0, 1), (1, 2)]
    assert [heads_of(r, 2, 8) for r in range(2)] == [(0, 4), (4, 8)]
    assert [heads_of(r, 4, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    with pytest.raises(UnmappableRanks):
        heads_of(0, 3, 2)


def test_a_prefill_with_twice_the_ranks_writes_two_halves_of_each_decode_rank() -> None:
    assert head_sources(0, 1, 2, 2) == (HeadSource(0, 0, 2), HeadSource(1, 1, 2))
    assert head_sources(1, 2, 4, 8) == (HeadSource(2, 0, 2), HeadSource(3, 1, 2))
    assert head_sources(1, 2, 2, 2) == (HeadSource(1, 0, 1),)  # same TP: rank to rank


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), SHAPES)
def test_every_destination_head_has_exactly_one_writer_holding_it(
    p_tp: int, d_tp: int, heads: int
) -> None:
    writers: set[int] = set()
    for rank in range(d_tp):
        first, end = heads_of(rank, d_tp, heads)
        covered: list[int] = []
        for source in head_sources(rank, d_tp, p_tp, heads):
            lo, hi = heads_of(source.prefill_rank, p_tp, heads)
            width = (end - first) // source.slices
            # The slice the source writes holds exactly the source's heads.
            assert (lo, hi) == (
                first + source.slice_index * width,
                first + (source.slice_index + 1) * width,
            )
            assert source.prefill_rank not in writers, "one prefill rank feeds two decode ranks"
            writers.add(source.prefill_rank)
            covered.extend(range(lo, hi))
        assert sorted(covered) == list(range(first, end)), (rank, covered)
    assert set(unread_prefill_ranks(d_tp, p_tp, heads)) == set(range(p_tp)) - writers


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), SHAPES)
def test_every_unread_replica_is_ended_by_exactly_one_decode_rank_on_its_own_heads(
    p_tp: int, d_tp: int, heads: int
) -> None:
    ended: list[int] = []
    for rank in range(d_tp):
        first, end = heads_of(rank, d_tp, heads)
        for source in forgone_sources(rank, d_tp, p_tp, heads):
            lo, hi = heads_of(source.prefill_rank, p_tp, heads)
            width = (end - first) // source.slices
            # Its empty receiver sits on the slice of the replica's own heads.
            assert (lo, hi) == (
                first + source.slice_index * width,
                first + (source.slice_index + 1) * width,
            )
            ended.append(source.prefill_rank)
    assert sorted(ended) == sorted(unread_prefill_ranks(d_tp, p_tp, heads))


def test_a_decode_with_more_ranks_than_the_prefill_is_refused_with_why() -> None:
    with pytest.raises(UnmappableRanks, match="TP 1 cannot feed a decode with TP 2"):
        head_sources(0, 2, 1, 2)
    with pytest.raises(UnmappableRanks):
        head_sources(0, 2, 3, 2)
