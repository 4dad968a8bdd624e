"""Injected faults: a failing disk, a peer killed mid-write, a peer frozen past its TTL.

Each test runs two real daemons with simulated engines (the crash rounds'
harness, harness/crashrounds.py) and ends with the same checks as a crash
round: every acknowledgement an engine received is in its daemon's journal,
the journals replay, every request was released, and no engine byte changed
where none may.

* A failed fdatasync or a full disk is fatal (ARCHITECTURE.md, Journal: exit and
  replay, never retry): the daemon exits with status 3 and says why in one line, whether
  the failure hit the group commit's sync thread, a write, or the loop's own
  synchronous path (a snapshot); after a restart the journal replays to the
  last durable record.
* A decode daemon killed while the prefill daemon writes into it: the push
  fails cleanly on the prefill side and nothing hangs.
* A daemon frozen (SIGSTOP) past its peer TTL is declared dead, its peer fails
  what depended on it, and when it thaws it re-authenticates without
  resurrecting anything: old request ids stay released and are refused as
  stale.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import pytest

from daemon.client import RpcError
from daemon.journal.replay import replay
from daemon.sim.engine import Expectation, tail_pairs
from daemon.sim.launcher import TEST_TIMING, Daemon
from harness.crashrounds import (
    DECODE,
    LAYOUT,
    PREFILL,
    CrashEngine,
    CrashPair,
    log_trouble,
)
from schemas import rpc
from schemas.events import KvReady, Record, Refused
from schemas.reasons import Reason
from tests.support.journals import lose_from
from tests.support.waiting import is_stopped, wait_until

PEER_TTL_S: Final = TEST_TIMING.peer_ttl_s
EXIT_JOURNAL_FATAL: Final = 3  # daemon/service.py


# ------------------------------------------------------------------ helpers


async def started_pair(
    tmp_path: Path, closing: list[CrashPair], failpoint_env: dict[str, str] | None = None
) -> CrashPair:
    pair = CrashPair(tmp_path, "f", random.Random(7))
    closing.append(pair)  # closed (daemons stopped) even if starting fails half-way
    await pair.start(failpoint_env)
    return pair


async def exit_code(daemon: Daemon, timeout: float) -> int:
    proc = daemon.proc
    assert proc is not None
    await wait_until(f"{daemon.node} exits", lambda: proc.poll() is not None, timeout)
    return proc.returncode


def peer_up(daemon: Daemon, peer: str) -> bool:
    return any(p["node"] == peer and p["up"] for p in daemon.status()["peers"])


def idle(daemon: Daemon) -> bool:
    st = daemon.status()
    return not st["live"] and not st["pending_peer_registrations"] and not st["writes_in_flight"]


def request_records(daemon: Daemon, request_id: str) -> list[Record]:
    found: list[Record] = []

    def collect(record: Record, touched: object) -> None:
        if getattr(record.event, "request_id", None) == request_id:
            found.append(record)

    replay(daemon.journal, on_record=collect)
    return found


class Steps:
    """Engine calls one at a time, each acknowledgement entered in the pair's ledgers."""

    def __init__(self, pair: CrashPair) -> None:
        self.pair = pair
        self.pe, self.de = pair.engines[PREFILL], pair.engines[DECODE]

    async def register_both(
        self, rid: str, slot: int, *, kv_ready: bool, prefill_first: bool = False
    ) -> None:
        src = [list(range(slot * 4, slot * 4 + 4)) for _ in LAYOUT]
        dst = [list(range(slot * 4 + 1, slot * 4 + 4)) for _ in LAYOUT]
        expect = Expectation(self.pe.engine_id, tail_pairs(LAYOUT, src, LAYOUT, dst))

        async def decode() -> None:
            await self.de.decode_register(rid, dst, PREFILL, expect=expect)
            self.pair.ledgers[DECODE].said("Registered", rid)

        if not prefill_first:
            await decode()
        await self.pe.prefill(rid, src, peer=DECODE, kv_ready=False)
        self.pair.ledgers[PREFILL].said("Registered", rid)
        if prefill_first:
            await decode()
        if kv_ready:
            await self.pe.kv_ready(rid)
            self.pair.ledgers[PREFILL].said("KvReady", rid)

    async def release(self, node: str, rid: str) -> rpc.Ok | rpc.Deferred:
        engine = self.pair.engines[node]
        reply = await engine.release(rid, wait=False)
        if isinstance(reply, rpc.Ok):
            self.pair.ledgers[node].said("Released", rid)
            return reply
        self.pair.ledgers[node].reply(rid, reply)
        await engine.outcome(rid, (rpc.Released,), 20.0)
        return reply

    async def refused(self, node: str, rid: str, call: Any) -> str:
        """The refusal code of ``call`` (which must be refused)."""
        try:
            await call
        except RpcError as exc:
            self.pair.ledgers[node].refusal(rid, exc)
            return exc.code
        raise AssertionError(f"{node}: {rid}: not refused")


async def outcome(engine: CrashEngine, rid: str, timeout: float = 20.0) -> rpc.Event:
    kinds = (rpc.KvArrived, rpc.BlocksFreeable, rpc.RequestFailed, rpc.Released)
    event = await engine.outcome(rid, kinds, timeout)
    assert event is not None, f"{engine.engine_id}: no outcome for {rid} within {timeout} s"
    return event


async def finish(pair: CrashPair) -> None:
    """The checks of a crash round: journals, acknowledgements, bytes, a working pair."""
    up_at = time.monotonic()
    await pair.settle(up_at)
    pair.check()
    assert pair.violations == []


@pytest.fixture
async def closing() -> AsyncIterator[list[CrashPair]]:
    """Pairs to close (and daemons to thaw) whatever the test did."""
    pairs: list[CrashPair] = []
    yield pairs
    for pair in pairs:
        for daemon in pair.daemons.values():
            if daemon.proc is not None and daemon.proc.poll() is None:
                os.kill(daemon.proc.pid, signal.SIGCONT)
        await pair.close()


# ------------------------------------------------------------ journal faults


JOURNAL_FAULTS: Final = [
    # (daemon, failpoint, what the one line must say)
    pytest.param(PREFILL, "journal.sync_fd=error@30", "Input/output error", id="fdatasync-thread"),
    pytest.param(DECODE, "journal.write=enospc@25", "No space left on device", id="enospc-write"),
    pytest.param(
        PREFILL, "journal.fdatasync=error@1", "Input/output error", id="fdatasync-snapshot"
    ),
    pytest.param(DECODE, "journal.snapshot=enospc@1", "No space left on device", id="enospc-snap"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("node", "spec", "says"), JOURNAL_FAULTS)
async def test_a_journal_fault_exits_3_with_one_line_and_the_restart_replays_what_was_durable(
    tmp_path: Path, closing: list[CrashPair], node: str, spec: str, says: str
) -> None:
    pair = await started_pair(tmp_path, closing, {node: spec})
    assert pair.load is not None
    daemon = pair.daemons[node]
    pair.load.resume()
    # Never continue: the daemon exits (it does not serve on with errors).
    assert await exit_code(daemon, 30.0) == EXIT_JOURNAL_FATAL, daemon.logs()[-3000:]
    pair.load.pause()

    lines = [json.loads(line) for line in daemon.logs().splitlines() if line.startswith("{")]
    exits = [line for line in lines if line.get("event") == "exiting after a journal failure"]
    assert len(exits) == 1, exits
    name = spec.split("=")[0]
    assert says in exits[0]["error"] and f"failpoint {name}" in exits[0]["error"]
    # Nothing louder or messier than that line: no traceback, no error-level noise.
    trouble, _ = log_trouble(daemon, 0)
    assert trouble == []
    critical = [line for line in lines if line.get("level") == "critical"]
    assert critical == exits, critical  # one line for one failure

    # Restart: the journal replays to the last durable record, every
    # acknowledged transition is there, every request ends, pushes work.
    up_at = await pair.recover(node)
    await pair.settle(up_at)
    pair.check()
    assert pair.violations == []
    assert pair.acks_checked > 0


# --------------------------------------------------------------- peer faults


@pytest.mark.slow
async def test_decode_killed_mid_write_fails_the_push_cleanly(
    tmp_path: Path, closing: list[CrashPair]
) -> None:
    # The prefill worker holds every WRITE for a moment before posting it,
    # which is when the decode daemon dies.
    pair = await started_pair(tmp_path, closing, {PREFILL: "nixl.post=sleep:1.5"})
    steps = Steps(pair)
    prefill, decode = pair.daemons[PREFILL], pair.daemons[DECODE]
    await steps.register_both("mid", 1, kv_ready=True)
    await wait_until("the write is in flight", lambda: prefill.status()["writes_in_flight"], 10.0)
    decode.kill()

    failed = await outcome(steps.pe, "mid")
    assert isinstance(failed, rpc.RequestFailed), failed
    assert failed.reason in (Reason.TRANSFER_ERROR, Reason.PEER_DEAD)
    assert isinstance(await steps.release(PREFILL, "mid"), rpc.Ok)
    # Nothing hangs: no write, no request left, and the daemon still answers.
    await wait_until("the prefill daemon is idle", lambda: idle(prefill), 10.0)

    up_at = await pair.recover(DECODE)
    restarted = await outcome(steps.de, "mid")
    assert isinstance(restarted, rpc.RequestFailed), restarted
    await steps.release(DECODE, "mid")
    await pair.settle(up_at)
    pair.check()
    assert pair.violations == []


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [PREFILL, DECODE])
async def test_a_peer_frozen_past_its_ttl_is_declared_dead_and_resurrects_nothing(
    tmp_path: Path, closing: list[CrashPair], frozen: str
) -> None:
    pair = await started_pair(tmp_path, closing)
    steps = Steps(pair)
    survivor = DECODE if frozen == PREFILL else PREFILL
    ice, other = pair.daemons[frozen], pair.daemons[survivor]
    boot_id = ice.status()["boot_id"]
    await steps.register_both("old", 2, kv_ready=False)  # forwarded, trimmed, no write yet

    assert ice.proc is not None
    os.kill(ice.proc.pid, signal.SIGSTOP)
    try:
        await wait_until("the peer is declared dead", lambda: not peer_up(other, frozen), 10.0)
        # Its peer fails what depended on it, by itself: as dead, or as out of
        # time, whichever comes first (the harness's state deadlines and the
        # peer TTL are both 3 s, so they race).
        failed = await outcome(pair.engines[survivor], "old", PEER_TTL_S + 5.0)
        assert isinstance(failed, rpc.RequestFailed), failed
        assert failed.reason in (Reason.PEER_DEAD, Reason.DEADLINE_EXCEEDED), failed
        if survivor == DECODE:
            # Declared dead and fenced: the decode blocks are free again (a
            # release made before the fence waits for it).
            await steps.release(DECODE, "old")
            assert not any(r["request_id"] == "old" for r in other.status()["requests"])
            # Nothing hangs: a new registration is refused at once.
            refusal = steps.refused(
                DECODE, "new", steps.de.decode_register("new", [[9], [9]], PREFILL)
            )
            assert await asyncio.wait_for(refusal, 5.0) == Reason.PEER_DEAD
        assert await asyncio.wait_for(asyncio.to_thread(other.status), 5.0)
    finally:
        os.kill(ice.proc.pid, signal.SIGCONT)

    # The thawed daemon sees its link died, fails its side, and re-authenticates.
    # (Its own deadlines ran on while it was frozen: whichever it notices first.)
    thawed = await outcome(pair.engines[frozen], "old", PEER_TTL_S + 10.0)
    assert isinstance(thawed, rpc.RequestFailed), thawed
    assert thawed.reason in (Reason.PEER_DEAD, Reason.DEADLINE_EXCEEDED), thawed
    if frozen == DECODE:
        await steps.release(DECODE, "old")  # Ok, or deferred until the peer is fenced
    await pair.wait_link()
    assert peer_up(other, frozen) and peer_up(ice, survivor)
    assert ice.status()["boot_id"] == boot_id  # the same process: a new link, not a restart
    # The prefill side releases only now: on the new link it re-sent its
    # (late) final word about "old" to a decode side that had released it.
    assert isinstance(await steps.release(PREFILL, "old"), rpc.Ok)

    # Old ids stay released: anything about them is refused as stale.
    stale = Reason.STALE_INCARNATION
    assert await steps.refused(DECODE, "old", steps.de.client.release("old", 1)) == stale
    again = steps.de.client.register_request(
        steps.de.engine_id, "old", steps.de.role, [[5], [5]], peer=PREFILL, incarnation=1
    )
    assert await steps.refused(DECODE, "old", again) == stale
    assert await steps.refused(PREFILL, "old", steps.pe.client.kv_ready("old", 1)) == stale
    # Nothing was resurrected: after Released only refusals were journaled.
    for node in (PREFILL, DECODE):
        names = [type(r.event).__name__ for r in request_records(pair.daemons[node], "old")]
        assert set(names[names.index("Released") + 1 :]) <= {"Refused"}, (node, names)
        assert not any(r["request_id"] == "old" for r in pair.daemons[node].status()["requests"])
    await finish(pair)


@pytest.mark.slow
async def test_a_pusher_frozen_just_before_posting_cannot_write_once_fenced(
    tmp_path: Path, closing: list[CrashPair]
) -> None:
    # The prefill daemon stops itself (SIGSTOP) on the worker thread just
    # before its first WRITE, having decided to write with the decode
    # engine's addresses in hand. The decode daemon declares it dead, fences
    # it and hands the blocks back; then the prefill thaws and goes on to post
    # with those stale addresses. Fencing revoked the window they point
    # into (a private sink now), so the freed blocks keep the bytes they had.
    pair = await started_pair(tmp_path, closing, {PREFILL: "nixl.post=stop@1"})
    steps = Steps(pair)
    prefill = pair.daemons[PREFILL]
    assert prefill.proc is not None
    await steps.register_both("late", 1, kv_ready=False)
    # The WRITE is posted while kv_ready is being made durable, so the reply
    # may come only after the thaw.
    ready = asyncio.ensure_future(steps.pe.kv_ready("late"))
    await wait_until(
        "the prefill daemon froze at nixl.post", lambda: is_stopped(prefill.proc.pid), 10
    )

    failed = await outcome(steps.de, "late", PEER_TTL_S + 10.0)
    assert isinstance(failed, rpc.RequestFailed), failed
    # Declared dead, or (whichever comes first) out of time while the write
    # was announced: either way the request fails on the decode side.
    assert failed.reason in (Reason.PEER_DEAD, Reason.DEADLINE_EXCEEDED), failed
    # The release is honoured once the peer is fenced (at once if it already
    # was, else deferred until then): the blocks are free again.
    await steps.release(DECODE, "late")
    assert not any(r["request_id"] == "late" for r in pair.daemons[DECODE].status()["requests"])
    assert steps.de.stray_changes() == []

    os.kill(prefill.proc.pid, signal.SIGCONT)
    assert isinstance(await ready, rpc.Ok)
    pair.ledgers[PREFILL].said("KvReady", "late")
    thawed = await outcome(steps.pe, "late", PEER_TTL_S + 10.0)
    assert isinstance(thawed, rpc.RequestFailed), thawed

    # The worker went on from the failpoint into make_prepped_xfer and
    # transfer() with the old descriptors; wait until that write settled.
    # It went into the revoked window's sink (or was cancelled first, by a
    # deadline or the fence): either way it reached nobody's KV.
    def settled() -> dict[str, int] | None:
        st = prefill.status()
        dp = st["dataplane"]
        ended = dp["writes"] + dp["write_errors"] + dp["writes_cancelled"]
        return dp if not st["writes_in_flight"] and ended >= 1 else None

    await wait_until("the stale write settled", settled, 10.0)
    # Not one byte of the released blocks changed.
    assert steps.de.stray_changes() == []
    await steps.release(PREFILL, "late")
    await pair.wait_link()
    await finish(pair)


# ------------------------------------------------ the write path's durability


@pytest.mark.slow
async def test_the_write_overlaps_the_pushers_fdatasync_and_a_power_cut_in_between_is_safe(
    tmp_path: Path, closing: list[CrashPair]
) -> None:
    # Every fdatasync of the prefill daemon stalls 1.5 s (a slow disk). Its
    # WRITE is posted while kv_ready/trimmed/write_started are being
    # synced (ARCHITECTURE.md, "The write path's durability"): the data
    # lands and the decode side tells its engine while the prefill engine
    # has heard nothing, not even the reply to kv_ready.
    pair = await started_pair(tmp_path, closing, {PREFILL: "journal.sync_fd=sleep:1.5"})
    steps = Steps(pair)
    prefill, decode = pair.daemons[PREFILL], pair.daemons[DECODE]
    # The prefill side first: its slow sync must not eat the decode side's
    # (short, crash-round) registration deadline.
    await steps.register_both("cut", 1, kv_ready=False, prefill_first=True)
    ready = asyncio.ensure_future(steps.pe.kv_ready("cut"))
    arrived = await outcome(steps.de, "cut")
    assert isinstance(arrived, rpc.KvArrived), arrived
    pair.ledgers[DECODE].event(arrived)
    assert not ready.done(), "kv_ready was answered before the write landed: nothing overlapped"
    told = steps.pe.seen("cut", (rpc.BlocksFreeable, rpc.RequestFailed, rpc.Released))
    assert told is None, f"the prefill engine heard {told} before its record was durable"

    # A power cut now: the prefill daemon dies inside that fdatasync and the
    # records it had not synced are gone (SIGKILL alone would keep them in
    # the page cache, so the test cuts them off the journal).
    prefill.kill()
    ready.cancel()
    # (The records may still have been in the daemon's buffer, waiting for
    # the sync in flight to end: then there is nothing on disk to cut.)
    lose_from(
        prefill.journal, lambda r: isinstance(r.event, KvReady) and r.event.request_id == "cut"
    )
    up_at = await pair.recover(PREFILL)

    # The restarted pusher knows only the registration and fails it; it can
    # never write for it again. The decode side keeps what landed: the bytes
    # were whole (the notification follows the data) and checked by its engine.
    failed = await outcome(steps.pe, "cut")
    assert isinstance(failed, rpc.RequestFailed) and failed.reason is Reason.DAEMON_RESTART
    pair.ledgers[PREFILL].event(failed)
    # On a loaded machine a short crash-round deadline may release either
    # side first; the engine's late release is then refused as stale, and
    # that refusal is journaled after the Released (and left out below).
    for node in (PREFILL, DECODE):
        try:
            await steps.release(node, "cut")
        except RpcError as exc:
            assert exc.code == Reason.STALE_INCARNATION.value, exc

    def lifecycle(daemon: Daemon) -> list[str]:
        events = daemon.journal_events("cut")
        late = [e for e in events if isinstance(e, Refused)]
        assert all(e.reason is Reason.STALE_INCARNATION for e in late), late
        return [type(e).__name__ for e in events if not isinstance(e, Refused)]

    assert lifecycle(prefill) == [
        "Registered",
        "PeerRegistered",
        "Failed",
        "Released",
    ]
    # The decode journal says what happened: data landed (the pusher's
    # "writing" never came, it was owed only once durable), then released.
    assert lifecycle(decode) == [
        "Registered",
        "WriteDone",
        "Released",
    ]
    assert steps.de.bad_reports() == []
    await pair.settle(up_at)
    pair.check()
    assert pair.violations == []
