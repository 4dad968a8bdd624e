"""Transfers: the pusher's trim and NIXL write, the receiver's arrival.

Pusher: once both registrations are known the core trims (tail alignment,
invariant 3); once the KV is ready the write starts: ``writing`` is
committed and one NIXL WRITE with the notification ``"R#inc"`` is posted
while that record is made durable; the peer hears ``writing`` once it is.
Receiver: the notification (or the pusher's word)
ends the wait for data. Every change goes through the ledger; what each
change owes to whom is the core's (statemachine/notices.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

import structlog

from daemon import failpoints
from daemon.dataplane import digest
from daemon.dataplane.geometry import blocks_nbytes
from daemon.dataplane.plane import DataPlane, DataPlaneError, Posted
from daemon.journal.format import JournalFatal
from daemon.node.counters import WriteCounters
from daemon.node.integrity import Integrity
from daemon.node.ledger import Commit, Ledger
from daemon.node.peerport import PeerPort
from daemon.node.tasks import Spawn
from schemas.events import Blocks, Event, WriteStarted
from schemas.layout import Role
from schemas.reasons import Reason
from schemas.state import RequestRecord, State
from statemachine import TrimRefused
from statemachine.integrity import sampled
from statemachine.reactions import (
    Next,
    Stimulus,
    Why,
    awaiting_data,
    pusher_next,
    react,
)

if TYPE_CHECKING:
    from daemon.node.engine_state import EngineState
    from daemon.node.peerstate import PeerState

log = structlog.get_logger("kvpushd.node")
PUSHER, RECEIVER = Role.PUSHER, Role.RECEIVER
REGISTERED, TRIMMED, WRITING = State.REGISTERED, State.TRIMMED, State.WRITING


def _wire_src(record: RequestRecord) -> Blocks:
    """The source blocks handed to NIXL: the trimmed ``src``, unless the
    ``integrity.shift_src`` failpoint plants a front-trim (the first of the
    engine's blocks instead of the last: what integrity checks must catch)."""
    src = record.src
    assert src is not None
    if failpoints.corrupts("integrity.shift_src"):
        return tuple(own[: len(ids)] for own, ids in zip(record.blocks, src, strict=True))
    return src


def notification_for(request_id: str, incarnation: int) -> bytes:
    return f"{request_id}#{incarnation}".encode()


def parse_notification(message: bytes) -> tuple[str, int] | None:
    request_id, sep, incarnation = message.decode(errors="replace").rpartition("#")
    if not sep or not incarnation.isdigit():
        return None
    return request_id, int(incarnation)


class PeerGone(Exception):
    pass


class Transfers:
    def __init__(
        self,
        *,
        ledger: Ledger,
        dataplane: DataPlane,
        engines: Mapping[str, EngineState],
        agents: Mapping[str, PeerState],
        port: PeerPort,
        integrity: Integrity,
        spawn: Spawn,
    ) -> None:
        self._ledger = ledger
        self._dataplane = dataplane
        self._engines = engines
        self._agents = agents  # the peers' NIXL agents, as the peers module keeps them
        self._port = port
        self._integrity = integrity
        self._spawn = spawn
        self.counters = WriteCounters()
        self.writes: dict[str, asyncio.Task[None]] = {}
        # WRITEs posted in kv_ready's call whose task has not started yet: a
        # task cancelled before its first step never runs its own clean-up,
        # so cancel_write stops these itself.
        self._unclaimed: dict[str, Posted] = {}
        # Receivers waiting for data: the data plane polls for notifications
        # only while there is one.
        self.awaiting: set[str] = set()

    def observe(self, event: Event, touched: object, ts: float) -> None:
        """Ledger observer: keep the set of receivers awaiting data in step with the core
        (and integrity's digests and waits of checked ones)."""
        if not isinstance(touched, RequestRecord):
            return
        had = bool(self.awaiting)
        if awaiting_data(touched):
            self.awaiting.add(touched.request_id)
        elif touched.request_id in self.awaiting:
            self.awaiting.discard(touched.request_id)
            # Only a checked receiver leaves digests or a wait in integrity:
            # an unchecked request never enters it.
            if self.checked(touched.request_id):
                self._integrity.forget(touched.request_id, touched.incarnation)
        if had != bool(self.awaiting):
            self._dataplane.expect_notifications(bool(self.awaiting))

    # --------------------------------------------------------------- pusher

    async def advance(self, request_id: str) -> None:
        """Pusher: trim once both sides are known, write once the KV is ready."""
        committed = self.step(request_id)
        if committed is not None:
            await committed
            # Durable: a trim's wait is over (kv_ready may have come meanwhile),
            # a refusal's notices went out; go on if the record allows.
            self.step(request_id)

    def step(self, request_id: str) -> Commit | None:
        """Trim and start the write as far as the record allows, without waiting.

        Returns a commit the caller must await (its notices go out only
        then): a refused trim, or a trim whose KV is not ready yet. Nothing
        waits on the journal again until kv_ready, which may be long: without
        that await (found by tests/test_load.py) an idle daemon's journal
        lagged its registry by every such trim.
        """
        ledger = self._ledger
        record = ledger.registry.get(request_id)
        if record is None:
            return None
        if pusher_next(record) is Next.TRIM:
            try:
                trimmed = ledger.registry.plan_trim(record.request_id, record.incarnation)
            except TrimRefused as refusal:
                refused = refusal.journaled(record.request_id, record.incarnation, record.engine_id)
                # One commit, no await in between: another step() of the same
                # request must find it failed, not trim (and refuse) it again.
                failed = react(record, Stimulus.FAILURE, Why(refusal.reason, refusal.message))
                return ledger.commit([refused, *failed], Stimulus.FAILURE.cause)
            committed = ledger.commit([trimmed])
            record = ledger.registry.get(request_id)
            assert record is not None
            if not record.kv_ready:
                return committed
        if pusher_next(record) is Next.WRITE and request_id not in self.writes:
            self._start_write(record)
        return None

    def _start_write(self, record: RequestRecord) -> None:
        assert record.src is not None
        engine = self._engines.get(record.engine_id)
        if engine is None:
            why = Why(Reason.UNKNOWN_ENGINE, "engine went away")
            self._spawn(self._ledger.react(record, Stimulus.FAILURE, why))
            return
        n_blocks = sum(len(ids) for ids in record.src)
        nbytes = blocks_nbytes(engine.spec, record.src)
        # Committed now, awaited by the write: the peer hears "writing" only
        # once it is durable; the WRITE is posted meanwhile (see _write).
        started = self._ledger.commit(
            [WriteStarted(record.request_id, record.incarnation, n_blocks, nbytes)]
        )
        self.counters.writes_started += 1
        checked = self.checked(record.request_id)
        # An unchecked request's WRITE is posted here, in kv_ready's own call:
        # no task and no loop pass between the engine's word and NIXL. A
        # checked one's source is summed first, in the write's task.
        posted = None if checked else self._post(record, n_blocks)
        if isinstance(posted, Posted):
            self._unclaimed[record.request_id] = posted
        self.writes[record.request_id] = self._spawn(
            self._write(record, started, checked, posted, n_blocks, nbytes)
        )

    def checked(self, request_id: str) -> bool:
        """Whether the request is checked for integrity: the core's rule, from its id alone."""
        return sampled(request_id, self._integrity.verify, self._integrity.rate)

    def _post(self, record: RequestRecord, n_blocks: int) -> Posted | Exception | None:
        """Hand the WRITE to the data plane now; what refuses it is returned, not raised.

        Posted while ``write_started`` is still being made durable: the
        fdatasync and the copy overlap instead of adding up. Safe because
        nobody is *told* anything before the record is durable (_write), the
        receiver's blocks stay quarantined until this side's final word or a
        fence, and a pusher that dies before the record is durable dies with
        its write and fails the request on restart (ARCHITECTURE.md, "The
        write path's durability"). A refusal is raised only once the record
        is durable, so that the peer hears "writing" before the failure.
        """
        if not n_blocks:
            return None
        peer = self._agents.get(record.peer)
        if peer is None or not peer.agent_name or not self._port.is_up(record.peer):
            return PeerGone(f"peer {record.peer} is not connected")
        assert record.dst is not None
        try:
            return self._dataplane.post(
                record.engine_id,
                peer.agent_name,
                record.remote_engine,
                _wire_src(record),
                record.dst,
                notification_for(record.request_id, record.incarnation),
            )
        except DataPlaneError as exc:
            return exc

    async def _write(
        self,
        record: RequestRecord,
        started: Commit,
        checked: bool,
        posted: Posted | Exception | None,
        n_blocks: int,
        nbytes: int,
    ) -> None:
        ledger, integrity = self._ledger, self._integrity
        rid, inc = record.request_id, record.incarnation
        self._unclaimed.pop(rid, None)  # ours from here: stopped below if we are cancelled
        try:
            digests = None
            if checked:
                digests = await integrity.before_write(record)  # before anything is posted
                posted = self._post(record, n_blocks)
            # The peer hears "writing" (and a failure follows it) only once durable.
            await started
            if digests is not None:
                integrity.send(record, digests)
            if isinstance(posted, Exception):
                raise posted
            if posted is not None:
                await self._dataplane.finish(posted)
        except (DataPlaneError, PeerGone) as exc:
            self.writes.pop(rid, None)
            self.counters.writes_failed += 1
            reason = Reason.PEER_DEAD if isinstance(exc, PeerGone) else Reason.TRANSFER_ERROR
            current = ledger.current(rid, inc)
            if current is not None:
                await ledger.react(current, Stimulus.FAILURE, Why(reason, str(exc)))
            return
        except BaseException:
            # Cancelled (an abort, a fence, the drain) or the journal failed
            # while the WRITE may be in flight: stop it before going on, so
            # that whoever cancelled us knows nothing is being written.
            if isinstance(posted, Posted):
                await self._dataplane.stop(posted)
            raise
        self.writes.pop(rid, None)
        current = ledger.current(rid, inc)
        if current is None:
            return
        # Counted once the core accepts it: a request failed meanwhile (its
        # deadline) does not count its late write as done.
        completed = ledger.react(current, Stimulus.WRITE_COMPLETED, failpoint="node.write_done")
        if await completed:
            self.counters.writes_done += 1
            self.counters.bytes_written += nbytes

    async def cancel_write(self, request_id: str) -> None:
        """Abort the NIXL transfer of a write task and wait until it has stopped."""
        task = self.writes.pop(request_id, None)
        if task is None:
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise  # we are being cancelled ourselves, not just the write
        except Exception as exc:  # already failed: the write task logged and failed it
            log.debug("cancelled write had failed", request_id=request_id, error=repr(exc))
        finally:
            unclaimed = self._unclaimed.pop(request_id, None)
            if unclaimed is not None:  # cancelled before it started: its WRITE is ours to stop
                await self._dataplane.stop(unclaimed)

    # ------------------------------------------------------------- receiver

    def on_notification(self, agent_name: str, message: bytes) -> None:
        key = parse_notification(message)
        if key is None:
            log.warning("unparseable notification", agent=agent_name)
            return
        record = self._ledger.registry.get(key[0])
        if record is None or record.incarnation != key[1] or not awaiting_data(record):
            return
        if self.checked(record.request_id):
            # Its landed blocks are summed and compared first, which may wait
            # for the pusher's digests or a thread: a task.
            self._spawn(self._arrived(key[0], key[1]))
            return
        # Unchecked: the core's reaction is committed here, in the data
        # plane's callback, and the engine told from the group commit's
        # wake-up: no task per landing.
        engine = self._engines.get(record.engine_id)
        if engine is not None and failpoints.corrupts("integrity.flip_dst"):
            digest.flip_first(engine.spec, engine.regions, record.blocks)
        # A journal that fails here was reported by its on_fatal: the node
        # stops and replays.
        with contextlib.suppress(JournalFatal):
            self._ledger.react_and_tell(record, Stimulus.DATA_LANDED, failpoint="node.kv_arrived")

    async def _arrived(self, request_id: str, incarnation: int) -> None:
        record = self._ledger.current(request_id, incarnation)
        if record is not None:
            record = await self._integrity.landed(record, final=False)
        if record is not None:
            await self._ledger.react(record, Stimulus.DATA_LANDED, failpoint="node.kv_arrived")
