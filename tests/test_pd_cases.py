"""The P/D fuzzer's generator (harness/pd_cases.py): reproducible, inside the model, fair.

The fuzzer itself runs on real vLLM (tests_vllm/test_pd_fuzz.py); these
pin what its cases are: the same seed draws the same run, every prompt
fits the context with room for both legs' tokens, a prefix hit never
covers the prompt's last token, the allowed outcomes follow the case, and
every shrunk variant is smaller than what it came from.
"""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from harness.pd_cases import (
    PREFILL_MAX_TOKENS,
    Dispatch,
    Model,
    Outcome,
    RouterFault,
    SystemFault,
    allowed,
    draw_run,
    find_case,
    shrink,
    tamper,
)

MODEL = Model(block_size=32, max_model_len=1024, vocab_size=512)
# The seed and size `make test` runs (tests_vllm/test_pd_fuzz.py).
CI_SEED, CI_CASES = 4518, 40


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cases=st.integers(1, 120))
def test_a_seed_draws_the_same_run_and_exactly_the_cases_asked_for(seed: int, cases: int) -> None:
    first, again = draw_run(seed, cases, MODEL), draw_run(seed, cases, MODEL)
    assert first == again
    indices = [c.index for b in first for c in b.cases]
    assert indices == list(range(cases))
    assert all(1 <= len(b.cases) <= 24 for b in first)
    for index in (0, cases - 1):
        batch, case = find_case(first, index)
        assert case in batch.cases and case.index == index


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_every_case_fits_the_context_and_its_prefix_hit_leaves_the_last_token(seed: int) -> None:
    for batch in draw_run(seed, 30, MODEL):
        for case in batch.cases:
            longest = case.prompt_len + max(case.decode_max_tokens, max(PREFILL_MAX_TOKENS))
            assert case.prompt_len >= 1 and longest < MODEL.max_model_len, case
            assert case.prefix_blocks * MODEL.block_size <= case.prompt_len - 1, case
            assert case.prefill_min_tokens <= case.prefill_max_tokens
            prompt = case.prompt(MODEL.vocab_size)
            assert len(prompt) == case.prompt_len and min(prompt) >= 2
            assert max(prompt) < MODEL.vocab_size
            differs = case.decode_prompt(MODEL.vocab_size)
            changed = sum(a != b for a, b in zip(prompt, differs, strict=True))
            assert changed == (1 if case.fault is RouterFault.PROMPT_DIFFERS else 0), case


def test_the_ci_run_draws_every_router_fault_system_fault_dispatch_and_length_kind() -> None:
    """What `make test`'s 40 cases cover: a change of the generator that loses a kind fails here."""
    batches = draw_run(CI_SEED, CI_CASES, MODEL)
    cases = [c for b in batches for c in b.cases]
    assert {c.fault for c in cases} == set(RouterFault)
    assert {b.system for b in batches} == set(SystemFault)
    assert {c.dispatch for c in cases} == set(Dispatch)
    assert {c.prefill_max_tokens for c in cases} == set(PREFILL_MAX_TOKENS)
    edges = {c.prompt_len % MODEL.block_size for c in cases}
    assert {MODEL.block_size - 1, 0, 1} <= edges
    assert any(c.prefix_blocks for c in cases)
    assert any(len(b.cases) == 1 for b in batches) and any(len(b.cases) > 8 for b in batches)
    assert any(c.prefill_fields() for c in cases)


def test_remote_kv_is_required_only_of_a_clean_case_with_tokens_to_load() -> None:
    (batch, *_) = draw_run(3, 30, MODEL)
    case = dataclasses.replace(
        batch.cases[0],
        fault=RouterFault.NONE,
        prompt_len=100,
        prefix_blocks=0,
        prefill_n=1,
        prefill_max_tokens=1,
    )
    quiet = dataclasses.replace(batch, system=SystemFault.NONE, small_pool=False)
    assert allowed(case, quiet, MODEL) == {Outcome.REMOTE}
    # vLLM computes the last token itself: 97 tokens with 3 blocks hit leave none to load.
    hit_all = dataclasses.replace(case, prompt_len=97, prefix_blocks=3)
    assert allowed(hit_all, quiet, MODEL) == {Outcome.REMOTE, Outcome.LOCAL}
    for fault in set(RouterFault) - {RouterFault.NONE}:
        faulty = dataclasses.replace(case, fault=fault)
        assert Outcome.LOCAL in allowed(faulty, quiet, MODEL), fault
        assert Outcome.WRONG not in allowed(faulty, quiet, MODEL)
    assert Outcome.ABORTED in allowed(
        dataclasses.replace(case, fault=RouterFault.ABORT_DECODE_MID), quiet, MODEL
    )
    # A sliding window moves while a prefill leg of 5 tokens generates (fuzz seed 104).
    windowed = dataclasses.replace(MODEL, sliding_window=48)
    assert allowed(case, quiet, windowed) == {Outcome.REMOTE}
    five = dataclasses.replace(case, prefill_max_tokens=5)
    assert Outcome.LOCAL in allowed(five, quiet, windowed)
    # A prefill leg of one token whose window's first kept token starts a
    # block: vLLM freed the block the decode's recomputed token attends to
    # (fuzz seed 20261207, case 39, shrunk: 367 - 48 + 1 = 320 = 10 x 32).
    gap = dataclasses.replace(case, prompt_len=367)
    assert allowed(gap, quiet, windowed) == {Outcome.REMOTE, Outcome.LOCAL}
    for length in (366, 368, 351):  # the neighbours must load
        assert allowed(dataclasses.replace(gap, prompt_len=length), quiet, windowed) == {
            Outcome.REMOTE
        }, length
    for system in set(SystemFault) - {SystemFault.NONE}:
        assert Outcome.LOCAL in allowed(case, dataclasses.replace(quiet, system=system), MODEL)
    assert Outcome.LOCAL in allowed(case, dataclasses.replace(quiet, small_pool=True), MODEL)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_every_shrunk_variant_runs_alone_and_is_no_larger(seed: int) -> None:
    batch = max(draw_run(seed, 40, MODEL), key=lambda b: len(b.cases))
    case = batch.cases[-1]
    for smaller, alone in shrink(case, batch, MODEL):
        assert alone.cases == (smaller,)
        assert smaller.prompt_len <= case.prompt_len
        assert smaller.prefix_blocks * MODEL.block_size <= smaller.prompt_len - 1
        assert alone.system in (batch.system, SystemFault.NONE)
        assert smaller.index == case.index


# What each dispatch hands the decode leg: the prefill's answer, or vLLM's
# push-mode fields (as harness/pd_fuzz.py sends them).
def _answer_params() -> dict[str, object]:
    from daemon.client.vllm.params import PARAMS_VERSION, PrefillAnswer
    from schemas.fingerprint import Fingerprint

    fingerprint = Fingerprint("m", num_layers=2, num_kv_heads=2)
    return PrefillAnswer(PARAMS_VERSION, "T", "p", "h:1", fingerprint, 1, 1, 7, "d").to_params()


DISPATCH_PARAMS = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "remote_engine_id": "prefill",
    "remote_host": "127.0.0.1",
    "remote_port": 9000,
    "tp_size": 1,
    "pp_size": 1,
    "remote_request_id": "r",
    "transfer_id": "xfer-r",
}


@given(st.integers(0, 10_000), st.booleans())
def test_a_tamper_the_fuzzer_says_must_be_refused_is_refused_by_the_connector(
    at: int, dispatched: bool
) -> None:
    """The fuzzer's rule (no load may come of it) agrees with what the connector reads.

    Without vLLM: the connector's params module (pure) reads the tampered
    leg as the scheduler does; a leg it reads is one it may load.
    """
    from daemon.client.vllm.params import adopt_dispatch, read_leg

    params = dict(DISPATCH_PARAMS) if dispatched else _answer_params()
    changed, key, refused = tamper(params, at)
    assert key in params and changed != params
    assert tamper(params, at) == (changed, key, refused)  # the same case, the same tamper
    wants_load = bool(changed.get("do_remote_prefill"))
    if dispatched and wants_load:
        # The scheduler adopts a leg that names a transfer; none named, nothing loads.
        readable = "transfer_id" in changed and adopt_dispatch(changed) is None
    else:
        readable = wants_load and not isinstance(read_leg(changed), str)
    assert readable is not refused, (key, changed)
