"""A Mamba hybrid (a tiny Nemotron-H) through kvpushd: its SSM state moves beside its KV.

vLLM gives the model two Mamba groups (one per Mamba layer) and one
attention group, laid over one pool of 128 KiB pages. A request holds one
state block per Mamba group (mamba_cache_mode "none": prefix caching off),
updated in place with every token it computes. The prefill computes the
prompt but its last token (the connector cuts it, as vLLM's NixlConnector
does), pushes its attention blocks and its two state pages; the decode
loads N-1 tokens and applies the last one itself. Applied on both sides, a
state takes that token twice and every output differs
(docs/mamba-on-vllm-cpu.md).

The oracle: the prefill instance asked alone (no prefix cache to hit).
Both daemons check every write end to end (``verify = "all"``). The
negative control: the decode's first load names its two state blocks the
other way round (``connector.swap_states``): each Mamba layer starts from
the other's state, which no block hash can see (both states took the same
tokens), and the tokens change.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from split_pairs import TOKENS, Shape, Side, split_pair

from daemon.sim.launcher import wait_idle
from harness.tinynemotron import write_tinynemotron
from harness.vllm_router import prefill_leg, route_concurrent
from schemas.events import Failed, Registered, Released, WriteDone, WriteStarted
from schemas.reasons import Reason

EXTERNAL_TOKENS = "vllm:prompt_tokens_by_source_total"
NO_PREFIX_CACHE = ("--no-enable-prefix-caching",)
BLOCK = 32


@pytest.fixture(scope="module")
def mamba_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Side]]:
    model = write_tinynemotron(tmp_path_factory.mktemp("tiny-nemotron"))
    shapes = [
        Shape("prefill", block_size=BLOCK, args=NO_PREFIX_CACHE),
        Shape(
            "decode",
            block_size=BLOCK,
            args=NO_PREFIX_CACHE,
            env={"KVPUSHD_FAILPOINTS": "connector.swap_states=corrupt@1"},
        ),
    ]
    with split_pair(model, tmp_path_factory.mktemp("pd-mamba"), shapes) as sides:
        yield sides


def test_swapped_states_change_the_tokens(mamba_pair: list[Side]) -> None:
    """The control first (the decode's first load): each layer gets the other's state."""
    (p, prefill), (d, decode) = mamba_pair
    prompt = [(13 * i) % 509 + 2 for i in range(200)]
    single = p.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt)
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids != single
    wait_idle(prefill, decode, timeout=10)
    # It was loaded, not computed: the daemon wrote it.
    kinds = [type(e) for e in decode.journal_events(sent["kvpushd_transfer_id"])]
    assert WriteDone in kinds, kinds


def test_state_and_kv_token_exact_at_many_lengths(mamba_pair: list[Side]) -> None:
    (p, prefill), (d, decode) = mamba_pair
    rng = random.Random(36)
    verified = decode.status()["counters"]["integrity_blocks_verified"]
    # Attention blocks of 32 tokens (a Mamba page is padded to their 32 KiB).
    for length in (2, 3, 32, 33, 34, 100, 200, 257, 600):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        single = p.complete(prompt, TOKENS).token_ids
        # A prefill leg asking for more tokens than the contract's 1 computes the same.
        sent = prefill_leg(p, prompt, max_tokens=3 if length == 100 else 1)
        # The prefill computed (and names) the prompt but its last token.
        assert sent["kvpushd_prompt_len"] == length - 1, sent
        before = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
        assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single, length
        loaded = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer") - before
        assert loaded == length - 1, (length, loaded)
        wait_idle(prefill, decode)
        events = decode.journal_events(sent["kvpushd_transfer_id"])
        kinds = [type(e) for e in events]
        assert WriteDone in kinds and kinds[-1] is Released, (length, kinds)
        (registered,) = [e for e in events if isinstance(e, Registered)]
        # Two state blocks (one per Mamba layer) beside the attention blocks.
        attention = -(-(length - 1) // BLOCK)
        assert [len(ids) for ids in registered.blocks] == [1, 1, attention], registered
    counters = decode.status()["counters"]
    assert counters["integrity_mismatches"] == 0
    assert counters["integrity_blocks_verified"] > verified, counters


def test_both_legs_at_once_and_a_one_token_prompt(mamba_pair: list[Side]) -> None:
    (p, prefill), (d, decode) = mamba_pair
    rng = random.Random(37)
    for length in (1, 64, 300):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        single = p.complete(prompt, TOKENS).token_ids
        before = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
        address = f"127.0.0.1:{prefill.port}"
        routed = route_concurrent(
            p, d, prompt, TOKENS, prefill_node=prefill.node, prefill_address=address
        )
        assert routed.token_ids == single, length
        loaded = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer") - before
        # A 1-token prompt has no state before its last token: the decode computes it.
        assert loaded == max(length - 1, 0), (length, loaded)
        wait_idle(prefill, decode, timeout=10)


def test_both_legs_at_once_with_another_prompt_on_the_decode_is_refused_by_the_state(
    mamba_pair: list[Side],
) -> None:
    """A router sends the decode another prompt (the same first half), both legs at once.

    The decode has no prefill answer to compare (no digest): the prefill
    daemon's pairing check is the only one. Each state group names the
    chain hash of the tokens its state took, and the model's first group is
    a state: the refusal names it (before issue 47 a state was named ``-``,
    unchecked, and only the attention group, group 2, refused this). The
    load fails and vLLM computes the decode's prompt, state included.
    """
    (p, prefill), (d, decode) = mamba_pair
    rng = random.Random(38)
    prompt = [rng.randrange(2, 512) for _ in range(120)]
    other = prompt[:60] + [rng.randrange(2, 512) for _ in range(60)]
    single = d.complete(other, TOKENS).token_ids
    assert single == p.complete(other, TOKENS).token_ids
    address = f"127.0.0.1:{prefill.port}"
    routed = route_concurrent(
        p, d, prompt, TOKENS, prefill_node=prefill.node, prefill_address=address,
        decode_prompt=other,
    )  # fmt: skip
    assert routed.token_ids == single
    wait_idle(prefill, decode, timeout=10)
    transfer = str(routed.params["transfer_id"])
    kinds = [type(e) for e in decode.journal_events(transfer)]
    assert kinds and WriteDone not in kinds and kinds[-1] is Released, kinds
    events = prefill.journal_events(transfer)
    (failed,) = [e for e in events if isinstance(e, Failed)]
    assert failed.reason is Reason.CONTENT_MISMATCH, failed
    assert failed.message.startswith("group 0: "), failed  # a Mamba layer's state
    assert not [e for e in events if isinstance(e, WriteStarted)]
