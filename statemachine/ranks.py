"""How one transfer's rank shares are named, and which prefill rank feeds which decode rank.

A vLLM instance with TP x PP ranks is one engine per rank, each holding the
KV heads of its TP rank for the layers of its pipeline stage. Prefill rank
(stage ``s``, TP rank ``r``)'s share of transfer ``T`` is the daemon request
``T@pp<s>@tp<r>`` (``@pp<s>`` only with more than one stage, ``@tp<r>`` only
with more than one TP rank), so the two sides' shares pair by name, every
invariant holds per share, and a postmortem asked about ``T`` finds every
share (:func:`transfer_of`). With one rank the share is ``T`` itself.
"""

from __future__ import annotations

import re
from typing import Final, NamedTuple

SEPARATOR: Final = "@tp"
STAGE_SEPARATOR: Final = "@pp"
# What share_id makes: the transfer, then a stage, a rank or both, without leading zeros.
_N = "(?:0|[1-9][0-9]*)"
_SHARE = re.compile(
    rf"^(?P<transfer>.+?)(?:{re.escape(STAGE_SEPARATOR)}{_N}(?:{re.escape(SEPARATOR)}{_N})?"
    rf"|{re.escape(SEPARATOR)}{_N})$"
)


def share_id(transfer_id: str, rank: int, tp_size: int, stage: int = 0, pp_size: int = 1) -> str:
    """The daemon request id of (stage ``stage``, TP rank ``rank``)'s share of ``transfer_id``."""
    staged = transfer_id if pp_size == 1 else f"{transfer_id}{STAGE_SEPARATOR}{stage}"
    return staged if tp_size == 1 else f"{staged}{SEPARATOR}{rank}"


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
#
# When the decode has k times the prefill's ranks, a prefill rank's heads lie
# in k decode ranks: it pushes one share per decode rank it feeds, each from
# the slice of its own blocks holding that rank's heads, named by the decode
# rank (``T@tp<d>`` of the decode's TP size). The prefill can do so only when
# it knows the decode's TP size as it registers its push: its router says so
# on the prefill leg (``split_tp``); otherwise the pair is refused.


class UnmappableRanks(ValueError):
    """The two sides' TP sizes cannot be paired head for head; the message says why."""


class HeadSource(NamedTuple):
    """A prefill rank a decode rank loads from, into head slice ``slice_index`` of ``slices``.

    ``share_rank``: the TP rank naming the share (the prefill rank, or the
    decode rank when the prefill split its push for the decode's ranks).
    """

    prefill_rank: int
    slice_index: int
    slices: int
    share_rank: int


class HeadTarget(NamedTuple):
    """A decode rank a prefill rank pushes to, from head slice ``slice_index`` of ``slices``
    of its own blocks, as the share named by ``share_rank`` (that decode rank)."""

    share_rank: int
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
    decode_rank: int,
    decode_tp: int,
    prefill_tp: int,
    num_kv_heads: int,
    split_tp: int | None = None,
) -> tuple[HeadSource, ...]:
    """The prefill ranks decode rank ``decode_rank`` loads from, one per head range.

    ``split_tp``: the TP size whose ranks name the prefill's shares (its own
    when None). Served: a prefill with as many ranks as the decode or a
    multiple of them; a decode with a multiple of the prefill's ranks only
    when the prefill split its push for exactly this decode's TP size (one
    prefill rank writes into several decode ranks, which it must know when it
    registers its push). Otherwise UnmappableRanks, saying why.
    """
    split_tp = prefill_tp if split_tp is None else split_tp
    if prefill_tp < decode_tp:
        if split_tp != decode_tp:
            raise UnmappableRanks(
                f"a prefill with TP {prefill_tp} feeds a decode with TP {decode_tp} only when "
                f"it splits its push for TP {decode_tp} (its router names the decode's TP "
                f"on the prefill leg); it pushed for TP {split_tp}"
            )
        source = split_source(decode_rank, decode_tp, prefill_tp, num_kv_heads)
        return (HeadSource(source, 0, 1, decode_rank),)
    if split_tp != prefill_tp:
        raise UnmappableRanks(
            f"the prefill pushed for TP {split_tp}, but it has TP {prefill_tp} and the "
            f"decode TP {decode_tp}: shares are named by the prefill's ranks here"
        )
    if prefill_tp % decode_tp:
        raise UnmappableRanks(
            f"a prefill with TP {prefill_tp} cannot feed a decode with TP {decode_tp}: "
            f"one TP size must be a multiple of the other"
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
            sources.append(HeadSource(rank, (lo - first) // width, (end - first) // width, rank))
    return tuple(sources)


def split_source(decode_rank: int, decode_tp: int, prefill_tp: int, num_kv_heads: int) -> int:
    """The one prefill rank that writes decode rank ``decode_rank``'s heads (decode TP larger).

    The prefill ranks holding all of its heads are replicas of each other;
    decode replicas spread over them in turn, so each destination byte has
    one writer and the reads are shared out.
    """
    if decode_tp % prefill_tp:
        raise UnmappableRanks(
            f"a prefill with TP {prefill_tp} cannot feed a decode with TP {decode_tp}: "
            f"one TP size must be a multiple of the other"
        )
    first, end = heads_of(decode_rank, decode_tp, num_kv_heads)
    holders = [
        r for r in range(prefill_tp) if _contains(heads_of(r, prefill_tp, num_kv_heads), first, end)
    ]
    if not holders:
        raise UnmappableRanks(
            f"no prefill rank of TP {prefill_tp} holds all of decode rank {decode_rank}'s "
            f"KV heads {first}-{end - 1}"
        )
    return holders[_replica(decode_rank, decode_tp, num_kv_heads) % len(holders)]


def head_targets(
    prefill_rank: int, prefill_tp: int, decode_tp: int, num_kv_heads: int
) -> tuple[HeadTarget, ...]:
    """The decode ranks prefill rank ``prefill_rank`` pushes to when it splits for ``decode_tp``.

    The inverse of :func:`split_source`; each target's slice of the prefill
    rank's blocks holds exactly that decode rank's heads. May be empty (a
    prefill replica no decode rank reads from pushes nothing).
    """
    first, end = heads_of(prefill_rank, prefill_tp, num_kv_heads)
    targets: list[HeadTarget] = []
    for rank in range(decode_tp):
        if split_source(rank, decode_tp, prefill_tp, num_kv_heads) != prefill_rank:
            continue
        lo, hi = heads_of(rank, decode_tp, num_kv_heads)
        width = hi - lo
        targets.append(HeadTarget(rank, (lo - first) // width, (end - first) // width))
    return tuple(targets)


def unread_prefill_ranks(decode_tp: int, prefill_tp: int, num_kv_heads: int) -> tuple[int, ...]:
    """Prefill ranks no decode rank reads from (replicated heads): their pushes are forgone.

    None when the decode has more ranks: the prefill then split its push and
    registered nothing for a rank no decode rank reads.
    """
    if prefill_tp < decode_tp:
        return ()
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
            ended.append(HeadSource(rank, (lo - first) // width, (end - first) // width, rank))
    return tuple(ended)


def _contains(heads: tuple[int, int], lo: int, hi: int) -> bool:
    return heads[0] <= lo and hi <= heads[1]


def _replicas(tp_size: int, num_kv_heads: int) -> int:
    """How many ranks hold each KV head (replicas sit on consecutive ranks)."""
    return max(1, tp_size // num_kv_heads)


def _replica(rank: int, tp_size: int, num_kv_heads: int) -> int:
    """Which of its heads' replicas rank ``rank`` is."""
    return rank % _replicas(tp_size, num_kv_heads)


# ------------------------------------------------------------ pipeline stages
#
# vLLM gives pipeline stage s of ``pp`` the layers of its s-th partition: the
# layers split evenly, the remainder spread over the stages before the last
# (vllm/distributed/utils.py get_pp_indices, without VLLM_PP_LAYER_PARTITION;
# the connector checks its own layers against this and refuses otherwise).
# A decode stage takes each prefill stage's layers whole, into the layers of
# its blocks that hold them. A prefill stage whose layers span several decode
# stages writes into each of them, from the layers of its blocks each holds,
# only when it knows the decode's PP size as it registers its push (its
# router says so, as for a decode with more TP ranks): it then names its
# shares by the decode's stages, and the decode sees a prefill of its own PP.


def stage_layers(stage: int, pp_size: int, num_layers: int) -> tuple[int, int]:
    """The layers [first, end) pipeline stage ``stage`` of ``pp_size`` holds."""
    if not 0 <= stage < pp_size or num_layers < pp_size:
        raise UnmappableRanks(f"stage {stage} of {pp_size} with {num_layers} layers")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        sizes[-i] += 1
    first = sum(sizes[:stage])
    return first, first + sizes[stage]


def stage_sources(
    decode_stage: int, decode_pp: int, prefill_pp: int, num_layers: int
) -> tuple[int, ...]:
    """The prefill stages whose layers decode stage ``decode_stage`` holds, in layer order.

    Served: every prefill stage's layers lie inside one decode stage's (equal
    PP sizes, or a prefill with more stages whose boundaries fall on the
    decode's). Otherwise UnmappableRanks, saying which stage straddles.
    """
    first, end = stage_layers(decode_stage, decode_pp, num_layers)
    sources: list[int] = []
    for stage in range(prefill_pp):
        lo, hi = stage_layers(stage, prefill_pp, num_layers)
        if hi <= first or end <= lo:
            continue
        if not (first <= lo and hi <= end):
            raise UnmappableRanks(
                f"prefill stage {stage} of {prefill_pp} holds layers {lo}-{hi - 1}, which "
                f"span two of the decode's {decode_pp} stages: a prefill stage must write "
                f"into one decode stage"
            )
        sources.append(stage)
    return tuple(sources)


def stage_targets(
    prefill_stage: int, prefill_pp: int, decode_pp: int, num_layers: int
) -> tuple[int, ...]:
    """The decode stages prefill stage ``prefill_stage`` pushes to when it splits for ``decode_pp``.

    Each decode stage's layers must lie inside one prefill stage's (a decode
    stage fed by two prefill stages is mapped without a split, by
    :func:`stage_sources`); otherwise UnmappableRanks, saying which straddles.
    """
    first, end = stage_layers(prefill_stage, prefill_pp, num_layers)
    targets: list[int] = []
    for stage in range(decode_pp):
        lo, hi = stage_layers(stage, decode_pp, num_layers)
        if hi <= first or end <= lo:
            continue
        if not (first <= lo and hi <= end):
            raise UnmappableRanks(
                f"decode stage {stage} of {decode_pp} holds layers {lo}-{hi - 1}, which span "
                f"two of the prefill's {prefill_pp} stages: a split push feeds each decode "
                f"stage from one prefill stage"
            )
        targets.append(stage)
    return tuple(targets)
