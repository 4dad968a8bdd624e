"""The node: one daemon's engines, peers, journal and data plane, tied to the core.

Every decision goes through the core (``statemachine.Registry``): a handler
asks a ``check_*``/``plan_*`` method, records the resulting events (applied
and appended by the :class:`Recorder`), waits for the group commit to make
them durable, and only then tells an engine or a peer (DESIGN invariant 6).

Roles, per request: the prefill node is the pusher, the decode node the
receiver. Message flow for one request R:

    decode engine --register(R)--> D --Forward--> P <--register(R)-- prefill engine
                                                  P <--kv_ready(R)--
    P: trimmed, writing --Writing--> D ; NIXL WRITE with notification "R#inc"
    P: done --BlocksFreeable--> prefill engine, --WriteDone--> D
    D: done (notification or WriteDone, whichever first) --KvArrived--> decode engine
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import structlog

from daemon import failpoints
from daemon.dataplane.memory import MappedRegion, OffloadPool, RegionError, map_dram_region
from daemon.dataplane.plane import DataPlane, DataPlaneError
from daemon.dataplane.vram import VramRegion, open_vram_region
from daemon.journal.groupcommit import GroupCommit
from daemon.journal.replay import fold_contents
from daemon.journal.store import MAX_RECORD_BYTES, Journal, JournalFatal
from daemon.node.recorder import Recorder
from schemas import peer as pm
from schemas import rpc
from schemas.config import Config
from schemas.events import (
    DaemonStarted,
    Event,
    Failed,
    KvReady,
    PeerSettled,
    Refused,
    Released,
    WriteDone,
    WriteStarted,
)
from schemas.kvlayout import EngineSpec, MemoryKind, RemoteEngine, model_signature
from schemas.layout import Role
from schemas.reasons import Reason
from schemas.state import PendingPeer, RequestRecord, State
from statemachine import Refusal, Registry, TrimRefused
from statemachine.registry import attention_ratio

VERSION = "0.1.0"
PUSHER, RECEIVER = Role.PUSHER, Role.RECEIVER
REGISTERED, TRIMMED, WRITING = State.REGISTERED, State.TRIMMED, State.WRITING
DONE, RELEASED, FAILED = State.DONE, State.RELEASED, State.FAILED
AWAITING_DATA = (REGISTERED, WRITING)

log = structlog.get_logger("kvpushd.node")
# Room for a record's envelope (version, node, seq, time) or a Forward's other
# fields around a registration's blocks.
_RECORD_HEADROOM = 4096
_size_encoder = msgspec.msgpack.Encoder()


class EngineSession(Protocol):
    """What the node needs from an engine's connection (see engine_server.Session)."""

    uid: int
    gid: int
    pid: int

    def send_event(self, event: Any) -> None: ...


@dataclass
class EngineState:
    spec: EngineSpec
    regions: dict[str, MappedRegion | VramRegion]  # VRAM: GPU KV caches (daemon/dataplane/vram.py)
    remote: RemoteEngine
    session: EngineSession | None
    offload: OffloadPool | None = None
    offload_region: MappedRegion | None = None
    live: int = 0
    # What each peer is told: the engine seen through that peer's own windows.
    windows: dict[str, RemoteEngine] = field(default_factory=dict)


@dataclass
class PeerState:
    agent_name: str = ""
    boot_id: str = ""
    engines: dict[str, RemoteEngine] = field(default_factory=dict)


def notification_for(request_id: str, incarnation: int) -> bytes:
    return f"{request_id}#{incarnation}".encode()


def parse_notification(message: bytes) -> tuple[str, int] | None:
    request_id, sep, incarnation = message.decode(errors="replace").rpartition("#")
    if not sep or not incarnation.isdigit():
        return None
    return request_id, int(incarnation)


class Node:
    def __init__(self, config: Config, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.boot_id = uuid.uuid4().hex[:12]
        self.log = log.bind(node=config.node)
        # Checked before building a debug line: record() is the journal's hot path.
        self._debug = config.log_level == "debug"
        self.registry = Registry(
            deadlines=config.deadlines, tombstone_limit=config.limits.tombstones
        )
        self.journal: Journal | None = None
        self.recorder: Recorder | None = None
        self.commit: GroupCommit | None = None
        self.dataplane = DataPlane(
            f"kvpushd-{config.node}-{self.boot_id}",
            backend=config.nixl.backend,
            poll_interval_s=config.nixl.poll_interval_s,
        )
        self.peers: Any = None  # PeerManager, set in start()
        self.engines: dict[str, EngineState] = {}
        self.peer_state: dict[str, PeerState] = {}
        self.offload: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.writes: dict[str, asyncio.Task[None]] = {}
        self.awaiting_data: set[str] = set()
        self.fatal: BaseException | None = None
        self.stopping = False
        self.started_at = clock()
        self.records_since_snapshot = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._chains: dict[tuple[str, Any], asyncio.Task[Any]] = {}
        self._window_locks: dict[str, asyncio.Lock] = {}
        # Releases no engine heard of yet, oldest dropped first (bounded like
        # the tombstones that would refuse a late call about them anyway).
        self._unannounced: collections.deque[tuple[str, rpc.Released]] = collections.deque(
            maxlen=config.limits.tombstones
        )
        self.counters: dict[str, int] = {
            "writes_started": 0,
            "writes_done": 0,
            "writes_failed": 0,
            "bytes_written": 0,
            "refusals": 0,
        }
        self.on_fatal: Callable[[BaseException], None] = lambda exc: None
        self.observers: list[Callable[[Event, object, float], None]] = []
        # Extra fields for status() from other parts of the service (metrics port).
        self.status_extras: dict[str, Any] = {}

    # ------------------------------------------------------------ start / stop

    async def start(self) -> None:
        cfg = self.config
        self.journal = Journal.open(
            cfg.journal.dir,
            fsync=cfg.journal.fsync,
            segment_bytes=cfg.journal.segment_mb * 1024 * 1024,
            # The group commit decides when to commit; append() never should.
            commit_window_s=float("inf"),
        )
        replayed = fold_contents(
            self.journal.take_recovered(),
            deadlines=cfg.deadlines,
            tombstone_limit=cfg.limits.tombstones,
        )
        self.registry = replayed.registry
        self.recorder = Recorder(self.journal, self.registry, node=cfg.node, clock=self.clock)
        self.commit = GroupCommit(self.journal, window_s=0.0, on_fatal=self._journal_failed)
        self.log.info(
            "journal replayed",
            records=replayed.records,
            last_seq=replayed.last_seq,
            torn_bytes=replayed.torn_bytes,
            live=len(self.registry.live),
        )
        await self.dataplane.start()
        self.dataplane.set_notification_handler(self._on_notification)
        self.record(DaemonStarted(os.getpid(), VERSION, self.boot_id))
        self._fail_after_restart()
        # Engines attached before the restart must register again (their memory
        # mappings died with the old process); until then they are unknown.
        for engine_id in list(self.registry.engines):
            if not any(r.engine_id == engine_id for r in self.registry.live.values()):
                self.record(self.registry.check_detach(engine_id))
        await self.commit.durable(self.journal.next_seq - 1)
        self.spawn(self._deadline_loop())

    def attach_peers(self, manager: Any) -> None:
        self.peers = manager

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
        for rid, task in list(self.writes.items()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            record = self.registry.get(rid)
            if record is not None and record.state is WRITING:
                await self.fail_and_tell(
                    record, Reason.DAEMON_RESTART, "daemon stopped during the write"
                )

    async def close(self) -> None:
        """After drain and after the peer links closed: make durable, release memory."""
        self.stopping = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.commit is not None:
            if self.fatal is None:
                with contextlib.suppress(JournalFatal):
                    self.commit.commit_now()
            self.commit.close()
        for engine in self.engines.values():
            await self._close_engine_memory(engine)
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
        # DESIGN: an fsync failure is fatal; exit and replay, never retry.
        if self.fatal is not None:
            return  # reported once; later calls only see the journal refuse
        self.fatal = exc
        # One line per failure: on_fatal's owner (the service) says it as it
        # exits; this one only for a node run without such an owner.
        self.log.debug("journal write failed; stopping", error=str(exc))
        self.on_fatal(exc)

    # -------------------------------------------------------------- recording

    def record(self, event: Event) -> int:
        assert self.recorder is not None
        try:
            record, touched = self.recorder.record(event)
        except JournalFatal as exc:
            # A synchronous commit (policy "always", a full segment) failed, or
            # the journal failed before: as fatal as a failed group commit.
            self._journal_failed(exc)
            raise
        self._log_event(event, record.seq)
        for observe in self.observers:
            observe(event, touched, record.ts)
        self.records_since_snapshot += 1
        if self.records_since_snapshot >= self.config.journal.snapshot_every:
            self.records_since_snapshot = 0
            try:
                self.recorder.snapshot(retain_segments=self.config.journal.retain_segments)
            except JournalFatal as exc:
                self._journal_failed(exc)  # the snapshot's commit or file write failed
                raise
        return record.seq

    def _log_event(self, event: Event, seq: int) -> None:
        request_id = getattr(event, "request_id", None)
        if request_id is None:
            return
        name = type(event).__name__
        if isinstance(event, Failed | Refused):
            self.log.warning(
                "request failed" if isinstance(event, Failed) else "request refused",
                request_id=request_id,
                incarnation=event.incarnation,
                reason=event.reason.value,
                detail=event.message,
                seq=seq,
            )
        elif self._debug:
            self.log.debug(
                "transition",
                request_id=request_id,
                incarnation=event.incarnation,
                kind=name,
                seq=seq,
            )

    async def durable(self, seq: int) -> None:
        assert self.commit is not None
        await self.commit.durable(seq)

    async def record_durably(self, *events: Event) -> int:
        seq = 0
        for event in events:
            seq = self.record(event)
        if seq:
            await self.durable(seq)
        return seq

    async def record_refusal(self, request: Any, refusal: Refusal) -> None:
        """Journal a refused engine request; the registry itself is unchanged."""
        if self.fatal is not None or self.recorder is None:
            return
        self.counters["refusals"] += 1
        event = Refused(
            getattr(request, "request_id", ""),
            getattr(request, "incarnation", 0),
            getattr(request, "engine_id", ""),
            refusal.reason,
            refusal.message,
        )
        with contextlib.suppress(JournalFatal):
            await self.record_durably(event)

    # ---------------------------------------------------------- engine events

    def tell_engine(self, engine_id: str, event: Any) -> None:
        engine = self.engines.get(engine_id)
        if engine is not None and engine.session is not None:
            engine.session.send_event(event)
        elif isinstance(event, rpc.Released):
            # Released without the engine (a deadline) while it was away: the
            # request is gone, so nothing else would tell it when it is back.
            self._unannounced.append((engine_id, event))

    def tell_peer(self, node: str, message: Any) -> bool:
        if self.peers is None:
            return False
        return bool(self.peers.send(node, message))

    def _resend_outcomes(self, engine_id: str) -> None:
        """Tell a (re)registered engine what it may have missed while away."""
        if any(owner == engine_id for owner, _ in self._unannounced):
            kept: collections.deque[tuple[str, rpc.Released]] = collections.deque(
                maxlen=self._unannounced.maxlen
            )
            for owner, event in self._unannounced:
                if owner == engine_id:
                    self.tell_engine(engine_id, event)
                else:
                    kept.append((owner, event))
            self._unannounced = kept
        for record in list(self.registry.live.values()):
            if record.engine_id != engine_id:
                continue
            rid, inc = record.request_id, record.incarnation
            if record.state is DONE:
                event = (
                    rpc.KvArrived(rid, inc)
                    if record.role is RECEIVER
                    else (rpc.BlocksFreeable(rid, inc))
                )
                self.tell_engine(engine_id, event)
            elif record.state is FAILED:
                self.tell_engine(
                    engine_id,
                    rpc.RequestFailed(rid, inc, record.reason or Reason.ABORTED, record.message),
                )

    # ------------------------------------------------------------ restart

    def _fail_after_restart(self) -> None:
        """Requests caught mid-flight by a restart fail; their memory is gone."""
        for record in list(self.registry.live.values()):
            if record.state in (REGISTERED, TRIMMED, WRITING):
                # A pusher's write died with the old process (the copy ran in
                # its threads), so nothing is in flight from this side.
                self.record(
                    Failed(
                        record.request_id,
                        record.incarnation,
                        Reason.DAEMON_RESTART,
                        f"daemon restarted while the request was {record.state.value}",
                    )
                )
        for pending in list(self.registry.pending.values()):
            reg = pending.registration
            self.record(
                Failed(
                    reg.request_id,
                    reg.incarnation,
                    Reason.DAEMON_RESTART,
                    "daemon restarted before the prefill engine registered",
                    settled=True,
                )
            )
            self.tell_peer(
                reg.peer,
                pm.WriteFailed(
                    reg.request_id,
                    reg.incarnation,
                    Reason.DAEMON_RESTART,
                    "prefill daemon restarted",
                ),
            )

    # --------------------------------------------------------------- engine RPC

    async def rpc_register_engine(
        self, session: EngineSession, req: rpc.RegisterEngine
    ) -> rpc.Reply:
        spec = EngineSpec(req.engine_id, req.groups, req.regions)
        existing = self.engines.get(req.engine_id)
        if existing is not None:
            if existing.spec != spec:
                raise Refusal(
                    Reason.ENGINE_IN_USE,
                    f"engine {req.engine_id} is registered with a different layout",
                )
            existing.session = session
            self._resend_outcomes(req.engine_id)
            return rpc.Ok(req.id)
        if req.offload is not None and req.offload.memory is not MemoryKind.DRAM:
            # Offload pools are zeroed and handed out by the daemon: host memory only.
            raise RegionError(f"offload region {req.offload.name!r}: offload pools are DRAM only")
        attach = self.registry.check_attach(spec.layout())
        # Off the loop: opening the first VRAM region initializes CUDA in this
        # process (seconds), which must not stall heartbeats or other engines' RPCs.
        regions = await asyncio.to_thread(self._map_regions, spec, session.uid)
        try:
            remote = await self.dataplane.add_local_engine(spec, regions)
        except DataPlaneError as exc:
            for region in regions.values():
                region.close()
            raise RegionError(str(exc)) from exc
        engine = EngineState(spec, regions, remote, session)
        try:
            for peer in self.config.peers:
                async with self._windows_lock(peer.node):
                    engine.windows[peer.node] = await self.dataplane.open_windows(
                        peer.node, spec, regions
                    )
        except DataPlaneError as exc:
            await self._close_engine_memory(engine)
            raise RegionError(str(exc)) from exc
        if req.offload is not None:
            engine.offload_region = self._map_one(req.offload, session.uid)
            # The pool starts zeroed: nothing left from before a restart leaks.
            engine.offload = OffloadPool(engine.offload_region, req.offload_slots)
        self.engines[req.engine_id] = engine
        await self.record_durably(attach)
        self._resend_outcomes(req.engine_id)
        await self._announce_engines()
        self.log.info("engine registered", engine=req.engine_id, groups=len(req.groups))
        return rpc.Ok(req.id)

    def _map_one(self, region: Any, uid: int) -> MappedRegion | VramRegion:
        # GPU KV caches come as CUDA IPC handles, opened on their GPU (daemon/dataplane/vram.py).
        if region.memory is MemoryKind.VRAM:
            return open_vram_region(region, owner_uid=uid)
        return map_dram_region(region, owner_uid=uid)

    def _map_regions(self, spec: EngineSpec, uid: int) -> dict[str, MappedRegion | VramRegion]:
        regions: dict[str, MappedRegion | VramRegion] = {}
        try:
            for region in spec.regions:
                if region.name in regions:
                    raise RegionError(f"region name {region.name!r} is declared twice")
                regions[region.name] = self._map_one(region, uid)
        except BaseException:
            for mapped in regions.values():
                mapped.close()
            raise
        return regions

    async def _close_engine_memory(self, engine: EngineState) -> None:
        with contextlib.suppress(Exception):
            await self.dataplane.remove_local_engine(engine.spec.engine_id)
        for region in engine.regions.values():
            region.close()
        if engine.offload_region is not None:
            engine.offload_region.close()

    def engine_disconnected(self, session: EngineSession) -> None:
        for engine_id, engine in list(self.engines.items()):
            if engine.session is session:
                engine.session = None
                self._detach_if_idle(engine_id)

    def _detach_if_idle(self, engine_id: str) -> None:
        """Forget an engine that has no connection and no live request, and unmap its memory.

        Its memory is only needed while a request may still write into it; an
        engine that comes back registers (and is mapped) again. Without this
        (found by tests/test_load.py) the daemon kept every departed engine's
        shared memory mapped, the files unlinked but their pages pinned, and
        its NIXL registrations, for as long as it ran. With live requests the
        engine stays until the last one is released (see _on_released).
        """
        engine = self.engines.get(engine_id)
        if engine is None or engine.session is not None or self.stopping or self.fatal:
            return
        if engine_id not in self.registry.engines:
            return
        if any(r.engine_id == engine_id for r in self.registry.live.values()):
            return
        # All three forget the engine before the first await, so a registration
        # of the same id arriving meanwhile starts afresh on every side.
        del self.engines[engine_id]
        seq = self.record(self.registry.check_detach(engine_id))
        # Spawned now, so it runs (and drops the data plane's entry) before any
        # request read after this point can try to add the engine again.
        self.spawn(self._unmap_detached(engine, seq))

    async def _unmap_detached(self, engine: EngineState, seq: int) -> None:
        await self._close_engine_memory(engine)
        if not self._closing:
            # Peers forget it too (their prepared lists of it would only grow).
            await self._announce_engines()
        # Nobody waits on the detach, so nothing else would commit it soon.
        await self.durable(seq)

    def _own_engine(self, session: EngineSession, engine_id: str) -> EngineState:
        engine = self.engines.get(engine_id)
        if engine is None:
            raise Refusal(Reason.UNKNOWN_ENGINE, f"engine {engine_id!r} is not registered")
        if engine.session is not session:
            raise Refusal(
                Reason.UNKNOWN_ENGINE,
                f"engine {engine_id!r} belongs to another connection",
            )
        return engine

    def _own_request(self, session: EngineSession, request_id: str, incarnation: int):
        record = self.registry.lookup(request_id, incarnation)
        self._own_engine(session, record.engine_id)
        return record

    async def rpc_register_request(
        self, session: EngineSession, req: rpc.RegisterRequest
    ) -> rpc.Reply:
        if self.stopping:
            raise Refusal(Reason.DAEMON_RESTART, "the daemon is draining")
        engine = self._own_engine(session, req.engine_id)
        if engine.live >= self.config.limits.max_live_per_engine:
            raise Refusal(
                Reason.ENGINE_IN_USE,
                f"engine {req.engine_id} has {engine.live} live requests, the limit is "
                f"{self.config.limits.max_live_per_engine}",
            )
        if req.role is RECEIVER:
            if not req.peer:
                raise Refusal(Reason.UNKNOWN_REQUEST, "a receiver registration must name its peer")
            if self.peers is None or not self.peers.is_up(req.peer):
                raise Refusal(Reason.PEER_DEAD, f"peer {req.peer!r} is not connected")
        event = self.registry.check_register(
            req.request_id, req.incarnation, req.role, req.engine_id, req.peer, req.blocks
        )
        self._check_fits(event)
        slots: tuple[int, ...] = ()
        if req.offload_slots:
            if engine.offload is None:
                raise Refusal(Reason.UNKNOWN_ENGINE, f"engine {req.engine_id} has no offload pool")
            slots = engine.offload.acquire(req.offload_slots)
        try:
            seq = self.record(event)
        except BaseException:
            if slots:
                engine.offload.release(slots)  # type: ignore[union-attr]
            raise
        if slots:
            self.offload[req.request_id] = (req.engine_id, slots)
        engine.live += 1
        if req.role is RECEIVER:
            self.awaiting_data.add(req.request_id)
            self.dataplane.expect_notifications(True)
        await self.durable(seq)
        if req.role is RECEIVER:
            self.tell_peer(
                req.peer,
                pm.Forward(
                    req.request_id,
                    req.incarnation,
                    req.engine_id,
                    event.blocks,
                    attention_ratio(self.registry.engines[req.engine_id]),
                ),
            )
        else:
            self.spawn(self.advance(req.request_id))
        return rpc.RequestAccepted(req.id, state=REGISTERED.value, offload_slots=slots)

    def _check_fits(self, event: Any) -> None:
        """Refuse a registration too big for one journal record or one peer frame.

        The core expands logical blocks to kernel blocks, so a request frame
        within the limit can become a record (and a Forward) many times its
        size. Without this check (found by tests/test_fuzz.py) an oversized
        record failed to append after the registry had applied it, leaving
        live state the journal did not have, and an oversized Forward was
        journaled but never reached the peer; both replied "internal".
        """
        n_blocks = sum(len(ids) for ids in event.blocks)
        strings = len(event.request_id) + len(event.engine_id) + len(event.peer)
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
        record = self._own_request(session, req.request_id, req.incarnation)
        if record.role is not PUSHER:
            raise Refusal(Reason.ROLE_MISMATCH, f"request {req.request_id} is a receiver here")
        seq = self.record(KvReady(req.request_id, req.incarnation))
        # Advance before waiting: its trimmed/writing records join the same
        # group commit as kv_ready, saving one fsync on the critical path.
        self.spawn(self.advance(req.request_id))
        await self.durable(seq)
        return rpc.Ok(req.id)

    async def rpc_release(self, session: EngineSession, req: rpc.Release) -> rpc.Reply:
        record = self._own_request(session, req.request_id, req.incarnation)
        events = self.registry.plan_release(req.request_id, req.incarnation)
        cancel = record.role is RECEIVER and record.state in AWAITING_DATA
        await self.record_durably(*events)
        if cancel:
            self._data_no_longer_awaited(record.request_id)
            self.tell_peer(record.peer, pm.Cancel(record.request_id, record.incarnation))
        if record.role is PUSHER and record.state in (REGISTERED, TRIMMED):
            self.tell_peer(
                record.peer,
                pm.WriteFailed(
                    record.request_id,
                    record.incarnation,
                    Reason.ABORTED,
                    "the prefill engine released the request before the write",
                ),
            )
        if any(isinstance(e, Released) for e in events):
            self._on_released(record)
            return rpc.Ok(req.id)
        return rpc.Deferred(req.id, "a write may still be in flight; released once it ends")

    async def rpc_abort(self, session: EngineSession, req: rpc.Abort) -> rpc.Reply:
        record = self._own_request(session, req.request_id, req.incarnation)
        events = self.registry.plan_abort(
            req.request_id, req.incarnation, Reason.ABORTED, "aborted by its engine"
        )
        await self.record_durably(*events)
        if record.role is RECEIVER and record.state in AWAITING_DATA:
            self._data_no_longer_awaited(record.request_id)
            self.tell_peer(record.peer, pm.Cancel(record.request_id, record.incarnation))
        elif record.role is PUSHER and record.state in (REGISTERED, TRIMMED):
            self.tell_peer(
                record.peer,
                pm.WriteFailed(
                    record.request_id,
                    record.incarnation,
                    Reason.ABORTED,
                    "aborted by the prefill engine",
                ),
            )
        return rpc.Ok(req.id)

    def status(self) -> dict[str, Any]:
        now = self.clock()
        by_state: dict[str, int] = {}
        oldest: RequestRecord | None = None
        for record in self.registry.live.values():
            by_state[record.state.value] = by_state.get(record.state.value, 0) + 1
            if oldest is None or record.entered_at < oldest.entered_at:
                oldest = record
        journal = self.journal
        return {
            "node": self.config.node,
            "version": VERSION,
            "boot_id": self.boot_id,
            "pid": os.getpid(),
            "uptime_s": round(now - self.started_at, 3),
            "live": len(self.registry.live),
            "by_state": by_state,
            "pending_peer_registrations": len(self.registry.pending),
            "oldest": None
            if oldest is None
            else {
                "request_id": oldest.request_id,
                "state": oldest.state.value,
                "age_s": round(now - oldest.entered_at, 3),
            },
            "requests": [
                {
                    "request_id": r.request_id,
                    "incarnation": r.incarnation,
                    "role": r.role.value,
                    "state": r.state.value,
                    "engine": r.engine_id,
                    "peer": r.peer,
                    "age_s": round(now - r.entered_at, 3),
                }
                for r in sorted(self.registry.live.values(), key=lambda r: r.entered_at)[:200]
            ],
            "engines": {
                engine_id: {
                    "connected": e.session is not None,
                    "groups": len(e.spec.groups),
                    "live": e.live,
                    "offload_free": None if e.offload is None else e.offload.free_count,
                }
                for engine_id, e in self.engines.items()
            },
            "peers": [msgspec.structs.asdict(info) for info in self.peers.links]
            if self.peers is not None
            else [],
            "journal": {
                "dir": str(self.config.journal.dir),
                "next_seq": journal.next_seq if journal else 0,
                "durable_seq": journal.durable_seq if journal else 0,
                "lag": (journal.next_seq - 1 - journal.durable_seq) if journal else 0,
            },
            "counters": dict(self.counters),
            "peer_engines": {node: sorted(p.engines) for node, p in self.peer_state.items()},
            "dataplane": {
                "writes": self.dataplane.writes,
                "write_errors": self.dataplane.write_errors,
                "writes_cancelled": self.dataplane.writes_cancelled,
                "bytes_written": self.dataplane.bytes_written,
            },
            "writes_in_flight": len(self.writes),
            **self.status_extras,
        }

    # ------------------------------------------------------------ lifecycle

    def _fail(
        self, record: RequestRecord, reason: Reason, message: str, *, settled: bool = False
    ) -> int:
        seq = self.record(Failed(record.request_id, record.incarnation, reason, message, settled))
        if record.role is RECEIVER:
            self._data_no_longer_awaited(record.request_id)
        return seq

    async def fail_and_tell(
        self,
        record: RequestRecord,
        reason: Reason,
        message: str,
        *,
        settled: bool = False,
        tell_peer: bool = True,
    ) -> None:
        seq = self._fail(record, reason, message, settled=settled)
        await self.durable(seq)
        self.tell_engine(
            record.engine_id,
            rpc.RequestFailed(record.request_id, record.incarnation, reason, message),
        )
        if tell_peer:
            if record.role is PUSHER:
                self.tell_peer(
                    record.peer,
                    pm.WriteFailed(record.request_id, record.incarnation, reason, message),
                )
            else:
                self.tell_peer(record.peer, pm.Cancel(record.request_id, record.incarnation))
        await self.follow_up(record.request_id)

    async def follow_up(self, request_id: str) -> None:
        """Carry out a deferred release once the quarantine lifts."""
        record = self.registry.get(request_id)
        if record is None:
            return
        events = self.registry.follow_up(record)
        if not events:
            return
        await self.record_durably(*events)
        self._on_released(record)
        self.tell_engine(record.engine_id, rpc.Released(record.request_id, record.incarnation))

    def _on_released(self, record: RequestRecord) -> None:
        # Invariant 5: zero every offload slot the request used, drop its tracking.
        held = self.offload.pop(record.request_id, None)
        if held is not None:
            engine_id, slots = held
            engine = self.engines.get(engine_id)
            if engine is not None and engine.offload is not None:
                engine.offload.release(slots)
        engine = self.engines.get(record.engine_id)
        if engine is not None:
            engine.live = max(0, engine.live - 1)
            if engine.session is None:
                self._detach_if_idle(record.engine_id)
        self._data_no_longer_awaited(record.request_id)

    def _data_no_longer_awaited(self, request_id: str) -> None:
        self.awaiting_data.discard(request_id)
        if not self.awaiting_data:
            self.dataplane.expect_notifications(False)

    async def advance(self, request_id: str) -> None:
        """Pusher: trim once both sides are known, write once the KV is ready."""
        record = self.registry.get(request_id)
        if record is None or record.role is not PUSHER:
            return
        if record.state is REGISTERED and record.remote_blocks is not None:
            try:
                trimmed = self.registry.plan_trim(record.request_id, record.incarnation)
            except TrimRefused as refusal:
                self.counters["refusals"] += 1
                self.record(
                    Refused(
                        record.request_id,
                        record.incarnation,
                        record.engine_id,
                        refusal.reason,
                        refusal.message,
                    )
                )
                await self.fail_and_tell(record, refusal.reason, refusal.message)
                return
            seq = self.record(trimmed)
            record = self.registry.get(request_id)
            assert record is not None
            if not record.kv_ready:
                # Nothing waits on the journal again until kv_ready, which may
                # be long: without this (found by tests/test_load.py) an idle
                # daemon's journal lagged its registry by every such trim.
                await self.durable(seq)
                record = self.registry.get(request_id)
                if record is None:
                    return
        if record.state is TRIMMED and record.kv_ready and request_id not in self.writes:
            self._start_write(record)

    def _start_write(self, record: RequestRecord) -> None:
        assert record.src is not None
        engine = self.engines.get(record.engine_id)
        if engine is None:
            self.spawn(self.fail_and_tell(record, Reason.UNKNOWN_ENGINE, "engine went away"))
            return
        n_blocks = sum(len(ids) for ids in record.src)
        nbytes = sum(
            len(ids) * group.block_bytes * len(group.layers)
            for ids, group in zip(record.src, engine.spec.groups, strict=True)
        )
        seq = self.record(WriteStarted(record.request_id, record.incarnation, n_blocks, nbytes))
        self.counters["writes_started"] += 1
        self.writes[record.request_id] = self.spawn(self._write(record, seq, n_blocks, nbytes))

    async def _write(self, record: RequestRecord, seq: int, n_blocks: int, nbytes: int) -> None:
        rid, inc = record.request_id, record.incarnation
        try:
            await self.durable(seq)
            self.tell_peer(record.peer, pm.Writing(rid, inc, n_blocks, nbytes))
            peer = self.peer_state.get(record.peer)
            if n_blocks:
                if (
                    peer is None
                    or not peer.agent_name
                    or self.peers is None
                    or not self.peers.is_up(record.peer)
                ):
                    raise _PeerGone(f"peer {record.peer} is not connected")
                assert record.src is not None and record.dst is not None
                await self.dataplane.write(
                    record.engine_id,
                    peer.agent_name,
                    record.remote_engine,
                    record.src,
                    record.dst,
                    notification_for(rid, inc),
                )
        except (DataPlaneError, _PeerGone) as exc:
            self.writes.pop(rid, None)
            self.counters["writes_failed"] += 1
            reason = Reason.PEER_DEAD if isinstance(exc, _PeerGone) else Reason.TRANSFER_ERROR
            current = self.registry.get(rid)
            if current is not None and current.state is WRITING:
                await self.fail_and_tell(current, reason, str(exc))
            return
        self.writes.pop(rid, None)
        current = self.registry.get(rid)
        if current is None or current.state is not WRITING:
            return
        self.counters["writes_done"] += 1
        self.counters["bytes_written"] += nbytes
        await self.record_durably(WriteDone(rid, inc))
        failpoints.hit("node.write_done")
        self.tell_engine(record.engine_id, rpc.BlocksFreeable(rid, inc))
        self.tell_peer(record.peer, pm.WriteDone(rid, inc))
        await self.follow_up(rid)

    # ------------------------------------------------------------- receiver

    def _on_notification(self, agent_name: str, message: bytes) -> None:
        key = parse_notification(message)
        if key is None:
            self.log.warning("unparseable notification", agent=agent_name)
            return
        record = self.registry.get(key[0])
        if record is None or record.incarnation != key[1] or record.role is not RECEIVER:
            return
        if record.state in AWAITING_DATA:
            self.spawn(self._receiver_done(record))

    async def _receiver_done(self, record: RequestRecord) -> None:
        current = self.registry.get(record.request_id)
        if current is None or current.incarnation != record.incarnation:
            return
        if current.state not in AWAITING_DATA:
            return
        self._data_no_longer_awaited(current.request_id)
        await self.record_durably(WriteDone(current.request_id, current.incarnation))
        failpoints.hit("node.kv_arrived")
        self.tell_engine(current.engine_id, rpc.KvArrived(current.request_id, current.incarnation))
        await self.follow_up(current.request_id)

    # ---------------------------------------------------------------- peers

    def check_peer_hello(self, node: str, hello: pm.Hello) -> None:
        """Refuse a peering whose engines cannot exchange KV with ours."""
        from daemon.node.peerlink import PeerRejected

        local = {model_signature(e.spec.groups) for e in self.engines.values()}
        for engine in hello.engines:
            signature = model_signature(engine.groups)
            if local and signature not in local:
                raise PeerRejected(
                    "layout_mismatch",
                    f"engine {engine.engine_id} on {node} has layout {signature}, "
                    f"this node's engines have {sorted(local)}",
                )

    def _peer_view(self, peer: str) -> tuple[RemoteEngine, ...]:
        # Never the engines' own mapping: a peer only learns its windows.
        return tuple(e.windows[peer] for e in self.engines.values() if peer in e.windows)

    def _engines_for(self, peer: str) -> pm.Engines:
        return pm.Engines(self._peer_view(peer), self._metadata)

    async def _announce_engines(self) -> None:
        """Fresh metadata (it carries the registrations), then each connected peer its view."""
        if self.peers is None:
            return
        self._metadata = await self.dataplane.metadata()
        for info in self.peers.links:
            if info.up:
                self.peers.send(info.node, self._engines_for(info.node))

    @property
    def _closing(self) -> bool:
        # The data plane is closed or closing; its close unmapped every window.
        return self.fatal is not None or self.stopping

    def hello(self, peer: str) -> pm.Hello:
        return pm.Hello(
            node=self.config.node,
            boot_id=self.boot_id,
            agent_name=self.dataplane.agent_name,
            agent_metadata=self._metadata,
            engines=self._peer_view(peer),
        )

    async def fence(self, node: str) -> None:
        """Make sure nothing more moves between ``node`` and this daemon's memory.

        Forgets its agent (nothing more is posted to it) and revokes its
        windows (a write it posts from now on faults instead of landing,
        whatever state it is in: frozen, partitioned, or thawing with an old
        descriptor list). Only after this may the blocks it could write be
        handed back; :meth:`rewindow` then gives it fresh windows.
        """
        if self._closing:
            return
        state = self.peer_state.get(node)
        if state is not None and state.agent_name:
            with contextlib.suppress(Exception):
                await self.dataplane.remove_remote_agent(state.agent_name)
            state.agent_name = ""
        async with self._windows_lock(node):
            for engine in self.engines.values():
                engine.windows.pop(node, None)  # no Hello may name them any more
            try:
                revoked = await self.dataplane.revoke_windows(node)
            except DataPlaneError:
                if self._closing:
                    return  # closed under us
                raise
        self.log.info("peer fenced", peer=node, windows_revoked=revoked)

    async def rewindow(self, node: str) -> None:
        """Fresh windows for a fenced peer's next link (after its requests were failed)."""
        if self._closing:
            return
        async with self._windows_lock(node):
            for engine in list(self.engines.values()):
                if node in engine.windows or self.engines.get(engine.spec.engine_id) is not engine:
                    continue  # opened meanwhile by its registration, or detached
                try:
                    engine.windows[node] = await self.dataplane.open_windows(
                        node, engine.spec, engine.regions
                    )
                except DataPlaneError as exc:
                    # Leaving this engine out of what the peer is told is safe:
                    # requests for it fail as unknown to the peer.
                    self.log.warning(
                        "no new window", peer=node, engine=engine.spec.engine_id, error=str(exc)
                    )
            try:
                self._metadata = await self.dataplane.metadata()
            except DataPlaneError:
                if self._closing:
                    return
                raise
        # If it is already back on a new link, that link's Hello named no
        # windows (or ones opened since): tell it the current ones.
        self.tell_peer(node, self._engines_for(node))

    def _windows_lock(self, peer: str) -> asyncio.Lock:
        # One fence or window opening per peer at a time, so a window is
        # never opened and revoked out of order.
        return self._window_locks.setdefault(peer, asyncio.Lock())

    _metadata: bytes = b""

    async def load_metadata(self) -> None:
        self._metadata = await self.dataplane.metadata()

    async def peer_up(self, node: str, hello: pm.Hello) -> None:
        state = self.peer_state.setdefault(node, PeerState())
        if state.agent_name and state.agent_name != hello.agent_name:
            with contextlib.suppress(Exception):
                await self.dataplane.remove_remote_agent(state.agent_name)
        if state.boot_id and state.boot_id != hello.boot_id:
            # A new process: the old one, which knew the revoked windows, is gone.
            await self.dataplane.drop_revoked(node)
        state.agent_name = await self.dataplane.add_remote_agent(hello.agent_metadata)
        state.boot_id = hello.boot_id
        state.engines = {}
        for engine in hello.engines:
            await self.dataplane.add_remote_engine(state.agent_name, engine)
            state.engines[engine.engine_id] = engine
        self.log.info("peer up", peer=node, boot_id=hello.boot_id, engines=len(hello.engines))
        self._reconcile(node)

    async def peer_engines(
        self, node: str, engines: tuple[RemoteEngine, ...], metadata: bytes
    ) -> None:
        state = self.peer_state.get(node)
        if state is None or not state.agent_name:
            return
        state.agent_name = await self.dataplane.add_remote_agent(metadata)
        for engine in engines:
            known = state.engines.get(engine.engine_id)
            if known == engine:
                continue
            if known is not None:
                await self.dataplane.remove_remote_engine(state.agent_name, engine.engine_id)
            await self.dataplane.add_remote_engine(state.agent_name, engine)
            state.engines[engine.engine_id] = engine
        # The list is the peer's whole view: an engine missing from it left.
        listed = {engine.engine_id for engine in engines}
        for engine_id in [e for e in state.engines if e not in listed]:
            del state.engines[engine_id]
            with contextlib.suppress(DataPlaneError):
                await self.dataplane.remove_remote_engine(state.agent_name, engine_id)

    def _reconcile(self, node: str) -> None:
        """After (re)connecting, say again what the peer may have missed."""
        for record in list(self.registry.live.values()):
            if record.peer != node:
                continue
            rid, inc = record.request_id, record.incarnation
            if record.role is RECEIVER:
                if record.state in AWAITING_DATA:
                    self.tell_peer(
                        node,
                        pm.Forward(
                            rid,
                            inc,
                            record.engine_id,
                            record.blocks,
                            attention_ratio(self.registry.engines[record.engine_id]),
                        ),
                    )
                elif record.state is FAILED and not record.settled:
                    self.tell_peer(node, pm.Cancel(rid, inc))
            else:
                if record.state is DONE:
                    self.tell_peer(node, pm.WriteDone(rid, inc))
                elif record.state is FAILED:
                    self.tell_peer(
                        node,
                        pm.WriteFailed(rid, inc, record.reason or Reason.ABORTED, record.message),
                    )

    async def peer_down(self, node: str, reason: str) -> None:
        """A peer is dead (TTL, disconnect): fence it, fail what depended on it."""
        self.log.warning("peer down", peer=node, reason=reason)
        await self.fence(node)
        message = f"peer {node} is dead ({reason})"
        for listed in list(self.registry.live.values()):
            # Each await below lets other handlers (an engine's release, say)
            # move records on: act on the record as it is now, not as listed.
            record = self.registry.get(listed.request_id)
            if record is None or record.incarnation != listed.incarnation or record.peer != node:
                continue
            if record.role is PUSHER and record.state in (REGISTERED, TRIMMED):
                await self.fail_and_tell(record, Reason.PEER_DEAD, message, tell_peer=False)
            elif record.role is RECEIVER and record.state in AWAITING_DATA:
                await self.fail_and_tell(
                    record, Reason.PEER_DEAD, message, settled=True, tell_peer=False
                )
            elif record.role is RECEIVER and record.state is FAILED and not record.settled:
                await self.record_durably(PeerSettled(record.request_id, record.incarnation, True))
                await self.follow_up(record.request_id)
        for pending in list(self.registry.pending.values()):
            if self.registry.pending.get(pending.registration.request_id) is not pending:
                continue  # joined by its engine or failed meanwhile
            if pending.registration.peer == node:
                reg = pending.registration
                await self.record_durably(
                    Failed(reg.request_id, reg.incarnation, Reason.PEER_DEAD, message, settled=True)
                )
        await self.rewindow(node)

    # The peer manager calls back synchronously and in arrival order. Handlers
    # wait on the journal, so each runs as a task; tasks are chained per
    # request id (and behind the peer's own up/down handling) so that the
    # order the peer sent in is the order they are applied in.

    def on_peer_up(self, node: str, hello: pm.Hello, link: Any) -> None:
        self.check_peer_hello(node, hello)
        self._chain(("peer", node), self.peer_up(node, hello))

    def on_peer_down(self, node: str, reason: str) -> None:
        if self.stopping:
            # Shutting down: what is live stays in the journal and fails as
            # "daemon restart" on the next start; journaling now would race
            # the close of the journal.
            return
        self._chain(("peer", node), self.peer_down(node, reason))

    def on_peer_message(self, node: str, message: Any) -> None:
        key = getattr(message, "request_id", None)
        self._chain(
            ("request", key) if key is not None else ("peer", node),
            self.peer_message(node, message),
            after=("peer", node),
        )

    def _chain(
        self,
        key: tuple[str, Any],
        coro: Coroutine[Any, Any, None],
        after: tuple[str, Any] | None = None,
    ) -> None:
        waits = [
            t
            for t in (self._chains.get(key), self._chains.get(after) if after else None)
            if t is not None and not t.done()
        ]

        async def run() -> None:
            # Wait for the predecessors whatever their outcome. (Suppressing
            # BaseException around shield() also swallowed this task's own
            # cancellation at shutdown, and the handler then ran anyway.)
            try:
                if waits:
                    await asyncio.wait(waits)
            except asyncio.CancelledError:
                coro.close()
                raise
            await coro

        task = self.spawn(run())
        self._chains[key] = task
        task.add_done_callback(
            lambda t: self._chains.pop(key, None) if self._chains.get(key) is t else None
        )

    async def peer_message(self, node: str, message: Any) -> None:
        handler = self._peer_handlers.get(type(message))
        if handler is None:
            self.log.warning("unexpected peer message", peer=node, type=type(message).__name__)
            return
        try:
            await handler(self, node, message)
        except Refusal as refusal:
            self.log.info(
                "peer message refused",
                peer=node,
                reason=refusal.reason.value,
                message=refusal.message,
            )

    async def _on_forward(self, node: str, msg: pm.Forward) -> None:
        record = self.registry.get(msg.request_id)
        if (
            record is not None
            and record.incarnation == msg.incarnation
            and record.remote_blocks == msg.blocks
        ):
            return  # a re-sent forward after reconnecting: already known
        pending = self.registry.pending.get(msg.request_id)
        if pending is not None and pending.registration.blocks == msg.blocks:
            return
        try:
            event = self.registry.check_peer_registration(
                msg.request_id, msg.incarnation, node, msg.engine_id, msg.blocks, msg.per_logical
            )
        except Refusal as refusal:
            self.counters["refusals"] += 1
            await self.record_durably(
                Refused(
                    msg.request_id, msg.incarnation, msg.engine_id, refusal.reason, refusal.message
                )
            )
            self.tell_peer(
                node,
                pm.WriteFailed(msg.request_id, msg.incarnation, refusal.reason, refusal.message),
            )
            return
        await self.record_durably(event)
        await self.advance(msg.request_id)

    async def _on_cancel(self, node: str, msg: pm.Cancel) -> None:
        record = self.registry.get(msg.request_id)
        if record is None or record.incarnation != msg.incarnation:
            pending = self.registry.pending.get(msg.request_id)
            if pending is not None and pending.registration.incarnation == msg.incarnation:
                await self.record_durably(
                    Failed(
                        msg.request_id, msg.incarnation, Reason.CANCELLED_BY_PEER, "cancelled", True
                    )
                )
            # No record here means no write can be in flight from here.
            self.tell_peer(
                node,
                pm.WriteFailed(
                    msg.request_id, msg.incarnation, Reason.CANCELLED_BY_PEER, "no write in flight"
                ),
            )
            return
        if record.state in (REGISTERED, TRIMMED):
            # Invariant 2: never start a write the receiver has cancelled.
            await self.fail_and_tell(
                record, Reason.CANCELLED_BY_PEER, "the decode side cancelled the request"
            )
        elif record.state is DONE:
            self.tell_peer(node, pm.WriteDone(msg.request_id, msg.incarnation))
        elif record.state is FAILED:
            self.tell_peer(
                node,
                pm.WriteFailed(
                    msg.request_id, msg.incarnation, record.reason or Reason.ABORTED, record.message
                ),
            )
        # WRITING: the write ends as done or failed, and the receiver hears which.

    async def _on_writing(self, node: str, msg: pm.Writing) -> None:
        record = self.registry.get(msg.request_id)
        if record is None or record.incarnation != msg.incarnation or record.role is not RECEIVER:
            return
        if record.state is REGISTERED:
            await self.record_durably(
                WriteStarted(msg.request_id, msg.incarnation, msg.num_blocks, msg.nbytes)
            )

    async def _on_write_done(self, node: str, msg: pm.WriteDone) -> None:
        record = self.registry.get(msg.request_id)
        if record is None or record.incarnation != msg.incarnation or record.role is not RECEIVER:
            return
        if record.state in AWAITING_DATA:
            await self._receiver_done(record)
        elif record.state is FAILED and not record.settled:
            await self.record_durably(PeerSettled(msg.request_id, msg.incarnation))
            await self.follow_up(msg.request_id)

    async def _on_write_failed(self, node: str, msg: pm.WriteFailed) -> None:
        record = self.registry.get(msg.request_id)
        if record is None or record.incarnation != msg.incarnation or record.role is not RECEIVER:
            return
        if record.state in AWAITING_DATA:
            reason = (
                msg.reason if msg.reason is not Reason.CANCELLED_BY_PEER else Reason.REFUSED_BY_PEER
            )
            await self.fail_and_tell(
                record, reason, f"{node}: {msg.message}", settled=True, tell_peer=False
            )
        elif record.state is FAILED and not record.settled:
            await self.record_durably(PeerSettled(msg.request_id, msg.incarnation))
            await self.follow_up(msg.request_id)

    async def _on_engines(self, node: str, msg: pm.Engines) -> None:
        await self.peer_engines(node, msg.engines, msg.agent_metadata)

    _peer_handlers: dict[type, Callable[..., Awaitable[None]]] = {
        pm.Forward: _on_forward,
        pm.Cancel: _on_cancel,
        pm.Writing: _on_writing,
        pm.WriteDone: _on_write_done,
        pm.WriteFailed: _on_write_failed,
        pm.Engines: _on_engines,
    }

    # ------------------------------------------------------------ deadlines

    async def _deadline_loop(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            for due in self.registry.expired(self.clock()):
                await self._on_deadline(due)

    async def _on_deadline(self, due: RequestRecord | PendingPeer) -> None:
        if isinstance(due, PendingPeer):
            reg = due.registration
            if self.registry.pending.get(reg.request_id) is not due:
                return
            await self.record_durably(self.registry.on_deadline(due))
            self.tell_peer(
                reg.peer,
                pm.WriteFailed(
                    reg.request_id,
                    reg.incarnation,
                    Reason.DEADLINE_EXCEEDED,
                    "the prefill engine never registered",
                ),
            )
            return
        current = self.registry.get(due.request_id)
        if current is None or current != due:
            return
        event = self.registry.on_deadline(current)
        if isinstance(event, Failed):
            task = self.writes.pop(current.request_id, None)
            if task is not None:
                # Abort the NIXL transfer before saying it failed.
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                current = self.registry.get(due.request_id)
                if current is None or current.state is not WRITING:
                    return
            await self.fail_and_tell(current, event.reason, event.message)
        elif isinstance(event, PeerSettled):
            # Fence the peer before declaring no write can land any more.
            link = self.peers.link(current.peer) if self.peers is not None else None
            if link is not None:
                link.close("fenced", "a quarantine deadline passed")
            await self.fence(current.peer)
            await self.record_durably(event)
            await self.follow_up(current.request_id)
            await self.rewindow(current.peer)
        else:
            await self.record_durably(event)
            self._on_released(current)
            self.tell_engine(
                current.engine_id, rpc.Released(current.request_id, current.incarnation)
            )


class _PeerGone(Exception):
    pass
