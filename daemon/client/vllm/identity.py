"""What this instance's KV is, as the engine itself computes it: the fingerprint it names.

Both of the project's vLLM connectors name their engine's KV this way (the
KvpushdConnector registers it and pairs by it; the offload tier derives
its namespace from it, daemon/client/vllm/tier/geometry.py), so the two
can never disagree on what makes KV interchangeable.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import vllm

from daemon.client.vllm.layout import fingerprint
from daemon.client.vllm.weights import calling_model, model_digest
from schemas.fingerprint import Fingerprint

log = logging.getLogger(f"vllm.{__name__}")


def instance_fingerprint(
    vllm_config: Any, extra: dict[str, Any], kv_cache_config: Any
) -> Fingerprint:
    """The fingerprint of the KV this instance computes, from its config (the same on every side).

    ``extra.model_id`` names the model in place of vLLM's ``--model`` value.
    """
    return fingerprint(
        vllm_config,
        vllm.__version__,
        str(extra.get("model_id") or ""),
        kv_cache_config,
        attention_isa=attention_isa(vllm_config),
    )


def attention_isa(vllm_config: Any) -> str:
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


def with_weights(instance: Fingerprint) -> Fingerprint:
    """``instance`` with this worker rank's weights digest (daemon/client/vllm/weights.py).

    vLLM builds the worker's connector after loading the model; the digest
    is taken once, here. Not reached (another vLLM's call path): none, and
    the pairing compares no weights for this engine.
    """
    model = calling_model()
    if model is None:
        log.warning("kvpushd: the loaded model was not found: this engine names no weights digest")
        return instance
    started = time.perf_counter()
    weights = model_digest(model)
    log.info("kvpushd: weights digest %s in %.3f s", weights, time.perf_counter() - started)
    return msgspec.structs.replace(instance, weights=weights)
