"""What this node knows of a peer daemon's NIXL side: its agent and its engines.

Written by the peers module (daemon/node/peers.py) as Hellos and ``Engines``
messages arrive and when a fence forgets the agent; read by the transfers
(daemon/node/transfers.py) to post a WRITE and by ``kvpushd status``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.kvlayout import RemoteEngine


@dataclass
class PeerState:
    agent_name: str = ""
    boot_id: str = ""
    engines: dict[str, RemoteEngine] = field(default_factory=dict)
