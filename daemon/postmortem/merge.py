"""Every node's folded journal merged into one view of requests, on one clock.

One table of requests keyed by (request id, incarnation), every step of
every node in one array sorted by request, node and sequence number, times
corrected to the reference clock, and each request's sides classified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from daemon.postmortem.clocks import Clocks, estimate_clocks
from daemon.postmortem.fold import NodeFold
from daemon.postmortem.vocab import (
    S_DONE,
    S_FAILED,
    S_REFUSED,
    S_RELEASED,
    STATE_LABELS,
    FloatArray,
    IntArray,
    RequestKey,
)


@dataclass(slots=True)
class Merged:
    """Every node's steps in one table, requests keyed across nodes.

    Steps (request events only) are sorted by (request, node, seq), so one
    request's steps are ``steps[start[r]:start[r + 1]]`` and one side's
    (a request on one node) are contiguous inside that. Per-side arrays are
    ``[request, node]``; ``final``/``outcome`` hold state codes (``S_*``,
    ``S_REFUSED`` for a side that only refused, -1 where the node never saw
    the request). Times are corrected to the reference clock.
    """

    nodes: list[NodeFold]
    names: list[str]
    keys: list[RequestKey]
    to_global: list[IntArray]
    clocks: Clocks
    step_node: npt.NDArray[np.int8]
    step_local: IntArray
    step_req: IntArray
    step_ts: FloatArray
    step_kind: npt.NDArray[np.int8]
    step_state: npt.NDArray[np.int8]
    start: IntArray
    role: npt.NDArray[np.int8]
    final: npt.NDArray[np.int8]
    outcome: npt.NDArray[np.int8]
    first: FloatArray
    last: FloatArray
    req_final: npt.NDArray[np.int8]
    req_outcome: npt.NDArray[np.int8]
    req_first: FloatArray
    req_last: FloatArray
    req_until: FloatArray
    node_first: FloatArray
    node_last: FloatArray
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return len(self.keys)

    @overload
    def corrected(self, node: int, ts: float) -> float: ...
    @overload
    def corrected(self, node: int, ts: FloatArray) -> FloatArray: ...
    def corrected(self, node: int, ts: float | FloatArray) -> float | FloatArray:
        """Node ``node``'s time(s) ``ts`` on the reference clock."""
        return ts - self.clocks.offsets[self.names[node]]

    def label(self, r: int) -> str:
        return final_label(int(self.req_final[r]), int(self.req_outcome[r]))


def final_label(final: int, outcome: int) -> str:
    """How a request ended, in the words of ``kvpushd demo``'s summary."""
    if final == S_RELEASED:
        return "released" if outcome == S_RELEASED else f"released after {STATE_LABELS[outcome]}"
    if final == S_REFUSED:
        return "refused (never live)"
    return f"{STATE_LABELS[final]} (not released)"


def _global_index(nodes: Sequence[NodeFold]) -> tuple[list[RequestKey], list[IntArray]]:
    index: dict[RequestKey, int] = {}
    maps = []
    for node in nodes:
        setdefault = index.setdefault
        maps.append(
            np.fromiter((setdefault(k, len(index)) for k in node.keys), np.int64, len(node.keys))
        )
    return list(index), maps


def _roles(nodes: Sequence[NodeFold], maps: Sequence[IntArray], n: int) -> npt.NDArray[np.int8]:
    roles = np.zeros((n, len(nodes)), dtype=np.int8)
    for i, node in enumerate(nodes):
        roles[maps[i], i] = node.roles
    return roles


def _step_table(
    nodes: Sequence[NodeFold], maps: Sequence[IntArray], clocks: Clocks
) -> tuple[npt.NDArray[Any], ...]:
    """Every request step of every node as (node, local index, request, corrected time,
    kind, state) arrays, sorted by request, then node, then the node's sequence number."""
    picks = [np.flatnonzero(node.req >= 0) for node in nodes]

    def joined(column: Callable[[int, NodeFold, IntArray], npt.NDArray[Any]]) -> npt.NDArray[Any]:
        return np.concatenate(
            [column(i, n, p) for i, (n, p) in enumerate(zip(nodes, picks, strict=True))]
        )

    node_of = joined(lambda i, n, p: np.full(len(p), i, np.int8))
    local = joined(lambda i, n, p: p)
    req = joined(lambda i, n, p: maps[i][n.req[p]])
    ts = joined(lambda i, n, p: n.ts[p] - clocks.offsets[n.node])
    seq = joined(lambda i, n, p: n.seq[p])
    kind = joined(lambda i, n, p: n.kind[p])
    state = joined(lambda i, n, p: n.state[p])
    order = np.lexsort((seq, node_of, req))
    return tuple(a[order] for a in (node_of, local, req, ts, kind, state))


def _span(nodes: Sequence[NodeFold], clocks: Clocks) -> tuple[FloatArray, FloatArray]:
    """Each node's first and last record time, corrected (NaN for an empty journal)."""
    first = [n.ts.min() - clocks.offsets[n.node] if n.records else np.nan for n in nodes]
    last = [n.ts.max() - clocks.offsets[n.node] if n.records else np.nan for n in nodes]
    return np.array(first, np.float64), np.array(last, np.float64)


def merge(nodes: list[NodeFold]) -> Merged:
    """Key requests across nodes, correct clocks, sort every step, classify every request."""
    keys, maps = _global_index(nodes)
    roles = _roles(nodes, maps, len(keys))
    clocks = estimate_clocks(nodes, maps, roles)
    step_node, step_local, step_req, step_ts, step_kind, step_state = _step_table(
        nodes, maps, clocks
    )
    node_first, node_last = _span(nodes, clocks)
    final, outcome, first, last = _sides(
        nodes, maps, len(keys), step_node, step_req, step_ts, step_state
    )
    # A side never released stays alive until its journal ends.
    until = np.where((final >= 0) & (final < S_RELEASED), node_last[None, :], last)
    return Merged(
        nodes=nodes,
        names=[node.node for node in nodes],
        keys=keys,
        to_global=maps,
        clocks=clocks,
        step_node=step_node,
        step_local=step_local,
        step_req=step_req,
        step_ts=step_ts,
        step_kind=step_kind,
        step_state=step_state,
        start=np.searchsorted(step_req, np.arange(len(keys) + 1)).astype(np.int64),
        role=roles,
        final=final,
        outcome=outcome,
        first=first,
        last=last,
        req_final=_merge_final(final),
        req_outcome=_merge_outcome(outcome),
        req_first=_nan_reduce(np.fmin, first, node_first),
        req_last=_nan_reduce(np.fmax, last, node_last),
        req_until=_nan_reduce(np.fmax, until, node_last),
        node_first=node_first,
        node_last=node_last,
    )


def _nan_reduce(ufunc: np.ufunc, values: FloatArray, fallback: FloatArray) -> FloatArray:
    """Per request over nodes, ignoring NaN; a request with no timed step gets the journal span.

    Such a request was live at a snapshot and never moved after it: it was
    alive the whole time the journal covers.
    """
    reduced = ufunc.reduce(values, axis=1) if values.shape[1] else np.full(len(values), np.nan)
    span = ufunc.reduce(fallback) if len(fallback) else np.nan
    return np.where(np.isnan(reduced), span, reduced)


def _sides(
    nodes: Sequence[NodeFold],
    maps: Sequence[IntArray],
    n: int,
    step_node: npt.NDArray[np.int8],
    step_req: IntArray,
    step_ts: FloatArray,
    step_state: npt.NDArray[np.int8],
) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.int8], FloatArray, FloatArray]:
    """Final state, outcome, first and last time of every (request, node) side."""
    width = len(nodes)
    shape = (n, width)
    present = np.zeros(shape, bool)
    for i, to_global in enumerate(maps):
        present[to_global, i] = True
    first = np.full(shape, np.nan)
    last = np.full(shape, np.nan)
    ever_done = np.zeros(shape, bool)
    ever_failed = np.zeros(shape, bool)
    ever_live = np.zeros(shape, bool)
    if len(step_req):
        side = step_req * width + step_node
        bounds = np.flatnonzero(np.r_[True, side[1:] != side[:-1]])
        rows, cols = step_req[bounds], step_node[bounds]
        first[rows, cols] = np.minimum.reduceat(step_ts, bounds)
        last[rows, cols] = np.maximum.reduceat(step_ts, bounds)
        ever_done[rows, cols] = np.logical_or.reduceat(step_state == S_DONE, bounds)
        ever_failed[rows, cols] = np.logical_or.reduceat(step_state == S_FAILED, bounds)
        ever_live[rows, cols] = np.logical_or.reduceat(step_state >= 0, bounds)
    unreleased = np.full(shape, -1, np.int8)
    for i, node in enumerate(nodes):
        if not node.at_snapshot and not node.unreleased:
            continue
        index = {k: j for j, k in enumerate(node.keys)}
        # Live at the snapshot: the side was live, and may have been done or failed.
        snapshot_states = {k: v.state for k, v in node.at_snapshot.items()}
        rows, codes = _keyed_codes(snapshot_states, index, maps[i])
        ever_live[rows, i] = True
        ever_done[rows, i] |= codes == S_DONE
        ever_failed[rows, i] |= codes == S_FAILED
        rows, codes = _keyed_codes(node.unreleased, index, maps[i])
        unreleased[rows, i] = codes
    final = np.where(present, np.where(ever_live, S_RELEASED, S_REFUSED), -1).astype(np.int8)
    final = np.where(unreleased >= 0, unreleased, final).astype(np.int8)
    outcome = np.where(ever_done, S_DONE, final)
    outcome = np.where(ever_failed, S_FAILED, outcome).astype(np.int8)
    return final, outcome, first, last


def _keyed_codes(
    states: dict[RequestKey, int], index: dict[RequestKey, int], to_global: IntArray
) -> tuple[IntArray, npt.NDArray[np.int8]]:
    local = np.fromiter((index[k] for k in states), np.int64, len(states))
    return to_global[local], np.fromiter(states.values(), np.int8, len(states))


def _merge_final(final: npt.NDArray[np.int8]) -> npt.NDArray[np.int8]:
    """Least advanced unreleased side, else released, else refused."""
    stuck = np.where((final >= 0) & (final < S_RELEASED), final, 127).min(axis=1, initial=127)
    released = (final == S_RELEASED).any(axis=1)
    merged = np.where(released, S_RELEASED, S_REFUSED)
    return np.where(stuck < 127, stuck, merged).astype(np.int8)


def _merge_outcome(outcome: npt.NDArray[np.int8]) -> npt.NDArray[np.int8]:
    """Failed if any side failed; done if every live side is done; else the least advanced."""
    live = (outcome >= 0) & (outcome != S_REFUSED)
    failed = (outcome == S_FAILED).any(axis=1)
    all_done = np.where(live, outcome == S_DONE, True).all(axis=1) & live.any(axis=1)
    least = np.where(live, outcome, 127).min(axis=1, initial=127)
    merged = np.where(least < 127, least, S_REFUSED)
    merged = np.where(all_done, S_DONE, merged)
    return np.where(failed, S_FAILED, merged).astype(np.int8)
