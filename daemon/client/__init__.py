"""The engine client library: what an engine imports to talk to its daemon.

Imports only ``schemas`` and ``daemon.framing`` (pinned by tests/test_layout.py),
so an engine process never loads the runtime, NIXL or torch through it.
"""

from daemon.client.engine_client import (
    BlockingEngineClient,
    CallTimeout,
    ClientError,
    ConnectionLost,
    EngineClient,
    ProtocolError,
    RequestTooLarge,
    RpcError,
)

__all__ = [
    "BlockingEngineClient",
    "CallTimeout",
    "ClientError",
    "ConnectionLost",
    "EngineClient",
    "ProtocolError",
    "RequestTooLarge",
    "RpcError",
]
