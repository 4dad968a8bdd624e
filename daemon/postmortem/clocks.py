"""Clock offsets between nodes, estimated from the messages they exchanged.

Nodes' wall clocks differ. Messages between daemons bound the difference
from both sides (see :func:`_pair_bounds`), and the midpoint of the
tightest consistent bounds is taken as the offset.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from daemon.postmortem.fold import NodeFold
from daemon.postmortem.formatting import abs_ms, signed_ms
from daemon.postmortem.vocab import (
    K_PEER_REGISTERED,
    K_REGISTERED,
    K_WRITE_DONE,
    K_WRITE_STARTED,
    ROLE_PUSHER,
    ROLE_RECEIVER,
    FloatArray,
    IntArray,
)


@dataclass(frozen=True, slots=True)
class ClockPair:
    """The estimated offset between a pusher node's clock and a receiver node's.

    ``offset`` is the receiver's clock minus the pusher's, in seconds, the
    midpoint of ``low`` and ``high``: the tightest lower and upper bounds
    left once ``trimmed`` (a fraction) of the most extreme bounds on each
    side were set aside to make them consistent (0 when they were already).
    ``contradicting`` counts the bounds the estimate still violates.
    """

    pusher: str
    receiver: str
    offset: float
    low: float
    high: float
    lower_bounds: int
    upper_bounds: int
    requests: int
    trimmed: float
    contradicting: int

    def describe(self) -> str:
        ahead = "ahead of" if self.offset >= 0 else "behind"
        width = self.high - self.low
        bounds = (
            f"between {signed_ms(self.low)} and {signed_ms(self.high)}"
            if math.isfinite(width)
            else f"one-sided bound {signed_ms(self.low if math.isfinite(self.low) else self.high)}"
        )
        text = (
            f"{self.receiver}'s clock runs {abs_ms(self.offset)} {ahead} {self.pusher}'s "
            f"({bounds}), estimated as the robust midpoint of causal bounds from "
            f"{self.requests} request pairs: {self.lower_bounds} lower bounds (the receiver "
            f"journals registered before the pusher's peer_registered) and {self.upper_bounds} "
            f"upper bounds (the pusher journals write_started before the receiver's "
            f"write_started or write_done)"
        )
        if self.trimmed:
            return text + (
                f"; the bounds contradict each other (clock step or drift?): the "
                f"{self.trimmed:.0%} most extreme on each side were set aside, "
                f"{self.contradicting} bounds still disagree with the estimate"
            )
        return text + "; the tightest bounds agree"


@dataclass(frozen=True, slots=True)
class Clocks:
    """Per-node clock offsets relative to ``reference`` (node clock minus reference clock)."""

    reference: str
    offsets: dict[str, float]
    pairs: tuple[ClockPair, ...]
    unpaired: tuple[str, ...]

    def describe(self) -> list[str]:
        lines = [f"times are {self.reference}'s clock"]
        lines += [pair.describe() for pair in self.pairs]
        if self.pairs:
            lines.append(
                "(the pusher's write_done bounds nothing: the receiver's write notification "
                "often arrives before the pusher's completion poll and group commit)"
            )
        lines += [
            f"{node}: no request links it to {self.reference}; its clock is taken as is"
            for node in self.unpaired
        ]
        return lines


# Fractions of the most extreme bounds to set aside, in turn, until the
# remaining lower bounds all sit below the remaining upper bounds.
_TRIMS: Final = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5)


def robust_midpoint(lower: FloatArray, upper: FloatArray) -> tuple[float, float, float, float]:
    """(estimate, low, high, trimmed) for bounds ``lower < x < upper``.

    Every bound comes from causality and holds exactly while both clocks run
    steady, so the tightest ones (max of the lower, min of the upper) are the
    best; trimming only helps when a clock stepped during the journal and
    some bounds became false. With bounds on one side only, that bound is the
    estimate.
    """
    low, high, trim = -math.inf, math.inf, 0.0
    for trim in _TRIMS:
        low = float(np.quantile(lower, 1 - trim, method="higher")) if lower.size else -math.inf
        high = float(np.quantile(upper, trim, method="lower")) if upper.size else math.inf
        if low <= high:
            break
    if not math.isfinite(low) and not math.isfinite(high):
        return 0.0, low, high, 0.0
    if not math.isfinite(high):
        return low, low, high, trim
    if not math.isfinite(low):
        return high, low, high, trim
    return (low + high) / 2, low, high, trim


def _times_of(node: NodeFold, to_global: IntArray, kind: int, n_requests: int) -> FloatArray:
    """Raw time of the (last) record of ``kind`` per global request, NaN where none."""
    out = np.full(n_requests, np.nan)
    mask = (node.kind == kind) & (node.req >= 0)
    out[to_global[node.req[mask]]] = node.ts[mask]
    return out


def _pair_bounds(
    pusher: NodeFold,
    receiver: NodeFold,
    p_map: IntArray,
    r_map: IntArray,
    paired: npt.NDArray[np.bool_],
) -> tuple[FloatArray, FloatArray]:
    """Causal bounds on (receiver clock - pusher clock) from the requests in ``paired``.

    Lower bounds: the receiver journals ``registered`` and only then forwards
    the registration, so the pusher's ``peer_registered`` comes later in true
    time: offset > recv.registered - push.peer_registered.
    Upper bounds: the pusher journals ``write_started`` and only then tells
    the receiver and posts the write; the receiver's ``write_started`` (from
    that message) and ``write_done`` (the write's notification, or the
    pusher's word) come later: offset < recv.write_* - push.write_started.
    The pusher's own ``write_done`` is no bound: the receiver's notification
    often beats the pusher's completion poll and group commit.
    """
    n = len(paired)
    registered = _times_of(receiver, r_map, K_REGISTERED, n)[paired]
    peer_registered = _times_of(pusher, p_map, K_PEER_REGISTERED, n)[paired]
    push_write = _times_of(pusher, p_map, K_WRITE_STARTED, n)[paired]
    recv_write = _times_of(receiver, r_map, K_WRITE_STARTED, n)[paired]
    recv_done = _times_of(receiver, r_map, K_WRITE_DONE, n)[paired]
    lower = registered - peer_registered
    upper = np.concatenate([recv_write - push_write, recv_done - push_write])
    return lower[~np.isnan(lower)], upper[~np.isnan(upper)]


def estimate_clocks(
    nodes: Sequence[NodeFold], to_global: Sequence[IntArray], roles: npt.NDArray[np.int8]
) -> Clocks:
    """Offsets of every node's clock from the first node's, through paired requests.

    ``roles[r, n]`` is the role of node ``n`` for global request ``r``.
    Node pairs are estimated directly, then chained from the reference.
    """
    names = [n.node for n in nodes]
    pairs: list[ClockPair] = []
    edges: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for p, pusher in enumerate(nodes):
        for r, receiver in enumerate(nodes):
            if p == r:
                continue
            paired = (roles[:, p] == ROLE_PUSHER) & (roles[:, r] == ROLE_RECEIVER)
            if not paired.any():
                continue
            lower, upper = _pair_bounds(pusher, receiver, to_global[p], to_global[r], paired)
            if not lower.size and not upper.size:
                continue
            offset, low, high, trim = robust_midpoint(lower, upper)
            contradicting = int((lower > offset).sum() + (upper < offset).sum())
            pairs.append(
                ClockPair(
                    names[p],
                    names[r],
                    offset,
                    low,
                    high,
                    int(lower.size),
                    int(upper.size),
                    int(paired.sum()),
                    trim,
                    contradicting,
                )
            )
            edges[p].append((r, offset))
            edges[r].append((p, -offset))
    offsets = _chain_offsets(len(nodes), edges)
    unpaired = tuple(names[i] for i in range(len(nodes)) if i not in offsets)
    return Clocks(
        reference=names[0],
        offsets={names[i]: offsets.get(i, 0.0) for i in range(len(nodes))},
        pairs=tuple(pairs),
        unpaired=unpaired,
    )


def _chain_offsets(count: int, edges: dict[int, list[tuple[int, float]]]) -> dict[int, float]:
    """Breadth-first from node 0: a node's offset is its neighbour's plus the pair's."""
    offsets = {0: 0.0}
    queue = [0]
    while queue:
        current = queue.pop(0)
        for neighbour, offset in edges.get(current, ()):
            if neighbour not in offsets:
                offsets[neighbour] = offsets[current] + offset
                queue.append(neighbour)
    return offsets
