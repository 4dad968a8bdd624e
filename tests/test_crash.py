"""Crash rounds and failpoints: SIGKILL a daemon under load, restart it, check nothing broke.

The kill rounds (:mod:`harness.crashrounds`, shared with ``tools/soak.py``)
kill the prefill or the decode daemon under load, at a failpoint or at a
random moment, restart it and check: nothing acknowledged is lost, the
journals replay and every request's events are in a legal order, no byte
landed where none may, every request is released once both daemons are up
again, and fresh requests push correctly. CI runs 30 rounds.

Also here: the failpoint machinery itself (every failpoint in the code is
declared, specs parse, a crash is a SIGKILL), and a storage-level test that
kills a bare journal writer at every journal failpoint and checks that every
record it acknowledged survives.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Final

import pytest

from daemon import failpoints
from daemon.journal.reader import read_journal
from harness.crashrounds import CRASH_POINTS, run_rounds

REPO: Final = Path(__file__).resolve().parents[1]

# A failpoint is hit by name, or its name is handed to the ledger's commit
# (``failpoint="node.write_done"``), which hits it once the events are journaled,
# or a pure part is handed ``failpoints.corrupts`` and calls it as ``self._corrupts``
# (the connector's share plan: pure modules never import the failpoints).
HIT_LINE = re.compile(r'(?:(?:failpoints\.|self\._)(?:hit|corrupts)\(|failpoint=)"([a-z_.]+)"')
# Every module of the daemon but the one that declares the failpoints (its
# docstring shows a call): modules move, a fixed list would miss a new one.
FAILPOINT_FILES: Final = sorted(
    p for p in (REPO / "daemon").rglob("*.py") if p != REPO / "daemon" / "failpoints.py"
)


def test_every_failpoint_in_the_code_is_declared_and_every_declared_one_is_in_the_code() -> None:
    found = {name for path in FAILPOINT_FILES for name in HIT_LINE.findall(path.read_text())}
    assert found == set(failpoints.POINTS)
    # Crash rounds kill at every point but those that only corrupt (integrity tests).
    crashable = {name for name, point in failpoints.POINTS.items() if not point.corrupts}
    assert set(CRASH_POINTS) == crashable


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("", {}),
        ("journal.append=crash", {"journal.append": ("crash", None, 0.0)}),
        (
            "journal.sync_fd=error@3, peer.send=sleep:0.25",
            {"journal.sync_fd": ("error", 3, 0.0), "peer.send": ("sleep", None, 0.25)},
        ),
        (
            "journal.write=enospc@1,node.write_done=stop",
            {
                "journal.write": ("enospc", 1, 0.0),
                "node.write_done": ("stop", None, 0.0),
            },
        ),
    ],
)
def test_failpoint_specs_parse(
    spec: str, expected: dict[str, tuple[str, int | None, float]]
) -> None:
    parsed = failpoints.parse(spec)
    assert {n: (p.action, p.nth, p.seconds) for n, p in parsed.items()} == expected


@pytest.mark.parametrize(
    "spec",
    [
        "journal.apend=crash",  # a typo must not silently test nothing
        "journal.append",
        "journal.append=explode",
        "journal.append=crash@0",
        "journal.append=crash@x",
        "journal.append=sleep",
        "journal.append=crash:1",
        "journal.append=error",  # no I/O there: an OSError would not mean a failed syscall
        "journal.append=crash,journal.append=crash@2",
    ],
)
def test_bad_failpoint_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match=failpoints.ENV):
        failpoints.parse(spec)


def test_failpoints_fire_on_the_nth_hit_only() -> None:
    try:
        failpoints.configure("journal.write=error@2")
        failpoints.hit("journal.write")
        with pytest.raises(OSError, match=r"failpoint journal\.write"):
            failpoints.hit("journal.write")
        failpoints.hit("journal.write")
        failpoints.hit("journal.append")  # not armed
        assert failpoints.armed()["journal.write"].hits == 3
    finally:
        failpoints.configure("")
    assert not failpoints.armed()


def test_a_crash_failpoint_is_a_sigkill_with_one_line_on_stderr() -> None:
    code = "from daemon import failpoints; failpoints.hit('peer.send'); print('survived')"
    env = {**os.environ, failpoints.ENV: "peer.send=crash"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, timeout=60
    )
    assert done.returncode == -9
    assert b"survived" not in done.stdout
    line = json.loads(done.stderr.decode().strip().splitlines()[-1])
    assert line["failpoint"] == "peer.send" and line["action"] == "crash" and line["hit"] == 1


CI_ROUNDS: Final = int(os.environ.get("KVPUSHD_CRASH_ROUNDS", "30"))
CI_SEED: Final = int(os.environ.get("KVPUSHD_CRASH_SEED", "20261129"))


@pytest.mark.slow
async def test_kill_rounds_under_load_lose_nothing_acknowledged(tmp_path: Path) -> None:
    lines: list[str] = []
    summary = await run_rounds(
        tmp_path, rounds=CI_ROUNDS, seed=CI_SEED, pairs=3, say=lines.append, stop_on_violation=True
    )
    report = "\n".join(lines)
    assert summary.violations == [], f"seed {CI_SEED}:\n{report}"
    assert len(summary.rounds) == CI_ROUNDS
    assert summary.stats.ok > CI_ROUNDS, report
    assert summary.acks_checked > 0


# ---------------------------------------------- storage-level crash points

WRITER_RECORD_BYTES: Final = 180


def writer_payload(seq: int) -> bytes:
    return f"record {seq} ".encode().ljust(WRITER_RECORD_BYTES, b".")


async def _journal_writer(directory: str, batches: int) -> None:
    """Append batches through GroupCommit; print each seq once it is durable.

    Tiny segments and a snapshot every few batches, so a crash can land in a
    rotation or a snapshot as easily as in a plain append or sync.
    """
    from daemon.journal.groupcommit import GroupCommit
    from daemon.journal.writer import Journal

    journal = Journal.open(directory, segment_bytes=2048)
    journal.take_recovered()
    commit = GroupCommit(journal, on_fatal=lambda exc: os._exit(3))
    rng = random.Random(batches)
    for batch in range(batches):
        seqs = [journal.append(writer_payload(journal.next_seq)) for _ in range(rng.randint(1, 6))]
        await commit.durable(seqs[-1])
        print(f"durable {seqs[-1]}", flush=True)
        if batch % 7 == 6:
            seq = journal.commit()
            journal.write_snapshot(seq, b"snapshot %d" % seq)
            journal.prune(retain_segments=1)
    commit.close()
    journal.close()


STORAGE_CRASHES: Final = [
    (name, nth)
    for name, nths in {
        "journal.append": (1, 40),
        "journal.write": (1, 20),
        "journal.sync_fd": (1, 12),
        "groupcommit.synced": (2, 25),
        "journal.fdatasync": (1, 4),
        "journal.rotate": (1, 3),
        "journal.snapshot": (1, 3),
    }.items()
    for nth in nths
]


@pytest.mark.parametrize(("name", "nth"), STORAGE_CRASHES)
def test_journal_writer_killed_at_a_failpoint_keeps_every_durable_record(
    tmp_path: Path, name: str, nth: int
) -> None:
    directory = tmp_path / "journal"
    env = {**os.environ, failpoints.ENV: f"{name}=crash@{nth}"}
    run = subprocess.run(
        [sys.executable, "-m", "tests.test_crash", "journal-writer", str(directory), "40"],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert run.returncode == -9, run.stderr.decode()
    durable = [int(line.split()[1]) for line in run.stdout.decode().splitlines()]
    last = durable[-1] if durable else 0
    _check_recovered(directory, last)
    # Recovery leaves a journal that a new writer opens and appends to.
    again = subprocess.run(
        [sys.executable, "-m", "tests.test_crash", "journal-writer", str(directory), "3"],
        cwd=REPO,
        env={**os.environ, failpoints.ENV: ""},
        capture_output=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr.decode()
    _check_recovered(directory, int(again.stdout.decode().split()[-1]))


def _check_recovered(directory: Path, last_durable: int) -> None:
    contents = read_journal(directory)
    covered = 0
    if contents.snapshot is not None:
        covered, payload = contents.snapshot
        assert payload == b"snapshot %d" % covered
    records = dict(contents.records)
    for seq in range(covered + 1, last_durable + 1):
        assert records.get(seq) == writer_payload(seq), f"durable record {seq} lost"
    assert contents.last_seq >= last_durable


def _main(argv: Iterable[str]) -> int:
    args = list(argv)
    if args[:1] == ["journal-writer"]:
        asyncio.run(_journal_writer(args[1], int(args[2])))
        return 0
    print("usage: python -m tests.test_crash journal-writer DIR BATCHES", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
