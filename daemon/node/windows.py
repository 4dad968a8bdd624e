"""Per-peer windows onto the engines' memory, and fencing by revoking them.

Each peer writes through its own window: a separate mapping of every engine
region, registered with NIXL, whose addresses only that peer is told (in its
Hello and in ``Engines`` updates). To fence a dead peer the receiver revokes
its windows (daemon/dataplane/window.py), so a late write with the old
descriptors faults instead of landing; only then may the blocks it could
write be handed back (ARCHITECTURE.md, invariant 2). A peer linked on demand
(not configured) has windows only while its link is up: opened when it links
(:meth:`Windows.rewindow` from its peer_up), fenced like any other when it
goes, and not reopened until it links again.

This module owns which windows are open (per engine, per peer); it reads the
engines' memory and learns who the peers are from the peer port.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING

import structlog

from daemon.dataplane.plane import DataPlane, DataPlaneError
from daemon.node.lifecycle import Lifecycle
from daemon.node.peerport import PeerPort
from schemas import peer as pm
from schemas.kvlayout import RemoteEngine

if TYPE_CHECKING:
    from daemon.node.engine_state import EngineState

log = structlog.get_logger("kvpushd.node")


class Windows:
    def __init__(
        self,
        *,
        node: str,
        dataplane: DataPlane,
        port: PeerPort,
        engines: Mapping[str, EngineState],
        life: Lifecycle,
        boot_id: str = "",
    ) -> None:
        self._node = node
        self._boot_id = boot_id
        self._dataplane = dataplane
        self._port = port
        self._engines = engines
        self._life = life
        self.metadata = b""
        # engine id -> peer -> that engine seen through that peer's window.
        self._open: dict[str, dict[str, RemoteEngine]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, peer: str) -> asyncio.Lock:
        # One fence or window opening per peer at a time, so a window is
        # never opened and revoked out of order.
        return self._locks.setdefault(peer, asyncio.Lock())

    async def open_for_all_peers(self, engine: EngineState) -> None:
        """A newly registered engine's windows: one per configured peer and per linked one."""
        opened = self._open.setdefault(engine.spec.engine_id, {})
        for peer in self._port.window_peers():
            async with self._lock(peer):
                opened[peer] = await self._dataplane.open_windows(peer, engine.spec, engine.regions)

    def forget(self, engine_id: str) -> None:
        """An engine left (or never finished registering): no peer is told of its windows."""
        self._open.pop(engine_id, None)

    def lacks(self, peer: str) -> bool:
        """Whether some registered engine has no window for ``peer`` yet."""
        return any(peer not in self._open.get(e, {}) for e in self._engines)

    def hello(self, peer: str) -> pm.Hello:
        """What this node says first on a link to ``peer``: who it is, and the windows it opened."""
        return pm.Hello(
            node=self._node,
            boot_id=self._boot_id,
            agent_name=self._dataplane.agent_name,
            agent_metadata=self.metadata,
            engines=self.view(peer),
        )

    def view(self, peer: str) -> tuple[RemoteEngine, ...]:
        # Never the engines' own mapping: a peer only learns its windows.
        seen = (self._open.get(engine_id, {}).get(peer) for engine_id in self._engines)
        return tuple(w for w in seen if w is not None)

    def engines_message(self, peer: str) -> pm.Engines:
        return pm.Engines(self.view(peer), self.metadata)

    async def load_metadata(self) -> None:
        self.metadata = await self._dataplane.metadata()

    async def announce(self) -> None:
        """Fresh metadata (it carries the registrations), then each connected peer its view."""
        if self._port.manager is None:
            return
        self.metadata = await self._dataplane.metadata()
        for info in self._port.links():
            if info.up:
                self._port.tell(info.node, self.engines_message(info.node))

    async def revoke(self, peer: str) -> None:
        """Revoke ``peer``'s windows: a write it posts from now on faults instead of landing.

        Whatever state it is in (frozen, partitioned, or thawing with an old
        descriptor list). Part of a fence (daemon/node/peers.py,
        :meth:`Peers.fence`); :meth:`rewindow` then gives it fresh windows.
        """
        if self._life.closing:
            return
        async with self._lock(peer):
            for opened in self._open.values():
                opened.pop(peer, None)  # no Hello may name them any more
            try:
                revoked = await self._dataplane.revoke_windows(peer)
            except DataPlaneError:
                if self._life.closing:
                    return  # closed under us
                raise
        log.info("peer fenced", node=self._node, peer=peer, windows_revoked=revoked)

    async def rewindow(self, peer: str) -> None:
        """Fresh windows for a fenced peer's next link (after its requests were failed).

        Also opens an on-demand peer's windows once it links. A peer on demand
        that is not linked (any more) gets none: it may never come back.
        """
        port = self._port
        if self._life.closing or not port.wants_windows(peer):
            return
        async with self._lock(peer):
            if not port.wants_windows(peer):
                return  # an on-demand peer went while a fence held the lock
            for engine_id, engine in list(self._engines.items()):
                opened = self._open.get(engine_id)
                if opened is None or peer in opened or self._engines.get(engine_id) is not engine:
                    continue  # still registering, opened meanwhile, or detached
                try:
                    opened[peer] = await self._dataplane.open_windows(
                        peer, engine.spec, engine.regions
                    )
                except DataPlaneError as exc:
                    # Leaving this engine out of what the peer is told is safe:
                    # requests for it fail as unknown to the peer.
                    log.warning("no new window", peer=peer, engine=engine_id, error=str(exc))
            try:
                self.metadata = await self._dataplane.metadata()
            except DataPlaneError:
                if self._life.closing:
                    return
                raise
        # If it is already back on a new link, that link's Hello named no
        # windows (or ones opened since): tell it the current ones.
        port.tell(peer, self.engines_message(peer))
