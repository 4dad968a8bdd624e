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
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

import structlog

from daemon.dataplane.plane import DataPlaneError
from schemas import peer as pm
from schemas.kvlayout import RemoteEngine

if TYPE_CHECKING:
    from daemon.node.engines import EngineState
    from daemon.node.runtime import Node

log = structlog.get_logger("kvpushd.node")


class Windows:
    def __init__(self, node: Node) -> None:
        self.node = node
        self.metadata = b""
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, peer: str) -> asyncio.Lock:
        # One fence or window opening per peer at a time, so a window is
        # never opened and revoked out of order.
        return self._locks.setdefault(peer, asyncio.Lock())

    async def open_for_all_peers(self, engine: EngineState) -> None:
        """A newly registered engine's windows: one per configured peer and per linked one."""
        for peer in self.node.peers.window_peers():
            async with self._lock(peer):
                engine.windows[peer] = await self.node.dataplane.open_windows(
                    peer, engine.spec, engine.regions
                )

    def view(self, peer: str) -> tuple[RemoteEngine, ...]:
        # Never the engines' own mapping: a peer only learns its windows.
        engines = self.node.engines.by_id.values()
        return tuple(e.windows[peer] for e in engines if peer in e.windows)

    def engines_message(self, peer: str) -> pm.Engines:
        return pm.Engines(self.view(peer), self.metadata)

    async def load_metadata(self) -> None:
        self.metadata = await self.node.dataplane.metadata()

    async def announce(self) -> None:
        """Fresh metadata (it carries the registrations), then each connected peer its view."""
        links = self.node.links
        if links is None:
            return
        self.metadata = await self.node.dataplane.metadata()
        for info in links.links:
            if info.up:
                links.send(info.node, self.engines_message(info.node))

    async def fence(self, node: str) -> None:
        """Make sure nothing more moves between ``node`` and this daemon's memory.

        Forgets its agent (nothing more is posted to it) and revokes its
        windows (a write it posts from now on faults instead of landing,
        whatever state it is in: frozen, partitioned, or thawing with an old
        descriptor list). Only after this may the blocks it could write be
        handed back; :meth:`rewindow` then gives it fresh windows.
        """
        own = self.node
        if own.closing:
            return
        state = own.peers.states.get(node)
        if state is not None and state.agent_name:
            with contextlib.suppress(Exception):
                await own.dataplane.remove_remote_agent(state.agent_name)
            state.agent_name = ""
        async with self._lock(node):
            for engine in own.engines.by_id.values():
                engine.windows.pop(node, None)  # no Hello may name them any more
            try:
                revoked = await own.dataplane.revoke_windows(node)
            except DataPlaneError:
                if own.closing:
                    return  # closed under us
                raise
        log.info("peer fenced", node=own.config.node, peer=node, windows_revoked=revoked)

    async def rewindow(self, node: str) -> None:
        """Fresh windows for a fenced peer's next link (after its requests were failed).

        Also opens an on-demand peer's windows once it links. A peer on demand
        that is not linked (any more) gets none: it may never come back.
        """
        own = self.node
        if own.closing or not own.peers.wants_windows(node):
            return
        async with self._lock(node):
            if not own.peers.wants_windows(node):
                return  # an on-demand peer went while a fence held the lock
            for engine in list(own.engines.by_id.values()):
                if (
                    node in engine.windows
                    or own.engines.by_id.get(engine.spec.engine_id) is not engine
                ):
                    continue  # opened meanwhile by its registration, or detached
                try:
                    engine.windows[node] = await own.dataplane.open_windows(
                        node, engine.spec, engine.regions
                    )
                except DataPlaneError as exc:
                    # Leaving this engine out of what the peer is told is safe:
                    # requests for it fail as unknown to the peer.
                    log.warning(
                        "no new window", peer=node, engine=engine.spec.engine_id, error=str(exc)
                    )
            try:
                self.metadata = await own.dataplane.metadata()
            except DataPlaneError:
                if own.closing:
                    return
                raise
        # If it is already back on a new link, that link's Hello named no
        # windows (or ones opened since): tell it the current ones.
        own.peers.tell_peer(node, self.engines_message(node))
