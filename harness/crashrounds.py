"""Crash rounds: SIGKILL a daemon under load, restart it, and check nothing broke.

The harness of tests/test_crash.py (30 rounds in CI), tests/test_faults.py
(injected faults with the same end checks) and ``tools/soak.py`` (hundreds of
rounds). Each round kills the prefill or the decode daemon while a background
task pushes requests through simulated engines on both nodes: either at a
failpoint (the daemon is restarted with ``KVPUSHD_FAILPOINTS=name=crash@K``
and dies on the Kth hit) or at a random moment (a plain SIGKILL after a
random delay). The daemon is restarted without failpoints, its engine
re-registers with the same shared memory, and then:

* nothing acknowledged is lost: every reply and event an engine received
  (RequestAccepted, Ok, Deferred, KvArrived, BlocksFreeable, RequestFailed,
  Released, a refusal) matches a record in that daemon's journal;
* the journal folds through the core without a ReplayError, every request's
  events are in a legal order (checked by an oracle written here, not by the
  core's table), and the snapshot-based replay equals the full history;
* no destination block received bytes after its request was released and
  every delivered request holds the right bytes (the engines' verification
  reports and a whole-cache comparison once everything is released);
* every request reaches ``released`` on both nodes within its deadlines once
  both daemons are up again, and fresh requests push correctly.

:func:`run_rounds` runs the rounds and returns a :class:`Summary`; the
daemons are real processes (:mod:`daemon.sim.launcher`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from daemon import failpoints
from daemon.client import ConnectionLost, EngineClient, RpcError
from daemon.journal.format import JournalError
from daemon.journal.replay import ReplayError, ReplayResult, replay
from daemon.nativelog import from_library
from daemon.sim.engine import Expectation, SimEngine, SimGroup, tail_pairs
from daemon.sim.kvpattern import Change, changed_blocks
from daemon.sim.launcher import STATUS_ERRORS, Daemon, free_port
from schemas import rpc
from schemas.events import Failed, Record, Refused, Registered
from schemas.layout import Role
from schemas.reasons import Reason

# ------------------------------------------------------------------ settings

# Short deadlines: a request nobody finishes is released within seconds.
DEADLINES: Final = {
    "registered": 3.0,
    "trimmed": 3.0,
    "writing": 3.0,
    "done": 5.0,
    "failed": 3.0,
}
# Frequent snapshots, so crashes land around them too; segments are never
# pruned, so the full history stays readable for the checks.
JOURNAL_EXTRA: Final = "snapshot_every = 40\nretain_segments = 1000000"

LAYOUT: Final = (
    SimGroup(num_blocks=256, block_bytes=2048, layers=2),
    SimGroup(num_blocks=256, block_bytes=1024, layers=1),
)
SLOT_BLOCKS: Final = 4  # logical blocks per group a request may use
SLOTS: Final = 256 // SLOT_BLOCKS
CONCURRENCY: Final = 6

# Once both daemons are up again every request must be released within the
# longest deadline chain (registered -> failed -> released, a quarantine
# fenced on the way) plus slack for a loaded 2-core box.
SETTLE_BOUND_S: Final = sum(DEADLINES.values()) + 5.0
OUTCOME_WAIT_S: Final = SETTLE_BOUND_S
FAILPOINT_WAIT_S: Final = 6.0  # load time after which an unreached failpoint gives way
READY_TIMEOUT_S: Final = 90.0
RESEND_GRACE_S: Final = 0.5  # for the events a daemon resends on re-registration to arrive

PREFILL, DECODE = "prefill", "decode"
NO_FAILPOINTS: Final = {failpoints.ENV: ""}

# Where a crash may be asked for: failpoint -> (daemons that pass it, the
# largest K drawn for each). K is drawn in 1..max so that, at the load this
# harness makes, most crashes come within a second or two; small K often
# fires while the daemon starts or while its engine re-registers.
CRASH_POINTS: Final[dict[str, dict[str, int]]] = {
    "journal.append": {PREFILL: 120, DECODE: 80},
    "journal.write": {PREFILL: 50, DECODE: 40},
    "journal.sync_fd": {PREFILL: 40, DECODE: 30},
    "groupcommit.synced": {PREFILL: 40, DECODE: 30},
    "journal.fdatasync": {PREFILL: 4, DECODE: 3},
    "journal.snapshot": {PREFILL: 4, DECODE: 3},
    "journal.rotate": {PREFILL: 1, DECODE: 1},
    "nixl.post": {PREFILL: 20},
    "nixl.posted": {PREFILL: 20},
    "node.write_done": {PREFILL: 20},
    "node.kv_arrived": {DECODE: 20},
    "peer.send": {PREFILL: 40, DECODE: 20},
    "engine.reply": {PREFILL: 50, DECODE: 40},
    # Killed with a registration accepted (and journaled) but not yet answered.
    "engine.accepted": {PREFILL: 20, DECODE: 20},
}


def daemon_pair(workdir: Path) -> dict[str, Daemon]:
    p_port, d_port = free_port(), free_port()
    deadlines = "[deadlines]\n" + "\n".join(f"{k} = {v}" for k, v in DEADLINES.items())
    common: dict[str, Any] = {"extra": deadlines, "journal_extra": JOURNAL_EXTRA}
    return {
        PREFILL: Daemon(PREFILL, workdir, p_port, [(DECODE, d_port)], **common),
        DECODE: Daemon(DECODE, workdir, d_port, [(PREFILL, p_port)], **common),
    }


# ------------------------------------------------------------ the engines


class Budget:
    """Seconds that run down only while an engine is connected.

    A restart, slow on a loaded box, must not eat the time a request is given
    once its daemon is back; how soon everything settles after a restart is
    what the settle check bounds.
    """

    def __init__(self, engine: CrashEngine, seconds: float) -> None:
        self.engine = engine
        self.left = seconds
        self.last = time.monotonic()

    def tick(self) -> float:
        now = time.monotonic()
        if self.engine.connected.is_set():
            self.left -= now - self.last
        self.last = now
        return self.left


class CrashEngine(SimEngine):
    """A simulated engine that outlives its daemon: it reconnects with the same memory.

    Keeping the memory across restarts is what lets it see a write that lands
    after a release, whichever daemon died in between.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connected = asyncio.Event()
        self.generation = 0  # connections made so far; a new one means a new daemon life

    @classmethod
    async def launch(
        cls, engine_id: str, role: Role, socket_path: str, memory: str = "file"
    ) -> CrashEngine:
        engine = await cls.create(engine_id, role, LAYOUT, socket_path, memory=memory)
        assert isinstance(engine, CrashEngine)
        engine._watch_pump()
        return engine

    def _watch_pump(self) -> None:
        pump = self._pump
        assert pump is not None
        self.connected.set()
        pump.add_done_callback(lambda _: self.connected.clear() if self._pump is pump else None)

    async def reconnect(self, socket_path: str) -> None:
        """Drop the old connection, connect, re-register the engine, pump events again."""
        self.connected.clear()
        if self._client is not None:
            await self._client.close()
        if self._pump is not None:
            with contextlib.suppress(BaseException):
                await self._pump
        # Memory shared by descriptor goes again with the new Hello: a
        # restarted daemon maps it anew.
        client = await EngineClient.connect(
            socket_path,
            client_name=f"crash:{self.engine_id}",
            timeout=10.0,
            descriptors=self.descriptors,
        )
        try:
            await client.register_engine(self.engine_id, self.groups, self.region_specs)
        except BaseException:
            await client.close()
            raise
        self._client = client
        self._pump = asyncio.create_task(self._pump_events(), name=f"crash-{self.engine_id}")
        self.generation += 1
        self._watch_pump()

    async def _register(
        self,
        request_id: str,
        incarnation: int,
        blocks: Any,
        peer: str,
        live: Any,
        peer_address: str = "",
        *,
        content: str = "",
        answered: bool = False,
    ) -> Any:
        try:
            return await super()._register(
                request_id,
                incarnation,
                blocks,
                peer,
                live,
                peer_address,
                content=content,
                answered=answered,
            )
        except ConnectionLost:
            # The daemon may have journaled the registration before it died:
            # until it says otherwise the blocks stay this request's, exempt
            # from "nothing else changed" (the base class forgets them).
            self._live[(request_id, incarnation)] = live
            raise

    def seen(self, request_id: str, kinds: tuple[type, ...]) -> rpc.Event | None:
        live = self._live.get((request_id, 1))
        return next((e for e in live.events if isinstance(e, kinds)), None) if live else None

    def forget(self, request_id: str) -> None:
        """The daemon no longer knows the request: its blocks are settled as they are."""
        self._settle((request_id, 1))

    async def outcome(
        self,
        request_id: str,
        kinds: tuple[type, ...],
        timeout: float,
        generation: int | None = None,
    ) -> rpc.Event | None:
        """The first event of ``kinds`` for the request, waiting through reconnections.

        With ``generation`` (the connection the request was made on), stop
        waiting a little after a reconnection that brought no outcome: a
        restarted daemon resends the outcome of every request it still holds
        when the engine re-registers, so none coming means the request was
        released (by a deadline) while the engine was away, and only a
        release call can tell.
        """
        loop = asyncio.get_running_loop()
        budget = Budget(self, timeout)
        resent_by: float | None = None
        while (left := budget.tick()) > 0:
            if (event := self.seen(request_id, kinds)) is not None:
                return event
            if generation is not None and self.generation > generation and self.connected.is_set():
                resent_by = resent_by or loop.time() + RESEND_GRACE_S
                if loop.time() > resent_by:
                    return None
                left = min(left, RESEND_GRACE_S)
            if not self.connected.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.connected.wait(), min(left, 1.0))
                continue
            try:
                return await self.wait_event(request_id, kinds, timeout=min(left, 0.5))
            except TimeoutError:
                continue
            except ConnectionLost:
                await asyncio.sleep(0.05)  # the pump ended; `connected` clears soon
        return None

    def stray_changes(self) -> list[Change]:
        """Bytes that changed outside the blocks of requests that may still be written."""
        reference = self._require_reference()
        return changed_blocks(reference, self.view, self._waiting_blocks(exclude=("", 0)))

    def bad_reports(self) -> list[str]:
        return [str(r) for r in self.reports.values() if not r.ok]


# ----------------------------------------------------------- the ledgers


@dataclass(frozen=True)
class Ack:
    """Something an engine was told: it must match a journal record of that daemon."""

    record: str  # the event type that must be journaled
    request_id: str
    detail: str = ""  # the reason, for Failed and Refused


_EVENT_ACKS: Final[dict[type, str]] = {
    rpc.KvArrived: "WriteDone",
    rpc.BlocksFreeable: "WriteDone",
    rpc.RequestFailed: "Failed",
    rpc.Released: "Released",
}


@dataclass
class Ledger:
    """Every acknowledgement one daemon gave its engine, in order of receipt."""

    acks: list[Ack] = field(default_factory=list)
    checked: int = 0  # acks before this index were found in the journal already

    def event(self, event: rpc.Event) -> None:
        detail = str(event.reason) if isinstance(event, rpc.RequestFailed) else ""
        self.acks.append(Ack(_EVENT_ACKS[type(event)], event.request_id, detail))

    def reply(self, request_id: str, reply: Any) -> None:
        if isinstance(reply, rpc.Deferred):
            self.acks.append(Ack("ReleaseDeferred", request_id))

    def refusal(self, request_id: str, error: RpcError) -> None:
        # Every refusal the core makes is journaled before the engine hears it.
        if error.reason is not None:
            self.acks.append(Ack("Refused", request_id, error.code))

    def said(self, record: str, request_id: str) -> None:
        self.acks.append(Ack(record, request_id))


# -------------------------------------------------------------- the load


@dataclass
class Stats:
    ok: int = 0  # pushed, verified on both sides
    failed: int = 0  # ended failed on at least one side (a crash was in the way)
    abandoned: int = 0  # an engine gave up on it at once (on purpose), racing the write
    refused: int = 0  # the decode daemon refused the registration
    probes: int = 0

    @property
    def completed(self) -> int:
        return self.ok + self.failed + self.abandoned + self.refused


class Load:
    """The steady load: requests pushed from the prefill engine into the decode engine.

    Each request registers on the decode side, then on the prefill side
    (which fills its blocks and says kv_ready), waits for an outcome on each
    side and releases on each side, waiting through any daemon restart. Block
    slots are exclusive among unfinished requests, so one request's bytes
    can never be mistaken for another's.
    """

    def __init__(
        self,
        engines: dict[str, CrashEngine],
        ledgers: dict[str, Ledger],
        rng: random.Random,
        violations: list[str],
    ) -> None:
        self.pe, self.de = engines[PREFILL], engines[DECODE]
        self.ledgers = ledgers
        self.rng = rng
        self.violations = violations
        self.stats = Stats()
        self.round = 0
        self._serial = 0
        self._go = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._free_src = list(range(SLOTS))
        self._free_dst = list(range(SLOTS))
        self._runner: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._runner = asyncio.create_task(self._run(), name="crash-load")

    async def stop(self) -> None:
        for task in [self._runner, *self._tasks]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def resume(self) -> None:
        self._go.set()

    def pause(self) -> None:
        self._go.clear()

    async def drain(self, timeout: float) -> int:
        """Wait for every started request to finish; the number still running after timeout."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)
        return len(self._tasks)

    async def _run(self) -> None:
        while True:
            await self._go.wait()
            ready = self.pe.connected.is_set() and self.de.connected.is_set()
            if not ready or len(self._tasks) >= CONCURRENCY or not self._free_src:
                await asyncio.sleep(0.005)
                continue
            self._spawn(self._request())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.violations.append(f"load task crashed: {task.exception()!r}")

    async def probe(self) -> bool:
        """One request outside the load that must succeed (the pair works again)."""
        self.stats.probes += 1
        return await self._request(probe=True) == "ok"

    async def _request(self, *, probe: bool = False) -> str:
        self._serial += 1
        rid = f"{'p' if probe else 'r'}{self.round}-{self._serial}"
        s, d = self._free_src.pop(), self._free_dst.pop()
        try:
            outcome = await self._lifecycle(rid, s, d, hurry=not probe)
        finally:
            self._free_src.append(s)
            self._free_dst.append(d)
        setattr(self.stats, outcome, getattr(self.stats, outcome) + 1)
        return outcome

    def _blocks(self, s: int, d: int) -> tuple[list[list[int]], list[list[int]]]:
        src = [list(range(s * SLOT_BLOCKS, (s + 1) * SLOT_BLOCKS)) for _ in LAYOUT]
        # A partial prefix-cache hit on the decode side: it fills only its tail.
        sizes = [self.rng.randint(0, SLOT_BLOCKS) for _ in LAYOUT]
        dst = [list(range(d * SLOT_BLOCKS, d * SLOT_BLOCKS + n)) for n in sizes]
        return src, dst

    async def _lifecycle(self, rid: str, s: int, d: int, *, hurry: bool) -> str:
        src, dst = self._blocks(s, d)
        pairs = tail_pairs(LAYOUT, src, LAYOUT, dst)
        expect = Expectation(self.pe.engine_id, pairs)
        d_gen, p_gen = self.de.generation, self.pe.generation
        d_state = await self._register(
            DECODE, rid, self.de.decode_register(rid, dst, PREFILL, expect=expect)
        )
        if d_state == "refused":
            return "refused"
        # Now and then an engine gives up at once, racing the write: its
        # release must be deferred until no byte can land any more.
        odds = self.rng.random() if hurry else 0.5
        decode_side = functools.partial(
            self._finish, self.de, DECODE, rid, d_state, d_gen, (rpc.KvArrived,)
        )
        early: asyncio.Task[bool] | None = None
        p_state = "absent"
        if d_state == "known":
            # peer= names the decode node, so the prefill daemon fails this
            # request at once if that node dies before it forwards anything.
            p_state = await self._register(
                PREFILL, rid, self.pe.prefill(rid, src, peer=DECODE, kv_ready=False)
            )
            if odds < 0.1:
                early = asyncio.create_task(decode_side(hurry=True))  # released while kv_ready
            if p_state == "known":
                await self._kv_ready(rid)
        prefill_ok = await self._finish(
            self.pe, PREFILL, rid, p_state, p_gen, (rpc.BlocksFreeable,), hurry=odds > 0.95
        )
        decode_ok = await (early or decode_side(hurry=False))
        if prefill_ok and decode_ok and p_state == "known":
            return "ok"
        return "abandoned" if early is not None or odds > 0.95 else "failed"

    async def _register(self, node: str, rid: str, call: Any) -> str:
        try:
            await call
        except RpcError as exc:
            if exc.code == rpc.SHUTTING_DOWN:
                return "uncertain"  # its journal failed; it is exiting
            self.ledgers[node].refusal(rid, exc)
            self._unexpected(node, rid, exc)
            return "refused"
        except ConnectionLost:
            return "uncertain"
        self.ledgers[node].said("Registered", rid)
        return "known"

    async def _kv_ready(self, rid: str) -> None:
        try:
            await self.pe.kv_ready(rid)
        except RpcError as exc:
            if exc.code != rpc.SHUTTING_DOWN:
                self.ledgers[PREFILL].refusal(rid, exc)
                self._unexpected(PREFILL, rid, exc)
        except ConnectionLost:
            return
        else:
            self.ledgers[PREFILL].said("KvReady", rid)

    def _unexpected(self, node: str, rid: str, exc: RpcError) -> None:
        if exc.reason is None:
            self.violations.append(f"{node}: {rid}: error that is not a refusal: {exc}")

    async def _finish(
        self,
        engine: CrashEngine,
        node: str,
        rid: str,
        state: str,
        generation: int,
        good: tuple[type, ...],
        *,
        hurry: bool,
    ) -> bool:
        """Wait for the side's outcome (unless in a hurry), then release; True if it was good."""
        if state in ("absent", "refused"):
            return False
        event = None
        if state == "known" and not hurry:
            kinds = (*good, rpc.RequestFailed, rpc.Released)
            event = await engine.outcome(rid, kinds, OUTCOME_WAIT_S, generation)
            if event is None and engine.generation == generation:
                # Its daemon never went away: an outcome is owed (invariant 7).
                self.violations.append(f"{node}: {rid}: no outcome within {OUTCOME_WAIT_S} s")
        await self._release(engine, node, rid)
        return isinstance(event, good)

    async def _release(self, engine: CrashEngine, node: str, rid: str) -> None:
        budget = Budget(engine, SETTLE_BOUND_S)
        while budget.tick() > 0:
            if engine.seen(rid, (rpc.Released,)) is not None:
                return
            if not engine.connected.is_set():
                await asyncio.sleep(0.05)
                continue
            try:
                reply = await engine.release(rid, wait=False)
            except RpcError as exc:
                if exc.code == rpc.SHUTTING_DOWN:
                    await asyncio.sleep(0.05)  # exiting; ask its successor
                    continue
                self.ledgers[node].refusal(rid, exc)
                if exc.code in (Reason.UNKNOWN_REQUEST, Reason.STALE_INCARNATION):
                    engine.forget(rid)  # never registered, or released by a deadline
                    return
                self.violations.append(f"{node}: {rid}: release refused: {exc}")
                return
            except ConnectionLost:
                # Raised without yielding while the pump has not noticed yet:
                # sleep, or this loop would starve the event loop.
                await asyncio.sleep(0.05)
                continue
            if isinstance(reply, rpc.Ok):
                self.ledgers[node].said("Released", rid)
                return
            self.ledgers[node].reply(rid, reply)
            await engine.outcome(rid, (rpc.Released,), 2.0)
        self.violations.append(f"{node}: {rid}: not released within {SETTLE_BOUND_S} s")


# ------------------------------------------------------------ the checks


def lifecycle_problems(records: list[Record]) -> list[str]:
    """What is wrong with one request's journaled events, by rules stated here.

    Deliberately not the core's transition table: an oracle must not share
    the logic it checks. The rules are the lifecycle of ARCHITECTURE.md.
    """
    names = [type(r.event).__name__ for r in records]
    problems = [
        f"{n} {names.count(n)} times"
        for n in (
            "Registered",
            "PeerRegistered",
            "KvReady",
            "Trimmed",
            "WriteStarted",
            "WriteDone",
            "Failed",
            "PeerSettled",
            "ReleaseDeferred",
            "Released",
        )
        if names.count(n) > 1
    ]
    if "WriteDone" in names and "Failed" in names:
        problems.append("both WriteDone and Failed")
    if "Released" in names:
        after = [n for n in names[names.index("Released") + 1 :] if n != "Refused"]
        if after:
            problems.append(f"{after} after Released")
    role = next((r.event.role for r in records if isinstance(r.event, Registered)), None)
    if role is None and "PeerRegistered" in names:
        role = Role.PUSHER

    def first(name: str) -> int:
        return names.index(name) if name in names else len(names)

    def needs(name: str, *earlier: str) -> None:
        if name in names and any(first(e) > first(name) for e in earlier):
            problems.append(f"{name} before {' and '.join(earlier)}")

    def needs_one_of(name: str, *earlier: str) -> None:
        if name in names and all(first(e) > first(name) for e in earlier):
            problems.append(f"{name} before any of {', '.join(earlier)}")

    if role is Role.PUSHER:
        needs("Trimmed", "Registered", "PeerRegistered")
        needs("WriteStarted", "Trimmed", "KvReady")
        needs("WriteDone", "WriteStarted")
        # No release while a write may be in flight (invariant 2, pusher side).
        needs_one_of("Released", "WriteDone", "Failed")
    elif role is Role.RECEIVER:
        for never in ("KvReady", "Trimmed", "PeerRegistered"):
            if never in names:
                problems.append(f"{never} on a receiver")
        needs("WriteDone", "Registered")
        needs("PeerSettled", "Failed")
        # Blocks stay quarantined until the pusher's final word (invariant 2).
        settled = [
            i
            for i, r in enumerate(records)
            if type(r.event).__name__ in ("WriteDone", "PeerSettled")
            or (isinstance(r.event, Failed) and r.event.settled)
        ]
        if "Released" in names and (not settled or settled[0] > first("Released")):
            problems.append("Released before the pusher's final word")
    return problems


@dataclass
class History:
    """A daemon's journal folded from its first record, snapshots ignored."""

    result: ReplayResult
    by_request: dict[tuple[str, int], list[Record]]
    facts: set[tuple[str, str, str]]  # (event type, request id, reason or "")


def read_history(journal: Path, scratch: Path) -> History:
    """Fold every segment (copied without the snapshots) from seq 1.

    The daemon replays from its newest snapshot; reading the whole history
    finds records the snapshot covers, and folding it from the start checks
    the snapshot as well (compared in :func:`check_daemon`).
    """
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    for segment in journal.glob("seg-*.kvj"):
        shutil.copyfile(segment, scratch / segment.name)
    by_request: dict[tuple[str, int], list[Record]] = {}
    facts: set[tuple[str, str, str]] = set()

    def collect(record: Record, touched: object) -> None:
        event = record.event
        rid = getattr(event, "request_id", None)
        incarnation = getattr(event, "incarnation", None)
        if rid is None or incarnation is None:
            return
        by_request.setdefault((rid, incarnation), []).append(record)
        detail = str(event.reason) if isinstance(event, Failed | Refused) else ""
        facts.add((type(event).__name__, rid, detail))

    result = replay(scratch, deadlines=None, on_record=collect)
    return History(result, by_request, facts)


def registry_state(result: ReplayResult) -> tuple[Any, ...]:
    registry = result.registry
    return (
        dict(registry.live),
        dict(registry.pending),
        dict(registry.engines),
        set(registry.tombstones),
    )


def ack_matches(ack: Ack, facts: set[tuple[str, str, str]]) -> bool:
    if ack.record in ("Failed", "Refused"):
        return (ack.record, ack.request_id, ack.detail) in facts
    return (ack.record, ack.request_id, "") in facts


def check_daemon(name: str, daemon: Daemon, ledger: Ledger, scratch: Path) -> tuple[list[str], int]:
    """Violations in one daemon's journal and acknowledgements; also the acks checked."""
    try:
        history = read_history(daemon.journal, scratch / f"history-{name}")
        live = replay(daemon.journal)
    except (ReplayError, JournalError) as exc:
        return [f"{name}: journal does not replay: {exc}"], 0
    violations = [
        f"{name}: acknowledged but not journaled: {ack}"
        for ack in ledger.acks[ledger.checked :]
        if not ack_matches(ack, history.facts)
    ]
    checked = len(ledger.acks) - ledger.checked
    ledger.checked = len(ledger.acks)
    for key, records in history.by_request.items():
        violations += [f"{name}: {key[0]}: {p}" for p in lifecycle_problems(records)]
        names = {type(r.event).__name__ for r in records}
        if names & {"Registered", "PeerRegistered"} and not names & {"Released", "Failed"}:
            violations.append(f"{name}: {key[0]}: never ended")
        elif "Registered" in names and "Released" not in names:
            violations.append(f"{name}: {key[0]}: never released")
    if registry_state(live) != registry_state(history.result):
        violations.append(f"{name}: the snapshot-based replay differs from the full history")
    if history.result.registry.live or history.result.registry.pending:
        violations.append(
            f"{name}: still live after settling: {sorted(history.result.registry.live)} "
            f"pending {sorted(history.result.registry.pending)}"
        )
    return violations, checked


_TROUBLE = re.compile(r"Traceback|\"level\": \"error\"|task failed")


def log_trouble(daemon: Daemon, offset: int) -> tuple[list[str], int]:
    """Error lines a daemon logged since ``offset`` (an unhandled exception is a bug).

    NIXL's and UCX's own error lines (a write to a peer that was just killed)
    are not the daemon's: it fails that write and says so itself.
    """
    data = daemon.log_path.read_bytes() if daemon.log_path.exists() else b""
    lines = data[offset:].decode(errors="replace").splitlines()
    trouble = [line for line in lines if _TROUBLE.search(line) and not from_library(line)]
    return [f"{daemon.node} logged: {line[:300]}" for line in trouble], len(data)


# ------------------------------------------------------------ the rounds


@dataclass(frozen=True)
class Kill:
    target: str
    failpoint: str | None = None  # None: a plain SIGKILL after `delay`
    nth: int = 0
    delay: float = 0.0

    def __str__(self) -> str:
        if self.failpoint is None:
            return f"SIGKILL {self.target} after {self.delay:.2f} s"
        return f"{self.target} at {self.failpoint}=crash@{self.nth}"


def plan_kill(rng: random.Random) -> Kill:
    target = rng.choice((PREFILL, DECODE))
    if rng.random() < 0.5:
        return Kill(target, delay=rng.uniform(0.05, 1.0))
    name = rng.choice([n for n, where in CRASH_POINTS.items() if target in where])
    return Kill(target, name, rng.randint(1, CRASH_POINTS[name][target]))


@dataclass
class RoundResult:
    index: int
    kill: Kill
    how: str  # "failpoint", "failpoint (start-up)", "random", "missed -> random"
    seconds: float
    settle_s: float
    violations: list[str]
    pair: str = ""


@dataclass
class Summary:
    seed: int
    rounds: list[RoundResult] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    acks_checked: int = 0
    kills: Counter[str] = field(default_factory=Counter)

    @property
    def violations(self) -> list[str]:
        return [
            f"pair {r.pair} round {r.index} ({r.kill}): {v}"
            for r in self.rounds
            for v in r.violations
        ]


def _start(daemon: Daemon) -> None:
    """Start and wait until it serves; RuntimeError if it exits first.

    More patient than Daemon.start: on a box shared with other test runs,
    creating the NIXL agent has been seen to take 30 s.
    """
    daemon.start(wait=False)
    daemon.wait_ready(timeout=READY_TIMEOUT_S)


class CrashPair:
    """Two real daemons, one engine on each, a load, and the kill rounds."""

    def __init__(
        self, workdir: Path, tag: str, load_rng: random.Random, memory: str = "file"
    ) -> None:
        self.workdir = workdir
        self.tag = tag
        # How the engines share their KV: a /dev/shm file, or a memfd passed
        # with each Hello (a restarted daemon maps it again).
        self.memory = memory
        self.rng = load_rng
        self.daemons = daemon_pair(workdir)
        self.engines: dict[str, CrashEngine] = {}
        self.ledgers = {PREFILL: Ledger(), DECODE: Ledger()}
        self.violations: list[str] = []
        self.load: Load | None = None
        self._log_offsets = {PREFILL: 0, DECODE: 0}
        self.acks_checked = 0

    async def start(self, failpoint_env: dict[str, str] | None = None) -> None:
        """Start both daemons (``failpoint_env``: node -> KVPUSHD_FAILPOINTS), engines, load."""
        for name, daemon in self.daemons.items():
            daemon.env = {failpoints.ENV: (failpoint_env or {}).get(name, "")}
        await asyncio.gather(*(asyncio.to_thread(_start, d) for d in self.daemons.values()))
        await self.wait_link()
        for name, role in ((PREFILL, Role.PUSHER), (DECODE, Role.RECEIVER)):
            engine_id = f"{name}-engine-{self.tag}"  # shm file names are per engine id
            engine = await CrashEngine.launch(
                engine_id, role, self.daemons[name].socket, self.memory
            )
            engine.on_event = self.ledgers[name].event
            self.engines[name] = engine
        self.load = Load(self.engines, self.ledgers, self.rng, self.violations)
        self.load.start()

    async def close(self) -> None:
        if self.load is not None:
            self.load.pause()
            await self.load.drain(SETTLE_BOUND_S)
            await self.load.stop()
        for engine in self.engines.values():
            await engine.close()
        for daemon in self.daemons.values():
            with contextlib.suppress(Exception):
                daemon.stop()
            daemon.kill()

    # -- one round ----------------------------------------------------------

    async def round(self, index: int, kill: Kill) -> RoundResult:
        assert self.load is not None
        started = time.monotonic()
        self.violations.clear()
        self.load.round = index
        target = self.daemons[kill.target]
        how = "random"
        if kill.failpoint is not None:
            how = await self._armed_crash(kill)
        else:
            self.load.resume()
            await asyncio.sleep(kill.delay)
            target.kill()
        self.load.pause()
        up_at = await self.recover(kill.target)
        settle_s = await self.settle(up_at)
        self.check()
        return RoundResult(
            index, kill, how, time.monotonic() - started, settle_s, list(self.violations)
        )

    async def _armed_crash(self, kill: Kill) -> str:
        """Restart the target armed with the failpoint, load it until it dies."""
        assert self.load is not None and kill.failpoint is not None
        target = self.daemons[kill.target]
        code = await asyncio.to_thread(target.stop)
        if code != 0:
            self.violations.append(f"{kill.target}: SIGTERM exit code {code}")
        target.env = {failpoints.ENV: f"{kill.failpoint}=crash@{kill.nth}"}
        if not await self.start_daemon(kill.target):
            return self._crashed(kill, "failpoint (start-up)")
        await self.wait_link()
        await self.connect_engine(kill.target)
        self.load.resume()
        loop = asyncio.get_running_loop()
        give_up = loop.time() + FAILPOINT_WAIT_S
        while target.proc is not None and target.proc.poll() is None:
            if loop.time() > give_up:
                target.kill()
                return "missed -> random"
            await asyncio.sleep(0.01)
        return self._crashed(kill, "failpoint")

    def _crashed(self, kill: Kill, how: str) -> str:
        target = self.daemons[kill.target]
        assert target.proc is not None
        if target.proc.returncode != -9:
            self.violations.append(f"{kill.target} exited {target.proc.returncode}, not by SIGKILL")
        said = f'"failpoint": "{kill.failpoint}", "action": "crash", "hit": {kill.nth}'
        if said not in target.logs():
            self.violations.append(f"{kill.target} died without its failpoint line")
        return how

    async def start_daemon(self, name: str) -> bool:
        try:
            await asyncio.to_thread(_start, self.daemons[name])
        except RuntimeError:
            return False  # exited while starting
        return True

    async def wait_link(self) -> None:
        """Both sides see the link up; quietly gives up if a daemon died meanwhile."""
        for name, peer in ((DECODE, PREFILL), (PREFILL, DECODE)):
            with contextlib.suppress(*STATUS_ERRORS, OSError, TimeoutError):
                await asyncio.to_thread(self.daemons[name].wait_peer, peer, 20.0)

    async def connect_engine(self, name: str) -> bool:
        daemon, engine = self.daemons[name], self.engines[name]
        for _ in range(100):
            if daemon.proc is None or daemon.proc.poll() is not None:
                return False
            try:
                await engine.reconnect(daemon.socket)
                return True
            except (ConnectionLost, RpcError, OSError):
                await asyncio.sleep(0.05)
        return False

    async def recover(self, name: str) -> float:
        """Restart the killed daemon without failpoints; the moment both are up again."""
        daemon = self.daemons[name]
        daemon.env = dict(NO_FAILPOINTS)
        if not await self.start_daemon(name):
            raise AssertionError(
                f"{name} did not restart after the crash:\n{daemon.logs()[-4000:]}"
            )
        for other, d in self.daemons.items():
            if d.proc is None or d.proc.poll() is not None:
                self.violations.append(
                    f"{other} is not running (exit {d.proc and d.proc.returncode})"
                )
                await self.start_daemon(other)
                await self.connect_engine(other)
        await self.wait_link()
        if not await self.connect_engine(name):
            raise AssertionError(f"{name}'s engine cannot re-register:\n{daemon.logs()[-4000:]}")
        return time.monotonic()

    async def settle(self, up_at: float) -> float:
        """Every request released on both nodes, then fresh requests work."""
        assert self.load is not None
        left = await self.load.drain(SETTLE_BOUND_S)
        if left:
            self.violations.append(f"{left} requests unfinished {SETTLE_BOUND_S} s after restart")
        settle_s = time.monotonic() - up_at
        for _ in range(20):
            if await self.load.probe():
                break
            # The first pushes after a restart may fail while the engines'
            # layouts travel between the daemons; the pair must recover soon.
            await asyncio.sleep(0.25)
        else:
            self.violations.append("no fresh request succeeded after the restart")
        await self._wait_idle()
        return settle_s

    async def _wait_idle(self) -> None:
        deadline = time.monotonic() + SETTLE_BOUND_S
        busy: dict[str, Any] = {}
        while time.monotonic() < deadline:
            busy = {}
            for name, daemon in self.daemons.items():
                st = await asyncio.to_thread(daemon.status)
                if st["live"] or st["pending_peer_registrations"]:
                    busy[name] = (st["by_state"], st["pending_peer_registrations"])
            if not busy:
                return
            await asyncio.sleep(0.1)
        self.violations.append(f"daemons still busy after {SETTLE_BOUND_S} s: {busy}")

    def check(self) -> None:
        for name, daemon in self.daemons.items():
            found, checked = check_daemon(name, daemon, self.ledgers[name], self.workdir)
            self.violations += found
            self.acks_checked += checked
            trouble, self._log_offsets[name] = log_trouble(daemon, self._log_offsets[name])
            self.violations += trouble
        for name, engine in self.engines.items():
            self.violations += [f"{name} engine: bad bytes: {r}" for r in engine.bad_reports()]
            engine.reports.clear()
            self.violations += [
                f"{name} engine: bytes changed outside live requests: {c}"
                for c in engine.stray_changes()
            ]


async def run_rounds(
    workdir: Path,
    *,
    rounds: int,
    seed: int,
    pairs: int = 1,
    say: Callable[[str], None] = lambda line: None,
    stop_on_violation: bool = False,
    memories: tuple[str, ...] = ("file", "descriptor"),
) -> Summary:
    """Run ``rounds`` kill rounds over ``pairs`` daemon pairs side by side.

    Pair ``i``'s engines share their KV as ``memories[i % len(memories)]``
    says: a /dev/shm file, or a memfd passed by descriptor.

    Pairs are independent (own ports, journals, engines); running two at
    once uses the time one pair spends waiting for a daemon to start. The
    kill plan of each pair follows from ``seed`` alone (the load draws from
    its own generator), so a failing plan can be replayed.
    """
    shares = [rounds // pairs + (i < rounds % pairs) for i in range(pairs)]
    parts = await asyncio.gather(
        *(
            _run_pair(
                workdir / f"pair-{i}",
                str(i),
                shares[i],
                seed + i,
                say,
                stop_on_violation,
                memories[i % len(memories)],
            )
            for i in range(pairs)
        )
    )
    summary = Summary(seed)
    for part in parts:
        summary.rounds += part.rounds
        summary.kills += part.kills
        summary.acks_checked += part.acks_checked
        for name in ("ok", "failed", "abandoned", "refused", "probes"):
            setattr(summary.stats, name, getattr(summary.stats, name) + getattr(part.stats, name))
    return summary


async def _run_pair(
    workdir: Path,
    tag: str,
    rounds: int,
    seed: int,
    say: Callable[[str], None],
    stop_on_violation: bool,
    memory: str = "file",
) -> Summary:
    plan_rng = random.Random(seed)
    summary = Summary(seed)
    workdir.mkdir(parents=True, exist_ok=True)
    pair = CrashPair(workdir, tag, random.Random(seed ^ 0x5EED), memory)
    try:
        await pair.start()
        say(f"pair {tag}: the engines share their KV by {memory}")
        for index in range(1, rounds + 1):
            kill = plan_kill(plan_rng)
            result = await pair.round(index, kill)
            result.pair = tag
            summary.rounds.append(result)
            summary.kills[_kill_label(result)] += 1
            say(
                f"pair {tag} round {index:3d}: {kill!s:44} {result.how:21} {result.seconds:5.1f} s"
                f"  settled {result.settle_s:4.1f} s  violations {len(result.violations)}"
            )
            for violation in result.violations:
                say(f"    {violation}")
            if result.violations and stop_on_violation:
                break
    finally:
        await pair.close()
        if pair.load is not None:
            summary.stats = pair.load.stats
        summary.acks_checked = pair.acks_checked
    return summary


def _kill_label(result: RoundResult) -> str:
    if result.how.startswith("failpoint"):
        return f"{result.kill.failpoint}" + (" (start-up)" if "start-up" in result.how else "")
    return "random" if result.how == "random" else "random (failpoint missed)"
