"""Benchmark of the postmortem replay (daemon/postmortem/: load, merge, analyse).

Writes a prefill and a decode journal that together hold about a million
events (``--events``), as two daemons would: every event goes through the
core's check/plan methods and a Ledger, requests overlap 16 at a time, a
few are refused, and the decode node's clock runs ``CLOCK_SKEW_S`` ahead.
Then times ``kvpushd journal replay``'s work (fold every node through the
core, merge, estimate clocks, analyse) and writes the section "Replay
(postmortem)" of bench/RESULTS.md.

    .venv/bin/python -m bench.replay_bench [--events N] [--runs N] [--dir DIR]

Rates are events per second of wall-clock time, best of ``--runs``; the CPU
seconds of the same run (children included) say how much of the machine it
took, which matters on a shared box.
"""

from __future__ import annotations

import argparse
import gc
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.results import load_average, machine, write_section
from daemon.journal.replay import replay
from daemon.journal.writer import FsyncPolicy, Journal
from daemon.node.ledger import Ledger
from daemon.postmortem.analyse import Analysis, analyse
from daemon.postmortem.fold import no_request
from daemon.postmortem.load import load
from daemon.postmortem.merge import merge
from schemas.events import Event, Failed, KvReady, Refused, Released, WriteDone, WriteStarted
from schemas.layout import EngineLayout, GroupKind, GroupLayout, Role
from schemas.reasons import Reason
from statemachine import Refusal, Registry

PREFILL, DECODE = "prefill", "decode"
WINDOW = 16  # requests in flight; each slot owns its own decode blocks
SLOT_BLOCKS = 8
CLOCK_SKEW_S = 0.0025  # the decode node's clock runs this much ahead
START = 1_800_000_000.0
SPACING_S = 0.001  # between request starts
REFUSE_EVERY = 50  # every 50th request: decode longer than prefill
LAYOUT_BLOCKS = WINDOW * SLOT_BLOCKS + 64

P_LAYOUT = EngineLayout(
    "prefill-0", (GroupLayout(GroupKind.ATTENTION, 4096), GroupLayout(GroupKind.ATTENTION, 4096))
)
D_LAYOUT = EngineLayout(
    "decode-0",
    (
        GroupLayout(GroupKind.ATTENTION, LAYOUT_BLOCKS),
        GroupLayout(GroupKind.ATTENTION, LAYOUT_BLOCKS),
    ),
)

# A scheduled step: (true time, node, order within the request, maker).
# The maker builds the event against the node's registry when its turn comes,
# through the same check/plan methods the daemon uses.
Maker = Callable[[Registry], list[Event]]
Scheduled = tuple[float, str, int, int, Maker]


class _Clock:
    """The Ledger's clock: the scheduled time of the event being recorded."""

    def __init__(self, skew: float) -> None:
        self.skew = skew
        self.now = START

    def __call__(self) -> float:
        return self.now + self.skew


def _request_steps(i: int) -> list[Scheduled]:
    """One request's steps on both nodes, at true times (ms apart, as the demo sees)."""
    rid = f"req-{i:07d}"
    t = START + i * SPACING_S
    slot = i % WINDOW
    base = slot * SLOT_BLOCKS
    refused = i % REFUSE_EVERY == REFUSE_EVERY - 1
    decode_blocks = [list(range(base, base + (7 if refused else 2))), [base, base + 1]]
    prefill_blocks = [list(range(1000 + base, 1000 + base + 6)), list(range(2000, 2004))]

    def d_register(reg: Registry) -> list[Event]:
        return [reg.check_register(rid, 1, Role.RECEIVER, "decode-0", PREFILL, decode_blocks)]

    def p_peer(reg: Registry) -> list[Event]:
        blocks = tuple(tuple(g) for g in decode_blocks)
        return [reg.check_peer_registration(rid, 1, DECODE, "decode-0", blocks, 1)]

    def p_register(reg: Registry) -> list[Event]:
        event = reg.check_register(rid, 1, Role.PUSHER, "prefill-0", "", prefill_blocks)
        return [event, KvReady(rid, 1)]

    def p_trim(reg: Registry) -> list[Event]:
        try:
            return [reg.plan_trim(rid, 1)]
        except Refusal as refusal:
            failed = Failed(rid, 1, refusal.reason, refusal.message)
            return [Refused(rid, 1, "prefill-0", refusal.reason, refusal.message), failed]

    def d_failed(reg: Registry) -> list[Event]:
        return [Failed(rid, 1, Reason.DECODE_LONGER_THAN_PREFILL, "prefill: refused", True)]

    def write_started(reg: Registry) -> list[Event]:
        return [WriteStarted(rid, 1, 4, 4 * 65536)]

    def write_done(reg: Registry) -> list[Event]:
        return [WriteDone(rid, 1)]

    def released(reg: Registry) -> list[Event]:
        return [Released(rid, 1)]

    steps: list[tuple[float, str, Maker]] = [
        (t, DECODE, d_register),
        (t + 0.0004, PREFILL, p_peer),
        (t + 0.0006, PREFILL, p_register),
        (t + 0.0008, PREFILL, p_trim),
    ]
    if refused:
        steps += [(t + 0.0012, DECODE, d_failed)]
    else:
        steps += [
            (t + 0.0010, PREFILL, write_started),
            (t + 0.0013, DECODE, write_started),
            (t + 0.0030, DECODE, write_done),
            (t + 0.0032, PREFILL, write_done),
        ]
    steps += [(t + 0.0100, DECODE, released), (t + 0.0101, PREFILL, released)]
    return [(when, node, i, n, maker) for n, (when, node, maker) in enumerate(steps)]


def write_pair(
    directory: Path, target_events: int, journal_format: int = 2, group: int = 8
) -> dict[str, Path]:
    """A prefill and a decode journal with about ``target_events`` records in all.

    Each node commits once ``group`` records are pending (in format 2, a
    frame per commit; format 1's bytes do not depend on commits).
    """
    paths = {node: directory / f"{node}-journal" for node in (PREFILL, DECODE)}
    clocks = {PREFILL: _Clock(0.0), DECODE: _Clock(CLOCK_SKEW_S)}
    requests = target_events // 11
    with (
        Journal.open(paths[PREFILL], fsync=FsyncPolicy.NEVER, format=journal_format) as pj,
        Journal.open(paths[DECODE], fsync=FsyncPolicy.NEVER, format=journal_format) as dj,
    ):
        journals = {PREFILL: pj, DECODE: dj}
        registries = {PREFILL: Registry(), DECODE: Registry()}
        recorders = {
            PREFILL: Ledger(pj, registries[PREFILL], node=PREFILL, clock=clocks[PREFILL]),
            DECODE: Ledger(dj, registries[DECODE], node=DECODE, clock=clocks[DECODE]),
        }
        recorders[PREFILL].append(registries[PREFILL].check_attach(P_LAYOUT))
        recorders[DECODE].append(registries[DECODE].check_attach(D_LAYOUT))
        # Requests are generated a window at a time and merged by time, so
        # memory stays bounded and the nodes see them interleaved.
        pending: list[Scheduled] = []
        for i in range(requests):
            pending += _request_steps(i)
            if len(pending) > 4096 or i == requests - 1:
                pending.sort(key=lambda s: (s[0], s[2], s[3]))
                horizon = START + (i - WINDOW) * SPACING_S if i < requests - 1 else float("inf")
                due = [s for s in pending if s[0] < horizon]
                pending = [s for s in pending if s[0] >= horizon]
                for when, node, _, _, maker in due:
                    clocks[node].now = when
                    for event in maker(registries[node]):
                        recorders[node].append(event)
                    if journals[node].pending >= group:
                        journals[node].commit()
    return paths


@dataclass(frozen=True)
class Timing:
    case: str
    events: int
    seconds: float  # wall clock, best run
    cpu: float  # user + system seconds of this process and its children, same run

    @property
    def rate(self) -> float:
        return self.events / self.seconds

    def cells(self) -> list[str]:
        return [
            self.case,
            f"{self.events:,}",
            f"{self.seconds:.2f}",
            f"{self.cpu:.2f}",
            f"{self.rate / 1e3:,.0f} k",
            f"{self.events / self.cpu / 1e3:,.0f} k",
        ]


HEADERS = ["case", "events", "wall s", "cpu s", "events/s (wall)", "events per cpu-second"]


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _best(case: str, events: int, runs: int, fn: Callable[[], object]) -> Timing:
    best: tuple[float, float] | None = None
    for _ in range(runs):
        gc.collect()
        cpu0, t0 = _cpu(), time.perf_counter()
        fn()
        wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
        if best is None or wall < best[0]:
            best = (wall, cpu)
    assert best is not None
    return Timing(case, events, *best)


def _postmortem(paths: list[Path], jobs: int | None) -> Analysis:
    """What `journal replay` does: gc off for the command, no record kept for timelines."""
    gc.disable()
    try:
        folds = load(paths, jobs=jobs, details=no_request)
        return analyse(merge(folds))
    finally:
        gc.enable()


def _cli(paths: list[Path]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "journal", "replay", *map(str, paths)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def _journals(
    directory: Path, target_events: int, journal_format: int, group: int
) -> tuple[dict[str, Path], str]:
    """The pair of journals in ``directory``: reused if there, written otherwise."""
    paths = {node: directory / f"{node}-journal" for node in (PREFILL, DECODE)}
    if all(p.is_dir() for p in paths.values()):
        return paths, "reused"
    t0 = time.perf_counter()
    write_pair(directory, target_events, journal_format, group)
    return paths, (
        f"format {journal_format}, a commit per {group} records, "
        f"written in {time.perf_counter() - t0:.1f} s"
    )


def run(
    directory: Path, target_events: int, runs: int, journal_format: int = 2, group: int = 8
) -> tuple[list[Timing], str]:
    paths, written = _journals(directory, target_events, journal_format, group)
    counts = {node: replay(path).records for node, path in paths.items()}
    total = sum(counts.values())
    both = [paths[PREFILL], paths[DECODE]]
    check = _postmortem(both, None)
    offset = check.merged.clocks.offsets[DECODE]
    assert not check.never_released and not check.disagreements, "the bench journals are clean"
    timings = [
        _best("`kvpushd journal replay` (CLI, both nodes)", total, runs, lambda: _cli(both)),
        _best("postmortem, both nodes, parallel", total, runs, lambda: _postmortem(both, None)),
        _best("postmortem, both nodes, one process", total, runs, lambda: _postmortem(both, 1)),
        _best(
            "postmortem, prefill alone",
            counts[PREFILL],
            runs,
            lambda: _postmortem([paths[PREFILL]], 1),
        ),
        _best(
            "core fold alone (daemon.journal.replay), prefill",
            counts[PREFILL],
            runs,
            lambda: replay(paths[PREFILL]),
        ),
        _best(
            "core fold alone (daemon.journal.replay), both in turn",
            total,
            runs,
            lambda: [replay(p) for p in both],
        ),
    ]
    notes = (
        f"journals: prefill {counts[PREFILL]:,} + decode {counts[DECODE]:,} = {total:,} events "
        f"({written}); decode clock skewed +{CLOCK_SKEW_S * 1e3:.1f} ms, "
        f"estimated {offset * 1e3:+.3f} ms"
    )
    return timings, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--dir", type=Path, help="keep the journals here, and reuse them if already there"
    )
    parser.add_argument("--no-write", action="store_true", help="print only; keep RESULTS.md")
    parser.add_argument(
        "--format", type=int, default=2, choices=(1, 2), help="journal format to write (default 2)"
    )
    parser.add_argument(
        "--group", type=int, default=8, metavar="N", help="records per commit (default 8)"
    )
    args = parser.parse_args()
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        timings, notes = run(args.dir, args.events, args.runs, args.format, args.group)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            timings, notes = run(Path(tmp), args.events, args.runs, args.format, args.group)
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(t.cells()) + " |" for t in timings]
    core = next(
        t for t in timings if t.case.startswith("core fold alone (daemon.journal.replay), prefill")
    )
    alone = next(t for t in timings if t.case == "postmortem, prefill alone")
    lines += [
        "",
        f"The postmortem of one journal costs {alone.cpu / core.cpu:.2f}x the CPU of the core "
        f"fold of it (daemon.journal.replay.replay, which it runs); nodes fold in parallel, so "
        f"on an "
        f"idle machine with a CPU per node the wall time is about that of the largest journal.",
        "Target: >= 500 k events/s for the postmortem of a million events.",
    ]
    body = "\n".join(lines)
    load = load_average()
    context = (
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
        f"- machine: {machine()}; load average at the end {load}\n"
        f"- {notes}\n"
        f"- postmortem = read + fold through the core + merge + clocks + anomalies "
        f"(`kvpushd journal replay` minus printing); parallel: the largest journal folds in "
        f"the command's own process, the others in forked workers meanwhile; best of "
        f"{args.runs} by wall clock"
    )
    print(context + "\n\n" + body)
    if not args.no_write:
        write_section("Replay (postmortem)", context, body)


if __name__ == "__main__":
    main()
