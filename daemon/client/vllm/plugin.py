"""vLLM's general plugin (entry point ``vllm.general_plugins``): kvpushd's connectors by name.

vLLM loads a connector named by ``kv_connector_module_path`` in the
processes that build one, but its API server rebuilds a connector's
metrics by the connector's name alone (``MultiConnector``'s stats), which
only the factory's registry knows. vLLM runs this in every one of its
processes, so both connectors are known by name everywhere.
"""

from __future__ import annotations

from typing import Final

CONNECTORS: Final = (
    ("KvpushdConnector", "daemon.client.vllm.connector"),
    ("KvpushdOffloadingConnector", "daemon.client.vllm.tier.connector"),
)


def register() -> None:
    """Name kvpushd's connectors in vLLM's factory (a second call changes nothing)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, module in CONNECTORS:
        try:
            KVConnectorFactory.register_connector(name, module, name)
        except ValueError:  # registered already: vLLM loads plugins once per process, or more
            continue
