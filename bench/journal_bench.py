"""Benchmark of the journal storage layer (daemon/journal/writer.py, reader.py).

Measures the append rate of ~100-byte payloads under each fsync policy and the
raw replay (parse) rate, prints a table and writes it as the section
"## Journal (storage layer)" of bench/RESULTS.md (replacing an older one).

    .venv/bin/python bench/journal_bench.py [--dir DIR] [--seconds S] [--format 1|2]

Run it with --dir on the filesystem the daemon will use: fdatasync cost is a
property of the device, and /tmp may be tmpfs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from daemon.journal.reader import read_journal
from daemon.journal.writer import FsyncPolicy, Journal

PAYLOAD = os.urandom(100)
SECTION_TITLE = "## Journal (storage layer)"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
REPLAY_RECORDS = 1_000_000
COMMIT_EVERY = 1000


@dataclass(frozen=True)
class Row:
    case: str
    records: int
    seconds: float
    syncs: int | None = None

    @property
    def rate(self) -> float:
        return self.records / self.seconds

    def cells(self) -> list[str]:
        per_sync = "-" if not self.syncs else f"{self.records / self.syncs:,.0f}"
        return [
            self.case,
            f"{self.records:,}",
            f"{self.seconds:.2f}",
            f"{self.rate:,.0f}",
            "-" if self.syncs is None else f"{self.syncs:,}",
            per_sync,
        ]


HEADERS = ["case", "records", "seconds", "records/s", "fdatasyncs", "records/sync"]


class CountingSync:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, fd: int) -> None:
        self.calls += 1
        os.fdatasync(fd)


def timed_appends(
    directory: Path,
    seconds: float,
    *,
    policy: FsyncPolicy,
    commit_every_s: float | None = None,
    commit_every: int | None = None,
    journal_format: int | None = None,
) -> tuple[int, float, int]:
    """Append for ``seconds``; return (durable records, elapsed, fdatasync calls).

    The journal commits by itself only under ``always`` (or when a segment
    fills): the other cases commit every ``commit_every_s`` seconds or every
    ``commit_every`` appends, as a caller (the daemon's GroupCommit) would.
    """
    sync = CountingSync()
    with Journal.open(directory, fsync=policy, fdatasync=sync, format=journal_format) as journal:
        syncs_at_start = sync.calls
        append = journal.append
        clock = time.perf_counter
        start = last_commit = clock()
        deadline = start + seconds
        count = 0
        while (now := clock()) < deadline:
            if commit_every_s is not None and now - last_commit >= commit_every_s:
                journal.commit()
                last_commit = now
            # Check the clock once per 100 appends; its cost would skew the rate.
            for _ in range(100):
                append(PAYLOAD)
            count += 100
            if commit_every is not None and count % commit_every == 0:
                journal.commit()
        durable = journal.commit()
        elapsed = clock() - start
        return durable, elapsed, sync.calls - syncs_at_start


def replay_rows(directory: Path, journal_format: int | None = None) -> list[Row]:
    with Journal.open(directory, fsync=FsyncPolicy.NEVER, format=journal_format) as journal:
        for index in range(REPLAY_RECORDS):
            journal.append(PAYLOAD)
            if index % COMMIT_EVERY == 0:
                journal.commit()
    start = time.perf_counter()
    contents = read_journal(directory)
    scanned = time.perf_counter()
    count = sum(1 for _ in contents.records)
    iterated = time.perf_counter()
    assert count == REPLAY_RECORDS, count
    return [
        Row("replay: read_journal (validate)", count, scanned - start),
        Row("replay: iterate records", count, iterated - scanned),
        Row("replay: total", count, iterated - start),
    ]


def append_rows(root: Path, seconds: float, journal_format: int | None = None) -> list[Row]:
    fmt = journal_format
    cases: list[tuple[str, Callable[[Path], tuple[int, float, int]]]] = [
        (
            "always (fdatasync per record)",
            lambda d: timed_appends(
                d, min(seconds, 2.0), policy=FsyncPolicy.ALWAYS, journal_format=fmt
            ),
        ),
        (
            "batch, commit every 1 ms",
            lambda d: timed_appends(
                d, seconds, policy=FsyncPolicy.BATCH, commit_every_s=0.001, journal_format=fmt
            ),
        ),
        (
            f"batch, commit every {COMMIT_EVERY} appends",
            lambda d: timed_appends(
                d, seconds, policy=FsyncPolicy.BATCH, commit_every=COMMIT_EVERY, journal_format=fmt
            ),
        ),
        (
            f"never (buffered writes, commit every {COMMIT_EVERY})",
            lambda d: timed_appends(
                d, seconds, policy=FsyncPolicy.NEVER, commit_every=COMMIT_EVERY, journal_format=fmt
            ),
        ),
    ]
    rows = []
    for index, (name, run) in enumerate(cases):
        durable, elapsed, syncs = run(root / f"append-{index}")
        rows.append(Row(name, durable, elapsed, syncs))
    return rows


def render_table(rows: list[Row]) -> str:
    lines = [
        "| " + " | ".join(HEADERS) + " |",
        "|" + "|".join("---" for _ in HEADERS) + "|",
    ]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines)


def render_section(rows: list[Row], directory: Path) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    machine = (
        f"nproc {os.cpu_count()}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}"
    )
    return "\n".join(
        [
            SECTION_TITLE,
            "",
            f"- date: {now}",
            f"- machine: {machine}",
            f"- directory: `{directory}` (payload {len(PAYLOAD)} bytes)",
            "- batch rows count durable records only (each commit = one write + fdatasync);",
            "  replay rows parse a 1M-record journal that is in the page cache.",
            "",
            render_table(rows),
            "",
        ]
    )


def update_results(section: str, path: Path = RESULTS) -> None:
    """Replace this benchmark's section of RESULTS.md, or append it."""
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = text.splitlines()
    try:
        start = lines.index(SECTION_TITLE)
    except ValueError:
        updated = text.rstrip("\n") + "\n\n" + section
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
            len(lines),
        )
        kept_after = "\n".join(lines[end:])
        updated = "\n".join(lines[:start]) + "\n" + section
        if kept_after:
            updated += "\n" + kept_after + "\n"
    path.write_text(updated.lstrip("\n"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="parent of the scratch journals")
    parser.add_argument("--seconds", type=float, default=3.0, help="per append case")
    parser.add_argument("--no-write", action="store_true", help="do not touch RESULTS.md")
    parser.add_argument(
        "--format", type=int, choices=(1, 2), help="journal format (default: the journal's)"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvpj-bench-", dir=args.dir) as tmp:
        root = Path(tmp)
        rows = append_rows(root, args.seconds, args.format)
        rows += replay_rows(root / "replay", args.format)
    print(render_table(rows))
    if not args.no_write:
        update_results(render_section(rows, args.dir or Path(tempfile.gettempdir())))
        print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
