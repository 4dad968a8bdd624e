"""What the scheduler side hands the worker side each step (vLLM carries it to every worker)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from daemon.client.vllm.specs import PushSpec, ReceiveSpec


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
    # Decode requests whose load the scheduler side could not set up (its own
    # error, swallowed by daemon/client/vllm/guard.py): each worker reports
    # it failed, nothing having been registered, and vLLM recomputes it.
    unloaded: list[str] = field(default_factory=list)
    # Loaded decode requests whose last prompt token this step computes: the
    # worker compares its K/V there with the pushed one after the forward.
    check: list[str] = field(default_factory=list)
    # Loaded decode requests that will not be checked (preempted or ended
    # before that forward): the worker drops what it kept for them.
    uncheck: list[str] = field(default_factory=list)
