"""Which KV cache groups of an engine lie over one memory.

vLLM's hybrid allocator (a sliding-window group beside a full-attention
group) gives each group its layers but lays the groups over the same
tensors: block ``b`` of group 0 and block ``b`` of group 1 are the same
bytes, and its one block pool hands a block id to one group at a time. The
daemon must then own a destination block once across those groups (invariant
1), or two live requests could claim block ``b`` through two groups and
write one memory twice. It finds the overlay from the memory itself, never
from the engine's word: two groups overlay when a layer of one shares a byte
with a layer of the other.

Block ids name the same memory in both groups only when both lay their
blocks out alike (equal block count, size and stride, every overlapping
pair of layers at one offset); any other overlap is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.kvlayout import GroupSpec, LayerSpec


class OverlayRefused(ValueError):
    """Groups share memory in a way block ids cannot name."""


def _span(group: GroupSpec, layer: LayerSpec) -> tuple[str, int, int]:
    return layer.region, layer.offset, layer.offset + group.layer_span


def _overlaps(a: tuple[str, int, int], b: tuple[str, int, int]) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def _check_alike(groups: Sequence[GroupSpec], g: int, h: int) -> None:
    """Raise unless group ``g`` lies over group ``h`` block for block."""
    a, b = groups[g], groups[h]
    if (a.num_blocks, a.block_bytes, a.stride) != (b.num_blocks, b.block_bytes, b.stride):
        raise OverlayRefused(
            f"groups {h} and {g} share memory but differ in block count, size or stride "
            f"({b.num_blocks}x{b.block_bytes}/{b.stride} and {a.num_blocks}x{a.block_bytes}"
            f"/{a.stride}): a block id would name different bytes in each"
        )
    for la in a.layers:
        for lb in b.layers:
            if _overlaps(_span(a, la), _span(b, lb)) and la.offset != lb.offset:
                raise OverlayRefused(
                    f"groups {h} and {g} share memory at different offsets "
                    f"({lb.offset} and {la.offset} in region {la.region!r}): a block id "
                    f"would name different bytes in each"
                )


def group_overlays(groups: Sequence[GroupSpec]) -> tuple[int, ...]:
    """For each group, the earlier group whose memory it lies over; -1 where none.

    Always the first group of the memory, so ownership has one key per
    memory. Raises :class:`OverlayRefused` for an overlap block ids cannot
    name (see the module's docstring).
    """
    spans = [[_span(group, layer) for layer in group.layers] for group in groups]
    out: list[int] = []
    for g in range(len(groups)):
        under = [h for h in range(g) if any(_overlaps(a, b) for a in spans[g] for b in spans[h])]
        for h in under:
            _check_alike(groups, g, h)
        roots = {out[h] if out[h] >= 0 else h for h in under}
        if len(roots) > 1:
            raise OverlayRefused(
                f"group {g} shares memory with groups {sorted(roots)}, which do not share "
                f"theirs: one block id cannot name all of them"
            )
        out.append(roots.pop() if roots else -1)
    return tuple(out)
