"""The data plane: one NIXL agent per daemon, pushing KV blocks with WRITEs.

:class:`DataPlane` is the facade the daemon uses, on the event loop: async
methods that validate against a loop-side mirror of the agent's engines
(geometry.py), then hand the work to the one thread that owns the agent
(worker.py) and await its answer. Failures raise :class:`DataPlaneError`
(``TransferError`` for a write that was posted), each with a stable code.

Windows. Peers never learn the addresses of a local engine's own mapping:
each peer gets a window of its own onto the same pages (daemon/dataplane/window.py),
registered with the agent, so that fencing a peer can revoke exactly its
access (``revoke_windows``) and nobody else's.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from daemon.dataplane.errors import DataPlaneError, TransferError
from daemon.dataplane.geometry import (
    EngineGeometry,
    Region,
    build_indices,
    check_remote_engine,
    local_remote_engine,
)
from daemon.dataplane.memory import MappedRegion
from daemon.dataplane.worker import Call, Cancel, Post, Stop, Worker, WriteResult
from schemas.events import Blocks
from schemas.kvlayout import EngineSpec, RemoteEngine

__all__ = [
    "DataPlane",
    "DataPlaneError",
    "NotificationHandler",
    "Posted",
    "TransferError",
    "WriteResult",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

NotificationHandler = Callable[[str, bytes], None]


@dataclass(slots=True)
class Posted:
    """One WRITE handed to the worker; ``fut`` None: nothing to write (zero bytes)."""

    xid: int
    worker: Worker
    fut: asyncio.Future[WriteResult] | None
    stopped: bool = False


async def _settle(fut: asyncio.Future[T]) -> T:
    """Await ``fut`` to completion even if the caller is cancelled meanwhile.

    The worker's state change happens whatever the caller does; letting the
    caller leave early would let the loop-side tables disagree with the
    agent's. The cancellation is re-raised once ``fut`` has settled.
    """
    cancelled = False
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancelled = cancelled or not fut.done()
        except Exception:
            pass  # fut's own exception, re-raised below
    if cancelled:
        if not fut.cancelled():
            fut.exception()  # mark it retrieved
        raise asyncio.CancelledError
    return fut.result()


class DataPlane:
    """One NIXL agent driven by one worker thread; async methods for the event loop.

    Lifecycle for a pair of daemons: each ``start()``s, adds its local engines,
    then sends ``metadata()`` (taken AFTER its engines were added: metadata
    carries the registrations, and a peer cannot prepare a remote engine from
    stale metadata; loading newer metadata for a known agent updates it) and
    its engines' ``RemoteEngine`` to the peer, which calls
    ``add_remote_agent`` then ``add_remote_engine``.

    ``poll_interval_s`` paces the worker while writes are in flight or
    notifications are expected; ``idle_progress_s`` is how often an otherwise
    idle worker makes one progress call (None: never). A receiver should call
    ``expect_notifications(True)`` while it waits for data: a pusher's
    notified WRITE only completes when the receiver progresses, so without it
    each write takes up to ``idle_progress_s`` (measured: 100 ms per write).
    """

    def __init__(
        self,
        name: str,
        *,
        backend: str = "UCX",
        poll_interval_s: float = 5e-5,
        idle_progress_s: float | None = 0.1,
    ) -> None:
        self.name = name
        self.backend = backend
        self.poll_interval_s = poll_interval_s
        self.idle_progress_s = idle_progress_s
        self._worker: Worker | None = None
        self._closed = False
        self._handler: NotificationHandler | None = None
        self._xids = itertools.count(1)
        # Loop-side mirror of what the worker holds, for validation before posting.
        self._local: dict[str, EngineGeometry] = {}
        self._remote_agents: set[str] = set()
        self._remote: dict[tuple[str, str], EngineGeometry] = {}
        self._remote_specs: dict[tuple[str, str], RemoteEngine] = {}
        # Counters (read them from the event loop).
        self.writes = 0
        self.bytes_written = 0
        self.write_errors = 0
        self.writes_cancelled = 0
        self.notifications = 0
        self.notifications_dropped = 0

    @property
    def agent_name(self) -> str:
        return self.name

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        if self._worker is not None:
            raise DataPlaneError(f"data plane {self.name!r} already started", code="state")
        worker = Worker(
            self.name,
            self.backend,
            asyncio.get_running_loop(),
            self.poll_interval_s,
            self.idle_progress_s,
            self._deliver_notifs,
        )
        worker.thread.start()
        try:
            await _settle(worker.started)
        except BaseException:
            if worker.started.exception() is None:
                # The agent started but our caller was cancelled: stop it again.
                worker.submit(Stop(worker.loop.create_future()))
            await asyncio.to_thread(worker.thread.join)
            raise
        self._worker = worker

    async def close(self) -> None:
        """Abort writes in flight, release every NIXL object, stop the worker. Idempotent."""
        worker = self._worker
        if worker is None or self._closed:
            return
        self._closed = True
        fut: asyncio.Future[None] = worker.loop.create_future()
        worker.submit(Stop(fut))
        await _settle(fut)
        await asyncio.to_thread(worker.thread.join)
        self._local.clear()
        self._remote.clear()
        self._remote_specs.clear()
        self._remote_agents.clear()

    def _live_worker(self) -> Worker:
        if self._worker is None or self._closed or not self._worker.thread.is_alive():
            raise DataPlaneError(f"data plane {self.name!r} is not running", code="state")
        return self._worker

    async def _call(self, fn: Callable[[], T]) -> T:
        worker = self._live_worker()
        fut: asyncio.Future[T] = worker.loop.create_future()
        worker.submit(Call(fn, fut))
        return await _settle(fut)

    # ---- agents and engines ------------------------------------------------

    async def metadata(self) -> bytes:
        worker = self._live_worker()
        return await self._call(lambda: bytes(worker.st.agent.get_agent_metadata()))

    async def add_local_engine(
        self, spec: EngineSpec, regions: Mapping[str, Region]
    ) -> RemoteEngine:
        """Register the engine's regions and prepare its descriptor list.

        Returns the ``RemoteEngine`` a peer needs (addresses in this process).
        """
        worker = self._live_worker()
        if spec.engine_id in self._local:
            raise DataPlaneError(f"local engine {spec.engine_id!r} already added", code="duplicate")
        engine = local_remote_engine(spec, regions)
        geometry = EngineGeometry.of(engine.engine_id, engine.groups)
        mapped = [regions[r.name] for r in spec.regions]
        await self._call(lambda: worker.add_local(engine, mapped))
        self._local[spec.engine_id] = geometry
        return engine

    async def open_windows(
        self, peer: str, spec: EngineSpec, regions: Mapping[str, Region]
    ) -> RemoteEngine:
        """The ``RemoteEngine`` to give ``peer``: its own windows onto the engine's regions.

        VRAM cannot be mapped twice in one process (a CUDA IPC handle opens
        once), so a VRAM engine's peers share its one registration, and
        fencing cannot revoke their access to it (see RELIABILITY.md).
        """
        worker = self._live_worker()
        if spec.engine_id not in self._local:
            raise DataPlaneError(f"unknown local engine {spec.engine_id!r}", code="unknown_engine")
        dram = [m for r in spec.regions if isinstance(m := regions[r.name], MappedRegion)]
        if len(dram) != len(spec.regions):
            return local_remote_engine(spec, regions)
        windows = await self._call(lambda: worker.open_windows(peer, spec.engine_id, dram))
        return local_remote_engine(spec, {w.name: w for w in windows})

    async def revoke_windows(self, peer: str) -> int:
        """Fence ``peer`` out of this process's memory: a write it posts from now on faults.

        Returns how many windows were revoked; open new ones for its next link.
        """
        worker = self._live_worker()
        return await self._call(lambda: worker.revoke_windows(peer))

    async def drop_revoked(self, peer: str) -> int:
        """Unmap ``peer``'s revoked windows, once the process that knew them is known gone."""
        worker = self._live_worker()
        return await self._call(lambda: worker.drop_revoked(peer))

    async def remove_local_engine(self, engine_id: str) -> int:
        """Abort its writes in flight, release its list, deregister its regions.

        Returns how many writes were aborted. Unmap the regions only after this.
        """
        worker = self._live_worker()
        if self._local.pop(engine_id, None) is None:
            raise DataPlaneError(f"unknown local engine {engine_id!r}", code="unknown_engine")
        return await self._call(lambda: worker.remove_local(engine_id))

    async def add_remote_agent(self, metadata: bytes) -> str:
        """Load a peer agent's metadata (again, to refresh it); returns its name."""
        worker = self._live_worker()
        name = await self._call(lambda: worker.add_remote_agent(metadata))
        if name == self.name:
            raise DataPlaneError("a remote agent has this agent's own name", code="bad_agent")
        self._remote_agents.add(name)
        return name

    async def remove_remote_agent(self, name: str) -> int:
        """Fence a peer: abort its writes in flight, release its lists, forget it.

        When this returns, no write to that agent is in flight and none can be
        posted. Returns how many writes were aborted.
        """
        worker = self._live_worker()
        if name not in self._remote_agents:
            raise DataPlaneError(f"unknown remote agent {name!r}", code="unknown_agent")
        self._remote_agents.discard(name)
        for key in [k for k in self._remote if k[0] == name]:
            del self._remote[key], self._remote_specs[key]
        return await self._call(lambda: worker.remove_remote_agent(name))

    async def add_remote_engine(self, agent_name: str, engine: RemoteEngine) -> None:
        """Prepare a peer engine's descriptor list; adding the identical engine again is a no-op."""
        worker = self._live_worker()
        if agent_name not in self._remote_agents:
            raise DataPlaneError(f"unknown remote agent {agent_name!r}", code="unknown_agent")
        key = (agent_name, engine.engine_id)
        if key in self._remote:
            if self._remote_specs.get(key) == engine:
                return  # the same engine again (a peer link reconnect): nothing to do
            raise DataPlaneError(
                f"remote engine {engine.engine_id!r} of {agent_name!r} already added with"
                " another layout; remove_remote_engine first",
                code="duplicate",
            )
        check_remote_engine(engine)
        geometry = EngineGeometry.of(engine.engine_id, engine.groups)
        await self._call(lambda: worker.add_remote_engine(agent_name, engine))
        self._remote[key] = geometry
        self._remote_specs[key] = engine

    async def remove_remote_engine(self, agent_name: str, engine_id: str) -> int:
        worker = self._live_worker()
        self._remote_specs.pop((agent_name, engine_id), None)
        if self._remote.pop((agent_name, engine_id), None) is None:
            raise DataPlaneError(
                f"unknown remote engine {engine_id!r} of {agent_name!r}", code="unknown_engine"
            )
        return await self._call(lambda: worker.remove_remote_engine(agent_name, engine_id))

    # ---- writes --------------------------------------------------------------

    def _geometries(
        self, local_engine: str, remote_agent: str, remote_engine: str
    ) -> tuple[EngineGeometry, EngineGeometry]:
        local = self._local.get(local_engine)
        if local is None:
            raise DataPlaneError(f"unknown local engine {local_engine!r}", code="unknown_engine")
        if remote_agent not in self._remote_agents:
            raise DataPlaneError(f"unknown remote agent {remote_agent!r}", code="unknown_agent")
        remote = self._remote.get((remote_agent, remote_engine))
        if remote is None:
            raise DataPlaneError(
                f"unknown remote engine {remote_engine!r} of {remote_agent!r}",
                code="unknown_engine",
            )
        return local, remote

    async def write(
        self,
        local_engine: str,
        remote_agent: str,
        remote_engine: str,
        src: Blocks,
        dst: Blocks,
        notif: bytes,
    ) -> WriteResult:
        """Write ``src[g][i]`` of every layer into ``dst[g][i]`` with one NIXL WRITE.

        :meth:`post` then :meth:`finish`: validation errors raise
        DataPlaneError before anything is posted; a write of zero blocks in
        total never touches NIXL (and sends no notification); if the caller
        is cancelled, the transfer is aborted (its handle released) before
        the cancellation propagates.
        """
        return await self.finish(
            self.post(local_engine, remote_agent, remote_engine, src, dst, notif)
        )

    def post(
        self,
        local_engine: str,
        remote_agent: str,
        remote_engine: str,
        src: Blocks,
        dst: Blocks,
        notif: bytes,
    ) -> Posted:
        """Hand one NIXL WRITE to the worker now, without waiting (and without a task).

        Validation errors raise DataPlaneError before anything is posted.
        Whoever posts must :meth:`finish` it, or :meth:`stop` it if they
        give up on it.
        """
        worker = self._live_worker()
        local, remote = self._geometries(local_engine, remote_agent, remote_engine)
        lidx, ridx, nbytes = build_indices(local, remote, src, dst)
        if nbytes == 0:
            return Posted(0, worker, None)
        xid = next(self._xids)
        fut: asyncio.Future[WriteResult] = worker.loop.create_future()
        worker.submit(
            Post(xid, local_engine, remote_agent, remote_engine, lidx, ridx, notif, nbytes, fut)
        )
        return Posted(xid, worker, fut)

    async def finish(self, posted: Posted) -> WriteResult:
        """Wait for a posted write; cancelled meanwhile, the transfer is aborted first."""
        fut = posted.fut
        if fut is None:
            return WriteResult(0, 0, 0.0)
        try:
            result = await asyncio.shield(fut)
        except asyncio.CancelledError:
            await self._cancel_write(posted, fut)
            raise
        except TransferError:
            self.write_errors += 1
            raise
        self.writes += 1
        self.bytes_written += result.nbytes
        return result

    async def stop(self, posted: Posted) -> None:
        """Abort a posted write nobody will finish, and wait until the worker let it go.

        Stopping one already stopped, or one whose result is in, does nothing.
        """
        fut = posted.fut
        if fut is None or posted.stopped or fut.done():
            if fut is not None and fut.done() and not fut.cancelled():
                fut.exception()  # retrieved: whoever gave up on it has its own failure
            return
        await self._cancel_write(posted, fut)

    async def _cancel_write(self, posted: Posted, fut: asyncio.Future[WriteResult]) -> None:
        posted.stopped = True
        worker, xid = posted.worker, posted.xid
        self.writes_cancelled += 1
        ack: asyncio.Future[str] = worker.loop.create_future()
        worker.submit(Cancel(xid, ack))
        try:
            await _settle(ack)
        finally:
            if fut.done() and not fut.cancelled():
                exc = fut.exception()  # retrieved: nobody else will look at it
                if isinstance(exc, TransferError):
                    # Posted before the cancel reached the worker, and failed
                    # (a fenced peer's revoked window, say): worth a count and a line.
                    self.write_errors += 1
                    log.warning("write %d failed before its cancel arrived: %s", xid, exc)

    # ---- notifications ---------------------------------------------------------

    def set_notification_handler(self, callback: NotificationHandler | None) -> None:
        """``callback(remote_agent_name, message)`` runs on the event loop thread.

        NIXL keys notifications by the sending agent's name only; the message
        must identify the request (and its incarnation). A cancelled or
        fenced write's notification is normally never delivered, but the
        handler must tolerate late or unknown messages.
        """
        self._handler = callback

    def expect_notifications(self, flag: bool) -> None:
        """While True, the worker polls for notifications (and thus progresses) continuously.

        A hint about polling: on a data plane that is closed (a fatal journal
        error closes it while peer messages are still being handled) there is
        nothing to poll, and nothing to refuse.
        """
        if self._closed:
            return
        self._live_worker().set_expect(bool(flag))

    def _deliver_notifs(self, notifs: dict[str, list[bytes]]) -> None:
        for agent_name, messages in notifs.items():
            for message in messages:
                self.notifications += 1
                handler = self._handler
                if handler is None:
                    self.notifications_dropped += 1
                    log.warning("notification from %s dropped: no handler", agent_name)
                    continue
                try:
                    handler(agent_name, bytes(message))
                except Exception:
                    log.exception("notification handler failed for %s", agent_name)
