"""Two instances that drifted apart where no field looks: never a wrong token.

A rolling upgrade rewrites a fine-tune's checkpoint in place: the prefill
started on the old weights, the folder then got other weights (same config,
names and sizes), and the decode started on them. The model path, the config
and every layout field agree. The weights digest each engine registers
refuses such a pairing up front (tests/test_vllm_identity.py), so this pair
runs with ``identity = false``, the test switch that leaves the behavioural
check alone, as it is left alone for every drift no field names. Before it
the decode served wrong tokens for every loaded prompt. Now the decode's own
K/V of the prompt's last token (it computes that token itself, over the
pushed one) differs from the prefill's far beyond kernel rounding: the
step's output is dropped, vLLM recomputes the prompt
(``kv_load_failure_policy=recompute``), and the client gets the decode's own
tokens. Both journals hold ``kv_mismatch``; the prefill daemon quarantines
the pairing, so the next request of it is refused before a byte moves
(computed locally, no forward at risk) until an operator clears it.

A LoRA adapter rewritten in place (same name, same path, other weights on
the decode) is the same drift for an adapter: vLLM keys an adapter's blocks
by its name and path only, so before it served wrong tokens for every
loaded prompt. The adapter's content, as each instance first read it, is in
the block hashes: the pairing is refused before a byte moves, and both
logs name the content mismatch.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from daemon.sim.launcher import Daemon, wait_idle
from harness.tinyllama import LORA_RANK, TinyLlama, write_lora, write_tinyllama
from harness.vllm_router import prefill_leg
from harness.vllm_servers import VllmServer, kvpushd_pd
from schemas.events import Failed, KvMismatch, WriteStarted
from schemas.reasons import Reason

TOKENS = 8
PD = tuple[VllmServer, VllmServer, Daemon, Daemon]
CHECKS = "vllm:kvpushd_kv_checks_total"
BEHAVIOUR_ALONE = {"identity": False}


@pytest.fixture(scope="module")
def rewritten_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    """A rolling upgrade between the legs' starts: the checkpoint and the adapter, in place."""
    folder = write_tinyllama(tmp_path_factory.mktemp("rolling"))
    adapter = write_lora(tmp_path_factory.mktemp("adapter"), seed=0)
    lora = ["--enable-lora", "--max-lora-rank", str(LORA_RANK), "--lora-modules", f"a={adapter}"]

    def upgrade_in_place(p: VllmServer) -> None:
        # vLLM loads an adapter on its first use: the prefill holds the old one.
        p.complete([5, 6, 7], 1, model="a")
        write_tinyllama(folder, TinyLlama(seed=1))
        write_lora(adapter, seed=1)

    with kvpushd_pd(
        folder,
        tmp_path_factory.mktemp("pd-rolling"),
        prefill_args=lora,
        decode_args=lora,
        between_starts=upgrade_in_place,
        kv_load_failure_policy="recompute",
        # The test switch: no weights or rope digest up front (which
        # would refuse this pairing naming 'weights'), the behavioural check
        # alone. The adapter's content key stays: it is in the block hashes.
        prefill_extra_config=BEHAVIOUR_ALONE,
        decode_extra_config=BEHAVIOUR_ALONE,
    ) as pd:
        yield pd


def _checks(server: VllmServer, result: str) -> float:
    return server.metrics().total(CHECKS, result=result)


def test_a_lora_adapter_rewritten_in_place_is_refused_before_any_write(rewritten_pd: PD) -> None:
    # First in the module: the checkpoint test below quarantines the pairing.
    p, d, prefill, decode = rewritten_pd
    rng = random.Random(49)
    for length in (70, 130):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        own = d.complete(prompt, TOKENS, model="a").token_ids
        # The oracle can tell: the two instances' adapters (and bases) differ.
        assert p.complete(prompt, TOKENS, model="a").token_ids != own
        answer = p.complete(prompt, 1, model="a", kv_transfer_params={"do_remote_decode": True})
        sent = dict(answer.raw["kv_transfer_params"])
        served = d.complete(prompt, TOKENS, model="a", kv_transfer_params=sent).token_ids
        assert served == own, length
        wait_idle(prefill, decode)
        events = prefill.journal_events(sent["kvpushd_transfer_id"])
        # The adapter's content in the block hashes refuses it before any write.
        assert not [e for e in events if isinstance(e, WriteStarted)], events
        (failed,) = [e for e in events if isinstance(e, Failed)]
        assert failed.reason is Reason.CONTENT_MISMATCH, events
    for server in (p, d):  # both instances' logs name why
        assert "content_mismatch" in server.log.read_text(errors="replace"), server.name


def test_a_checkpoint_rewritten_in_place_between_the_legs_starts_serves_no_wrong_token(
    rewritten_pd: PD,
) -> None:
    p, d, prefill, decode = rewritten_pd
    rng = random.Random(47)
    prompt = [rng.randrange(2, 512) for _ in range(100)]
    own = d.complete(prompt, TOKENS).token_ids
    # The oracle can tell: the two instances hold other weights.
    assert p.complete(prompt, TOKENS).token_ids != own
    sent = prefill_leg(p, prompt)
    # Nothing the fingerprint names differs: the same path, config and layout.
    assert sent["kvpushd_fingerprint"]["model"] == str(d.model)
    mismatches = _checks(d, "kv_mismatch")
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == own
    assert _checks(d, "kv_mismatch") == mismatches + 1
    wait_idle(prefill, decode)
    transfer = sent["kvpushd_transfer_id"]
    for daemon in (prefill, decode):
        records = [e for e in daemon.journal_events(transfer) if isinstance(e, KvMismatch)]
        assert len(records) == 1, (daemon.node, daemon.journal_events(transfer))
        (record,) = records
        assert record.difference > record.tolerance, record
    log = d.log.read_text(errors="replace")
    assert "kv_mismatch: the KV pushed by prefill" in log
    assert prefill.node in log


def test_a_quarantined_pairing_is_computed_without_a_forward_at_risk(rewritten_pd: PD) -> None:
    p, d, prefill, decode = rewritten_pd
    rng = random.Random(48)
    checked = _checks(d, "kv_mismatch") + _checks(d, "agree")
    for length in (40, 150):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        own = d.complete(prompt, TOKENS).token_ids
        sent = prefill_leg(p, prompt)
        assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == own, length
        wait_idle(prefill, decode)
        for daemon in (prefill, decode):
            (failed,) = [
                e
                for e in daemon.journal_events(sent["kvpushd_transfer_id"])
                if isinstance(e, Failed)
            ]
            assert failed.reason is Reason.QUARANTINED, daemon.node
    # Refused at the pairing: nothing loaded, so nothing left to check.
    assert _checks(d, "kv_mismatch") + _checks(d, "agree") == checked
    for server in (p, d):  # both instances' logs name why
        assert "quarantined" in server.log.read_text(errors="replace"), server.name
