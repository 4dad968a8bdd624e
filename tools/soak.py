"""Crash soak: hundreds of kill rounds, then one table.

Runs the kill rounds of harness/crashrounds.py (a prefill or decode daemon
SIGKILLed under load, at a failpoint or at a random moment, restarted, and
checked) for as many rounds as asked::

    .venv/bin/python tools/soak.py --rounds 300 --pairs 3

Pairs run side by side, each on its own journals and ports. Every
``--epoch`` rounds a pair is replaced by a fresh one, so the full-history
journal check stays fast however long the soak runs. Work directories are
deleted after a clean epoch and kept (and named) after one with violations.
Exit status: 0 when no round found a violation, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.crashrounds import Summary, run_rounds


@dataclass
class Totals:
    """What all epochs added up to."""

    rounds: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    ok: int = 0
    failed: int = 0
    abandoned: int = 0
    refused: int = 0
    acks_checked: int = 0
    violations: list[str] = field(default_factory=list)
    max_settle_s: float = 0.0
    max_round_s: float = 0.0

    @property
    def completed(self) -> int:
        return self.ok + self.failed + self.abandoned + self.refused

    def add(self, summary: Summary) -> None:
        self.rounds += len(summary.rounds)
        self.kills += summary.kills
        self.ok += summary.stats.ok
        self.failed += summary.stats.failed
        self.abandoned += summary.stats.abandoned
        self.refused += summary.stats.refused
        self.acks_checked += summary.acks_checked
        self.violations += summary.violations
        for result in summary.rounds:
            self.max_settle_s = max(self.max_settle_s, result.settle_s)
            self.max_round_s = max(self.max_round_s, result.seconds)


def table(totals: Totals, wall_s: float, command: str) -> str:
    """The soak's result as a Markdown table (it reads fine as plain text too)."""
    random_kills = {k: n for k, n in totals.kills.items() if k.startswith("random")}
    failpoint_kills = {k: n for k, n in totals.kills.items() if k not in random_kills}
    rows = [
        ("rounds", str(totals.rounds)),
        ("kills at a failpoint", str(sum(failpoint_kills.values()))),
        *((f"&nbsp;&nbsp;{k}", str(n)) for k, n in sorted(failpoint_kills.items())),
        ("kills at a random moment", str(sum(random_kills.values()))),
        *((f"&nbsp;&nbsp;{k}", str(n)) for k, n in sorted(random_kills.items())),
        ("requests completed (all released on both nodes)", str(totals.completed)),
        ("&nbsp;&nbsp;pushed, bytes verified on both sides", str(totals.ok)),
        ("&nbsp;&nbsp;failed (a kill was in the way)", str(totals.failed)),
        ("&nbsp;&nbsp;given up by an engine on purpose, racing the write", str(totals.abandoned)),
        ("&nbsp;&nbsp;refused at registration", str(totals.refused)),
        ("acknowledged transitions checked", str(totals.acks_checked)),
        ("violations found", str(len(totals.violations))),
        ("longest round", f"{totals.max_round_s:.1f} s"),
        ("longest settle after both daemons were up", f"{totals.max_settle_s:.1f} s"),
        ("wall time", f"{wall_s:.0f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"`{command}`", "", f"| {'':{width}} | |", f"|{'-' * (width + 2)}|---|"]
    lines += [f"| {k:{width}} | {v} |" for k, v in rows]
    return "\n".join(lines)


async def soak(args: argparse.Namespace) -> Totals:
    totals = Totals()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="kvpushd-soak-"))
    epoch = 0
    while totals.rounds < args.rounds:
        rounds = min(args.epoch * args.pairs, args.rounds - totals.rounds)
        workdir = root / f"epoch-{epoch}"
        summary = await run_rounds(
            workdir,
            rounds=rounds,
            seed=args.seed + 1000 * epoch,
            pairs=args.pairs,
            say=print if args.verbose else lambda line: None,
            stop_on_violation=args.stop_on_violation,
        )
        totals.add(summary)
        bad = len(summary.violations)
        print(
            f"epoch {epoch}: {len(summary.rounds)} rounds, {summary.stats.completed} requests, "
            f"{summary.acks_checked} acks checked, {bad} violations"
            + (f" (kept {workdir})" if bad else ""),
            flush=True,
        )
        for violation in summary.violations:
            print(f"    {violation}", flush=True)
        if not bad and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        if bad and args.stop_on_violation:
            break
        epoch += 1
    return totals


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=300, help="kill rounds in all (default 300)")
    p.add_argument("--pairs", type=int, default=3, help="daemon pairs run side by side")
    p.add_argument("--epoch", type=int, default=25, help="rounds per pair before a fresh pair")
    p.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    p.add_argument("--workdir", default=None, help="default: a new temporary directory")
    p.add_argument("--keep", action="store_true", help="keep clean epochs' directories too")
    p.add_argument("--stop-on-violation", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true", help="print every round")
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = random.randrange(1 << 31)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = " ".join(["tools/soak.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"soak: {args.rounds} rounds, {args.pairs} pairs, seed {args.seed}", flush=True)
    started = time.monotonic()
    totals = asyncio.run(soak(args))
    print()
    print(table(totals, time.monotonic() - started, f"{command} (seed {args.seed})"))
    return 1 if totals.violations else 0


if __name__ == "__main__":
    sys.exit(main())
