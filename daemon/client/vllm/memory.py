"""The KV memory the daemon sees: vLLM's cache in memory the daemon maps, and its layout.

``SharedAllocation`` turns vLLM's one flat KV allocation into the memory
the daemon maps (``sharedmemory.SharedMemory``); ``check_memory`` refuses
memory the daemon could not read;
``in_model_order`` orders vLLM's layers as the model does; ``layout``
describes the blocks as kvpushd's groups and layers (offsets into that
one region). Runs on vLLM's thread, at registration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from daemon.client.vllm.sharedmemory import DESCRIPTOR, SharedMemory
from daemon.client.vllm.staging import SHARED
from schemas.fingerprint import Fingerprint
from schemas.kvlayout import GroupSpec, KvPlacement, LayerSpec, MemoryNote
from schemas.layout import GroupKind


class SharedAllocation(TorchFunctionMode):
    """Turns vLLM's one flat int8 KV allocation into the memory the daemon maps."""

    def __init__(self, memory: SharedMemory) -> None:
        super().__init__()
        self.memory = memory
        self.buffer: torch.Tensor | None = None

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
            self.buffer = self.memory.tensor(args[0])
            return self.buffer
        return func(*args, **kwargs)


def memory_note(buffer: str, memory: SharedMemory, device: str) -> MemoryNote:
    """The engine's word to its daemon on its memory (``kvpushd status`` shows it)."""
    how = (
        "a sealed memfd passed by descriptor"
        if memory.how == DESCRIPTOR
        else f"{memory.path} (kv_memory = 'file')"
    )
    if buffer == SHARED:
        return MemoryNote(KvPlacement.CACHE, f"vLLM's KV cache itself, in {how}")
    return MemoryNote(
        KvPlacement.STAGING,
        f"a host mirror, in {how}, of vLLM's KV cache on {device}: the engine "
        "copies blocks out before a push and in after a load (kv_buffer = 'host')",
    )


def check_memory(
    kv_caches: dict[str, torch.Tensor],
    buffer: str,
    allocation: SharedAllocation | None,
    states: tuple[bool, ...],
) -> None:
    """Refuse KV memory the daemon cannot read as ``buffer`` says (RuntimeError, vLLM stops)."""
    on_gpu = sorted({t.device.type for t in kv_caches.values()} - {"cpu"})
    if on_gpu and buffer == SHARED:
        raise RuntimeError(
            f"KvpushdConnector: the KV cache is on {', '.join(on_gpu)}; kv_buffer = "
            "'shared' maps host-memory KV caches only: use kv_buffer = 'host'"
        )
    if buffer == SHARED and (allocation is None or allocation.buffer is None):
        raise RuntimeError(
            "KvpushdConnector: vLLM did not allocate its KV cache through "
            "get_mem_pool_context(); the daemon cannot map it"
        )
    if any(states) and buffer != SHARED:
        raise RuntimeError(
            "KvpushdConnector: this model keeps Mamba/SSM state, which kv_buffer = "
            f"{buffer!r} does not carry: use kv_buffer = 'shared' (host-memory KV)"
        )


def in_model_order(
    kv_caches: dict[str, torch.Tensor],
    group_layers: tuple[tuple[str, ...], ...] | None,
    own: Fingerprint,
    stage: int,
    pp_size: int,
) -> tuple[dict[str, torch.Tensor], list[int] | None]:
    """vLLM's layers in model order, and each one's model layer index (None: no layer slices).

    A pipeline stage must hold the layers vLLM's even split gives it: the
    other side names a stage's KV by that split.
    """
    layer_ids = layer_indices(kv_caches)
    if group_layers is not None and len(group_layers) > 1:
        # Several groups (pipeline stages of 1, check_supported): no
        # share is ever a run of layers, so none is sliced by layer.
        layer_ids = None
    if layer_ids is not None:
        # In model order, so a stage's layers are one run of the group's.
        order = sorted(range(len(layer_ids)), key=layer_ids.__getitem__)
        names = list(kv_caches)
        kv_caches = {names[i]: kv_caches[names[i]] for i in order}
        layer_ids = sorted(layer_ids)
    if pp_size > 1 and layer_ids != list(range(*own.layer_range)):
        raise RuntimeError(
            f"KvpushdConnector: pipeline stage {stage} holds layers "
            f"{layer_ids}, not {own.layer_range} as vLLM's even split "
            "gives (VLLM_PP_LAYER_PARTITION is not supported): the other side could not "
            "tell which layers this stage's KV is of"
        )
    return kv_caches, layer_ids


def layer_indices(names: Any) -> list[int] | None:
    """The model's layer index of each KV cache layer name, or None if a name has none."""
    from vllm.model_executor.models.utils import extract_layer_index

    try:
        return [int(extract_layer_index(name)) for name in names]
    except (AssertionError, ValueError):
        return None


def layout(
    kv_caches: dict[str, torch.Tensor],
    group_layers: tuple[tuple[str, ...], ...],
    buffer: torch.Tensor,
    states: tuple[bool, ...] = (False,),
) -> tuple[GroupSpec, ...]:
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
    return tuple(groups)


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
