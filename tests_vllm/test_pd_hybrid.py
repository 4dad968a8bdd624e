"""A hybrid model (a sliding-window layer beside a full-attention one) through kvpushd.

vLLM's hybrid allocator gives the tiny llama's sliding-window layer (48
tokens) and its full-attention layer a KV cache group each, laid over the
same tensors (the decode side stages them through a host mirror,
``kv_buffer = "host"``). KvpushdConnector implements ``SupportsHMA``: both groups
move, the sliding-window group only inside its window (vLLM has put its
null block in place of the rest on both sides), and the daemons own a
block once across the two groups (statemachine/overlay.py). The oracle: a
single instance's greedy tokens for the same prompt (the prefill instance
asked without transfer parameters: same weights).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from daemon.journal.replay import replay
from daemon.sim.launcher import Daemon, wait_idle
from harness.tinyllama import TinyLlama, write_tinyllama
from harness.vllm_router import prefill_leg
from harness.vllm_servers import VllmServer, kvpushd_pd
from schemas.events import Registered, WriteDone

TOKENS = 8
WINDOW = 48  # tokens; blocks hold 32
EXTERNAL = "vllm:prompt_tokens_by_source_total"

PD = tuple[VllmServer, VllmServer, Daemon, Daemon]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    model = write_tinyllama(
        tmp_path_factory.mktemp("hybrid-llama"),
        TinyLlama(sliding_layers=(0,), sliding_window=WINDOW),
    )
    with kvpushd_pd(
        model,
        tmp_path_factory.mktemp("pd-hybrid"),
        # The negative controls: the decode's first load lands its window's
        # blocks misplaced; its second is never copied into vLLM's cache.
        decode_server_env={
            "KVPUSHD_FAILPOINTS": (
                "connector.reverse_group=corrupt@1,connector.skip_stage_in=corrupt@2"
            )
        },
        # The decode stages through a host mirror (kv_buffer "host"), the
        # prefill maps vLLM's cache itself: both modes meet in one pair.
        decode_extra_config={"kv_buffer": "host"},
    ) as pair:
        yield pair


CHECKS = "vllm:kvpushd_kv_checks_total"


def _external(d: VllmServer) -> float:
    return d.metrics().total(EXTERNAL, source="external_kv_transfer")


def test_both_groups_move_the_window_only_inside_it_token_exact(hybrid: PD) -> None:
    p, d, prefill, decode = hybrid
    rng = random.Random(61)
    # The controls first: the window's blocks misplaced, then a load whose
    # blocks never reach vLLM's cache from the mirror: each changes the tokens.
    for control in ("reverse_group", "skip_stage_in"):
        prompt = [rng.randrange(2, 512) for _ in range(200)]
        single = p.complete(prompt, TOKENS).token_ids
        caught = d.metrics().total(CHECKS, result="kv_mismatch")
        sent = prefill_leg(p, prompt)
        assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids != single, control
        # The decode's own K/V caught it (a model of two KV cache groups: vLLM
        # takes no load error for a running request, so the tokens were served);
        # the pairing was quarantined, and an operator's clear lets loads in again.
        assert d.metrics().total(CHECKS, result="kv_mismatch") == caught + 1, control
        wait_idle(prefill, decode, timeout=10)
        assert prefill.clear_quarantine(), control
    for length in (40, 150, 200, 300):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        single = p.complete(prompt, TOKENS).token_ids
        before = _external(d)
        sent = prefill_leg(p, prompt)
        assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single, length
        assert _external(d) - before >= length - 1, length
        wait_idle(prefill, decode, timeout=10)
        (push,) = [
            e
            for e in prefill.journal_events(sent["kvpushd_transfer_id"])
            if isinstance(e, Registered)
        ]
        window, full = push.blocks
        # Every block of the prompt in the full-attention group; in the
        # sliding-window group only those its last token attends to.
        assert len(full) == -(-length // 32), (length, push.blocks)
        first_kept = max(0, length - WINDOW + 1) // 32
        assert len(window) == (length - 1) // 32 - first_kept + 1, (length, push.blocks)
        assert 0 not in window  # vLLM's null block is never moved
        events = decode.journal_events(sent["kvpushd_transfer_id"])
        assert any(isinstance(e, WriteDone) for e in events), events
    # Each daemon saw the two groups lie over one memory.
    for daemon in (prefill, decode):
        engines = replay(daemon.journal).registry.engines.values()
        assert [[g.overlays for g in e.groups] for e in engines] == [[-1, 0]], daemon.node


def test_a_prompt_whose_window_the_prefill_freed_is_computed_by_the_decode(hybrid: PD) -> None:
    """At 79 tokens the prefill keeps its window from token 32 on, a block start.

    The decode, which computes the last prompt token again, attends back to
    token 31: that block is gone on both sides (vLLM's null block stands in
    for it), so the decode computes the prompt itself, and the prefill's
    push ends at once.
    """
    p, d, prefill, decode = hybrid
    prompt = [(13 * i) % 509 + 2 for i in range(79)]
    single = p.complete(prompt, TOKENS).token_ids
    before = _external(d)
    sent = prefill_leg(p, prompt)
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    assert _external(d) == before
    wait_idle(prefill, decode, timeout=10)  # well before the push's 30 s deadline
    events = decode.journal_events(sent["kvpushd_transfer_id"])
    registered = [e for e in events if isinstance(e, Registered)]
    assert registered and all(not any(e.blocks) for e in registered), events
