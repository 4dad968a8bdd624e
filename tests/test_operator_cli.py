"""The operator's commands on the wrong input, and on a reader that goes away.

* ``journal verify|show|stats`` on a directory that holds no journal (say
  /var/lib/kvpushd instead of /var/lib/kvpushd/NODE) say there is none and
  exit 2, never "OK: 0 records"; ``journal replay|timeline|report`` on a
  file that is not a journal, or one without an intact record, exit 2 with
  one line and no numpy warnings.
* Every command ends quietly when its stdout is a pipe nobody reads any
  more (``kvpushd status | head``): no BrokenPipeError traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.journal.writer import FsyncPolicy, Journal
from daemon.node.ledger import Ledger
from daemon.sim.launcher import Daemon
from harness.lifecycle import FakeClock, run_mix
from statemachine import Registry
from tests.support import REPO


def kvpushd(*args: str, stdout: int = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def one_line_exit_2(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def journals(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """STATE_DIRECTORY-like: ``<root>/node-a/`` holds a journal of 20 requests."""
    root = tmp_path_factory.mktemp("state")
    with Journal.open(root / "node-a", fsync=FsyncPolicy.NEVER) as journal:
        run_mix(Ledger(journal, Registry(), node="node-a", clock=FakeClock()), 20)
    return root


@pytest.mark.parametrize("command", ["verify", "stats", "show"])
def test_a_directory_without_a_journal_is_no_journal_not_ok(journals: Path, command: str) -> None:
    empty = journals / "empty"
    empty.mkdir(exist_ok=True)
    proc = kvpushd("journal", command, str(empty))
    said = one_line_exit_2(proc)
    assert "no journal here" in said and str(empty) in said
    assert proc.stdout == ""
    # One level too high: the message names the journals below.
    said = one_line_exit_2(kvpushd("journal", command, str(journals)))
    assert "no journal here" in said and str(journals / "node-a") in said


@pytest.mark.parametrize(
    "command",
    [("replay",), ("replay", "--json"), ("timeline", "--request", "req-1"), ("report", "-o")],
)
def test_a_file_that_is_not_a_journal_is_one_line_exit_2(tmp_path: Path, command: tuple) -> None:
    report = tmp_path / "report.html"
    args = [*command, str(report)] if command[-1] == "-o" else list(command)
    text = tmp_path / "notes.txt"
    text.write_text("not a journal\n")
    said = one_line_exit_2(kvpushd("journal", *args, str(text)))
    assert str(text) in said and "not a kvpushd journal" in said
    # A segment's magic and nothing intact after it: no record to analyse.
    hollow = tmp_path / "seg-00000000000000000001.kvj"
    hollow.write_bytes(b"KVPJ" + b"\xff" * 60)
    said = one_line_exit_2(kvpushd("journal", *args, str(hollow)))
    assert "no intact record" in said
    assert not report.exists()


# ------------------------------------------------------------------ | head


def _into_a_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """Run with stdout a pipe whose reader is already gone (as `| head` after its lines)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return kvpushd(*args, stdout=write_end)
    finally:
        os.close(write_end)


JOURNAL_COMMANDS = [
    ("verify",),
    ("show",),
    ("show", "--json"),
    ("stats",),
    ("stats", "--json"),
    ("replay",),
    ("replay", "--json"),
    ("timeline", "--request", "req-*"),
]


@pytest.mark.parametrize("command", JOURNAL_COMMANDS, ids=" ".join)
def test_journal_commands_end_quietly_on_a_closed_pipe(journals: Path, command: tuple) -> None:
    proc = _into_a_closed_pipe("journal", command[0], str(journals / "node-a"), *command[1:])
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("args", [("--help",), ("run", "--help"), ("journal", "replay", "--help")])
def test_help_ends_quietly_on_a_closed_pipe(args: tuple) -> None:
    proc = _into_a_closed_pipe(*args)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("json", [False, True])
def test_status_ends_quietly_on_a_closed_pipe(solo_daemon: Daemon, json: bool) -> None:
    proc = _into_a_closed_pipe("status", "--socket", solo_daemon.socket, *(["--json"] * json))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
