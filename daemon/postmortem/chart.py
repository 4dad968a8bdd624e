"""What the HTML report shows: which requests it writes out, and the data its chart draws.

The report cannot write out every request of a million-event journal, nor
draw a bar for each: the anomalous requests come first (never released,
disagreeing, failed in a restart, rejected, slowest, refused), then the
rest by time, and the chart samples what is left. :func:`chart_data` is the
JSON block the page's script (:mod:`daemon.postmortem.html_assets`) reads.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Sequence
from typing import Final, TypedDict

import numpy as np

from daemon.postmortem.analyse import HIST_EDGES, Analysis
from daemon.postmortem.formatting import key_text
from daemon.postmortem.vocab import K_REFUSED, S_FAILED, S_REFUSED, S_RELEASED, RequestKey

MAX_BARS: Final = 4000  # request bars drawn in the timeline chart

# Colour classes of a request's final state (the chart and the tables).
ST_DONE, ST_FAILED, ST_REFUSED, ST_STUCK = "st-done", "st-failed", "st-refused", "st-stuck"


def anchor(key: RequestKey) -> str:
    """A stable, HTML-safe fragment id for a request's timeline section."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", lambda m: f"_{ord(m.group()):x}_", key[0])
    return f"req-{safe}-{key[1]}"


def summary_class(final: str, outcome: str) -> str:
    """The colour class of a final state and outcome given as labels (a RequestSummary's)."""
    if final == "released":
        return ST_FAILED if outcome == "failed" else ST_DONE
    return ST_REFUSED if final == "refused" else ST_STUCK


Bar = tuple[int, float, float, str, str, str, str]
"""A request's bar on one node: node, start, end, colour class, request, final-state
label, and the anchor of its timeline section ('' when it is not written out)."""
RefusalMark = tuple[int, float, str, str]
"""A refusal: node, time, reason, request."""
RestartMark = tuple[int, float, str]
"""A restart: node, time, caption."""


class Histogram(TypedDict):
    title: str
    count: int
    p50: float
    p99: float
    max: float
    bins: list[int]


class ChartData(TypedDict):
    """The JSON block the page's script reads (keys as the script spells them)."""

    nodes: list[str]
    t0: float
    t1: float
    utcOffset: int
    requests: int
    bars: list[Bar]
    sampled: bool
    refusals: list[RefusalMark]
    restarts: list[RestartMark]
    edges: list[float]
    histograms: list[Histogram]


def state_class(final: int, outcome: int) -> str:
    """The colour class of a final state and outcome given as state codes."""
    if final == S_RELEASED:
        return ST_FAILED if outcome == S_FAILED else ST_DONE
    if final == S_REFUSED:
        return ST_REFUSED
    return ST_STUCK


def _anomalous(analysis: Analysis) -> list[RequestKey]:
    """Requests worth a timeline, most alarming first, each once."""
    keys: list[RequestKey] = [s.key for s in analysis.never_released]
    keys += [d.key for d in analysis.disagreements]
    keys += [m.key for m in analysis.mismatches]
    keys += [k for r in analysis.restarts for k, _ in r.failed]
    keys += [r.key for r in analysis.rejected if r.key is not None]
    keys += [t.key for t in analysis.slowest]
    keys += [t.key for t in analysis.longest_holds]
    keys += [o.key for r in analysis.refusals for o in (r.first, r.last) if o.key is not None]
    merged = analysis.merged
    failed = analysis.selected[merged.req_outcome[analysis.selected] == S_FAILED]
    keys += [merged.keys[int(r)] for r in failed]
    return list(dict.fromkeys(keys))


def anomalous_requests(analysis: Analysis) -> list[int]:
    """Global indices of the requests in :func:`_anomalous`, in the same order."""
    index = {key: r for r, key in enumerate(analysis.merged.keys)}
    return [index[k] for k in _anomalous(analysis) if k in index]


def choose_timelines(analysis: Analysis, anomalous: Sequence[int], limit: int) -> list[int]:
    """Requests to write out in full: the anomalous ones, then the rest by time."""
    chosen = list(anomalous[:limit])
    if len(chosen) < limit:
        merged = analysis.merged
        taken = set(chosen)
        by_time = analysis.selected[np.argsort(merged.req_first[analysis.selected], kind="stable")]
        chosen += [int(r) for r in by_time if int(r) not in taken][: limit - len(chosen)]
    return chosen


def _bar_requests(analysis: Analysis, first: Sequence[int]) -> list[int]:
    """Requests drawn as bars: all of them, or ``first`` and an even sample of the rest."""
    selected = analysis.selected
    if len(selected) <= MAX_BARS:
        return [int(r) for r in selected]
    first = list(first[:MAX_BARS])
    rest = np.setdiff1d(selected, np.array(first, dtype=np.int64))
    room = MAX_BARS - len(first)
    step = max(1, math.ceil(len(rest) / room)) if room else len(rest) + 1
    return sorted({*first, *(int(r) for r in rest[::step][:room])})


# ============================================================== chart data


def chart_data(analysis: Analysis, shown: set[int], first: Sequence[int]) -> ChartData:
    """What the script draws: bars per (request, node), refusals, restarts, histograms.

    ``shown``: requests whose timeline is written out (their bars link to it);
    ``first``: requests drawn even when the chart has to sample.
    """
    merged = analysis.merged
    bars: list[Bar] = []
    for r in _bar_requests(analysis, [*first, *sorted(shown)]):
        css = state_class(int(merged.req_final[r]), int(merged.req_outcome[r]))
        key = merged.keys[r]
        for n in range(len(merged.names)):
            if merged.final[r, n] < 0:
                continue
            start = merged.first[r, n]
            end = max(merged.last[r, n], merged.req_until[r] if css == ST_STUCK else -math.inf)
            if not math.isfinite(start):  # live since before a snapshot
                start = merged.node_first[n]
            if not math.isfinite(end):
                end = start
            bars.append(
                (
                    n,
                    float(start),
                    float(end),
                    css,
                    key_text(key),
                    merged.label(r),
                    anchor(key) if r in shown else "",
                )
            )
    refusals = _refusal_marks(analysis)
    restarts: list[RestartMark] = [
        (merged.names.index(r.node), r.ts, f"{r.node} restarted (pid {r.pid})")
        for r in analysis.restarts
        if r.restart
    ]
    # The chart spans what it draws, not the daemons' idle start-up.
    times = [t for b in bars for t in b[1:3]] + [m[1] for m in refusals + restarts]
    times = [t for t in times if math.isfinite(t)] or [float(np.nanmin(merged.node_first))]
    t0, t1 = min(times), max(times)
    pad = max((t1 - t0) * 0.01, 1e-3)
    return {
        "nodes": merged.names,
        "t0": t0 - pad,
        "t1": t1 + pad,
        "utcOffset": _utc_offset(t0),
        "requests": len(analysis.selected),
        "bars": bars,
        "sampled": len({b[4] for b in bars}) < len(analysis.selected),
        "refusals": refusals,
        "restarts": restarts,
        "edges": [float(e) for e in HIST_EDGES],
        "histograms": [
            {
                "title": f"{row.node} {row.name}",
                "count": row.count,
                "p50": row.p50,
                "p99": row.p99,
                "max": row.max,
                "bins": list(row.histogram),
            }
            for row in analysis.latency
        ],
    }


def _refusal_marks(analysis: Analysis) -> list[RefusalMark]:
    """Every refusal step of a selected request: (node, time, reason, request)."""
    merged = analysis.merged
    mask = np.zeros(merged.requests, bool)
    mask[analysis.selected] = True
    picks = np.flatnonzero((merged.step_kind == K_REFUSED) & mask[merged.step_req])
    marks: list[RefusalMark] = []
    for j in picks[:MAX_BARS]:
        node = int(merged.step_node[j])
        reason = merged.nodes[node].reasons[int(merged.step_local[j])]
        key = merged.keys[int(merged.step_req[j])]
        marks.append((node, float(merged.step_ts[j]), reason, key_text(key)))
    return marks


def _utc_offset(ts: float) -> int:
    """Seconds east of UTC here at ``ts``: the script shows the times the CLI prints."""
    offset = dt.datetime.fromtimestamp(ts).astimezone().utcoffset()
    return int(offset.total_seconds()) if offset is not None else 0
