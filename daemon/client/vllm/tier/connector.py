"""``KvpushdOffloadingConnector``: vLLM's OffloadingConnector on the node's tier.

vLLM's own connector with two things added, both needed to never serve a
wrong chunk:

- a load whose slot is not what was committed ends as load errors
  (``get_block_ids_with_load_errors``: vLLM recomputes those blocks or
  fails the request, as ``kv_load_failure_policy`` says), because vLLM's
  offloading worker asserts that every job succeeded and a failed job
  would take the engine down;
- the worker's spec learns what the engine's KV is (the fingerprint the
  KvpushdConnector would register, with its weights digest, vLLM's block
  hash algorithm and chain seed) before vLLM registers its caches: the
  namespace the engine's chunks are shared in.

An instance with LoRA adapters is refused at start-up: vLLM's block hash
names an adapter by its name and path, not by what it holds, so two
engines (or one restarted) whose adapter was rewritten in place would
share keys for different KV.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from daemon.client.vllm.identity import instance_fingerprint, with_weights
from daemon.client.vllm.tier.copier import TierWorker
from daemon.client.vllm.tier.geometry import chain_seed
from daemon.client.vllm.tier.spec import KvpushdOffloadingSpec, TierUnsupported

log = logging.getLogger(f"vllm.{__name__}")

SPEC = {"spec_name": "KvpushdOffloadingSpec", "spec_module_path": "daemon.client.vllm.tier"}


class KvpushdOffloadingConnector(OffloadingConnector):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any
    ) -> None:
        if getattr(vllm_config, "lora_config", None) is not None:
            raise TierUnsupported(
                "the kvpushd offload tier does not serve LoRA instances: vLLM's block "
                "hash names an adapter by its name and path, not by what it holds"
            )
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        for name, value in SPEC.items():
            extra.setdefault(name, value)
        transfer.kv_connector_extra_config = extra
        super().__init__(vllm_config, role, kv_cache_config)
        worker = self.connector_worker
        if worker is not None:
            spec = worker.spec
            assert isinstance(spec, KvpushdOffloadingSpec), spec
            instance = with_weights(instance_fingerprint(vllm_config, extra, kv_cache_config))
            hash_algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
            spec.identity = (instance, hash_algo, chain_seed(hash_algo))

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.connector_worker
        tier = None if worker is None else worker.worker
        if isinstance(tier, TierWorker):
            return tier.take_load_errors()
        return set()
