"""The node's KV offload tier for vLLM: chunks stored in the daemon's pool, found by content.

Loaded the out-of-tree way, alone on a plain instance::

    --kv-transfer-config '{"kv_connector": "KvpushdOffloadingConnector",
        "kv_connector_module_path": "daemon.client.vllm.tier",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/run/kvpushd/NODE.sock",
                                      "block_size": 32}}'

The parts: ``connector.py`` (vLLM's OffloadingConnector, with load errors
and the engine's identity), ``spec.py`` (the OffloadingSpec vLLM loads:
``KvpushdOffloadingSpec``), ``manager.py`` (the scheduler side: lookups
as leases, stores on slots granted ahead), ``copier.py`` (the worker side:
copies and digests), ``jobs.py`` (what the scheduler hands the worker),
``geometry.py`` (pure: where a chunk lies in a slot, the namespace),
``session.py`` (the tier's link to the daemon). The names are exported on
first use, so ``geometry`` imports without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvpushdOffloadingConnector", "KvpushdOffloadingSpec"]


def __getattr__(name: str) -> Any:
    if name == "KvpushdOffloadingConnector":
        from daemon.client.vllm.tier.connector import KvpushdOffloadingConnector

        return KvpushdOffloadingConnector
    if name == "KvpushdOffloadingSpec":
        from daemon.client.vllm.tier.spec import KvpushdOffloadingSpec

        return KvpushdOffloadingSpec
    raise AttributeError(name)
