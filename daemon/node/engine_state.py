"""An engine attached to this node, as the node's parts see it.

The engines module (daemon/node/engines.py) owns the table of them; the
windows, the integrity checks, the transfers and the peers read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from daemon.dataplane.memory import MappedRegion, OffloadPool
from daemon.dataplane.vram import VramRegion
from schemas.kvlayout import EngineSpec, MemoryNote, RegionSpec, RemoteEngine

Region = MappedRegion | VramRegion


class EngineSession(Protocol):
    """What the node needs from an engine's connection (see engine_server.Session)."""

    uid: int
    gid: int
    pid: int

    @property
    def descriptors(self) -> tuple[int, ...]:
        """Descriptors the connection's Hello carried (memory passed by SCM_RIGHTS)."""
        ...

    def send_event(self, event: Any) -> None: ...


@dataclass
class EngineState:
    spec: EngineSpec
    regions: dict[str, Region]  # VRAM: GPU KV caches (daemon/dataplane/vram.py)
    remote: RemoteEngine
    session: EngineSession | None
    offload: OffloadPool | None = None
    offload_region: MappedRegion | None = None
    offload_spec: RegionSpec | None = None
    live: int = 0
    # The engine's word on its memory: its KV cache itself or a mirror, and why.
    note: MemoryNote = field(default_factory=MemoryNote)
