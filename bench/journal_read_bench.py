"""Reading a journal, stage by stage: the reader's hot paths on 1 M small records.

Builds (once, kept under ``--dir``) three journals of 1,000,000 records of
100 random bytes: format 1, and format 2 committed every 8 records (a
daemon's commit per request) and every 1000 (journal_bench's), then times,
each best of ``--repeat`` with the cyclic collector off (as replay runs):

- ``validate``: :func:`read_journal`, the CRC pass of a strict read (and of
  the optimistic replay's forked child);
- ``units``: walking the validated records as units (``records.units()``,
  what replay folds: a format-2 group in one piece);
- ``records``: walking them as ``(seq, payload)`` pairs (the tools' path);
- ``unchecked``: :func:`read_unchecked`'s units, the optimistic fold's input.

Prints ns per record. ``--compare TREE`` alternates this bench in TREE (an
older checkout with this file copied in; its own code is imported) and in
this tree, ``--rounds`` times, in fresh processes, and prints each stage's
best and median per side: before/after figures on a shared machine.

    .venv/bin/python -m bench.journal_read_bench [--dir DIR] [--compare /tmp/old]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from daemon.journal.reader import read_journal, read_unchecked
from daemon.journal.writer import FsyncPolicy, Journal

RECORDS = 1_000_000
PAYLOAD_BYTES = 100
# (name, format, records per commit)
JOURNALS = (
    ("format 1", 1, 8),
    ("format 2, 8 a commit", 2, 8),
    ("format 2, 1000 a commit", 2, 1000),
)
STAGES = ("validate", "units", "records", "unchecked")
REPO = Path(__file__).resolve().parents[1]


def build(path: Path, journal_format: int, per_commit: int) -> None:
    if path.exists():
        return
    payloads = [os.urandom(PAYLOAD_BYTES) for _ in range(1024)]
    building = path.with_name(path.name + ".building")
    with Journal.open(building, fsync=FsyncPolicy.NEVER, format=journal_format) as journal:
        for index in range(RECORDS):
            journal.append(payloads[index & 1023])
            if index % per_commit == per_commit - 1:
                journal.commit()
    building.rename(path)


def best_ns(fn: Callable[[], int], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        count = fn()
        best = min(best, time.perf_counter() - start)
        assert count == RECORDS, count
    return best / RECORDS * 1e9


def measure(path: Path, repeat: int) -> dict[str, float]:
    contents = read_journal(path)

    def validate() -> int:
        return len(read_journal(path).records)

    def units() -> int:
        count = 0
        for _, _, sizes in contents.records.units():
            count += 1 if sizes is None else len(sizes)
        return count

    def records() -> int:
        count = 0
        for _ in contents.records:
            count += 1
        return count

    def unchecked() -> int:
        count = 0
        for _, _, sizes in read_unchecked(path)[1].units():
            count += 1 if sizes is None else len(sizes)
        return count

    stages = {"validate": validate, "units": units, "records": records, "unchecked": unchecked}
    gc.disable()
    try:
        return {name: best_ns(stages[name], repeat) for name in STAGES}
    finally:
        gc.enable()


def run_here(directory: Path, repeat: int) -> dict[str, dict[str, float]]:
    directory.mkdir(parents=True, exist_ok=True)
    found = {}
    for name, journal_format, per_commit in JOURNALS:
        path = directory / f"f{journal_format}-g{per_commit}"
        build(path, journal_format, per_commit)
        found[name] = measure(path, repeat)
    return found


def compare(old: Path, directory: Path, rounds: int, repeat: int) -> None:
    """Alternate before (``old``) and after (this tree), fresh processes each time."""
    sides: dict[str, list[dict[str, dict[str, float]]]] = {"before": [], "after": []}
    command = [sys.executable, "-m", "bench.journal_read_bench", "--json"]
    command += ["--dir", str(directory), "--repeat", str(repeat)]
    for round_ in range(rounds):
        for side, tree in (("before", old), ("after", REPO)):
            out = subprocess.run(command, cwd=tree, check=True, capture_output=True, text=True)
            sides[side].append(json.loads(out.stdout))
            print(f"round {round_ + 1} {side}: done", file=sys.stderr)
    print("| journal | stage | before, ns/record: best (median) | after | after / before, best |")
    print("|---|---|---|---|---|")
    for name, _, _ in JOURNALS:
        for stage in STAGES:
            runs = {side: [r[name][stage] for r in found] for side, found in sides.items()}
            cells = [f"{min(v):.0f} ({statistics.median(v):.0f})" for v in runs.values()]
            ratio = min(runs["after"]) / min(runs["before"])
            print(f"| {name} | {stage} | {cells[0]} | {cells[1]} | {ratio:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/kvpj-read-bench"))
    parser.add_argument("--repeat", type=int, default=3, help="timings per stage, best kept")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--compare", type=Path, metavar="TREE", help="an older checkout")
    parser.add_argument("--rounds", type=int, default=5, help="with --compare: pairs run")
    args = parser.parse_args()
    if args.compare is not None:
        run_here(args.dir, 1)  # build the journals once, outside the timed runs
        compare(args.compare, args.dir, args.rounds, args.repeat)
        return
    found = run_here(args.dir, args.repeat)
    if args.json:
        print(json.dumps(found))
        return
    for name, stages in found.items():
        print(name, "  ".join(f"{stage} {ns:.0f} ns" for stage, ns in stages.items()))


if __name__ == "__main__":
    main()
