"""The simulated model's layout and the oracle's block pairing.

A :class:`SimGroup` is one KV-cache group of the model a simulated engine
(:class:`daemon.sim.engine.SimEngine`) holds; a :data:`SimLayout` is its
groups in order. :func:`expand` turns logical block ids into kernel block
ids and :func:`tail_pairs` gives the (destination, source) kernel pairs a
plain tail-aligned push must produce.

Block expansion and pairing are reimplemented here, not imported from the
core: the simulated engine is an oracle for the daemon, so it must not share
the daemon's logic.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from schemas.layout import GroupKind


class SimError(Exception):
    """A simulated engine was misused (wrong role, unknown request, bad layout)."""


class SimGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One KV-cache group of the simulated model; ``layers`` is a count."""

    num_blocks: int
    block_bytes: int
    kind: GroupKind = GroupKind.ATTENTION
    layers: int = 1
    per_logical: int = 1


SimLayout = tuple[SimGroup, ...]


def parse_layout(text: str) -> SimLayout:
    """A layout from JSON: a list of :class:`SimGroup` objects."""
    return msgspec.json.decode(text, type=SimLayout)


def expand(layout: SimLayout, logical: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Logical ids per group -> kernel ids: L -> L*r .. L*r+r-1; SSM groups as is."""
    if len(logical) != len(layout):
        raise SimError(f"{len(logical)} block lists for {len(layout)} groups")
    return tuple(
        tuple(ids)
        if group.kind is GroupKind.SSM
        else tuple(b * group.per_logical + k for b in ids for k in range(group.per_logical))
        for group, ids in zip(layout, logical, strict=True)
    )


def tail_pairs(
    src_layout: SimLayout,
    src_logical: Sequence[Sequence[int]],
    dst_layout: SimLayout,
    dst_logical: Sequence[Sequence[int]],
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The expected (destination, source) kernel pairs for plain tail alignment.

    Per group, the prefill side's last N kernel blocks go into the decode
    side's N (N = 0: nothing). Cases the daemon handles differently (SSM or
    ratio padding with unequal counts) must be spelled out by the caller.
    """
    src, dst = expand(src_layout, src_logical), expand(dst_layout, dst_logical)
    pairs = []
    for g, (s, d) in enumerate(zip(src, dst, strict=True)):
        if len(d) > len(s):
            raise SimError(f"group {g}: decode has {len(d)} blocks, prefill only {len(s)}")
        tail = s[len(s) - len(d) :]
        pairs.append(tuple(zip(d, tail, strict=True)))
    return tuple(pairs)
