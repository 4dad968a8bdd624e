"""KvpushdConnector: the facade vLLM calls, and nothing else.

vLLM builds the connector in its scheduler and in each worker; this class
derives what both share (the instance's fingerprint, its KV cache groups)
and hands each call to the side it belongs to: daemon/client/vllm/scheduler.py
decides, daemon/client/vllm/worker.py talks to memory and to the daemon.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from daemon.client.vllm import stats as vs
from daemon.client.vllm.adapters import adapter_key
from daemon.client.vllm.guard import Swallowed, bound
from daemon.client.vllm.identity import instance_fingerprint, with_weights
from daemon.client.vllm.inputs import counts_inputs
from daemon.client.vllm.kvcheck import KvCheckSettings, tolerance_for, values_dtype
from daemon.client.vllm.layout import (
    check_supported,
    group_states,
    group_windows,
    mla_rope_warning,
)
from daemon.client.vllm.metadata import KvpushdConnectorMetadata
from daemon.client.vllm.scheduler import HOLD_EVERY_S, SchedulerSide
from daemon.client.vllm.sharedmemory import kv_memory
from daemon.client.vllm.staging import SHARED, kv_buffer
from daemon.client.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvpushdConnector", "KvpushdConnectorMetadata"]

log = logging.getLogger(f"vllm.{__name__}")


class KvpushdConnector(KVConnectorBase_V1, SupportsHMA):
    """What vLLM calls: each call goes to the side this process runs (scheduler or worker)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: Any = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # Before anything else: a layout the connector cannot pair stops vLLM here.
        check_supported(vllm_config, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._node = str(extra.get("node", ""))
        self._address = str(extra.get("address", ""))
        self._block_size = vllm_config.cache_config.block_size
        # What produced this instance's KV: the same on the scheduler and the worker.
        self._fingerprint = instance_fingerprint(vllm_config, extra, kv_cache_config)
        # identity = false (a test switch): no up-front rope or weights
        # digest, so the behavioural check (kv_check) is seen alone.
        self._identity = _switch(extra, "identity")
        if not self._identity:
            self._fingerprint = msgspec.structs.replace(self._fingerprint, rope="")
        # Each KV cache group's sliding window in tokens (0: full attention),
        # and which hold recurrent state (Mamba/SSM) instead of token positions.
        self._windows = group_windows(kv_cache_config)
        self._states = group_states(kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role is KVConnectorRole.SCHEDULER:
            # Once per instance (its one scheduler): where vLLM itself computes wrong.
            rope_warning = mla_rope_warning(vllm_config)
            if rope_warning is not None:
                log.warning(rope_warning)
            self._scheduler = SchedulerSide(
                self._node,
                self._address,
                self._block_size,
                self._fingerprint,
                self._windows,
                hold_every_s=float(extra.get("hold_every_s", HOLD_EVERY_S)),
                states=self._states,
            )
            self._scheduler.counts_inputs = counts_inputs(vllm_config)
        else:
            socket_path = extra.get("socket")
            if not socket_path:
                raise ValueError("KvpushdConnector needs kv_connector_extra_config.socket")
            tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
            rank = _tp_rank() if tp_size > 1 else 0
            pp_size = int(vllm_config.parallel_config.pipeline_parallel_size)
            stage = _pp_rank() if pp_size > 1 else 0
            # One engine per rank: each rank's worker holds its own share of the heads.
            engine_id = str(extra.get("engine_id") or f"vllm-{self._node or 'node'}-{os.getpid()}")
            if pp_size > 1:
                engine_id += f"-pp{stage}"
            if tp_size > 1:
                engine_id += f"-tp{rank}"
            # Each KV cache group's layers (None: vLLM names no groups, one group).
            groups = getattr(kv_cache_config, "kv_cache_groups", None)
            device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
            self._worker = WorkerSide(
                str(socket_path),
                engine_id,
                # The engine registers with its rank's weights digest too.
                with_weights(self._fingerprint) if self._identity else self._fingerprint,
                rank,
                tp_size,
                stage,
                pp_size,
                group_layers=tuple(tuple(g.layer_names) for g in groups) if groups else None,
                buffer=kv_buffer(extra.get("kv_buffer"), str(device or "cpu")),
                memory=kv_memory(extra.get("kv_memory")),
                num_blocks=getattr(kv_cache_config, "num_blocks", None),
                states=self._states,
                kv_check=_kv_check(vllm_config, extra, len(groups) if groups else 1),
            )

    # ------------------------------------------------------------- scheduler

    # Each call vLLM's scheduler makes goes through guard.py: nothing a
    # request sends, and no error of the connector's, reaches vLLM.

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        with Swallowed(self._scheduler, "on_new_request", request):
            bound(request, self._scheduler)  # first: the params vLLM pickles, bounded
            # An adapter's digest is read when the instance first sees it, as
            # its worker loads it: every request, P/D or not (adapters.py).
            adapter_key(request)
            self._scheduler.new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        with Swallowed(self._scheduler, "get_num_new_matched_tokens", request):
            return self._scheduler.matched_tokens(request, num_computed_tokens)
        return 0, False

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # With recurrent state a load moves the request's own blocks of every
        # group, state groups included (vLLM's default names the prefix-
        # cacheable ones); attention-only models keep vLLM's default.
        groups = getattr(self._kv_cache_config, "transfer_group_ids", None)
        if groups is None or not any(self._states):
            return super().get_loaded_kv_cache_group_ids(request)
        return tuple(groups)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        with Swallowed(self._scheduler, "update_state_after_alloc", request) as swallowed:
            self._scheduler.after_alloc(request, blocks, num_external_tokens)
        if swallowed.caught and num_external_tokens > 0:
            # vLLM waits for this load: it ends failed, and vLLM recomputes it.
            self._scheduler.unload(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        with Swallowed(self._scheduler, "build_connector_meta"):
            return self._scheduler.take_metadata(scheduler_output)
        return self._scheduler.salvage()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        with Swallowed(self._scheduler, "request_finished", request):
            return self._scheduler.finished(request, block_ids)
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            with Swallowed(self._scheduler, "update_connector_output"):
                self._scheduler.sent(
                    connector_output.finished_sending or (),
                    connector_output.finished_recving or (),
                    connector_output.failed_recving or (),
                )

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.pushing()

    # ----------------------------------------------------------------- stats

    def get_kv_connector_stats(self) -> vs.KvpushdStats | None:
        side = self._scheduler or self._worker
        assert side is not None
        return side.stats.take()

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        # Another instance's accelerator or host memory, over the daemons' link.
        return {CacheHitSource.P2P: num_external_tokens} if num_external_tokens else {}

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> vs.KvpushdStats:
        return vs.KvpushdStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> vs.KvpushdPromMetrics:
        return vs.KvpushdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---------------------------------------------------------------- worker

    def get_mem_pool_context(self) -> contextlib.AbstractContextManager[Any] | None:
        assert self._worker is not None
        # Host staging: vLLM allocates its cache as it always does.
        return self._worker.shared_allocation() if self._worker.buffer == SHARED else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvpushdConnectorMetadata)
        self._worker.post(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the data lands between steps

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # the daemon pushes whole requests once they finish

    def wait_for_save(self) -> None:
        # After the forward: each load whose last prompt token it computed is
        # checked against what the prefill pushed there (kvcheck.py).
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvpushdConnectorMetadata)
        try:
            self._worker.check_loads(metadata)
        except Exception as exc:  # never into vLLM's step: the load goes unchecked
            log.error("kvpushd: checking this step's loads failed: %r", exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Failed loads go by request (failed_recving), never as block ids:
        # vLLM's scheduler takes block-level load errors only for a model
        # with one KV cache group, and kills its engine core otherwise.
        assert self._worker is not None
        sending, receiving, failed = self._worker.finished(finished_req_ids)
        return KVConnectorTransferResults(sending, receiving, failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


# ---------------------------------------------------------------- scheduler


def _switch(extra: dict[str, Any], name: str) -> bool:
    """A connector setting that is on unless it says false (``false``, ``0``, ``off``)."""
    return str(extra.get(name, True)).lower() not in ("false", "0", "off")


def _kv_check(
    vllm_config: VllmConfig, extra: dict[str, Any], groups: int
) -> KvCheckSettings | None:
    """How this instance checks its loads by behaviour (``kv_check = false``: not at all).

    ``kv_check_tolerance`` overrides the measured tolerance of its KV dtype.
    """
    if not _switch(extra, "kv_check"):
        return None
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    model_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    tolerance = extra.get("kv_check_tolerance")
    return KvCheckSettings(
        float(tolerance) if tolerance is not None else tolerance_for(cache_dtype, model_dtype),
        values_dtype(cache_dtype),
        one_group=groups <= 1,
    )


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _pp_rank() -> int:
    from vllm.distributed.parallel_state import get_pp_group

    return int(get_pp_group().rank_in_group)
