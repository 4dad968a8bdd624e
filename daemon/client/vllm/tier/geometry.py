"""Where one offloaded chunk lies in a pool slot, and the namespace its key lives in.

Pure: no vLLM, no torch (unit-tested in tests/test_tier_parts.py).

A slot holds one chunk of one KV cache group: ``blocks_per_chunk`` of vLLM's
blocks, each block the pages of every layer of the group, one after the
other in the group's layer order (vLLM's canonical pages: one per layer,
``page_bytes`` each). The slot's first ``chunk_bytes`` are written by a
store and digested; the rest of the slot stays as its reset left it (zero).

The namespace is a digest of everything that makes two engines' chunks
interchangeable: the engine's fingerprint (the model by what it holds: its
weights digest, its rope table, its dtype and layout), the chunk geometry,
vLLM's block hash algorithm and the seed of its hash chain. Two engines
share hits only inside one namespace: a key (vLLM's chained block hash) is
compared only with keys hashed the same way over KV computed the same way.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Final

import msgspec

from schemas.fingerprint import Fingerprint

# vLLM's prefix-cache hash algorithms whose chain seed is random per process
# unless PYTHONHASHSEED is set (vllm/v1/core/kv_cache_utils.py
# resolve_none_hash_seed): their keys are this process's alone.
_PER_PROCESS_SEED: Final = frozenset({"xxhash", "xxhash_cbor"})
# The seed vLLM chains a cryptographic hash from when PYTHONHASHSEED is unset.
_DEFAULT_SEED: Final = "default"
# Bump when what a slot holds, or how a namespace is derived, changes.
TIER_LAYOUT: Final = 1


class SlotTooSmall(ValueError):
    """A chunk of this engine does not fit the daemon's slots."""


class ChunkGeometry(msgspec.Struct, frozen=True):
    """One engine's chunks: the page of each layer, per KV cache group."""

    blocks_per_chunk: int
    tokens_per_hash: int
    # Per group, the bytes of each layer's page in vLLM's canonical layout.
    pages: tuple[tuple[int, ...], ...]
    kv_cache_layout: str = ""

    def block_bytes(self, group: int) -> int:
        """One vLLM block of ``group``: its layers' pages, one after another."""
        return sum(self.pages[group])

    def chunk_bytes(self, group: int) -> int:
        """What a store writes to (and a load reads from) a slot of ``group``."""
        return self.blocks_per_chunk * self.block_bytes(group)

    def page_offsets(self, group: int) -> tuple[int, ...]:
        """Each layer's page offset inside one block of ``group``."""
        offsets, at = [], 0
        for page in self.pages[group]:
            offsets.append(at)
            at += page
        return tuple(offsets)

    def check_fits(self, slot_bytes: int) -> None:
        """Raise :class:`SlotTooSmall` when a chunk of some group exceeds a slot."""
        for group in range(len(self.pages)):
            need = self.chunk_bytes(group)
            if need > slot_bytes:
                raise SlotTooSmall(
                    f"a chunk of KV cache group {group} is {need} bytes and the daemon's "
                    f"offload slots are {slot_bytes}: raise [offload] slot_bytes to at "
                    f"least {need}, or lower the connector's block_size"
                )


def chunk_slots(block_index: int, count: int, blocks_per_chunk: int) -> list[tuple[int, int]]:
    """(chunk, block within the chunk) of each of ``count`` blocks from ``block_index``.

    vLLM hands a transfer a group's blocks from ``block_index`` (the first
    block's index in the request), which may lie inside a chunk: the chunks
    are counted from the one that holds it.
    """
    skip = block_index % blocks_per_chunk
    return [divmod(skip + i, blocks_per_chunk) for i in range(count)]


def chain_seed(hash_algo: str, environ: Mapping[str, str] = os.environ) -> str:
    """The seed of this instance's block hash chain, as vLLM resolves it.

    A seed random per process (a non-cryptographic hash with no
    PYTHONHASHSEED) is returned as fresh random bytes: a namespace nobody
    else, not even this instance restarted, ever shares.
    """
    seed = environ.get("PYTHONHASHSEED")
    if seed is not None:
        return f"env:{seed}"
    if hash_algo in _PER_PROCESS_SEED:
        return "random:" + os.urandom(16).hex()
    return _DEFAULT_SEED


def namespace(fingerprint: Fingerprint, geometry: ChunkGeometry, hash_algo: str, seed: str) -> str:
    """The digest two engines must share to read each other's chunks."""
    encoded = msgspec.msgpack.encode((TIER_LAYOUT, fingerprint, geometry, hash_algo, seed))
    return hashlib.blake2b(encoded, digest_size=16).hexdigest()
