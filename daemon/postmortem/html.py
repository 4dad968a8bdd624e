"""``kvpushd journal report``: one self-contained HTML file of a postmortem.

Everything is inline (CSS, the script, the data it draws from), so the file
can be mailed, attached to a ticket or opened on an air-gapped machine; it
loads nothing from anywhere. Tables are plain HTML written here, readable
without the script; the script draws the charts (a timeline of requests
per node, latency histograms) from a JSON block and records how it went in
the page: ``<html data-status="ok">`` at the end of its ``try``, or
``data-status="error"`` with the error shown in ``#errors``. A headless
browser test reads both.

What the page shows is chosen in :mod:`daemon.postmortem.chart`; its CSS and
script are in :mod:`daemon.postmortem.html_assets`.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

import msgspec

from daemon.postmortem.analyse import Analysis, Side
from daemon.postmortem.chart import (
    ST_DONE,
    ST_FAILED,
    ST_REFUSED,
    ST_STUCK,
    ChartData,
    anchor,
    anomalous_requests,
    chart_data,
    choose_timelines,
    state_class,
    summary_class,
)
from daemon.postmortem.formatting import (
    blocks_text,
    first_record_ts,
    format_time,
    key_text,
    ms,
    seconds,
    zone_label,
)
from daemon.postmortem.html_assets import CSS, SCRIPT
from daemon.postmortem.merge import Merged
from daemon.postmortem.timeline import Timeline, timeline
from daemon.postmortem.vocab import RequestKey

DEFAULT_TIMELINES: Final = 200


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
        f"({_e(scope)}); times in {_e(zone_label(first_record_ts(merged.node_first)))}, "
        f"{_e(merged.clocks.reference)}'s clock</p>"
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
            (ST_DONE, "released after done"),
            (ST_FAILED, "released after failed"),
            (ST_REFUSED, "refused"),
            (ST_STUCK, "not released"),
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


def _side_text(sides: Iterable[Side]) -> str:
    return "; ".join(
        f"{s.node} {s.role}: {s.outcome}" + (f" ({s.reason})" if s.reason else "") for s in sides
    )


_Anomalies = tuple[str, str, list[str], list[tuple[str, ...]]]
"""One anomaly table: its CSS class (and id), title, header and rows of escaped cells."""


def _anomaly_tables(analysis: Analysis, link: _Links) -> str:
    t = format_time
    parts: list[_Anomalies] = [
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
            "split-transfers",
            "Transfers whose rank shares ended differently",
            ["transfer", "shares"],
            [
                (
                    _e(t.transfer),
                    "; ".join(f"{link(key)}: {_e(ended)}" for key, ended in t.shares),
                )
                for t in analysis.split_transfers
            ],
        ),
        (
            "integrity",
            "Integrity mismatches (landed bytes differ from the pusher's; the request failed)",
            ["request", "node", "at", "differ", "of", "blocks (group/layer/block)"],
            [
                (
                    link(m.key),
                    _e(m.node),
                    _e(t(m.at)),
                    str(m.mismatched),
                    str(m.checked),
                    _e(blocks_text(m.blocks, m.mismatched)),
                )
                for m in analysis.mismatches
            ],
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
            "Slowest transitions (daemon time; engine holds below)",
            ["ms", "node", "transition", "request", "at"],
            [
                (ms(x.seconds), _e(x.node), _e(x.name), link(x.key), _e(t(x.at)))
                for x in analysis.slowest
            ],
        ),
        (
            "holds",
            "Longest engine holds (done->released: the engine kept its blocks)",
            ["ms", "node", "request", "released at"],
            [(ms(x.seconds), _e(x.node), link(x.key), _e(t(x.at))) for x in analysis.longest_holds],
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
    css = summary_class(summary.final, summary.outcome)
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


def _data_block(data: ChartData) -> str:
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
