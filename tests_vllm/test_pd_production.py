"""A production layout through kvpushd: data-parallel engines, an fp8 KV cache, a draft model.

The pair is what DeepSeek-style serving runs, scaled down: each side is two
data-parallel engines (``--data-parallel-size 2``: one API server, two
engine cores, each an instance of its own to its daemon), the KV cache is
fp8 (``--kv-cache-dtype fp8``, one byte per element: vLLM's uint8 storage)
where the CPU can hold one, and both sides speculate with a draft model
(``method: draft_model``) whose weights are the target's own: vLLM caches
the draft's KV in the same KV cache group, so it moves with the target's,
and a draft that reads the right KV proposes exactly what the target then
computes. The router picks each leg's engine with vLLM's
``X-data-parallel-rank`` header, so every (prefill engine, decode engine)
combination is driven, not left to the balancer.

fp8's scales: vLLM's CPU fp8 cache stores the values with the layer's
``k_scale``/``v_scale``, which come from the checkpoint (1.0 here), not from
the cache; both sides load the same weights (the fingerprint names the
model and the KV dtype), so the bytes mean the same on both, and the tokens
below prove it. The fingerprint names the draft (method, model, tokens):
a decode drafting with another model does not pair. (The n-gram proposer,
which keeps no KV, is left out of it: tests/test_vllm_layout.py.)

vLLM's CPU build stores an fp8 cache only on x86 with AVX-512 or AMX
(``cpu_attn._get_attn_isa`` refuses it at start-up elsewhere, and CI's
machines may lack both): there the pair runs the model's own dtype
(float32) and every test below runs the same, with its element size.

The oracle is the prefill instance asked without transfer parameters (the
same weights, the same KV dtype, the same speculative settings): a single
instance. The first transfer of the module is a planted misplacement (the
prefill daemon writes its first blocks in place of the trimmed tail,
``integrity.shift_src``; integrity checks off so that it lands), and it must
change the tokens: the KV carries the context.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.journal.replay import replay
from daemon.sim.launcher import Daemon, wait_idle
from harness.tinyllama import TinyLlama, write_tinyllama
from harness.vllm_servers import VllmServer, kvpushd_pd
from schemas.events import WriteDone, WriteStarted

TOKENS = 12
BLOCK = 32
EXTERNAL = "vllm:prompt_tokens_by_source_total"
DRAFTED = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFT_TOKENS = 3


def _fp8_cache_runs_here() -> bool:
    """Whether vLLM's CPU attention can store an fp8 KV cache on this CPU."""
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


# (--kv-cache-dtype, the fingerprint's kv_cache_dtype, bytes per element)
KV_DTYPE, KV_BYTES = ("fp8", 1) if _fp8_cache_runs_here() else ("auto", 4)


def _args(draft: Path) -> tuple[str, ...]:
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": DRAFT_TOKENS}
    return ("--kv-cache-dtype", KV_DTYPE, "--speculative-config", json.dumps(spec))


# The planted misplacement must land to show that the tokens see it.
NO_CHECKS = '[integrity]\nverify = "off"'

PD = tuple[VllmServer, VllmServer, Daemon, Daemon]


@pytest.fixture(scope="module")
def production(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    model = write_tinyllama(tmp_path_factory.mktemp("production-llama"))
    with kvpushd_pd(
        model,
        tmp_path_factory.mktemp("pd-production"),
        prefill_dp=2,
        decode_dp=2,
        prefill_args=_args(model),
        decode_args=_args(model),
        prefill_env={"KVPUSHD_FAILPOINTS": "integrity.shift_src=corrupt@1"},
        prefill_daemon_extra=NO_CHECKS,
        decode_daemon_extra=NO_CHECKS,
        # Every check off, the decode's own K/V check too: the control's wrong
        # block must reach the oracle (tests_vllm/test_pd_drift.py and
        # test_pd_mla.py pin that the check catches such a write).
        decode_extra_config={"kv_check": False},
    ) as pair:
        yield pair


def _external(d: VllmServer, engine: int | None = None) -> float:
    labels = {"source": "external_kv_transfer"}
    if engine is not None:
        labels["engine"] = str(engine)
    return d.metrics().total(EXTERNAL, **labels)


def _pd(
    p: VllmServer, d: VllmServer, prompt: list[int], prefill_rank: int, decode_rank: int
) -> tuple[list[int], dict[str, object]]:
    """One request: its prefill leg on engine ``prefill_rank``, its decode leg on ``decode_rank``.

    (The engines are DP ranks, picked with vLLM's ``X-data-parallel-rank`` header.)
    """
    leg = p.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True}, dp_rank=prefill_rank)
    sent = dict(leg.raw["kv_transfer_params"])
    answer = d.complete(prompt, TOKENS, kv_transfer_params=sent, dp_rank=decode_rank)
    return answer.token_ids, sent


def test_a_misplaced_write_changes_the_tokens(production: PD) -> None:
    """The control (this module's first push): the oracle sees a wrong block."""
    p, d, prefill, decode = production
    rng = random.Random(3)
    prompt = [rng.randrange(2, 512) for _ in range(200)]
    # The decode engine holds the prompt's first 4 blocks already: the push
    # is trimmed to its tail, which the failpoint replaces by its head.
    d.complete([*prompt[: 4 * BLOCK], 7, 7, 7], 1, dp_rank=1)
    single = p.complete(prompt, TOKENS).token_ids
    got, sent = _pd(p, d, prompt, 0, 1)
    assert got != single
    wait_idle(prefill, decode, timeout=10)
    assert any(
        isinstance(e, WriteDone) for e in decode.journal_events(str(sent["kvpushd_transfer_id"]))
    )


def test_every_prefill_engine_feeds_every_decode_engine_token_exact(production: PD) -> None:
    p, d, prefill, decode = production
    rng = random.Random(11)
    before = [_external(d, engine) for engine in (0, 1)]
    lengths = (BLOCK - 1, BLOCK, BLOCK + 1, 100, 4 * BLOCK, 300)
    for (a, b), length in itertools.product(itertools.product((0, 1), (0, 1)), lengths):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        single = p.complete(prompt, TOKENS).token_ids
        got, sent = _pd(p, d, prompt, a, b)
        assert got == single, (a, b, length, sent)
    wait_idle(prefill, decode, timeout=10)
    # Each decode engine loaded remote KV for its own requests.
    after = [_external(d, engine) for engine in (0, 1)]
    for engine in (0, 1):
        loaded = after[engine] - before[engine]
        assert loaded >= 2 * sum(n - 1 for n in lengths), (engine, before, after)
    # Each side's two DP engines are two engines to its daemon, both with the KV dtype.
    for daemon in (prefill, decode):
        engines = replay(daemon.journal).registry.engines.values()
        assert len(engines) == 2, daemon.node
        dtypes = {e.fingerprint.kv_cache_dtype for e in engines if e.fingerprint is not None}
        assert dtypes == {KV_DTYPE}, (daemon.node, dtypes)


def test_the_draft_models_kv_moves_with_the_targets_and_its_drafts_are_accepted(
    production: PD,
) -> None:
    """Every block carries the draft's layers beside the target's; the drafts read them."""
    p, d, prefill, decode = production
    rng = random.Random(12)
    model = TinyLlama()
    # K and V of the target's layers and the draft's (the same model), KV_BYTES per element.
    layer_block = model.num_key_value_heads * BLOCK * 2 * model.head_dim * KV_BYTES
    for length in (65, 160, 257):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        alone = p.metrics().total(ACCEPTED)
        single = p.complete(prompt, TOKENS).token_ids
        alone = p.metrics().total(ACCEPTED) - alone
        accepted, drafted = d.metrics().total(ACCEPTED), d.metrics().total(DRAFTED)
        got, sent = _pd(p, d, prompt, length % 2, (length // 2) % 2)
        assert got == single, length
        accepted = d.metrics().total(ACCEPTED) - accepted
        drafted = d.metrics().total(DRAFTED) - drafted
        # The decode's drafts after the load are accepted as on the single
        # instance (its first step recomputes the last prompt token and
        # drafts once more than a prefill that answered a token itself).
        assert alone > 0 and accepted == alone, (length, alone, accepted, drafted)
        assert drafted <= alone + DRAFT_TOKENS, (length, alone, drafted)
        wait_idle(prefill, decode, timeout=10)
        (started,) = [
            e
            for e in prefill.journal_events(str(sent["kvpushd_transfer_id"]))
            if isinstance(e, WriteStarted)
        ]
        per_block = started.nbytes // started.num_blocks
        assert per_block == 2 * model.num_hidden_layers * layer_block, (length, started)
