"""Which prompt blocks a vLLM request names to the daemon, and their content hashes.

Both sides of a transfer name their blocks with the content hash vLLM itself
gives a block for prefix caching (``hash_block_tokens`` chained from the
first block, over the block's tokens and ``generate_block_hash_extra_keys``:
LoRA adapter, multimodal inputs, prompt embeddings, cache salt), computed
here whether or not prefix caching is on, with a chain seed of kvpushd's own
(vLLM's ``NONE_HASH`` is random per process unless ``PYTHONHASHSEED`` is
set: two instances would never agree). The last block of a prompt that does
not fill it is hashed over the tokens it holds. The prefill daemon pairs a
decode block only with a prefill block of equal hash at the position the
tail trim pairs it with (statemachine/content.py).

Only the prompt's blocks are ever named: a prefill that computed beyond its
prompt (``max_tokens`` > 1, a preemption and resume, speculative tokens)
pushes the blocks that cover the prompt, and a decode names only those too
(an allocation's lookahead blocks hold nothing to load).

The selection (:func:`prompt_blocks`, :func:`unhashed_prompt_blocks`) and the
wire form are plain Python; only :func:`block_hashes` calls into vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from daemon.client.vllm.adapters import adapter_key
from daemon.client.vllm.layout import NULL_BLOCK, Blocks
from statemachine.content import HASH_HEX, GroupHashes, encode

# The chain's seed: the parent of every prompt's first block, the same in
# every instance (a versioned name: a change of what is hashed changes it).
CHAIN_SEED: Final = "kvpushd-block-hash-v1"

# A group's blocks as the request names them: the prompt block of the first
# one, and the block ids (each the next prompt block).
Named = tuple[int, tuple[int, ...]]


class NotOneRun(ValueError):
    """A group's blocks to name are not one run of prompt positions (the message says which)."""


def prompt_block_count(prompt_len: int, block_size: int) -> int:
    """How many blocks cover a prompt of ``prompt_len`` tokens (the last may be partial)."""
    return -(-prompt_len // block_size)


def prompt_blocks(
    block_ids: Sequence[Sequence[int]],
    windows: Sequence[int],
    count: int,
    states: Sequence[bool] = (),
) -> tuple[Named, ...]:
    """A finished prefill's blocks to push: per group, those covering the prompt.

    ``block_ids``: vLLM's per-group lists, position 0 first (what
    ``request_finished`` gets); ``count``: the prompt's blocks. Blocks past
    the prompt (tokens generated after it) are never pushed; a sliding-window
    group's null blocks (out of its window) hold nothing to push. A state
    group (``states``, Mamba/SSM) pushes its running state: its last block.
    """
    if len(block_ids) != len(windows):
        raise ValueError(f"{len(block_ids)} block lists for {len(windows)} KV cache groups")
    return tuple(
        _state_block(ids)
        if state
        else _one_run(
            [(pos, b) for pos, b in enumerate(ids[:count]) if not (window and b == NULL_BLOCK)],
            index,
        )
        for index, (ids, window, state) in enumerate(
            zip(block_ids, windows, _kinds(states, len(windows)), strict=True)
        )
    )


def unhashed_prompt_blocks(
    groups: Sequence[Sequence[Any]], count: int, states: Sequence[bool] = ()
) -> tuple[Named, ...]:
    """A decode's blocks to load: per group, the prompt's blocks its own cache lacks.

    ``groups``: vLLM's ``KVCacheBlocks.blocks`` (per group, position 0 first);
    a block with a prefix-cache hash is a local hit, a null block is outside
    a sliding window, and a block at or past ``count`` is no prompt block.
    A state group (``states``) loads into its last block, the one vLLM's
    kernels read the running state from.
    """
    return tuple(
        _state_block([b.block_id for b in group])
        if state
        else _one_run(
            [
                (pos, block.block_id)
                for pos, block in enumerate(group[:count])
                if block.block_hash is None and not block.is_null
            ],
            index,
        )
        for index, (group, state) in enumerate(
            zip(groups, _kinds(states, len(groups)), strict=True)
        )
    )


def _kinds(states: Sequence[bool], groups: int) -> Sequence[bool]:
    """Which of ``groups`` groups hold state; none when the caller names none (``()``)."""
    return states or (False,) * groups


def _state_block(ids: Sequence[int]) -> Named:
    """A state group's one block to move: its last non-null one (vLLM's running state).

    In mamba_cache_mode "none" (the one client.vllm.layout.check_supported lets
    through) a request holds exactly one; its position names no token.
    """
    held = [b for b in ids if b != NULL_BLOCK]
    return (0, (held[-1],)) if held else (0, ())


def _one_run(positioned: list[tuple[int, int]], group: int) -> Named:
    if not positioned:
        return (0, ())
    first = positioned[0][0]
    if positioned[-1][0] - first + 1 != len(positioned):
        raise NotOneRun(
            f"group {group}: the blocks to name sit at prompt blocks "
            f"{[pos for pos, _ in positioned]}, not one run"
        )
    return (first, tuple(b for _, b in positioned))


def ids_of(named: Sequence[Named]) -> Blocks:
    """The block ids alone, per group."""
    return tuple(ids for _, ids in named)


def content(named: Sequence[Named], hashes: Sequence[str], states: Sequence[bool] = ()) -> str:
    """The registration's content: each named block's hash (``hashes``: one per prompt block).

    A state group's block (Mamba/SSM) holds the state after every hashed
    token: it is named as the last prompt block, with that block's chain
    hash (the hash of every token the state consumed), so the daemon pairs
    it as it pairs an attention block, and two prompts' states differ
    whatever else the model has (a Mamba-only model, both legs at once).
    """
    return encode(
        tuple(
            _state(ids, hashes)
            if state
            else GroupHashes(first, tuple(hashes[first : first + len(ids)]))
            for (first, ids), state in zip(named, _kinds(states, len(named)), strict=True)
        )
    )


def _state(ids: Sequence[int], hashes: Sequence[str]) -> GroupHashes:
    """A state group's name: the last prompt block, the chain hash of the tokens its state took."""
    if not ids:
        return GroupHashes(0, ())
    # No token hashed (never sent: a load needs one): the state of no token.
    return GroupHashes(max(len(hashes) - 1, 0), (hashes[-1] if hashes else "0" * HASH_HEX,))


def block_hashes(request: Any, block_size: int, count: int, length: int | None = None) -> list[str]:
    """The content hash of each of a vLLM request's first ``count`` prompt blocks (hex).

    vLLM's own chained block hash (SHA-256 over CBOR, as its ``sha256_cbor``
    prefix-caching option), seeded with :data:`CHAIN_SEED`; kept to
    HASH_HEX hex digits on the wire, the chain runs on the whole hash.
    ``length``: hash the prompt's first ``length`` tokens only (a decode
    that computes the last prompt token itself names the blocks of the rest).
    """
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens

    tokens = request.prompt_token_ids or ()
    if length is not None:
        tokens = tokens[:length]
    parent = sha256_cbor(CHAIN_SEED)
    mm_index = 0
    hashes = []
    # vLLM keys an adapter by name and path: its content goes in the first
    # block's extra keys too (adapters.py), and the chain carries it on.
    adapter = adapter_key(request)
    for index in range(count):
        start = index * block_size
        end = min(start + block_size, len(tokens))
        extra, mm_index = generate_block_hash_extra_keys(request, start, end, mm_index)
        if index == 0 and adapter is not None:
            extra = (*(extra or ()), adapter)
        parent = hash_block_tokens(sha256_cbor, parent, tokens[start:end], extra)
        hashes.append(bytes(parent).hex()[:HASH_HEX])
    return hashes
