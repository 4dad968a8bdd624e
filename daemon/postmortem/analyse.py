"""What ``journal replay`` reports: final states, refusals and anomalies, and latency.

Over the requests a :class:`~daemon.postmortem.filters.Filters` selects:
requests never released, sides that disagree, integrity mismatches (with
their blocks), slow transitions, sequence gaps, torn tails, restarts and
records the core rejected on replay.
Renderers (text, JSON, HTML) only read the :class:`Analysis`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, cast

import numpy as np
import numpy.typing as npt

from daemon.postmortem.filters import Filters, in_window, select
from daemon.postmortem.fold import Rejected, TornTail
from daemon.postmortem.merge import Merged, final_label
from daemon.postmortem.vocab import (
    K_DAEMON_STARTED,
    K_FAILED,
    K_INTEGRITY_MISMATCH,
    K_KV_MISMATCH,
    K_REFUSED,
    KIND_NAMES,
    ROLE_NAMES,
    S_DONE,
    S_FAILED,
    S_REFUSED,
    S_RELEASED,
    STATE_LABELS,
    FloatArray,
    IntArray,
    RequestKey,
)
from schemas.events import DaemonStarted, IntegrityMismatch, KvMismatch
from schemas.reasons import Reason
from statemachine.ranks import transfer_of


@dataclass(frozen=True, slots=True)
class Occurrence:
    ts: float
    node: str
    key: RequestKey | None


@dataclass(frozen=True, slots=True)
class RefusalSummary:
    reason: str
    count: int
    first: Occurrence
    last: Occurrence


@dataclass(frozen=True, slots=True)
class Side:
    """One node's part in a request."""

    node: str
    role: str
    final: str
    outcome: str
    reason: str


@dataclass(frozen=True, slots=True)
class RequestSummary:
    key: RequestKey
    label: str
    final: str
    outcome: str
    first: float
    last: float
    sides: tuple[Side, ...]


@dataclass(frozen=True, slots=True)
class Stuck:
    """A side that never reached ``released``."""

    key: RequestKey
    node: str
    state: str
    since: float
    age: float
    last_event: str


@dataclass(frozen=True, slots=True)
class Disagreement:
    key: RequestKey
    sides: tuple[Side, ...]


@dataclass(frozen=True, slots=True)
class SplitTransfer:
    """A transfer whose rank shares (``T@pp<s>@tp<r>``) did not all end the same way.

    ``shares``: each share's request and how it ended (its outcome, with the
    reason of the side that failed or was refused), in request-id order.
    """

    transfer: str
    shares: tuple[tuple[RequestKey, str], ...]


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A receiver's IntegrityMismatch: the bytes that landed were not the pusher's."""

    key: RequestKey
    node: str
    at: float
    checked: int
    mismatched: int
    blocks: tuple[tuple[int, int, int], ...]  # (group, layer, block), the first listed


@dataclass(frozen=True, slots=True)
class BehaviourMismatch:
    """A KvMismatch: a decode engine recomputed a loaded token and its K/V differed.

    Journaled on both nodes (``role`` receiver on the decode's, pusher on the
    prefill's, which quarantined the pairing), after the request may have
    ended as done on both: the load was not this engine's KV.
    """

    key: RequestKey
    node: str
    at: float
    role: str
    engine: str
    peer: str
    peer_engine: str
    layer: int
    position: int
    difference: float
    tolerance: float
    detail: str


@dataclass(frozen=True, slots=True)
class Transition:
    key: RequestKey
    node: str
    name: str
    seconds: float
    at: float


@dataclass(frozen=True, slots=True)
class LatencyRow:
    node: str
    name: str
    count: int
    p50: float
    p99: float
    max: float
    histogram: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SeqGap:
    """Missing envelope sequence numbers (``repeated``: the numbering went backwards)."""

    node: str
    first_missing: int
    last_missing: int
    after_ts: float
    repeated: bool = False

    @property
    def count(self) -> int:
        return self.last_missing - self.first_missing + 1


@dataclass(frozen=True, slots=True)
class Restart:
    """A DaemonStarted record, and the requests failed right after it."""

    node: str
    seq: int
    ts: float
    pid: int
    version: str
    boot_id: str
    restart: bool  # False: the first start of a fresh journal
    failed: tuple[tuple[RequestKey, str], ...]  # (request, state it was caught in)


# Latency histogram bins: 4 per decade from 10 us to 1000 s; the ends catch the rest.
HIST_EDGES: Final = np.logspace(-5, 3, 33)


@dataclass(slots=True)
class _TransitionTable:
    """Every change of state on every side, in step order."""

    req: IntArray
    node: npt.NDArray[np.int8]
    frm: npt.NDArray[np.int8]
    to: npt.NDArray[np.int8]
    seconds: FloatArray
    at: FloatArray
    entered: FloatArray  # [request, node]: when the side entered its last state
    last_kind: npt.NDArray[np.int8]  # [request, node]: kind of the side's last step


def _entered_at_snapshot(merged: Merged, entered: FloatArray) -> None:
    """Requests live at a snapshot entered their state before it: the snapshot says when."""
    for i, node in enumerate(merged.nodes):
        if not node.at_snapshot:
            continue
        index = {k: j for j, k in enumerate(node.keys)}
        for key, known in node.at_snapshot.items():
            entered[merged.to_global[i][index[key]], i] = merged.corrected(i, known.entered)


def _transitions(merged: Merged) -> _TransitionTable:
    width = len(merged.nodes)
    shape = (merged.requests, width)
    entered = np.full(shape, np.nan)
    last_kind = np.full(shape, -1, np.int8)
    side = merged.step_req * width + merged.step_node
    if len(side):
        ends = np.flatnonzero(np.r_[side[1:] != side[:-1], True])
        last_kind[merged.step_req[ends], merged.step_node[ends]] = merged.step_kind[ends]
    live = np.flatnonzero(merged.step_state >= 0)
    states = merged.step_state[live]
    live_side = side[live]
    changed = np.r_[True, (live_side[1:] != live_side[:-1]) | (states[1:] != states[:-1])][
        : len(live)
    ]
    steps = live[changed]
    c_side, c_state, c_ts = live_side[changed], states[changed], merged.step_ts[steps]
    _entered_at_snapshot(merged, entered)
    if len(steps):
        last = np.r_[c_side[1:] != c_side[:-1], True]
        entered[merged.step_req[steps[last]], merged.step_node[steps[last]]] = c_ts[last]
    same = c_side[1:] == c_side[:-1]
    later = steps[1:][same]
    return _TransitionTable(
        req=merged.step_req[later],
        node=merged.step_node[later],
        frm=c_state[:-1][same],
        to=c_state[1:][same],
        seconds=(c_ts[1:] - c_ts[:-1])[same],
        at=c_ts[1:][same],
        entered=entered,
        last_kind=last_kind,
    )


@dataclass(slots=True)
class Analysis:
    """What ``journal replay`` reports, over the requests the filters selected."""

    merged: Merged
    filters: Filters
    selected: IntArray
    by_final: list[tuple[str, int]]
    refusals: list[RefusalSummary]
    never_released: list[Stuck]
    disagreements: list[Disagreement]
    split_transfers: list[SplitTransfer]
    mismatches: list[Mismatch]
    kv_mismatches: list[BehaviourMismatch]
    slowest: list[Transition]  # the daemons' time: every transition but done->released
    longest_holds: list[Transition]  # done->released: the engine held its blocks
    latency: list[LatencyRow]
    gaps: list[SeqGap]
    torn: list[TornTail]
    restarts: list[Restart]
    rejected: list[Rejected]
    damage: list[tuple[str, str]]

    def summaries(self) -> Iterator[RequestSummary]:
        for r in self.selected:
            yield summarize(self.merged, int(r))


def analyse(merged: Merged, filters: Filters | None = None, *, top: int = 10) -> Analysis:
    """Everything ``journal replay`` reports; ``top`` bounds the slowest-transition list."""
    filters = filters or Filters()
    mask = select(merged, filters)
    selected = np.flatnonzero(mask)
    table = _transitions(merged)
    node_ok = [not filters.nodes or name in filters.nodes for name in merged.names]
    return Analysis(
        merged=merged,
        filters=filters,
        selected=selected,
        by_final=_by_final(merged, selected),
        refusals=_refusals(merged, mask, filters),
        never_released=_never_released(merged, selected, table),
        disagreements=_disagreements(merged, selected),
        split_transfers=_split_transfers(merged, selected),
        mismatches=_mismatches(merged, mask),
        kv_mismatches=_kv_mismatches(merged, mask),
        slowest=_slowest(merged, table, mask, top, engine_hold=False),
        longest_holds=_slowest(merged, table, mask, top, engine_hold=True),
        latency=_latency(merged, table, mask),
        gaps=[
            g
            for g in _gaps(merged)
            if node_ok[merged.names.index(g.node)] and in_window(filters, g.after_ts)
        ],
        torn=[t for n, ok in zip(merged.nodes, node_ok, strict=True) if ok for t in n.torn],
        restarts=[
            r
            for r in restarts(merged)
            if node_ok[merged.names.index(r.node)] and in_window(filters, r.ts)
        ],
        rejected=[
            r
            for n, ok in zip(merged.nodes, node_ok, strict=True)
            if ok
            for r in n.rejected
            if in_window(filters, merged.corrected(merged.names.index(r.node), r.ts))
        ],
        damage=[
            (n.node, d) for n, ok in zip(merged.nodes, node_ok, strict=True) if ok for d in n.damage
        ],
    )


def _by_final(merged: Merged, selected: IntArray) -> list[tuple[str, int]]:
    if not len(selected):
        return []
    pairs = merged.req_final[selected].astype(np.int64) * 16 + merged.req_outcome[selected]
    codes, counts = np.unique(pairs, return_counts=True)
    rows = [
        (final_label(int(c) // 16, int(c) % 16), int(n)) for c, n in zip(codes, counts, strict=True)
    ]
    return sorted(rows, key=lambda row: (-row[1], row[0]))


def _side_reason(merged: Merged, r: int, node: int) -> str:
    """Why a side failed (its last failure) or was refused; '' for any other outcome."""
    wanted = {S_FAILED: K_FAILED, S_REFUSED: K_REFUSED}.get(int(merged.outcome[r, node]))
    found = ""
    for j in range(int(merged.start[r]), int(merged.start[r + 1])):
        if merged.step_node[j] == node and merged.step_kind[j] == wanted:
            found = merged.nodes[node].reasons[int(merged.step_local[j])]
    return found


def summarize(merged: Merged, r: int) -> RequestSummary:
    sides = tuple(
        Side(
            node=merged.names[i],
            role=ROLE_NAMES[merged.role[r, i]],
            final=STATE_LABELS[merged.final[r, i]],
            outcome=STATE_LABELS[merged.outcome[r, i]],
            reason=_side_reason(merged, r, i),
        )
        for i in range(len(merged.nodes))
        if merged.final[r, i] >= 0
    )
    return RequestSummary(
        key=merged.keys[r],
        label=merged.label(r),
        final=STATE_LABELS[merged.req_final[r]],
        outcome=STATE_LABELS[merged.req_outcome[r]],
        first=float(merged.req_first[r]),
        last=float(merged.req_last[r]),
        sides=sides,
    )


def _refusals(
    merged: Merged, mask: npt.NDArray[np.bool_], filters: Filters
) -> list[RefusalSummary]:
    """Refusals by reason, with their first and last occurrence (corrected times)."""
    seen: dict[str, list[Occurrence]] = defaultdict(list)
    picks = np.flatnonzero((merged.step_kind == K_REFUSED) & mask[merged.step_req])
    for j in picks:
        n = int(merged.step_node[j])
        reason = merged.nodes[n].reasons[int(merged.step_local[j])]
        key = merged.keys[int(merged.step_req[j])]
        seen[reason].append(Occurrence(float(merged.step_ts[j]), merged.names[n], key))
    # Refusals that name no request (an engine's malformed call) pass only
    # the filters that are not about requests.
    if not filters.on_requests:
        for i, node in enumerate(merged.nodes):
            if filters.nodes and node.node not in filters.nodes:
                continue
            for j in np.flatnonzero((node.kind == K_REFUSED) & (node.req < 0)):
                ts = float(merged.corrected(i, node.ts[j]))
                reason = node.reasons[int(j)]
                if in_window(filters, ts) and (not filters.reasons or reason in filters.reasons):
                    seen[reason].append(Occurrence(ts, node.node, None))
    rows = []
    for reason, items in sorted(seen.items()):
        items.sort(key=lambda o: o.ts)
        rows.append(RefusalSummary(reason, len(items), items[0], items[-1]))
    return rows


def _never_released(merged: Merged, selected: IntArray, table: _TransitionTable) -> list[Stuck]:
    rows = []
    final = merged.final[selected]
    for r_pos, node in zip(*np.nonzero((final >= 0) & (final < S_RELEASED)), strict=True):
        r = int(selected[r_pos])
        since = float(table.entered[r, node])
        kind = int(table.last_kind[r, node])
        rows.append(
            Stuck(
                key=merged.keys[r],
                node=merged.names[node],
                state=STATE_LABELS[merged.final[r, node]],
                since=since,
                age=float(merged.node_last[node]) - since if math.isfinite(since) else math.nan,
                last_event=KIND_NAMES[kind] if kind >= 0 else "(before the snapshot)",
            )
        )
    rows.sort(key=lambda s: (-(s.age if math.isfinite(s.age) else math.inf), s.key, s.node))
    return rows


def _disagreements(merged: Merged, selected: IntArray) -> list[Disagreement]:
    outcome = merged.outcome[selected]
    split = (outcome == S_DONE).any(axis=1) & (outcome == S_FAILED).any(axis=1)
    return [
        Disagreement(merged.keys[int(r)], summarize(merged, int(r)).sides) for r in selected[split]
    ]


def _split_transfers(merged: Merged, selected: IntArray) -> list[SplitTransfer]:
    """Transfers whose rank shares ended differently: one rank loaded, another did not."""
    shares: dict[str, list[int]] = defaultdict(list)
    for r in selected:
        request_id = merged.keys[int(r)][0]
        transfer = transfer_of(request_id)
        if transfer != request_id:
            shares[transfer].append(int(r))
    split = []
    for transfer, rows in sorted(shares.items()):
        ended = [(merged.keys[r], _share_outcome(summarize(merged, r))) for r in rows]
        if len({outcome for _, outcome in ended}) > 1:
            split.append(SplitTransfer(transfer, tuple(sorted(ended))))
    return split


def _share_outcome(summary: RequestSummary) -> str:
    reasons = sorted({side.reason for side in summary.sides if side.reason})
    return summary.outcome + (f" ({', '.join(reasons)})" if reasons else "")


def _kv_mismatches(merged: Merged, mask: npt.NDArray[np.bool_]) -> list[BehaviourMismatch]:
    rows = []
    picks = np.flatnonzero((merged.step_kind == K_KV_MISMATCH) & mask[merged.step_req])
    for j in picks.tolist():
        n = int(merged.step_node[j])
        event = merged.nodes[n].event(int(merged.step_local[j]))
        assert isinstance(event, KvMismatch)  # kept: vocab's KEEP lists hold it
        rows.append(
            BehaviourMismatch(
                merged.keys[int(merged.step_req[j])],
                merged.names[n],
                float(merged.step_ts[j]),
                event.role.value,
                event.engine_id,
                event.peer,
                event.peer_engine,
                event.layer,
                event.position,
                event.difference,
                event.tolerance,
                event.detail,
            )
        )
    rows.sort(key=lambda m: m.at)
    return rows


def _mismatches(merged: Merged, mask: npt.NDArray[np.bool_]) -> list[Mismatch]:
    rows = []
    picks = np.flatnonzero((merged.step_kind == K_INTEGRITY_MISMATCH) & mask[merged.step_req])
    for j in picks.tolist():
        n = int(merged.step_node[j])
        event = merged.nodes[n].event(int(merged.step_local[j]))
        assert isinstance(event, IntegrityMismatch)  # kept: vocab's KEEP lists hold it
        key = merged.keys[int(merged.step_req[j])]
        at = float(merged.step_ts[j])
        rows.append(
            Mismatch(key, merged.names[n], at, event.checked, event.mismatched, event.blocks)
        )
    rows.sort(key=lambda m: m.at)
    return rows


def _transition_name(frm: int, to: int) -> str:
    return f"{STATE_LABELS[frm]}->{STATE_LABELS[to]}"


def _slowest(
    merged: Merged,
    table: _TransitionTable,
    mask: npt.NDArray[np.bool_],
    top: int,
    *,
    engine_hold: bool,
) -> list[Transition]:
    """The longest transitions, either the engines' holds (done->released) or all others.

    Apart because a done request waits for its engine's release, which may
    take seconds by design; mixed in, those holds hide the daemon's slow steps.
    """
    hold = (table.frm == S_DONE) & (table.to == S_RELEASED)
    picks = np.flatnonzero(mask[table.req] & (hold if engine_hold else ~hold))
    if not len(picks) or top <= 0:
        return []
    seconds = table.seconds[picks]
    if len(picks) > top:
        best = np.argpartition(-seconds, top - 1)[:top]
        picks, seconds = picks[best], seconds[best]
    order = np.argsort(-seconds, kind="stable")
    return [
        Transition(
            key=merged.keys[int(table.req[j])],
            node=merged.names[int(table.node[j])],
            name=_transition_name(int(table.frm[j]), int(table.to[j])),
            seconds=float(table.seconds[j]),
            at=float(table.at[j]),
        )
        for j in picks[order]
    ]


def _latency(
    merged: Merged, table: _TransitionTable, mask: npt.NDArray[np.bool_]
) -> list[LatencyRow]:
    picks = np.flatnonzero(mask[table.req])
    group = (
        table.node[picks].astype(np.int64) * 256
        + table.frm[picks].astype(np.int64) * 16
        + table.to[picks]
    )
    rows = []
    for code in np.unique(group):
        values = np.sort(table.seconds[picks[group == code]])
        node, frm, to = int(code) // 256, (int(code) // 16) % 16, int(code) % 16
        clipped = np.clip(values, HIST_EDGES[0], HIST_EDGES[-1])
        histogram, _ = np.histogram(clipped, bins=HIST_EDGES)
        rows.append(
            LatencyRow(
                node=merged.names[node],
                name=_transition_name(frm, to),
                count=len(values),
                p50=float(np.quantile(values, 0.5, method="inverted_cdf")),
                p99=float(np.quantile(values, 0.99, method="inverted_cdf")),
                max=float(values[-1]),
                histogram=tuple(int(c) for c in histogram),
            )
        )
    return rows


def _gaps(merged: Merged) -> list[SeqGap]:
    gaps = []
    for i, node in enumerate(merged.nodes):
        seqs = np.concatenate([node.seq, np.array([r.seq for r in node.rejected], np.int64)])
        times = np.concatenate([node.ts, np.array([r.ts for r in node.rejected], np.float64)])
        if not len(seqs):
            continue
        order = np.argsort(seqs, kind="stable")
        seqs, times = seqs[order], merged.corrected(i, times[order])
        if node.snapshot_seq and seqs[0] > node.snapshot_seq + 1:
            gaps.append(SeqGap(node.node, node.snapshot_seq + 1, int(seqs[0]) - 1, math.nan))
        steps = np.diff(seqs)
        for j in np.flatnonzero(steps > 1):
            gaps.append(SeqGap(node.node, int(seqs[j]) + 1, int(seqs[j + 1]) - 1, float(times[j])))
        for j in np.flatnonzero(np.diff(node.seq) <= 0):
            # A number seen again or out of order: the journal was rewritten or merged wrongly.
            seq = int(node.seq[j + 1])
            gaps.append(SeqGap(node.node, seq, seq, float(merged.corrected(i, node.ts[j])), True))
    return gaps


def restarts(merged: Merged) -> list[Restart]:
    """Every DaemonStarted of every node, found once per merge (timelines ask again)."""
    cached: list[Restart] | None = merged.cache.get("restarts")
    if cached is None:
        cached = merged.cache["restarts"] = _scan_restarts(merged)
    return cached


def _scan_restarts(merged: Merged) -> list[Restart]:
    found = []
    for i, node in enumerate(merged.nodes):
        starts = np.flatnonzero(node.kind == K_DAEMON_STARTED)
        if not len(starts):
            continue
        position = _sorted_positions(merged, i)
        for s in starts:
            # DaemonStarted records are always kept (they name no request).
            started = cast(DaemonStarted, node.event(int(s)))
            failed = []
            j = int(s) + 1
            while j < len(node.kind) and node.kind[j] == K_FAILED:
                if node.req[j] < 0 or node.reasons[j] != Reason.DAEMON_RESTART.value:
                    break
                key = node.keys[int(node.req[j])]
                failed.append((key, _state_before(merged, int(position[j]))))
                j += 1
            found.append(
                Restart(
                    node=node.node,
                    seq=int(node.seq[s]),
                    ts=float(merged.corrected(i, node.ts[s])),
                    pid=started.pid,
                    version=started.version,
                    boot_id=started.boot_id,
                    restart=int(node.seq[s]) > 1,
                    failed=tuple(failed),
                )
            )
    return found


def _sorted_positions(merged: Merged, node: int) -> IntArray:
    """For one node: local record index -> position in the merged step table (-1: none)."""
    positions = np.full(len(merged.nodes[node].seq), -1, np.int64)
    mine = np.flatnonzero(merged.step_node == node)
    positions[merged.step_local[mine]] = mine
    return positions


def _state_before(merged: Merged, j: int) -> str:
    """The state a side was in before step ``j`` (merged position)."""
    side = (merged.step_req[j], merged.step_node[j])
    k = j - 1
    while k >= 0 and (merged.step_req[k], merged.step_node[k]) == side:
        if merged.step_state[k] >= 0:
            return STATE_LABELS[merged.step_state[k]]
        k -= 1
    return "unknown (before the journal)"
