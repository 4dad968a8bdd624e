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
