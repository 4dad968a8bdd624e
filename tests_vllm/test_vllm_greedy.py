"""A real vLLM on the tiny seeded llama is a usable oracle for KV transfer tests.

Greedy tokens repeat across requests and across two instances (each pinned
to its own core), and they depend on the whole prompt: changing one token
changes them. That last property is why the checkpoint is written from a
seed (harness/tinyllama.py) instead of vLLM's dummy weights, whose output
ignores the context: a decode instance fed wrong KV must produce different
tokens, or a P/D test could not fail.
"""

from __future__ import annotations

import random
import time

from harness.vllm_servers import VllmServer, affinities

TOKENS = 16
_rng = random.Random(12)
PROMPT = [_rng.randrange(2, 512) for _ in range(64)]
PROMPTS = [PROMPT[:8], PROMPT, [_rng.randrange(2, 512) for _ in range(200)]]


def test_greedy_tokens_repeat_across_requests(vllm_pair: tuple[VllmServer, VllmServer]) -> None:
    a, _ = vllm_pair
    first = a.complete(PROMPT, TOKENS)
    second = a.complete(PROMPT, TOKENS)
    assert first.prompt_token_ids == PROMPT
    assert first.finish_reason == "length"
    assert len(first.token_ids) == TOKENS
    assert first.token_ids == second.token_ids
    # Not a degenerate model that repeats one token whatever it is fed.
    assert len(set(first.token_ids)) > TOKENS // 2


def test_changing_one_prompt_token_changes_the_tokens(
    vllm_pair: tuple[VllmServer, VllmServer],
) -> None:
    """The oracle can fail: the first (furthest) and a middle token each matter."""
    a, _ = vllm_pair
    base = a.complete(PROMPT, TOKENS).token_ids
    for position in (0, len(PROMPT) // 2):
        changed = list(PROMPT)
        changed[position] = 2 + (changed[position] - 1) % 510  # another id in 2..511
        assert changed != PROMPT
        assert a.complete(changed, TOKENS).token_ids != base, position


def test_two_instances_give_bit_equal_greedy_tokens(
    vllm_pair: tuple[VllmServer, VllmServer],
) -> None:
    a, b = vllm_pair
    for prompt in PROMPTS:
        ours = a.complete(prompt, TOKENS)
        theirs = b.complete(prompt, TOKENS)
        assert ours.token_ids == theirs.token_ids, len(prompt)
    assert a.complete(PROMPTS[0], TOKENS).token_ids != a.complete(PROMPTS[2], TOKENS).token_ids


def test_every_thread_of_each_server_is_pinned_to_its_core(
    vllm_pair: tuple[VllmServer, VllmServer],
) -> None:
    for server in vllm_pair:
        server.pin()
        pids = server.pids()
        assert len(pids) >= 3, pids  # the API server, its engine core, the worker
        cores = affinities(pids)
        assert cores and set(map(frozenset, cores.values())) == {frozenset({server.core})}


def test_metrics_count_the_prompt_tokens_computed_locally(
    vllm_pair: tuple[VllmServer, VllmServer],
) -> None:
    """What P/D tests will read: prompt tokens by source (here all computed locally)."""
    _, b = vllm_pair
    name = "vllm:prompt_tokens_by_source_total"
    prompt = [random.Random(99).randrange(2, 512) for _ in range(96)]  # never sent before
    before = b.metrics()
    assert name in before.names()
    b.complete(prompt, 2)
    deadline = time.monotonic() + 10
    while True:
        after = b.metrics()
        delta = {
            source: after.total(name, source=source) - before.total(name, source=source)
            for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
        }
        if sum(delta.values()) >= len(prompt) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert delta == {
        "local_compute": len(prompt),
        "local_cache_hit": 0,
        "external_kv_transfer": 0,
    }
