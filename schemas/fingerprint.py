"""What makes two engines' KV interchangeable: the fingerprint an engine registers with.

KV computed by one model is garbage to another, even when the bytes fit: a
checkpoint at another path, another dtype or another layout yields blocks of
the same size and wrong tokens. An engine names what produced its KV; the
prefill daemon pairs a push only between engines whose fingerprints are
equal (statemachine/fingerprint.py), and refuses with the first field that
differs.

An engine that declares nothing (``None``: the simulated engines, a client
older than the fingerprint) pairs only with another that declares nothing.
"""

from __future__ import annotations

from typing import Final

import msgspec

# The KvpushdConnector's own protocol: bumped when what it puts in
# kv_transfer_params, or how it reads them, changes incompatibly.
# 2: instances of different TP sizes pair rank by rank (``kv_head_range``).
# 3: pipeline stages pair by the layers they hold (``layer_range``; ``@pp<s>`` shares).
# 4: registrations name each block's content hash (statemachine/content.py),
#    and a prefill pushes only its prompt's blocks.
CONNECTOR_PROTOCOL: Final = 4


class Fingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The model, formats and parallel layout behind an engine's KV.

    ``model`` and ``revision`` name the weights (vLLM's ``--model`` value
    and revision, or an operator-chosen model id when the same weights sit
    at different paths on different hosts); ``tp_size`` and ``pp_size`` are
    the parallel layout the KV was split for; ``kv_head_range`` is the KV
    heads [first, end) an engine's blocks hold (one TP rank's share, or a
    head slice of it; ``(0, 0)``: not said, all of them); ``layer_range``
    the layers [first, end) its blocks hold (one pipeline stage's, or a
    layer slice of a decode stage's; ``(0, 0)``: not said); ``engine`` names
    the engine and its version, ``protocol`` the connector's
    (``CONNECTOR_PROTOCOL``).
    """

    model: str
    revision: str = ""
    dtype: str = ""
    kv_cache_dtype: str = ""
    block_size: int = 0
    num_layers: int = 0
    num_kv_heads: int = 0
    head_size: int = 0
    kv_layout: str = ""
    tp_size: int = 1
    pp_size: int = 1
    engine: str = ""
    protocol: int = 0
    # Last, with a default: fingerprints journaled before it decode unchanged.
    kv_head_range: tuple[int, int] = (0, 0)
    layer_range: tuple[int, int] = (0, 0)
    # What else changes the KV of the same weights: their quantization
    # method, a digest of config overrides (vLLM's ``hf_overrides``), and a
    # speculative method whose draft layers keep KV of their own.
    quantization: str = ""
    overrides: str = ""
    speculative: str = ""

    @property
    def names_heads(self) -> bool:
        return self.kv_head_range != (0, 0)
