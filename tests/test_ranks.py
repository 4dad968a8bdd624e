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
        ("cmpl-1@pp1@tp0", "cmpl-1"),
        ("cmpl-1@pp0", "cmpl-1"),
        ("cmpl-1@tp0@pp1", "cmpl-1@tp0"),  # a transfer named "cmpl-1@tp0", its stage 1
        ("cmpl-1@pp01@tp0", "cmpl-1@pp01"),
    ],
)
def test_a_share_names_its_transfer(request_id: str, transfer: str) -> None:
    assert transfer_of(request_id) == transfer


def test_share_and_transfer_round_trip() -> None:
    for pp_size in (1, 2, 4):
        for tp_size in (1, 2, 4, 8):
            names = {
                share_id("xfer-9", rank, tp_size, stage, pp_size)
                for stage in range(pp_size)
                for rank in range(tp_size)
            }
            assert len(names) == pp_size * tp_size  # every rank its own name
            assert {transfer_of(name) for name in names} == {"xfer-9"}


def test_stages_are_named_before_ranks_and_only_with_more_than_one() -> None:
    assert share_id("T", 1, 2, 1, 2) == "T@pp1@tp1"
    assert share_id("T", 0, 1, 1, 2) == "T@pp1"
    assert share_id("T", 1, 2, 0, 1) == "T@tp1"


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
    HeadTarget,
    UnmappableRanks,
    forgone_sources,
    head_sources,
    head_targets,
    heads_of,
    split_source,
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
    assert head_sources(0, 1, 2, 2) == (HeadSource(0, 0, 2, 0), HeadSource(1, 1, 2, 1))
    assert head_sources(1, 2, 4, 8) == (HeadSource(2, 0, 2, 2), HeadSource(3, 1, 2, 3))
    assert head_sources(1, 2, 2, 2) == (HeadSource(1, 0, 1, 1),)  # same TP: rank to rank


def test_a_prefill_split_for_twice_its_ranks_writes_each_half_to_its_own_decode_rank() -> None:
    # Both halves of the prefill rank's blocks, each its own share named by the decode rank.
    assert head_targets(0, 1, 2, 2) == (HeadTarget(0, 0, 2), HeadTarget(1, 1, 2))
    assert head_targets(1, 2, 4, 8) == (HeadTarget(2, 0, 2), HeadTarget(3, 1, 2))
    assert [head_sources(d, 2, 1, 2, split_tp=2) for d in (0, 1)] == [
        (HeadSource(0, 0, 1, 0),),
        (HeadSource(0, 0, 1, 1),),
    ]
    # Decode replicas of one head read from the prefill's replicas in turn.
    assert [split_source(d, 4, 2, 1) for d in range(4)] == [0, 1, 0, 1]


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


SPLIT_SHAPES = [
    (p_tp, d_tp, heads)
    for heads in (1, 2, 4, 8)
    for p_tp in (1, 2, 4, 8)
    for d_tp in (2, 4, 8, 16)
    if d_tp > p_tp and d_tp % p_tp == 0
]


@pytest.mark.parametrize(("p_tp", "d_tp", "heads"), SPLIT_SHAPES)
def test_a_split_push_writes_every_decode_rank_once_from_a_slice_holding_its_heads(
    p_tp: int, d_tp: int, heads: int
) -> None:
    fed: list[int] = []
    for rank in range(p_tp):
        first, end = heads_of(rank, p_tp, heads)
        for target in head_targets(rank, p_tp, d_tp, heads):
            width = (end - first) // target.slices
            # The slice it reads holds exactly the decode rank's heads.
            assert heads_of(target.share_rank, d_tp, heads) == (
                first + target.slice_index * width,
                first + (target.slice_index + 1) * width,
            )
            # And the decode rank expects exactly this prefill rank's share.
            (source,) = head_sources(target.share_rank, d_tp, p_tp, heads, split_tp=d_tp)
            assert (source.prefill_rank, source.share_rank) == (rank, target.share_rank)
            fed.append(target.share_rank)
    assert sorted(fed) == list(range(d_tp)), "each decode rank has exactly one writer"
    assert unread_prefill_ranks(d_tp, p_tp, heads) == ()


def test_a_decode_with_more_ranks_than_the_prefill_is_refused_unless_the_push_was_split() -> None:
    with pytest.raises(UnmappableRanks, match="only when it splits its push for TP 2"):
        head_sources(0, 2, 1, 2)
    with pytest.raises(UnmappableRanks, match="it pushed for TP 4"):
        head_sources(0, 2, 1, 2, split_tp=4)
    with pytest.raises(UnmappableRanks, match="one TP size must be a multiple"):
        head_sources(0, 2, 3, 2)
    with pytest.raises(UnmappableRanks, match="one TP size must be a multiple"):
        head_sources(0, 3, 2, 6, split_tp=3)


# ---------------------------------------------------------- pipeline stages

from statemachine.ranks import stage_layers, stage_sources, stage_targets  # noqa: E402


def test_stages_split_layers_as_vllm_does_the_remainder_before_the_last_stage() -> None:
    # vllm/distributed/utils.py get_pp_indices: 7 layers over 3 stages are [2, 3, 2].
    assert [stage_layers(s, 3, 7) for s in range(3)] == [(0, 2), (2, 5), (5, 7)]
    assert [stage_layers(s, 2, 2) for s in range(2)] == [(0, 1), (1, 2)]
    assert [stage_layers(s, 4, 10) for s in range(4)] == [(0, 2), (2, 5), (5, 8), (8, 10)]
    with pytest.raises(UnmappableRanks):
        stage_layers(0, 3, 2)


@pytest.mark.parametrize("layers", [2, 4, 7, 8, 12, 32])
@pytest.mark.parametrize(("p_pp", "d_pp"), [(1, 1), (2, 2), (2, 1), (4, 1), (4, 2), (3, 3)])
def test_every_layer_of_every_decode_stage_has_exactly_one_prefill_stage(
    layers: int, p_pp: int, d_pp: int
) -> None:
    if layers < p_pp:
        return
    try:
        plan = {d: stage_sources(d, d_pp, p_pp, layers) for d in range(d_pp)}
    except UnmappableRanks:
        # Only where a prefill stage's layers straddle two decode stages.
        bounds = {stage_layers(d, d_pp, layers)[0] for d in range(d_pp)}
        cuts = {stage_layers(s, p_pp, layers)[0] for s in range(p_pp)}
        assert not bounds <= cuts
        return
    seen: list[int] = []
    for d, sources in plan.items():
        first, end = stage_layers(d, d_pp, layers)
        covered = [layer for s in sources for layer in range(*stage_layers(s, p_pp, layers))]
        assert covered == list(range(first, end)), (d, sources)
        seen.extend(sources)
    assert sorted(seen) == list(range(p_pp))  # each prefill stage writes once


def test_a_prefill_stage_spanning_two_decode_stages_is_refused_with_why() -> None:
    with pytest.raises(UnmappableRanks, match="span two of the decode's 2 stages"):
        stage_sources(0, 2, 1, 2)


@pytest.mark.parametrize("layers", [2, 4, 7, 8, 12, 32])
@pytest.mark.parametrize(("p_pp", "d_pp"), [(1, 2), (1, 4), (2, 4), (1, 3), (2, 3), (3, 4)])
def test_a_split_push_feeds_every_decode_stage_once_from_the_stage_holding_its_layers(
    layers: int, p_pp: int, d_pp: int
) -> None:
    if d_pp > layers:
        return
    try:
        fed = {s: stage_targets(s, p_pp, d_pp, layers) for s in range(p_pp)}
    except UnmappableRanks as exc:
        # Refused only where a decode stage straddles two prefill stages.
        assert "span two of the prefill's" in str(exc)
        cuts = {stage_layers(s, p_pp, layers)[0] for s in range(p_pp)}
        assert any(
            any(lo < cut < hi for cut in cuts)
            for lo, hi in (stage_layers(t, d_pp, layers) for t in range(d_pp))
        )
        return
    assert sorted(t for targets in fed.values() for t in targets) == list(range(d_pp))
    for stage, targets in fed.items():
        first, end = stage_layers(stage, p_pp, layers)
        for target in targets:
            lo, hi = stage_layers(target, d_pp, layers)
            assert first <= lo and hi <= end, (stage, target)
            # The decode stage sees a prefill of its own PP: itself, stage to stage.
            assert stage_sources(target, d_pp, d_pp, layers) == (target,)
