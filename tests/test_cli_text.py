"""What operators read from the command line: help, version, `journal show` and `stats` text."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.cli import build_parser
from daemon.journal.writer import FsyncPolicy, Journal
from daemon.node.ledger import Ledger
from harness.lifecycle import FakeClock, run_mix
from statemachine import Registry
from tests.support import REPO


def _kvpushd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("journal") / "j"
    with Journal.open(path, fsync=FsyncPolicy.NEVER) as j:
        run_mix(Ledger(j, Registry(), node="prefill-a", clock=FakeClock()), 20)
    return path


def _options(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.Action]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _options(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            found.append((path, action))
    return found


def test_every_option_and_argument_has_help():
    options = _options(build_parser(), "kvpushd")
    assert len(options) > 30
    missing = [f"{path} {a.option_strings or a.dest}" for path, a in options if not a.help]
    assert missing == []


def test_version_is_the_daemons():
    from daemon.version import VERSION  # what DaemonStarted and status say

    proc = _kvpushd("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"kvpushd {VERSION}"


def test_run_help_lists_exit_codes():
    out = _kvpushd("run", "--help").stdout
    codes = re.findall(r"^  (\d)  ", out[out.index("exit codes:") :], flags=re.M)
    assert codes == ["0", "2", "3"]


def test_show_prints_iso_utc_times_and_enum_values(journal: Path):
    proc = _kvpushd("journal", "show", str(journal))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) > 20
    for line in lines:
        _seq, when, node, kind = line.split()[:4]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", when), line
        assert node == "prefill-a" and kind[0].isupper()
    assert "<" not in proc.stdout and "GroupKind" not in proc.stdout and "Role." not in proc.stdout
    assert any('"kind":"attention"' in line for line in lines)
    assert any(" role=pusher " in line for line in lines)
    json_line = _kvpushd("journal", "show", str(journal), "--json").stdout.splitlines()[0]
    assert '"time":"' in json_line and json_line.count("Z") >= 1


def test_stats_lists_states_and_transitions_in_lifecycle_order(journal: Path):
    out = _kvpushd("journal", "stats", str(journal)).stdout
    reached = out[out.index("state reached") : out.index("refusal reason")]
    states = [line.split()[0] for line in reached.splitlines()[2:] if line.strip()]
    assert states == ["registered", "trimmed", "writing", "done", "failed", "released"]
    latency = out[out.index("transition ") :]
    transitions = [line.split()[0] for line in latency.splitlines()[2:] if line.strip()]
    assert transitions == [
        "registered->trimmed",
        "registered->failed",
        "trimmed->writing",
        "writing->done",
        "writing->failed",
        "done->released",
        "failed->released",
    ]
