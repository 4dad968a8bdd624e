"""A prefill instance serving other weights never hands its KV to a decode instance.

Measured before the fingerprint: a prefill on another checkpoint (same
architecture, another path) pushed its KV and the decode instance produced
wrong tokens for 8 of 8 prompts, its external-KV counter moving. Now the
prefill's ``kv_transfer_params`` carry its fingerprint; the decode
connector compares it with its own and computes the prompt itself (0
external tokens, so its tokens equal its own single-instance tokens), and
its zero-block receiver lets the prefill daemon refuse the pairing at once:
both journals name the field that differs (``model``), and both daemons end
idle.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from refusals import the_pairing_refusal

from daemon.sim.launcher import Daemon, wait_idle
from harness.tinyllama import TinyLlama, write_tinyllama
from harness.vllm_router import prefill_leg
from harness.vllm_servers import EXTERNAL_TOKENS, VllmServer, kvpushd_pd
from schemas.events import Failed, Trimmed, WriteStarted
from schemas.reasons import Reason

TOKENS = 8
PD = tuple[VllmServer, VllmServer, Daemon, Daemon]


@pytest.fixture(scope="module")
def other_weights_pd(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    other = write_tinyllama(tmp_path_factory.mktemp("other-weights"), TinyLlama(seed=1))
    with kvpushd_pd(tiny_model, tmp_path_factory.mktemp("pd-other"), prefill_model=other) as pd:
        yield pd


def test_the_decode_side_computes_the_prompt_when_the_prefill_serves_other_weights(
    other_weights_pd: PD,
) -> None:
    p, d, prefill, decode = other_weights_pd
    rng = random.Random(11)
    for length in (40, 96, 150):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        own = d.complete(prompt, TOKENS).token_ids
        # The oracle can tell: the two checkpoints answer differently.
        assert p.complete(prompt, TOKENS).token_ids != own, length
        sent = prefill_leg(p, prompt)
        assert sent["kvpushd_fingerprint"]["model"] == str(p.model)
        # The CPU kernels the block layout is for ("vec" on this machine's x86).
        assert sent["kvpushd_fingerprint"]["kv_layout"] == "cpu:auto:isa=vec", sent
        before = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
        assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == own, length
        loaded = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer") - before
        assert loaded == 0, (length, loaded)
        wait_idle(prefill, decode)
        transfer = sent["kvpushd_transfer_id"]
        p_events, d_events = prefill.journal_events(transfer), decode.journal_events(transfer)
        refused = the_pairing_refusal(p_events)
        assert refused.reason is Reason.FINGERPRINT_MISMATCH
        assert "field 'model' differs" in refused.message
        for events in (p_events, d_events):
            (failed,) = [e for e in events if isinstance(e, Failed)]
            assert failed.reason is Reason.FINGERPRINT_MISMATCH, events
            assert not [e for e in events if isinstance(e, Trimmed | WriteStarted)], events
            assert type(events[-1]).__name__ == "Released", events
    assert "fingerprint differs in model" in d.log.read_text(errors="replace")
    for server in (p, d):
        metrics = server.metrics()
        assert metrics.total("vllm:num_requests_running") == 0, server.name
        assert metrics.total("vllm:num_requests_waiting") == 0, server.name
