"""The ledger: it changes the registry only for records the journal takes, tells
only what is durable, and its group commit honours the configured window."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path

import msgspec
import pytest

from daemon.journal.format import MAX_RECORD_BYTES
from daemon.journal.groupcommit import GroupCommit
from daemon.journal.replay import replay
from daemon.journal.writer import Journal
from daemon.node.ledger import Ledger
from daemon.node.runtime import Node
from harness.lifecycle import PREFILL, FakeClock
from schemas.config import Config
from schemas.events import DaemonStarted, Failed, KvReady, Released, WriteDone
from schemas.layout import EngineLayout, GroupKind, GroupLayout, Role
from schemas.reasons import Reason
from statemachine import Registry
from statemachine.reactions import Cause, Stimulus, Why, react


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


DECODE = EngineLayout("decode-0", (GroupLayout(GroupKind.ATTENTION, 64),))


class _Courier:
    """Records what is delivered, and how far the journal was durable at that moment."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.told: list[tuple[str, object, int]] = []

    def tell_engine(self, engine_id: str, message: object) -> None:
        self.told.append((engine_id, message, self.journal.durable_seq))

    def tell_peer(self, node: str, message: object) -> bool:
        self.told.append((node, message, self.journal.durable_seq))
        return True


async def test_notices_go_out_only_once_their_records_are_durable(tmp_path: Path) -> None:
    # Invariant 6 at the ledger: what the core says is owed is delivered after
    # the group commit made the record durable, never at append time.
    with Journal.open(tmp_path / "j") as journal:
        group = GroupCommit(journal, on_fatal=lambda exc: None)
        courier = _Courier(journal)
        ledger = Ledger(journal, Registry(), node="decode", group=group, courier=courier)
        try:
            ledger.append(ledger.registry.check_attach(DECODE))
            registered = ledger.commit(
                [ledger.registry.check_register("r1", 1, Role.RECEIVER, "decode-0", "p", [[3]])],
                Cause.ENGINE,
            )
            assert courier.told == []  # appended, not yet durable: nobody told
            assert journal.durable_seq < registered.seq
            await registered
            ((peer, forward, durable),) = courier.told
            assert (peer, type(forward).__name__) == ("p", "Forward")
            assert durable >= registered.seq
            arrived = ledger.commit([WriteDone("r1", 1)], Cause.DAEMON)
            await arrived
            engine, kv_arrived, durable = courier.told[-1]
            assert (engine, type(kv_arrived).__name__) == ("decode-0", "KvArrived")
            assert durable >= arrived.seq
        finally:
            group.close()


def _config(directory: Path, window_ms: float) -> Config:
    return msgspec.convert(
        {
            "node": "window",
            "listen": "",
            "journal": {"dir": str(directory), "commit_window_ms": window_ms},
        },
        Config,
    )


async def _wait(commit: Awaitable[None]) -> None:
    await commit


async def _fsyncs_for_spread_commits(directory: Path, window_ms: float) -> int:
    """A started node's ledger commits 40 records ~1 ms apart; returns its group commits."""
    node = Node(_config(directory, window_ms))
    await node.start()
    try:
        before = node.group.commits  # type: ignore[union-attr]
        handlers = []
        for i in range(40):
            # As a handler does: commit, then wait until durable to reply.
            commit = node.ledger.commit([DaemonStarted(i, "window-test", f"boot-{i}")])
            handlers.append(asyncio.ensure_future(_wait(commit)))
            await asyncio.sleep(0.001)
        await asyncio.gather(*handlers)
        return node.group.commits - before  # type: ignore[union-attr]
    finally:
        await node.close()


async def test_the_configured_commit_window_puts_more_records_in_each_fsync(
    tmp_path: Path,
) -> None:
    # journal.commit_window_ms reaches the group commit: with a window, a
    # commit waits for the records of the next milliseconds and syncs them
    # together; without one, each record arriving after a sync gets its own.
    unwindowed = await _fsyncs_for_spread_commits(tmp_path / "0", 0.0)
    windowed = await _fsyncs_for_spread_commits(tmp_path / "30", 30.0)
    assert 0 < windowed < unwindowed


async def test_a_commit_that_lifts_a_quarantine_carries_the_deferred_release_itself(
    tmp_path: Path,
) -> None:
    # The decode engine released while the write was under way: deferred.
    # Whatever commit then lifts the quarantine (here the pusher's final
    # word, committed plainly) carries the release in the same commit: the
    # core says what follows and the ledger appends it; no caller has to ask.
    with Journal.open(tmp_path / "j") as journal:
        group = GroupCommit(journal, on_fatal=lambda exc: None)
        courier = _Courier(journal)
        ledger = Ledger(journal, Registry(), node="decode", group=group, courier=courier)
        try:
            ledger.append(ledger.registry.check_attach(DECODE))
            registry = ledger.registry
            await ledger.commit(
                [registry.check_register("r1", 1, Role.RECEIVER, "decode-0", "p", [[3]])]
            )
            record = registry.lookup("r1", 1)
            await ledger.commit(react(record, Stimulus.PEER_WRITING, Why(num_blocks=1, nbytes=64)))
            deferred = react(registry.lookup("r1", 1), Stimulus.ENGINE_RELEASE)
            assert [type(e).__name__ for e in deferred][-1] == "ReleaseDeferred", deferred
            await ledger.commit(deferred, Cause.ENGINE)
            final_word = react(registry.lookup("r1", 1), Stimulus.PEER_WRITE_DONE)
            assert not any(isinstance(e, Released) for e in final_word)  # the core's answer alone
            commit = ledger.commit(final_word, Cause.PEER)
            await commit
            kinds = [type(event).__name__ for event, _ in commit.records]
            assert kinds[-1] == "Released", kinds
            assert registry.get("r1") is None
            assert ("decode-0", "Released") in [(to, type(m).__name__) for to, m, _ in courier.told]
        finally:
            group.close()
