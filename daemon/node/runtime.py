"""The node: one daemon's runtime, put together around the ledger.

One request takes this path (ARCHITECTURE.md, "One request"): the engine
server decodes a frame and calls an ``rpc_*`` handler here; the handler asks
the core what the request calls for (a ``check_*`` of the registry or a
reaction of statemachine/reactions.py) and commits the events through the
ledger, which applies them, journals them, waits for durability and only
then tells the engine and the peer what the core says they are owed.

The parts, one module each: ``engines`` (sessions, memory, offload pools),
``peers`` (peer daemons, their messages and deaths), ``windows`` (per-peer
memory windows and fencing), ``transfers`` (trim, NIXL write, arrival),
``status`` (the status document), ``ledger`` (the one commit path) and
``serializer`` (per-key ordering of concurrent handlers).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog

from daemon.dataplane.plane import DataPlane, DataPlaneError
from daemon.journal.format import MAX_RECORD_BYTES, JournalFatal
from daemon.journal.groupcommit import GroupCommit
from daemon.journal.replay import fold_contents
from daemon.journal.writer import Journal
from daemon.node.engines import Engines, EngineSession
from daemon.node.integrity import Integrity
from daemon.node.ledger import Ledger
from daemon.node.peerlink import PeerManager
from daemon.node.peers import Peers
from daemon.node.status import status_document
from daemon.node.transfers import Transfers
from daemon.node.windows import Windows
from daemon.version import VERSION
from schemas import peer as pm
from schemas import rpc
from schemas.config import Config
from schemas.events import DaemonStarted, Event, Registered, Released, RequestEvent
from schemas.layout import Role
from schemas.reasons import Reason
from schemas.state import PendingPeer, RequestRecord, State
from schemas.status import StatusDocument
from statemachine import Refusal, Registry
from statemachine.reactions import Cause, Stimulus, Why, react, react_pending

PUSHER, RECEIVER = Role.PUSHER, Role.RECEIVER
WRITING = State.WRITING

log = structlog.get_logger("kvpushd.node")
# Room for a record's envelope (version, node, seq, time) or a Forward's other
# fields around a registration's blocks.
_RECORD_HEADROOM = 4096
# The deadline loop acts on a deadline at most DEADLINE_TICK_S late, and
# wakes at least every DEADLINE_IDLE_S (a wall-clock jump is caught then).
DEADLINE_TICK_S = 0.05
DEADLINE_IDLE_S = 1.0
_size_encoder = msgspec.msgpack.Encoder()


class Node:
    def __init__(self, config: Config, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self._wake_at = 0.0  # when the deadline loop plans to wake next (clock time)
        self._deadline_moved = asyncio.Event()
        self.boot_id = uuid.uuid4().hex[:12]
        self.log = log.bind(node=config.node)
        self.registry = Registry(
            deadlines=config.deadlines, tombstone_limit=config.limits.tombstones
        )
        self.journal: Journal | None = None
        self.group: GroupCommit | None = None
        self._ledger: Ledger | None = None
        self.dataplane = DataPlane(
            f"kvpushd-{config.node}-{self.boot_id}",
            backend=config.nixl.backend,
            poll_interval_s=config.nixl.poll_interval_s,
        )
        self.links: PeerManager | None = None  # the peer links, set by the service
        self.engines = Engines(self)
        self.peers = Peers(self)
        self.windows = Windows(self)
        self.transfers = Transfers(self)
        self.fatal: BaseException | None = None
        self.stopping = False
        self.started_at = clock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.counters: dict[str, int] = {
            "writes_started": 0,
            "writes_done": 0,
            "writes_failed": 0,
            "bytes_written": 0,
            "refusals": 0,
        }
        self.integrity = Integrity(self)  # adds its counters
        self.on_fatal: Callable[[BaseException], None] = lambda exc: None
        # Metrics and tests watch every journaled event: (event, record touched, ts).
        self.observers: list[Callable[[Event, object, float], None]] = []
        # The port the service serves metrics on, for status(); None without metrics.
        self.metrics_port: int | None = None

    @property
    def ledger(self) -> Ledger:
        assert self._ledger is not None, "the node is not started"
        return self._ledger

    @property
    def writes(self) -> dict[str, asyncio.Task[None]]:
        return self.transfers.writes

    @property
    def closing(self) -> bool:
        # The data plane is closed or closing; its close unmapped every window.
        return self.fatal is not None or self.stopping

    # ------------------------------------------------------------ start / stop

    async def start(self) -> None:
        await self.open()
        await self.begin()

    async def open(self) -> None:
        """Lock and replay the journal, start the data plane; journal nothing yet.

        What can still fail after this (a port in use) must not leave a
        DaemonStarted record behind: postmortems would count restarts that
        never ran. The service calls :meth:`begin` once nothing can.
        """
        cfg = self.config
        self.journal = Journal.open(
            cfg.journal.dir,
            fsync=cfg.journal.fsync,
            segment_bytes=cfg.journal.segment_mb * 1024 * 1024,
        )
        replayed = fold_contents(
            self.journal.take_recovered(),
            deadlines=cfg.deadlines,
            tombstone_limit=cfg.limits.tombstones,
        )
        self.registry = replayed.registry
        self.group = GroupCommit(
            self.journal,
            window_s=cfg.journal.commit_window_ms / 1000.0,
            on_fatal=self._journal_failed,
        )
        self._ledger = Ledger(
            self.journal,
            self.registry,
            node=cfg.node,
            clock=self.clock,
            group=self.group,
            courier=self,
            snapshot_every=cfg.journal.snapshot_every,
            retain_segments=cfg.journal.retain_segments,
            debug=cfg.log_level == "debug",
            on_fatal=self._journal_failed,
        )
        self._ledger.observers.append(self.transfers.observe)
        self._ledger.observers.append(self.integrity.observe)
        self._ledger.observers.append(self._observe)
        self._ledger.observers.append(self._deadline_watch)
        self._ledger.after_durable[Released] = [self.engines.after_durable]
        self.log.info(
            "journal replayed",
            records=replayed.records,
            last_seq=replayed.last_seq,
            torn_bytes=replayed.torn_bytes,
            live=len(self.registry.live),
        )
        await self.dataplane.start()
        self.dataplane.set_notification_handler(self.transfers.on_notification)

    async def begin(self) -> None:
        """Journal the start, fail what the restart interrupted, start the deadlines."""
        assert self.group is not None and self.journal is not None, "begin() needs open()"
        self.ledger.commit([DaemonStarted(os.getpid(), VERSION, self.boot_id)])
        self._fail_after_restart()
        # Engines attached before the restart must register again (their memory
        # mappings died with the old process); until then they are unknown.
        for engine_id in list(self.registry.engines):
            if not any(r.engine_id == engine_id for r in self.registry.live.values()):
                self.ledger.commit([self.registry.check_detach(engine_id)])
        await self.group.durable(self.journal.next_seq - 1)
        self.spawn(self._deadline_loop())

    def _observe(self, event: Event, touched: object, ts: float) -> None:
        for observe in self.observers:
            observe(event, touched, ts)

    def attach_peers(self, manager: PeerManager) -> None:
        self.links = manager

    async def drain(self) -> None:
        """SIGTERM: finish in-flight writes within ``drain_s``, fail the rest.

        New registrations are refused from here on; requests that are not
        writing stay as they are in the journal and fail as "daemon restart"
        on the next start, where their engines are told.
        """
        self.stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_s
        while self.writes and loop.time() < deadline:
            await asyncio.sleep(0.01)
        why = Why(Reason.DAEMON_RESTART, "daemon stopped during the write")
        for rid in list(self.writes):
            await self.transfers.cancel_write(rid)
            record = self.registry.get(rid)
            if record is not None:
                # Still writing: it fails; if it ended meanwhile, the core calls for nothing.
                await self.react(record, Stimulus.FAILURE, why)

    async def close(self) -> None:
        """After drain and after the peer links closed: make durable, release memory."""
        self.stopping = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.group is not None:
            if self.fatal is None:
                with contextlib.suppress(JournalFatal):
                    self.group.commit_now()
            self.group.close()
        await self.engines.close()
        await self.dataplane.close()
        if self.journal is not None and self.fatal is None:
            with contextlib.suppress(JournalFatal):
                self.journal.close()

    async def stop(self) -> None:
        await self.drain()
        await self.close()

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if isinstance(exc, JournalFatal):
            return  # already handled by _journal_failed
        if self.fatal is not None and isinstance(exc, DataPlaneError) and exc.code == "state":
            return  # the journal failure closed the data plane under it; reported once
        if exc is not None:
            self.log.error("task failed", error=repr(exc), exc_info=exc)

    def _journal_failed(self, exc: JournalFatal) -> None:
        # ARCHITECTURE.md: an fsync failure is fatal; exit and replay, never retry.
        if self.fatal is not None:
            return  # reported once; later calls only see the journal refuse
        self.fatal = exc
        # One line per failure: on_fatal's owner (the service) says it as it
        # exits; this one only for a node run without such an owner.
        self.log.debug("journal write failed; stopping", error=str(exc))
        self.on_fatal(exc)

    # ----------------------------------------------------- the ledger's courier

    def tell_engine(self, engine_id: str, message: rpc.Event) -> None:
        self.engines.tell_engine(engine_id, message)

    def tell_peer(self, node: str, message: pm.PeerMessage) -> bool:
        return self.peers.tell_peer(node, message)

    # -------------------------------------------------------------- reacting

    async def react(
        self,
        record: RequestRecord,
        stimulus: Stimulus,
        why: Why | None = None,
        *,
        failpoint: str | None = None,
    ) -> list[RequestEvent]:
        """Commit what the core says ``stimulus`` calls for (and the ledger, what follows).

        Returns the events the stimulus called for (none: nothing to journal).
        """
        events = react(record, stimulus, why)
        if events:
            await self.ledger.commit(events, stimulus.cause, failpoint=failpoint)
        return events

    def current(self, request_id: str, incarnation: int) -> RequestRecord | None:
        """The live record of exactly this incarnation, if any (after an await, say)."""
        record = self.registry.get(request_id)
        if record is None or record.incarnation != incarnation:
            return None
        return record

    def _fail_after_restart(self) -> None:
        """Requests caught mid-flight by a restart fail; their memory is gone."""
        for record in list(self.registry.live.values()):
            self.ledger.commit(react(record, Stimulus.RESTART), Cause.RESTART)
        for pending in list(self.registry.pending.values()):
            self.ledger.commit(react_pending(pending, Stimulus.RESTART), Cause.RESTART)

    # --------------------------------------------------------------- engine RPC

    async def rpc_register_engine(
        self, session: EngineSession, req: rpc.RegisterEngine
    ) -> rpc.Reply:
        return await self.engines.register(session, req)

    def engine_disconnected(self, session: EngineSession) -> None:
        self.engines.disconnected(session)

    async def rpc_register_request(
        self, session: EngineSession, req: rpc.RegisterRequest
    ) -> rpc.Reply:
        if self.stopping:
            raise Refusal(Reason.DAEMON_RESTART, "the daemon is draining")
        engine = self.engines.own(session, req.engine_id)
        if req.role is RECEIVER and self._dials(req.peer, req.peer_address):
            # Dial the pusher's daemon (README.md, "Peers on demand"); then
            # check again what the wait may have changed.
            await self.peers.link_on_demand(req.peer, req.peer_address)
            if self.stopping:
                raise Refusal(Reason.DAEMON_RESTART, "the daemon is draining")
            engine = self.engines.own(session, req.engine_id)
        limit = self.config.limits.max_live_per_engine
        if engine.live >= limit:
            raise Refusal(
                Reason.ENGINE_IN_USE,
                f"engine {req.engine_id} has {engine.live} live requests, the limit is {limit}",
            )
        if req.role is RECEIVER:
            if not req.peer:
                raise Refusal(Reason.UNKNOWN_REQUEST, "a receiver registration must name its peer")
            if not self.peers.is_up(req.peer):
                raise Refusal(Reason.PEER_DEAD, f"peer {req.peer!r} is not connected")
        # The core grants the offload slots (never one a live request holds,
        # nor one the pool has not zeroed yet); the grant is journaled with
        # the registration, so it survives a crash.
        event = self.registry.check_register(
            req.request_id,
            req.incarnation,
            req.role,
            req.engine_id,
            req.peer,
            req.blocks,
            req.offload_slots,
            self.engines.unavailable_slots(engine),
            req.content,
        )
        self._check_fits(event)
        self.integrity.check_slots(engine, event)
        self.engines.take_offload(engine, event)
        try:
            registered = self.ledger.commit([event], Cause.ENGINE)
        except BaseException:
            self.engines.give_back_offload(engine, event)
            raise
        self.engines.granted(event)
        engine.live += 1
        await registered  # a receiver's registration is forwarded to its peer once durable
        if req.role is PUSHER:
            self.spawn(self.transfers.advance(req.request_id))
        return rpc.RequestAccepted(
            req.id, state=State.REGISTERED.value, offload_slots=event.offload_slots
        )

    def _dials(self, peer: str, address: str) -> bool:
        """A peer named by address that is not configured (and may be linked now)."""
        return (
            bool(peer)
            and bool(address)
            and self.config.on_demand_peers
            and not self.peers.is_configured(peer)
        )

    def _check_fits(self, event: Registered) -> None:
        """Refuse a registration too big for one journal record or one peer frame.

        The core expands logical blocks to kernel blocks, so a request frame
        within the limit can become a record (and a Forward) many times its
        size. Without this check (found by tests/test_fuzz.py) an oversized
        record failed to append after the registry had applied it, leaving
        live state the journal did not have, and an oversized Forward was
        journaled but never reached the peer; both replied "internal".
        """
        n_blocks = sum(len(ids) for ids in event.blocks)
        strings = (
            len(event.request_id) + len(event.engine_id) + len(event.peer) + len(event.content)
        )
        limit = min(self.config.limits.max_frame_bytes, MAX_RECORD_BYTES) - _RECORD_HEADROOM
        # 9 bytes is the largest msgpack int and 4 bytes per character the
        # largest UTF-8 one: most registrations pass without being encoded.
        if 9 * n_blocks + 4 * strings <= limit:
            return
        size = len(_size_encoder.encode(event))
        if size > limit:
            raise Refusal(
                Reason.BLOCK_OUT_OF_RANGE,
                f"request {event.request_id}: {n_blocks} kernel blocks encode to {size} bytes, "
                f"over the {limit}-byte limit of one journal record and one peer frame",
            )

    async def rpc_kv_ready(self, session: EngineSession, req: rpc.KvReady) -> rpc.Reply:
        record = self.engines.own_request(session, req.request_id, req.incarnation)
        ready = self.ledger.commit([self.registry.check_kv_ready(record)], Cause.ENGINE)
        # Advance before waiting: its trimmed/writing records join the same
        # group commit as kv_ready (one fdatasync), and the WRITE is posted
        # while it runs. Called, not spawned: with the KV ready, advance()
        # trims and starts the write without suspending, so a task would
        # only cost a loop pass.
        await self.transfers.advance(req.request_id)
        await ready
        return rpc.Ok(req.id)

    async def rpc_release(self, session: EngineSession, req: rpc.Release) -> rpc.Reply:
        record = self.engines.own_request(session, req.request_id, req.incarnation)
        events = react(record, Stimulus.ENGINE_RELEASE)
        await self.ledger.commit(events, Cause.ENGINE)
        if any(isinstance(e, Released) for e in events):
            return rpc.Ok(req.id)
        return rpc.Deferred(req.id, "a write may still be in flight; released once it ends")

    async def rpc_abort(self, session: EngineSession, req: rpc.Abort) -> rpc.Reply:
        record = self.engines.own_request(session, req.request_id, req.incarnation)
        events = react(record, Stimulus.ENGINE_ABORT)
        await self.ledger.commit(events, Cause.ENGINE)
        return rpc.Ok(req.id)

    async def rpc_hold(self, session: EngineSession, req: rpc.Hold) -> rpc.Reply:
        """Tell the prefill daemon a queued decode request will register (rpc.Hold)."""
        if not req.peer:
            raise Refusal(Reason.UNKNOWN_REQUEST, "a hold must name the prefill node")
        if self._dials(req.peer, req.peer_address):
            await self.peers.link_on_demand(req.peer, req.peer_address)
        if not self.peers.tell_peer(req.peer, pm.Hold(req.request_id, req.incarnation)):
            raise Refusal(Reason.PEER_DEAD, f"peer {req.peer!r} is not connected")
        return rpc.Ok(req.id)

    async def record_refusal(self, request: Any, refusal: Refusal) -> bool:
        """Journal a refused engine request; the registry itself is unchanged.

        False when the refusal is not durable (the journal failed): then the
        engine must not be told of it either (persist before telling).
        """
        if self.fatal is not None or self._ledger is None:
            return False
        self.counters["refusals"] += 1
        event = refusal.journaled(
            getattr(request, "request_id", ""),
            getattr(request, "incarnation", 0),
            getattr(request, "engine_id", ""),
        )
        try:
            await self.ledger.commit([event], Cause.ENGINE)
        except JournalFatal:
            return False
        return True

    def status(self) -> StatusDocument:
        return status_document(self, VERSION)

    # ------------------------------------------------------------- peer links

    def hello(self, peer: str) -> pm.Hello:
        return pm.Hello(
            node=self.config.node,
            boot_id=self.boot_id,
            agent_name=self.dataplane.agent_name,
            agent_metadata=self.windows.metadata,
            engines=self.windows.view(peer),
        )

    async def load_metadata(self) -> None:
        await self.windows.load_metadata()

    def on_peer_up(self, node: str, hello: pm.Hello, link: Any) -> None:
        self.peers.on_up(node, hello, link)

    def on_peer_down(self, node: str, reason: str) -> None:
        self.peers.on_down(node, reason)

    def on_peer_message(self, node: str, message: Any) -> None:
        self.peers.on_message(node, message)

    # ------------------------------------------------------------ deadlines

    async def _deadline_loop(self) -> None:
        # Sleeps until the earliest deadline (no later than DEADLINE_TICK_S
        # after it, no sooner than DEADLINE_IDLE_S apart when nothing is
        # live); a record whose deadline falls before the planned wake-up
        # wakes it early (_deadline_watch). An idle daemon used to wake every
        # 100 ms for nothing: most of its idle CPU.
        while True:
            for due in self.registry.expired(self.clock()):
                await self._on_deadline(due)
            now = self.clock()
            nxt = self.registry.next_deadline()
            delay = DEADLINE_IDLE_S if nxt is None else min(DEADLINE_IDLE_S, nxt - now)
            delay = max(delay, DEADLINE_TICK_S)
            self._wake_at = now + delay
            self._deadline_moved.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._deadline_moved.wait(), delay)

    def _deadline_watch(self, event: Event, touched: object, ts: float) -> None:
        """Ledger observer: wake the deadline loop for a deadline before its wake-up."""
        if type(touched) is RequestRecord:
            due = touched.deadline
        elif type(touched) is PendingPeer:
            due = touched.received_at + self.registry.deadlines.registered
        else:
            return
        if due < self._wake_at - DEADLINE_TICK_S:
            self._wake_at = due
            self._deadline_moved.set()

    async def _on_deadline(self, due: RequestRecord | PendingPeer) -> None:
        if isinstance(due, PendingPeer):
            if self.registry.pending.get(due.registration.request_id) is due:
                await self.ledger.commit(react_pending(due, Stimulus.DEADLINE), Cause.DAEMON)
            return
        current = self.registry.get(due.request_id)
        if current is None or current != due:
            return
        events = react(current, Stimulus.DEADLINE)
        if current.request_id in self.writes:
            # Abort the NIXL transfer before saying it failed; if the write
            # ended meanwhile, the record moved on and this deadline is moot.
            await self.transfers.cancel_write(current.request_id)
            if self.registry.get(due.request_id) != due:
                return
        elif any(getattr(e, "fenced", False) for e in events):
            # Fence the peer before declaring no write can land any more.
            link = self.links.link(current.peer) if self.links is not None else None
            if link is not None:
                link.close("fenced", "a quarantine deadline passed")
            peer = current.peer
            await self.windows.fence(peer)
            current = self.registry.get(due.request_id)
            if current is not None and current.incarnation == due.incarnation:
                await self.react(current, Stimulus.DEADLINE)
            await self.windows.rewindow(peer)
            return
        await self.react(current, Stimulus.DEADLINE)
