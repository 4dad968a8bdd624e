"""The engine client library: what an engine imports to talk to its daemon.

Imports only ``schemas`` and ``daemon.framing`` (pinned by tests/test_layout.py),
so an engine process never loads the runtime, NIXL or torch through it.
"""

from daemon.client.blocking import BlockingEngineClient
from daemon.client.engine_client import EngineClient
from daemon.client.errors import (
    CallTimeout,
    ClientError,
    ConnectionLost,
    DaemonUnreachable,
    ProtocolError,
    RequestTooLarge,
    RpcError,
)
from daemon.client.kvfile import KvFileError
from daemon.client.memfd import create_kv_memfd

__all__ = [
    "BlockingEngineClient",
    "CallTimeout",
    "ClientError",
    "ConnectionLost",
    "DaemonUnreachable",
    "EngineClient",
    "KvFileError",
    "ProtocolError",
    "RequestTooLarge",
    "RpcError",
    "create_kv_memfd",
]
