"""The rotary embedding as vLLM resolved it: the fingerprint's ``rope`` field.

Two instances of one checkpoint can rotate their keys differently: vLLM's
LongRoPE (Phi-3 style, ``rope_type = "longrope"``) uses the long factors
when ``max_model_len > original_max_position_embeddings`` and the short ones
otherwise (vllm/model_executor/layers/rotary_embedding/phi3_long_rope_scaled_rope.py),
so a prefill started with ``--max-model-len 256`` and a decode with 64 held
keys of the other table (12/12 wrong tokens before this field).

:func:`rope_identity` is ``TYPES:TABLE:DIGEST``: the rope types (one per
layer type where the config nests them, ``+``-joined), the LongRoPE table
chosen for this ``max_model_len`` (``long`` or ``short``; ``-`` for a type
that has one table), and a digest of the rope parameters as vLLM patched
them (theta, factors, original lengths) with the text config's
``max_position_embeddings`` (LongRoPE's scale and a dynamic NTK's base
depend on it). Read from vLLM's config by attribute, the same on the
scheduler and on every worker; "" for a model that names no rope.

Pure: no vLLM, no torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any, Final

# vLLM's rope types whose table depends on max_model_len (get_rope's names).
LONG_ROPE: Final = frozenset({"longrope"})


def rope_identity(model_config: Any) -> str:
    """``TYPES:TABLE:DIGEST`` of the rotary embedding this instance computes with ("": none)."""
    text = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    params = list(_rope_parameters(text))
    if not params:
        return ""
    max_model_len = int(getattr(model_config, "max_model_len", 0) or 0)
    types = [str(p.get("rope_type") or p.get("type") or "default") for p in params]
    tables = {_table(p, t, max_model_len, text) for p, t in zip(params, types, strict=True)} - {"-"}
    document = {
        "rope": params,
        "max_position_embeddings": getattr(text, "max_position_embeddings", None),
    }
    canonical = json.dumps(document, sort_keys=True, default=repr, separators=(",", ":"))
    digest = hashlib.blake2b(canonical.encode(), digest_size=8).hexdigest()
    return f"{'+'.join(sorted(set(types)))}:{'+'.join(sorted(tables)) or '-'}:{digest}"


def _rope_parameters(text: Any) -> Iterator[Mapping[str, Any]]:
    """The config's rope parameter dicts (one per layer type if nested); its legacy fields else."""
    rope = getattr(text, "rope_parameters", None)
    if isinstance(rope, Mapping) and rope:
        if all(isinstance(p, Mapping) for p in rope.values()):  # nested by layer type
            yield from (p for p in rope.values() if isinstance(p, Mapping) and p)
        else:
            yield rope
        return
    legacy = dict(getattr(text, "rope_scaling", None) or {})
    theta = getattr(text, "rope_theta", None)
    if theta is not None:
        legacy["rope_theta"] = theta
    if legacy:
        yield legacy


def _table(params: Mapping[str, Any], kind: str, max_model_len: int, text: Any) -> str:
    """Which LongRoPE table vLLM picked for ``max_model_len`` (``-``: a type with one table)."""
    if kind not in LONG_ROPE:
        return "-"
    original = params.get("original_max_position_embeddings") or getattr(
        text, "original_max_position_embeddings", 0
    )
    return "long" if max_model_len > int(original or 0) else "short"
