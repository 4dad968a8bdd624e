"""``kvpushd journal replay|timeline|report``: load, merge, analyse, render."""

from __future__ import annotations

import gc
import os
import sys
from typing import Any, Final, TextIO

import msgspec
import numpy as np

from daemon.journal.format import JournalError
from daemon.journal.replay import ReplayError
from daemon.postmortem.analyse import analyse
from daemon.postmortem.filters import Filters, FilterSpec, RequestMatcher, resolve_filters, select
from daemon.postmortem.fold import KeepDetails, no_request
from daemon.postmortem.load import load
from daemon.postmortem.merge import Merged, merge
from daemon.postmortem.render_json import replay_json, timeline_json
from daemon.postmortem.text import render_replay, render_timeline
from daemon.postmortem.timeline import timeline
from daemon.postmortem.vocab import PostmortemError

EXIT_OK: Final = 0
EXIT_NOT_FOUND: Final = 1
EXIT_ERROR: Final = 2


def spec_from_args(args: Any) -> FilterSpec:
    return FilterSpec(
        requests=tuple(getattr(args, "request", None) or ()),
        since=getattr(args, "since", None),
        until=getattr(args, "until", None),
        states=tuple(getattr(args, "state", None) or ()),
        reasons=tuple(getattr(args, "reason", None) or ()),
        nodes=tuple(getattr(args, "node", None) or ()),
    )


def _prepare(args: Any, details: KeepDetails | None) -> tuple[Merged, Filters]:
    """Load, merge and resolve the filters; raises PostmortemError for what the user can fix."""
    # A command runs once and exits, holding millions of acyclic objects: the
    # cyclic collector would only rescan them, for seconds, finding nothing.
    gc.disable()
    try:
        merged = merge(load(args.journals, jobs=args.jobs, progress=sys.stderr, details=details))
    except (JournalError, ReplayError, OSError) as exc:
        raise PostmortemError(str(exc)) from exc
    return merged, resolve_filters(spec_from_args(args), merged)


def _quiet_broken_pipe() -> int:
    """The reader went away (``| head``): stop quietly, as other CLI tools do."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_OK


def _write_json(data: Any, out: TextIO) -> None:
    out.write(msgspec.json.encode(data).decode())
    out.write("\n")


def run_replay(args: Any, out: TextIO | None = None) -> int:
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


def run_timeline(args: Any, out: TextIO | None = None) -> int:
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


def run_report(args: Any) -> int:
    from daemon.postmortem.html import write_report

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
