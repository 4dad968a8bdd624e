"""Block hashes pair a decode's blocks with the prefill's (statemachine/content.py).

The trim says which blocks move; the hashes prove the two block lists hold
the same prompt positions. Properties over generated prompts: a decode with
any prefix hit pairs with the prefill that computed the same prompt, and
any shift, another prompt, or another adapter (other hashes) is refused
before the trim pairs anything, naming the first block that differs.
"""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from daemon.client.vllm.hashes import (
    NotOneRun,
    content,
    prompt_block_count,
    prompt_blocks,
    unhashed_prompt_blocks,
)
from daemon.client.vllm.layout import NULL_BLOCK
from schemas.reasons import Reason
from statemachine.content import (
    GroupHashes,
    check_counts,
    check_pairing,
    decode,
    encode,
)
from statemachine.errors import Refusal, TrimRefused


def _chain(tokens: list[int], block: int, salt: str = "") -> list[str]:
    """Chained hashes of a prompt's blocks (the shape of vLLM's; sha256 here)."""
    parent, out = salt.encode(), []
    for start in range(0, len(tokens), block):
        parent = hashlib.sha256(parent + repr(tokens[start : start + block]).encode()).digest()
        out.append(parent.hex()[:16])
    return out


def test_the_wire_form_round_trips_and_names_unhashed_groups() -> None:
    groups = (GroupHashes(3, ("a" * 16, "b" * 16)), None, GroupHashes(0, ()))
    assert decode("r", encode(groups)) == groups
    assert decode("r", "") is None
    assert decode("r", "0123456789abcdef0123456789abcdef") is None  # a digest


@pytest.mark.parametrize(
    "bad", ["bh1:x.00", "bh1:1.0", "bh1:1", "bh1:1.zzzzzzzzzzzzzzzz", "bh1:1.ABCDEF0123456789"]
)
def test_a_block_hash_form_that_does_not_parse_is_refused(bad: str) -> None:
    with pytest.raises(Refusal) as refused:
        decode("r", bad)
    assert refused.value.reason is Reason.BLOCK_OUT_OF_RANGE


def test_hashes_must_name_exactly_the_blocks_listed() -> None:
    named = encode((GroupHashes(0, ("0" * 16, "1" * 16)),))
    check_counts("r", named, (2,))
    with pytest.raises(Refusal) as refused:
        check_counts("r", named, (3,))
    assert refused.value.reason is Reason.BLOCK_COUNT_MISMATCH
    with pytest.raises(Refusal) as refused:
        check_counts("r", named, (2, 2))
    assert refused.value.reason is Reason.GROUP_COUNT_MISMATCH


@given(
    st.lists(st.integers(0, 511), min_size=1, max_size=300),
    st.sampled_from([16, 32, 64]),
    st.data(),
)
def test_a_decode_with_any_prefix_hit_pairs_with_the_prefill_of_its_prompt(
    tokens: list[int], block: int, data: st.DataObject
) -> None:
    hashes = _chain(tokens, block)
    count = prompt_block_count(len(tokens), block)
    assert len(hashes) == count
    hit = data.draw(st.integers(0, count - 1))
    prefill = content(((0, tuple(range(100, 100 + count))),), hashes)
    decode_side = content(((hit, tuple(range(hit, count))),), hashes)
    check_pairing("r", prefill, decode_side)


@given(
    st.lists(st.integers(0, 511), min_size=2, max_size=300),
    st.sampled_from([16, 32]),
    st.integers(1, 3),
    st.data(),
)
def test_a_prefill_that_names_other_positions_is_refused(
    tokens: list[int], block: int, shift: int, data: st.DataObject
) -> None:
    """The prefill names blocks ``shift`` positions off: a push past the prompt, or short of it."""
    hashes = _chain(tokens, block)
    count = len(hashes)
    hit = data.draw(st.integers(0, count - 1))
    decode_side = content(((hit, tuple(range(hit, count))),), hashes)
    longer = _chain(tokens + [7] * block * shift, block)  # generated past the prompt
    pushed_past = content(((0, tuple(range(len(longer)))),), longer)
    with pytest.raises(TrimRefused) as refused:
        check_pairing("r", pushed_past, decode_side)
    assert refused.value.reason is Reason.CONTENT_MISMATCH
    assert f"the decode's block for prompt block {hit}" in str(refused.value)
    if count > shift:
        short = content(((0, tuple(range(count - shift))),), hashes)
        with pytest.raises(TrimRefused) as refused:
            check_pairing("r", short, decode_side)
        assert refused.value.reason is Reason.CONTENT_MISMATCH


@given(st.lists(st.integers(0, 511), min_size=1, max_size=200), st.integers(0, 199))
def test_another_prompt_or_adapter_is_refused_at_its_first_differing_block(
    tokens: list[int], changed: int
) -> None:
    block = 32
    other = list(tokens)
    changed %= len(tokens)
    other[changed] = (other[changed] + 1) % 512
    count = len(_chain(tokens, block))
    prefill = content(((0, tuple(range(count))),), _chain(tokens, block))
    for decode_hashes in (_chain(other, block), _chain(tokens, block, salt="lora:a")):
        decode_side = content(((0, tuple(range(count))),), decode_hashes)
        with pytest.raises(TrimRefused) as refused:
            check_pairing("r", prefill, decode_side)
        assert refused.value.reason is Reason.CONTENT_MISMATCH
    # Another token: the chain differs from that token's block on.
    decode_side = content(((0, tuple(range(count))),), _chain(other, block))
    with pytest.raises(TrimRefused, match=f"prompt block {changed // block} "):
        check_pairing("r", prefill, decode_side)


def test_a_side_that_names_nothing_or_an_unhashed_group_is_not_checked() -> None:
    hashes = encode((GroupHashes(0, ("0" * 16,)), None))
    check_pairing("r", hashes, "")
    check_pairing("r", "", hashes)
    other = encode((GroupHashes(0, ("0" * 16,)), GroupHashes(0, ("1" * 16,))))
    check_pairing("r", hashes, other)  # group 1 unhashed on one side
    with pytest.raises(TrimRefused):
        check_pairing("r", hashes, "digest-of-something")


def test_a_prefill_pushes_only_the_prompts_blocks() -> None:
    """max_tokens 2 at 64 tokens: vLLM's list holds a third block; it is never pushed."""
    count = prompt_block_count(64, 32)
    assert count == 2
    assert prompt_blocks(([7, 8, 9],), (0,), count) == ((0, (7, 8)),)
    # A sliding-window group: its null blocks (out of the window) are not named.
    window = ([NULL_BLOCK] * 7 + [26, 27, 28], list(range(29, 39)))
    assert prompt_blocks(window, (48, 0), 10) == ((7, (26, 27, 28)), (0, tuple(range(29, 39))))
    # Block 0 of a full-attention group is a real block.
    assert prompt_blocks(([0, 5],), (0,), 2) == ((0, (0, 5)),)
    with pytest.raises(ValueError, match="2 block lists for 1"):
        prompt_blocks(([1], [2]), (0,), 1)


def test_a_state_group_pushes_its_running_state_named_by_the_tokens_it_took() -> None:
    """A Mamba group holds one state block per request: the last, whatever the prompt's length."""
    count = prompt_block_count(99, 32)
    groups = ([41], [42], [7, 8, 9, 10, 11])
    named = prompt_blocks(groups, (0, 0, 0), count, (True, True, False))
    assert named == ((0, (41,)), (0, (42,)), (0, (7, 8, 9, 10)))
    # Null blocks before it (vLLM's other Mamba modes) are never the state.
    assert prompt_blocks(([NULL_BLOCK, 43],), (0,), 1, (True,)) == ((0, (43,)),)
    assert prompt_blocks(([],), (0,), 1, (True,)) == ((0, ()),)
    hashes = [f"{i:016x}" for i in range(count)]
    wire = content(named, hashes, (True, True, False))
    # Each state: the last prompt block and its chain hash (every token the state took).
    last = f"{count - 1}.{hashes[-1]}"
    assert wire == f"bh1:{last}/{last}/0." + "".join(hashes)
    state = GroupHashes(count - 1, (hashes[-1],))
    assert decode("r", wire) == (state, state, GroupHashes(0, tuple(hashes)))
    # A state group that names no block names no hash.
    assert content(((0, ()),), hashes, (True,)) == "bh1:0."
    check_counts("r", wire, (1, 1, count))
    # The form connectors before issue 47 sent for a state ("-") is still read, unchecked.
    check_pairing("r", "bh1:-", "bh1:-")
    check_pairing("r", "bh1:-", wire.split("/")[0])


MAMBA_ONLY = (True,)


@given(
    st.lists(st.integers(0, 511), min_size=1, max_size=300),
    st.sampled_from([32, 1024]),
    st.integers(0, 299),
    st.integers(-2, 2),
)
def test_a_state_pairs_only_with_the_state_of_the_same_tokens(
    tokens: list[int], block: int, changed: int, grown: int
) -> None:
    """A Mamba-only model: nothing but the state names the prompt, and it refuses another one.

    The prefill's state took its prompt but the last token, and the decode
    loads exactly that state: the two sides hash the same tokens. Another
    token anywhere, or another length (a prompt of 1024 tokens and less is
    one block at block size 1024), is refused; the same tokens pair.
    """
    named = ((0, (41,)),)
    prefill = content(named, _chain(tokens, block), MAMBA_ONLY)
    check_pairing("r", prefill, content(((0, (7,)),), _chain(tokens, block), MAMBA_ONLY))
    other = list(tokens)
    other[changed % len(tokens)] = (other[changed % len(tokens)] + 1) % 512
    longer = tokens + [3] * grown if grown > 0 else tokens[: len(tokens) + grown]
    for decode_tokens in (other, longer):
        if decode_tokens == tokens or not decode_tokens:
            continue
        decode_side = content(((0, (7,)),), _chain(decode_tokens, block), MAMBA_ONLY)
        with pytest.raises(TrimRefused) as refused:
            check_pairing("r", prefill, decode_side)
        assert refused.value.reason is Reason.CONTENT_MISMATCH
        assert "group 0: " in str(refused.value)


class _Block:
    """The two fields of vLLM's KVCacheBlock the selection reads (vLLM is not in this venv)."""

    def __init__(self, block_id: int, hashed: bool = False) -> None:
        self.block_id = block_id
        self.block_hash = b"h" if hashed else None
        self.is_null = block_id == NULL_BLOCK


def test_a_decode_names_the_prompt_blocks_its_own_cache_lacks() -> None:
    group = [_Block(4, hashed=True), _Block(5, hashed=True), _Block(6), _Block(7), _Block(8)]
    # Prompt of 4 blocks: the fifth is lookahead, never named.
    assert unhashed_prompt_blocks([group], 4) == ((2, (6, 7)),)
    window = [_Block(NULL_BLOCK), _Block(NULL_BLOCK), _Block(9), _Block(10)]
    assert unhashed_prompt_blocks([window], 4) == ((2, (9, 10)),)
    with pytest.raises(NotOneRun):
        unhashed_prompt_blocks([[_Block(3), _Block(4, hashed=True), _Block(5)]], 3)
    # A state group loads into its last block, whatever the prompt's block count.
    state = [_Block(NULL_BLOCK), _Block(12)]
    assert unhashed_prompt_blocks([state, group], 4, (True, False)) == ((0, (12,)), (2, (6, 7)))
