"""The engines attached to this node: their sessions, memory and offload pools.

An engine registers with its layout and its KV memory (DRAM shm files or
CUDA IPC handles), which the daemon maps and registers with NIXL; each peer
gets its own window onto that memory (daemon/node/windows.py). An engine whose
connection closed is forgotten, and its memory unmapped, once its last live
request is released.

Offload slots are granted by the core (``Registry.check_register``) and
journaled; an engine's pool here only carries the grants out: it marks them
busy, zeroes a slot once its request's release is durable, and, when the
engine registers after a restart, starts with the slots that replay says
live requests still hold.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Set as AbstractSet
from typing import Any

import structlog

from daemon.dataplane.memory import (
    MappedRegion,
    OffloadPool,
    RegionError,
    brought_identity,
    map_dram,
)
from daemon.dataplane.plane import DataPlane, DataPlaneError
from daemon.dataplane.vram import open_vram_descriptor, open_vram_region
from daemon.node.engine_state import EngineSession, EngineState, Region
from daemon.node.ledger import Ledger
from daemon.node.lifecycle import Lifecycle
from daemon.node.tasks import Spawn
from daemon.node.windows import Windows
from schemas import rpc
from schemas.events import Event, Registered
from schemas.kvlayout import EngineSpec, MemoryKind, MemoryNote, RegionSpec
from schemas.reasons import Reason
from schemas.state import RequestRecord
from statemachine import Refusal
from statemachine.notices import on_engine_back
from statemachine.overlay import OverlayRefused, group_overlays
from statemachine.reactions import Cause

log = structlog.get_logger("kvpushd.node")


class Engines:
    def __init__(
        self,
        *,
        node: str,
        ledger: Ledger,
        dataplane: DataPlane,
        windows: Windows,
        by_id: dict[str, EngineState],
        spawn: Spawn,
        life: Lifecycle,
        tombstones: int,
    ) -> None:
        self._node = node
        self._ledger = ledger
        self._dataplane = dataplane
        self._windows = windows
        self._spawn = spawn
        self._life = life
        # Shared, read-only, with the windows, the transfers and the peers.
        self.by_id = by_id
        # Offload slots held per live request, as the core granted them:
        # (request id, incarnation) -> (engine, slots). Keyed by incarnation
        # too: the next incarnation may be granted slots before the release
        # of the one before is durable (and its slots zeroed).
        self.offload: dict[tuple[str, int], tuple[str, tuple[int, ...]]] = {}
        # Releases no engine heard of yet, oldest dropped first (bounded like
        # the tombstones that would refuse a late call about them anyway).
        self._unannounced: collections.deque[tuple[str, rpc.Released]] = collections.deque(
            maxlen=tombstones
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
        for record in list(self._ledger.registry.live.values()):
            if record.engine_id == engine_id:
                for event in on_engine_back(record):
                    self.tell_engine(engine_id, event)

    # ---------------------------------------------------------- registering

    async def register(self, session: EngineSession, req: rpc.RegisterEngine) -> rpc.Reply:
        spec = EngineSpec(req.engine_id, req.groups, req.regions, req.fingerprint)
        _check_offload(req)
        existing = self.by_id.get(req.engine_id)
        if existing is not None:
            pool = 0 if existing.offload is None else existing.offload.n_slots
            if existing.spec != spec or (existing.offload_spec, pool) != (
                req.offload,
                req.offload_slots,
            ):
                raise Refusal(
                    Reason.ENGINE_IN_USE,
                    f"engine {req.engine_id} is registered with a different layout",
                )
            _check_same_memory(existing, req, session.descriptors)
            existing.session = session
            existing.note = req.memory_note or MemoryNote()
            self._resend_outcomes(req.engine_id)
            return rpc.Ok(req.id)
        # The pool's size is part of the layout: while live requests hold
        # slots (after a restart, say), the engine cannot come back with another.
        try:
            overlays = group_overlays(spec.groups)
        except OverlayRefused as exc:
            raise RegionError(f"engine {req.engine_id}: {exc}") from exc
        attach = self._ledger.registry.check_attach(spec.layout(req.offload_slots, overlays))
        # Off the loop: opening the first VRAM region initializes CUDA in this
        # process (seconds), which must not stall heartbeats or other engines' RPCs.
        regions = await asyncio.to_thread(self._map_regions, spec, session.uid, session.descriptors)
        offload_region: MappedRegion | None = None
        try:
            if req.offload is not None:
                offload_region = map_dram(req.offload, session.descriptors, owner_uid=session.uid)
            _check_distinct(regions, offload_region)
            remote = await self._dataplane.add_local_engine(spec, regions)
        except (DataPlaneError, RegionError) as exc:
            for region in regions.values():
                region.close()
            if offload_region is not None:
                offload_region.close()
            if isinstance(exc, RegionError):
                raise
            raise RegionError(str(exc)) from exc
        engine = EngineState(spec, regions, remote, session)
        engine.offload_region, engine.offload_spec = offload_region, req.offload
        engine.note = req.memory_note or MemoryNote()
        try:
            await self._windows.open_for_all_peers(engine)
            if offload_region is not None:
                # After the last await: the slots held now are the ones kept.
                self._open_pool(engine, offload_region, req.offload_slots)
        except (DataPlaneError, RegionError) as exc:
            if req.engine_id not in self.by_id:
                self._windows.forget(req.engine_id)  # never registered: no peer hears of it
            await self._close_memory(engine)
            if isinstance(exc, RegionError):
                raise
            raise RegionError(str(exc)) from exc
        self.by_id[req.engine_id] = engine
        await self._ledger.commit([attach], Cause.ENGINE)
        self._resend_outcomes(req.engine_id)
        await self._windows.announce()
        log.info("engine registered", node=self._node, engine=req.engine_id)
        return rpc.Ok(req.id)

    def _open_pool(self, engine: EngineState, region: MappedRegion, n_slots: int) -> None:
        """The engine's offload pool, keeping the slots live requests hold as they are.

        After a restart the engine registers again with the pool it had, and
        replay knows which slots its live requests still hold: those stay
        busy (and unzeroed: their requests may still use them) until they
        are released, when after_durable zeroes them; every other slot is
        zeroed now.
        """
        engine_id, registry = engine.spec.engine_id, self._ledger.registry
        engine.offload = OffloadPool(region, n_slots, held=registry.slots_held(engine_id))
        for record in registry.live.values():
            slots = registry.offload_slots(record.request_id)
            if slots and record.engine_id == engine_id:
                self.offload[(record.request_id, record.incarnation)] = (engine_id, slots)

    @staticmethod
    def _map_one(region: Any, uid: int, descriptors: tuple[int, ...]) -> Region:
        # GPU KV caches come as cuMem descriptors or CUDA IPC handles, opened on
        # their GPU (daemon/dataplane/vram.py).
        if region.memory is MemoryKind.VRAM and region.descriptor >= 0:
            return open_vram_descriptor(region, descriptors, owner_uid=uid)
        if region.memory is MemoryKind.VRAM:
            return open_vram_region(region, owner_uid=uid)
        return map_dram(region, descriptors, owner_uid=uid)

    def _map_regions(
        self, spec: EngineSpec, uid: int, descriptors: tuple[int, ...]
    ) -> dict[str, Region]:
        regions: dict[str, Region] = {}
        try:
            for region in spec.regions:
                if region.name in regions:
                    raise RegionError(f"region name {region.name!r} is declared twice")
                regions[region.name] = self._map_one(region, uid, descriptors)
        except BaseException:
            for mapped in regions.values():
                mapped.close()
            raise
        return regions

    async def _close_memory(self, engine: EngineState) -> None:
        with contextlib.suppress(Exception):
            await self._dataplane.remove_local_engine(engine.spec.engine_id)
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
        record = self._ledger.registry.lookup(request_id, incarnation)
        self.own(session, record.engine_id)
        return record

    @staticmethod
    def unavailable_slots(engine: EngineState) -> AbstractSet[int]:
        """Slots the core must not grant: busy in the pool (granted, or not yet zeroed)."""
        return frozenset() if engine.offload is None else engine.offload.busy

    def take_offload(self, engine: EngineState, event: Registered) -> None:
        """Carry out the core's grant before it is journaled (RegionError: nothing taken)."""
        if event.offload_slots:
            if engine.offload is None:
                raise RegionError(
                    f"engine {engine.spec.engine_id} has no offload pool", code="bad_slot"
                )
            engine.offload.take(event.offload_slots)

    def granted(self, event: Registered) -> None:
        """The grant is journaled: its slots are zeroed and freed once its release is durable."""
        if event.offload_slots:
            key = (event.request_id, event.incarnation)
            self.offload[key] = (event.engine_id, event.offload_slots)

    def give_back_offload(self, engine: EngineState, event: Registered) -> None:
        """The grant was not journaled after all: free its slots (zeroed; nobody was told)."""
        if event.offload_slots and engine.offload is not None:
            engine.offload.release(event.offload_slots)

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
        held = self.offload.pop((record.request_id, record.incarnation), None)
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
        registry = self._ledger.registry
        engine = self.by_id.get(engine_id)
        if engine is None or engine.session is not None or self._life.closing:
            return
        if engine_id not in registry.engines:
            return
        if any(r.engine_id == engine_id for r in registry.live.values()):
            return
        # All four forget the engine before the first await, so a registration
        # of the same id arriving meanwhile starts afresh on every side.
        del self.by_id[engine_id]
        self._windows.forget(engine_id)
        detached = self._ledger.commit([registry.check_detach(engine_id)])
        # Spawned now, so it runs (and drops the data plane's entry) before any
        # request read after this point can try to add the engine again.
        self._spawn(self._unmap_detached(engine, detached))

    async def _unmap_detached(self, engine: EngineState, detached: Any) -> None:
        await self._close_memory(engine)
        if not self._life.closing:
            # Peers forget it too (their prepared lists of it would only grow).
            await self._windows.announce()
        # Nobody waits on the detach, so nothing else would commit it soon.
        await detached


def _check_offload(req: rpc.RegisterEngine) -> None:
    """An offload pool's declaration, checked before anything is mapped."""
    offload = req.offload
    if offload is None:
        if req.offload_slots:
            raise RegionError(f"offload_slots = {req.offload_slots} without an offload region")
        return
    if offload.memory is not MemoryKind.DRAM:
        # Offload pools are zeroed and handed out by the daemon: host memory only.
        raise RegionError(f"offload region {offload.name!r}: offload pools are DRAM only")
    if req.offload_slots <= 0 or offload.size % req.offload_slots:
        raise RegionError(
            f"offload region {offload.name!r} of {offload.size} bytes does not split into "
            f"{req.offload_slots} equal slots (offload_slots must be at least 1)"
        )


def _check_distinct(regions: dict[str, Region], offload: MappedRegion | None) -> None:
    """Two regions must be two memories: a region maps its memory whole, from byte 0.

    The same memfd or file named twice would alias one region's blocks onto
    the other's: a write meant for one lands in both, and an offload pool
    over the KV cache would have the daemon zero live KV when a slot is freed.
    """
    seen: dict[tuple[int, int], str] = {}
    named = [*regions.items(), *((("offload " + offload.name, offload),) if offload else ())]
    for name, region in named:
        if not isinstance(region, MappedRegion):
            continue
        first = seen.setdefault(region.identity, name)
        if first != name:
            raise RegionError(
                f"regions {first!r} and {name!r} are the same memory ({region.path}): "
                "each region must be memory of its own"
            )


def _check_same_memory(
    engine: EngineState, req: rpc.RegisterEngine, descriptors: tuple[int, ...]
) -> None:
    """An engine that registers again must bring the memory the daemon has mapped.

    Same layout, other memory (a new memfd, or a file made anew under the
    old name) would leave the daemon writing into memory the engine no
    longer reads: the bytes land, and the engine computes on its own.
    """
    # Each region the registration names, beside what the daemon mapped for it.
    pairs: list[tuple[RegionSpec, Region | None]] = [
        (spec, engine.regions.get(spec.name)) for spec in req.regions
    ]
    if req.offload is not None:
        pairs.append((req.offload, engine.offload_region))
    for spec, region in pairs:
        if not isinstance(region, MappedRegion):
            continue  # VRAM: the same CUDA IPC handle is the same allocation
        if brought_identity(spec, descriptors) != region.identity:
            raise Refusal(
                Reason.ENGINE_IN_USE,
                f"engine {req.engine_id} is registered with other memory in region "
                f"{spec.name!r} ({region.path}): an engine that registers again must "
                "bring the memory it registered with",
            )
