"""A hybrid model's failed loads leave vLLM serving (two KV cache groups).

vLLM's scheduler takes block-level load errors only for a model with one
KV cache group: for more it raises, and its engine core dies. The
connector reports every failed load as a failed receive
(``failed_recving``) instead. Each path that fails a load here killed the
decode instance before: a client abort during the load, the prefill daemon
killed with the load in flight, and a pairing the block hashes refuse. The
decode recomputes (``kv_load_failure_policy`` recompute), so every answer
equals a single instance's, and the next request is loaded, token-exact.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from daemon.sim.launcher import Daemon, wait_idle
from harness.tinyllama import TinyLlama, write_tinyllama
from harness.vllm_router import external_tokens, loads_token_exact, prefill_leg
from harness.vllm_servers import VllmServer, kvpushd_pd
from schemas.events import Failed, WriteStarted
from schemas.reasons import Reason

TOKENS = 8
WINDOW = 48

PD = tuple[VllmServer, VllmServer, Daemon, Daemon]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    model = write_tinyllama(
        tmp_path_factory.mktemp("hybrid-fail-llama"),
        TinyLlama(sliding_layers=(0,), sliding_window=WINDOW),
    )
    with kvpushd_pd(
        model,
        tmp_path_factory.mktemp("pd-hybrid-fail"),
        # Every push waits 1.5 s before it is posted: a load stays in flight.
        prefill_env={"KVPUSHD_FAILPOINTS": "nixl.post=sleep:1.5"},
        # The prefill instance's first push names its blocks one short.
        prefill_server_env={"KVPUSHD_FAILPOINTS": "connector.shift_push=corrupt@1"},
        kv_load_failure_policy="recompute",
    ) as pair:
        yield pair


def _loads_token_exact(p: VllmServer, d: VllmServer, rng: random.Random) -> None:
    """vLLM still serves, and a P/D request after the failure loads its KV token-exact."""
    loads_token_exact(p, d, [rng.randrange(2, 512) for _ in range(150)], TOKENS)


def test_a_refused_pairing_on_a_hybrid_model_is_recomputed_and_vllm_keeps_serving(
    hybrid: PD,
) -> None:
    p, d, prefill, decode = hybrid
    rng = random.Random(5)
    prompt = [rng.randrange(2, 512) for _ in range(150)]
    single = p.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt)  # the planted short push
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    wait_idle(prefill, decode, timeout=10)
    events = prefill.journal_events(sent["kvpushd_transfer_id"])
    (failed,) = [e for e in events if isinstance(e, Failed)]
    assert failed.reason is Reason.CONTENT_MISMATCH, failed
    assert not [e for e in events if isinstance(e, WriteStarted)]
    _loads_token_exact(p, d, rng)


def test_a_client_abort_during_a_hybrid_load_leaves_vllm_serving(hybrid: PD) -> None:
    p, d, prefill, decode = hybrid
    rng = random.Random(6)
    prompt = [rng.randrange(2, 512) for _ in range(150)]
    sent = prefill_leg(p, prompt)
    with pytest.raises(OSError):  # the client gives up (and disconnects) while the push waits
        d.complete(prompt, TOKENS, kv_transfer_params=sent, timeout_s=0.5)
    deadline = time.monotonic() + 30
    while decode.status()["live"] or prefill.status()["live"]:
        assert time.monotonic() < deadline, decode.status()["requests"]
        time.sleep(0.1)
    assert d.alive()
    _loads_token_exact(p, d, rng)


def test_the_prefill_daemon_killed_with_a_hybrid_load_in_flight_leaves_vllm_serving(
    hybrid: PD,
) -> None:
    p, d, prefill, decode = hybrid
    rng = random.Random(7)
    prompt = [rng.randrange(2, 512) for _ in range(150)]
    single = p.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt)
    transfer = sent["kvpushd_transfer_id"]
    with ThreadPoolExecutor(1) as pool:
        decoding = pool.submit(d.complete, prompt, TOKENS, kv_transfer_params=sent)
        deadline = time.monotonic() + 30
        while "WriteStarted" not in [type(e).__name__ for e in decode.journal_events(transfer)]:
            assert time.monotonic() < deadline and not decoding.done()
            time.sleep(0.02)
        prefill.kill()
        assert decoding.result().token_ids == single  # failed, recomputed
    prefill.start()
    deadline = time.monotonic() + 30
    while not prefill.status()["engines"] or prefill.status()["live"]:
        assert time.monotonic() < deadline, prefill.status()
        time.sleep(0.1)
    assert d.alive()
    _loads_token_exact(p, d, rng)


def test_a_prefill_leg_whose_window_moved_past_a_block_is_refused_not_written(
    hybrid: PD,
) -> None:
    """Found by the P/D fuzzer (seed 104, shape hybrid, case 22): refused, and said so.

    A prefill leg of 5 tokens at a 875-token prompt: while it generates, the
    48-token window of layer 0 moves past a block boundary and vLLM frees
    the block the window left, so the prefill no longer holds prompt block
    25, which the decode's window needs. The block hashes refuse the push
    before any write; the decode computes, token-exact. With a prefill leg
    of 1 token a prompt of that length loads.
    """
    p, d, prefill, decode = hybrid
    rng = random.Random(22)
    prompt = [rng.randrange(2, 512) for _ in range(875)]
    single = p.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt, max_tokens=5)
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    wait_idle(prefill, decode, timeout=10)
    events = prefill.journal_events(sent["kvpushd_transfer_id"])
    (failed,) = [e for e in events if isinstance(e, Failed)]
    assert failed.reason is Reason.CONTENT_MISMATCH, failed
    assert "has no prefill block to pair with" in failed.message, failed.message
    assert not [e for e in events if isinstance(e, WriteStarted)]
    # Another prompt of the same length (the decode's cache now holds this one).
    prompt = [rng.randrange(2, 512) for _ in range(875)]
    single = p.complete(prompt, TOKENS).token_ids
    before = external_tokens(d)
    sent = prefill_leg(p, prompt)
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    assert external_tokens(d) - before >= len(prompt) - 1
