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

from typing import Annotated, Final

import msgspec

# The KvpushdConnector's own protocol: bumped when what it puts in
# kv_transfer_params, or how it reads them, changes incompatibly.
# 2: instances of different TP sizes pair rank by rank (``kv_head_range``).
# 3: pipeline stages pair by the layers they hold (``layer_range``; ``@pp<s>`` shares).
# 4: registrations name each block's content hash (statemachine/content.py),
#    and a prefill pushes only its prompt's blocks.
CONNECTOR_PROTOCOL: Final = 4

# Bounds on every field, checked wherever a fingerprint is decoded (an
# engine's Hello, a peer's forward, the journal, a client's
# kv_transfer_params through the connector): a fingerprint a client forged
# is refused as unreadable, never met by arithmetic (a TP size of 0) or by
# a string of any length. Each bound is far above any real engine's.
MAX_RANKS: Final = 256  # TP or PP ranks of one instance
MAX_NAME: Final = 16384  # a model path or id, a layout naming every KV cache group
MAX_WORD: Final = 256  # a revision, a dtype, an engine's version, a digest
MAX_COUNT: Final = 1 << 20  # tokens per block, layers, heads, a head's size, a protocol
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
Word = Annotated[str, msgspec.Meta(max_length=MAX_WORD)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Ranks = Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]


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

    model: Name
    revision: Word = ""
    dtype: Word = ""
    kv_cache_dtype: Word = ""
    block_size: Count = 0
    num_layers: Count = 0
    num_kv_heads: Count = 0
    head_size: Count = 0
    kv_layout: Name = ""
    tp_size: Ranks = 1
    pp_size: Ranks = 1
    engine: Word = ""
    protocol: Count = 0
    # Last, with a default: fingerprints journaled before it decode unchanged.
    kv_head_range: tuple[Count, Count] = (0, 0)
    layer_range: tuple[Count, Count] = (0, 0)
    # What else changes the KV of the same weights: their quantization
    # method, a digest of config overrides (vLLM's ``hf_overrides``), and a
    # speculative method whose draft layers keep KV of their own.
    quantization: Word = ""
    overrides: Word = ""
    speculative: Name = ""
    # What the model's config and paths do not say (issue 47): ``weights``
    # a digest of the loaded parameters this engine's rank holds (a strided
    # sample of each, daemon/client/vllm/weights.py; "" where not taken:
    # the scheduler, which holds no model, or a worker that could not reach
    # it), compared only between shards of one layout (statemachine/fingerprint.py);
    # ``rope`` the rotary embedding as vLLM resolved it (its type, the table
    # chosen for this max_model_len, a digest of its parameters).
    weights: Word = ""
    rope: Word = ""

    @property
    def names_heads(self) -> bool:
        return self.kv_head_range != (0, 0)
