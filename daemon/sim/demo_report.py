"""What the demo prints: its progress while pushing, and the summary at the end.

The summary's tables (outcomes, final states, refusals, latencies), the
bytes and throughput of the push phase, how the daemons stopped, and the
commands that inspect the journals.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from daemon.journal.stats import percentile
from daemon.ops.texttable import table
from daemon.sim.demo_journal import JournalView
from daemon.sim.demo_plan import DELIVERED_KINDS, REFUSED_KINDS, WINDOW, Kind, Plan
from daemon.sim.demo_push import Outcome, PushResult
from schemas.state import State


class Progress:
    """A ``\\r`` bar on a terminal; a plain line every 10 % otherwise."""

    def __init__(self, total: int, out: TextIO, tty: bool) -> None:
        self.total = max(1, total)
        self.out = out
        self.tty = tty
        self.done = 0
        self.problems = 0
        self.started = time.perf_counter()
        self._last_draw = 0.0
        self._next_tenth = 1

    def advance(self, outcome: Outcome) -> None:
        self.done += 1
        self.problems += not outcome.ok
        if self.tty:
            self._draw(final=self.done >= self.total)
        else:
            self._line()

    def _status(self) -> str:
        elapsed = time.perf_counter() - self.started
        problems = plural(self.problems, "problem")
        return f"{self.done}/{self.total} requests  {problems}  {elapsed:.1f} s"

    def _draw(self, final: bool) -> None:
        now = time.perf_counter()
        if not final and now - self._last_draw < 0.1:
            return  # a redraw per request would cost more than the push itself
        self._last_draw = now
        width = 30
        filled = width * self.done // self.total
        bar = "#" * filled + "-" * (width - filled)
        self.out.write(f"\r  pushing [{bar}] {self._status()}")
        if final:
            self.out.write("\n")
        self.out.flush()

    def _line(self) -> None:
        while self.done * 10 >= self._next_tenth * self.total and self._next_tenth <= 10:
            self.out.write(f"  pushed {self._next_tenth * 10:3d}%  {self._status()}\n")
            self.out.flush()
            self._next_tenth += 1


def _table(header: Sequence[str], rows: Sequence[Sequence[object]], right: int = 1) -> str:
    """The summary's tables: indented, numbers (columns from ``right`` on) right-aligned."""
    return table(header, rows, indent="  ", right=right)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB ({nbytes:,} bytes)"


@dataclass
class RunResult:
    """Everything the summary needs."""

    plan: Plan
    push: PushResult
    journals: list[JournalView]
    exit_codes: dict[str, int]
    problems: list[str]

    @property
    def outcomes(self) -> list[Outcome]:
        return self.push.outcomes


def outcome_rows(result: RunResult) -> list[tuple[str, int, int]]:
    expected = Counter(result.plan.kinds())
    actual = Counter(o.kind for o in result.outcomes if o.ok)
    rows = []
    for kind in (*DELIVERED_KINDS, *REFUSED_KINDS):
        label = f"delivered, {kind.value}" if kind in DELIVERED_KINDS else f"refused, {kind.value}"
        rows.append((label, expected[kind], actual[kind]))
    errors = sum(not o.ok for o in result.outcomes)
    if errors:
        rows.append(("NOT AS PLANNED", 0, errors))
    rows.append(("total", result.plan.size, len(result.outcomes)))
    return rows


def final_state_rows(journals: Sequence[JournalView], plan: Plan) -> list[list[object]]:
    """Per node: how the journal says each request ended."""

    def label(view: JournalView, rid: str) -> str:
        states = view.states.get(rid, [])
        if not states:
            return "never registered (refused)"
        last = states[-1].value
        if State.FAILED in states:
            reason = view.failures.get(rid)
            return f"{last} after failed ({reason.value if reason else '?'})"
        if State.DONE in states:
            return f"{last} after done"
        return last

    ids = [t.request_id for t in plan.transfers] + [
        p.request_id for p in plan.probes if p.kind is Kind.BLOCKS_OWNED
    ]
    counts = [Counter(label(v, rid) for rid in ids) for v in journals]
    keys = sorted(set().union(*counts))
    return [[key, *(c[key] for c in counts)] for key in keys]


def refusal_rows(result: RunResult) -> list[list[object]]:
    expected = {k.value: n for k, n in result.plan.kinds().items() if k in REFUSED_KINDS}
    seen = Counter(
        o.actual.removeprefix("refused: ")
        for o in result.outcomes
        if o.actual.startswith("refused")
    )
    journaled = [v.stats.refusals for v in result.journals]
    reasons = sorted(set(expected) | set(seen) | set().union(*journaled))
    return [[r, expected.get(r, 0), seen[r], *(j.get(r, 0) for j in journaled)] for r in reasons]


def latency_rows(result: RunResult) -> list[list[object]]:
    e2e = sorted(o.latency_s for o in result.outcomes if o.ok and o.latency_s is not None)
    rows: list[list[object]] = []
    if e2e:
        rows.append(
            [
                "end to end (demo, delivered)",
                len(e2e),
                _ms(percentile(e2e, 50)),
                _ms(percentile(e2e, 99)),
                _ms(e2e[-1]),
            ]
        )
    for view in result.journals:
        for name, n, p50, p99, mx in view.stats.latency_table():
            rows.append([f"{view.node:<8} {name}", n, _ms(p50), _ms(p99), _ms(mx)])
    return rows


def cli_command() -> str:
    """How to call kvpushd from this shell: bare when on PATH, else the venv's script."""
    script = Path(sys.executable).parent / "kvpushd"
    on_path = shutil.which("kvpushd")
    if on_path and (not script.exists() or Path(on_path).resolve() == script.resolve()):
        return "kvpushd"
    if script.exists():
        with contextlib.suppress(ValueError):
            return str(script.relative_to(Path.cwd()))
        return str(script)
    return f"{sys.executable} -m daemon.cli"


def example_ids(result: RunResult) -> list[str]:
    """The first request that went wrong, a delivered partial hit and a refused one."""
    picks = [o.request_id for o in result.outcomes if not o.ok][:1]
    for kind in (Kind.PARTIAL, Kind.TOO_LONG):
        for o in result.outcomes:
            if o.kind is kind and o.ok:
                picks.append(o.request_id)
                break
    return picks or [t.request_id for t in result.plan.transfers[:1]]


def integrity_line(counters: dict[str, int]) -> str:
    """What the decode daemon's end-to-end checksums found (verify = "all")."""
    checked = counters.get("integrity_checked", 0)
    equal = counters.get("integrity_blocks_verified", 0)
    bad = counters.get("integrity_mismatches", 0)
    return (
        f'  integrity        verify = "all": {plural(checked, "request")} checked end to end,'
        f" {equal:,} block checksums equal, {bad} {'mismatch' if bad == 1 else 'mismatches'}"
    )


def print_summary(result: RunResult, workdir: Path, keep: bool, out: TextIO) -> None:
    w = out.write
    delivered = [o for o in result.outcomes if o.ok and o.latency_s is not None]
    nbytes = sum(o.nbytes for o in delivered)
    blocks = sum(o.blocks for o in delivered)
    push = max(result.push.seconds, 1e-9)
    names = [v.node for v in result.journals]

    w("\nsummary\n\n")
    w(_table(["requests by outcome", "planned", "as planned"], outcome_rows(result)) + "\n\n")
    w(_table(["final state in journal", *names], final_state_rows(result.journals, result.plan)))
    w("\n\n")
    refusals = refusal_rows(result)
    header = ["refusal reason", "planned", "engines told", *(f"{n} journal" for n in names)]
    w(_table(header, refusals or [["-", 0, 0, *(0 for _ in names)]]) + "\n\n")
    wrong = sum(o.actual.startswith("error: wrong bytes") for o in result.outcomes)
    checked = "every byte verified" if not wrong else f"{plural(wrong, 'request')} with WRONG bytes"
    w(f"  bytes moved      {_size(nbytes)} in {blocks:,} blocks, {checked}\n")
    w(integrity_line(result.push.integrity) + "\n")
    w(
        f"  push phase       {result.push.seconds:.2f} s: {nbytes / push / 1e9:.3g} GB/s,"
        f" {len(result.outcomes) / push:.1f} requests/s, {WINDOW} in flight\n"
    )
    # Measured: the demo process (pattern fills and whole-cache checks) is
    # busy all along while the daemons idle; say so, so nobody quotes these
    # figures as the daemon's speed.
    w("                   (bound by the simulated engines filling and checking every byte)\n\n")
    rows = latency_rows(result)
    header = ["latency", "count", "p50 ms", "p99 ms", "max ms"]
    w(_table(header, rows or [["-", 0, "-", "-", "-"]]) + "\n\n")
    codes = ", ".join(f"{node} exited {code}" for node, code in result.exit_codes.items())
    w(f"  daemons          stopped with SIGTERM: {codes}\n")
    created, left = result.push.shm_files, len(result.push.leftover_shm)
    passed = result.push.descriptors
    w(
        f"  shared memory    {passed} regions passed to the daemons as sealed memfds"
        f" (SCM_RIGHTS), {created} files created, {created - left} unlinked\n\n"
    )
    _print_journals(result, workdir, keep, w)


def _print_journals(result: RunResult, workdir: Path, keep: bool, w: Callable[[str], int]) -> None:
    for view in result.journals:
        w(f"  {view.node + ' journal':<16} {view.path}  ({view.records} records)\n")
    if not keep:
        w(f"\n  work folder {workdir} removed; run with --keep to inspect the journals:\n")
    else:
        w(f"\n  kept in {workdir}; inspect the journals with:\n")
    cli = cli_command()
    for view in result.journals:
        w(f"    {cli} journal stats {view.path}\n")
    for rid in example_ids(result):
        for view in result.journals:
            w(f"    {cli} journal show {view.path} --request {rid}\n")
