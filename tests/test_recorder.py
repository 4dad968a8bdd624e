"""The recorder changes the registry only for records the journal will take."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.journal.format import MAX_RECORD_BYTES
from daemon.journal.replay import replay
from daemon.journal.writer import Journal
from daemon.node.ledger import Ledger
from daemon.sim.lifecycle import PREFILL, FakeClock
from schemas.events import DaemonStarted, Failed, KvReady
from schemas.layout import Role
from schemas.reasons import Reason
from statemachine import Registry


def test_a_record_too_large_for_the_journal_changes_nothing(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "j") as journal:
        rec = Ledger(journal, Registry(), node="prefill", clock=FakeClock())
        rec.append(DaemonStarted(1, "test", "boot-1"))
        rec.append(rec.registry.check_attach(PREFILL))
        rec.append(
            rec.registry.check_register("r1", 1, Role.PUSHER, PREFILL.engine_id, "d", [[1], [2]])
        )
        before = rec.registry.snapshot(0)
        next_seq = journal.next_seq

        huge = Failed("r1", 1, Reason.ABORTED, "x" * (MAX_RECORD_BYTES + 1))
        with pytest.raises(ValueError, match="payload must be"):
            rec.append(huge)

        # Neither the registry nor the journal moved; the next record goes on.
        assert rec.registry.snapshot(0) == before
        assert journal.next_seq == next_seq
        rec.append(KvReady("r1", 1))
        journal.commit()
    replayed = replay(tmp_path / "j").registry
    assert replayed.snapshot(0) == rec.registry.snapshot(0)
