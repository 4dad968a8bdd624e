"""Real vLLM P/D with tensor-parallel ranks through kvpushd.

Measured before: a TP 2 prefill and a TP 2 decode failed every request
(each rank registered the same transfer id; the pairs that formed were one
rank's heads into another rank's blocks). Now each rank's worker is its own
engine and pushes its share of a transfer under its own name
(``T@tp<rank>``) to the decode rank of the same index, which holds the same
KV heads; vLLM finishes a load only when every rank reported it.

The oracle: the decode instance's greedy tokens equal a single instance's
(the TP 2 prefill instance asked without transfer parameters: same weights,
same TP), the external-KV counter moved, and both journals show every rank's
pair written. Instances of different TP sizes never pair (their fingerprints
differ in ``tp_size``): the decode side computes the prompt itself, and both
daemons end every rank's share at once.

Every rank of an instance runs on that instance's one core (the CPU build
runs TP over gloo with a shared-memory all-reduce).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.cli import main
from daemon.sim.launcher import Daemon, free_port, wait_idle
from daemon.sim.vllm_router import prefill_leg
from daemon.sim.vllm_servers import (
    EXTERNAL_TOKENS,
    VllmServer,
    kvpushd_connector_config,
    kvpushd_pd,
    remove_vllm_shm_segments,
    running,
    vllm_shm_segments,
)
from schemas.events import Failed, Refused, Registered, Released, Trimmed, WriteDone
from schemas.reasons import Reason

TOKENS = 8
PD = tuple[VllmServer, VllmServer, Daemon, Daemon]


@pytest.fixture(scope="module")
def tp2_pd(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    with kvpushd_pd(tiny_model, tmp_path_factory.mktemp("pd-tp2"), prefill_tp=2, decode_tp=2) as pd:
        yield pd


def test_tp2_to_tp2_is_token_exact_and_every_rank_pair_is_written(tp2_pd: PD, capsys) -> None:
    p, d, prefill, decode = tp2_pd
    rng = random.Random(21)
    for length in (40, 96, 200):
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        single = p.complete(prompt, TOKENS).token_ids
        sent = prefill_leg(p, prompt)
        assert sent["kvpushd_fingerprint"]["tp_size"] == 2
        before = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
        assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single, length
        loaded = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer") - before
        assert loaded >= length - 1, (length, loaded)
        wait_idle(prefill, decode)
        transfer = sent["kvpushd_transfer_id"]
        for daemon in (prefill, decode):
            for rank in (0, 1):
                kinds = [type(e) for e in daemon.journal_events(f"{transfer}@tp{rank}")]
                assert WriteDone in kinds and kinds[-1] is Released, (daemon.node, rank, kinds)
            # The bare transfer id names no request: only the ranks' shares do.
            assert daemon.journal_events(transfer) == []
        # The postmortem asked about the transfer shows every rank's share, both sides.
        capsys.readouterr()
        journals = [str(prefill.journal), str(decode.journal)]
        assert main(["journal", "timeline", *journals, "--request", transfer]) == 0
        shown = capsys.readouterr().out
        assert f"{transfer}@tp0" in shown and f"{transfer}@tp1" in shown, shown
    for daemon in (prefill, decode):
        engines = daemon.status()["engines"]
        assert sorted(e.rsplit("-", 1)[-1] for e in engines) == ["tp0", "tp1"], engines
        assert {e["fingerprint"]["tp_size"] for e in engines.values()} == {2}
    for server in (p, d):
        metrics = server.metrics()
        assert metrics.total("vllm:num_requests_running") == 0, server.name
        assert metrics.total("vllm:num_requests_waiting") == 0, server.name


def test_tp2_decode_prefix_hit_moves_only_the_tail_blocks_on_every_rank(tp2_pd: PD) -> None:
    p, d, prefill, decode = tp2_pd
    rng = random.Random(22)
    shared = [rng.randrange(2, 512) for _ in range(64)]
    d.complete([*shared, *(rng.randrange(2, 512) for _ in range(10))], 1)  # caches 2 blocks
    prompt = [*shared, *(rng.randrange(2, 512) for _ in range(40))]  # 104 tokens: 4 blocks
    single = p.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt)
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    wait_idle(prefill, decode)
    for rank in (0, 1):
        share = f"{sent['kvpushd_transfer_id']}@tp{rank}"
        (registered,) = [e for e in decode.journal_events(share) if isinstance(e, Registered)]
        (trimmed,) = [e for e in prefill.journal_events(share) if isinstance(e, Trimmed)]
        assert [len(ids) for ids in registered.blocks] == [2], rank
        assert (trimmed.src_before, trimmed.dst_before) == ((4,), (2,)), rank
        assert trimmed.dst == registered.blocks


# ---------------------------------------------------- different TP sizes


@pytest.fixture(scope="module")
def tp2_and_tp1(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[tuple[VllmServer, Daemon], tuple[VllmServer, Daemon]]]:
    """A TP 2 and a TP 1 instance, each kv_both beside its own daemon: either may prefill."""
    workdir = tmp_path_factory.mktemp("pd-tp-mixed")
    cores = sorted(os.sched_getaffinity(0))
    daemons = [Daemon(name, workdir, free_port()).start() for name in ("two", "one")]
    servers = [
        VllmServer(
            name.upper(),
            tiny_model,
            workdir,
            core=core,
            tp=tp,
            extra_args=["--kv-transfer-config", kvpushd_connector_config("kv_both", daemon)],
        )
        for name, core, tp, daemon in zip(
            ("two", "one"), (cores[0], cores[-1]), (2, 1), daemons, strict=True
        )
    ]
    shm_before = vllm_shm_segments()
    try:
        with running(*servers):
            yield (servers[0], daemons[0]), (servers[1], daemons[1])
    finally:
        remove_vllm_shm_segments(vllm_shm_segments() - shm_before)
        assert [daemon.stop() for daemon in daemons] == [0, 0]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_instances_of_different_tp_never_pair_and_the_decode_computes_the_prompt(
    tp2_and_tp1, prefill_tp: int, decode_tp: int
) -> None:
    by_tp = {2: tp2_and_tp1[0], 1: tp2_and_tp1[1]}
    (p, prefill), (d, decode) = by_tp[prefill_tp], by_tp[decode_tp]
    rng = random.Random(23 + prefill_tp)
    prompt = [rng.randrange(2, 512) for _ in range(96)]
    single = d.complete(prompt, TOKENS).token_ids
    sent = prefill_leg(p, prompt)
    before = d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer")
    assert d.complete(prompt, TOKENS, kv_transfer_params=sent).token_ids == single
    assert d.metrics().total(EXTERNAL_TOKENS, source="external_kv_transfer") == before
    # Every prefill rank's share ends at once (well before its 30 s deadline).
    wait_idle(prefill, decode, timeout=10)
    transfer = sent["kvpushd_transfer_id"]
    shares = [transfer] if prefill_tp == 1 else [f"{transfer}@tp{r}" for r in range(prefill_tp)]
    for share in shares:
        events = prefill.journal_events(share)
        (refused,) = [e for e in events if isinstance(e, Refused)]
        assert refused.reason is Reason.FINGERPRINT_MISMATCH, events
        assert "field 'tp_size' differs" in refused.message
        (failed,) = [e for e in decode.journal_events(share) if isinstance(e, Failed)]
        assert failed.reason is Reason.FINGERPRINT_MISMATCH
