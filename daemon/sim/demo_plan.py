"""The demo's plan: which requests it pushes, and the engines' layouts.

The plan (kinds, lengths, engines, block ids) depends only on ``--requests``
and ``--seed``. Destination blocks never collide by accident: request ``i``
runs in slot ``i % WINDOW``, each slot owns a fixed range of block ids on
every engine, and a slot runs its requests one after another, so a range is
reused only after its previous request was released on both sides. The only
collisions are the deliberate ``blocks_owned`` probes.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from daemon.sim.engine import SimGroup, SimLayout
from schemas.reasons import Reason

PREFILL: Final = "prefill"
DECODE: Final = "decode"

WINDOW: Final = 16  # requests in flight, one per slot
SLOT_BLOCKS: Final = 12  # block ids per slot and group; also the longest request
SLIDING_BLOCKS: Final = 4  # group 1 is a sliding-window group: it keeps the last 4 blocks
PROBE_BLOCKS: Final = 1  # a decode block past every slot, claimed only by duplicate probes
LAYERS: Final = (2, 3)  # layers of group 0 and group 1
ENGINES_PER_SIDE: Final = 2


class Kind(enum.StrEnum):
    NO_HIT = "no prefix hit"
    PARTIAL = "partial prefix hit"
    FULL_HIT = "full prefix hit"
    TOO_LONG = Reason.DECODE_LONGER_THAN_PREFILL.value
    BLOCKS_OWNED = Reason.BLOCKS_OWNED.value
    DUPLICATE = Reason.DUPLICATE_REQUEST.value


DELIVERED_KINDS: Final = (Kind.NO_HIT, Kind.PARTIAL, Kind.FULL_HIT)
REFUSED_KINDS: Final = (Kind.TOO_LONG, Kind.BLOCKS_OWNED, Kind.DUPLICATE)
PROBE_KINDS: Final = (Kind.BLOCKS_OWNED, Kind.DUPLICATE)

Logical = tuple[tuple[int, ...], ...]  # logical block ids per group


def expected_outcome(kind: Kind) -> str:
    """The outcome string a request of ``kind`` must end with."""
    return "delivered" if kind in DELIVERED_KINDS else f"refused: {kind.value}"


@dataclass(frozen=True)
class Probe:
    """A registration that must be refused, made while its host request is live.

    ``blocks_owned``: a new request claiming one of the host's destination
    blocks. ``duplicate_request``: the host's own id registered again.
    """

    request_id: str
    kind: Kind


@dataclass(frozen=True)
class Transfer:
    """One request pushed from a prefill engine to a decode engine."""

    request_id: str
    kind: Kind
    slot: int
    prefill_engine: int
    decode_engine: int
    src: Logical  # the prefill side's full sequence
    dst: Logical  # the decode side's uncomputed suffix
    decode_first: bool  # which engine registers first
    probe: Probe | None = None


@dataclass(frozen=True)
class Plan:
    transfers: tuple[Transfer, ...]

    @property
    def probes(self) -> tuple[Probe, ...]:
        return tuple(t.probe for t in self.transfers if t.probe is not None)

    @property
    def size(self) -> int:
        return len(self.transfers) + len(self.probes)

    def kinds(self) -> Counter[Kind]:
        counts = Counter(t.kind for t in self.transfers)
        counts.update(p.kind for p in self.probes)
        return counts

    def expected(self) -> dict[str, str]:
        """Request (or probe) id -> the outcome it must end with."""
        out = {t.request_id: expected_outcome(t.kind) for t in self.transfers}
        out.update({p.request_id: expected_outcome(p.kind) for p in self.probes})
        return out


def refusals_per_kind(n: int) -> int:
    """A few of each refusal: 2 % of the stream each, at least one from 10 requests on."""
    if n < 10:
        return 0
    return max(1, n // 50)


def _spread(rng: random.Random, n: int, count: int, taken: set[int], gap: bool) -> list[int]:
    """``count`` positions in 1..n-1 not in ``taken``; with ``gap``, none adjacent to another."""
    chosen: list[int] = []
    candidates = list(range(1, n))
    rng.shuffle(candidates)
    for p in candidates:
        if len(chosen) == count:
            break
        if p in taken or (gap and (p - 1 in taken or p + 1 in taken)):
            continue
        chosen.append(p)
        taken.add(p)
    return chosen


def _choose_kinds(n: int, rng: random.Random) -> list[Kind]:
    """The kind of each position; a probe's host is the position before it."""
    each = refusals_per_kind(n)
    taken: set[int] = set()
    # Probes first and never adjacent, so the position before each is a free host.
    probes = _spread(rng, n, 2 * each, taken, gap=True)
    hosts = {p - 1 for p in probes}
    taken |= hosts
    too_long = _spread(rng, n, each, taken, gap=False)
    kinds: list[Kind] = []
    for i in range(n):
        if i in probes:
            kinds.append(PROBE_KINDS[probes.index(i) % 2])
        elif i in too_long:
            kinds.append(Kind.TOO_LONG)
        elif i in hosts:
            # A host must own at least one destination block while it is live.
            kinds.append(rng.choice((Kind.NO_HIT, Kind.PARTIAL)))
        else:
            kinds.append(rng.choices(DELIVERED_KINDS, weights=(35, 50, 15))[0])
    return kinds


def _lengths(kind: Kind, rng: random.Random) -> tuple[int, int]:
    """(prefill blocks, decode blocks) of group 0 for a request of ``kind``."""
    if kind is Kind.TOO_LONG:
        length = rng.randint(1, SLOT_BLOCKS - 2)
        return length, length + rng.randint(1, 2)
    if kind is Kind.PARTIAL:
        length = rng.randint(2, SLOT_BLOCKS)
        return length, rng.randint(1, length - 1)
    length = rng.randint(1, SLOT_BLOCKS)
    return length, 0 if kind is Kind.FULL_HIT else length


def _blocks(rng: random.Random, slot: int, counts: Sequence[int]) -> Logical:
    """Block ids from the slot's range, in a shuffled order as a real allocator hands them out."""
    base = slot * SLOT_BLOCKS
    return tuple(tuple(rng.sample(range(base, base + SLOT_BLOCKS), c)) for c in counts)


def make_plan(n: int, seed: int) -> Plan:
    """The request stream: a pure function of ``n`` and ``seed``."""
    rng = random.Random(seed)
    kinds = _choose_kinds(n, rng)
    transfers: list[Transfer] = []
    for i, kind in enumerate(kinds):
        rid = f"r{i:04d}"
        if kind in PROBE_KINDS:
            host = transfers[-1]  # position i-1, a host by construction
            transfers[-1] = dataclasses.replace(host, probe=Probe(rid, kind))
            continue
        slot = len(transfers) % WINDOW
        p_len, d_len = _lengths(kind, rng)
        # Group 1 is a sliding-window group: it holds at most the last few blocks.
        src = _blocks(rng, slot, (p_len, min(p_len, SLIDING_BLOCKS)))
        dst = _blocks(rng, slot, (d_len, min(d_len, SLIDING_BLOCKS, p_len)))
        transfers.append(
            Transfer(
                request_id=rid,
                kind=kind,
                slot=slot,
                prefill_engine=rng.randrange(ENGINES_PER_SIDE),
                decode_engine=rng.randrange(ENGINES_PER_SIDE),
                src=src,
                dst=dst,
                # Mostly decode first (its daemon forwards before the prefill
                # engine registers); the rest exercise the other order.
                decode_first=rng.random() < 0.75,
            )
        )
    return Plan(tuple(transfers))


def layouts(block_bytes: int) -> tuple[SimLayout, SimLayout]:
    """(prefill, decode) layouts: the same model, the decode side has probe blocks too."""
    slots = WINDOW * SLOT_BLOCKS

    def layout(num_blocks: int) -> SimLayout:
        return tuple(SimGroup(num_blocks, block_bytes, layers=n) for n in LAYERS)

    return layout(slots), layout(slots + PROBE_BLOCKS)


def shm_bytes(block_bytes: int) -> int:
    """Shared memory the four engines allocate (blocks only; guards are small)."""
    p, d = layouts(block_bytes)
    per = [sum(g.num_blocks * g.block_bytes * g.layers for g in lay) for lay in (p, d)]
    return ENGINES_PER_SIDE * sum(per)
