"""Prefix-cache trim at kernel-block granularity (ARCHITECTURE.md, "Trim").

The decode side registers only the blocks it still has to fill (its
uncomputed suffix); the prefill side registers its whole sequence. Pairing
them wrongly is the classic silent-corruption bug: a front-trim writes the
prefix's KV into the suffix's blocks. Everything here is pure and returns new
lists; inputs are never mutated.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.layout import GroupKind
from schemas.reasons import Reason
from statemachine.errors import TrimRefused


def to_kernel_blocks(logical_ids: Sequence[int], per_logical: int) -> list[int]:
    """Expand logical block ids to kernel block ids: L -> L*r .. L*r+r-1."""
    if per_logical < 1:
        raise ValueError(f"per_logical must be >= 1, got {per_logical}")
    if per_logical == 1:
        return list(logical_ids)
    return [lid * per_logical + k for lid in logical_ids for k in range(per_logical)]


def _last(blocks: list[int], n: int) -> list[int]:
    # Not blocks[-n:]: with n == 0 that slice is the whole list, and a full
    # prefix hit would then push every block.
    return blocks[len(blocks) - n :]


def _refuse(reason: Reason, group: int, n_decode: int, n_prefill: int, why: str) -> TrimRefused:
    return TrimRefused(
        reason,
        f"group {group}: decode has {n_decode} blocks, prefill has {n_prefill}: {why}",
    )


def _trim_ssm(d: list[int], p: list[int], group: int) -> tuple[list[int], list[int]]:
    # SSM state slots pair by position.
    if len(d) == len(p):
        return d, p
    if len(p) > len(d):
        return d, _last(p, len(d))
    if len(d) == len(p) + 1:
        return d[: len(p)], p
    raise _refuse(
        Reason.SSM_COUNT_MISMATCH,
        group,
        len(d),
        len(p),
        "SSM slots differ by more than the one the decode side may have extra",
    )


def _tail_trim(d: list[int], p: list[int], group: int) -> tuple[list[int], list[int]]:
    if len(d) > len(p):
        raise _refuse(
            Reason.DECODE_LONGER_THAN_PREFILL,
            group,
            len(d),
            len(p),
            "the decode side cannot need more blocks than the prefill side computed",
        )
    return d, _last(p, len(d))


def _front_align(
    d: list[int], p: list[int], group: int, padding: int
) -> tuple[list[int], list[int]]:
    # Different ratios on the two sides round the sequence up to different
    # multiples; the extra blocks are padding at the end, so pair from the
    # front, but only within what rounding can explain.
    if abs(len(d) - len(p)) > padding:
        raise _refuse(
            Reason.RATIO_PADDING_EXCEEDED,
            group,
            len(d),
            len(p),
            f"difference exceeds the rounding padding of {padding} blocks",
        )
    n = min(len(d), len(p))
    return d[:n], p[:n]


def apply_prefix_caching(
    decode: Sequence[Sequence[int]],
    prefill: Sequence[Sequence[int]],
    *,
    group_kinds: Sequence[GroupKind],
    decode_per_logical: int = 1,
    prefill_per_logical: int = 1,
) -> tuple[list[list[int]], list[list[int]]]:
    """Pair decode and prefill kernel blocks per group.

    Returns ``(decode, prefill)`` as new lists of lists with equal counts per
    group: ``prefill[g][i]`` is to be written into ``decode[g][i]``. Raises
    :class:`TrimRefused` where the trim rule says refuse.
    """
    n_groups = len(group_kinds)
    if len(decode) != n_groups or len(prefill) != n_groups:
        raise TrimRefused(
            Reason.GROUP_COUNT_MISMATCH,
            f"decode has {len(decode)} groups, prefill has {len(prefill)}, "
            f"the model has {n_groups}",
        )
    hybrid = GroupKind.SSM in group_kinds
    ratios_differ = decode_per_logical != prefill_per_logical
    padding = decode_per_logical + prefill_per_logical

    out_d: list[list[int]] = []
    out_p: list[list[int]] = []
    for g, kind in enumerate(group_kinds):
        d, p = list(decode[g]), list(prefill[g])
        if not d:
            # Full prefix hit for this group: the decode side has it all.
            d, p = [], []
        elif kind is GroupKind.SSM:
            d, p = _trim_ssm(d, p, g)
        elif hybrid and ratios_differ:
            d, p = _front_align(d, p, g, padding)
        else:
            d, p = _tail_trim(d, p, g)
        if len(d) != len(p):
            raise _refuse(
                Reason.BLOCK_COUNT_MISMATCH, g, len(d), len(p), "counts differ after trim"
            )
        out_d.append(d)
        out_p.append(p)
    return out_d, out_p
