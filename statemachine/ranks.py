"""How one transfer's tensor-parallel shares are named: one daemon request per rank.

A vLLM instance with TP ranks is one engine per rank, each holding its own
KV heads; the prefill and decode ranks of the same index hold the same heads
when both instances have the same TP size (the fingerprint guarantees it).
Rank ``r``'s share of transfer ``T`` is the daemon request ``T@tp<r>``, so
the two sides' shares pair by name, every invariant holds per share, and a
postmortem asked about ``T`` finds every share (:func:`transfer_of`). With
one rank the share is ``T`` itself.
"""

from __future__ import annotations

import re
from typing import Final, NamedTuple

SEPARATOR: Final = "@tp"
# What share_id makes: the transfer, the separator, a rank without leading zeros.
_SHARE = re.compile(rf"^(?P<transfer>.+){re.escape(SEPARATOR)}(?:0|[1-9][0-9]*)$")


def share_id(transfer_id: str, rank: int, tp_size: int) -> str:
    """The daemon request id of TP rank ``rank``'s share of ``transfer_id``."""
    return transfer_id if tp_size == 1 else f"{transfer_id}{SEPARATOR}{rank}"


def transfer_of(request_id: str) -> str:
    """The transfer a daemon request is a share of (the id itself if it is no share)."""
    match = _SHARE.match(request_id)
    return match.group("transfer") if match else request_id


# ----------------------------------------------------------------- head slices
#
# vLLM gives TP rank r of ``tp`` ranks the KV heads [r*H/tp, (r+1)*H/tp) of a
# model with H KV heads; with more ranks than heads each head is replicated on
# tp/H consecutive ranks. When the prefill has k times the decode's ranks, a
# decode rank holds the heads of k prefill ranks: it takes each head range
# from exactly one prefill rank, into the slice of its blocks that holds those
# heads (a slice engine, schemas/kvlayout.py), so every destination byte has
# one writer. Prefill ranks no decode rank reads from (replicas) push nothing.


class UnmappableRanks(ValueError):
    """The two sides' TP sizes cannot be paired head for head; the message says why."""


class HeadSource(NamedTuple):
    """A prefill rank a decode rank loads from, into head slice ``slice_index`` of ``slices``."""

    prefill_rank: int
    slice_index: int
    slices: int


def heads_of(rank: int, tp_size: int, num_kv_heads: int) -> tuple[int, int]:
    """The KV heads [first, end) TP rank ``rank`` of ``tp_size`` holds."""
    if not 0 <= rank < tp_size or num_kv_heads < 1:
        raise UnmappableRanks(f"rank {rank} of {tp_size} with {num_kv_heads} KV heads")
    if tp_size >= num_kv_heads:
        if tp_size % num_kv_heads:
            raise UnmappableRanks(f"TP {tp_size} is not a multiple of {num_kv_heads} KV heads")
        first = rank // (tp_size // num_kv_heads)
        return first, first + 1
    if num_kv_heads % tp_size:
        raise UnmappableRanks(f"{num_kv_heads} KV heads do not split over TP {tp_size}")
    per = num_kv_heads // tp_size
    return rank * per, (rank + 1) * per


def head_sources(
    decode_rank: int, decode_tp: int, prefill_tp: int, num_kv_heads: int
) -> tuple[HeadSource, ...]:
    """The prefill ranks decode rank ``decode_rank`` loads from, one per head range.

    Served: a prefill with as many ranks as the decode or a multiple of them.
    A decode with more ranks than the prefill would need one prefill rank to
    write into several decode ranks, which the prefill cannot know when it
    registers its push (it has not seen the decode): refused.
    """
    if prefill_tp < decode_tp or prefill_tp % decode_tp:
        raise UnmappableRanks(
            f"a prefill with TP {prefill_tp} cannot feed a decode with TP {decode_tp}: "
            f"the prefill's TP must equal the decode's or be a multiple of it"
        )
    first, end = heads_of(decode_rank, decode_tp, num_kv_heads)
    # This decode rank reads from the prefill replica of the same index, so
    # two decode replicas of one head never share a writer.
    replica = _replica(decode_rank, decode_tp, num_kv_heads) % _replicas(prefill_tp, num_kv_heads)
    sources: list[HeadSource] = []
    for rank in range(prefill_tp):
        lo, hi = heads_of(rank, prefill_tp, num_kv_heads)
        if first <= lo and hi <= end and _replica(rank, prefill_tp, num_kv_heads) == replica:
            width = hi - lo
            sources.append(HeadSource(rank, (lo - first) // width, (end - first) // width))
    return tuple(sources)


def unread_prefill_ranks(decode_tp: int, prefill_tp: int, num_kv_heads: int) -> tuple[int, ...]:
    """Prefill ranks no decode rank reads from (replicated heads): their pushes are forgone."""
    read = {
        source.prefill_rank
        for rank in range(decode_tp)
        for source in head_sources(rank, decode_tp, prefill_tp, num_kv_heads)
    }
    return tuple(rank for rank in range(prefill_tp) if rank not in read)


def forgone_sources(
    decode_rank: int, decode_tp: int, prefill_tp: int, num_kv_heads: int
) -> tuple[HeadSource, ...]:
    """The unread prefill ranks whose pushes decode rank ``decode_rank`` ends.

    Each unread replica is ended by one decode rank: the first that holds its
    heads, with an empty receiver on the slice of those heads (so the
    pairing's head check passes and the push ends with nothing written
    instead of holding the prefill's blocks until its deadline).
    """
    first, end = heads_of(decode_rank, decode_tp, num_kv_heads)
    ended: list[HeadSource] = []
    for rank in unread_prefill_ranks(decode_tp, prefill_tp, num_kv_heads):
        lo, hi = heads_of(rank, prefill_tp, num_kv_heads)
        holders = [
            d for d in range(decode_tp) if _contains(heads_of(d, decode_tp, num_kv_heads), lo, hi)
        ]
        if holders and holders[0] == decode_rank:
            width = hi - lo
            ended.append(HeadSource(rank, (lo - first) // width, (end - first) // width))
    return tuple(ended)


def _contains(heads: tuple[int, int], lo: int, hi: int) -> bool:
    return heads[0] <= lo and hi <= heads[1]


def _replicas(tp_size: int, num_kv_heads: int) -> int:
    """How many ranks hold each KV head (replicas sit on consecutive ranks)."""
    return max(1, tp_size // num_kv_heads)


def _replica(rank: int, tp_size: int, num_kv_heads: int) -> int:
    """Which of its heads' replicas rank ``rank`` is."""
    return rank % _replicas(tp_size, num_kv_heads)
