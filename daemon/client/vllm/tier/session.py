"""The tier's connections to the daemon: the connector's link, and what a connection means.

The tier's calls name their holder (the engine's tier client id), so a new
connection registers no engine. Two things matter to the tier: a daemon
that is gone voids the grants and leases it held (``on_gone``: a
restarted daemon holds none, daemon/node/offload.py), and a new
connection may be to a new daemon, which knows nothing of the holder's
namespace and may hold another pool (``on_connect``: the worker attaches
again, which binds the namespace and maps the pool).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from daemon.client.engine_client import EngineClient
from daemon.client.vllm.link import Link
from schemas import rpc


class TierSession:
    """What a tier link's connections mean; both callbacks run on the loop thread."""

    descriptors: tuple[int, ...] = ()

    def __init__(
        self,
        on_gone: Callable[[], None] | None = None,
        on_connect: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._on_gone = on_gone
        self._on_connect = on_connect

    async def register(self, client: EngineClient) -> None:
        if self._on_connect is not None:
            await self._on_connect()

    def on_event(self, event: rpc.Event, client: EngineClient) -> None:
        return None  # the tier's calls are answered, never told

    def lived(self, client: EngineClient) -> None:
        return None  # the daemon lived: its grants and leases hold

    def gone(self, generation: int) -> None:
        if self._on_gone is not None:
            self._on_gone()


def tier_link(
    socket_path: str,
    holder: str,
    on_gone: Callable[[], None] | None = None,
    on_connect: Callable[[], Awaitable[None]] | None = None,
) -> Link:
    """A started link to the daemon at ``socket_path`` for ``holder``'s calls."""
    link = Link(socket_path, holder, TierSession(on_gone, on_connect))
    link.start()
    return link
