"""``KvpushdOffloadingSpec``: vLLM's offloading spec for the node's tier.

vLLM builds it once in the scheduler's process (``get_manager``) and once in
each worker's (``get_worker``); the two share nothing but the daemon and
the holder name, the engine's tier client id (vLLM's engine id, distinct
per data-parallel engine), under which the daemon grants, leases and
commits. The worker attaches to the pool first (``attach_pool``: the
daemon's memfd passed over the socket) and binds the holder to its
namespace (daemon/client/vllm/tier/geometry.py): the scheduler's calls name
only the holder, so the two sides can never disagree on it.

Settings (``kv_connector_extra_config``): ``socket`` (the node's daemon,
required), ``credits`` (slots granted ahead for stores, 16: a few steps'
stores; slots granted and not yet written hold no content, so an engine
that holds many leaves the pool less to keep), and vLLM's own
``block_size`` / ``blocks_per_chunk`` (tokens per offloaded chunk).
"""

from __future__ import annotations

import logging
from typing import Final

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from daemon.client.vllm.tier.copier import TierWorker
from daemon.client.vllm.tier.geometry import ChunkGeometry, namespace
from daemon.client.vllm.tier.manager import TierManager
from schemas.fingerprint import Fingerprint

log = logging.getLogger(f"vllm.{__name__}")

DEFAULT_CREDITS: Final = 16


class TierUnsupported(ValueError):
    """An instance the tier cannot serve right: vLLM stops at start-up with why."""


class KvpushdOffloadingSpec(OffloadingSpec):
    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        socket_path = self.extra_config.get("socket")
        if not socket_path:
            raise TierUnsupported("KvpushdOffloadingSpec needs kv_connector_extra_config.socket")
        if config.parallel.world_size != 1:
            # One slot holds one worker's whole chunk: ranks' shares of a chunk
            # are not written or committed together yet.
            raise TierUnsupported(
                "the kvpushd offload tier serves one-worker instances only "
                f"(this one has {config.parallel.world_size} workers)"
            )
        self.socket = str(socket_path)
        self.holder = f"vllm:{config.engine_id}"
        self.credits = int(self.extra_config.get("credits", DEFAULT_CREDITS))
        # What the engine's KV is (fingerprint, hash algorithm, chain seed):
        # set by KvpushdOffloadingConnector before vLLM registers its caches.
        self.identity: tuple[Fingerprint, str, str] | None = None
        self.namespace = ""
        self._manager: TierManager | None = None
        self._worker: TierWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = TierManager(self.socket, self.holder, self.credits)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is not None:
            return self._worker
        if self.identity is None:
            raise TierUnsupported(
                "KvpushdOffloadingSpec runs under KvpushdOffloadingConnector "
                '(kv_connector "KvpushdOffloadingConnector", kv_connector_module_path '
                '"daemon.client.vllm.tier"): it names the engine\'s namespace'
            )
        geometry = self.geometry(kv_caches)
        fingerprint, hash_algo, seed = self.identity
        self.namespace = namespace(fingerprint, geometry, hash_algo, seed)
        log.info("kvpushd tier: %s stores in namespace %s", self.holder, self.namespace)
        self._worker = TierWorker(kv_caches, geometry, self.socket, self.holder, self.namespace)
        return self._worker

    def geometry(self, kv_caches: CanonicalKVCaches) -> ChunkGeometry:
        return ChunkGeometry(
            blocks_per_chunk=int(self.blocks_per_chunk),
            tokens_per_hash=int(self.tokens_per_hash),
            pages=tuple(
                tuple(int(ref.page_size_bytes) for ref in refs)
                for refs in kv_caches.group_data_refs
            ),
            kv_cache_layout=str(self.config.kv_cache_layout or ""),
        )
