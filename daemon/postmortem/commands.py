"""``kvpushd journal replay|timeline|report``: their options, and load, merge, analyse, render.

:func:`add_parsers` runs for every ``kvpushd`` command line, so this module
loads nothing heavy: the postmortem's modules (numpy among them) are
imported when one of these commands runs, not when ``kvpushd run`` or
``kvpushd status`` starts.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Final, TextIO

import msgspec

if TYPE_CHECKING:
    from daemon.postmortem.filters import Filters, FilterSpec
    from daemon.postmortem.fold import KeepDetails
    from daemon.postmortem.merge import Merged

EXIT_OK: Final = 0
EXIT_NOT_FOUND: Final = 1
EXIT_ERROR: Final = 2

# Options whose values may start with "-" (a time relative to the journals'
# end: --since -15m), which argparse would otherwise take for an option;
# daemon/cli.py attaches such a value to its option before parsing.
DASH_VALUED: Final = ("--since", "--until")


POSTMORTEM_HELP = """\
JOURNAL: a node's journal directory, or segment files copied out of one
(grouped by the node their records name). Give every node's journal to merge
the prefill and decode sides of each request; clock offsets between nodes are
estimated from the messages they exchanged.

filters (repeat one to OR its values; different filters AND):
  --request ID     exact id (a transfer's id also names its TP ranks' shares,
                   ID@tp0, ID@tp1, ...), ID#INCARNATION, or a glob (r00*)
  --since/--until  ISO (2026-11-29T02:10, local time unless a zone is given),
                   a time of day on the journals' day (02:10), relative to
                   the journals' end or start (-15m, +90s), or epoch seconds
  --state STATE    final state or outcome on some node: pending, registered,
                   trimmed, writing, done, failed, released, refused
  --reason REASON  a refusal or failure reason (blocks_owned, daemon_restart, ...)
  --node NODE      requests this node saw

exit codes: 0 done, 1 no request matched (timeline), 2 unreadable input or bad filter
"""


def _add_common_arguments(parser: argparse.ArgumentParser, *, request_required: bool) -> None:
    parser.add_argument(
        "journals",
        type=Path,
        nargs="+",
        metavar="JOURNAL",
        help="a node's journal directory or segment file; give one per node",
    )
    parser.add_argument(
        "--request", action="append", required=request_required, metavar="ID", help="request id"
    )
    parser.add_argument("--since", metavar="TIME", help="requests alive at or after TIME")
    parser.add_argument("--until", metavar="TIME", help="requests alive at or before TIME")
    parser.add_argument("--state", action="append", metavar="STATE", help="final state/outcome")
    parser.add_argument("--reason", action="append", metavar="REASON", help="refusal/failure")
    parser.add_argument("--node", action="append", metavar="NODE", help="seen by this node")
    parser.add_argument(
        "--jobs", type=int, metavar="N", help="processes folding nodes in parallel (default: auto)"
    )


def add_parsers(jsub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``replay``, ``timeline`` and ``report`` under ``kvpushd journal``."""
    formatter = argparse.RawDescriptionHelpFormatter
    replay_cmd = jsub.add_parser(
        "replay",
        help="fold and merge nodes' journals; final states, refusals and anomalies",
        epilog=POSTMORTEM_HELP,
        formatter_class=formatter,
    )
    _add_common_arguments(replay_cmd, request_required=False)
    replay_cmd.add_argument("--json", action="store_true", help="everything, as one JSON object")
    replay_cmd.add_argument("--top", type=int, default=10, metavar="N", help="slowest transitions")
    replay_cmd.add_argument(
        "--limit", type=int, default=20, metavar="N", help="rows per anomaly list (0: all)"
    )
    replay_cmd.set_defaults(func=run_replay)

    timeline = jsub.add_parser(
        "timeline",
        help="one request's life across nodes, step by step",
        epilog=POSTMORTEM_HELP,
        formatter_class=formatter,
    )
    _add_common_arguments(timeline, request_required=True)
    timeline.add_argument("--json", action="store_true", help="the steps as JSON")
    timeline.set_defaults(func=run_timeline)

    report = jsub.add_parser(
        "report",
        help="a self-contained HTML report: timeline chart, latency histograms, anomalies",
        epilog=POSTMORTEM_HELP,
        formatter_class=formatter,
    )
    _add_common_arguments(report, request_required=False)
    report.add_argument(
        "-o", "--output", type=Path, required=True, metavar="FILE", help="the HTML file to write"
    )
    report.add_argument("--top", type=int, default=20, metavar="N", help="slowest transitions")
    report.add_argument(
        "--max-timelines",
        type=int,
        default=200,
        metavar="N",
        help="request timelines written out in full (anomalies first; default 200)",
    )
    report.set_defaults(func=run_report)


def spec_from_args(args: argparse.Namespace) -> FilterSpec:
    from daemon.postmortem.filters import FilterSpec

    return FilterSpec(
        requests=tuple(getattr(args, "request", None) or ()),
        since=getattr(args, "since", None),
        until=getattr(args, "until", None),
        states=tuple(getattr(args, "state", None) or ()),
        reasons=tuple(getattr(args, "reason", None) or ()),
        nodes=tuple(getattr(args, "node", None) or ()),
    )


def _prepare(args: argparse.Namespace, details: KeepDetails | None) -> tuple[Merged, Filters]:
    """Load, merge and resolve the filters; raises PostmortemError for what the user can fix."""
    from daemon.journal.format import JournalError
    from daemon.journal.replay import ReplayError
    from daemon.postmortem.filters import resolve_filters
    from daemon.postmortem.load import load
    from daemon.postmortem.merge import merge
    from daemon.postmortem.vocab import PostmortemError

    # A command runs once and exits, holding millions of acyclic objects: the
    # cyclic collector would only rescan them, for seconds, finding nothing.
    gc.disable()
    try:
        folds = load(args.journals, jobs=args.jobs, progress=sys.stderr, details=details)
    except (JournalError, ReplayError, OSError) as exc:
        raise PostmortemError(str(exc)) from exc
    if not any(len(fold.seq) for fold in folds):
        # Nothing to place in time: every analysis below would be of NaNs.
        damage = next((d for fold in folds for d in fold.damage), "")
        raise PostmortemError(
            "no intact record in these journals" + (f" (damage: {damage})" if damage else "")
        )
    merged = merge(folds)
    return merged, resolve_filters(spec_from_args(args), merged)


def _quiet_broken_pipe() -> int:
    """The reader went away (``| head``): stop quietly, as other CLI tools do."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_OK


def _write_json(data: object, out: TextIO) -> None:
    out.write(msgspec.json.encode(data).decode())
    out.write("\n")


def run_replay(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from daemon.postmortem.analyse import analyse
    from daemon.postmortem.fold import no_request
    from daemon.postmortem.render_json import replay_json
    from daemon.postmortem.text import render_replay
    from daemon.postmortem.vocab import PostmortemError

    out = out or sys.stdout
    try:
        merged, filters = _prepare(args, no_request)
    except PostmortemError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return EXIT_ERROR
    analysis = analyse(merged, filters, top=args.top)
    try:
        if args.json:
            _write_json(replay_json(analysis), out)
        else:
            render_replay(analysis, out, limit=args.limit)
        out.flush()
    except BrokenPipeError:
        return _quiet_broken_pipe()
    return EXIT_OK


def run_timeline(args: argparse.Namespace, out: TextIO | None = None) -> int:
    import numpy as np

    from daemon.postmortem.filters import RequestMatcher, select
    from daemon.postmortem.render_json import timeline_json
    from daemon.postmortem.text import render_timeline
    from daemon.postmortem.timeline import timeline
    from daemon.postmortem.vocab import PostmortemError

    out = out or sys.stdout
    try:
        merged, filters = _prepare(args, RequestMatcher(args.request))
    except PostmortemError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return EXIT_ERROR
    found = np.flatnonzero(select(merged, filters))
    if not len(found):
        wanted = " or ".join(args.request)
        print(f"no request {wanted} in these journals", file=sys.stderr)
        return EXIT_NOT_FOUND
    items = [timeline(merged, int(r)) for r in found]
    try:
        if args.json:
            _write_json([timeline_json(item) for item in items], out)
        else:
            for n, item in enumerate(items):
                out.write("\n" if n else "")
                render_timeline(item, merged, out)
        out.flush()
    except BrokenPipeError:
        return _quiet_broken_pipe()
    return EXIT_OK


def run_report(args: argparse.Namespace) -> int:
    from daemon.postmortem.analyse import analyse
    from daemon.postmortem.html import write_report
    from daemon.postmortem.vocab import PostmortemError

    try:
        merged, filters = _prepare(args, None)
    except PostmortemError as exc:
        print(f"ERROR: {exc}", file=sys.stderr)
        return EXIT_ERROR
    analysis = analyse(merged, filters, top=args.top)
    try:
        write_report(analysis, args.output, max_timelines=args.max_timelines)
    except OSError as exc:
        print(f"ERROR: cannot write {args.output}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(f"wrote {args.output} ({len(analysis.selected)} requests)", file=sys.stderr)
    return EXIT_OK
