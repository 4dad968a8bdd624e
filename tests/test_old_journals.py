"""Journals written before the architecture change still verify, replay and restart.

tests/data/journals-d0806d2/ holds journals written by commit d0806d2 (the
code before daemon/ was split into wings and the runtime moved onto the
ledger): a two-node ``kvpushd demo`` run (prefill, decode) and a pusher
journal with a registry snapshot and a pending receiver registration. The
``.expected`` files are that code's own replay of each, as an encoded
registry snapshot, which this code decodes and compares with its own
replay. The journal format is a public surface: a change that breaks these
is a format change, and needs a format version.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from daemon.cli import main
from daemon.journal.replay import decode_snapshot, replay
from daemon.sim.launcher import Daemon, free_port

DATA = Path(__file__).parent / "data" / "journals-d0806d2"
NAMES = ["prefill", "decode", "prefill-snapshot"]


@pytest.fixture
def journals(tmp_path: Path) -> Path:
    # A copy: opening a journal (a restart) writes to it.
    copy = tmp_path / "journals"
    shutil.copytree(DATA, copy)
    return copy


@pytest.mark.parametrize("name", NAMES)
def test_an_old_journal_verifies(journals: Path, name: str, capsys) -> None:
    assert main(["journal", "verify", str(journals / name)]) == 0
    assert "OK" in capsys.readouterr().out


@pytest.mark.parametrize("name", NAMES)
def test_an_old_journal_replays_to_the_registry_the_old_code_built(
    journals: Path, name: str
) -> None:
    result = replay(journals / name)
    replayed = result.registry.snapshot(result.last_seq)
    # Compared as decoded registries: fields appended since (with defaults,
    # such as a forwarded receiver's fingerprint) add to the encoding, not
    # to what the registry holds.
    assert replayed == decode_snapshot((journals / f"{name}.expected").read_bytes())


def test_a_daemon_restarts_on_an_old_journal_and_fails_what_was_pending(
    journals: Path, tmp_path: Path
) -> None:
    before = replay(journals / "prefill-snapshot")
    assert len(before.registry.pending) == 1
    daemon = Daemon("prefill-old", tmp_path, free_port())
    shutil.copytree(journals / "prefill-snapshot", daemon.journal)
    daemon.start()
    try:
        status = daemon.status()
        assert status["live"] == 0
        assert status["pending_peer_registrations"] == 0
    finally:
        assert daemon.stop() == 0
    after = replay(daemon.journal)
    assert after.last_seq > before.last_seq
    assert not after.registry.pending
    # The pending registration ended as a restart failure, and is tombstoned.
    assert after.registry.tombstones.covers("pending-1", 1)
