"""The text output of ``journal replay`` and ``journal timeline``."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from typing import TextIO, TypeVar

from daemon.ops import texttable
from daemon.postmortem.analyse import Analysis, Occurrence, Side
from daemon.postmortem.formatting import (
    blocks_text,
    first_record_ts,
    format_time,
    key_text,
    ms,
    seconds,
    signed_ms,
    zone_label,
)
from daemon.postmortem.merge import Merged
from daemon.postmortem.timeline import Timeline
from daemon.postmortem.vocab import K_DAEMON_STARTED, KIND_NAMES


def table(header: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> str:
    return texttable.table(header, rows, indent=indent)


_Row = TypeVar("_Row")


def _limited(rows: list[_Row], limit: int) -> tuple[list[_Row], str]:
    if limit <= 0 or len(rows) <= limit:
        return rows, ""
    return rows[:limit], f"  ... and {len(rows) - limit} more (--limit, or --json for all)"


def render_replay(analysis: Analysis, out: TextIO, *, limit: int = 20) -> None:
    """The human report of ``journal replay``."""
    merged = analysis.merged
    w = out.write
    w("journals\n")
    header = ["node", "records", "seq", "starts", "first", "last", "journal"]
    w(table(header, _journal_rows(merged)) + "\n")
    w("\nclocks\n")
    for line in merged.clocks.describe():
        w(textwrap.fill(line, 100, initial_indent="  ", subsequent_indent="    ") + "\n")
    scope = analysis.filters.describe()
    zone = zone_label(first_record_ts(merged.node_first))
    w(
        f"\n{len(analysis.selected)} of {merged.requests} requests"
        + (f" ({scope})" if scope else "")
        + f"; times in {zone}, {merged.clocks.reference}'s clock"
        + "\n"
    )
    _section(w, "requests by final state", ["final state", "requests"], analysis.by_final)
    _section(
        w,
        "refusals by reason",
        ["reason", "count", "first (time node request)", "last"],
        [(r.reason, r.count, _occurrence(r.first), _occurrence(r.last)) for r in analysis.refusals],
    )
    stuck, more = _limited(analysis.never_released, limit)
    _section(
        w,
        "never released",
        ["request", "node", "state", "since", "age s", "last event"],
        [
            (key_text(s.key), s.node, s.state, format_time(s.since), seconds(s.age), s.last_event)
            for s in stuck
        ],
        more,
    )
    split, more = _limited(analysis.disagreements, limit)
    _section(
        w,
        "sides that disagree (one done, another failed)",
        ["request", "sides"],
        [(key_text(d.key), "; ".join(_side_text(s) for s in d.sides)) for d in split],
        more,
    )
    split_transfers, more = _limited(analysis.split_transfers, limit)
    _section(
        w,
        "transfers whose rank shares ended differently",
        ["transfer", "shares"],
        [
            (t.transfer, "; ".join(f"{key_text(key)}: {ended}" for key, ended in t.shares))
            for t in split_transfers
        ],
        more,
    )
    bad, more = _limited(analysis.mismatches, limit)
    _section(
        w,
        "integrity mismatches (landed bytes differ from the pusher's; the request failed)",
        ["request", "node", "at", "differ", "of", "blocks (group/layer/block)"],
        [
            (
                key_text(m.key),
                m.node,
                format_time(m.at),
                m.mismatched,
                m.checked,
                blocks_text(m.blocks, m.mismatched),
            )
            for m in bad
        ],
        more,
    )
    kv_bad, more = _limited(analysis.kv_mismatches, limit)
    _section(
        w,
        "kv mismatches (a decode recomputed a loaded token: its K/V differed; pairing quarantined)",
        ["request", "node", "at", "role", "engine", "peer", "layer", "position", "diff", "tol"],
        [
            (
                key_text(m.key),
                m.node,
                format_time(m.at),
                m.role,
                m.engine,
                f"{m.peer}/{m.peer_engine}" if m.peer_engine else m.peer,
                m.layer,
                m.position,
                f"{m.difference:.4g}",
                f"{m.tolerance:.4g}",
            )
            for m in kv_bad
        ],
        more,
    )
    _section(
        w,
        "slowest transitions (daemon time; engine holds below)",
        ["ms", "node", "transition", "request", "at"],
        [
            (ms(t.seconds), t.node, t.name, key_text(t.key), format_time(t.at))
            for t in analysis.slowest
        ],
    )
    _section(
        w,
        "longest engine holds (done->released: the engine kept its blocks)",
        ["ms", "node", "request", "released at"],
        [
            (ms(t.seconds), t.node, key_text(t.key), format_time(t.at))
            for t in analysis.longest_holds
        ],
    )
    _section(
        w,
        "transition latency",
        ["node", "transition", "count", "p50 ms", "p99 ms", "max ms"],
        [
            (row.node, row.name, row.count, ms(row.p50), ms(row.p99), ms(row.max))
            for row in analysis.latency
        ],
    )
    _section(
        w,
        "restarts",
        ["node", "seq", "at", "pid", "boot", "requests failed right after (state caught in)"],
        [
            (
                r.node,
                r.seq,
                format_time(r.ts, date=True),
                r.pid,
                r.boot_id,
                ", ".join(f"{key_text(k)} ({s})" for k, s in r.failed) or "-",
            )
            for r in analysis.restarts
            if r.restart
        ],
    )
    _section(
        w,
        "sequence gaps",
        ["node", "missing", "count", "after"],
        [
            (
                g.node,
                f"{g.first_missing}"
                + ("" if g.count == 1 else f"..{g.last_missing}")
                + (" (seen again / out of order)" if g.repeated else ""),
                g.count,
                format_time(g.after_ts),
            )
            for g in analysis.gaps
        ],
    )
    _section(
        w,
        "torn tails",
        ["node", "file", "offset", "bytes cut"],
        [(t.node, t.path, t.offset, t.nbytes) for t in analysis.torn],
    )
    _section(w, "damage (read past with salvage)", ["node", "damage"], analysis.damage)
    _section(
        w,
        "records the core rejected on replay",
        ["node", "seq", "at", "event", "request", "why"],
        [
            (r.node, r.seq, format_time(r.ts), KIND_NAMES[r.kind], key_text(r.key), r.message)
            for r in analysis.rejected
        ],
    )


def _occurrence(item: Occurrence) -> str:
    return f"{format_time(item.ts)} {item.node} {key_text(item.key)}"


def _journal_rows(merged: Merged) -> list[tuple[object, ...]]:
    rows: list[tuple[object, ...]] = []
    for i, node in enumerate(merged.nodes):
        seqs = f"{int(node.seq.min())}..{int(node.seq.max())}" if node.records else "-"
        starts = int((node.kind == K_DAEMON_STARTED).sum())
        rows.append(
            (
                node.node,
                node.records,
                seqs,
                starts,
                format_time(float(merged.node_first[i]), date=True),
                format_time(float(merged.node_last[i]), date=True),
                ", ".join(node.sources),
            )
        )
    return rows


def _side_text(side: Side) -> str:
    reason = f" ({side.reason})" if side.reason else ""
    return f"{side.node} {side.role}: {side.outcome}{reason}, {side.final}"


def _section(
    w: Callable[[str], int],
    title: str,
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    more: str = "",
) -> None:
    if not rows:
        w(f"\n{title}: none\n")
        return
    w(f"\n{title}\n{table(header, rows)}\n")
    if more:
        w(more + "\n")


def render_timeline(item: Timeline, merged: Merged, out: TextIO) -> None:
    """One request's life as a table, every node interleaved."""
    summary = item.summary
    w = out.write
    sides = "; ".join(_side_text(s) for s in summary.sides) or "-"
    w(f"{key_text(summary.key)}: {summary.label}  [{sides}]\n")
    if item.steps:
        day = format_time(item.steps[0].ts, date=True).split(" ")[0]
        zone = zone_label(item.steps[0].ts)
        w(f"times: {day} {zone}, {merged.clocks.reference}'s clock")
        shifted = [f"{n} {signed_ms(-o)}" for n, o in merged.clocks.offsets.items() if o]
        w(f" (corrected: {', '.join(shifted)})\n" if shifted else "\n")
    rows = [
        (
            format_time(s.ts),
            ms(s.since_previous),
            s.node,
            s.event,
            f"{s.before} -> {s.after}".lstrip() if s.after else "",
            s.blocks,
            "" if s.nbytes is None else f"{s.nbytes:,}",
            s.detail,
        )
        for s in item.steps
    ]
    header = ["time", "+ms", "node", "event", "state", "blocks", "bytes", "detail"]
    w(table(header, rows, indent="") + "\n")
