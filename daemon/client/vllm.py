"""KvpushdConnector: vLLM's KV cache moved by kvpushd (a vLLM V1 KV connector).

Loaded the out-of-tree way::

    --kv-transfer-config '{"kv_connector": "KvpushdConnector",
        "kv_connector_module_path": "daemon.client.vllm",
        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
        "kv_connector_extra_config": {"socket": "/run/kvpushd/NODE.sock",
                                      "node": "NODE", "address": "HOST:PORT"}}'

``socket`` is this node's daemon; ``node`` and ``address`` name that daemon
to a decode instance (they travel in ``kv_transfer_params``).

vLLM runs a connector twice: in the scheduler (decides) and in each worker
(talks to memory). Only the worker talks to the daemon: the daemon ties an
engine's requests to the connection that registered the engine, and the
worker is the one that owns the KV memory. The scheduler hands the worker
what to register through the per-step connector metadata; the worker reports
back through ``get_transfer_results`` (failed loads by request id). No call
on vLLM's step path waits for the daemon: requests go out on a background
thread, and events come back through a queue drained once per step.

- Prefill (``do_remote_decode``): when the request finishes, its blocks stay
  allocated (``delay_free``) and the worker registers a pusher request with
  the blocks that cover the prompt (never those of tokens generated after
  it) and says the KV is ready; ``blocks_freeable`` (or a failure)
  ends the send and the blocks go back to vLLM.
- Decode (``do_remote_prefill``): the prompt's tokens are external and load
  asynchronously; after allocation the worker registers a receiver with the
  blocks vLLM still has to fill (not those its own prefix cache already
  holds: the daemon's tail trim pairs them with the prefill's last blocks).
  ``kv_arrived`` ends the load; a failure ends it as a failed receive
  (``failed_recving``, the form vLLM takes for any number of KV cache
  groups), so vLLM's ``kv_load_failure_policy`` applies.
- Right blocks only: both sides name each block with its content hash
  (vLLM's own chained prefix-cache hash, daemon/client/vllm_hashes.py); the
  prefill daemon writes a decode block only from the prefill block of
  equal hash at the position the tail trim pairs, and refuses the transfer
  (``content_mismatch``, naming the first block) otherwise.
- Same model only: the engine registers with a fingerprint of what makes
  its KV interchangeable (daemon/client/vllm_layout.py), and the prefill's
  ``kv_transfer_params`` carry it; a decode instance whose fingerprint
  differs reports no external tokens (it computes the prompt) and sends an
  empty receiver, which the prefill daemon refuses as
  ``fingerprint_mismatch`` and so ends the push at once.
- Same prompt only: the params carry the prompt's length and digest; a
  decode request whose prompt differs computes it. One request per
  transfer: a second request with the same params (a retry) computes its
  prompt, and a second live prefill request with the same router
  ``transfer_id`` pushes nothing (the first push goes on). A prefill
  request that ended by abort pushes nothing.
- Shapes: TP ranks (each prefill rank's share is its own daemon request,
  statemachine/ranks.py), and one group per vLLM KV cache group
  (``SupportsHMA``: full attention and sliding window; a sliding-window
  group moves only its blocks inside the window, vllm_hashes.prompt_blocks).
  Equal TP sizes pair rank to rank; a prefill with k times the decode's ranks writes each decode
  rank's blocks from k prefill ranks, each into the head slice that holds
  its heads (a slice engine over the same memory), and the decode rank's
  load ends only when every one has landed (any failure fails the load
  once all are released). A decode with more ranks than the prefill
  computes the prompt. Pipeline stages pair the same way by their layers
  (``T@pp<s>`` shares, layer-slice engines). Each DP engine is an engine of
  its own; context parallel is refused when vLLM builds the connector
  (``check_supported``).
- Recurrent state (Mamba/SSM groups, TP 1, prefix caching off): the prefill
  computes the prompt but its last token (``new_request``) and pushes each
  Mamba layer's one state block beside the attention blocks; the decode
  loads N-1 tokens and applies the last one itself, so the state takes it
  once (docs/mamba-on-vllm-cpu.md).
- No daemon yet: vLLM starts anyway and serves without remote KV (its
  pushes and loads end at once) until the daemon is up, then registers.
- Memory: ``get_mem_pool_context`` makes vLLM's one KV buffer a /dev/shm file
  the daemon maps; ``register_kv_caches`` derives the layout (blocks, layers,
  block bytes) from vLLM's tensors and registers the engine. The file keeps
  its name while vLLM runs (a restarted daemon maps it again) and goes at
  shutdown; one left by a vLLM killed with SIGKILL is removed by the next
  connector that starts on the machine (the owner holds a lock on it for its
  life, daemon/client/kvfile.py, so a live one is never removed).
- Daemon restarts: the worker notices the connection end at once and
  reconnects with backoff, registering the engine again. A lost connection
  is not an answer: what it held ends (sends: blocks back to vLLM; loads:
  load errors) only once its daemon is known gone (nobody listens on the
  socket, or another daemon process answers: its boot id differs). When the
  same daemon answers, it lived: it says again what became of each
  transfer, calls whose answers were lost are asked again, and no block
  goes back while a write can still touch it. Calls that register or say
  kv_ready wait as long as the connection lives (no time limit).

This module and its stats (daemon/client/vllm_stats.py) are the only ones
of kvpushd that import vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import torch
import vllm
from torch.overrides import TorchFunctionMode
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from daemon import failpoints
from daemon.client import vllm_stats as vs
from daemon.client.engine_client import EngineClient
from daemon.client.errors import ClientError, DaemonUnreachable, RpcError
from daemon.client.kvfile import create_kv_file, sweep_stale_kv_files
from daemon.client.vllm_hashes import (
    NotOneRun,
    block_hashes,
    ids_of,
    prompt_block_count,
    prompt_blocks,
    unhashed_prompt_blocks,
)
from daemon.client.vllm_hashes import content as block_content
from daemon.client.vllm_layout import (
    Blocks,
    check_supported,
    fingerprint,
    group_states,
    group_windows,
    prompt_backoff,
    prompt_digest,
    rank_count,
    rank_fingerprint,
    rank_map_problem,
    slice_fingerprint,
    split_pp,
    split_tp,
    window_gap,
)
from daemon.client.vllm_staging import (
    SHARED,
    Copy,
    Staging,
    StagingError,
    block_major,
    kv_buffer,
)
from schemas import rpc
from schemas.fingerprint import Fingerprint
from schemas.kvlayout import GroupSpec, LayerSpec, RegionSpec
from schemas.layout import GroupKind, Role
from schemas.reasons import Reason
from statemachine.fingerprint import first_difference
from statemachine.ranks import (
    HeadSource,
    HeadTarget,
    UnmappableRanks,
    forgone_sources,
    head_sources,
    head_targets,
    share_id,
    stage_layers,
    stage_sources,
    stage_targets,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's logger tree: vLLM prints only that tree (its "vllm" logger
# does not propagate), so the connector's lines reach vLLM's log this way.
log = logging.getLogger(f"vllm.{__name__}")

SHM_DIR = "/dev/shm"
SHM_PREFIX = "kvpushd-vllm-"
# Reconnecting to a daemon that went away: first try soon, then back off.
RECONNECT_FIRST_S = 0.2
RECONNECT_MAX_S = 2.0
# A decode request queued for blocks holds the prefill's push this often
# (kv_connector_extra_config.hold_every_s); the prefill daemon's registered
# deadline must be longer.
HOLD_EVERY_S = 5.0
# The daemon's reply to a registration waits for its fsync: bounded, not short.
CALL_TIMEOUT_S = 30.0
# Registrations and kv_ready wait as long as the connection lives: a slow
# daemon (a stalled fdatasync) may have taken the call, and only its answer,
# or its end, says so.
_UNTIL_ANSWERED = math.inf
# Finished request ids remembered until their send ends (pruned past this many).
_MAX_SEEN = 65536
# What two instances' fingerprints may differ in and still pair: where each
# rank sits (the rank map pairs their heads, and each engine's own
# fingerprint names its heads for the daemon to check).
_ACROSS_RANKS = ("tp_size", "pp_size", "kv_head_range", "layer_range")
# A decode leg sent at once with the prefill's, as the connector took it
# (_adopt_dispatch): the prefill's sizes the router named.
CONCURRENT = "kvpushd_concurrent"
SOURCE_TP, SOURCE_PP = "kvpushd_source_tp", "kvpushd_source_pp"
_MAX_TRANSFER_ID = 200
# In the prefill's answer: the TP and PP sizes its shares are named by.
TP_SPLIT = "kvpushd_split_tp"
PP_SPLIT = "kvpushd_split_pp"
# The content of a pusher that pushes nothing, before why (statemachine/content.py
# takes any content that is not block hashes as a name both sides must share).
NOT_PUSHED = "not pushed: "
# How a prefill request must have ended for its KV to be pushed: its prompt
# was computed (it stopped, or hit its length). An abort pushes nothing.
_COMPUTED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED})


@dataclass(frozen=True)
class PushSpec:
    """A finished prefill request whose blocks the daemon pushes.

    ``split_tp``/``split_pp``: the TP and PP sizes naming the shares (the
    decode's when this instance splits its push for a decode with more
    ranks or stages; 0: its own).
    ``engine_id``: the engine (this rank's, or a head slice of it) the
    worker registers the pusher on; "" until the worker chose.
    """

    request_id: str
    transfer_id: str
    block_ids: Blocks  # per KV cache group; () for none in any
    split_tp: int = 0
    split_pp: int = 0
    engine_id: str = ""
    content: str = ""  # the prompt's digest: the daemon pairs only equal ones


@dataclass(frozen=True)
class ReceiveSpec:
    """A decode request waiting for its prompt's KV in ``block_ids``.

    ``source_ranks``: the prefill instance's TP size (from its fingerprint),
    which names its ranks' shares of the transfer. ``paired``: the two
    instances' KV pairs (each decode rank ends its own sources' pushes);
    False: rank 0 ends every prefill rank's push (the prefill daemon refuses
    the pairing). ``engine_id``: the engine (this rank's, or a head slice of
    it) the worker registers the receiver on; "" until the worker chose.
    """

    request_id: str
    transfer_id: str
    block_ids: Blocks  # per KV cache group; () for none in any
    peer: str
    peer_address: str
    source_ranks: int = 1
    paired: bool = True
    engine_id: str = ""
    source_stages: int = 1  # the prefill's pipeline stages, as source_ranks
    # The TP size naming the prefill's shares: source_ranks, or this
    # instance's when the prefill split its push for it (0: source_ranks).
    split_tp: int = 0
    content: str = ""  # this request's prompt digest: the daemon pairs only equal ones

    @property
    def shares_tp(self) -> int:
        """The TP size the prefill's shares of this transfer are named by."""
        return self.split_tp or self.source_ranks


class _Source(NamedTuple):
    """A prefill rank a decode rank loads from: its stage, and its heads' slice."""

    stage: int
    heads: HeadSource


@dataclass
class _Load:
    """A decode request's load the worker waits for (vLLM's thread).

    One daemon receiver per prefill rank that feeds this rank (``shares``).
    It ends when every share has landed, or, once one failed, when every
    share is settled: arrived, or released by the daemon (no write can
    reach the blocks any more). Then, and only then, vLLM gets the blocks.
    """

    request_id: str
    blocks: Blocks  # per group, for host staging's copy
    nbytes: int  # the KV it loads, for the stats
    generation: int  # the daemon connection it was posted under
    posted_at: float  # time.monotonic(), for its time in the stats
    shares: tuple[str, ...]
    pending: set[str] = field(default_factory=set)  # no outcome yet
    holding: set[str] = field(default_factory=set)  # a write may still reach the blocks
    failed: bool = False

    def __post_init__(self) -> None:
        self.pending = set(self.shares)
        self.holding = set(self.shares)


@dataclass(frozen=True)
class Freed:
    """The daemon released a receiver whose load failed: its blocks are vLLM's again."""

    request_id: str


@dataclass(frozen=True)
class GaveUp:
    """A transfer the daemon will never report on (refused, or the daemon is gone)."""

    request_id: str
    reason: str
    message: str


@dataclass(frozen=True)
class DaemonLost:
    """The connection of ``generation`` ended: what it held will never be reported on."""

    generation: int


@dataclass
class KvpushdConnectorMetadata(KVConnectorMetadata):
    push: list[PushSpec] = field(default_factory=list)
    receive: list[ReceiveSpec] = field(default_factory=list)
    # Decode requests vLLM finished (aborted) while their KV was loading.
    abort: list[str] = field(default_factory=list)
    # Decode requests vLLM finished before giving them blocks: nothing loads.
    forgo: list[ReceiveSpec] = field(default_factory=list)
    # Decode requests still queued for blocks: the prefill's push must wait.
    hold: list[ReceiveSpec] = field(default_factory=list)
    # Prefill requests a router named a transfer for that push nothing.
    unpushed: list[PushSpec] = field(default_factory=list)


class KvpushdConnector(KVConnectorBase_V1, SupportsHMA):
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
        self._fingerprint = fingerprint(
            vllm_config,
            vllm.__version__,
            str(extra.get("model_id") or ""),
            kv_cache_config,
            attention_isa=_attention_isa(vllm_config),
        )
        # Each KV cache group's sliding window in tokens (0: full attention),
        # and which hold recurrent state (Mamba/SSM) instead of token positions.
        self._windows = group_windows(kv_cache_config)
        self._states = group_states(kv_cache_config)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(
                self._node,
                self._address,
                self._block_size,
                self._fingerprint,
                self._windows,
                hold_every_s=float(extra.get("hold_every_s", HOLD_EVERY_S)),
                states=self._states,
            )
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
            self._worker = _WorkerSide(
                str(socket_path),
                engine_id,
                self._fingerprint,
                rank,
                tp_size,
                stage,
                pp_size,
                group_layers=tuple(tuple(g.layer_names) for g in groups) if groups else None,
                buffer=kv_buffer(extra.get("kv_buffer"), str(device or "cpu")),
                num_blocks=getattr(kv_cache_config, "num_blocks", None),
                states=self._states,
            )

    # ------------------------------------------------------------- scheduler

    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

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
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.take_metadata()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.sent(
                connector_output.finished_sending or (), connector_output.finished_recving or ()
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
        return

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


class _SchedulerSide:
    def __init__(
        self,
        node: str,
        address: str,
        block_size: int,
        fingerprint: Fingerprint,
        windows: tuple[int, ...] = (0,),
        *,
        hold_every_s: float = HOLD_EVERY_S,
        states: tuple[bool, ...] = (),
    ) -> None:
        self._node = node
        self._windows = windows
        self._states = states or (False,) * len(windows)
        # Prompt tokens the decode computes itself (1 with recurrent state),
        # and the prefill requests whose prompt was cut by as many (bounded).
        # By request, not in kv_transfer_params: vLLM's parallel sampling
        # (n > 1) shallow-copies the parent's params, so an in-process engine
        # sees one params dict for every child.
        self._backoff = prompt_backoff(self._states)
        self._cut: dict[str, None] = {}
        self._hold_every_s = hold_every_s
        # Transfer id -> when its push was last held (time.monotonic()), for
        # the requests queued for blocks (bounded).
        self._held: dict[str, float] = {}
        self._address = address
        self._block_size = block_size
        self._fingerprint = fingerprint
        self._sent_fingerprint = msgspec.to_builtins(fingerprint)
        self._pending = KvpushdConnectorMetadata()
        # Live pushes: request id -> its transfer id, and back (one live
        # push per transfer id).
        self._pushing: dict[str, str] = {}
        self._push_owners: dict[str, str] = {}
        self._loading: set[str] = set()
        # Transfer ids a receiver was registered for, oldest first (bounded).
        self._received: dict[str, None] = {}
        # Transfer id -> the one request that may load it (bounded): a second
        # request with the same params (a retry, a hedge) computes its prompt.
        self._claims: dict[str, str] = {}
        self.stats = vs.KvpushdStats()

    def new_request(self, request: Request) -> None:
        """A prefill request of a model with recurrent state computes its prompt but the last token.

        The decode applies that token to the state itself; a state that had
        taken it on the prefill too would take it twice (the first token
        differed on 8 of 8 prompts, docs/mamba-on-vllm-cpu.md). Cut once
        (vLLM calls this when a request is added, not when a preempted one
        resumes), never to no token, and not for a request that reads no
        prefix (prompt logprobs: the decode computes its whole prompt). The
        prefill's own answer is then one token, of the shorter prompt (as
        with vLLM's NixlConnector): routers answer from the decode.
        """
        params = request.kv_transfer_params
        if not self._backoff or not params or not params.get("do_remote_decode"):
            return
        prompt = request.prompt_token_ids
        if request.request_id in self._cut or prompt is None or len(prompt) <= self._backoff:
            return
        if getattr(request, "get_skip_reading_prefix_cache", lambda: False)():
            return
        del prompt[-self._backoff :]
        del request._all_token_ids[-self._backoff :]
        request.num_prompt_tokens -= self._backoff
        request.max_tokens = 1
        _remember(self._cut, request.request_id, None)

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        if not params.get("kvpushd_transfer_id") and "transfer_id" in params:
            unusable = _adopt_dispatch(params)
            if unusable is not None:
                self._compute_here(request, params, (vs.PARAMS, unusable))
                return 0, False
        if not params.get("kvpushd_transfer_id"):
            return 0, False
        transfer_id = str(params["kvpushd_transfer_id"])
        owner = self._claims.get(transfer_id)
        if owner == request.request_id:
            # Checked when it claimed the transfer (vLLM asks again every step
            # the request waits for blocks; the prompt's digest is not free).
            # Still waiting: the prefill's push must wait too.
            self._hold(transfer_id, request, params)
            return self._external_tokens(request, num_computed_tokens)
        if owner is not None:
            # The transfer is the other request's: nothing of it is this one's to end.
            self._compute_here(
                request, params, (vs.DUPLICATE, f"transfer {transfer_id} is loaded by {owner}")
            )
            return 0, False
        why = self._why_not(request, params)
        if why is not None:
            # Never KV from other weights, another layout or another prompt:
            # this instance computes the prompt. A receiver with no block still
            # goes out, so the prefill's daemon ends the push now (its pairing
            # check refuses a fingerprint mismatch, and both journals name the
            # field) instead of at its deadline.
            self._compute_here(request, params, why)
            if self._first_time(transfer_id):
                paired = why[0] != vs.FINGERPRINT
                self._pending.forgo.append(
                    _receive_spec(request.request_id, params, (), paired=paired)
                )
            return 0, False
        _remember(self._claims, transfer_id, request.request_id)
        return self._external_tokens(request, num_computed_tokens)

    def _hold(self, transfer_id: str, request: Request, params: dict[str, Any]) -> None:
        """Keep the prefill's push of a transfer waiting while this request queues for blocks.

        Sent at most every ``hold_every_s`` (each hold lengthens the push's
        wait by the prefill daemon's ``registered`` deadline, which must be
        longer), and bounded there by its ``[deadlines] held``.
        """
        now = time.monotonic()
        last = self._held.get(transfer_id)
        if last is not None and now - last < self._hold_every_s:
            return
        _remember(self._held, transfer_id, now)
        self._pending.hold.append(_receive_spec(request.request_id, params, ()))

    def _external_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        count = self._loaded_len(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _loaded_len(self, request: Request) -> int:
        """The prompt tokens a decode loads: all, or all but those it computes (state)."""
        return max(len(request.prompt_token_ids or ()) - self._backoff, 0)

    def _compute_here(self, request: Request, params: dict[str, Any], why: tuple[str, str]) -> None:
        kind, message = why
        log.warning("kvpushd: %s: %s: computing the prompt here", request.request_id, message)
        self.stats.not_loaded(kind)
        params["do_remote_prefill"] = False

    def _why_not(self, request: Request, params: dict[str, Any]) -> tuple[str, str] | None:
        """Why the prefill's KV (as ``params`` describe it) is not this request's, or None.

        (What kind of reason, for the stats; what happened, for the log.)
        """
        gap = window_gap(len(request.prompt_token_ids or ()), self._block_size, self._windows)
        if gap is not None:
            return vs.WINDOW, (
                f"the prefill no longer holds the first token of the last prompt token's "
                f"{gap}-token sliding window (it starts a block vLLM freed)"
            )
        if request.prompt_token_ids is not None and self._loaded_len(request) == 0:
            return vs.PROMPT, (
                f"a prompt of {len(request.prompt_token_ids)} token(s) on a model with "
                f"recurrent state: the decode computes its last token itself, and no state "
                f"of the tokens before it exists"
            )
        if params.get(CONCURRENT):
            # Both legs at once: the prefill has not answered, so there is no
            # fingerprint or prompt digest to compare here. The daemon checks
            # both at the pairing (the engines' fingerprints, the content
            # each side registers); this side checks only that the ranks map.
            sizes = {"tp_size": params[SOURCE_TP], "pp_size": params[SOURCE_PP]}
            sent_shape = msgspec.structs.replace(self._fingerprint, **sizes)
            unmappable = rank_map_problem(sent_shape, self._fingerprint)
            if unmappable is not None:
                return vs.FINGERPRINT, f"the two instances' ranks do not pair: {unmappable}"
            return None
        try:
            sent = msgspec.convert(params.get("kvpushd_fingerprint"), Fingerprint)
        except msgspec.ValidationError as exc:
            return vs.FINGERPRINT, f"the prefill's KV fingerprint is missing or unreadable ({exc})"
        difference = first_difference(sent, self._fingerprint, ignore=_ACROSS_RANKS)
        if difference is not None:
            field_name, theirs, ours = difference
            return vs.FINGERPRINT, (
                f"the prefill's KV fingerprint differs in {field_name} (prefill {theirs!r}, "
                f"this instance {ours!r})"
            )
        unmappable = rank_map_problem(
            sent, self._fingerprint, _split_of(params, TP_SPLIT), _split_of(params, PP_SPLIT)
        )
        if unmappable is not None:
            return vs.FINGERPRINT, f"the two instances' ranks do not pair: {unmappable}"
        prompt = request.prompt_token_ids
        if prompt is None:
            return vs.PROMPT, "the request has no prompt token ids to compare with the prefill's"
        # With recurrent state the prefill computed all but the last token.
        loaded = self._loaded_len(request)
        if params.get("kvpushd_prompt_len") != loaded:
            return vs.PROMPT, (
                f"the prefill computed a prompt of {params.get('kvpushd_prompt_len')!r} tokens, "
                f"this request loads {loaded} of its {len(prompt)}"
            )
        if params.get("kvpushd_prompt_digest") != prompt_digest(prompt[:loaded]):
            return vs.PROMPT, "the prefill computed another prompt of the same length"
        return None

    def after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or num_external_tokens <= 0:
            return
        # Only once: the second call (after the load) must not register again.
        params["do_remote_prefill"] = False
        loaded = self._loaded_len(request)
        count = prompt_block_count(loaded, self._block_size)
        try:
            named = unhashed_prompt_blocks(blocks.blocks, count, self._states)
            hashes = block_hashes(request, self._block_size, count, loaded)
            content = block_content(named, hashes, self._states)
        except NotOneRun as exc:
            # Never reached with vLLM's allocator (hits and nulls are a
            # prefix); if it were, the daemon refuses the pairing, the load
            # fails and vLLM computes the prompt.
            log.error("kvpushd: %s: %s", request.request_id, exc)
            named = tuple((0, tuple(ids)) for ids in blocks.get_unhashed_block_ids_all_groups())
            content = f"unpaired: {exc}"
        self._first_time(str(params["kvpushd_transfer_id"]))
        self._held.pop(str(params["kvpushd_transfer_id"]), None)
        self._loading.add(request.request_id)
        self._pending.receive.append(
            _receive_spec(request.request_id, params, ids_of(named), content=content)
        )

    def finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        cut = request.request_id in self._cut
        self._cut.pop(request.request_id, None)
        if request.request_id in self._loading:
            # Finished while loading (an abort): vLLM keeps its blocks until the
            # worker reports the load over, which it does once the daemon
            # released them; the daemon is told to give the transfer up.
            self._loading.discard(request.request_id)
            self._pending.abort.append(request.request_id)
            return False, None
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and params.get("kvpushd_transfer_id"):
            # Finished before vLLM gave it blocks (aborted while waiting, or
            # the pre-aborted copy vLLM's API server submits when a client
            # goes away): a receiver with no block lets the prefill's daemon
            # end its push now (nothing is written) instead of at its deadline.
            # Once per transfer: the copy also comes for a request that loaded.
            params["do_remote_prefill"] = False
            if self._first_time(str(params["kvpushd_transfer_id"])):
                self._pending.forgo.append(_receive_spec(request.request_id, params, ()))
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if not any(block_ids) or request.status not in _COMPUTED:
            # Aborted, or ended before its prompt was computed: nobody needs
            # its KV, and its blocks go back to vLLM now.
            self.stats.not_loaded(vs.NOT_NEEDED)
            self._not_pushing(request, params, f"the prefill request ended {request.status.name}")
            return False, None
        if request.prompt_token_ids is None:
            self._not_pushing(request, params, "the prompt has no token ids (prompt embeddings)")
            return False, None
        if self._backoff and not cut:
            # Its state took the whole prompt: a decode would apply the last
            # token twice. It computes the prompt instead.
            log.warning("kvpushd: %s: whole prompt computed: not pushed", request.request_id)
            self._not_pushing(
                request, params, "the prefill computed the whole prompt into its recurrent state"
            )
            return False, None
        # A router dispatching both legs at once names the transfer itself.
        transfer_id = _router_transfer_id(params) or request.request_id
        owner = self._push_owners.get(transfer_id)
        if owner is not None:
            # One live push per transfer id: a router's retry, or a client's
            # own id used twice. This request pushes nothing (its blocks go
            # back now); the first push goes on untouched.
            log.warning(
                "kvpushd: %s: transfer %s is already pushed by %s: not pushed",
                request.request_id,
                transfer_id,
                owner,
            )
            self.stats.not_loaded(vs.DUPLICATE)
            return False, None
        digest = prompt_digest(request.prompt_token_ids)
        # Exactly the prompt's blocks, whatever was computed beyond it, each
        # named with its content hash (daemon/client/vllm_hashes.py).
        count = prompt_block_count(len(request.prompt_token_ids), self._block_size)
        try:
            named = prompt_blocks(block_ids, self._windows, count, self._states)
        except NotOneRun as exc:
            log.error("kvpushd: %s: %s: not pushed", request.request_id, exc)
            self._not_pushing(request, params, str(exc))
            return False, None
        if failpoints.corrupts("connector.shift_push"):
            # The negative control: the push names one block less at its end,
            # so the tail trim pairs every decode block with the block before
            # its own; the block hashes must refuse it before any write.
            named = tuple((first, ids[:-1]) for first, ids in named)
        content = block_content(named, block_hashes(request, self._block_size, count), self._states)
        # A decode with more TP ranks or stages, named by the router: each
        # rank pushes one share per decode rank (and stage) it feeds
        # (statemachine/ranks.py).
        by_tp, by_pp = self._splits(params)
        self._pending.push.append(
            PushSpec(
                request.request_id,
                transfer_id,
                ids_of(named),
                split_tp=by_tp,
                split_pp=by_pp,
                content=content,
            )
        )
        self._pushing[request.request_id] = transfer_id
        self._push_owners[transfer_id] = request.request_id
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "kvpushd_transfer_id": transfer_id,
            "kvpushd_node": self._node,
            "kvpushd_address": self._address,
            "kvpushd_fingerprint": self._sent_fingerprint,
            TP_SPLIT: by_tp,
            PP_SPLIT: by_pp,
            # Which prompt the KV is of: the decode side checks it is its own.
            "kvpushd_prompt_len": len(request.prompt_token_ids),
            "kvpushd_prompt_digest": digest,
        }

    def _splits(self, params: dict[str, Any]) -> tuple[int, int]:
        """The decode's TP and PP sizes this instance splits its push for (0: its own)."""
        return (
            split_tp(self._fingerprint, params.get("kvpushd_decode_tp")),
            split_pp(self._fingerprint, params.get("kvpushd_decode_pp")),
        )

    def _not_pushing(self, request: Request, params: dict[str, Any], why: str) -> None:
        """Say at once that a transfer a router named will not be pushed.

        A decode leg sent at the same time may already wait for it: a pusher
        with no block, whose content says why, makes the prefill daemon
        refuse that receiver now (``content_mismatch``, naming why) instead
        of at its ``registered`` deadline. A transfer named by the prefill
        (prefill-first) has no decode waiting: nothing is said.
        """
        transfer_id = _router_transfer_id(params)
        if transfer_id is None or transfer_id in self._push_owners:
            return
        by_tp, by_pp = self._splits(params)
        self._pending.unpushed.append(
            PushSpec(
                request.request_id,
                transfer_id,
                (),
                split_tp=by_tp,
                split_pp=by_pp,
                content=f"{NOT_PUSHED}{why}",
            )
        )

    def _first_time(self, transfer_id: str) -> bool:
        """Note a receiving transfer; False if it was noted before."""
        if transfer_id in self._received:
            return False
        _remember(self._received, transfer_id, None)
        return True

    def take_metadata(self) -> KvpushdConnectorMetadata:
        metadata, self._pending = self._pending, KvpushdConnectorMetadata()
        return metadata

    def sent(self, request_ids: Any, received: Any) -> None:
        for request_id in request_ids:
            transfer_id = self._pushing.pop(request_id, None)
            if transfer_id is not None and self._push_owners.get(transfer_id) == request_id:
                del self._push_owners[transfer_id]
        self._loading.difference_update(received)

    def pushing(self) -> bool:
        return bool(self._pushing)


def _remember(memory: dict[str, Any], key: str, value: Any) -> None:
    """Note ``key`` in a memory bounded to _MAX_SEEN entries (the oldest go first)."""
    memory[key] = value
    if len(memory) > _MAX_SEEN:
        del memory[next(iter(memory))]


def _split_of(params: dict[str, Any], key: str) -> int | None:
    """The TP or PP size the prefill named its shares by (None: unsaid or unreadable, its own)."""
    return rank_count(params.get(key))


def _router_transfer_id(params: dict[str, Any]) -> str | None:
    """The transfer id a router named on a leg (``transfer_id``), if it is a usable one."""
    named = params.get("transfer_id")
    if isinstance(named, str) and 0 < len(named) <= _MAX_TRANSFER_ID and "@" not in named:
        return named
    return None


def _adopt_dispatch(params: dict[str, Any]) -> str | None:
    """Take a decode leg sent at once with the prefill's (vLLM's push-mode proxy).

    It names the transfer (``transfer_id``), the prefill daemon's node
    (``remote_engine_id``) and peer address (``remote_host``,
    ``remote_port``), and the prefill's TP and PP sizes; no block ids. In
    place, it becomes the kvpushd fields the rest reads. Returns why not,
    if the leg is not usable.
    """
    transfer_id = _router_transfer_id(params)
    node, host, port = (params.get(k) for k in ("remote_engine_id", "remote_host", "remote_port"))
    if transfer_id is None:
        return f"the router's transfer_id {params.get('transfer_id')!r} is not usable"
    if not isinstance(node, str) or not node or not isinstance(host, str) or not host:
        return "the router named no prefill node (remote_engine_id) or address (remote_host)"
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return f"the router named no usable prefill port (remote_port {port!r})"
    params.update(
        {
            "kvpushd_transfer_id": transfer_id,
            "kvpushd_node": node,
            "kvpushd_address": f"{host}:{port}",
            CONCURRENT: True,
            SOURCE_TP: rank_count(params.get("tp_size")) or 1,
            SOURCE_PP: rank_count(params.get("pp_size")) or 1,
        }
    )
    return None


def _receive_spec(
    request_id: str,
    params: dict[str, Any],
    block_ids: Blocks,
    *,
    paired: bool = True,
    content: str = "",
) -> ReceiveSpec:
    sent = params.get("kvpushd_fingerprint")
    if params.get(CONCURRENT):
        ranks, stages = params[SOURCE_TP], params[SOURCE_PP]
    else:
        sizes = [sent.get(k, 1) if isinstance(sent, dict) else 1 for k in ("tp_size", "pp_size")]
        ranks, stages = (rank_count(n) or 1 for n in sizes)
    return ReceiveSpec(
        request_id,
        str(params["kvpushd_transfer_id"]),
        block_ids,
        str(params["kvpushd_node"]),
        str(params.get("kvpushd_address", "")),
        ranks,
        paired=paired,
        # Shares split for this instance's stages look like a prefill of its PP.
        source_stages=_split_of(params, PP_SPLIT) or stages,
        split_tp=_split_of(params, TP_SPLIT) or ranks,
        content=content,
    )


def _attention_isa(vllm_config: VllmConfig) -> str:
    """The kernel family vLLM's CPU attention lays this instance's blocks out for ("": not CPU).

    The CPU kernels write a block's keys dimension-major (``[head_size,
    block_size]`` per head) in the "vec" kernels, and in tiles of their own
    in others ("amx" for bfloat16 where the CPU has AMX): two hosts of one
    model and block size can hold the same KV in different bytes.
    """
    model = vllm_config.model_config
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
    if device != "cpu" or getattr(model, "use_mla", False):
        return ""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:  # a vLLM without it: the layout is named by the rest alone
        return ""
    cache = vllm_config.cache_config
    return str(
        _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)
    )


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _pp_rank() -> int:
    from vllm.distributed.parallel_state import get_pp_group

    return int(get_pp_group().rank_in_group)


def _holds_run(layer_ids: list[int], first: int, end: int) -> bool:
    """Whether the layers [first, end) are one run of ``layer_ids`` (in that order)."""
    if first not in layer_ids:
        return False
    start = layer_ids.index(first)
    return layer_ids[start : start + end - first] == list(range(first, end))


def _layer_indices(names: Any) -> list[int] | None:
    """The model's layer index of each KV cache layer name, or None if a name has none."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return [int(extract_layer_index(name)) for name in names]
    except (AssertionError, ValueError):
        return None


# ------------------------------------------------------------------- worker


class _SharedAllocation(TorchFunctionMode):
    """Turns vLLM's one flat int8 KV allocation into a /dev/shm file the daemon maps."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.buffer: torch.Tensor | None = None
        # Holds the file's lock for the process's life (daemon/client/kvfile.py).
        self.lock_fd: int | None = None

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if (
            func is torch.zeros
            and self.buffer is None
            and kwargs.get("dtype") is torch.int8
            and len(args) == 1
            and isinstance(args[0], int)
            and torch.device(kwargs.get("device", "cpu")).type == "cpu"
        ):
            size = args[0]
            self.lock_fd = create_kv_file(self.path, size)
            self.buffer = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.int8)
            return self.buffer
        return func(*args, **kwargs)


class _WorkerSide:
    def __init__(
        self,
        socket_path: str,
        engine_id: str,
        fingerprint: Fingerprint,
        rank: int = 0,
        tp_size: int = 1,
        stage: int = 0,
        pp_size: int = 1,
        *,
        group_layers: tuple[tuple[str, ...], ...] | None = None,
        buffer: str = SHARED,
        num_blocks: int | None = None,
        states: tuple[bool, ...] = (False,),
    ) -> None:
        self._socket = socket_path
        # Which KV cache groups hold recurrent state (Mamba/SSM), in group order.
        self._states = states
        # vLLM's block count (None: not told), to find each tensor's block dimension.
        self._num_blocks = num_blocks
        # Where the daemon reads and writes: vLLM's cache itself (shared), or
        # a host mirror of it (host staging, daemon/client/vllm_staging.py).
        self.buffer = buffer
        self._staging: Staging | None = None
        # Landed loads whose blocks still go mirror -> cache, and the copies
        # under way with the loads they end (vLLM's thread).
        self._to_stage_in: list[_Load] = []
        self._staging_in: list[tuple[Copy, list[str]]] = []
        # The layer names of each KV cache group (None: every layer, one group).
        self._group_layers = group_layers
        self._engine_id = engine_id
        # The instance's fingerprint; the engine's names the heads and layers this rank holds.
        self._instance = fingerprint
        self._fingerprint = rank_fingerprint(fingerprint, rank, stage)
        self._stage = stage
        self._pp_size = pp_size
        # The model layer index of each layer of the registered group, in order
        # (None: vLLM's layer names carry none, and no layer slice is possible).
        self._layer_ids: list[int] | None = None
        # This worker's TP rank: the daemon knows its share of a transfer by
        # the rank's own name (statemachine/ranks.py), paired with the same rank.
        self._rank = rank
        self._tp_size = tp_size
        # Head slices of this rank's blocks, one engine each, for a prefill
        # with more ranks than this instance: engine id -> (groups, fingerprint).
        # Registered when first needed and again on every new connection.
        self._slices: dict[str, tuple[tuple[GroupSpec, ...], Fingerprint]] = {}
        self._slices_registered: set[str] = set()  # on the current connection
        self._slice_lock = asyncio.Lock()
        # Whether vLLM's tensors are head-major ([blocks, heads, ...]): only
        # then is a range of heads one contiguous run of every block.
        self._head_major = False
        sweep_stale_kv_files(Path(SHM_DIR), SHM_PREFIX)
        # The pid in the name tells an operator whose file it is (the sweep
        # goes by the owner's lock, daemon/client/kvfile.py).
        self._path = Path(SHM_DIR) / f"{SHM_PREFIX}{os.getpid()}-{engine_id}"
        self._allocation: _SharedAllocation | None = None
        self._layout: tuple[tuple[GroupSpec, ...], RegionSpec] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvpushd-connector", daemon=True
        )
        self._thread.start()
        # Calls vLLM's thread hands the loop between two of the loop's turns
        # start in one turn, so the client sends them as one Batch frame
        # (schemas/rpc.py): one engine step's registrations, kv_readys and
        # releases, one frame (_spawn).
        self._spawn_lock = threading.Lock()
        self._to_spawn: list[Coroutine[Any, Any, None]] = []
        self._running: set[asyncio.Task[None]] = set()
        self._closing = False
        # The connection to the daemon and its generation: a transfer belongs
        # to the connection it was posted under and ends when that one ends.
        self._client: EngineClient | None = None
        self._generation = 0
        self._events: queue.SimpleQueue[rpc.Event | GaveUp | Freed | DaemonLost] = (
            queue.SimpleQueue()
        )
        # Daemon request (a share of a push) -> (vLLM request id, generation),
        # and each pushing request's shares not over yet.
        self._sending: dict[str, tuple[str, int]] = {}
        self._pushes: dict[str, set[str]] = {}
        # Daemon request (a prefill rank's share) -> the load it is part of.
        self._receiving: dict[str, _Load] = {}
        self._done_sending: set[str] = set()
        self._done_receiving: set[str] = set()
        self._finished_seen: set[str] = set()
        # Loads that ended without their KV (vLLM recomputes or fails them).
        self._failed_loads: set[str] = set()
        # Transfers registered on the current connection (the loop thread's).
        self._posted: set[str] = set()
        # Transfers whose release was asked and not yet answered (loop thread).
        self._releasing: set[str] = set()
        # Failed loads' releases that got no answer, asked again on a
        # reconnect to the same daemon (loop thread).
        self._unreleased: set[str] = set()
        # Receivers whose registration is not answered yet (loop thread).
        self._registering: dict[str, asyncio.Event] = {}
        # Transfers whose registration's answer a lost connection took (loop thread).
        self._unsure: dict[str, PushSpec | ReceiveSpec] = {}
        # Bytes of one block of each group, over all its layers (for the stats).
        self._group_nbytes: tuple[int, ...] = ()
        self.stats = vs.KvpushdStats()

    # memory -------------------------------------------------------------

    def shared_allocation(self) -> _SharedAllocation:
        self._allocation = _SharedAllocation(self._path)
        return self._allocation

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        on_gpu = sorted({t.device.type for t in kv_caches.values()} - {"cpu"})
        if on_gpu and self.buffer == SHARED:
            raise RuntimeError(
                f"KvpushdConnector: the KV cache is on {', '.join(on_gpu)}; kv_buffer = "
                "'shared' maps host-memory KV caches only: use kv_buffer = 'host'"
            )
        allocation = self._allocation
        if self.buffer == SHARED and (allocation is None or allocation.buffer is None):
            raise RuntimeError(
                "KvpushdConnector: vLLM did not allocate its KV cache through "
                "get_mem_pool_context(); the daemon cannot map it"
            )
        if any(self._states) and self.buffer != SHARED:
            raise RuntimeError(
                "KvpushdConnector: this model keeps Mamba/SSM state, which kv_buffer = "
                f"{self.buffer!r} does not carry: use kv_buffer = 'shared' (host-memory KV)"
            )
        self._layer_ids = _layer_indices(kv_caches)
        if self._group_layers is not None and len(self._group_layers) > 1:
            # Several groups (pipeline stages of 1, check_supported): no
            # share is ever a run of layers, so none is sliced by layer.
            self._layer_ids = None
        if self._layer_ids is not None:
            # In model order, so a stage's layers are one run of the group's.
            order = sorted(range(len(self._layer_ids)), key=self._layer_ids.__getitem__)
            names = list(kv_caches)
            kv_caches = {names[i]: kv_caches[names[i]] for i in order}
            self._layer_ids = sorted(self._layer_ids)
        if self._pp_size > 1 and self._layer_ids != list(range(*self._fingerprint.layer_range)):
            raise RuntimeError(
                f"KvpushdConnector: pipeline stage {self._stage} holds layers "
                f"{self._layer_ids}, not {self._fingerprint.layer_range} as vLLM's even split "
                "gives (VLLM_PP_LAYER_PARTITION is not supported): the other side could not "
                "tell which layers this stage's KV is of"
            )
        kv_caches, parts = block_major(kv_caches, self._num_blocks)
        if any(len(names) > 1 for names in parts.values()):
            # Keys and values are layers of their own: a layer slice is no run of them.
            self._layer_ids = None
        group_layers = tuple(
            tuple(part for name in names for part in parts[name])
            for names in self._group_layers or (tuple(parts),)
        )
        if self.buffer == SHARED:
            assert allocation is not None and allocation.buffer is not None
            buffer = allocation.buffer
        else:
            try:
                self._staging = Staging.create(kv_caches, group_layers, self._path)
            except StagingError as exc:
                raise RuntimeError(str(exc)) from exc
            # The daemon sees the mirror: same shapes, same offsets, its own file.
            kv_caches, buffer = self._staging.mirror, self._staging.buffer
        self._layout = _layout(kv_caches, group_layers, buffer, self._path, self._states)
        held = self._fingerprint.kv_head_range[1] - self._fingerprint.kv_head_range[0]
        self._head_major = all(t.dim() == 4 and t.shape[1] == held for t in kv_caches.values())
        groups, _ = self._layout
        self._group_nbytes = tuple(group.block_bytes * len(group.layers) for group in groups)
        # The file keeps its name while vLLM runs: a restarted daemon maps it
        # again when the connector registers anew.
        try:
            self._run(self._connect())
        except (ClientError, OSError) as exc:
            # vLLM serves without remote KV until its daemon is up (pushes
            # and loads end at once, as with a daemon that went away).
            log.warning(
                "kvpushd: no daemon at %s (%s): serving without remote KV until it is up",
                self._socket,
                exc,
            )
        self._spawn(self._supervise())

    async def _connect(self, lost: tuple[int, str] | None = None) -> None:
        """Connect and register the engine; ``lost``: (generation, boot id) of the connection
        that ended, whose daemon's fate this connection tells."""
        assert self._layout is not None
        groups, region = self._layout
        # The connection an event came on (resent outcomes come before the
        # registration's reply, while this connection is not yet the current one).
        came_on: list[EngineClient] = []
        client = await EngineClient.connect(
            self._socket,
            client_name=f"vllm:{self._engine_id}",
            on_event=lambda event: self._on_daemon_event(event, came_on[0]),
            queue_events=False,  # the callback is the only consumer
        )
        came_on.append(client)
        lived = lost is not None and bool(lost[1]) and client.boot_id == lost[1]
        if lost is not None and not lived:
            # Another daemon process: the one that held those transfers is
            # gone, and with it every NIXL operation it could still post.
            self._daemon_gone(lost[0])
        # The slices used before are registered again: a re-asked receiver
        # goes to the engine it was first registered on.
        self._slices_registered = set()
        try:
            await client.register_engine(
                self._engine_id, groups, (region,), fingerprint=self._fingerprint
            )
            for slice_id in list(self._slices):
                await self._register_slice(client, slice_id)
        except BaseException:
            await client.close()
            raise
        self._generation += 1
        self._client = client
        log.info("kvpushd: engine %s registered with %s", self._engine_id, self._socket)
        if lived:
            # The same daemon lived: its word on what it holds of ours came
            # again with the registration (live outcomes, releases); calls
            # whose answer the lost connection took are asked again.
            log.warning("kvpushd: the daemon at %s lived; its transfers go on", self._socket)
            for spec in list(self._unsure.values()):
                self._spawn(self._ask_again(spec, client))
            self._unsure.clear()
            for transfer_id in self._unreleased:
                self._spawn(self._release_then_free(transfer_id))
            self._unreleased.clear()

    async def _supervise(self) -> None:
        """Notice the daemon going away at once (not at the next step) and reconnect.

        What the lost connection held ends first (``DaemonLost``, in order
        before any event of the next connection); a restarted daemon then
        gets the engine registered again and serves new transfers.
        """
        lost: tuple[int, str] | None = None
        while not self._closing:
            client = self._client
            if client is not None:
                why = await client.wait_closed()
                if self._closing:
                    return
                log.warning("kvpushd: lost the daemon at %s: %s", self._socket, why)
                self._client = None
                # Not an answer: the daemon may live and still write (a
                # connection it closed, a reset). Its transfers end only once
                # it is known gone: nobody listens, or another process answers.
                lost = (self._generation, client.boot_id)
            delay = RECONNECT_FIRST_S
            while not self._closing:
                try:
                    await self._connect(lost)
                    lost = None
                    break
                except DaemonUnreachable as exc:
                    if lost is not None:
                        self._daemon_gone(lost[0])
                        lost = None
                    log.debug("kvpushd: reconnect to %s failed: %s", self._socket, exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RECONNECT_MAX_S)
                except (ClientError, OSError) as exc:
                    # A daemon that answers and refuses is worth an operator's look;
                    # one that is not back yet is not.
                    report = log.warning if isinstance(exc, RpcError) else log.debug
                    report("kvpushd: reconnect to %s failed: %s", self._socket, exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RECONNECT_MAX_S)

    def _daemon_gone(self, generation: int) -> None:
        """The daemon of connection ``generation`` is gone: end its transfers (loop thread)."""
        # What a restarted daemon resends about them is not ours to wait for.
        self._posted = set()
        self._releasing = set()
        self._unsure.clear()
        self._unreleased.clear()
        self._events.put(DaemonLost(generation))

    async def _ask_again(self, spec: PushSpec | ReceiveSpec, client: EngineClient) -> None:
        """A registration whose answer was lost with a connection to a daemon that lived.

        Asked again: accepted (the first never arrived), a duplicate (it did:
        its outcome comes as for any other), or stale (it did, and was
        released meanwhile: nothing holds its blocks).
        """
        transfer_id = spec.transfer_id
        if transfer_id not in self._sending and transfer_id not in self._receiving:
            # Its request ended meanwhile and vLLM may have given its blocks
            # to another: registering them again would name blocks that are
            # no longer this transfer's.
            return
        try:
            if isinstance(spec, PushSpec):
                with contextlib.suppress(RpcError):  # a duplicate: it is there
                    await self._register_pusher(spec, client)
                await client.kv_ready(transfer_id, timeout=_UNTIL_ANSWERED)
            else:
                await self._engine_ready(spec.engine_id)
                await self._register_receiver(spec, self._generation)
        except RpcError as exc:
            if exc.code == Reason.STALE_INCARNATION:
                self._gave_up(transfer_id, exc)
            # Otherwise it is there (a duplicate, a kv_ready already said):
            # its outcome comes from the daemon.
        except (ClientError, RuntimeError) as exc:
            self._unsure_of(spec, exc)

    def _unsure_of(self, spec: PushSpec | ReceiveSpec, exc: BaseException) -> None:
        """A call's answer was lost with its connection: wait for the daemon's word.

        (Loop thread.) Asked again if the same daemon answers a reconnect; ended
        if it is known gone.
        """
        log.warning(
            "kvpushd: %s: no answer from the daemon (%s); its blocks stay held until it is "
            "known gone or says what became of it",
            spec.transfer_id,
            exc,
        )
        self._unsure[spec.transfer_id] = spec

    def _on_daemon_event(self, event: rpc.Event, client: EngineClient) -> None:
        """An event from the daemon (on the connector's loop thread)."""
        transfer_id = event.request_id
        if transfer_id not in self._posted:
            if isinstance(event, rpc.KvArrived | rpc.BlocksFreeable | rpc.RequestFailed):
                # The outcome of a transfer vLLM no longer waits for (one a
                # restarted daemon resends after the old connection ended, or
                # a forgone receiver's): let the daemon drop it now (vLLM may
                # be idle, with no step to carry it out).
                self._spawn(self._release(transfer_id, client))
            return
        if isinstance(event, rpc.Released):
            self._posted.discard(transfer_id)
            self._releasing.discard(transfer_id)
        self._events.put(event)

    # per step -----------------------------------------------------------

    def post(self, metadata: KvpushdConnectorMetadata) -> None:
        generation = self._generation
        # Host staging: this step's finished prefills' blocks go to the
        # mirror in one batch, and each push waits for it before it registers.
        staged = Copy()
        if self._staging is not None and metadata.push:
            staged = self._staging.copy_out([push.block_ids for push in metadata.push])
            self.stats.staged("out", staged.nbytes)
        for push in metadata.push:
            shares = self._shares(push)
            if any(share.transfer_id in self._sending for share in shares):
                # Another live request pushes this transfer (the scheduler
                # lets only one; this guards its bounded memory): this one
                # pushes nothing, and the other's bookkeeping stays whole.
                log.warning(
                    "kvpushd: %s: transfer %s is already pushed by another request",
                    push.request_id,
                    push.transfer_id,
                )
                shares = []
            if not shares:
                # A replica no decode rank reads from: nothing reads its blocks.
                self._done_sending.add(push.request_id)
                continue
            self._pushes[push.request_id] = {share.transfer_id for share in shares}
            for share in shares:
                self._sending[share.transfer_id] = (push.request_id, generation)
                self._spawn(self._push(share, generation, staged))
        for receive in metadata.receive:
            self._start_load(receive, generation)
        if metadata.abort:
            self.abort(metadata.abort)
        for forgone in metadata.forgo:
            self._forgo_all(forgone, generation)
        for queued in metadata.hold:
            self._hold_all(queued)
        for unpushed in metadata.unpushed:
            for share in self._shares(unpushed):
                self._spawn(self._announce(share))

    def _shares(self, push: PushSpec) -> list[PushSpec]:
        """This rank's shares of a push, each on the engine (or slice) it is read from.

        One per (decode stage, decode rank) it feeds when it split its push
        for more of them; else its own one share.
        """
        split = push.split_tp or self._tp_size
        targets: tuple[HeadTarget, ...] = (HeadTarget(self._rank, 0, 1),)
        if split > self._tp_size:
            targets = head_targets(self._rank, self._tp_size, split, self._instance.num_kv_heads)
        stages, layers = push.split_pp or self._pp_size, self._instance.num_layers
        into: tuple[int, ...] = (self._stage,)
        if stages > self._pp_size:
            into = stage_targets(self._stage, self._pp_size, stages, layers)
        sliced = len(into) > 1 or any(target.slices > 1 for target in targets)
        # The negative control's planted mis-mapping: each decode rank's (and
        # stage's) share read from the next slice (the daemon must refuse it).
        swap = sliced and failpoints.corrupts("connector.swap_split")
        shares = []
        for i, stage in enumerate(into):
            held = stage_layers(into[(i + swap) % len(into)], stages, layers)
            for target in targets:
                share = share_id(push.transfer_id, target.share_rank, split, stage, stages)
                index = (target.slice_index + swap) % target.slices
                engine_id = self._source_engine(held, index, target.slices)
                shares.append(dataclasses.replace(push, transfer_id=share, engine_id=engine_id))
        return shares

    def _source_engine(self, layers: tuple[int, int], index: int, slices: int) -> str:
        """The engine a split share is read from: this rank's, or a slice of its blocks.

        "" where no slice is one run of each block (the cache is not
        head-major, or the layers are not one run of the group): the share
        is given up, and its decode rank's load fails at its deadline.
        """
        whole = layers == self._fingerprint.layer_range
        if slices == 1 and whole:
            return self._engine_id
        if slices > 1 and not self._head_major:
            return ""
        if not whole and not _holds_run(self._layer_ids or [], *layers):
            return ""
        return self._slice(layers, index, slices)

    def _start_load(self, receive: ReceiveSpec, generation: int) -> None:
        """Register one receiver per prefill rank that feeds this rank's blocks."""
        try:
            sources = self._sources(receive)
        except UnmappableRanks as exc:
            # The scheduler pairs only instances whose ranks map; this rank
            # cannot (its cache is not head-major, or its layers carry no
            # index): nothing is registered, so no write can reach the
            # blocks, and the load ends failed.
            log.warning("kvpushd: %s: %s", receive.request_id, exc)
            self._load_nothing(receive)
            return
        first = receive.block_ids[0] if receive.block_ids else ()
        if len(first) > 1 and failpoints.corrupts("connector.reverse_group"):
            # The negative control: the first group's KV lands misplaced (its
            # blocks named in reverse: each hash then names another's block).
            receive = dataclasses.replace(receive, block_ids=(first[::-1], *receive.block_ids[1:]))
        receive = self._maybe_swap_states(receive)
        # The negative control's planted mis-mapping: each prefill rank's
        # receiver on the next rank's head slice (the daemon must refuse it).
        sliced = any(source.heads.slices > 1 for source in sources)
        swap = sliced and failpoints.corrupts("connector.swap_slices")
        shares = [self._receiver(receive, source, swap=swap) for source in sources]
        if any(share.transfer_id in self._receiving for share in shares):
            # Another request loads this transfer (the scheduler lets only
            # one claim it; this guards its bounded memory): this one
            # registers nothing, so no write can reach its blocks, and its
            # load ends now, failed.
            log.warning(
                "kvpushd: %s: transfer %s is already loading for another request",
                receive.request_id,
                receive.transfer_id,
            )
            self._load_nothing(receive)
            return
        load = _Load(
            receive.request_id,
            receive.block_ids,
            self._nbytes(receive.block_ids),
            generation,
            time.monotonic(),
            tuple(share.transfer_id for share in shares),
        )
        for share in shares:
            self._receiving[share.transfer_id] = load
            self._spawn(self._receive(share, generation))
        self._forgo_unread(receive, generation)

    def _maybe_swap_states(self, receive: ReceiveSpec) -> ReceiveSpec:
        """The negative control for recurrent state: two layers' states land in each other's blocks.

        State blocks carry no token hash, so nothing but the tokens can tell.
        """
        blocks = list(receive.block_ids)
        held = [g for g, state in enumerate(self._states[: len(blocks)]) if state and blocks[g]]
        if len(held) < 2 or not failpoints.corrupts("connector.swap_states"):
            return receive
        a, b = held[:2]
        blocks[a], blocks[b] = blocks[b], blocks[a]
        return dataclasses.replace(receive, block_ids=tuple(blocks))

    def _load_nothing(self, receive: ReceiveSpec) -> None:
        """End a load that registered nothing: it failed (vLLM recomputes or fails it)."""
        self._failed_loads.add(receive.request_id)
        self._done_receiving.add(receive.request_id)

    def _forgo_all(self, forgone: ReceiveSpec, generation: int) -> None:
        """End the prefill's pushes of a transfer this instance will not load.

        Paired instances: each rank ends its own sources' pushes with empty
        receivers on the engines they would have written. Otherwise the
        first rank of the first stage ends every prefill rank's push (its
        shares are named by the prefill's sizes), and the prefill daemon
        refuses each pairing.
        """
        if forgone.paired:
            try:
                sources = self._sources(forgone)
            except UnmappableRanks:
                pass
            else:
                for source in sources:
                    self._spawn(self._forgo(self._receiver(forgone, source), generation))
                self._forgo_unread(forgone, generation)
                return
        if self._rank == 0 and self._stage == 0:
            ranks = forgone.shares_tp
            for stage in range(forgone.source_stages):
                for rank in range(ranks):
                    share = share_id(forgone.transfer_id, rank, ranks, stage, forgone.source_stages)
                    forgone_share = dataclasses.replace(forgone, transfer_id=share, block_ids=())
                    self._spawn(self._forgo(forgone_share, generation))

    def _hold_all(self, queued: ReceiveSpec) -> None:
        """Hold the push of every prefill rank this rank will load from (best effort).

        A hold that does not arrive costs nothing worse than before holds:
        the push ends at its deadline and this instance computes the prompt.
        """
        try:
            sources = self._sources(queued)
        except UnmappableRanks:
            return
        for source in sources:
            share = self._receiver(queued, source)
            self._spawn(self._hold(share))

    async def _hold(self, share: ReceiveSpec) -> None:
        try:
            await self._need_client().hold(
                share.transfer_id, share.peer, share.peer_address, timeout=CALL_TIMEOUT_S
            )
        except (ClientError, RuntimeError) as exc:
            log.info("kvpushd: hold of %s: %s", share.transfer_id, exc)

    def _forgo_unread(self, receive: ReceiveSpec, generation: int) -> None:
        """End the pushes of prefill replicas nobody reads (TP above the KV heads)."""
        prefill_tp, heads = receive.source_ranks, self._instance.num_kv_heads
        unread = forgone_sources(self._rank, self._tp_size, prefill_tp, heads)
        if not unread:
            return
        # No block, so no block hash: a receiver naming the load's hashes
        # with no block was refused by its own daemon (block_count_mismatch),
        # and the replica's push held the prefill's blocks to its deadline.
        forgone = dataclasses.replace(receive, block_ids=(), content="")
        for stage in self._stages(receive):
            for source in unread:
                self._spawn(
                    self._forgo(self._receiver(forgone, _Source(stage, source)), generation)
                )

    def _stages(self, receive: ReceiveSpec) -> tuple[int, ...]:
        """The prefill stages whose layers this rank's stage holds."""
        return stage_sources(
            self._stage, self._pp_size, receive.source_stages, self._instance.num_layers
        )

    def _sources(self, receive: ReceiveSpec) -> list[_Source]:
        """The prefill ranks this rank loads from (UnmappableRanks: none can feed it)."""
        heads = head_sources(
            self._rank,
            self._tp_size,
            receive.source_ranks,
            self._instance.num_kv_heads,
            receive.shares_tp,
        )
        if not self._head_major and any(source.slices > 1 for source in heads):
            raise UnmappableRanks(
                "vLLM's KV cache here is not head-major ([blocks, heads, ...]): a prefill "
                "rank's heads are not one run of each block"
            )
        stages = self._stages(receive)
        if stages != (self._stage,):
            # Each prefill stage's layers become a run of this rank's group.
            for stage in stages:
                first, end = stage_layers(stage, receive.source_stages, self._instance.num_layers)
                if not _holds_run(self._layer_ids or [], first, end):
                    raise UnmappableRanks(
                        f"this rank's KV cache does not hold layers {first}-{end - 1} as one run"
                    )
        return [_Source(stage, source) for stage in stages for source in heads]

    def _receiver(
        self, receive: ReceiveSpec, source: _Source, *, swap: bool = False
    ) -> ReceiveSpec:
        """The receiver for a prefill rank's share, on the engine its heads and layers fill."""
        heads = source.heads
        share = share_id(
            receive.transfer_id,
            heads.share_rank,
            receive.shares_tp,
            source.stage,
            receive.source_stages,
        )
        layers = stage_layers(source.stage, receive.source_stages, self._instance.num_layers)
        engine_id = self._engine_id
        if heads.slices > 1 or layers != self._fingerprint.layer_range:
            index = (heads.slice_index + swap) % heads.slices
            engine_id = self._slice(layers, index, heads.slices)
        return dataclasses.replace(receive, transfer_id=share, engine_id=engine_id)

    def _slice(self, layers: tuple[int, int], index: int, slices: int) -> str:
        """The engine of head slice ``index`` of ``slices`` of ``layers`` (registered when used)."""
        first, end = self._fingerprint.kv_head_range
        width = (end - first) // slices
        heads = (first + index * width, first + (index + 1) * width)
        slice_id = self._engine_id
        if layers != self._fingerprint.layer_range:
            slice_id += f"-L{layers[0]}-{layers[1]}"
        if slices > 1:
            slice_id += f"-kvh{heads[0]}-{heads[1]}"
        if slice_id not in self._slices:
            assert self._layout is not None
            groups, _ = self._layout
            sliced = tuple(self._slice_group(group, layers, index, slices) for group in groups)
            slice_print = slice_fingerprint(self._instance, heads, layers)
            self._slices[slice_id] = (sliced, slice_print)
        return slice_id

    def _slice_group(
        self, group: GroupSpec, layers: tuple[int, int], index: int, slices: int
    ) -> GroupSpec:
        """Head slice ``index`` of ``slices`` of one group's blocks, of ``layers`` only."""
        nbytes = group.block_bytes // slices
        held = group.layers
        if layers != self._fingerprint.layer_range:
            assert self._layer_ids is not None  # _sources checked the run (one group)
            start = self._layer_ids.index(layers[0])
            held = held[start : start + layers[1] - layers[0]]
        return GroupSpec(
            group.kind,
            group.num_blocks,
            nbytes,
            tuple(LayerSpec(layer.region, layer.offset + index * nbytes) for layer in held),
            group.per_logical,
            block_stride=group.stride,
        )

    async def _engine_ready(self, engine_id: str) -> None:
        """Make sure ``engine_id`` (this rank's, or a slice of it) is registered now."""
        if engine_id in ("", self._engine_id) or engine_id in self._slices_registered:
            return
        async with self._slice_lock:
            if engine_id not in self._slices_registered:
                await self._register_slice(self._need_client(), engine_id)

    async def _register_slice(self, client: EngineClient, slice_id: str) -> None:
        assert self._layout is not None
        _, region = self._layout
        groups, slice_print = self._slices[slice_id]
        await client.register_engine(slice_id, groups, (region,), fingerprint=slice_print)
        self._slices_registered.add(slice_id)

    async def _push(self, push: PushSpec, generation: int, staged: Copy) -> None:
        if not staged.done():
            await asyncio.to_thread(staged.wait)
        if not push.engine_id:
            self._gave_up(
                push.transfer_id,
                RuntimeError(
                    "the KV a decode rank holds is not one run of each block here (the cache "
                    "is not head-major [blocks, heads, ...], or the layers not one run)"
                ),
            )
            return
        try:
            client = self._need_client(generation)
            self._posted.add(push.transfer_id)
            await self._register_pusher(push, client)
            await client.kv_ready(push.transfer_id, timeout=_UNTIL_ANSWERED)
        except (RpcError, RuntimeError) as exc:
            # Refused, or no daemon to ask: nothing will read these blocks, so
            # vLLM may have them back; the decode side fails its load on its own.
            self._gave_up(push.transfer_id, exc)
        except ClientError as exc:
            # The connection ended mid-call: a write may already read the blocks.
            self._unsure_of(push, exc)

    async def _receive(self, receive: ReceiveSpec, generation: int) -> None:
        # An abort of this share waits until its registration was answered:
        # one that overtook it would find nothing, and the blocks would go
        # back while the registration still lands.
        answered = self._registering[receive.transfer_id] = asyncio.Event()
        try:
            self._posted.add(receive.transfer_id)
            await self._engine_ready(receive.engine_id)
            await self._register_receiver(receive, generation)
        except (RpcError, RuntimeError) as exc:
            # Never registered: no write can target these blocks. The load
            # ends as a load error, so vLLM recomputes or fails the request.
            self._gave_up(receive.transfer_id, exc)
        except ClientError as exc:
            # The connection ended mid-call: a write may already target them.
            self._unsure_of(receive, exc)
        finally:
            answered.set()
            if self._registering.get(receive.transfer_id) is answered:
                del self._registering[receive.transfer_id]

    async def _forgo(self, receive: ReceiveSpec, generation: int) -> None:
        """Register a receiver with no block for a request vLLM dropped before its load.

        Not one of ours to report: vLLM has forgotten the request. Its
        outcome (``kv_arrived`` with nothing written, or a failure) comes as
        an event for a transfer this connection did not post, which is
        released at once (``_on_daemon_event``).
        """
        with contextlib.suppress(ClientError, RuntimeError):  # the deadline ends it instead
            await self._engine_ready(receive.engine_id)
            await self._register_receiver(receive, generation)

    async def _announce(self, share: PushSpec) -> None:
        """Register a pusher with no block for a transfer this instance will not push.

        Not one of ours to report: vLLM has its blocks back already. Its
        outcome comes as an event for a transfer this connection did not
        post, which is released at once (``_on_daemon_event``).
        """
        with contextlib.suppress(ClientError, RuntimeError):  # the deadline ends it instead
            client = self._need_client()
            await self._register_pusher(share, client)
            await client.kv_ready(share.transfer_id, timeout=CALL_TIMEOUT_S)

    async def _register_pusher(self, push: PushSpec, client: EngineClient) -> None:
        await self._engine_ready(push.engine_id)
        await client.register_request(
            push.engine_id or self._engine_id,
            push.transfer_id,
            Role.PUSHER,
            self._per_group(push.block_ids),
            timeout=_UNTIL_ANSWERED,
            content=push.content,
        )

    async def _register_receiver(self, receive: ReceiveSpec, generation: int) -> None:
        await self._need_client(generation).register_request(
            receive.engine_id or self._engine_id,
            receive.transfer_id,
            Role.RECEIVER,
            self._per_group(receive.block_ids),
            peer=receive.peer,
            # The decode daemon dials the prefill's on demand if it has no link.
            peer_address=receive.peer_address,
            timeout=_UNTIL_ANSWERED,
            content=receive.content,
        )

    def _nbytes(self, block_ids: Blocks) -> int:
        """The KV bytes of these blocks, over all their groups' layers."""
        return sum(len(ids) * n for ids, n in zip(block_ids, self._group_nbytes, strict=False))

    def _per_group(self, block_ids: Blocks) -> list[list[int]]:
        """Block ids as the daemon takes them: one list per group (() is none in any)."""
        if not block_ids:
            return [[] for _ in self._group_nbytes or (0,)]
        return [list(ids) for ids in block_ids]

    def _gave_up(self, transfer_id: str, exc: BaseException) -> None:
        reason = exc.code if isinstance(exc, RpcError) else "daemon_unavailable"
        self._posted.discard(transfer_id)
        log.warning("kvpushd: %s not registered: %s", transfer_id, exc)
        self._events.put(GaveUp(transfer_id, reason, str(exc)))

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(Sends over, loads over, the loads of those that failed.)"""
        self._finished_seen.update(finished_req_ids)
        if len(self._finished_seen) > _MAX_SEEN:
            # Only sends wait for vLLM to name them finished: forget the others.
            pending = {request_id for request_id, _ in self._sending.values()}
            self._finished_seen &= pending | self._done_sending
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            self._on_event(event)
        if self._staging is not None:
            self._stage_in()
        sending = {r for r in self._done_sending if r in self._finished_seen}
        self._done_sending -= sending
        self._finished_seen -= sending
        receiving, self._done_receiving = self._done_receiving, set()
        # A failed load is finished too (every one is in ``receiving``):
        # vLLM ends its wait on both sets.
        failed, self._failed_loads = self._failed_loads, set()
        return sending, receiving, failed

    def _on_event(self, event: rpc.Event | GaveUp | Freed | DaemonLost) -> None:
        if isinstance(event, DaemonLost):
            self._daemon_lost(event.generation)
            return
        transfer_id = event.request_id
        if transfer_id in self._sending:
            # A pusher's blocks are only read while it writes: once the write
            # is over (or never happens), vLLM may have them back.
            if isinstance(event, rpc.BlocksFreeable | rpc.RequestFailed | rpc.Released | GaveUp):
                # Released: the daemon dropped it (a deadline, while we were
                # away); a released pusher has no write left. The blocks go
                # back once every share of the request is over.
                request_id, _ = self._sending.pop(transfer_id)
                shares = self._pushes.get(request_id, set())
                shares.discard(transfer_id)
                if not shares:
                    self._pushes.pop(request_id, None)
                    self._done_sending.add(request_id)
                self.stats.ended(_outcome(event, "pushed"))
                if not isinstance(event, GaveUp | rpc.Released):
                    self._spawn(self._release(transfer_id))
            return
        load = self._receiving.get(transfer_id)
        if load is None:
            return
        if isinstance(event, rpc.KvArrived):
            # Done is settled: the write is over, its slice holds the KV.
            load.pending.discard(transfer_id)
            load.holding.discard(transfer_id)
            self._spawn(self._release(transfer_id))
        elif isinstance(event, rpc.RequestFailed):
            # The data will not come, but a write may still be in flight
            # (quarantine): the blocks go back to vLLM only once the daemon
            # has released the request.
            log.warning("kvpushd: %s failed: %s %s", transfer_id, event.reason, event.message)
            self.stats.ended(_outcome(event, "loaded"))
            load.pending.discard(transfer_id)
            self._fail(load)
            self._spawn(self._release_then_free(transfer_id))
        elif isinstance(event, rpc.Released):
            self._events.put(Freed(transfer_id))  # a deferred release was carried out
        elif isinstance(event, GaveUp | Freed):
            if isinstance(event, GaveUp):  # a failure was counted when it came
                self.stats.ended(_outcome(event, "loaded"))
            load.pending.discard(transfer_id)
            load.holding.discard(transfer_id)
            self._fail(load)
        self._settle(load)

    def _fail(self, load: _Load) -> None:
        """One share of a load failed: the others are given up too (all or nothing)."""
        if load.failed:
            return
        load.failed = True
        for share in load.pending:
            # Its write may still come: the daemon cancels it or quarantines
            # the blocks, and the release that follows frees them.
            self._spawn(self._abort(share))

    def _settle(self, load: _Load) -> None:
        """End the load once every share has landed, or every share is released."""
        if load.pending or load.holding:
            return
        for share in load.shares:
            self._receiving.pop(share, None)
        if load.failed:
            # Never silently wrong KV: vLLM fails or recomputes these blocks.
            self._failed_loads.add(load.request_id)
        else:
            self.stats.loaded(load.nbytes, time.monotonic() - load.posted_at)
            if self._staging is not None:
                # Host staging: finished once its blocks are in vLLM's cache.
                self._to_stage_in.append(load)
                return
        self._done_receiving.add(load.request_id)

    def _stage_in(self) -> None:
        """Copy this step's landed loads mirror -> cache (one batch); end those copied."""
        assert self._staging is not None
        if self._to_stage_in:
            loads, self._to_stage_in = self._to_stage_in, []
            copy = Copy()
            # The hybrid negative control's twin for staging: the KV never reaches vLLM.
            if not failpoints.corrupts("connector.skip_stage_in"):
                copy = self._staging.copy_in([load.blocks for load in loads])
                self.stats.staged("in", copy.nbytes)
            self._staging_in.append((copy, [load.request_id for load in loads]))
        still = []
        for copy, request_ids in self._staging_in:
            if copy.done():
                self._done_receiving.update(request_ids)
            else:
                still.append((copy, request_ids))
        self._staging_in = still

    async def _release_then_free(self, transfer_id: str) -> None:
        if transfer_id not in self._posted:
            # Released already (a sibling share's failure aborted it, then
            # its own failure came), or never registered: nothing holds the
            # blocks, and a second release would be journaled as stale.
            self._events.put(Freed(transfer_id))
            return
        if not self._first_release(transfer_id):
            return  # already asked (an abort, then its failure): its answer frees the blocks
        try:
            reply = await self._need_client().release(transfer_id)
        except RpcError as exc:
            # Already released (stale), or unknown: nothing holds the blocks.
            log.warning("kvpushd: release of %s: %s", transfer_id, exc)
            self._releasing.discard(transfer_id)
            self._events.put(Freed(transfer_id))
            return
        except (ClientError, RuntimeError) as exc:
            # No answer (no connection, or it ended mid-call): the daemon may
            # live and hold the blocks. Asked again when it answers a
            # reconnect; ended with the rest if it is known gone.
            log.warning("kvpushd: release of %s: no answer (%s)", transfer_id, exc)
            self._releasing.discard(transfer_id)
            self._unreleased.add(transfer_id)
            return
        if isinstance(reply, rpc.Ok):
            self._releasing.discard(transfer_id)
            self._posted.discard(transfer_id)
            self._events.put(Freed(transfer_id))
        # Deferred: the daemon sends Released when the quarantine lifts.

    def _first_release(self, transfer_id: str) -> bool:
        """Note a release asked of the daemon (loop thread); False if one is under way.

        One release per request: the abort path released twice (once after
        the abort, once for the failure it caused), and the second, arriving
        after the request was gone, was journaled as a stale refusal.
        """
        if transfer_id in self._releasing:
            return False
        self._releasing.add(transfer_id)
        return True

    def abort(self, request_ids: list[str]) -> None:
        """vLLM finished these decode requests while their KV was still loading."""
        aborted = set(request_ids)
        for load in {id(load): load for load in self._receiving.values()}.values():
            if load.request_id in aborted:
                for share in load.pending:
                    self._spawn(self._abort(share))

    async def _abort(self, transfer_id: str) -> None:
        # The daemon cancels the push (or keeps the blocks until the pusher's
        # final word); the blocks come back through the release.
        registering = self._registering.get(transfer_id)
        if registering is not None:
            await registering.wait()
        with contextlib.suppress(ClientError, RuntimeError):
            await self._need_client().abort(transfer_id)
        await self._release_then_free(transfer_id)

    def _daemon_lost(self, generation: int) -> None:
        """The daemon went away: end every transfer the lost connection held.

        A prefill's blocks are no longer read by anyone (the daemon's NIXL
        agent died with it). A decode's blocks: its peer fences a dead daemon
        and fails the write; the loads end failed, never as arrived.
        Transfers posted under a newer connection are not touched.
        """
        lost = [t for t, (_, g) in self._sending.items() if g <= generation]
        lost += [
            t
            for t, load in self._receiving.items()
            if load.generation <= generation and t in load.holding
        ]
        for transfer_id in lost:
            self._on_event(GaveUp(transfer_id, "daemon_unavailable", "connection lost"))

    async def _release(self, transfer_id: str, client: EngineClient | None = None) -> None:
        if not self._first_release(transfer_id):
            return
        # The daemon's deadline releases it anyway.
        with contextlib.suppress(ClientError, RuntimeError):
            await (client or self._need_client()).release(transfer_id)
        self._posted.discard(transfer_id)
        self._releasing.discard(transfer_id)

    # plumbing -----------------------------------------------------------

    def _need_client(self, generation: int | None = None) -> EngineClient:
        """The live connection (the one ``generation`` was posted under, if given)."""
        client = self._client
        if client is None or client.closed:
            raise RuntimeError("KvpushdConnector: not connected to kvpushd")
        if generation is not None and generation != self._generation:
            raise RuntimeError("KvpushdConnector: the daemon connection was replaced")
        return client

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        with self._spawn_lock:
            self._to_spawn.append(coro)
            if len(self._to_spawn) > 1:
                return  # the loop has yet to start the ones before: it starts this too
        self._loop.call_soon_threadsafe(self._start_spawned)

    def _start_spawned(self) -> None:
        """On the loop: start every call handed over since the last turn, together."""
        with self._spawn_lock:
            coros, self._to_spawn = self._to_spawn, []
        for coro in coros:
            task = self._loop.create_task(coro)
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            task.add_done_callback(_log_failure)

    def _run(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(CALL_TIMEOUT_S)

    def close(self) -> None:
        self._closing = True
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()
        if self._allocation is not None and self._allocation.lock_fd is not None:
            os.close(self._allocation.lock_fd)
            self._allocation.lock_fd = None
        if self._staging is not None:
            self._staging.close()
            os.close(self._staging.lock_fd)
            self._staging = None


def _outcome(event: Any, ok: str) -> str:
    """How a transfer ended, as the stats name it."""
    if isinstance(event, rpc.RequestFailed):
        return f"failed:{event.reason}"
    if isinstance(event, GaveUp):
        return f"gave_up:{event.reason}"
    if isinstance(event, rpc.Released):
        return "released"
    return ok


def _log_failure(future: Any) -> None:
    if future.cancelled():
        return  # the loop stopped (close)
    exc = future.exception()
    if exc is not None:
        log.error("kvpushd: a daemon call failed: %r", exc)


def _layout(
    kv_caches: dict[str, torch.Tensor],
    group_layers: tuple[tuple[str, ...], ...],
    buffer: torch.Tensor,
    path: Path,
    states: tuple[bool, ...] = (False,),
) -> tuple[tuple[GroupSpec, ...], RegionSpec]:
    """One group per KV cache group, its layers vLLM's views of the shared buffer.

    kvpushd's model: block ``b`` of layer ``l`` is ``block_bytes`` at
    ``offset(l) + b * block_bytes``; vLLM's CPU cache is exactly that (each
    layer's blocks back to back). Anything else is refused, not guessed.
    vLLM's hybrid allocator lays its groups over the same tensors; the
    daemon sees that from the offsets (statemachine/overlay.py). A state
    group (``states``: Mamba/SSM) is an SSM group of whole pages.
    """
    size = buffer.untyped_storage().nbytes()
    order = list(kv_caches)
    groups = []
    for g, names in enumerate(group_layers):
        # In the order the worker sorted the layers (model order).
        members = {name: kv_caches[name] for name in sorted(names, key=order.index)}
        groups.append(_group(members, buffer.data_ptr(), size, g < len(states) and states[g]))
    return tuple(groups), RegionSpec("kv", size, path=str(path))


def _group(
    kv_caches: dict[str, torch.Tensor], base: int, size: int, state: bool = False
) -> GroupSpec:
    """One group of layers: their blocks must agree in count and size.

    A state group's block is the whole page vLLM gives it: the state
    (conv, then SSM) is its first bytes and the rest pads it to the
    attention page it overlays. Moving the page whole keeps it "alike"
    that group (statemachine/overlay.py), at the price of the padding.
    """
    layers: list[LayerSpec] = []
    shape: tuple[int, int] | None = None
    for name, tensor in kv_caches.items():
        block_bytes = tensor.stride(0) * tensor.element_size()
        held = tensor[0].numel() * tensor.element_size()
        if (held > block_bytes if state else held != block_bytes) or not tensor[0].is_contiguous():
            raise ValueError(f"KvpushdConnector: layer {name}'s blocks are not contiguous")
        offset = tensor.data_ptr() - base
        if not 0 <= offset <= size - tensor.shape[0] * block_bytes:
            raise ValueError(f"KvpushdConnector: layer {name} lies outside the shared buffer")
        if shape is not None and shape != (tensor.shape[0], block_bytes):
            raise ValueError("KvpushdConnector: layers differ in block count or size")
        shape = (tensor.shape[0], block_bytes)
        layers.append(LayerSpec("kv", offset))
    if shape is None:
        raise ValueError("KvpushdConnector: vLLM registered no KV cache")
    kind = GroupKind.SSM if state else GroupKind.ATTENTION
    return GroupSpec(kind, shape[0], shape[1], tuple(layers))
