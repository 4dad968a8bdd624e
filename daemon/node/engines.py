"""The engines attached to this node: their sessions, memory and offload pools.

An engine registers with its layout and its KV memory (DRAM shm files or
CUDA IPC handles), which the daemon maps and registers with NIXL; each peer
gets its own window onto that memory (daemon/node/windows.py). An engine whose
connection closed is forgotten, and its memory unmapped, once its last live
request is released.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from daemon.dataplane.memory import MappedRegion, OffloadPool, RegionError, map_dram_region
from daemon.dataplane.plane import DataPlaneError
from daemon.dataplane.vram import VramRegion, open_vram_region
from schemas import rpc
from schemas.events import Event
from schemas.kvlayout import EngineSpec, MemoryKind, RemoteEngine
from schemas.reasons import Reason
from schemas.state import RequestRecord
from statemachine import Refusal
from statemachine.notices import on_engine_back
from statemachine.reactions import Cause

if TYPE_CHECKING:
    from daemon.node.runtime import Node

log = structlog.get_logger("kvpushd.node")

Region = MappedRegion | VramRegion


class EngineSession(Protocol):
    """What the node needs from an engine's connection (see engine_server.Session)."""

    uid: int
    gid: int
    pid: int

    def send_event(self, event: Any) -> None: ...


@dataclass
class EngineState:
    spec: EngineSpec
    regions: dict[str, Region]  # VRAM: GPU KV caches (daemon/dataplane/vram.py)
    remote: RemoteEngine
    session: EngineSession | None
    offload: OffloadPool | None = None
    offload_region: MappedRegion | None = None
    live: int = 0
    # What each peer is told: the engine seen through that peer's own windows.
    windows: dict[str, RemoteEngine] = field(default_factory=dict)


class Engines:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.by_id: dict[str, EngineState] = {}
        # Offload slots held per live request: request id -> (engine, slots).
        self.offload: dict[str, tuple[str, tuple[int, ...]]] = {}
        # Releases no engine heard of yet, oldest dropped first (bounded like
        # the tombstones that would refuse a late call about them anyway).
        self._unannounced: collections.deque[tuple[str, rpc.Released]] = collections.deque(
            maxlen=node.config.limits.tombstones
        )

    # ------------------------------------------------------------- telling

    def tell_engine(self, engine_id: str, event: rpc.Event) -> None:
        engine = self.by_id.get(engine_id)
        if engine is not None and engine.session is not None:
            engine.session.send_event(event)
        elif isinstance(event, rpc.Released):
            # Released without the engine (a deadline) while it was away: the
            # request is gone, so nothing else would tell it when it is back.
            self._unannounced.append((engine_id, event))

    def _resend_outcomes(self, engine_id: str) -> None:
        """Tell a (re)registered engine what it may have missed while away."""
        if any(owner == engine_id for owner, _ in self._unannounced):
            kept: collections.deque[tuple[str, rpc.Released]] = collections.deque(
                maxlen=self._unannounced.maxlen
            )
            for owner, released in self._unannounced:
                if owner == engine_id:
                    self.tell_engine(engine_id, released)
                else:
                    kept.append((owner, released))
            self._unannounced = kept
        for record in list(self.node.registry.live.values()):
            if record.engine_id == engine_id:
                for event in on_engine_back(record):
                    self.tell_engine(engine_id, event)

    # ---------------------------------------------------------- registering

    async def register(self, session: EngineSession, req: rpc.RegisterEngine) -> rpc.Reply:
        node = self.node
        spec = EngineSpec(req.engine_id, req.groups, req.regions)
        existing = self.by_id.get(req.engine_id)
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
        attach = node.registry.check_attach(spec.layout())
        # Off the loop: opening the first VRAM region initializes CUDA in this
        # process (seconds), which must not stall heartbeats or other engines' RPCs.
        regions = await asyncio.to_thread(self._map_regions, spec, session.uid)
        try:
            remote = await node.dataplane.add_local_engine(spec, regions)
        except DataPlaneError as exc:
            for region in regions.values():
                region.close()
            raise RegionError(str(exc)) from exc
        engine = EngineState(spec, regions, remote, session)
        try:
            await node.windows.open_for_all_peers(engine)
        except DataPlaneError as exc:
            await self._close_memory(engine)
            raise RegionError(str(exc)) from exc
        if req.offload is not None:
            engine.offload_region = map_dram_region(req.offload, owner_uid=session.uid)
            # The pool starts zeroed: nothing left from before a restart leaks.
            engine.offload = OffloadPool(engine.offload_region, req.offload_slots)
        self.by_id[req.engine_id] = engine
        await node.ledger.commit([attach], Cause.ENGINE)
        self._resend_outcomes(req.engine_id)
        await node.windows.announce()
        log.info("engine registered", node=node.config.node, engine=req.engine_id)
        return rpc.Ok(req.id)

    @staticmethod
    def _map_one(region: Any, uid: int) -> Region:
        # GPU KV caches come as CUDA IPC handles, opened on their GPU (daemon/dataplane/vram.py).
        if region.memory is MemoryKind.VRAM:
            return open_vram_region(region, owner_uid=uid)
        return map_dram_region(region, owner_uid=uid)

    def _map_regions(self, spec: EngineSpec, uid: int) -> dict[str, Region]:
        regions: dict[str, Region] = {}
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

    async def _close_memory(self, engine: EngineState) -> None:
        with contextlib.suppress(Exception):
            await self.node.dataplane.remove_local_engine(engine.spec.engine_id)
        for region in engine.regions.values():
            region.close()
        if engine.offload_region is not None:
            engine.offload_region.close()

    async def close(self) -> None:
        for engine in self.by_id.values():
            await self._close_memory(engine)

    # ------------------------------------------------------------ ownership

    def own(self, session: EngineSession, engine_id: str) -> EngineState:
        engine = self.by_id.get(engine_id)
        if engine is None:
            raise Refusal(Reason.UNKNOWN_ENGINE, f"engine {engine_id!r} is not registered")
        if engine.session is not session:
            raise Refusal(
                Reason.UNKNOWN_ENGINE,
                f"engine {engine_id!r} belongs to another connection",
            )
        return engine

    def own_request(
        self, session: EngineSession, request_id: str, incarnation: int
    ) -> RequestRecord:
        record = self.node.registry.lookup(request_id, incarnation)
        self.own(session, record.engine_id)
        return record

    def acquire_offload(self, engine: EngineState, count: int) -> tuple[int, ...]:
        if not count:
            return ()
        if engine.offload is None:
            raise Refusal(
                Reason.UNKNOWN_ENGINE, f"engine {engine.spec.engine_id} has no offload pool"
            )
        return engine.offload.acquire(count)

    def give_back_offload(self, engine: EngineState, slots: tuple[int, ...]) -> None:
        if slots and engine.offload is not None:
            engine.offload.release(slots)

    # ------------------------------------------------------------- leaving

    def disconnected(self, session: EngineSession) -> None:
        for engine_id, engine in list(self.by_id.items()):
            if engine.session is session:
                engine.session = None
                self._detach_if_idle(engine_id)

    def after_durable(self, event: Event, record: RequestRecord) -> None:
        """Invariant 5 once a release is durable: zero its offload slots, drop its tracking.

        The ledger runs it for ``Released`` records only.
        """
        held = self.offload.pop(record.request_id, None)
        if held is not None:
            engine_id, slots = held
            owner = self.by_id.get(engine_id)
            if owner is not None and owner.offload is not None:
                owner.offload.release(slots)
        engine = self.by_id.get(record.engine_id)
        if engine is not None:
            engine.live = max(0, engine.live - 1)
            if engine.session is None:
                self._detach_if_idle(record.engine_id)

    def _detach_if_idle(self, engine_id: str) -> None:
        """Forget an engine that has no connection and no live request, and unmap its memory.

        Its memory is only needed while a request may still write into it; an
        engine that comes back registers (and is mapped) again. Without this
        (found by tests/test_load.py) the daemon kept every departed engine's
        shared memory mapped, the files unlinked but their pages pinned, and
        its NIXL registrations, for as long as it ran. With live requests the
        engine stays until the last one is released (see after_durable).
        """
        node = self.node
        engine = self.by_id.get(engine_id)
        if engine is None or engine.session is not None or node.closing:
            return
        if engine_id not in node.registry.engines:
            return
        if any(r.engine_id == engine_id for r in node.registry.live.values()):
            return
        # All three forget the engine before the first await, so a registration
        # of the same id arriving meanwhile starts afresh on every side.
        del self.by_id[engine_id]
        detached = node.ledger.commit([node.registry.check_detach(engine_id)])
        # Spawned now, so it runs (and drops the data plane's entry) before any
        # request read after this point can try to add the engine again.
        node.spawn(self._unmap_detached(engine, detached))

    async def _unmap_detached(self, engine: EngineState, detached: Any) -> None:
        await self._close_memory(engine)
        if not self.node.closing:
            # Peers forget it too (their prepared lists of it would only grow).
            await self.node.windows.announce()
        # Nobody waits on the detach, so nothing else would commit it soon.
        await detached
