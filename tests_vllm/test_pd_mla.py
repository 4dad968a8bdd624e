"""An MLA model (a tiny DeepSeek-V2) through kvpushd, at TP 2 -> 1 and 1 -> 2.

MLA caches one latent per token (512 + 64 floats), the same on every TP
rank: one replicated "head" (daemon/client/vllm/layout.py ``kv_heads``), so
each decode rank is fed by exactly one prefill rank. TP 2 -> 1: prefill
rank 0 writes the decode's blocks, rank 1's replica is forgone (its push
ends at once, nothing written). TP 1 -> 2 (the router names the decode's TP
on the prefill leg): the one prefill rank writes each decode rank's blocks
whole, one share per rank. Both instances are kv_both (either may prefill),
each daemon checks every write end to end (``verify = "all"``), block size
16 (vLLM's CPU MLA backend forces it).

The oracle: a single instance computing the prompt (the prefill instance
asked alone; vLLM's CPU build turns prefix caching off for MLA, so it never
reads a cached prefix). Every server runs vLLM's pure-torch rotary
embedding (``custom_ops: -rotary_embedding``): the CPU build's rotary op
mis-indexes MLA's 3-D query and rope-key views, so as shipped the tokens
depend on how the tokens of a forward pass are batched, and a P/D decode,
which computes the last prompt token alone, differed from a single
instance for a reason that is not the KV (34 of 36 prompts, through vLLM's
own NixlConnector as well; docs/mla-on-vllm-cpu.md). The negative control: the
TP 1 instance's first load registers its blocks in reverse
(``connector.reverse_group``), and the tokens change.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from split_pairs import TOKENS, Shape, Side, load_split_across_ranks, split_pair

from daemon.sim.launcher import wait_idle
from harness.tinydeepseek import SERVER_ARGS, write_tinydeepseek
from harness.vllm_router import prefill_leg
from schemas.events import Released

# vLLM's own rope (forward_native) instead of the CPU op that breaks MLA, and
# its reference CPU MLA backend whatever the CPU (harness/tinydeepseek.py).
ROPE = SERVER_ARGS
BLOCK = 16
CHECKS = "vllm:kvpushd_kv_checks_total"


@pytest.fixture(scope="module")
def mla_sides(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Side]]:
    model = write_tinydeepseek(tmp_path_factory.mktemp("tiny-deepseek"))
    shapes = [
        Shape("two", tp=2, block_size=BLOCK, args=ROPE),
        Shape(
            "one",
            block_size=BLOCK,
            args=ROPE,
            env={"KVPUSHD_FAILPOINTS": "connector.reverse_group=corrupt@1"},
        ),
    ]
    with split_pair(model, tmp_path_factory.mktemp("pd-mla"), shapes) as sides:
        yield sides


def test_a_misplaced_latent_is_caught_by_the_decodes_own_kv_and_recomputed(
    mla_sides: list[Side],
) -> None:
    """The control (the TP 1 instance's first load): its blocks named in reverse.

    Served, the misplaced latents change the tokens; the decode's own K/V of
    the last token differs from what landed there (kvcheck.py), so vLLM
    recomputes the prompt and the client gets the single instance's tokens.
    """
    (p, prefill), (d, decode) = mla_sides
    prompt = [(11 * i) % 509 + 2 for i in range(100)]
    single = p.complete(prompt, TOKENS).token_ids
    caught = d.metrics().total(CHECKS, result="kv_mismatch")
    sent = prefill_leg(p, prompt)
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    assert d.metrics().total(CHECKS, result="kv_mismatch") == caught + 1
    wait_idle(prefill, decode, timeout=10)
    # The pairing was quarantined for it: an operator's clear lets the next loads in.
    assert prefill.clear_quarantine()


def test_tp2_to_tp1_one_prefill_rank_writes_each_latent(mla_sides: list[Side]) -> None:
    two, one = mla_sides
    rng = random.Random(21)
    for length in (BLOCK - 1, BLOCK, BLOCK + 1, 100, 10 * BLOCK + 1, 300):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        engines = load_split_across_ranks(two, one, prompt, ("@tp0",))
        assert len(engines.prefill) == 1 and len(engines.decode) == 1, engines
    # The other prefill rank's replica is forgone at once: no byte written, released on both
    # sides (its receiver of no block was refused by its own daemon before: it held the
    # prefill's blocks to the push's deadline).
    (p, prefill), (d, decode) = two, one
    prompt = [rng.randrange(2, 512) for _ in range(64)]
    sent = prefill_leg(p, prompt)
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == (
        p.complete(prompt, TOKENS).token_ids
    )
    wait_idle(prefill, decode, timeout=10)  # well before any deadline
    for daemon in (prefill, decode):
        replica = daemon.journal_events(f"{sent['kvpushd_transfer_id']}@tp1")
        assert replica and isinstance(replica[-1], Released), (daemon.node, replica)
        # Paired with a receiver of no block: a write of nothing.
        assert [getattr(e, "nbytes", 0) for e in replica] == [0] * len(replica), replica


def test_tp1_to_tp2_the_prefill_rank_writes_each_decode_rank_whole(
    mla_sides: list[Side],
) -> None:
    two, one = mla_sides
    rng = random.Random(22)
    for length in (BLOCK + 1, 99, 257):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        engines = load_split_across_ranks(one, two, prompt, ("@tp0", "@tp1"), decode_tp=2)
        # One prefill engine (no slice: the latent is whole on each rank), two decode ranks.
        assert len(engines.prefill) == 1 and len(engines.decode) == 2, engines


def test_no_rope_warning_where_vllms_own_rope_is_started(mla_sides: list[Side]) -> None:
    """Every server here runs with ``custom_ops: -rotary_embedding``: the connector says nothing.

    Without it the scheduler side logs one line naming the flag and
    docs/mla-on-vllm-cpu.md (tests/test_mla_rope_warning.py, and
    tests_vllm/test_mla_rope_warning_vllm.py on vLLM's resolved config).
    """
    for server, _ in mla_sides:
        log = server.log.read_text(errors="replace")
        assert "kvpushd: engine " in log  # the connector's own lines reach this log
        assert "custom_ops: -rotary_embedding" not in log
