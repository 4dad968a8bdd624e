"""``kvpushd journal report``: one self-contained HTML file of a postmortem.

Everything is inline (CSS, the script, the data it draws from), so the file
can be mailed, attached to a ticket or opened on an air-gapped machine; it
loads nothing from anywhere. Tables are plain HTML written here, readable
without the script; the script draws the charts (a timeline of requests
per node, latency histograms) from a JSON block and records how it went in
the page: ``<html data-status="ok">`` at the end of its ``try``, or
``data-status="error"`` with the error shown in ``#errors``. A headless
browser test reads both.
"""

from __future__ import annotations

import datetime as dt
import html
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np

from daemon.postmortem.analyse import HIST_EDGES, Analysis
from daemon.postmortem.formatting import format_time, key_text, ms, seconds
from daemon.postmortem.merge import Merged
from daemon.postmortem.timeline import Timeline, timeline
from daemon.postmortem.vocab import K_REFUSED, S_FAILED, S_REFUSED, S_RELEASED, RequestKey

MAX_BARS: Final = 4000  # request bars drawn in the timeline chart
DEFAULT_TIMELINES: Final = 200

# Colour classes of a request's final state (the chart and the tables).
_DONE, _FAILED, _REFUSED, _STUCK = "st-done", "st-failed", "st-refused", "st-stuck"


def anchor(key: RequestKey) -> str:
    """A stable, HTML-safe fragment id for a request's timeline section."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", lambda m: f"_{ord(m.group()):x}_", key[0])
    return f"req-{safe}-{key[1]}"


def _summary_class(final: str, outcome: str) -> str:
    if final == "released":
        return _FAILED if outcome == "failed" else _DONE
    return _REFUSED if final == "refused" else _STUCK


def state_class(final: int, outcome: int) -> str:
    if final == S_RELEASED:
        return _FAILED if outcome == S_FAILED else _DONE
    if final == S_REFUSED:
        return _REFUSED
    return _STUCK


# ============================================================== choosing what to show


def _anomalous(analysis: Analysis) -> list[RequestKey]:
    """Requests worth a timeline, most alarming first, each once."""
    keys: list[RequestKey] = [s.key for s in analysis.never_released]
    keys += [d.key for d in analysis.disagreements]
    keys += [k for r in analysis.restarts for k, _ in r.failed]
    keys += [r.key for r in analysis.rejected if r.key is not None]
    keys += [t.key for t in analysis.slowest]
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


def chart_data(analysis: Analysis, shown: set[int], first: Sequence[int]) -> dict[str, Any]:
    """What the script draws: bars per (request, node), refusals, restarts, histograms.

    ``shown``: requests whose timeline is written out (their bars link to it);
    ``first``: requests drawn even when the chart has to sample.
    """
    merged = analysis.merged
    bars = []
    for r in _bar_requests(analysis, [*first, *sorted(shown)]):
        css = state_class(int(merged.req_final[r]), int(merged.req_outcome[r]))
        key = merged.keys[r]
        for n in range(len(merged.names)):
            if merged.final[r, n] < 0:
                continue
            start = merged.first[r, n]
            end = max(merged.last[r, n], merged.req_until[r] if css == _STUCK else -math.inf)
            if not math.isfinite(start):  # live since before a snapshot
                start = merged.node_first[n]
            if not math.isfinite(end):
                end = start
            bars.append(
                [
                    n,
                    float(start),
                    float(end),
                    css,
                    key_text(key),
                    merged.label(r),
                    anchor(key) if r in shown else "",
                ]
            )
    refusals = _refusal_marks(analysis)
    restarts = [
        [merged.names.index(r.node), r.ts, f"{r.node} restarted (pid {r.pid})"]
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


def _refusal_marks(analysis: Analysis) -> list[list[Any]]:
    """Every refusal step of a selected request: [node, time, reason, request]."""
    merged = analysis.merged
    mask = np.zeros(merged.requests, bool)
    mask[analysis.selected] = True
    picks = np.flatnonzero((merged.step_kind == K_REFUSED) & mask[merged.step_req])
    marks = []
    for j in picks[:MAX_BARS]:
        node = int(merged.step_node[j])
        reason = merged.nodes[node].reasons[int(merged.step_local[j])]
        key = merged.keys[int(merged.step_req[j])]
        marks.append([node, float(merged.step_ts[j]), reason, key_text(key)])
    return marks


def _utc_offset(ts: float) -> int:
    """Seconds east of UTC here at ``ts``: the script shows the times the CLI prints."""
    offset = dt.datetime.fromtimestamp(ts).astimezone().utcoffset()
    return int(offset.total_seconds()) if offset is not None else 0


# ============================================================== HTML pieces


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _table(
    header: Sequence[str], rows: Iterable[Sequence[str]], *, css: str = "", empty: str = "none"
) -> str:
    """A table of pre-escaped cells (so cells may hold links)."""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    if not body:
        return f'<p class="none">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


class _Links:
    """Request cells: a link to the request's timeline section when it is written out."""

    def __init__(self, merged: Merged, shown: set[int]) -> None:
        self._shown = {merged.keys[r] for r in shown}

    def __call__(self, key: RequestKey | None) -> str:
        if key is None:
            return "-"
        if key in self._shown:
            return f'<a href="#{anchor(key)}">{_e(key_text(key))}</a>'
        return _e(key_text(key))


def _header(analysis: Analysis) -> str:
    merged = analysis.merged
    rows = [
        (
            _e(n.node),
            str(n.records),
            f"{int(n.seq.min())}..{int(n.seq.max())}" if n.records else "-",
            _e(format_time(float(merged.node_first[i]), date=True)),
            _e(format_time(float(merged.node_last[i]), date=True)),
            _e(", ".join(n.sources)),
        )
        for i, n in enumerate(merged.nodes)
    ]
    clocks = "".join(f"<li>{_e(line)}</li>" for line in merged.clocks.describe())
    scope = analysis.filters.describe() or "all requests"
    return (
        "<header><h1>kvpushd postmortem</h1>"
        f'<p class="meta">{len(analysis.selected)} of {merged.requests} requests '
        f"({_e(scope)}); times in local time, {_e(merged.clocks.reference)}'s clock</p>"
        + _table(["node", "records", "seq", "first", "last", "journal"], rows, css="journals")
        + f'<ul class="clocks">{clocks}</ul></header>'
    )


def _summary(analysis: Analysis) -> str:
    merged = analysis.merged
    classes = {
        merged.label(int(r)): state_class(int(merged.req_final[r]), int(merged.req_outcome[r]))
        for r in analysis.selected
    }
    rows = [
        (f'<span class="swatch {classes.get(label, "")}"></span>{_e(label)}', str(count))
        for label, count in analysis.by_final
    ]
    return (
        '<section id="summary"><h2>Requests by final state</h2>'
        + _table(["final state", "requests"], rows, css="final-states")
        + "</section>"
    )


def _chart_section() -> str:
    legend = "".join(
        f'<span class="legend-item"><span class="swatch {css}"></span>{_e(text)}</span>'
        for css, text in (
            (_DONE, "released after done"),
            (_FAILED, "released after failed"),
            (_REFUSED, "refused"),
            (_STUCK, "not released"),
        )
    )
    marks = (
        '<span class="legend-item"><span class="mark-refusal">&#9660;</span>refusal</span>'
        '<span class="legend-item"><span class="mark-restart">|</span>restart</span>'
    )
    return (
        '<section id="chart"><h2>Requests over time, per node</h2>'
        f'<div class="legend">{legend}{marks}</div>'
        '<p id="chart-caption" class="meta">drawing&hellip;</p>'
        '<div class="chart-box"><svg id="timeline-chart" role="img" '
        'aria-label="requests over time per node"></svg></div></section>'
    )


def _latency_section(analysis: Analysis) -> str:
    rows = [
        (_e(row.node), _e(row.name), str(row.count), ms(row.p50), ms(row.p99), ms(row.max))
        for row in analysis.latency
    ]
    return (
        '<section id="latency"><h2>Transition latency</h2>'
        '<div id="histograms" class="histograms"></div>'
        + _table(["node", "transition", "count", "p50 ms", "p99 ms", "max ms"], rows, css="latency")
        + "</section>"
    )


def _side_text(sides: Iterable[Any]) -> str:
    return "; ".join(
        f"{s.node} {s.role}: {s.outcome}" + (f" ({s.reason})" if s.reason else "") for s in sides
    )


def _anomaly_tables(analysis: Analysis, link: _Links) -> str:
    t = format_time
    parts = [
        (
            "never-released",
            "Never released",
            ["request", "node", "state", "since", "age s", "last event"],
            [
                (
                    link(s.key),
                    _e(s.node),
                    _e(s.state),
                    _e(t(s.since)),
                    seconds(s.age),
                    _e(s.last_event),
                )
                for s in analysis.never_released
            ],
        ),
        (
            "disagreements",
            "Sides that disagree (one done, another failed)",
            ["request", "sides"],
            [(link(d.key), _e(_side_text(d.sides))) for d in analysis.disagreements],
        ),
        (
            "refusals",
            "Refusals by reason",
            ["reason", "count", "first", "last"],
            [
                (
                    _e(r.reason),
                    str(r.count),
                    f"{_e(t(r.first.ts))} {_e(r.first.node)} {link(r.first.key)}",
                    f"{_e(t(r.last.ts))} {_e(r.last.node)} {link(r.last.key)}",
                )
                for r in analysis.refusals
            ],
        ),
        (
            "slowest",
            "Slowest transitions",
            ["ms", "node", "transition", "request", "at"],
            [
                (ms(x.seconds), _e(x.node), _e(x.name), link(x.key), _e(t(x.at)))
                for x in analysis.slowest
            ],
        ),
        (
            "restarts",
            "Restarts",
            ["node", "seq", "at", "pid", "requests failed right after (state caught in)"],
            [
                (
                    _e(r.node),
                    str(r.seq),
                    _e(t(r.ts, date=True)),
                    str(r.pid),
                    ", ".join(f"{link(k)} ({_e(s)})" for k, s in r.failed) or "-",
                )
                for r in analysis.restarts
                if r.restart
            ],
        ),
        (
            "gaps",
            "Sequence gaps",
            ["node", "missing", "count", "after"],
            [
                (
                    _e(g.node),
                    f"{g.first_missing}..{g.last_missing}" + (" (repeated)" if g.repeated else ""),
                    str(g.count),
                    _e(t(g.after_ts)),
                )
                for g in analysis.gaps
            ],
        ),
        (
            "torn",
            "Torn tails",
            ["node", "file", "offset", "bytes cut"],
            [(_e(x.node), _e(x.path), str(x.offset), str(x.nbytes)) for x in analysis.torn],
        ),
        (
            "rejected",
            "Records the core rejected on replay",
            ["node", "seq", "at", "request", "why"],
            [
                (_e(r.node), str(r.seq), _e(t(r.ts)), link(r.key), _e(r.message))
                for r in analysis.rejected
            ],
        ),
        (
            "damage",
            "Damage read past with salvage",
            ["node", "damage"],
            [(_e(node), _e(text)) for node, text in analysis.damage],
        ),
    ]
    sections = "".join(
        f'<section class="anomaly" id="anomaly-{css}"><h3>{_e(title)} '
        f'<span class="count">{len(rows)}</span></h3>{_table(header, rows, css=css)}</section>'
        for css, title, header, rows in parts
    )
    return f'<section id="anomalies"><h2>Anomalies</h2>{sections}</section>'


def _timeline_section(item: Timeline) -> str:
    summary = item.summary
    css = _summary_class(summary.final, summary.outcome)
    rows = [
        (
            _e(format_time(s.ts)),
            ms(s.since_previous),
            _e(s.node),
            _e(s.event),
            _e(f"{s.before} -> {s.after}".lstrip() if s.after else ""),
            _e(s.blocks),
            "" if s.nbytes is None else f"{s.nbytes:,}",
            _e(s.detail),
        )
        for s in item.steps
    ]
    header = ["time", "+ms", "node", "event", "state", "blocks", "bytes", "detail"]
    return (
        f'<section class="timeline" id="{anchor(summary.key)}">'
        f'<h3><span class="swatch {css}"></span>{_e(key_text(summary.key))}: {_e(summary.label)}'
        f' <a class="top" href="#anomalies">anomalies</a></h3>'
        f'<p class="meta">{_e(_side_text(summary.sides))}</p>'
        + _table(header, rows, css="steps")
        + "</section>"
    )


def _timelines(merged: Merged, chosen: Sequence[int], total: int) -> str:
    note = (
        f'<p class="meta">{len(chosen)} of {total} requests written out (anomalies first; '
        f"raise --max-timelines for more).</p>"
        if len(chosen) < total
        else ""
    )
    body = "".join(_timeline_section(timeline(merged, r)) for r in chosen)
    return f'<section id="timelines"><h2>Request timelines</h2>{note}{body}</section>'


def _data_block(data: dict[str, Any]) -> str:
    # "</" would end the script element early; JSON allows "<\/" for it.
    text = msgspec.json.encode(data).decode().replace("</", "<\\/")
    return f'<script id="report-data" type="application/json">{text}</script>'


# ============================================================== the page


def render(analysis: Analysis, *, max_timelines: int = DEFAULT_TIMELINES) -> str:
    merged = analysis.merged
    anomalous = anomalous_requests(analysis)
    chosen = choose_timelines(analysis, anomalous, max_timelines)
    shown = set(chosen)
    link = _Links(merged, shown)
    data = chart_data(analysis, shown, anomalous)
    body = (
        _header(analysis)
        + '<div id="errors" class="errors" hidden></div>'
        + _summary(analysis)
        + _chart_section()
        + _latency_section(analysis)
        + _anomaly_tables(analysis, link)
        + _timelines(merged, chosen, len(analysis.selected))
    )
    title = f"kvpushd postmortem: {', '.join(merged.names)}"
    return (
        f'<!DOCTYPE html><html lang="en" data-status="loading"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>{body}"
        f"{_data_block(data)}<script>{SCRIPT}</script></body></html>\n"
    )


def write_report(analysis: Analysis, path: Path, *, max_timelines: int = DEFAULT_TIMELINES) -> None:
    """Write the page atomically: a reader never sees half a report."""
    text = render(analysis, max_timelines=max_timelines)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


CSS: Final = """
:root { --done: #2e8b57; --failed: #e08a1e; --refused: #8a8f98; --stuck: #c0392b;
        --ink: #1d2330; --muted: #5d6675; --line: #d8dde6; --bg: #ffffff; --band: #f4f6f9; }
* { box-sizing: border-box; }
body { font: 13px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: var(--ink);
       background: var(--bg); margin: 0 auto; padding: 16px 24px 64px; max-width: 1400px; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 8px; }
h3 { font-size: 14px; margin: 16px 0 6px; }
.meta, .none { color: var(--muted); margin: 4px 0; }
table { border-collapse: collapse; margin: 4px 0 8px; }
th, td { text-align: left; padding: 2px 10px 2px 0; border-bottom: 1px solid var(--line);
         vertical-align: top; }
th { color: var(--muted); font-weight: 600; }
td { font-variant-numeric: tabular-nums; }
table.steps td:nth-child(8), table.rejected td:nth-child(5) { max-width: 560px; }
a { color: #1f5fbf; text-decoration: none; } a:hover { text-decoration: underline; }
ul.clocks { margin: 6px 0; padding-left: 18px; color: var(--muted); }
.errors { background: #fdecea; color: #7a1b12; border: 1px solid #f5c2bc; padding: 8px 12px;
          white-space: pre-wrap; font-family: ui-monospace, monospace; margin: 12px 0; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px;
          margin-right: 6px; vertical-align: -1px; }
.st-done { background: var(--done); fill: var(--done); }
.st-failed { background: var(--failed); fill: var(--failed); }
.st-refused { background: var(--refused); fill: var(--refused); }
.st-stuck { background: var(--stuck); fill: var(--stuck); }
.legend { display: flex; gap: 16px; flex-wrap: wrap; color: var(--muted); }
.legend-item { display: inline-flex; align-items: center; }
.mark-refusal { color: #b03a2e; margin-right: 4px; font-size: 10px; }
.mark-restart { color: #6a2c91; margin-right: 4px; font-weight: 700; }
.chart-box { overflow-x: auto; border: 1px solid var(--line); border-radius: 4px; }
svg text { font: 11px system-ui, sans-serif; fill: var(--muted); }
svg .lane { fill: var(--band); } svg .bar { cursor: pointer; }
svg .bar.linked:hover { stroke: var(--ink); stroke-width: 1; }
svg .refusal { fill: #b03a2e; } svg .restart { stroke: #6a2c91; stroke-dasharray: 4 3; }
svg .axis { stroke: var(--line); }
.histograms { display: flex; flex-wrap: wrap; gap: 12px; margin-bottom: 8px; }
.histogram { border: 1px solid var(--line); border-radius: 4px; padding: 4px 6px; }
.histogram .title { font-weight: 600; font-size: 12px; }
.histogram rect { fill: #4a78c2; }
section.anomaly h3 .count { color: var(--muted); font-weight: 400; }
section.timeline { border-top: 1px solid var(--line); padding-top: 4px; }
section.timeline:target { background: #fff8e1; }
a.top { font-weight: 400; font-size: 12px; margin-left: 8px; }
"""

SCRIPT: Final = r"""
(function () {
  "use strict";
  var root = document.documentElement;
  var errors = document.getElementById("errors");
  var NS = "http://www.w3.org/2000/svg";
  function fail(message) {
    errors.hidden = false;
    errors.textContent += message + "\n";
    root.setAttribute("data-status", "error");
  }
  window.addEventListener("error", function (e) { fail("script error: " + e.message); });

  function el(tag, attrs, parent, text) {
    var node = document.createElementNS(NS, tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) { node.textContent = text; }
    if (parent) { parent.appendChild(node); }
    return node;
  }
  function pad(n, w) { var s = String(n); while (s.length < w) { s = "0" + s; } return s; }
  function clock(ts, offset, withMs) {
    var d = new Date((ts + offset) * 1000);  // shifted: read back as UTC = local time
    var text = pad(d.getUTCHours(), 2) + ":" + pad(d.getUTCMinutes(), 2) + ":" +
      pad(d.getUTCSeconds(), 2);
    return withMs ? text + "." + pad(d.getUTCMilliseconds(), 3) : text;
  }
  function niceStep(span, target) {
    var raw = span / target, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    var steps = [1, 2, 5, 10];
    for (var i = 0; i < steps.length; i++) { if (steps[i] * mag >= raw) { return steps[i] * mag; } }
    return 10 * mag;
  }
  function ms(seconds) { return (seconds * 1e3).toFixed(3) + " ms"; }

  // Greedy interval packing: each bar takes the first row free at its start.
  function packRows(bars, maxRows) {
    var rowsEnd = [];
    bars.forEach(function (bar) {
      var row = -1;
      for (var i = 0; i < rowsEnd.length; i++) { if (rowsEnd[i] < bar.start) { row = i; break; } }
      if (row < 0) {
        if (rowsEnd.length < maxRows) { row = rowsEnd.length; rowsEnd.push(0); }
        else { row = bar.index % maxRows; }
      }
      rowsEnd[row] = Math.max(rowsEnd[row], bar.end);
      bar.row = row;
    });
    return Math.max(1, rowsEnd.length);
  }

  function drawTimeline(data) {
    var svg = document.getElementById("timeline-chart");
    var width = 1300, left = 110, right = 20, rowH = 5, laneGap = 18, top = 10;
    var span = Math.max(data.t1 - data.t0, 1e-3);
    var x = function (ts) { return left + (ts - data.t0) / span * (width - left - right); };
    var lanes = data.nodes.map(function () { return []; });
    data.bars.forEach(function (b, i) {
      lanes[b[0]].push({ index: i, start: b[1], end: Math.max(b[2], b[1]), css: b[3],
        label: b[4], state: b[5], anchor: b[6] });
    });
    var y = top, laneTops = [], drawn = 0;
    lanes.forEach(function (bars, n) {
      bars.sort(function (a, b) { return a.start - b.start; });
      var rows = packRows(bars, 60);
      var height = rows * rowH + 8;
      laneTops.push([y, height]);
      el("rect", { class: "lane", x: left, y: y, width: width - left - right, height: height },
        svg);
      el("text", { x: 6, y: y + Math.min(height, 24) / 2 + 4 }, svg, data.nodes[n]);
      bars.forEach(function (bar) {
        var x0 = x(bar.start), w = Math.max(1.5, x(bar.end) - x0);
        var rect = el("rect", { class: "bar " + bar.css + (bar.anchor ? " linked" : ""),
          x: x0, y: y + 4 + bar.row * rowH, width: w, height: rowH - 1,
          "data-request": bar.label }, svg);
        el("title", {}, rect, bar.label + " on " + data.nodes[n] + ": " + bar.state + ", " +
          clock(bar.start, data.utcOffset, true) + " .. " + clock(bar.end, data.utcOffset, true));
        if (bar.anchor) {
          rect.addEventListener("click", function () { location.hash = bar.anchor; });
        }
        drawn++;
      });
      y += height + laneGap;
    });
    data.refusals.forEach(function (r) {
      var lane = laneTops[r[0]], cx = x(r[1]);
      var tip = "M" + (cx - 4) + " " + (lane[0] - 6) + " h8 l-4 6 z";
      var mark = el("path", { class: "refusal", d: tip }, svg);
      el("title", {}, mark,
        "refused " + r[2] + ": " + r[3] + " at " + clock(r[1], data.utcOffset, true));
    });
    data.restarts.forEach(function (r) {
      var lane = laneTops[r[0]], rx = x(r[1]);
      var line = el("line", { class: "restart", x1: rx, x2: rx, y1: lane[0] - 6,
        y2: lane[0] + lane[1] + 4 }, svg);
      el("title", {}, line, r[2] + " at " + clock(r[1], data.utcOffset, true));
    });
    var axisY = y - laneGap + 6, step = niceStep(span, 8);
    el("line", { class: "axis", x1: left, x2: width - right, y1: axisY, y2: axisY }, svg);
    for (var t = Math.ceil(data.t0 / step) * step; t <= data.t1 + 1e-9; t += step) {
      el("line", { class: "axis", x1: x(t), x2: x(t), y1: axisY, y2: axisY + 4 }, svg);
      el("text", { x: x(t) - 24, y: axisY + 16 }, svg, clock(t, data.utcOffset, step < 1));
    }
    svg.setAttribute("viewBox", "0 0 " + width + " " + (axisY + 24));
    svg.setAttribute("width", width);
    svg.setAttribute("height", axisY + 24);
    svg.setAttribute("data-bars", String(drawn));
    svg.setAttribute("data-refusals", String(data.refusals.length));
    svg.setAttribute("data-restarts", String(data.restarts.length));
    var requests = {};
    data.bars.forEach(function (b) { requests[b[4]] = true; });
    document.getElementById("chart-caption").textContent =
      Object.keys(requests).length + " of " + data.requests + " requests drawn" +
      (data.sampled ? " (a sample: anomalies first)" : "") + ", " + drawn + " bars, " +
      data.refusals.length + " refusals, " + data.restarts.length + " restarts";
  }

  function drawHistograms(data) {
    var box = document.getElementById("histograms");
    var w = 260, h = 70, left = 4, bottom = 16;
    data.histograms.forEach(function (hist) {
      var card = document.createElement("div");
      card.className = "histogram";
      var title = document.createElement("div");
      title.className = "title";
      title.textContent = hist.title;
      var meta = document.createElement("div");
      meta.className = "meta";
      meta.textContent = "n=" + hist.count + ", p50 " + ms(hist.p50) + ", p99 " + ms(hist.p99) +
        ", max " + ms(hist.max);
      card.appendChild(title);
      card.appendChild(meta);
      var svg = el("svg", { width: w, height: h + bottom, viewBox: "0 0 " + w + " " + (h + bottom),
        "data-count": hist.count }, card);
      var peak = Math.max.apply(null, hist.bins.concat([1]));
      var bw = (w - left) / hist.bins.length;
      hist.bins.forEach(function (count, i) {
        if (!count) { return; }
        var bh = Math.max(1, count / peak * h);
        var bar = el("rect", { x: left + i * bw, y: h - bh, width: bw - 1, height: bh }, svg);
        el("title", {}, bar, count + " in " + ms(data.edges[i]) + " .. " + ms(data.edges[i + 1]));
      });
      ["10us", "1ms", "100ms", "10s", "1000s"].forEach(function (label, k) {
        var anchor = k === 0 ? "start" : k === 4 ? "end" : "middle";
        el("text", { x: left + k * 8 * bw, y: h + 12, "text-anchor": anchor }, svg, label);
      });
      box.appendChild(card);
    });
    box.setAttribute("data-histograms", String(data.histograms.length));
  }

  try {
    var data = JSON.parse(document.getElementById("report-data").textContent);
    drawTimeline(data);
    drawHistograms(data);
    root.setAttribute("data-status", "ok");
  } catch (e) {
    fail("the report script failed: " + (e && e.stack ? e.stack : e));
  }
})();
"""
