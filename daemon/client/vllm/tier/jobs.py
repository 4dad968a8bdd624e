"""What the scheduler hands the worker for one store or one load (vLLM pickles them).

vLLM's offloading scheduler pairs each of these with its own list of the
request's blocks (``GPULoadStoreSpec``): the slots here are in the order of
the chunks those blocks fill, group by group.
"""

from __future__ import annotations

import numpy as np
from vllm.v1.kv_offload.base import LoadStoreSpec


class TierStore(LoadStoreSpec):
    """Slots granted to this engine, to be written with the chunks of ``keys``."""

    def __init__(self, slots: list[int], generations: list[int], keys: list[bytes]) -> None:
        self.slots = np.array(slots, dtype=np.int64)
        self.generations = tuple(generations)
        self.keys = tuple(keys)

    def __repr__(self) -> str:
        return f"TierStore(slots={self.slots.tolist()})"


class TierLoad(LoadStoreSpec):
    """Leased slots, each with the digest its chunk was committed with."""

    def __init__(self, slots: list[int], generations: list[int], digests: list[bytes]) -> None:
        self.slots = np.array(slots, dtype=np.int64)
        self.generations = tuple(generations)
        self.digests = tuple(digests)

    def __repr__(self) -> str:
        return f"TierLoad(slots={self.slots.tolist()})"
