"""The one way any part of the node reaches a peer daemon: its link.

The peer links (daemon/node/peerlink.py) come up after the node has
replayed its journal, so the port starts empty and the service attaches the
manager once it is bound; until then every peer is down and nothing is
sent. Which peers are configured is known from the start: windows are
opened for them whether their link is up or not (daemon/node/windows.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from daemon.node.peerauth import PeerUnreachable
from daemon.node.peerlink import LinkInfo, PeerManager
from schemas import peer as pm
from schemas.reasons import Reason
from statemachine import Refusal


class PeerPort:
    def __init__(self, configured: Iterable[str]) -> None:
        self.configured = tuple(configured)
        self.manager: PeerManager | None = None

    def attach(self, manager: PeerManager) -> None:
        self.manager = manager

    def tell(self, node: str, message: pm.PeerMessage) -> bool:
        """Queue ``message`` on ``node``'s link; False if it is not up."""
        manager = self.manager
        return manager is not None and bool(manager.send(node, message))

    def is_up(self, node: str) -> bool:
        manager = self.manager
        return manager is not None and manager.is_up(node)

    def is_configured(self, node: str) -> bool:
        return node in self.configured

    def wants_windows(self, node: str) -> bool:
        """Whether ``node`` should have windows here: configured, or linked now."""
        return self.is_configured(node) or self.is_up(node)

    def window_peers(self) -> list[str]:
        """The peers a newly registered engine opens windows for."""
        manager = self.manager
        linked = [i.node for i in manager.links if i.on_demand and i.up] if manager else []
        return [*self.configured, *linked]

    def links(self) -> tuple[LinkInfo, ...]:
        return self.manager.links if self.manager is not None else ()

    def close(self, node: str, reason: str, message: str) -> None:
        """Close ``node``'s link, if there is one (a fence: nothing more from it)."""
        link = self.manager.link(node) if self.manager is not None else None
        if link is not None:
            link.close(reason, message)

    async def connect(self, node: str, address: str) -> None:
        """Link to ``node`` at ``address``; ``Refusal(peer_unreachable)`` if none comes up."""
        if self.manager is None:
            raise Refusal(
                Reason.PEER_UNREACHABLE,
                f"peer {node!r} at {address}: this daemon has no peer link "
                "(no listen address, peers or secret_file)",
            )
        try:
            await self.manager.connect(node, address)
        except PeerUnreachable as exc:
            raise Refusal(Reason.PEER_UNREACHABLE, str(exc)) from None
