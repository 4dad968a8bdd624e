"""What in a decode request's own inputs makes it compute its prompt, whatever the prefill sent.

- Prompt logprobs: vLLM reads no prefix for such a request (it needs every
  prompt token's logits) and drops its external tokens.
- Multimodal inputs named by per-process counters. vLLM names an image (an
  audio clip...) by a content hash, unless both its caches are off (prefix
  caching off and ``mm_processor_cache_gb`` 0): then by
  ``renderer{rank}-mm-{n}-{modality}-{i}``, a counter of the process
  (vllm/renderers/base.py ``_process_mm_uuids``), hashed with the
  processor's kwargs where a request has some. Two instances' counters
  agree on numbers, not on images: two legs carrying different images of
  the same token count can hash alike. Such a request computes its prompt
  here (the prefill's daemon is told, and both journals say why). Known by
  the instance's config (:func:`counts_inputs`) and, whatever the config,
  by an identifier of the counter's form (:data:`COUNTER`). A prefill whose
  inputs are counted pairs with no decode that names them by content: the
  hashes differ, and the pairing is refused.

Pure: no vLLM, no torch (read by attribute).
"""

from __future__ import annotations

import re
from typing import Any, Final

# Why (stats.py's not_loaded reasons): the request reads no prefix; its
# multimodal inputs are named by per-process counters.
LOGPROBS: Final = "prompt_logprobs"
MULTIMODAL: Final = "multimodal"
# vLLM's per-process multimodal name (after a LoRA name and ':' where it has one).
COUNTER: Final = re.compile(r"(?:^|:)renderer\d+-mm-\d+-")


def reads_no_prefix(request: Any) -> bool:
    """vLLM reads no prefix for this request (prompt logprobs): it computes its whole prompt."""
    return bool(getattr(request, "get_skip_reading_prefix_cache", lambda: False)())


def counts_inputs(vllm_config: Any) -> bool:
    """Whether this instance names multimodal inputs by per-process counters (both caches off)."""
    model = getattr(vllm_config, "model_config", None)
    multimodal = getattr(model, "multimodal_config", None)
    if multimodal is None:
        return False
    cache = getattr(vllm_config, "cache_config", None)
    processor_cache = getattr(multimodal, "mm_processor_cache_gb", None)
    return processor_cache == 0 and not getattr(cache, "enable_prefix_caching", False)


def counted(request: Any) -> bool:
    """Whether any of the request's multimodal identifiers has the counter's form."""
    for feature in getattr(request, "mm_features", None) or ():
        for name in (getattr(feature, "identifier", None), getattr(feature, "mm_hash", None)):
            if isinstance(name, str) and COUNTER.search(name):
                return True
    return False


def local_only(request: Any, counts: bool) -> tuple[str, str] | None:
    """Why this request computes its prompt whatever the prefill sent (stats kind, log), or None.

    ``counts``: this instance names multimodal inputs by counters (:func:`counts_inputs`).
    """
    if reads_no_prefix(request):
        return LOGPROBS, "the request asks for prompt logprobs: vLLM computes its whole prompt"
    if getattr(request, "mm_features", None) and (counts or counted(request)):
        return MULTIMODAL, (
            "its multimodal inputs are named by per-process counters, not by content "
            "(prefix caching off and mm_processor_cache_gb 0): nothing proves the prefill's "
            "were the same"
        )
    return None
