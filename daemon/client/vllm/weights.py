"""What weights a worker rank holds, by what they are: a digest of the loaded parameters.

A model folder rewritten in place (a rolling upgrade of a fine-tune at one
path) keeps its path, config, names and sizes: the fingerprint's ``model``
field cannot tell the two instances apart. This digest is taken from the
parameters vLLM loaded, once, when the worker's connector is built:

- every parameter, by name (vLLM's, with LoRA's ``.base_layer`` wrapper
  removed, so an instance serving adapters digests its base weights as one
  without), dtype and shape, in name order;
- a fixed strided sample of each: :data:`SAMPLES` elements evenly spaced
  over its flattened elements (all of a smaller one), each element's bytes
  as they lie in memory, gathered on the parameter's device and copied to
  the host in one transfer;
- BLAKE2b-128 over all of it.

Two processes that loaded the same weights get the same digest (nothing of
the process, the device address or the host goes in); a fine-tune, another
seed or a rescaled tensor changes nearly every element and so the sampled
ones. A change confined to elements between the samples is not seen here:
the decode's own K/V of the prompt's last token is the check for what this
misses (kvcheck.py). Buffers are not digested (a rotary table comes from
the config: the fingerprint's ``rope`` names it).

The digest is of the rank's own shard (its TP slice of its stage's layers):
statemachine/fingerprint.py compares it only between engines of one layout.

Reaching the model: vLLM hands a KV connector no model. The worker's
connector is built in ``Worker.initialize_from_config`` (through
``ensure_kv_transfer_initialized``), after ``load_model``: :func:`calling_model`
looks up the calling frames for the worker (``model_runner.get_model()``) or
its model runner (``get_model()``). Not found (another vLLM, a caller of
another shape): no digest (""), one log line, and the pairing compares no
weights for this engine.

No vLLM import: tested in the main environment with torch alone.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable
from types import FrameType
from typing import Any, Final

import torch

# Elements sampled per parameter: a 70B model's ~720 tensors read ~740 K
# elements (1.5 MB in bf16), bench/weights_digest.py.
SAMPLES: Final = 1024
# How far up the calling frames the worker is looked for.
MAX_FRAMES: Final = 24
# vLLM's LoRA layers wrap the base layer's parameters under this name.
_LORA_WRAPPER: Final = ".base_layer"


def weights_digest(named: Iterable[tuple[str, torch.Tensor]], samples: int = SAMPLES) -> str:
    """The digest of ``named`` (name, tensor): names, dtypes, shapes, strided samples (hex)."""
    tensors = sorted((_canonical(name), tensor) for name, tensor in named)
    header = hashlib.blake2b(digest_size=16)
    picked: list[torch.Tensor] = []
    for name, tensor in tensors:
        header.update(f"{name}|{str(tensor.dtype).removeprefix('torch.')}|".encode())
        header.update(",".join(str(n) for n in tensor.shape).encode() + b";")
        if tensor.numel():
            picked.append(_sample(tensor.detach(), samples))
    for device in sorted({t.device for t in picked}, key=str):
        # One host copy per device, in name order within it.
        on = [t for t in picked if t.device == device]
        header.update(torch.cat(on).cpu().numpy().tobytes())
    return header.hexdigest()


def _canonical(name: str) -> str:
    return name.replace(_LORA_WRAPPER, "")


def _sample(tensor: torch.Tensor, samples: int) -> torch.Tensor:
    """The bytes of ``samples`` evenly spaced elements of ``tensor`` (all of a smaller one), uint8.

    Read through a flat uint8 view, so any dtype (fp8, packed integers)
    samples alike, in place: nothing the size of the tensor is copied (but
    for a tensor not contiguous in memory, which vLLM's parameters are).
    """
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    count = tensor.numel()
    taken = min(samples, count)
    width = tensor.element_size()
    # Integer arithmetic: the same positions in every process.
    flat = torch.arange(taken, dtype=torch.int64) * (count - 1) // max(taken - 1, 1)
    offsets = (flat[:, None] * width + torch.arange(width, dtype=torch.int64)).reshape(-1)
    raw = tensor.reshape(-1).view(torch.uint8)
    return raw.index_select(0, offsets.to(tensor.device))


def model_digest(model: Any) -> str:
    """The digest of a torch module's parameters (each once, shared ones under their first name)."""
    return weights_digest(model.named_parameters())


def calling_model(max_frames: int = MAX_FRAMES) -> Any | None:
    """The loaded model of the vLLM worker up the calling frames, or None.

    A frame's ``self`` that is a worker (its ``model_runner.get_model()``) or
    a model runner (``get_model()``) and returns a module with parameters.
    """
    frame: FrameType | None = sys._getframe(1)
    for _ in range(max_frames):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        for holder in (getattr(owner, "model_runner", None), owner):
            get_model = getattr(holder, "get_model", None)
            if not callable(get_model):
                continue
            try:
                model = get_model()
            except Exception:  # not loaded, or not a runner: look further up
                continue
            if callable(getattr(model, "named_parameters", None)):
                return model
        frame = frame.f_back
    return None
